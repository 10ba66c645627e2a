import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The suite means the CPU: real megatron-core models over gloo in several processes, and checks of
# the CPU redirection. On a machine with GPUs it still runs on the CPU (every process it starts
# inherits this), unless DYNAPIPE_TEST_CUDA=1 asks to see the GPUs. Set before torch is imported.
if os.environ.get("DYNAPIPE_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

ROOT = Path(__file__).resolve().parents[1]
# The profile shipped inside the package: every test that plans on it runs on a fresh clone.
GPT_6_7B_A100 = ROOT / "megatron_dynapipe" / "planning" / "profiles" / "gpt-6.7b-a100.json"


@pytest.fixture(scope="session")
def profiled_model():
    from megatron_dynapipe.planning.cost_model import ProfiledCostModel

    return ProfiledCostModel.from_json(GPT_6_7B_A100, tp=1)


@pytest.fixture(scope="session")
def costs_pp4(profiled_model):
    from megatron_dynapipe.planning.cost_model import StageCosts

    return StageCosts(profiled_model, num_layers=32, pp=4)


@pytest.fixture(scope="session")
def tiny_profile(tmp_path_factory):
    """A profile of the tiny GPT on this CPU (tp 1 and 2, lengths up to 128), without dropout (so
    that stored activations follow the dropout-free formulas): its path and content."""
    out = tmp_path_factory.mktemp("profile") / "tiny.json"
    run = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "profile", "--no-progress", "--model", "tiny",
                          "--tp", "1", "2", "--max-seq-length", "128", "--max-tokens", "256", "--repeats", "1",
                          "--warmup", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return out, json.loads(out.read_text())


@pytest.fixture(scope="session")
def tiny_traces(tmp_path_factory):
    """Shapes-only traces of the tiny GPT (tests/tiny_traces.py): config folder by layout line.
    Tests change only what they load from them, never the trace files."""
    from tiny_traces import trace_tiny

    return trace_tiny(tmp_path_factory.mktemp("tiny_traces"))


def pytest_report_header(config):
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    return ("devices: CPU only (CUDA_VISIBLE_DEVICES=''; DYNAPIPE_TEST_CUDA=1 shows the GPUs)" if shown == ""
            else f"devices: CUDA_VISIBLE_DEVICES={shown!r}")
