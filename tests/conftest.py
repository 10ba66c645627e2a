import os
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


def pytest_report_header(config):
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    return ("devices: CPU only (CUDA_VISIBLE_DEVICES=''; DYNAPIPE_TEST_CUDA=1 shows the GPUs)" if shown == ""
            else f"devices: CUDA_VISIBLE_DEVICES={shown!r}")
