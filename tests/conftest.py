from pathlib import Path

import pytest

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
