"""megatron-core on CPU over gloo: real processes, real megatron-core.

(a) one training iteration of the tiny GPT with megatron-core's own schedules (1F1B at PP=2, and
    TP=2) matches a single-process PP=1 run: per-micro-batch losses, every parameter gradient,
    the grad norm and the updated weights;
(b) the patch guard fails loudly when an upstream spot changes;
(c) enable/disable are idempotent and restore the originals.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from megatron_dynapipe.compat import cpu_compat
from megatron_dynapipe.compat.patching import UpstreamChanged, megatron_core_version
from megatron_dynapipe.local_ranks import run_local_ranks

CFG_KW = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_layers=4,
    vocab_size=128,
    max_sequence_length=64,
)
NUM_MICROBATCHES = 4
MICRO_BATCH_SIZE = 2
SEQ_LENGTH = 16
RTOL, ATOL = 1e-5, 1e-7
TIMEOUT = 150  # seconds per multi-process run; importing megatron-core takes ~10 s per rank here


# --------------------------------------------------------------------------------------------
# What each rank runs (module level so that spawn pickles it by reference)
# --------------------------------------------------------------------------------------------


def _train_one_iteration(
    rank, world_size, tp, pp, vpp=None, reference_weights=None, **config_overrides
):
    """Build this rank's stage (or virtual-stage chunks), wrap it in megatron DDP, run one
    iteration of ``get_forward_backward_func()``, finalize grads, take an SGD step with grad
    clipping. Returns what the parent compares, keyed by single-process parameter names.
    With ``reference_weights``, first checks in-rank that the stage holds exactly its slice of
    them (bit for bit)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dynapipe.config.model import ModelSpec
    from megatron_dynapipe.gpt.tiny import (
        build_tiny_gpt,
        destroy_model_parallel,
        init_model_parallel,
        mean_loss_forward_step,
        random_micro_batches,
        reference_name,
        reference_shard,
    )

    cfg = ModelSpec(**CFG_KW)
    cpu_compat.enable_cpu_mode()
    init_model_parallel(tp, pp, virtual_pp=vpp)
    try:
        stages = [None] if vpp is None else list(range(vpp))
        chunks = [build_tiny_gpt(cfg, vp_stage=vp, **config_overrides) for vp in stages]
        params = [
            (reference_name(chunk, name), param)
            for chunk in chunks
            for name, param in chunk.named_parameters()
        ]
        weights = {name: p.detach().clone() for name, p in params}
        if reference_weights is not None:
            for name, param in params:
                assert torch.equal(param, reference_shard(reference_weights[name], param)), name

        ddp = [
            DistributedDataParallel(
                chunk.config,
                DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                chunk,
                disable_bucketing=index > 0,
            )
            for index, chunk in enumerate(chunks)
        ]
        config = chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = [m.no_sync for m in ddp] if vpp else ddp[0].no_sync
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="sgd", lr=0.1, weight_decay=0.0, clip_grad=1.0, log_num_zeros_in_grad=True
            ),
            ddp,
        )
        for m in ddp:
            m.zero_grad_buffer()
        optimizer.zero_grad()

        batches = random_micro_batches(NUM_MICROBATCHES, MICRO_BATCH_SIZE, SEQ_LENGTH, cfg.vocab_size, seed=7)
        losses = get_forward_backward_func()(
            forward_step_func=mean_loss_forward_step,
            data_iterator=[iter(batches) for _ in ddp] if vpp else iter(batches),
            model=ddp,
            num_microbatches=NUM_MICROBATCHES,
            seq_length=SEQ_LENGTH,
            micro_batch_size=MICRO_BATCH_SIZE,
            forward_only=False,
        )
        grads = {name: p.main_grad.detach().clone() for name, p in params}
        success, grad_norm, num_zeros = optimizer.step()
        assert success
        updated = {name: p.detach().clone() for name, p in params}
        return {
            "spot_calls": {entry["spot"]: entry["calls"] for entry in cpu_compat.describe()},
            "losses": [float(d["lm loss"]) for d in losses],
            "weights": weights,
            "grads": grads,
            "grad_norm": grad_norm,
            "num_zeros": num_zeros,
            "updated": updated,
            "tp_rank": torch.distributed.get_rank() % tp,
            "tp": tp,
            "partition": {
                name: p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1
                for name, p in params
            },
        }
    finally:
        destroy_model_parallel()
        cpu_compat.disable_cpu_mode()


def _reference_runs(rank, world_size):
    """Single process, PP=1: the reference, and the same with full activation recompute."""
    return {
        "plain": _train_one_iteration(rank, world_size, 1, 1),
        "recompute": _train_one_iteration(
            rank,
            world_size,
            1,
            1,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
        ),
    }


def _two_rank_runs(rank, world_size, reference_weights):
    """The two-rank layouts, one after another in the same two processes (a spawn costs ~10 s of
    imports here): PP=2 1F1B, PP=2 interleaved (two virtual stages per rank), TP=2."""
    return {
        # Shapes are exchanged before each p2p, as with variable sequence lengths. (megatron-core
        # refuses variable_seq_lengths with the default MoE dispatcher, even for a dense model.)
        "pp2-1f1b": _train_one_iteration(
            rank,
            world_size,
            1,
            2,
            reference_weights=reference_weights,
            variable_seq_lengths=True,
            moe_token_dispatcher_type="alltoall",
        ),
        # With two ranks, prev and next stage are the same peer; megatron-core keeps the two
        # directions apart only on the unbatched path (as Megatron-LM runs interleaving:
        # overlap_p2p_comm on, batch_p2p_comm off). Batched, the messages cross.
        "pp2-interleaved": _train_one_iteration(
            rank,
            world_size,
            1,
            2,
            vpp=2,
            reference_weights=reference_weights,
            overlap_p2p_comm=True,
            batch_p2p_comm=False,
        ),
        "tp2": _train_one_iteration(rank, world_size, 2, 1, reference_weights=reference_weights),
    }


# --------------------------------------------------------------------------------------------
# Comparison helpers (parent process)
# --------------------------------------------------------------------------------------------


def _shard(full: torch.Tensor, result: dict, name: str) -> torch.Tensor:
    dim = result["partition"][name]
    if dim < 0:
        return full
    return torch.chunk(full, result["tp"], dim=dim)[result["tp_rank"]]


def _assert_matches_reference(results: list[dict], reference: dict) -> None:
    seen = set()
    for result in results:
        if result["losses"]:  # only the last pipeline stage reports losses
            assert result["losses"] == pytest.approx(reference["losses"], rel=RTOL, abs=0)
        assert result["grad_norm"] == pytest.approx(reference["grad_norm"], rel=RTOL)
        # exact zeros: the unused position-embedding rows, plus a few gradients that are zero in
        # exact arithmetic (key biases) and come out as 0 or ~1e-13 depending on summation order
        assert result["num_zeros"] == pytest.approx(reference["num_zeros"], abs=8)
        for key in ("weights", "grads", "updated"):
            for name, value in result[key].items():
                expected = _shard(reference[key][name], result, name)
                torch.testing.assert_close(
                    value, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key} {name}: {m}"
                )
                seen.add(name)
    assert any(r["losses"] for r in results)
    assert seen == set(reference["grads"]), "some reference parameters are on no rank"


# --------------------------------------------------------------------------------------------
# (a) equivalence with megatron-core's own schedules
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    (runs,) = run_local_ranks(_reference_runs, 1, timeout=TIMEOUT)
    return runs


def _hit(result: dict, *qualnames: str) -> None:
    """Each named spot was entered in that run: the redirect, not luck, made it work on CPU."""
    calls = {label.split(":", 1)[1]: n for label, n in result["spot_calls"].items()}
    missed = [q for q in qualnames if not calls[q]]
    assert not missed, f"redirected spots never entered: {missed}"


COMMON_SPOTS = (
    "GlobalMemoryBuffer.get_tensor",
    "CudaRNGStatesTracker",
    "get_default_causal_mask",
    "_ParamAndGradBuffer.__init__",
    "FP32Optimizer.__init__",
    "get_grad_norm_fp32",
    "local_multi_tensor_l2_norm",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
)


@pytest.mark.slow
def test_reference_is_sane_and_recompute_matches(reference):
    plain = reference["plain"]
    assert len(plain["losses"]) == NUM_MICROBATCHES
    assert all(3.0 < loss < 6.0 for loss in plain["losses"])  # ~ln(128) at init
    assert all(g.abs().sum() > 0 for g in plain["grads"].values())
    assert plain["grad_norm"] > 1.0  # so clip_grad=1.0 really scales the grads
    unused_positions = (CFG_KW["max_sequence_length"] - SEQ_LENGTH) * CFG_KW["hidden_size"]
    assert unused_positions <= plain["num_zeros"] <= unused_positions + 8
    _hit(plain, "forward_backward_no_pipelining", *COMMON_SPOTS)
    # full activation recompute restores RNG states through the redirected state accessors
    _hit(reference["recompute"], "_get_cuda_rng_state", "_set_cuda_rng_state")
    _assert_matches_reference([reference["recompute"]], plain)


@pytest.fixture(scope="module")
def two_ranks(reference):
    runs = run_local_ranks(_two_rank_runs, 2, reference["plain"]["weights"], timeout=TIMEOUT)
    return {layout: [run[layout] for run in runs] for layout in runs[0]}


PP_SPOTS = (
    "P2PCommunicator._communicate",
    "LanguageModule.setup_embeddings_and_output_layer",
    *COMMON_SPOTS,
)


@pytest.mark.slow
def test_pipeline_parallel_1f1b_matches_single_process(reference, two_ranks):
    results = two_ranks["pp2-1f1b"]
    assert not results[0]["losses"] and len(results[1]["losses"]) == NUM_MICROBATCHES
    for result in results:
        _hit(
            result,
            "forward_backward_pipelining_without_interleaving",
            "P2PCommunicator._communicate_shapes",
            *PP_SPOTS,
        )
    _assert_matches_reference(results, reference["plain"])


@pytest.mark.slow
def test_pipeline_parallel_interleaved_matches_single_process(reference, two_ranks):
    results = two_ranks["pp2-interleaved"]
    assert not results[0]["losses"] and len(results[1]["losses"]) == NUM_MICROBATCHES
    for result in results:
        _hit(result, "forward_backward_pipelining_with_interleaving", *PP_SPOTS)
    _assert_matches_reference(results, reference["plain"])


@pytest.mark.slow
def test_tensor_parallel_matches_single_process(reference, two_ranks):
    results = two_ranks["tp2"]
    assert all(len(result["losses"]) == NUM_MICROBATCHES for result in results)
    assert any(
        result["grads"][name].shape != reference["plain"]["grads"][name].shape
        for result in results
        for name in result["grads"]
    ), "nothing was split"
    for result in results:
        _hit(result, "forward_backward_no_pipelining", *COMMON_SPOTS)
    _assert_matches_reference(results, reference["plain"])


# --------------------------------------------------------------------------------------------
# (b) the guard
# --------------------------------------------------------------------------------------------


def _spot(qualname: str) -> cpu_compat.Spot:
    (spot,) = [s for s in cpu_compat.redirected_spots() if s.qualname == qualname]
    return spot


def test_every_spot_matches_installed_megatron_core():
    for spot in cpu_compat.SPOTS:
        cpu_compat.check_spot(spot)


def test_guard_names_spot_when_upstream_source_changed():
    spot = dataclasses.replace(
        _spot("P2PCommunicator._communicate"),
        expects=("device=torch.cuda.current_device()", "torch.cuda.synchronize_v2()"),
    )
    with pytest.raises(UpstreamChanged) as info:
        cpu_compat.check_spot(spot)
    message = str(info.value)
    assert "pipeline_parallel/p2p_communication.py:P2PCommunicator._communicate" in message
    assert "torch.cuda.synchronize_v2()" in message
    assert megatron_core_version() in message


def test_guard_names_spot_when_upstream_attribute_is_gone():
    spot = dataclasses.replace(
        _spot("GlobalMemoryBuffer.get_tensor"), qualname="GlobalMemoryBuffer.get_buffer"
    )
    with pytest.raises(
        UpstreamChanged, match=r"megatron/core/utils\.py:GlobalMemoryBuffer\.get_buffer"
    ):
        cpu_compat.check_spot(spot)


# --------------------------------------------------------------------------------------------
# (c) enable / disable
# --------------------------------------------------------------------------------------------


def _current(spot: cpu_compat.Spot):
    owner = importlib.import_module(spot.module)
    *path, name = spot.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return vars(owner)[name]


def test_enable_disable_idempotent_and_restores_originals():
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.utils as mutils

    assert not cpu_compat.is_enabled()
    spots = cpu_compat.redirected_spots()
    originals = {spot.label: _current(spot) for spot in spots}
    l2_binding = clip_grads.l2_norm_impl
    assert l2_binding is mutils.local_multi_tensor_l2_norm
    try:
        cpu_compat.enable_cpu_mode()
        patched = {spot.label: _current(spot) for spot in spots}
        assert all(patched[label] is not originals[label] for label in originals)
        assert clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm  # binding followed
        cpu_compat.enable_cpu_mode()  # idempotent: nothing wrapped twice
        assert {spot.label: _current(spot) for spot in spots} == patched
        listing = cpu_compat.describe()
        assert [entry["spot"] for entry in listing] == [spot.label for spot in spots]
        assert all(entry["active"] for entry in listing)
        # the checks still run against the originals while enabled
        for spot in spots:
            assert cpu_compat.check_spot(spot) is originals[spot.label]
        # scoped redirection does what it says, and only inside the scope
        with cpu_compat.cuda_as_cpu():
            assert torch.zeros(2, device="cuda").device.type == "cpu"
            assert torch.cuda.current_device() == torch.device("cpu")
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(2, device="cuda")
    finally:
        cpu_compat.disable_cpu_mode()
    cpu_compat.disable_cpu_mode()  # idempotent
    assert {spot.label: _current(spot) for spot in spots} == originals
    assert clip_grads.l2_norm_impl is l2_binding
    assert not any(entry["active"] for entry in cpu_compat.describe())
    assert not cpu_compat.is_enabled()


def test_context_manager_nests_and_restores():
    spot = _spot("forward_backward_pipelining_without_interleaving")
    original = _current(spot)
    with cpu_compat.cpu_mode():
        inner = _current(spot)
        assert inner is not original
        with cpu_compat.cpu_mode():
            assert _current(spot) is inner
        assert _current(spot) is inner  # inner exit leaves the outer's mode on
    assert _current(spot) is original
