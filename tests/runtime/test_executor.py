"""The plan executor inside megatron-core: real processes, gloo, a tiny GPTModel.

Equivalence: one iteration over a PlannedBatch of variable-length micro-batches, run by
DynaPipe's forward-backward function at PP=2, TP=2 x PP=2, PP=2 x CP=2 (each sequence split over
two ranks that pass keys and values round a ring) and PP=2 x DP=2, gives the losses and
parameter gradients of a single process running the same micro-batches without pipelining (rtol
1e-5), for 1F1B and wait-free-cyclic plans and for plans that recompute some micro-batches
(selective and full). Per-micro-batch recompute is shown to really recompute (the forward keeps
fewer bytes for backward: none > selective > full) and to leave gradients bit-identical.

Failures: a rank that dies, or stalls, makes its pipeline peer fail fast with a message naming
the peer and the micro-batch.

Each multi-process spawn covers several plans (starting a rank costs ~10 s of imports here).
"""

from __future__ import annotations

import os
import re
import sys
import time

import pytest
import torch

from megatron_dynapipe.local_ranks import LocalRanksError, run_local_ranks

CFG_KW = dict(hidden_size=64, num_attention_heads=4, num_layers=4, vocab_size=128,
              max_sequence_length=64)
# (size, padded sequence length) of each micro-batch; 0, 2 and 4 share a shape, so the bytes their
# forwards keep for backward can be compared across recompute choices.
SHAPES_A = [(2, 16), (1, 32), (2, 16), (3, 8), (2, 16), (1, 24)]
SHAPES_B = [(1, 40), (2, 8), (4, 8), (1, 16)]  # the second data-parallel rank's micro-batches
RECOMPUTE_MIX = ["none", "full", "selective", "none", "full", "selective"]  # 0, 2, 4: none, selective, full
RTOL, ATOL = 1e-5, 1e-7
TIMEOUT = 240


# --------------------------------------------------------------------------------------------
# Data, plans, model (module level: spawn pickles functions by reference)
# --------------------------------------------------------------------------------------------


def _microbatches(shapes, seed):
    """Deterministic variable-length samples, padded to each micro-batch's length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for index, (size, seq) in enumerate(shapes):
        lengths = torch.randint(max(1, seq // 2), seq + 1, (size,), generator=g)
        lengths[0] = seq  # the longest sample sets the padded length
        positions = torch.arange(seq)
        mask = (positions[None, :] < lengths[:, None]).float()
        tokens = torch.randint(1, CFG_KW["vocab_size"], (size, seq), generator=g) * mask.long()
        labels = torch.randint(1, CFG_KW["vocab_size"], (size, seq), generator=g) * mask.long()
        out.append({"tokens": tokens, "labels": labels, "loss_mask": mask,
                    "position_ids": positions.expand(size, seq).contiguous(),
                    "index": torch.tensor(index)})
    return out


def _plans(schedule, shapes, recompute, pp=2, chunks=1):
    import numpy as np

    from megatron_dynapipe.planning.plan import build_execution_plans
    from megatron_dynapipe.planning.schedules import SCHEDULES
    from megatron_dynapipe.planning.simulator import StageWork
    from megatron_dynapipe.planning.types import MicroBatch

    tokens = np.array([float(b * s) for b, s in shapes])
    cost = np.tile(tokens, (pp, 1))
    work = StageWork(forward=cost, backward=2 * cost, stored=cost / 100, peak=cost / 100,
                     state=np.zeros(pp), comm=np.ones(len(shapes)))
    orders = SCHEDULES[schedule].orders(work, 1e9) if chunks == 1 else SCHEDULES[schedule].orders_for(pp, len(shapes), chunks)
    mbs, first = [], 0
    for size, seq in shapes:
        mbs.append(MicroBatch(tuple(range(first, first + size)), seq))
        first += size
    return build_execution_plans(orders, mbs, recompute, schedule, chunks=chunks)


SAVED: list = []  # (micro-batch index, bytes saved for backward by its forward), per process


def _forward_step(data_iterator, model):
    from megatron_dynapipe.gpt.context_parallel import batch_on_this_cp_rank

    batch = batch_on_this_cp_rank(next(data_iterator))
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    SAVED.append((int(batch["index"]), saved[0]))

    def loss_func(per_token_loss):
        mask = batch["loss_mask"].view(-1).float()
        loss = torch.sum(per_token_loss.view(-1).float() * mask)
        num_tokens = mask.sum().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach().clone(), num_tokens.float()])}

    return output, loss_func


def _stage(tp, pp, per_token, ddp=True, cp=1, num_layers=CFG_KW["num_layers"]):
    """This rank's stage of the tiny GPT (DDP-wrapped) after initialising model parallelism."""
    from megatron_dynapipe.gpt.build import wrap_in_ddp
    from megatron_dynapipe.gpt.tiny import (
        build_tiny_gpt,
        init_model_parallel,
        reference_name,
    )

    init_model_parallel(tp, pp, context_parallel_size=cp)
    from megatron_dynapipe.config.model import ModelSpec

    model = build_tiny_gpt(ModelSpec(**{**CFG_KW, "num_layers": num_layers}), calculate_per_token_loss=per_token)
    names = [(reference_name(model, n), p) for n, p in model.named_parameters()]
    if not ddp:
        return model, names
    return wrap_in_ddp(model, model.config), names


def _reference(rank, cases, num_layers=CFG_KW["num_layers"]):
    """Single process, no pipelining: megatron-core's forward_backward_no_pipelining over the
    same micro-batches; per-token gradients divided by the token count as finalize does."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_dynapipe.gpt.tiny import destroy_model_parallel

    out = {}
    model, names = _stage(1, 1, per_token=True, ddp=False, num_layers=num_layers)
    try:
        if rank != 0:
            return out
        for key, (batches, per_token) in cases.items():
            model.config.calculate_per_token_loss = per_token
            model.zero_grad(set_to_none=True)
            losses = forward_backward_no_pipelining(
                forward_step_func=_forward_step, data_iterator=iter(batches), model=[model],
                num_microbatches=len(batches), seq_length=0, micro_batch_size=0)
            tokens = sum(float(b["loss_mask"].sum()) for b in batches)
            scale = 1.0 / tokens if per_token else 1.0
            out[key] = {"losses": [d["lm loss"] for d in losses],
                        "grads": {n: p.grad.detach() * scale for n, p in names}}
    finally:
        destroy_model_parallel()
    return out


def _run_cases(model, names, cases, dp_rank):
    """Run each case through DynaPipe's forward-backward function; grads from DDP's buffers.
    ``model``: this rank's stage, or its list of model chunks (an interleaved pipeline)."""
    from megatron.core import parallel_state

    from megatron_dynapipe.data.batch import PlannedBatch
    from megatron_dynapipe.megatron import get_forward_backward_func

    stage = parallel_state.get_pipeline_model_parallel_rank()
    models = model if isinstance(model, list) else [model]
    results = {}
    for key, case in cases.items():
        shapes = case["shapes"][dp_rank]
        plans = _plans(case["schedule"], shapes, case.get("recompute", "none"),
                       pp=parallel_state.get_pipeline_model_parallel_world_size(), chunks=len(models))
        if "split" in case:  # this DP rank's share of one set of micro-batches
            data = _microbatches(SHAPES_A, seed=case["seeds"][dp_rank])[case["split"][dp_rank]]
        else:
            data = _microbatches(shapes, seed=case["seeds"][dp_rank])
        batch = PlannedBatch(0, plans[stage], data)
        _set_up(models, case)
        del SAVED[:]
        losses = get_forward_backward_func(dynapipe=True)(
            forward_step_func=_forward_step, data_iterator=iter([batch]), model=models,
            num_microbatches=0, seq_length=0, micro_batch_size=0,
            forward_only=case.get("forward_only", False))
        results[key] = {
            "losses": [_over_context_parallel_ranks(d["lm loss"]) for d in losses],
            "grads": {n: p.main_grad.detach().clone() for n, p in names},
            "saved": dict(SAVED),
            "order": [str(i) for i in plans[stage].instructions if i.op.is_compute],
        }
    return results


def _over_context_parallel_ranks(report):
    """A micro-batch's (loss sum, tokens) over its whole sequences: each context-parallel rank
    reports its share (Megatron-LM's training log sums them over the CP group too)."""
    from megatron.core import parallel_state

    report = report.clone()
    torch.distributed.all_reduce(report, group=parallel_state.get_context_parallel_group())
    return report


def _set_up(models, case):
    """Zeroed gradients and the case's loss and output settings on every model chunk's config."""
    for model in models:
        model.zero_grad_buffer()
        model.module.config.calculate_per_token_loss = case.get("per_token", True)
        # Megatron-LM's default: an output sent on is shrunk to one element, backward runs from it
        model.module.config.deallocate_pipeline_outputs = case.get("deallocate", False)


def _layout_info(names):
    from megatron.core import parallel_state

    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "cp": parallel_state.get_context_parallel_world_size(),
        "partition": {n: p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1
                      for n, p in names},
    }


PP2_CASES = {
    "1f1b": dict(schedule="1f1b"),
    "wait-free-cyclic": dict(schedule="wait-free-cyclic", deallocate=True),
    "gpipe": dict(schedule="gpipe"),
    "1f1b-recompute": dict(schedule="1f1b", recompute=RECOMPUTE_MIX),
    "wait-free-recompute-mean-loss": dict(schedule="wait-free-cyclic", recompute=RECOMPUTE_MIX[::-1],
                                          per_token=False),
    "forward-only": dict(schedule="wait-free-cyclic", recompute=RECOMPUTE_MIX, forward_only=True),
}
for _case in PP2_CASES.values():
    _case.update(shapes=[SHAPES_A], seeds=[11])


# Two model chunks a rank; the recompute of virtual stage v = chunk * 2 + stage, per micro-batch
INTERLEAVED_RECOMPUTE = [RECOMPUTE_MIX, RECOMPUTE_MIX[::-1], RECOMPUTE_MIX[1:] + RECOMPUTE_MIX[:1], RECOMPUTE_MIX]
INTERLEAVED_CASES = {
    "interleaved": dict(schedule="interleaved-1f1b", deallocate=True),
    "interleaved-recompute": dict(schedule="interleaved-1f1b", recompute=INTERLEAVED_RECOMPUTE),
    "interleaved-forward-only": dict(schedule="interleaved-1f1b", forward_only=True),
    "interleaved-fixed": dict(schedule="interleaved-1f1b", shapes=[[(2, 16)] * 4], seeds=[13]),
}
for _case in INTERLEAVED_CASES.values():
    _case.setdefault("shapes", [SHAPES_A])
    _case.setdefault("seeds", [11])


# Megatron-LM's --decoder-first-pipeline-num-layers 2 of 6 layers with two chunks a rank (the last
# stage takes the other 4): virtual stages of 1, 2 (chunk 0 of ranks 0, 1) and 1, 2 (chunk 1) layers
UNEVEN_SPLIT = dict(num_layers=6, num_layers_in_first_pipeline_stage=2)


PP1_DP2_CASES = {"1f1b-recompute": dict(schedule="1f1b", recompute=RECOMPUTE_MIX[:3], shapes=[SHAPES_A[:3], SHAPES_A[3:]],
                                         seeds=[11, 11], split=[slice(0, 3), slice(3, 6)])}


def _pp2_work(rank, world_size):
    """Two ranks: the reference (rank 0); PP=1 x DP=2 (the micro-batches split over the two DP
    ranks); PP=2 over every case in PP2_CASES; the fallback to megatron-core's 1F1B for an
    iterator of plain fixed-shape batches."""
    from megatron.core import parallel_state

    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.gpt.tiny import destroy_model_parallel
    from megatron_dynapipe.megatron import get_forward_backward_func

    cpu_compat.enable_cpu_mode()
    batches = _microbatches(SHAPES_A, seed=11)
    fixed = [batches[0], batches[2], batches[4]]  # all (2, 16)
    four_fixed = _microbatches(INTERLEAVED_CASES["interleaved-fixed"]["shapes"][0], seed=13)
    out = {"reference": _reference(rank, {"per-token": (batches, True), "mean": (batches, False),
                                          "fixed": (fixed, True), "four-fixed": (four_fixed, True)})}
    model, names = _stage(1, 1, per_token=True)  # PP=1 x DP=2: the two halves of the batch
    try:
        out["pp1dp2"] = _run_cases(model, names, PP1_DP2_CASES, parallel_state.get_data_parallel_rank())
        out["pp1dp2"]["info"] = _layout_info(names)
    finally:
        destroy_model_parallel()
    model, names = _stage(1, 2, per_token=True)
    try:
        out.update(_run_cases(model, names, PP2_CASES, dp_rank=0))
        model.zero_grad_buffer()
        model.module.config.calculate_per_token_loss = True
        model.module.config.variable_seq_lengths = True  # what validate_dynapipe_args sets
        losses = get_forward_backward_func(dynapipe=True)(
            forward_step_func=_forward_step, data_iterator=iter(fixed), model=[model],
            num_microbatches=3, seq_length=16, micro_batch_size=2)
        out["fallback"] = {"losses": [d["lm loss"] for d in losses],
                           "grads": {n: p.main_grad.detach().clone() for n, p in names}}
        out["info"] = _layout_info(names)
        out["handlers"] = _handlers_alone(model)
    finally:
        destroy_model_parallel()
    for layout, split in (("interleaved", {}), ("uneven-interleaved", UNEVEN_SPLIT)):
        chunks, names = _chunks(pp=2, vpp=2, **split)
        try:
            out[layout] = _run_cases(chunks, names, INTERLEAVED_CASES, dp_rank=0)
            out[layout]["megatron"] = _megatron_interleaved(chunks, names, four_fixed)
            out[layout]["info"] = _layout_info(names)
            out[layout]["chunk_layers"] = [len(chunk.module.decoder.layers) for chunk in chunks]
        finally:
            destroy_model_parallel()
    out["uneven-reference"] = _reference(rank, {"per-token": (batches, True), "four-fixed": (four_fixed, True)},
                                         num_layers=UNEVEN_SPLIT["num_layers"])
    return out


def _chunks(pp, vpp, num_layers=CFG_KW["num_layers"], **split):
    """This rank's ``vpp`` model chunks of the tiny GPT at PP ``pp``, each DDP-wrapped, with
    megatron's per-chunk hooks on the first chunk's config, as Megatron-LM sets them up;
    ``split``: TransformerConfig's uneven-stage fields."""
    from megatron_dynapipe.config.model import ModelSpec
    from megatron_dynapipe.gpt.build import wrap_in_ddp
    from megatron_dynapipe.gpt.tiny import build_tiny_gpt, init_model_parallel, reference_name

    init_model_parallel(1, pp, virtual_pp=vpp)
    chunks = [build_tiny_gpt(ModelSpec(**{**CFG_KW, "num_layers": num_layers}), calculate_per_token_loss=True,
                             vp_stage=v, **split) for v in range(vpp)]
    names = [(reference_name(chunk, n), p) for chunk in chunks for n, p in chunk.named_parameters()]
    ddp = [wrap_in_ddp(chunk, chunk.config) for chunk in chunks]
    chunks[0].config.no_sync_func = [d.no_sync for d in ddp]
    return ddp, names


def _megatron_interleaved(chunks, names, batches):
    """megatron-core's own interleaved 1F1B over fixed-shape ``batches`` (two ranks: the two
    directions kept apart on its unbatched path, as Megatron-LM runs it)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _set_up(chunks, {})
    config = chunks[0].module.config
    config.overlap_p2p_comm, config.batch_p2p_comm = True, False
    size, seq = INTERLEAVED_CASES["interleaved-fixed"]["shapes"][0][0]
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
        num_microbatches=len(batches), seq_length=seq, micro_batch_size=size)
    return {"losses": [d["lm loss"] for d in losses],
            "grads": {n: p.main_grad.detach().clone() for n, p in names}}


def _handlers_alone(model):
    """StageRunner's handlers called one at a time on this rank's stage, with no peer involved:
    what each leaves in the runner's fields, and the shape check of a send before it starts."""
    from megatron.core import parallel_state

    from megatron_dynapipe.data.batch import PlannedBatch
    from megatron_dynapipe.planning.plan import Instruction, Op
    from megatron_dynapipe.runtime.executor import PlanMismatchError, StageRunner

    stage = parallel_state.get_pipeline_model_parallel_rank()
    interleaved = _plans("interleaved-1f1b", SHAPES_A[:2], "none", chunks=2)
    try:
        StageRunner(forward_step_func=_forward_step, model=[model],
                    batch=PlannedBatch(0, interleaved[stage], _microbatches(SHAPES_A[:2], 11)))
    except PlanMismatchError as error:
        refused = str(error)
    plans = _plans("1f1b", SHAPES_A[:2], "none")
    runner = StageRunner(forward_step_func=_forward_step, batch=PlannedBatch(0, plans[stage], _microbatches(SHAPES_A[:2], 11)),
                         model=[model])
    seen = {"shape_of_0": runner.shape_of(0), "interleaved": refused}
    if stage != 0:
        return seen
    runner.step(0, Instruction(Op.LOAD_INPUT, 0))
    seen["input_after_load"] = runner.inputs[(0, 0)]  # (chunk, micro-batch)
    runner.step(1, Instruction(Op.FORWARD, 0))
    seen["output_shape"] = tuple(runner.outputs[(0, 0)].shape)
    seen["tokens"] = int(runner.total_num_tokens)
    runner.outputs[(0, 0)] = runner.outputs[(0, 0)][:1]  # not what the plan says micro-batch 0 sends
    try:
        runner.step(2, Instruction(Op.SEND_ACT_START, 0, peer=1))
    except PlanMismatchError as error:
        seen["mismatch"] = str(error)
    seen["started"] = len(runner.transfers)
    runner.inputs[(0, 1)] = None
    runner.step(3, Instruction(Op.FREE_BUFFER, 1))
    seen["kept_after_free"] = sorted(runner.inputs)
    return seen


FOUR_RANK_CASES = {
    "tp2pp2": {
        "1f1b-recompute": dict(schedule="1f1b", recompute=RECOMPUTE_MIX),
        "wait-free-cyclic": dict(schedule="wait-free-cyclic", recompute=RECOMPUTE_MIX[::-1], deallocate=True),
    },
    "pp2cp2": {  # every sequence split over two ranks, which pass keys and values round their ring
        "1f1b-recompute": dict(schedule="1f1b", recompute=RECOMPUTE_MIX),
        "wait-free-cyclic": dict(schedule="wait-free-cyclic", recompute=RECOMPUTE_MIX[::-1], deallocate=True),
    },
    "pp2dp2": {
        "1f1b": dict(schedule="1f1b"),
        "wait-free-recompute": dict(schedule="wait-free-cyclic", recompute=RECOMPUTE_MIX[:4]),
    },
}
for _case in (*FOUR_RANK_CASES["tp2pp2"].values(), *FOUR_RANK_CASES["pp2cp2"].values()):
    _case.update(shapes=[SHAPES_A], seeds=[11])  # DP=1: both TP (CP) ranks of a stage get the same batch
for _case in FOUR_RANK_CASES["pp2dp2"].values():
    _case.update(shapes=[SHAPES_A, SHAPES_B], seeds=[11, 12])
FOUR_RANK_CASES["pp2dp2"]["wait-free-recompute"]["shapes"] = [SHAPES_A[:4], SHAPES_B]


def _four_rank_work(rank, world_size):
    """Four ranks: the references (rank 0), then TP=2 x PP=2, PP=2 x CP=2, and PP=2 x DP=2 (every
    DP rank plans its own micro-batches; per-token loss over both)."""
    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.gpt.tiny import destroy_model_parallel

    cpu_compat.enable_cpu_mode()
    a, b = _microbatches(SHAPES_A, seed=11), _microbatches(SHAPES_B, seed=12)
    out = {"reference": _reference(rank, {"A": (a, True), "A+B": (a + b, True),
                                          "A[:4]+B": (a[:4] + b, True)})}
    for layout, (tp, pp, cp) in (("tp2pp2", (2, 2, 1)), ("pp2cp2", (1, 2, 2)), ("pp2dp2", (1, 2, 1))):
        model, names = _stage(tp, pp, per_token=True, cp=cp)
        try:
            from megatron.core import parallel_state

            dp_rank = parallel_state.get_data_parallel_rank()
            out[layout] = _run_cases(model, names, FOUR_RANK_CASES[layout], dp_rank)
            out[layout]["info"] = _layout_info(names)
        finally:
            destroy_model_parallel()
    return out


# --------------------------------------------------------------------------------------------
# Comparison (parent process)
# --------------------------------------------------------------------------------------------


def _shard(full, info, name):
    dim = info["partition"][name]
    return full if dim < 0 else torch.chunk(full, info["tp"], dim=dim)[info["tp_rank"]]


def _assert_equivalent(runs, reference, key, layout=None):
    """Every rank's gradients (its shard) match the reference; the last stages' losses too (with
    two DP ranks, the first holds the reference's first micro-batches, the second the last)."""
    seen = set()
    for run in runs:
        info = run[layout]["info"] if layout else run["info"]
        result = run[layout][key] if layout else run[key]
        assert bool(result["losses"]) == (info["pp_rank"] == info["pp"] - 1)
        if result["losses"]:
            k = len(result["losses"])
            expected = reference["losses"][:k] if info["dp_rank"] == 0 else reference["losses"][-k:]
            if info["dp"] == 1:
                assert k == len(reference["losses"])
            torch.testing.assert_close(torch.stack(result["losses"]), torch.stack(expected), rtol=RTOL, atol=ATOL)
        for name, grad in result["grads"].items():
            want = _shard(reference["grads"][name], info, name)
            torch.testing.assert_close(grad, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key} {name}: {m}")
            seen.add(name)
    assert seen == set(reference["grads"]), "some parameters are on no rank"


@pytest.fixture(scope="module")
def pp2():
    return run_local_ranks(_pp2_work, 2, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def four_ranks():
    return run_local_ranks(_four_rank_work, 4, timeout=TIMEOUT)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["1f1b", "wait-free-cyclic", "gpipe", "1f1b-recompute"])
def test_pp2_matches_single_process(pp2, case):
    _assert_equivalent(pp2, pp2[0]["reference"]["per-token"], case)
    assert len(pp2[1][case]["losses"]) == len(SHAPES_A) and not pp2[0][case]["losses"]


@pytest.mark.slow
def test_pp1_dp2_matches_single_process(pp2):
    _assert_equivalent(pp2, pp2[0]["reference"]["per-token"], "1f1b-recompute", layout="pp1dp2")


@pytest.mark.slow
def test_pp2_mean_loss_matches_single_process(pp2):
    """Without per-token loss, each micro-batch's mean counts 1/n, as in megatron-core."""
    _assert_equivalent(pp2, pp2[0]["reference"]["mean"], "wait-free-recompute-mean-loss")


@pytest.mark.slow
def test_plans_really_differ(pp2):
    orders = {case: pp2[0][case]["order"] for case in ("1f1b", "wait-free-cyclic", "gpipe")}
    assert len({tuple(order) for order in orders.values()}) == 3
    assert {"F2[selective]", "F4[full]", "B4[full]"} <= set(pp2[0]["1f1b-recompute"]["order"])


@pytest.mark.slow
def test_recompute_per_microbatch_recomputes_and_keeps_gradients_identical(pp2):
    for run in pp2:
        plain, mixed = run["1f1b"], run["1f1b-recompute"]
        # the same operations in the same order, recompute only re-runs some: bit-identical grads
        for name, grad in plain["grads"].items():
            assert torch.equal(grad, mixed["grads"][name]), name
        # micro-batches 0, 2, 4 share a shape and are none, selective, full in the mix: what their
        # forwards keep for backward shrinks in that order (and all keep the same without recompute)
        kept = plain["saved"]
        assert kept[0] == kept[2] == kept[4]
        kept = mixed["saved"]
        assert kept[0] == plain["saved"][0]
        assert kept[0] > kept[2] > kept[4], kept
        assert kept[4] < kept[0] / 4, kept  # full keeps little more than each layer's input


@pytest.mark.slow
def test_forward_only_gives_the_losses_and_no_gradients(pp2):
    reference = pp2[0]["reference"]["per-token"]
    losses = torch.stack(pp2[1]["forward-only"]["losses"])
    torch.testing.assert_close(losses, torch.stack(reference["losses"]), rtol=RTOL, atol=ATOL)
    assert all(not g.any() for run in pp2 for g in run["forward-only"]["grads"].values())


def test_every_instruction_kind_has_one_handler():
    from megatron_dynapipe.planning.plan import Op
    from megatron_dynapipe.runtime.executor import HANDLERS

    assert set(HANDLERS) == set(Op)


@pytest.mark.slow
def test_handlers_alone_change_only_their_micro_batch(pp2):
    first, second = (run["handlers"] for run in pp2)
    size, seq = SHAPES_A[0]
    hidden = CFG_KW["hidden_size"]
    assert first["shape_of_0"] == second["shape_of_0"] == (seq, size, hidden)  # sequence x batch x hidden
    assert first["input_after_load"] is None  # the first stage embeds the tokens itself
    assert first["output_shape"] == (seq, size, hidden)
    assert first["tokens"] == 0  # tokens are counted on the last stage, with the loss
    assert "micro-batch 0's output is (1, 2, 64)" in first["mismatch"] and first["started"] == 0
    assert first["kept_after_free"] == [(0, 0)]
    for run in (first, second):
        assert "received a plan of 2 model chunk(s) a stage for a model of 1" in run["interleaved"]


INTERLEAVED_LAYOUTS = {"interleaved": "reference", "uneven-interleaved": "uneven-reference"}  # layout: its reference


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(INTERLEAVED_LAYOUTS))
@pytest.mark.parametrize("case", ["interleaved", "interleaved-recompute"])
def test_pp2_interleaved_matches_single_process(pp2, case, layout):
    """Two model chunks a rank, variable-length micro-batches, per-(chunk, micro-batch) recompute;
    even chunks, and uneven ones as Megatron-LM builds them for first/last stages of their own."""
    _assert_equivalent(pp2, pp2[0][INTERLEAVED_LAYOUTS[layout]]["per-token"], case, layout=layout)
    for run in pp2:  # each rank ran both its chunks (its compute ops are F<m>.<chunk>[recompute])
        ops = {op.split("[")[0] for op in run[layout][case]["order"]}
        assert {"F0", "B5", "F0.1", "B5.1"} <= ops


@pytest.mark.slow
def test_uneven_interleaved_chunks_hold_the_layers_the_planner_prices(pp2):
    """--decoder-first-pipeline-num-layers 2 of 6 at PP 2 x 2 chunks: megatron-core builds each
    rank's chunks with the layers the planner is told each virtual stage holds."""
    from megatron_dynapipe.config.pipeline_split import PipelineSplit

    split = PipelineSplit(UNEVEN_SPLIT["num_layers_in_first_pipeline_stage"])
    priced = split.chunk_layers(UNEVEN_SPLIT["num_layers"], 2, 2)
    assert [run["uneven-interleaved"]["chunk_layers"] for run in pp2] == [priced[0::2], priced[1::2]] == [[1, 1], [2, 2]]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(INTERLEAVED_LAYOUTS))
def test_pp2_interleaved_matches_megatron_interleaved_schedule(pp2, layout):
    """The same fixed-shape micro-batches through megatron-core's interleaved 1F1B and through a
    planned interleaved schedule: equal losses and gradients, and both equal one process's."""
    reference = pp2[0][INTERLEAVED_LAYOUTS[layout]]["four-fixed"]
    _assert_equivalent(pp2, reference, "megatron", layout=layout)
    _assert_equivalent(pp2, reference, "interleaved-fixed", layout=layout)
    ours, theirs = pp2[1][layout]["interleaved-fixed"], pp2[1][layout]["megatron"]
    torch.testing.assert_close(torch.stack(ours["losses"]), torch.stack(theirs["losses"]), rtol=RTOL, atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(INTERLEAVED_LAYOUTS))
def test_pp2_interleaved_forward_only_gives_the_losses(pp2, layout):
    reference = pp2[0][INTERLEAVED_LAYOUTS[layout]]["per-token"]
    losses = torch.stack(pp2[1][layout]["interleaved-forward-only"]["losses"])
    torch.testing.assert_close(losses, torch.stack(reference["losses"]), rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_plain_batches_fall_back_to_megatron_core_schedule(pp2):
    _assert_equivalent(pp2, pp2[0]["reference"]["fixed"], "fallback")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FOUR_RANK_CASES["tp2pp2"]))
def test_tp2_pp2_matches_single_process(four_ranks, case):
    _assert_equivalent(four_ranks, four_ranks[0]["reference"]["A"], case, layout="tp2pp2")
    assert {r["tp2pp2"]["info"]["tp_rank"] for r in four_ranks} == {0, 1}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FOUR_RANK_CASES["pp2cp2"]))
def test_pp2_cp2_matches_single_process(four_ranks, case):
    """Each stage's two context-parallel ranks hold two of every sequence's four chunks; DDP sums
    their gradients, and their loss shares add up to the whole sequences'."""
    _assert_equivalent(four_ranks, four_ranks[0]["reference"]["A"], case, layout="pp2cp2")
    assert sorted(r["pp2cp2"]["info"]["cp"] for r in four_ranks) == [2] * 4
    assert [len(r["pp2cp2"][case]["losses"]) for r in four_ranks] == [0, 0, len(SHAPES_A), len(SHAPES_A)]


@pytest.mark.slow
@pytest.mark.parametrize("case, reference", [("1f1b", "A+B"), ("wait-free-recompute", "A[:4]+B")])
def test_pp2_dp2_matches_single_process(four_ranks, case, reference):
    _assert_equivalent(four_ranks, four_ranks[0]["reference"][reference], case, layout="pp2dp2")
    assert {r["pp2dp2"]["info"]["dp_rank"] for r in four_ranks} == {0, 1}


# --------------------------------------------------------------------------------------------
# A rank that dies or stalls
# --------------------------------------------------------------------------------------------


def _failing_forward_step(how):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        import torch.distributed as dist

        if dist.get_rank() == 1 and int(batch["index"]) == 2:
            if how == "die":
                os._exit(7)
            time.sleep(3600)
        return _forward_step(iter([batch]), model)

    return forward_step


def _die_or_stall(rank, world_size, how):
    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.data.batch import PlannedBatch
    from megatron_dynapipe.megatron import configure, get_forward_backward_func

    cpu_compat.enable_cpu_mode()
    configure(True, comm_timeout_s=3.0)
    model, _ = _stage(1, 2, per_token=True)
    plans = _plans("1f1b", SHAPES_A, "none")
    batch = PlannedBatch(0, plans[rank], _microbatches(SHAPES_A, seed=11))
    started = time.monotonic()
    try:
        get_forward_backward_func()(
            forward_step_func=_failing_forward_step(how), data_iterator=iter([batch]), model=[model],
            num_microbatches=0, seq_length=0, micro_batch_size=0)
    except Exception as exc:
        raise RuntimeError(f"failed after {time.monotonic() - started:.1f} s") from exc
    return "finished"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["die", "stall"])
def test_dead_or_stalled_peer_fails_fast_with_a_clear_error(how):
    with pytest.raises(LocalRanksError) as info:
        run_local_ranks(_die_or_stall, 2, how, timeout=90)
    text = str(info.value)
    assert "failed on rank 0" in text, text
    # stage 1 stops in F2; stage 0 then waits for gradient 2 (or fails sending activation 3)
    assert re.search(r"PipelineCommError: pipeline stage 0 \(global rank 0\) failed (receiving the gradient "
                     r"of micro-batch \d from|sending the activation of micro-batch \d to) stage 1 \(global "
                     r"rank 1\) \[plan instruction #\d+ ", text), text
    if how == "die":
        assert "rank(s) [1] exited without a result (exit codes {1: 7})" in text, text
    else:
        assert ", 3." in text and "s after posting it" in text, text  # the 3 s communication timeout


# --------------------------------------------------------------------------------------------
# install / get_forward_backward_func (in this process, no process groups)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def provider():
    from megatron_dynapipe.runtime import provider

    yield provider
    provider.uninstall()


def _namespace(**kw):
    import argparse

    return argparse.Namespace(**kw)


def test_get_forward_backward_func_falls_back_to_megatron_core_when_off(provider):
    from megatron.core.pipeline_parallel import schedules

    provider.install(_namespace(dynapipe=False))
    assert not provider.is_enabled()
    assert provider.get_forward_backward_func(2, None) is schedules.forward_backward_pipelining_without_interleaving
    assert provider.get_forward_backward_func(1, None) is schedules.forward_backward_no_pipelining
    assert provider.get_forward_backward_func(2, None, dynapipe=True) is provider.forward_backward_dynapipe
    assert provider.get_forward_backward_func(2, 2, dynapipe=True) is provider.forward_backward_dynapipe


def test_install_without_megatron_lm_patches_nothing_and_says_so(provider):
    pytest.importorskip("megatron.core")
    try:
        import megatron.training  # noqa: F401
        pytest.skip("Megatron-LM is installed here")
    except ImportError:
        pass
    with pytest.warns(UserWarning, match="cannot be imported"):
        report = provider.install(_namespace(dynapipe=True, dynapipe_comm_timeout=9.0))
    assert report.enabled and report.patched == []
    assert "nothing patched" in str(report) and "megatron_dynapipe.megatron.get_forward_backward_func()" in str(report)
    assert provider.get_forward_backward_func(2, None) is provider.forward_backward_dynapipe
    assert provider._state.options.comm_timeout_s == 9.0


def test_install_rebinds_megatron_training_name_and_uninstall_restores(provider, monkeypatch):
    import types

    from megatron.core.pipeline_parallel import get_forward_backward_func as core_func

    package = types.ModuleType("megatron.training")
    training = types.ModuleType("megatron.training.training")
    training.get_forward_backward_func = core_func  # bound at import, as Megatron-LM does
    utils = types.ModuleType("megatron.training.utils")
    utils.get_forward_backward_func = core_func
    package.training = training
    for name, module in (("megatron.training", package), ("megatron.training.training", training),
                         ("megatron.training.utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)

    report = provider.install(_namespace(dynapipe=True))
    assert report.patched == ["megatron.training.training.get_forward_backward_func",
                              "megatron.training.utils.get_forward_backward_func"]
    assert training.get_forward_backward_func is provider.get_forward_backward_func
    assert "train_step and evaluate" in str(report)
    # what train_step does: get_forward_backward_func() with Megatron's pp/vp sizes
    assert training.get_forward_backward_func(2, None) is provider.forward_backward_dynapipe
    assert provider.install(_namespace(dynapipe=True)).patched == report.patched  # idempotent
    provider.uninstall()
    assert training.get_forward_backward_func is core_func and utils.get_forward_backward_func is core_func
    assert not provider.is_enabled()


def test_recompute_switch_refuses_an_upstream_that_changed(monkeypatch):
    from megatron_dynapipe.compat import upstream
    from megatron_dynapipe.compat.patching import Spot, UpstreamChanged
    from megatron_dynapipe.runtime import executor

    executor._check_recompute_reads.cache_clear()
    monkeypatch.setattr(upstream, "RECOMPUTE_READS", (
        Spot("megatron.core.transformer.attention", "Attention.forward", ("self.checkpoint_core_attention_v2",)),))
    with pytest.raises(UpstreamChanged, match=r"Attention\.forward: expected 'self\.checkpoint_core_attention_v2'"
                                              r".*review megatron_dynapipe/runtime/executor\.py"):
        executor._check_recompute_reads()
    executor._check_recompute_reads.cache_clear()


def test_executor_benchmark_summary():
    from megatron_dynapipe.bench.executor_bench import SCHEDULES, format_table, summarize

    core, ours = SCHEDULES
    settings = dict(pp=2, microbatches=8, micro_batch_size=2, seq_length=64, hidden_size=64, num_layers=4,
                    steps=5, warmup=1)
    per_rank = [  # seconds per step; the slowest rank's step counts
        {core: [0.10, 0.20, 0.10, 0.10, 0.10], ours: [0.11, 0.20, 0.10, 0.10, 0.10], "losses_match": True},
        {core: [0.10, 0.10, 0.12, 0.10, 0.10], ours: [0.10, 0.10, 0.12, 0.11, 0.10], "losses_match": True},
    ]
    row = summarize(per_rank, settings)
    assert row[core]["steps_ms"] == pytest.approx([100, 200, 120, 100, 100])
    assert row[ours]["steps_ms"] == pytest.approx([110, 200, 120, 110, 100])
    assert row["paired_ratio"] == pytest.approx(1.0) and row["overhead_pct"] == pytest.approx(0.0)
    assert row["ratio"] == pytest.approx(110 / 100) and row["losses_match"]
    text = format_table(row)
    assert "| megatron-core 1F1B | 100.0 | 100.0 |" in text and "overhead +0.0% (target <= 5%)" in text
