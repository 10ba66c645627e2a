from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPT_6_7B_A100 = ROOT.parent / "shared" / "cost_models" / "gpt-6.7b-a100.json"


@pytest.fixture(scope="session")
def profiled_model():
    from megatron_dynapipe.planning.cost_model import ProfiledCostModel

    if not GPT_6_7B_A100.is_file():
        pytest.skip(f"reference cost model {GPT_6_7B_A100} is not beside the project checkout")
    return ProfiledCostModel.from_json(GPT_6_7B_A100, tp=1)


@pytest.fixture(scope="session")
def costs_pp4(profiled_model):
    from megatron_dynapipe.planning.cost_model import StageCosts

    return StageCosts(profiled_model, num_layers=32, pp=4)
