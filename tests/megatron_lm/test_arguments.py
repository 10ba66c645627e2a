"""Megatron arguments of DynaPipe and of the fake-rank tracer, on plain argparse parsers."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from megatron_dynapipe import add_arguments, chain_providers, validate_dynapipe_args
from megatron_dynapipe.megatron_lm.arguments import (
    DYNAPIPE_GROUP,
    TRACER_GROUP,
    DynapipeArgumentError,
    training_spec_from_args,
)
from megatron_dynapipe.planning.fast_mode import FAST_MODE_ENV
from megatron_dynapipe.planning.spec import TrainingSpec
from megatron_dynapipe.planning.types import RecomputeType


def parse(*argv: str, **megatron) -> argparse.Namespace:
    args = add_arguments(argparse.ArgumentParser()).parse_args(list(argv))
    for name, value in megatron.items():  # what Megatron's own parser and validate_args set
        setattr(args, name, value)
    return args


def validated(*argv: str, **megatron) -> argparse.Namespace:
    megatron.setdefault("calculate_per_token_loss", True)
    return validate_dynapipe_args(parse(*argv, **megatron))


ON = ("--dynapipe", "--dynapipe-memory-limit", "30000")


@pytest.fixture(autouse=True)
def no_env_fast_mode(monkeypatch):
    monkeypatch.delenv(FAST_MODE_ENV, raising=False)


def test_groups_and_defaults():
    parser = add_arguments(argparse.ArgumentParser())
    titles = [g.title for g in parser._action_groups]
    assert DYNAPIPE_GROUP in titles and TRACER_GROUP in titles
    args = parser.parse_args([])
    assert args.dynapipe is False and args.dynapipe_fast_mode is None
    assert args.dynapipe_schedule == ["1f1b", "wait-free-cyclic"]
    assert args.dynapipe_recompute == list(RecomputeType)
    assert (args.dynapipe_seed, args.dynapipe_seqlen_round, args.dynapipe_partition) == (0, None, "dp")  # 8, or by CP
    assert args.is_scaling_mode is False and args.do_trace is False and args.fake_ep == 1
    assert args.fake_rank_order == "tp-cp-ep-dp-pp"
    assert validate_dynapipe_args(args) is args  # off: nothing to check, nothing changed
    assert not hasattr(args, "variable_seq_lengths")


def test_dynapipe_flags_parse():
    args = validated(*ON, "--dynapipe-cost-model", __file__, "--dynapipe-schedule", "1f1b",
                     "--dynapipe-partition", "token_based", "--dynapipe-recompute", "none", "full",
                     "--dynapipe-preprocess-workers", "4", "--dynapipe-kv-host", "10.0.0.1",
                     "--dynapipe-kv-port", "4242", "--dynapipe-seed", "7", "--dynapipe-seqlen-round", "64",
                     "--dynapipe-comm-timeout", "120")
    assert args.dynapipe_memory_limit == 30000.0 and args.dynapipe_cost_model == __file__
    assert args.dynapipe_schedule == ["1f1b"] and args.dynapipe_partition == "token_based"
    assert args.dynapipe_recompute == (RecomputeType.NONE, RecomputeType.FULL)
    assert (args.dynapipe_preprocess_workers, args.dynapipe_kv_host, args.dynapipe_kv_port) == (4, "10.0.0.1", 4242)
    assert (args.dynapipe_seed, args.dynapipe_seqlen_round, args.dynapipe_comm_timeout) == (7, 64, 120.0)
    assert args.variable_seq_lengths is True  # Megatron forces it off; planned batches need it


def test_kv_host_defaults_to_master_addr(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "node-0")
    assert validated(*ON).dynapipe_kv_host == "node-0"
    monkeypatch.delenv("MASTER_ADDR")
    assert validated(*ON).dynapipe_kv_host == "127.0.0.1"


def test_chained_with_another_provider():
    def modelopt_like(parser):
        parser.add_argument_group("modelopt").add_argument("--export-te-mcore-model", action="store_true")
        return parser

    def mutates_only(parser):
        parser.add_argument("--other", type=int, default=3)  # returns None

    provider = chain_providers(None, modelopt_like, mutates_only, add_arguments)
    parser = argparse.ArgumentParser()
    assert provider(parser) is parser
    args = parser.parse_args(["--export-te-mcore-model", "--dynapipe", "--other", "5"])
    assert args.export_te_mcore_model and args.dynapipe and args.other == 5
    with pytest.raises(TypeError, match="not callable"):
        chain_providers("add_arguments")


@pytest.mark.parametrize("env, argv, expected, source", [
    ("true", (), True, "env"),
    ("auto", (), "auto", "env"),
    ("False", (), False, "env"),
    (None, (), False, "default"),
    ("true", ("--dynapipe-fast-mode", "false"), False, "flag"),
    (None, ("--dynapipe-fast-mode",), True, "flag"),
    ("false", ("--dynapipe-fast-mode", "auto"), "auto", "flag"),
])
def test_fast_mode_flag_else_environment(monkeypatch, env, argv, expected, source):
    if env is not None:
        monkeypatch.setenv(FAST_MODE_ENV, env)
    args = validated(*ON, *argv)
    assert args.dynapipe_fast_mode == expected and args.dynapipe_fast_mode_source == source
    assert training_spec_from_args(args).fast_mode == expected


def test_bad_fast_mode_values(monkeypatch, capsys):
    monkeypatch.setenv(FAST_MODE_ENV, "sometimes")
    with pytest.raises(DynapipeArgumentError, match=r"DYNAPIPE_FAST_MODE='sometimes'.*or pass --dynapipe-fast-mode"):
        validated(*ON)
    with pytest.raises(SystemExit):
        parse("--dynapipe-fast-mode", "maybe")
    assert "use true, false or auto" in capsys.readouterr().err


@pytest.mark.parametrize("argv, megatron, fix", [
    (("--dynapipe",), {}, "--dynapipe needs --dynapipe-memory-limit MB"),
    (("--dynapipe", "--dynapipe-memory-limit", "-5"), {}, "must be positive"),
    (ON + ("--dynapipe-cost-model", "/nonexistent.json"), {}, "or drop the flag for the analytical model"),
    (ON + ("--dynapipe-hardware", "no-such-gpu"), {}, "give one of those names or a hardware file's path, or drop"),
    (ON + ("--dynapipe-preprocess-workers", "0"), {}, "pass e.g. --dynapipe-preprocess-workers 2"),
    (ON + ("--dynapipe-kv-port", "70000"), {}, "pass one in 1..65535"),
    (ON + ("--dynapipe-comm-timeout", "0"), {}, "drop it to use the process group's timeout"),
    (ON, {"virtual_pipeline_model_parallel_size": 2, "num_layers": 6, "pipeline_model_parallel_size": 2},
     "make num_layers a multiple of pp x chunks"),
    (ON, {"num_virtual_stages_per_pipeline_rank": 2, "num_layers": 8, "pipeline_model_parallel_size": 2,
          "decoder_first_pipeline_num_layers": 1},
     "the 1 layers of pipeline stage 0 do not split into 2 model chunks: change the virtual pipeline size"),
    (ON, {"num_virtual_stages_per_pipeline_rank": 2, "num_layers": 8, "pipeline_model_parallel_size": 2,
          "decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 6},
     "give only --decoder-first-pipeline-num-layers or --decoder-last-pipeline-num-layers at PP = 2"),
    (ON + ("--dynapipe-schedule", "wait-free-cyclic"),
     {"virtual_pipeline_model_parallel_size": 2, "num_layers": 8, "pipeline_model_parallel_size": 2},
     "interleaved-1f1b"),
    (ON, {"recompute_granularity": "full"}, "pass --recompute-method uniform --recompute-num-layers 1"),
    (ON + ("--dynapipe-recompute", "none"), {"recompute_granularity": "selective"},
     "allow selective or drop --recompute-granularity"),
    (ON, {"num_experts": 8, "moe_token_dispatcher_type": "allgather"}, "--moe-token-dispatcher-type alltoall"),
    (ON, {"enable_cuda_graph": True}, "drop --enable-cuda-graph"),
    (ON, {"sequence_parallel": True, "tensor_model_parallel_size": 16},
     "pass --dynapipe-seqlen-round as a multiple of 16 (got 8)"),
    (ON, {"context_parallel_size": 8}, "pass --dynapipe-seqlen-round as a multiple of 16"),
    (ON, {"num_layers": 2, "pipeline_model_parallel_size": 4}, "lower pp or raise num_layers"),
    (ON + ("--dynapipe-packing", "varlen"), {"transformer_impl": "local"},
     "add --dynapipe-attention sdpa, use --transformer-impl transformer_engine, or --dynapipe-packing pad"),
    (ON + ("--dynapipe-packing", "varlen", "--dynapipe-partition", "uniform"), {},
     "packing varlen cuts micro-batches by dynamic programming"),
    (ON, {"num_layers": 126, "pipeline_model_parallel_size": 16, "decoder_first_pipeline_num_layers": 5,
          "decoder_last_pipeline_num_layers": 5}, "do not split evenly: change --decoder-first-pipeline-num-layers"),
])
def test_validation_errors_name_the_fix(argv, megatron, fix):
    with pytest.raises(DynapipeArgumentError) as info:
        validated(*argv, **megatron)
    message = str(info.value)
    assert fix in message and "\n" not in message


@pytest.mark.parametrize("megatron, allowed", [
    ({}, ["none", "selective", "full"]),
    ({"recompute_granularity": "selective"}, ["selective", "full"]),
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, ["full"]),
])
def test_megatron_recompute_granularity_is_a_floor_for_each_micro_batch(megatron, allowed):
    spec = training_spec_from_args(validated(*ON, calculate_per_token_loss=True, **megatron))
    assert [t.label for t in spec.recompute_types] == allowed


def test_per_token_loss_recommended():
    with pytest.warns(UserWarning, match="--calculate-per-token-loss"):
        validated(*ON, calculate_per_token_loss=False)


@pytest.mark.parametrize("megatron", [
    {"virtual_pipeline_model_parallel_size": 2},  # what Megatron-LM's validate_args derives
    {"num_virtual_stages_per_pipeline_rank": 2},
    {"num_layers_per_virtual_pipeline_stage": 3},  # 12 layers / 2 ranks / 3 a chunk = 2 chunks
])
def test_interleaving_flags_plan_model_chunks(megatron):
    spec = training_spec_from_args(validated(*ON, num_layers=12, pipeline_model_parallel_size=2, **megatron))
    assert (spec.pp, spec.chunks, spec.schedules) == (2, 2, ("interleaved-1f1b",))


def test_training_spec_from_megatron_args():
    args = validated(*ON, "--dynapipe-schedule", "wait-free-cyclic", "--dynapipe-recompute", "selective",
                     num_layers=24, tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
                     data_parallel_size=8, use_distributed_optimizer=True, micro_batch_size=4)
    spec = training_spec_from_args(args)
    assert (spec.num_layers, spec.tp, spec.pp, spec.dp, spec.zero_stage) == (24, 2, 4, 8, 1)
    assert spec.memory_limit_mb == 30000.0 and spec.schedules == ("wait-free-cyclic",)
    assert spec.recompute_types == (RecomputeType.SELECTIVE,) and spec.microbatch_size == 4
    assert spec.packing == "pad"
    packed = validated(*ON, "--dynapipe-packing", "varlen", transformer_impl="transformer_engine", num_layers=24)
    assert training_spec_from_args(packed).packing == "varlen"
    on_local_layers = validated(*ON, "--dynapipe-packing", "varlen", "--dynapipe-attention", "sdpa",
                                transformer_impl="local", num_layers=24)
    assert training_spec_from_args(on_local_layers).packing == "varlen"


@pytest.mark.parametrize("megatron, layers", [
    ({"num_layers": 24, "pipeline_model_parallel_size": 4}, None),  # even: the planner splits them itself
    # Llama 3 405B's split: 126 layers, the first and last stage 7, the 14 in between 8 each
    ({"num_layers": 126, "pipeline_model_parallel_size": 16, "decoder_first_pipeline_num_layers": 7,
      "decoder_last_pipeline_num_layers": 7}, (7,) + (8,) * 14 + (7,)),
    ({"num_layers": 3, "pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 1}, (1, 2)),
    # interleaved: a rank's layers split evenly over its 2 chunks, listed chunk by chunk (chunk 0 of
    # ranks 0 and 1, then chunk 1 of each)
    ({"num_layers": 8, "pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 2,
      "num_virtual_stages_per_pipeline_rank": 2}, (1, 3, 1, 3)),
    # 14 + 2 over 2 ranks x 2 chunks, 4 a chunk; the embedding's on the very first, the loss's on the very last
    ({"num_layers": 14, "pipeline_model_parallel_size": 2, "account_for_embedding_in_pipeline_split": True,
      "account_for_loss_in_pipeline_split": True, "num_virtual_stages_per_pipeline_rank": 2}, (3, 4, 4, 3)),
    # the embedding and the loss count as a layer each: 30 + 2 over 4 stages, 8 a stage, 7 on the ends
    ({"num_layers": 30, "pipeline_model_parallel_size": 4, "account_for_embedding_in_pipeline_split": True,
      "account_for_loss_in_pipeline_split": True}, (7, 8, 8, 7)),
])
def test_the_planner_prices_the_stages_megatron_builds(megatron, layers):
    spec = training_spec_from_args(validated(*ON, calculate_per_token_loss=True, **megatron))
    assert spec.stage_layers == layers and TrainingSpec.from_json(spec.to_json()) == spec


# --------------------------------------------------------------------------------------------
# fake-rank tracer
# --------------------------------------------------------------------------------------------

SCALING = ("--is-scaling-mode", "--fake-world-size", "64", "--fake-pp", "4", "--fake-tp", "2")


def test_do_trace_is_a_real_on_off_flag():
    assert parse("--do-trace").do_trace is True
    assert parse("--do-trace", "--no-do-trace").do_trace is False
    args = validated("--do-trace", "--trace-start", "3", "--trace-iters", "2", "--trace-dir", "out")
    assert (args.trace_start, args.trace_iters, args.trace_dir) == (3, 2, "out")
    with pytest.raises(DynapipeArgumentError, match="--trace-start must be >= 0"):
        validated("--do-trace", "--trace-start", "-1")


def test_fake_exp_is_an_alias_of_fake_ep():
    assert parse("--fake-exp", "4").fake_ep == 4
    assert parse("--fake-ep", "2").fake_ep == 2
    args = validated(*SCALING, "--fake-exp", "4", "--fake-num-experts", "16")
    assert args.fake_ep == 4 and args.fake_num_experts == 16


def test_fake_dp_derived_when_omitted_and_checked_when_given():
    assert validated(*SCALING).fake_dp == 8
    assert validated(*SCALING, "--fake-cp", "2").fake_dp == 4
    assert validated(*SCALING, "--fake-dp", "8").fake_dp == 8
    with pytest.raises(DynapipeArgumentError, match=r"--fake-dp 4 does not match .* = 8: pass --fake-dp 8 or leave it out"):
        validated(*SCALING, "--fake-dp", "4")


def test_fake_layout_parses_and_keeps_its_values():
    args = validated(*SCALING, "--fake-gpus-per-node", "4", "--fake-current-rank-id", "63",
                     "--fake-rank-order", "tp,cp,ep,pp,dp")
    assert (args.fake_world_size, args.fake_pp, args.fake_tp, args.fake_cp) == (64, 4, 2, 1)
    assert (args.fake_gpus_per_node, args.fake_current_rank_id) == (4, 63)
    assert args.fake_rank_order == "tp-cp-ep-pp-dp"


@pytest.mark.parametrize("argv, fix", [
    (("--is-scaling-mode", "--fake-pp", "2"), "--is-scaling-mode needs --fake-world-size N, --fake-tp N"),
    (("--is-scaling-mode", "--fake-world-size", "10", "--fake-pp", "4", "--fake-tp", "1"),
     "--fake-world-size 10 is not divisible by --fake-tp·--fake-pp·--fake-cp = 1·4·1 = 4: make it a multiple of 4"),
    (SCALING + ("--fake-ep", "4"), "--fake-ep 4 needs a mixture-of-experts model: give --fake-num-experts N, a multiple of 4"),
    (SCALING + ("--fake-ep", "4", "--fake-num-experts", "6"), "use a multiple of 4"),
    (SCALING + ("--fake-current-rank-id", "64"), "pass a rank in 0..63"),
    (SCALING + ("--fake-rank-order", "pp,dp,tp"), "--fake-rank-order pp-dp-tp is not a Megatron rank order: use one of tp-cp-ep-dp-pp or tp-cp-ep-pp-dp"),
    (SCALING + ("--fake-ep", "3", "--fake-num-experts", "3"), "--fake-world-size 64 is not divisible by --fake-tp·--fake-ep·--fake-pp = 2·3·4 = 24"),
])
def test_fake_layout_errors_name_the_fix(argv, fix):
    with pytest.raises(DynapipeArgumentError) as info:
        validated(*argv)
    assert fix in str(info.value) and "\n" not in str(info.value)


def test_fake_flags_reject_nonsense_at_parse_time(capsys):
    with pytest.raises(SystemExit):
        parse("--fake-pp", "0")
    assert "must be a positive integer" in capsys.readouterr().err


def test_arguments_stay_light():
    """Parsing and validating pulls in neither torch nor megatron."""
    code = ("import sys, argparse, megatron_dynapipe as m;"
            "a = m.add_arguments(argparse.ArgumentParser()).parse_args(['--dynapipe', '--dynapipe-memory-limit', '1',"
            " '--is-scaling-mode', '--fake-world-size', '8', '--fake-pp', '2', '--fake-tp', '2']);"
            "m.validate_dynapipe_args(a); m.chain_providers(None, m.add_arguments);"
            "bad = [n for n in sys.modules if n.split('.')[0] in ('torch', 'megatron')]; print(bad);"
            "sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dense_model_gets_a_dispatcher_that_allows_variable_lengths():
    # Megatron-LM defaults to the allgather dispatcher, which TransformerConfig refuses together
    # with variable_seq_lengths even without experts; a dense model is switched to alltoall.
    args = validated(*ON, moe_token_dispatcher_type="allgather")
    assert args.moe_token_dispatcher_type == "alltoall" and args.variable_seq_lengths is True


SEARCH = dict(fast_mode="auto", cost_model="gpt-6.7b-a100", schedule=["1f1b"], partition="token_based",
              recompute=["none", "full"], seed=3, seqlen_round=16, max_permutations=4, tokens_per_microbatch=4096)


def _flags(prefix: str) -> list[str]:
    argv = []
    for name, value in SEARCH.items():
        argv += [f"--{prefix}{name.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    return argv


def test_plan_and_megatron_flags_give_the_same_search_settings():
    from megatron_dynapipe.cli import build_parser
    from megatron_dynapipe.planning.flags import planner_settings
    from megatron_dynapipe.planning.spec import TrainingSpec

    plan_args = build_parser().parse_args(["plan", *_flags("")])
    job_args = validated(*ON, *_flags("dynapipe-"), num_layers=4, pipeline_model_parallel_size=2,
                         tensor_model_parallel_size=1, data_parallel_size=1)
    expected = dict(fast_mode="auto", schedules=("1f1b",), recompute_types=(RecomputeType.NONE, RecomputeType.FULL),
                    partition="token_based", seed=3, seqlen_round=16, max_permutations=4,
                    tokens_per_microbatch=4096, packing="pad", documents="whole")
    assert planner_settings(plan_args) == expected
    assert planner_settings(job_args, prefix="dynapipe-") == expected
    spec = training_spec_from_args(job_args)
    assert {k: getattr(spec, k) for k in expected} == expected
    assert plan_args.cost_model == job_args.dynapipe_cost_model == "gpt-6.7b-a100"  # a shipped name, accepted
    assert isinstance(TrainingSpec(**planner_settings(plan_args)), TrainingSpec)


def test_a_missing_cost_model_names_the_megatron_flag():
    with pytest.raises(DynapipeArgumentError, match=r"pass --dynapipe-cost-model PATH .*\(gpt-0\.94b-h100-sdpa, gpt-6\.7b-a100, "
                                                   r"gpt-6\.7b-h100\)"):
        validated(*ON, "--dynapipe-cost-model", "no-such-profile")


def test_a_job_on_dynapipe_hardware_plans_its_layout_as_search_prices_it():
    from megatron_dynapipe.hardware.pricing import Pricing
    from megatron_dynapipe.megatron_lm.pretrain_hooks import _cost_model

    job = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, padded_vocab_size=128,
               seq_length=128, max_position_embeddings=128, bf16=True, tensor_model_parallel_size=2,
               sequence_parallel=True, context_parallel_size=1)
    args = validated(*ON, "--dynapipe-hardware", "h100", **job)
    pricing = _cost_model(args)
    assert isinstance(pricing, Pricing) and pricing.profile is None  # the device's roofline prices the layers
    assert (pricing.hardware.name, pricing.dtype, pricing.tp, pricing.sequence_parallel) == (
        "H100-80GB-SXM", "bfloat16", 2, True)
    assert "all-gathers" in pricing.stage_costs(training_spec_from_args(args)).model.describe()
    # with a profile, the profile prices the layers; without the flag the job plans with it alone
    profiled = _cost_model(validated(*ON, "--dynapipe-hardware", "h100", "--dynapipe-cost-model", "gpt-6.7b-a100",
                                     **dict(job, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=16384)))
    assert profiled.profile is not None and profiled.profile.hidden_size == 4096
    alone = _cost_model(validated(*ON, "--dynapipe-cost-model", "gpt-6.7b-a100",
                                  **dict(job, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=16384)))
    assert type(alone) is type(profiled.profile)


@pytest.mark.parametrize("megatron, packs", [
    ({"transformer_impl": "transformer_engine"}, True),
    ({"transformer_impl": "local"}, False),  # megatron-core's unfused core refuses THD rows
    ({"transformer_impl": "local", "dynapipe_attention": "sdpa"}, True),
])
def test_which_attention_cores_take_packed_rows(megatron, packs):
    from megatron_dynapipe.megatron_lm.arguments import core_takes_packed_rows

    args = parse(*ON, **megatron)
    assert core_takes_packed_rows(args) is packs
    if not packs:
        with pytest.raises(DynapipeArgumentError, match="--dynapipe-packing varlen runs packed"):
            validated(*ON, "--dynapipe-packing", "varlen", **megatron)
    else:
        assert training_spec_from_args(validated(*ON, "--dynapipe-packing", "varlen", **megatron)).packed
