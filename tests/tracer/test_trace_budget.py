"""Real compute or shapes only: the estimated bytes and compute time of a config's busiest rank."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.config.model import ModelSpec, get_model
from megatron_dynapipe.tracer import trace_budget
from megatron_dynapipe.tracer.trace_budget import decide_shapes_only

from stand_in import cfg

TINY = get_model("tiny")


# --------------------------------------------------------------------------------------------
# shapes-only by estimated bytes


def test_shapes_only_by_estimated_bytes():
    assert decide_shapes_only(cfg("8192 2 2"), budget=2**30)[0] is False
    only, why = decide_shapes_only(cfg("8192 2 2", model="6.7"), budget=16 * 2**30)
    assert only and "GiB per rank > memory budget 16.0 GiB" in why
    assert decide_shapes_only(cfg("8192 2 2", model="6.7"), budget=2**50, time_budget_s=1e9)[0] is False


def test_shapes_only_when_real_compute_would_take_too_long():
    # 6.7B at PP=16, TP=8 fits in memory but 16 micro-batches of 2048 tokens take minutes on a CPU
    only, why = decide_shapes_only(cfg("8192 16 8", model="6.7"), budget=2**40)
    assert only and "real compute would take about" in why
    assert decide_shapes_only(cfg("8192 16 8", model="6.7"), budget=2**40, time_budget_s=1e9)[0] is False
    assert trace_budget.estimated_compute_seconds(cfg("8192 2 2")) < 1


def test_the_choice_counts_recompute_and_the_distributed_optimizer():
    c = cfg("64 2 1 seq=2048 mbs=4 nmb=8", model="6.7")  # DP 32
    options = {"plain": MegatronOptions(), "selective": MegatronOptions(recompute_granularity="selective"),
               "full": MegatronOptions(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
               "distributed": MegatronOptions(distributed_optimizer=True)}
    need = {name: trace_budget.estimated_bytes(c, training) for name, training in options.items()}
    assert need["full"] < need["selective"] < need["plain"]
    # Adam's two fp32 moments (8 bytes a parameter) split over DP 32, on the busiest stage: the
    # first, 16 layers of 12h^2 + 13h parameters, the word (51200) and position (2048) embeddings
    h = 4096
    stage0 = 16 * (12 * h * h + 13 * h) + (51200 + 2048) * h
    assert need["plain"] - need["distributed"] == pytest.approx(8 * (1 - 1 / 32) * stage0, abs=1)
    budget = (need["full"] + need["selective"]) // 2
    assert decide_shapes_only(c, budget=budget, time_budget_s=1e9, training=options["full"])[0] is False
    assert decide_shapes_only(c, budget=budget, time_budget_s=1e9, training=options["selective"])[0] is True
    # full recompute runs every layer's forward twice: the layers' compute grows by a third
    seconds = {name: trace_budget.estimated_compute_seconds(c, training=options[name]) for name in ("plain", "full")}
    assert 1 < seconds["full"] / seconds["plain"] < 4 / 3


def test_the_choice_counts_the_interleaved_warm_up_the_tracer_sees():
    """Interleaving holds more micro-batches on the first stage: megatron-core's warm-up of
    2 (PP - 1) + (V - 1) PP chunk passes, plus one, each of 1/V of the stage's layers; a
    shapes-only trace of that rank sees as many passes in flight."""
    from megatron_dynapipe.tracer.fake_rank import trace_fake_rank

    model = dict(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=128, max_sequence_length=64)
    c = dataclasses.replace(cfg("4 4 1 nmb=8 seq=16"), model=ModelSpec.from_any(model))
    interleaved = MegatronOptions(layers_per_virtual_stage=1)  # PP 4, V 2
    passes = 2 * (4 - 1) + (2 - 1) * 4 + 1
    assert trace_budget.in_flight_microbatches(c, interleaved) == passes / 2
    assert trace_budget.in_flight_microbatches(c, MegatronOptions()) == 4
    assert trace_budget.estimated_bytes(c, interleaved) > trace_budget.estimated_bytes(c)
    trace = trace_fake_rank(c.layout(), 0, model, micro_batch_size=1, num_microbatches=8, seq_length=16,
                            shapes_only=True, training=interleaved)
    assert trace.memory["peak_in_flight_microbatches"] == passes


def test_ranks_that_compute_on_a_gpu_are_budgeted_by_the_gpu(monkeypatch):
    """Where torch sees a GPU the fake ranks compute on it: half its memory, at a GPU's rate."""
    import types

    import torch

    on_cpu = trace_budget.estimated_compute_seconds(cfg("8192 4 8", model="6.7"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 2**30))
    assert trace_budget.memory_budget_bytes() == 40 * 2**30
    on_gpu = trace_budget.estimated_compute_seconds(cfg("8192 4 8", model="6.7"))
    assert on_gpu * trace_budget.GPU_FLOPS == pytest.approx(on_cpu * trace_budget.CPU_FLOPS)
    only, why = decide_shapes_only(cfg("8192 4 8", model="6.7"))  # an H100 traces GPT-6.7B at TP 8 for real
    assert not only, why




def test_an_uneven_split_budgets_its_busiest_stage():
    # 6.7B's 32 layers on PP 4 as 5 + 9 + 9 + 9: the busiest stage holds 9 layers, not an even 8
    c = cfg("64 4 1 seq=2048 mbs=1 nmb=8", model="6.7")
    even, uneven = MegatronOptions(), MegatronOptions(first_stage_layers=5)
    s, h, a, in_flight = 2048, 4096, 32, 4
    layer_state = 16 * (12 * h * h + 13 * h)  # fp32 weight, gradient and Adam's moments of a layer
    layer_activations = 2 * s * h * (34 + 5 * a * s / h)  # Korthikanti et al.'s 16-bit count, in fp32
    grew = trace_budget.estimated_bytes(c, uneven) - trace_budget.estimated_bytes(c, even)
    assert grew == pytest.approx(layer_state + in_flight * layer_activations, abs=2)
    seconds = {name: trace_budget.estimated_compute_seconds(c, training=t) for name, t in (("even", even),
                                                                                        ("uneven", uneven))}
    assert seconds["uneven"] > seconds["even"]
