"""A layout priced on a device (hardware.pricing.Pricing): what plan, bench planner and a
Megatron-LM job on --dynapipe-hardware plan with."""

import pytest

from megatron_dynapipe.config.model import get_model
from megatron_dynapipe.hardware import load_hardware
from megatron_dynapipe.hardware.pricing import Pricing
from megatron_dynapipe.planning.cost_model.link import Link
from megatron_dynapipe.planning.spec import TrainingSpec
from megatron_dynapipe.planning.types import RecomputeType

GPT = get_model("6.7B")  # 32 layers


def _spec(tp: int, dp: int = 1, cp: int = 1) -> TrainingSpec:
    return TrainingSpec(num_layers=GPT.num_layers, pp=2, tp=tp, dp=dp, cp=cp)


@pytest.mark.parametrize("tp, dp, cp, link", [
    (2, 1, 1, Link(360.0, 4.0)),  # the next stage is 2 GPUs on, on the same 8-GPU node: NVLink
    (2, 2, 2, Link(40.0, 8.0)),  # 2 x 2 x 2 = 8 GPUs on: the next node, over InfiniBand
    (8, 1, 1, Link(40.0, 8.0)),
])
def test_stages_send_over_the_link_between_the_gpus_they_are_on(tp, dp, cp, link):
    """The H100 file's links (intra_node 360 GB/s, 4 us; inter_node 40 GB/s, 8 us), not the
    default link a cost model without one measured falls back to."""
    costs = Pricing(load_hardware("h100"), GPT, "bfloat16", tp).stage_costs(_spec(tp, dp, cp))
    assert (costs.p2p_link.bandwidth_GBps, costs.p2p_link.latency_us) == (link.bandwidth_GBps, link.latency_us)
    assert costs.model.cp == cp and costs.pp == 2 and costs.dp == dp


def test_a_pricing_prices_its_own_tensor_parallel_size_only():
    with pytest.raises(ValueError, match="the pricing is of TP 2, the layout has TP 4"):
        Pricing(load_hardware("h100"), GPT, "bfloat16", 2).stage_costs(_spec(4))


def test_the_collectives_of_the_tp_group_are_added_to_the_layers():
    """At TP 1 there are none: the layers cost what the roofline alone prices; at TP 8 more."""
    h100 = load_hardware("h100")
    for tp, more in ((1, False), (8, True)):
        layers = h100.cost_model(GPT, tp, "bfloat16")
        planned = Pricing(h100, GPT, "bfloat16", tp).stage_costs(_spec(tp)).model
        for phase in ("forward", "backward"):
            alone = layers.layer_ms("encoder", phase, RecomputeType.NONE, 1, 2048)
            priced = planned.layer_ms("encoder", phase, RecomputeType.NONE, 1, 2048)
            assert (priced > alone * 1.001) is more and priced >= alone * (1 - 1e-12)


def test_a_pricing_travels_as_json():
    h100 = load_hardware("h100")
    pricing = Pricing(h100, GPT, "bfloat16", 4, sequence_parallel=True, tp_comm_overlap=True)
    back = Pricing.from_json(pricing.to_json())
    assert back == pricing
    spec = _spec(4, cp=2)
    for phase in ("forward", "backward"):
        assert back.stage_costs(spec).model.layer_ms("encoder", phase, RecomputeType.NONE, 1, 4096) == \
            pricing.stage_costs(spec).model.layer_ms("encoder", phase, RecomputeType.NONE, 1, 4096)
