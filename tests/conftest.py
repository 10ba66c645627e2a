import json
import os

import pytest

from project import GPT_6_7B_A100

# The suite means the CPU: real megatron-core models over gloo in several processes, and checks of
# the CPU redirection. On a machine with GPUs it still runs on the CPU (every process it starts
# inherits this), unless DYNAPIPE_TEST_CUDA=1 asks to see the GPUs. Set before torch is imported.
if os.environ.get("DYNAPIPE_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""



#: fixtures that measure a profile in the session (a minute or more on 2 cores): whatever needs
#: one is in the slow tier, so that `pytest -m "not slow"` stays quick
MEASURED_PROFILES = ("tiny_profile", "tiny_sdpa_profile")


def pytest_collection_modifyitems(items):
    for item in items:
        if set(MEASURED_PROFILES) & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


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
    that stored activations follow the dropout-free formulas), made in this process as
    ``megatron-dynapipe profile --model tiny --tp 1 2 --max-seq-length 128 --max-tokens 256 --repeats 1
    --warmup 0 --min-time-ms 0`` makes it, without refinement: its path and content. One run a
    point and no lengths added on a probe's word: its shape is the grid's whatever the machine's
    speed, and it takes a quarter of the time (no test here reads what a time is)."""
    return _profile_tiny(tmp_path_factory, "local", (1, 2))


@pytest.fixture(scope="session")
def tiny_sdpa_profile(tmp_path_factory):
    """The tiny GPT with ``--attention sdpa`` (the attention core that runs packed micro-batches)
    profiled at tp 1 as :func:`tiny_profile` is: its path and content."""
    return _profile_tiny(tmp_path_factory, "sdpa", (1,))


def _profile_tiny(tmp_path_factory, attention: str, tp_sizes: tuple) -> tuple:
    from types import SimpleNamespace

    import torch

    from megatron_dynapipe.config.model_flags import model_from_args
    from megatron_dynapipe.profiling.profiler import ProfileSettings, profile_model

    out = tmp_path_factory.mktemp("profile") / f"tiny-{attention}.json"
    # as the CLI reads the flags
    spec = model_from_args(SimpleNamespace(model="tiny", hidden_dropout=0.0, attention_dropout=0.0, attention=attention))
    settings = ProfileSettings(tp_sizes=tp_sizes, max_seq_length=128, max_tokens=256, repeats=1, warmup=0,
                               min_time_ms=0.0, max_refinements=0)
    # as measured, however busy the machine: the tests that use it check other things than noise
    profile_model(spec, out, settings, device=torch.device("cpu"), allow_noisy=True)
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
