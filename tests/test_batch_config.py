"""Batch configurations of the fake-rank tracer: parsing, validation, folders, the batch runner,
`megatron-dynapipe trace` and the example scripts.

The batch-runner tests inject a small stand-in tracer (below) so they run in a second and can
fail on purpose; the example scripts and the end-to-end tests use the real fake-rank tracer.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dynapipe import progress
from megatron_dynapipe.config.accounting import stage_params, total_params, training_bytes
from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.config.model import MODELS, ModelSpec, get_model
from megatron_dynapipe.config.model_flags import (
    add_model_arguments,
    megatron_model_args,
    model_from_args,
    model_from_megatron_args,
)
from megatron_dynapipe.megatron_lm import scaling_mode
from megatron_dynapipe.tracer import batch_run, isolation, trace_budget
from megatron_dynapipe.tracer import cli as trace_cli
from megatron_dynapipe.tracer.batch_config import (
    ConfigParseError,
    TraceConfig,
    parse_config_line,
    parse_configs,
    read_config_file,
    validate,
)
from megatron_dynapipe.tracer.batch_results import ConfigResult, RankResult, exit_code
from megatron_dynapipe.tracer.batch_run import run_batch
from megatron_dynapipe.tracer.trace_budget import decide_shapes_only
from megatron_dynapipe.tracer.trace_format import RankTrace, TraceOp

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

TINY = get_model("tiny")
NO_BIAS = dataclasses.replace(TINY, add_bias_linear=False)  # MoE at expert TP > 1 allows no biases


def cfg(line: str, **kw) -> TraceConfig:
    config = parse_config_line(line, **kw)
    assert config is not None
    return config


# --------------------------------------------------------------------------------------------
# the stand-in tracer: same call and `write` contract as trace_fake_rank


def stand_in_trace(layout, rank, model, options) -> RankTrace:
    """A three-op trace in the real trace format (what trace_fake_rank returns)."""
    ops = [TraceOp(seq=i, iteration=0, stage=0, cat="compute", kind="forward", microbatch=i,
                   start_us=10.0 * i, dur_us=5.0) for i in range(3)]
    return RankTrace(rank=rank, stage=0, layout={"world_size": layout.world_size}, coords={}, groups={},
                     model={"name": model.label}, iteration=dict(options, cost_model=None),
                     mode="shapes_only" if options["shapes_only"] else "real", ops=ops)


class UnreadableTrace:
    def __init__(self, rank):
        self.rank = rank

    def write(self, directory):
        (Path(directory) / f"rank_{self.rank}.trace.jsonl").write_text("not a trace\n")


class SilentTrace:
    def write(self, directory):
        pass


CALLS: list[dict] = []


def stand_in_tracer(layout, rank, model, **options):
    print(f"stand-in tracing rank {rank}")
    CALLS.append({"world_size": layout.world_size, "rank": rank, "model": model.label, **options})
    return stand_in_trace(layout, rank, model, options)


def failing_on(world_size=None, rank=None, how="raise"):
    """A stand-in that fails for one world size (whole config) or one rank."""

    def tracer(layout, r, model, **options):
        if (world_size is None or layout.world_size == world_size) and (rank is None or r == rank):
            if how == "raise":
                raise RuntimeError(f"boom on W={layout.world_size} rank {r}")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "sleep":
                time.sleep(60)
            if how == "unreadable":
                return UnreadableTrace(r)
            if how == "silent":
                return SilentTrace()
        return stand_in_tracer(layout, r, model, **options)

    return tracer


# --------------------------------------------------------------------------------------------
# models


def test_model_table_matches_the_issue():
    table = {"tiny": (128, 8, 4), "6.7B": (4096, 32, 32), "13B": (5120, 32, 40), "30B": (7680, 48, 40),
             "40B": (9216, 72, 40), "70B": (8192, 64, 80), "175B": (12288, 96, 96),
             "485B": (20480, 160, 96), "1T": (25600, 160, 128), "2T": (25600, 160, 256)}
    assert {n: (m.hidden_size, m.num_attention_heads, m.num_layers) for n, m in MODELS.items()} == table
    assert all(m.ffn_hidden_size == 4 * m.hidden_size for m in MODELS.values())


@pytest.mark.parametrize("name", ["6.7", "6.7b", "6.7B", "gpt-6.7b", " GPT-6.7B "])
def test_model_aliases(name):
    assert get_model(name) is MODELS["6.7B"]


def test_unknown_model_lists_the_valid_names():
    with pytest.raises(ValueError) as e:
        get_model("7b")
    for name in MODELS:
        assert name in str(e.value)


def test_model_sizes_are_plausible():
    assert abs(total_params(get_model("6.7")) / 6.7e9 - 1) < 0.02
    assert abs(total_params(get_model("175")) / 175e9 - 1) < 0.02
    m = get_model("6.7")
    assert stage_params(m, pp=2, tp=2, stage=0) < total_params(m) / 3
    assert training_bytes(get_model("tiny"), 2, 2) < 2**30 < training_bytes(m, 2, 2)


def test_megatron_args_of_a_model():
    args = megatron_model_args(get_model("13"), 4096)
    assert args[args.index("--hidden-size") + 1] == "5120"
    assert args[args.index("--num-layers") + 1] == "40"
    assert args[args.index("--seq-length") + 1] == "4096"


# --------------------------------------------------------------------------------------------
# parsing


def test_parse_a_plain_line():
    c = cfg("8192 16 8", model="175")
    assert (c.world_size, c.pp, c.tp, c.cp, c.ep) == (8192, 16, 8, 1, 1)
    assert c.model is MODELS["175B"] and c.dp == 64 and c.microbatches == 16


def test_parse_cp_ep_commas_comments_and_overrides():
    c = cfg("1024, 4, 2, 2, 8   mbs=2 gbs=512 experts=16 seq=1024 model=6.7  # a comment")
    assert (c.world_size, c.pp, c.tp, c.cp, c.ep) == (1024, 4, 2, 2, 8)
    assert (c.micro_batch_size, c.global_batch_size, c.seq) == (2, 512, 1024)
    assert c.model.name == "6.7B" and c.model.num_experts == 16 and c.moe
    assert c.dp == 64 and c.microbatches == 4  # 512 / (2 * 64)


def test_line_overrides_win_over_defaults():
    c = cfg("64 2 2 cp=2", micro_batch_size=4, seq_length=512)
    assert c.cp == 2 and c.micro_batch_size == 4 and c.seq == 512
    c = cfg("64 2 2 mbs=1", micro_batch_size=4)
    assert c.micro_batch_size == 1


@pytest.mark.parametrize("line", ["", "   ", "# only a comment", "  # indented"])
def test_blank_and_comment_lines_are_skipped(line):
    assert parse_config_line(line) is None


@pytest.mark.parametrize("line, message", [
    ("8192 16", "expected 3 to 5 numbers"),
    ("8192 16 8 1 1 1", "expected 3 to 5 numbers"),
    ("8192 sixteen 8", "PP must be an integer"),
    ("8192 16 8 foo=1", "unknown key 'foo'"),
    ("8192 16 8 mbs=2 4", "after key=value"),
    ("8192 16 8 2 cp=4", "cp given twice"),
    ("8192 16 8 model=7b", "unknown model"),
    ("8192 16 8 mbs=two", "mbs must be an integer"),
])
def test_parse_errors_say_what_is_wrong(line, message):
    with pytest.raises(ConfigParseError, match=message) as e:
        parse_config_line(line, source="cfg.txt:3")
    assert "cfg.txt:3" in str(e.value)


def test_config_file_numbering_and_sources(tmp_path):
    path = tmp_path / "configs.txt"
    path.write_text("# world pp tp\n8192 16 8\n\n4096 16 4  # half\n2048 8 8 2\n")
    configs = read_config_file(path, start_index=2, model="175")
    assert [c.index for c in configs] == [2, 3, 4]
    assert [c.source for c in configs] == [f"{path}:2", f"{path}:4", f"{path}:5"]
    assert [c.line for c in configs] == ["8192 16 8", "4096 16 4", "2048 8 8 2"]
    bad = tmp_path / "bad.txt"
    bad.write_text("8192 16 8\n8192 x 8\n")
    with pytest.raises(ConfigParseError, match=f"{bad}:2"):
        read_config_file(bad)
    with pytest.raises(ConfigParseError, match="cannot read"):
        read_config_file(tmp_path / "missing.txt")


def test_parse_configs_from_lines():
    configs = parse_configs(["16 2 2", "# x", "8 4 1"])
    assert [(c.index, c.world_size) for c in configs] == [(0, 16), (1, 8)]


# --------------------------------------------------------------------------------------------
# validation: one test per rule, each reason with its numbers


def test_valid_configs_have_no_reasons():
    assert validate(cfg("8192 16 8", model="175")) == []
    assert validate(cfg("8192 2 2")) == []
    assert validate(cfg("64 2 2 1 4 experts=8", model=NO_BIAS)) == []
    assert validate(cfg("64 2 2 2 gbs=64")) == []


def test_rule_positive_sizes():
    reasons = validate(TraceConfig(0, 2, 2))
    assert reasons == ["world size must be a positive integer, got 0"]
    assert "micro-batch size must be a positive integer, got -1" in validate(TraceConfig(8, 2, 2, micro_batch_size=-1))
    assert "PP must be a positive integer, got 1.5" in validate(TraceConfig(8, 1.5, 2))  # type: ignore[arg-type]


def test_rule_dp_positive():
    assert validate(cfg("8 4 4")) == ["world size 8 is not divisible by TP·PP·CP = 4·4·1 = 16: make it a multiple of 16 or change TP, PP, CP"]


def test_rule_world_divisible_by_pp_tp_cp():
    assert validate(cfg("100 2 4 2")) == ["world size 100 is not divisible by TP·PP·CP = 4·2·2 = 16: make it a multiple of 16 or change TP, PP, CP"]


def test_rule_global_batch_divisible_by_micro_batch_times_dp():
    # dp = 16 / (2*2) = 4, mbs 2 -> 8
    assert validate(cfg("16 2 2 mbs=2 gbs=20")) == [
        "global batch 20 is not divisible by micro-batch × DP = 2×4 = 8"]
    assert validate(cfg("16 2 2 mbs=2 gbs=24 nmb=2")) == [
        "global batch 24 != micro-batch × micro-batches × DP = 2×2×4 = 16"]
    assert validate(cfg("16 2 2 mbs=2 gbs=24")) == []


def test_rule_layers_divisible_by_pp():
    assert validate(cfg("24 3 1")) == ["4 layers of model tiny do not split evenly into PP = 3 pipeline stages: use PP among 1, 2, 4"]


def test_rule_heads_divisible_by_tp():
    assert validate(cfg("48 1 16")) == ["8 attention heads of model tiny are not divisible by TP = 16"]


def test_rule_ffn_divisible_by_tp():
    odd = ModelSpec(hidden_size=64, num_attention_heads=4, num_layers=2, ffn_hidden_size=30, name="odd")
    assert validate(cfg("8 1 4", model=odd)) == ["FFN width 30 of model odd is not divisible by TP = 4"]


def test_rule_experts_divisible_by_ep():
    assert validate(cfg("64 2 2 1 4")) == ["EP 4 needs a mixture-of-experts model: give experts=N, a multiple of 4"]
    assert validate(cfg("64 2 2 1 4 experts=6", model=NO_BIAS)) == ["experts=6 is not divisible by EP 4: use a multiple of 4"]


def test_rule_world_divisible_by_tp_ep_pp():
    # dense: 48 / (2*2) ok; expert: 48 / (2*8*2) not
    assert validate(cfg("48 2 2 1 8 experts=8", model=NO_BIAS)) == [
        "world size 48 is not divisible by TP·EP·PP = 2·8·2 = 32: make it a multiple of 32 or change TP, EP, PP"]
    # expert TP given: expert 48 / (1*8*2) ok; 32 / (4*8*2) not
    assert validate(cfg("48 2 2 1 8 experts=8 etp=1", model=NO_BIAS)) == []
    assert validate(cfg("32 2 2 1 8 experts=8 etp=4", model=NO_BIAS)) == [
        "world size 32 is not divisible by ETP·EP·PP = 4·8·2 = 64: make it a multiple of 64 or change ETP, EP, PP"]


def test_rule_moe_biases_need_expert_tp_1():
    fix = ": add --disable-bias-linear, or set expert TP 1 (etp=1 on a config line, --expert-tensor-parallel-size 1)"
    rule = "MoE with linear biases needs expert tensor parallelism 1 (megatron-core's rule), but it is 2"
    assert validate(cfg("8 1 2 1 2 experts=4")) == [rule + " (by default, TP)" + fix]
    assert validate(cfg("8 1 2 1 2 experts=4 etp=2")) == [rule + fix]
    assert validate(cfg("8 1 2 1 2 experts=4 etp=1")) == []
    assert validate(cfg("8 1 2 1 2 experts=4", model=NO_BIAS)) == []
    assert validate(cfg("8 1 1 1 2 experts=4")) == []  # TP 1, so expert TP 1


def test_rule_moe_with_tensor_parallelism_needs_sequence_parallelism():
    moe = cfg("8 1 2 1 2 experts=4", model=NO_BIAS)
    assert validate(moe, MegatronOptions()) == [
        "MoE with tensor parallelism trains with sequence parallelism (megatron-core's rule): add --sequence-parallel"]
    assert validate(moe, MegatronOptions(sequence_parallel=True)) == []
    assert validate(cfg("8 1 2"), MegatronOptions()) == []  # dense


def test_etp_sets_the_experts_tensor_parallelism():
    """Megatron's expert ranks: global = etp + ETP * (ep + EP * (edp + EDP * pp)); the traced ones
    have etp = edp = 0, one per (stage, EP rank)."""
    c = cfg("16 2 2 1 2 experts=4 etp=1", model=NO_BIAS)
    layout = c.layout()
    assert (layout.expert_tp, layout.expert_dp) == (1, 16 // (1 * 2 * 2))
    edp = 16 // (1 * 2 * 2)
    assert [r.global_rank for r in c.representatives()] == [1 * (ep + 2 * edp * pp) for pp in (0, 1) for ep in (0, 1)]
    default = cfg("16 2 2 1 2 experts=4", model=NO_BIAS)
    assert [r.global_rank for r in default.representatives()] == [2 * (ep + 2 * 2 * pp) for pp in (0, 1) for ep in (0, 1)]
    assert "_EP2_ETP1_DP4_" in c.folder_name() and "ETP" not in default.folder_name()
    assert cfg("16 2 2 1 2 experts=4 etp=2", model=NO_BIAS).folder_name() == default.folder_name()
    assert c.to_dict()["expert_tp"] == 1 and default.to_dict()["expert_tp"] == 2


def test_rule_sequence_divisible_by_two_cp():
    assert validate(cfg("64 2 2 2 seq=250")) == ["sequence length 250 is not divisible by 2·CP = 4"]


def test_all_reasons_are_listed_together():
    reasons = validate(cfg("40 3 16"))
    assert len(reasons) == 3
    assert any("world size 40 is not divisible by TP·PP·CP = 16·3·1 = 48" in r for r in reasons)
    assert any("layers" in r for r in reasons) and any("heads" in r for r in reasons)


def test_moe_flags_describe_the_experts():
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, moe=True)
    args = parser.parse_args(["--model", "tiny", "--moe-router-topk", "1", "--moe-ffn-hidden-size", "96",
                              "--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity"])
    spec = model_from_args(args).with_experts(4)
    assert (spec.moe_router_topk, spec.moe_ffn_hidden_size, spec.moe_expert_capacity_factor,
            spec.moe_pad_expert_input_to_capacity) == (1, 96, 1.5, True)
    # Megatron-LM's flags of the model, read back as scaling mode reads a pretrain_gpt.py command line
    back = model_from_megatron_args(scaling_mode.parse_args(megatron_model_args(spec)))
    assert back == dataclasses.replace(spec, name="")
    with pytest.raises(ValueError, match=r"give moe_expert_capacity_factor \(--moe-expert-capacity-factor F\)"):
        model_from_args(parser.parse_args(["--model", "tiny", "--moe-pad-expert-input-to-capacity"]))


def test_shapes_only_dropless_moe_fails_its_config_before_any_rank_starts(tmp_path):
    CALLS.clear()
    configs = parse_configs(["8 2 1 1 2 experts=4", "8 4 1"])
    results = run_batch(configs, tmp_path, tracer=stand_in_tracer, shapes_only=True, isolation="inline", progress=False)
    assert [r.status for r in results] == ["failed", "ok"]
    assert "add --moe-expert-capacity-factor F --moe-pad-expert-input-to-capacity" in results[0].error
    assert [c["rank"] for c in CALLS] == [0, 2, 4, 6]  # the dense config's stages only (s x TP x DP)
    assert not (tmp_path / configs[0].folder_name()).exists()
    padded = dataclasses.replace(TINY, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    results = run_batch(parse_configs(["8 2 1 1 2 experts=4"], model=padded), tmp_path, tracer=stand_in_tracer,
                        shapes_only=True, isolation="inline", progress=False)
    assert results[0].status == "ok"


@pytest.mark.slow
def test_moe_at_expert_tp_1_traces_and_its_all_to_alls_pair_up(tmp_path):
    """TP 2 with sequence parallelism, EP 2, expert TP 1: each rank routes its 64 / 2 tokens to
    top-2 of 4 experts, 2 on each EP rank, so it sends 32 x 2 / 2 = 32 rows to each EP peer."""
    code = trace_cli.main(["--model", "tiny", "--num-experts", "4", "--disable-bias-linear", "--sequence-parallel",
                           "--config", "8 1 2 1 2 etp=1", "--seq-length", "64", "--real-compute",
                           "--output-dir", str(tmp_path), "--no-progress"])
    assert code == 0
    (folder,) = tmp_path.iterdir()
    traces = {t.rank: t for t in map(RankTrace.read, folder.glob("rank_*.trace.jsonl"))}
    assert sorted(traces) == [0, 1]  # etp + ETP x ep with etp = 0, ETP = 1
    routed = {rank: [op for op in t.ops if op.kind == "all_to_all" and op.splits] for rank, t in traces.items()}
    assert routed[0] and len(routed[0]) == len(routed[1])
    for rank, ops in routed.items():
        assert traces[rank].layout["expert_tp"] == 1 and traces[rank].expert_coords["ep"] == rank
        # the dispatch sends the tokens' hidden states (64 x 128 float32) and their routing
        # probabilities (64 float32); the combine sends the hidden states back
        assert {op.bytes for op in ops} == {64 * 128 * 4, 64 * 4}
        for k, op in enumerate(ops):
            assert op.group == (0, 1) and op.splits["in"] == op.splits["out"] == [32, 32]
            peer = routed[1 - rank][k]
            assert op.splits["in"][1 - rank] == peer.splits["out"][rank]


# --------------------------------------------------------------------------------------------
# folders


def test_folder_name():
    c = cfg("8192 16 8", model="175", index=3, global_batch_size=1024)
    assert c.folder_name() == ("SIM_GPT_175B_Config3_WS8192_PP16_TP8_DP64_nMICROB16_MICROB_SIZE1"
                               "_GLOBAL_BATCH1024")
    c = cfg("8192 2 2")
    assert c.folder_name() == "SIM_GPT_tiny_Config0_WS8192_PP2_TP2_DP2048_nMICROB2_MICROB_SIZE1_GLOBAL_BATCH4096"
    c = cfg("1024 4 2 2 8 experts=8 mbs=2 nmb=8", model="6.7", index=1)
    assert c.folder_name() == ("SIM_GPT_6.7B_Config1_WS1024_PP4_TP2_CP2_EP8_DP64_nMICROB8_MICROB_SIZE2"
                               "_GLOBAL_BATCH1024")


def test_default_microbatches_fill_the_pipeline():
    c = cfg("64 4 2")
    assert c.microbatches == 4 and c.global_batch == 4 * 8


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


# --------------------------------------------------------------------------------------------
# run_batch with the stand-in


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_run_batch_writes_a_folder_per_config(tmp_path, isolation):
    CALLS.clear()
    configs = parse_configs(["16 2 2", "12 2 4", "8 4 1"])
    results = run_batch(configs, tmp_path, tracer=stand_in_tracer, isolation=isolation, progress=False)
    assert [r.status for r in results] == ["ok", "invalid", "ok"]
    assert results[1].folder is None and "not divisible" in results[1].reasons[0]
    assert exit_code(results) == 0
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert folders == sorted([configs[0].folder_name(), configs[2].folder_name()])
    for result, ranks in ((results[0], [0, 8]), (results[2], [0, 2, 4, 6])):
        names = {p.name for p in result.folder.iterdir()}
        for r in ranks:
            assert {f"fake_rank_{r}.log", f"rank_{r}.trace.jsonl"} <= names
            log = (result.folder / f"fake_rank_{r}.log").read_text()
            assert f"stand-in tracing rank {r}" in log and "status ok" in log
        assert not [n for n in names if n.startswith(".")], "temporary files left behind"
        summary = _summary(result.folder)
        assert summary["complete"] and summary["status"] == "ok" and summary["timeline"] == "timeline.json"
        timeline = json.loads((result.folder / "timeline.json").read_text())
        spans = [e for e in timeline["traceEvents"] if e["ph"] == "X"]
        assert sorted({e["pid"] for e in spans}) == ranks and len(spans) == 3 * len(ranks)
        assert [x["rank"] for x in summary["ranks"]] == ranks
        assert summary["ranks_traced"] == len(ranks)
        assert summary["reduction_pct"] == pytest.approx(100 * (1 - len(ranks) / result.config.world_size))
        rank0 = summary["ranks"][0]
        assert rank0["files"] == ["rank_0.trace.jsonl"]
        assert rank0["stats"]["ops"] == 3 and rank0["stats"]["rank"] == 0
    if isolation == "inline":
        assert [c["rank"] for c in CALLS] == [0, 8, 0, 2, 4, 6]
        assert CALLS[0]["num_microbatches"] == 2 and CALLS[0]["micro_batch_size"] == 1
        assert CALLS[0]["seq_length"] == 256 and CALLS[0]["shapes_only"] is False


def test_a_failed_config_names_its_first_failed_rank_whichever_finished_first():
    result = ConfigResult(cfg("32 2 2"), "ok")
    for rank, status in [(16, "failed"), (8, "ok"), (0, "failed")]:  # the order they finished in
        result.ranks.append(RankResult(rank, rank // 16, 0, status, error=f"boom on rank {rank}"))
        result.note(result.ranks[-1])
    assert result.error == "rank 16: boom on rank 16"
    result.order_ranks([0, 8, 16])
    assert [r.rank for r in result.ranks] == [0, 8, 16] and result.error == "rank 0: boom on rank 0"


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_a_failing_config_does_not_take_the_others_down(tmp_path, isolation):
    configs = parse_configs(["16 2 2", "32 2 2", "8 4 1"])
    results = run_batch(configs, tmp_path, tracer=failing_on(world_size=32), isolation=isolation,
                        progress=False)
    assert [r.status for r in results] == ["ok", "failed", "ok"]
    assert exit_code(results) == 1
    failed = results[1]
    assert "boom on W=32 rank 0" in failed.error
    assert [r.status for r in failed.ranks] == ["failed", "failed"]
    summary = _summary(failed.folder)
    assert summary["status"] == "failed" and "boom on W=32" in summary["error"]
    assert "RuntimeError: boom on W=32 rank 0" in summary["ranks"][0]["error"]
    log = (failed.folder / "fake_rank_0.log").read_text()
    assert "Traceback" in log and "boom on W=32 rank 0" in log and "status failed" in log


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_a_failing_rank_does_not_stop_the_next_rank(tmp_path, isolation):
    results = run_batch(parse_configs(["8 4 1"]), tmp_path, tracer=failing_on(rank=2), isolation=isolation,
                        progress=False)
    assert [r.status for r in results[0].ranks] == ["ok", "failed", "ok", "ok"]
    assert results[0].status == "failed" and results[0].error.startswith("rank 2:")
    assert (results[0].folder / "rank_4.trace.jsonl").is_file()


@pytest.mark.parametrize("how, message", [("unreadable", "unreadable rank_2.trace.jsonl"),
                                          ("silent", "the tracer wrote no rank_2.trace.jsonl")])
def test_a_rank_without_a_readable_trace_fails(tmp_path, how, message):
    results = run_batch(parse_configs(["8 4 1"]), tmp_path, tracer=failing_on(rank=2, how=how), isolation="inline",
                        progress=False)
    assert [r.status for r in results[0].ranks] == ["ok", "failed", "ok", "ok"]
    assert message in results[0].ranks[1].error and results[0].status == "failed"
    spans = [e for e in json.loads((results[0].folder / "timeline.json").read_text())["traceEvents"]
             if e["ph"] == "X"]
    assert sorted({e["pid"] for e in spans}) == [0, 4, 6]


def test_a_crashing_rank_process_is_contained(tmp_path):
    results = run_batch(parse_configs(["16 2 2", "8 4 1"]), tmp_path, tracer=failing_on(world_size=16, rank=8, how="kill"),
                        isolation="process", progress=False)
    assert [r.status for r in results] == ["failed", "ok"]
    assert "SIGKILL" in results[0].ranks[1].error
    assert (results[0].folder / "fake_rank_8.log").is_file()


def test_a_hanging_rank_times_out(tmp_path):
    start = time.perf_counter()
    results = run_batch(parse_configs(["8 4 1"]), tmp_path, tracer=failing_on(rank=4, how="sleep"),
                        isolation="process", rank_timeout=2, progress=False)
    assert time.perf_counter() - start < 30
    assert [r.status for r in results[0].ranks] == ["ok", "ok", "failed", "ok"]
    assert "timed out after 2 s" in results[0].ranks[2].error


def meeting_tracer(folder: Path, wait_s: float = 10.0):
    """A stand-in whose ranks 0 and 4 each wait until the other has started: they can only both
    finish if they run at the same time."""

    def tracer(layout, rank, model, **options):
        (folder / f"arrived_{rank}").touch()
        other = folder / f"arrived_{4 - rank}"
        deadline = time.monotonic() + wait_s
        while not other.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {4 - rank} never ran beside rank {rank}")
            time.sleep(0.02)
        if rank == 0:
            time.sleep(0.5)  # rank 4 finishes first
        return stand_in_tracer(layout, rank, model, **options)

    return tracer


def test_jobs_run_ranks_side_by_side_and_list_them_in_order(tmp_path):
    meet = tmp_path / "meet"
    meet.mkdir()
    [result] = run_batch(parse_configs(["8 2 1"]), tmp_path / "t", tracer=meeting_tracer(meet), jobs=2, progress=False)
    assert result.status == "ok", result.error
    assert [r.rank for r in result.ranks] == [0, 4]
    assert [r["rank"] for r in _summary(result.folder)["ranks"]] == [0, 4]
    assert {p.name for p in result.folder.glob("*.log")} == {"fake_rank_0.log", "fake_rank_4.log"}


def test_one_job_runs_ranks_one_after_the_other(tmp_path):
    meet = tmp_path / "meet"
    meet.mkdir()
    [result] = run_batch(parse_configs(["8 2 1"]), tmp_path / "t", tracer=meeting_tracer(meet, wait_s=1), jobs=1,
                         progress=False)
    assert [r.status for r in result.ranks] == ["failed", "ok"]
    assert "rank 4 never ran beside rank 0" in result.ranks[0].error


def test_a_rank_killed_beside_others_fails_alone(tmp_path):
    results = run_batch(parse_configs(["16 4 1"]), tmp_path, tracer=failing_on(rank=8, how="kill"), jobs=3,
                        rank_timeout=60, progress=False)
    assert [(r.rank, r.status) for r in results[0].ranks] == [(0, "ok"), (4, "ok"), (8, "failed"), (12, "ok")]
    assert "SIGKILL" in results[0].ranks[2].error


@pytest.mark.parametrize("jobs", [0, -2, 1.5])
def test_run_batch_refuses_a_bad_jobs_count(tmp_path, jobs):
    with pytest.raises(ValueError, match="jobs must be a positive integer"):
        run_batch(parse_configs(["8 2 1"]), tmp_path, tracer=stand_in_tracer, jobs=jobs, progress=False)


def test_shapes_only_choice_reaches_the_tracer(tmp_path):
    CALLS.clear()
    run_batch(parse_configs(["16 2 2"]), tmp_path, tracer=stand_in_tracer, isolation="inline", progress=False,
              shapes_only=True, warmup_iters=2, trace_iters=3)
    assert {c["shapes_only"] for c in CALLS} == {True}
    assert {(c["warmup_iters"], c["trace_iters"]) for c in CALLS} == {(2, 3)}
    CALLS.clear()
    results = run_batch(parse_configs(["16 2 2"], model="6.7"), tmp_path, tracer=stand_in_tracer,
                        isolation="inline", progress=False)
    assert results[0].shapes_only is True and CALLS[0]["shapes_only"] is True  # 6.7B cannot fit here


def test_cost_model_factory_is_called_per_config(tmp_path):
    CALLS.clear()
    seen = []
    run_batch(parse_configs(["16 2 2", "16 2 4"]), tmp_path, tracer=stand_in_tracer, isolation="inline",
              progress=False, cost_model=lambda c: seen.append(c.tp) or f"cost-tp{c.tp}")
    assert seen == [2, 4]
    assert [c["cost_model"] for c in CALLS] == ["cost-tp2", "cost-tp2", "cost-tp4", "cost-tp4"]


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_only_on_a_terminal(tmp_path):
    assert progress.progress_enabled(True, FakeTTY()) is True
    assert progress.progress_enabled(True, io.StringIO()) is False
    assert progress.progress_enabled(False, FakeTTY()) is False
    plain = io.StringIO()
    run_batch(parse_configs(["16 2 2"]), tmp_path, tracer=stand_in_tracer, isolation="inline",
              progress=True, progress_stream=plain)
    assert plain.getvalue() == ""
    tty = FakeTTY()
    run_batch(parse_configs(["16 2 2"]), tmp_path, tracer=stand_in_tracer, isolation="inline",
              progress=True, progress_stream=tty)
    assert "configs" in tty.getvalue()


# --------------------------------------------------------------------------------------------
# the trace command, in this process with the stand-in


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(batch_run, "_default_tracer", lambda: failing_on(world_size=32))


def test_trace_json_summary(tmp_path, stand_in, capsys):
    code = trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "32 2 2", "--config", "12 2 4",
                           "--output-dir", str(tmp_path), "--json", "--isolation", "inline"])
    out, err = capsys.readouterr()
    assert code == 1
    summary = json.loads(out)
    assert [c["status"] for c in summary["configs"]] == ["ok", "failed", "invalid"]
    assert (summary["ok"], summary["failed"], summary["invalid"], summary["exit_code"]) == (1, 1, 1, 1)
    ok, failed, invalid = summary["configs"]
    assert ok["folder"] == str(tmp_path / ok_folder("16 2 2", 0)) and ok["ranks_in_job"] == 16
    assert ok["ranks_traced"] == 2 and ok["reduction_pct"] == 87.5
    assert "boom on W=32" in failed["error"] and failed["ranks"][0]["status"] == "failed"
    assert invalid["folder"] is None and "not divisible" in invalid["reasons"][0]
    assert "\x1b[" not in err and "configs" not in err  # stderr is not a terminal: no progress bar


def test_collect_writes_what_a_trace_run_writes_from_ranks_traced_elsewhere(tmp_path, stand_in, capsys):
    """--collect (the MEGATRON_LM_DIR way of update_pretrain_gpt.sh): summary and timeline from the traces."""
    argv = ["--model", "tiny", "--config", "16 2 2", "--config", "32 4 1", "--output-dir", str(tmp_path), "--json"]
    assert trace_cli.main(argv + ["--isolation", "inline", "--config", "8 4 1"]) == 1  # 32 4 1 fails
    traced = json.loads(capsys.readouterr().out)["configs"]
    ok, failed = (tmp_path / ok_folder("16 2 2", 0)), (tmp_path / ok_folder("32 4 1", 1))
    expected = json.loads((ok / "summary.json").read_text())
    timeline = (ok / "timeline.json").read_text()
    for folder in (ok, failed):
        (folder / "summary.json").unlink()
        (folder / "timeline.json").unlink(missing_ok=True)
    # config 1's four ranks, traced elsewhere: all but rank 24
    for rank in (0, 8, 16):
        stand_in_trace(cfg("32 4 1").layout(), rank, cfg("32 4 1").model,
                       {"shapes_only": True}).write(failed)
    code = trace_cli.main(argv + ["--collect", "--config", "9 2 2"])
    collected = json.loads(capsys.readouterr().out)["configs"]
    assert code == 1 and [c["status"] for c in collected] == ["ok", "failed", "invalid"]
    got = json.loads((ok / "summary.json").read_text())
    same = ("status", "complete", "ranks_traced", "reduction_pct", "timeline", "folder")
    assert {k: got[k] for k in same} == {k: expected[k] for k in same}
    assert [(r["rank"], r["stage"], r["status"], r["files"], r["stats"]) for r in got["ranks"]] == [
        (r["rank"], r["stage"], r["status"], r["files"], r["stats"]) for r in expected["ranks"]]
    assert (ok / "timeline.json").read_text() == timeline
    summary = json.loads((failed / "summary.json").read_text())
    assert [r["status"] for r in summary["ranks"]] == ["ok", "ok", "ok", "failed"]
    assert summary["error"] == "rank 24: no rank_24.trace.jsonl: see fake_rank_24.log"
    assert summary["shapes_only"] is True and (failed / "timeline.json").is_file()
    assert traced[1]["status"] == collected[1]["status"] == "failed"


def ok_folder(line, index):
    return cfg(line, index=index).folder_name()


def test_trace_plain_table_when_not_a_terminal(tmp_path, stand_in, capsys):
    code = trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "24 3 1", "--output-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["#", "config", "model", "ranks", "traced", "reduction", "status", "time", "folder"]
    assert "ok" in lines[1].split() and "87.50%" in lines[1] and ok_folder("16 2 2", 0) in lines[1]
    assert "invalid" in lines[2] and "skipped: 4 layers of model tiny do not split evenly into PP = 3" in lines[2]
    assert lines[-1] == f"1 traced, 0 failed, 1 invalid; folders in {tmp_path}"
    assert "\x1b[" not in out + err


def test_trace_strict_and_nothing_valid(tmp_path, stand_in, capsys):
    assert trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "24 3 1", "--output-dir", str(tmp_path),
                           "--strict"]) == 1
    assert trace_cli.main(["--model", "tiny", "--config", "24 3 1", "--output-dir", str(tmp_path)]) == 1


def test_rich_table_on_a_terminal(tmp_path):
    results = run_batch(parse_configs(["16 2 2", "24 3 1"]), tmp_path, tracer=stand_in_tracer,
                        isolation="inline", progress=False)
    tty = FakeTTY()
    trace_cli.print_summary(results, file=tty)
    text = tty.getvalue()
    assert "fake-rank traces" in text and "87.50%" in text and ("┃" in text or "│" in text)


def test_trace_usage_errors_exit_2(tmp_path, capsys):
    assert trace_cli.main(["--configs", str(tmp_path / "nope.txt")]) == 2
    assert trace_cli.main(["--config", "16 2"]) == 2
    assert trace_cli.main(["--config", "16 2 2", "--model", "7b"]) == 2
    err = capsys.readouterr().err
    assert "cannot read config file" in err and "expected 3 to 5 numbers" in err and "unknown model '7b'" in err


def test_print_ranks(capsys):
    code = trace_cli.main(["--config", "8192 16 8", "--config", "100 3 2", "--model", "175", "--print-ranks"])
    out, err = capsys.readouterr()
    assert code == 0
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
    assert [int(r[11]) for r in rows] == [512 * s for s in range(16)]
    assert {(r[14], r[15], r[16], r[17]) for r in rows} == {
        ("175B", "0", "8", cfg("8192 16 8", model="175").folder_name())}
    # the rest of the line: the pretrain_gpt.py flags of the model
    flags = {" ".join(r[18:]) for r in rows}
    assert len(flags) == 1 and flags.pop().startswith("--num-layers 96 --hidden-size 12288 --num-attention-heads 96")
    assert "config 1 (100 3 2) is invalid" in err
    trace_cli.main(["--config", "64 2 2 1 4", "--num-experts", "8", "--disable-bias-linear", "--sequence-parallel",
                    "--print-ranks", "--json"])
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert [(r["rank"], r["stage"], r["ep_rank"]) for r in ranks] == [
        (0, 0, 0), (2, 0, 1), (4, 0, 2), (6, 0, 3), (32, 1, 0), (34, 1, 1), (36, 1, 2), (38, 1, 3)]


def test_default_config_is_8192_2_2(capsys):
    assert trace_cli.main(["--print-ranks"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[1], r[2], r[3], r[11]) for r in rows] == [("8192", "2", "2", "0"), ("8192", "2", "2", "4096")]


def test_add_trace_parser_registers_a_subcommand():
    import argparse

    parser = argparse.ArgumentParser(prog="megatron-dynapipe")
    trace_cli.add_trace_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["trace", "--config", "8 2 2", "--shapes-only", "--json"])
    assert args.func is trace_cli.run_trace and args.shapes_only is True and args.json
    assert parser.parse_args(["trace", "--real-compute"]).shapes_only is False
    assert parser.parse_args(["trace"]).shapes_only is None
    with pytest.raises(SystemExit):
        parser.parse_args(["trace", "--real-compute", "--shapes-only"])


# --------------------------------------------------------------------------------------------
# example scripts (subprocesses, like a user runs them)


def run_script(name, *args, env=None, timeout=600):
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)


def test_rank_mapping_script_passes():
    out = run_script("test_rank_mapping.sh")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout and "all" in out.stdout.splitlines()[-1]


def test_rank_mapping_script_fails_on_a_wrong_expectation(tmp_path):
    wrong = tmp_path / "expect.txt"
    wrong.write_text("8192 2 2 : 0 4096\n16 4 1 : 0 4 8 13   # 13 is wrong\n")
    out = run_script("test_rank_mapping.sh", str(wrong))
    assert out.returncode != 0
    assert "FAIL 16 4 1" in out.stdout and "PASS 8192 2 2" in out.stdout


@pytest.mark.slow
def test_batch_config_script_passes(tmp_path):
    out = run_script("test_batch_config.sh", env={"WORK_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout


def test_batch_config_script_fails_on_a_wrong_expectation(tmp_path):
    wrong = tmp_path / "expect.txt"  # nothing valid to trace: fast
    wrong.write_text("12 2 4 : ok SIM_GPT_tiny_Config0_WS12  # it is invalid\n24 3 1 : invalid\n")
    out = run_script("test_batch_config.sh", str(wrong), env={"WORK_DIR": str(tmp_path / "w")})
    assert out.returncode == 1
    assert "FAIL 12 2 4 : status invalid, expected ok" in out.stdout and "PASS 24 3 1" in out.stdout


def test_update_pretrain_gpt_builds_megatron_commands(tmp_path):
    out = run_script("update_pretrain_gpt.sh", "8192 2 2", "4096 16 4",
                     env={"MEGATRON_LM_DIR": str(tmp_path / "Megatron-LM"), "DRY_RUN": "1",
                          "MODEL_SIZE": "175", "OUTPUT_DIR": str(tmp_path / "out")})
    assert out.returncode == 0, out.stdout + out.stderr
    commands = [line for line in out.stdout.splitlines() if " -m megatron_dynapipe.megatron.launcher " in line]
    assert len(commands) == 2 + 16
    first = commands[0]
    for flag in ("--is-scaling-mode", "--fake-world-size 8192", "--fake-pp 2", "--fake-tp 2",
                 "--fake-current-rank-id 0", "--hidden-size 12288", "--num-layers 96",
                 "--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2",
                 "--trace-dir " + str(tmp_path / "out" / "SIM_GPT_175B_Config0_WS8192_PP2_TP2_DP2048_"),
                 "--trace-start 1", "--trace-iters 1",
                 str(tmp_path / "Megatron-LM" / "pretrain_gpt.py")):
        assert flag in first, flag
    assert "--fake-current-rank-id 4096" in commands[1]
    assert [c.split("--fake-current-rank-id ")[1].split()[0] for c in commands[2:]] == [
        str(256 * s) for s in range(16)]


def test_update_pretrain_gpt_passes_the_model_and_training_flags_to_megatron(tmp_path):
    """TRACE_ARGS describe the model and how it trains on both ways: each rank's pretrain_gpt.py
    command carries them, and the configs they do not fit are skipped before any command."""
    flags = "--bf16 --disable-bias-linear --sequence-parallel --num-layers-per-virtual-pipeline-stage 1"
    out = run_script("update_pretrain_gpt.sh", "64 2 2 1 4 experts=8", "64 2 2 nmb=3",
                     env={"MEGATRON_LM_DIR": str(tmp_path / "Megatron-LM"), "DRY_RUN": "1", "MODEL_SIZE": "tiny",
                          "TRACE_ARGS": flags, "OUTPUT_DIR": str(tmp_path / "out")})
    assert out.returncode == 0, out.stdout + out.stderr
    commands = [line for line in out.stdout.splitlines() if " -m megatron_dynapipe.megatron.launcher " in line]
    assert len(commands) == 2 * 4  # PP 2 x EP 4
    for command in commands:
        for flag in (*flags.split(" --"), "--num-experts 8", "--expert-model-parallel-size 4"):
            assert (flag if flag.startswith("--") else "--" + flag) in command
    assert "config 1 (64 2 2) is invalid: interleaved 1F1B runs micro-batches in groups of PP=2" in out.stderr


@pytest.mark.slow
def test_update_pretrain_gpt_default_run_on_cpu(tmp_path):
    start = time.perf_counter()
    out = run_script("update_pretrain_gpt.sh", env={"OUTPUT_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert time.perf_counter() - start < 600
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith("SIM_GPT_6.7B_Config0_WS8192_PP2_TP2_DP2048_"), folder.name
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["shapes_only"] is True and summary["timeline"]
    assert {"fake_rank_0.log", "fake_rank_4096.log", "rank_0.trace.jsonl", "rank_4096.trace.jsonl",
            "summary.json"} <= {p.name for p in folder.iterdir()}


# --------------------------------------------------------------------------------------------
# with the real tracer


@pytest.mark.slow
def test_real_tracer_isolates_a_failing_config(tmp_path, monkeypatch, capsys):
    """One config whose trace raises (a rank outside the job) amid real traces."""
    from megatron_dynapipe.tracer import fake_rank

    real = fake_rank.trace_fake_rank

    def sometimes_broken(layout, rank, model, **kw):
        if layout.world_size == 32:
            raise RuntimeError("injected failure")
        return real(layout, rank, model, **kw)

    monkeypatch.setattr(batch_run, "_default_tracer", lambda: sometimes_broken)
    code = trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "32 2 2", "--config", "8 4 1",
                           "--output-dir", str(tmp_path), "--json", "--shapes-only"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 1
    assert [c["status"] for c in summary["configs"]] == ["ok", "failed", "ok"]
    assert "injected failure" in summary["configs"][1]["error"]
    for c in (summary["configs"][0], summary["configs"][2]):
        for r in c["ranks"]:
            assert (Path(c["folder"]) / f"rank_{r['rank']}.trace.jsonl").stat().st_size > 0


# --------------------------------------------------------------------------------------------
# the trace command's edges: bad lines, bad places, Ctrl-C


def test_an_unparsable_config_is_skipped_and_the_others_are_traced(tmp_path, stand_in, capsys):
    code = trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "16 two 2",
                           "--output-dir", str(tmp_path), "--json", "--isolation", "inline"])
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert code == 1 and summary["exit_code"] == 1
    assert [c["status"] for c in summary["configs"]] == ["ok"]
    assert len(summary["unparsable"]) == 1 and "--config #2: PP must be an integer, got 'two'" in summary["unparsable"][0]
    assert "skipping a config that cannot be parsed: --config #2" in err


def test_a_configs_file_line_that_cannot_be_parsed_names_its_line(tmp_path, stand_in, capsys):
    path = tmp_path / "configs.txt"
    path.write_text("# layouts\n16 2 2\n16 2 2 mbs=x\n")
    code = trace_cli.main(["--model", "tiny", "--configs", str(path), "--output-dir", str(tmp_path / "t"),
                           "--isolation", "inline"])
    assert code == 1 and f"{path}:3: mbs must be an integer" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--config", ""], "no configs: --config holds only blanks or comments"),
    (["--config", "1 2"], "no config could be parsed: --config: expected 3 to 5 numbers"),
    (["--output-dir", "{file}"], "is a file, not a folder: choose a folder"),
    (["--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["--jobs", "2", "--isolation", "inline"], "drop --isolation inline, or use --jobs 1"),
    (["--output-dir", "{file}/below"], "is not a writable folder"),
    (["--cost-model", "/missing/profile.json"], "cost model file /missing/profile.json not found"),
    (["--cost-model", "gpt-6.7b-a100", "--model", "6.7", "--config", "16 1 16"], "has no profile for tp=16"),
])
def test_what_would_fail_every_rank_is_refused_before_any_starts(tmp_path, args, message, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(batch_run, "_default_tracer", lambda: lambda *a, **k: calls.append(a))
    (tmp_path / "file").write_text("")
    argv = ["--model", "tiny"] + [a.format(file=tmp_path / "file") for a in args]
    if "--config" not in argv:
        argv += ["--config", "16 2 2"]
    if "--output-dir" not in argv:
        argv += ["--output-dir", str(tmp_path / "traces")]
    assert trace_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert calls == [] and not (tmp_path / "traces").exists()


def test_ctrl_c_marks_the_folder_interrupted_and_stops_the_batch(tmp_path, monkeypatch, capsys):
    def tracer(layout, rank, model, **options):
        if rank > 0:
            raise KeyboardInterrupt
        return stand_in_tracer(layout, rank, model, **options)

    monkeypatch.setattr(batch_run, "_default_tracer", lambda: tracer)
    code = trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "32 2 2",
                           "--output-dir", str(tmp_path), "--isolation", "inline"])
    out, err = capsys.readouterr()
    assert code == 130
    folder = tmp_path / ok_folder("16 2 2", 0)
    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["status"], summary["complete"]) == ("interrupted", False)
    assert summary["error"] == "interrupted after 1 of 2 ranks" and len(summary["ranks"]) == 1
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # the second config never started
    assert "interrupted; " + str(folder) in err and "Traceback" not in err
    assert "1 interrupted" in out


def test_trace_defaults_to_the_model_of_the_example_script(capsys):
    assert trace_cli.main(["--config", "8192 16 8", "--print-ranks"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert len(rows) == 16 and {r[14] for r in rows} == {"6.7B"}


def _report_pid_and_argument(value):
    print(f"child {os.getpid()} says {value}")
    return {"value": value, "pid": os.getpid()}


@pytest.mark.slow
def test_ranks_start_as_fresh_interpreters_when_cuda_is_seen_here(tmp_path, monkeypatch):
    """A forked child cannot use CUDA once this process has so much as counted its GPUs; a
    spawned child has no CUDA of this process. The same rank work through a real spawn."""
    import functools

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert isolation.rank_start_method() == "spawn"
    monkeypatch.undo()
    assert isolation.rank_start_method() == ("spawn" if torch.cuda.is_available() else "fork")
    log_path = tmp_path / "rank.log"
    outcome = isolation.run_forked(functools.partial(_report_pid_and_argument, 41), log_path, 120, "spawn")
    assert outcome["ok"] and outcome["value"] == 41 and outcome["pid"] != os.getpid()
    assert f"child {outcome['pid']} says 41" in log_path.read_text()


def test_a_rank_whose_process_cannot_start_fails_alone(tmp_path):
    """A spawned child gets its work by pickling: a lambda cannot be sent, so that rank's
    process never starts; the rank beside it still runs."""
    import functools

    jobs = [(lambda: {}, tmp_path / "a.log"), (functools.partial(_report_pid_and_argument, 7), tmp_path / "b.log")]
    outcomes = {i: o for i, o, _ in isolation.run_forked_many(jobs, 2, 120, "spawn")}
    assert not outcomes[0]["ok"] and outcomes[0]["error"].startswith("cannot start the rank process: ")
    assert outcomes[1]["ok"] and outcomes[1]["value"] == 7


def test_trace_takes_megatron_model_and_precision_flags(tmp_path, capsys):
    code = trace_cli.main(["--model", "tiny", "--swiglu", "--normalization", "RMSNorm", "--group-query-attention",
                           "--num-query-groups", "2", "--position-embedding-type", "rope", "--ffn-hidden-size", "384",
                           "--fp16", "--config", "8 2 2", "--shapes-only", "--output-dir", str(tmp_path), "--json",
                           "--no-progress", "--jobs", "1"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0, summary
    traces = [RankTrace.read(p) for p in sorted(Path(summary["configs"][0]["folder"]).glob("rank_*.trace.jsonl"))]
    assert [t.rank for t in traces] == [0, 4]
    for trace in traces:
        m = trace.model
        assert (m["swiglu"], m["normalization"], m["num_query_groups"], m["position_embedding_type"],
                m["ffn_hidden_size"], m["dtype"]) == (True, "RMSNorm", 2, "rope", 384, "float16")
        tp = {op.bytes for op in trace.comm_ops if op.group_name == "TENSOR_MODEL_PARALLEL_GROUP"
              and op.kind == "all_reduce" and op.phase == "forward" and op.shape[-1] == 128}
        assert tp == {256 * 1 * 128 * 2}  # tiny: [seq 256, mbs 1, hidden 128] in float16 (not the loss's)


def test_trace_refuses_num_query_groups_without_group_query_attention(tmp_path, capsys):
    assert trace_cli.main(["--model", "tiny", "--num-query-groups", "2", "--output-dir", str(tmp_path)]) == 2
    assert "--num-query-groups needs --group-query-attention" in capsys.readouterr().err
