"""Batch configurations of the fake-rank tracer: parsing a line, the rules a config must follow
(one test per rule, each reason with its numbers), and the folder it is traced into."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.config.model import MODELS, ModelSpec, get_model
from megatron_dynapipe.config.model_flags import (
    add_model_arguments,
    megatron_model_args,
    model_from_args,
    model_from_megatron_args,
)
from megatron_dynapipe.megatron_lm import scaling_mode
from megatron_dynapipe.tracer import cli as trace_cli
from megatron_dynapipe.tracer.batch_config import (
    ConfigParseError,
    TraceConfig,
    parse_config_line,
    parse_configs,
    read_config_file,
    validate,
)
from megatron_dynapipe.tracer.batch_run import run_batch
from megatron_dynapipe.tracer.trace_format import RankTrace

from stand_in import CALLS, cfg, stand_in_tracer

TINY = get_model("tiny")
NO_BIAS = dataclasses.replace(TINY, add_bias_linear=False)  # MoE at expert TP > 1 allows no biases


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


def test_a_lines_model_is_built_with_the_commands_layers():
    """model=NAME changes the size, not the layers the command builds (trace's: Megatron-LM's)."""
    te_tiny = dataclasses.replace(get_model("tiny"), attention="transformer_engine")
    c = cfg("64 2 2 model=6.7", model=te_tiny)
    assert c.model == dataclasses.replace(MODELS["6.7B"], attention="transformer_engine")
    assert c.model.label == "6.7B-te" and cfg("64 2 2", model=te_tiny).model is te_tiny


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


