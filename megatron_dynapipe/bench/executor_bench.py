"""Executor benchmark: DynaPipe's plan executor against megatron-core's own 1F1B.

Both run the same fixed-shape micro-batches through the same tiny megatron-core GPT (CPU, gloo,
PP ranks as local processes, DDP, ``deallocate_pipeline_outputs`` and ``finalize_model_grads`` as
in Megatron-LM training): megatron-core's ``forward_backward_pipelining_without_interleaving``
with its p2p communicator, and DynaPipe's ``forward_backward_dynapipe`` running a 1F1B
ExecutionPlan of the same micro-batches. A step is one forward-backward call, timed on every rank
between barriers (the slowest rank counts). The two schedules alternate step by step (which goes
first alternates too), so machine noise hits both alike; the overhead is the median of the
step-by-step ratios. On CPU, megatron-core's schedule only runs inside cpu_compat's CUDA-as-CPU
scope (a torch function mode every torch call inside passes through); the DynaPipe step runs
inside the same scope so that both pay that per-op cost alike.

Reported: median and minimum step time of each after warm-up, the ratios DynaPipe /
megatron-core (target: at most 1.05) and whether both gave the same losses.
"""

from __future__ import annotations

import json
import statistics
from typing import Any, Callable

from megatron_dynapipe.bench.timing import time_alternating
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.data.batch import PlannedBatch
from megatron_dynapipe.gpt.build import wrap_in_ddp
from megatron_dynapipe.local_ranks import run_local_ranks
from megatron_dynapipe.planning.plan import build_execution_plans
from megatron_dynapipe.planning.schedules import one_f_one_b_orders
from megatron_dynapipe.planning.types import MicroBatch

SCHEDULES = ("megatron-core 1F1B", "DynaPipe executor")
#: Vocabulary of the benchmark GPT: small, so that the transformer layers dominate.
VOCAB_SIZE = 128


def add_arguments(p) -> None:
    p.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=2,
                   help="pipeline stages = local processes (default 2)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    p.add_argument("--micro-batch-size", type=int, default=2, help="samples per micro-batch (default 2)")
    p.add_argument("--seq-length", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--hidden-size", type=int, default=64, help="tiny GPT hidden size (default 64)")
    p.add_argument("--num-layers", type=int, default=4, help="tiny GPT layers, split over the stages (default 4)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per schedule (default 20, at least 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per schedule first (default 3)")
    p.add_argument("--timeout", type=float, default=600, help="give up after this many seconds (default 600)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    if args.steps < 5:
        raise ValueError(f"--steps {args.steps}: medians need at least 5 timed steps")
    if args.pp < 2:
        raise ValueError(f"--pp {args.pp}: the benchmark compares pipeline schedules, use --pp 2 or more")
    if args.num_layers < args.pp:
        raise ValueError(f"--num-layers {args.num_layers} cannot fill {args.pp} stages")
    settings = {k: getattr(args, k) for k in ("pp", "microbatches", "micro_batch_size", "seq_length",
                                               "hidden_size", "num_layers", "steps", "warmup")}
    per_rank = run_local_ranks(_bench_rank, args.pp, settings, timeout=args.timeout)
    row = summarize(per_rank, settings)
    print(json.dumps(row) if args.json else format_table(row))
    return 0


def summarize(per_rank: list[dict], settings: dict) -> dict:
    """Step time of a schedule = the slowest rank's time of that step; medians over steps."""
    row: dict[str, Any] = {"settings": settings}
    for name in SCHEDULES:
        steps = [max(rank[name][i] for rank in per_rank) for i in range(settings["steps"])]
        row[name] = {"median_ms": statistics.median(steps) * 1e3, "min_ms": min(steps) * 1e3,
                     "steps_ms": [round(s * 1e3, 3) for s in steps]}
    core, ours = (row[name]["median_ms"] for name in SCHEDULES)
    row["ratio"] = ours / core
    # the two schedules' i-th steps ran back to back: their ratio is immune to slow drifts in load
    row["paired_ratio"] = statistics.median(
        b / a for a, b in zip(row[SCHEDULES[0]]["steps_ms"], row[SCHEDULES[1]]["steps_ms"]))
    row["overhead_pct"] = (row["paired_ratio"] - 1) * 100
    row["ratio_of_minima"] = row[SCHEDULES[1]]["min_ms"] / row[SCHEDULES[0]]["min_ms"]
    row["losses_match"] = all(rank["losses_match"] for rank in per_rank)
    return row


def format_table(row: dict) -> str:
    s = row["settings"]
    lines = [
        f"executor benchmark: tiny GPT (hidden {s['hidden_size']}, {s['num_layers']} layers) on CPU, "
        f"PP={s['pp']}, {s['microbatches']} micro-batches of {s['micro_batch_size']} x {s['seq_length']} tokens, "
        f"{s['steps']} timed steps after {s['warmup']} warm-up",
        "| schedule | median ms | min ms |",
        "|---|---|---|",
    ]
    for name in SCHEDULES:
        lines.append(f"| {name} | {row[name]['median_ms']:.1f} | {row[name]['min_ms']:.1f} |")
    lines.append(f"DynaPipe / megatron-core: {row['paired_ratio']:.3f} (median of step-by-step ratios), "
                 f"{row['ratio']:.3f} (ratio of medians), {row['ratio_of_minima']:.3f} (ratio of minima)")
    lines.append(f"overhead {row['overhead_pct']:+.1f}% (target <= 5%); same losses: {row['losses_match']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Ranks
# --------------------------------------------------------------------------------------------


def _bench_rank(rank: int, world_size: int, s: dict) -> dict:
    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.gpt.tiny import destroy_model_parallel, init_model_parallel, random_micro_batches

    cpu_compat.enable_cpu_mode()
    init_model_parallel(1, world_size)
    try:
        ddp = _ddp_model(s)
        batches = random_micro_batches(s["microbatches"], s["micro_batch_size"], s["seq_length"], VOCAB_SIZE, seed=0)
        steps = _schedule_steps(ddp, batches, s, pp=world_size)
        return _time_alternating(steps, ddp, s, rank)
    finally:
        destroy_model_parallel()
        cpu_compat.disable_cpu_mode()


def _ddp_model(s: dict):
    """The benchmark GPT wrapped in Megatron's DDP, configured as Megatron-LM trains it."""
    from megatron_dynapipe.gpt.tiny import build_tiny_gpt

    spec = ModelSpec(hidden_size=s["hidden_size"], num_layers=s["num_layers"],
                     num_attention_heads=max(1, s["hidden_size"] // 16), vocab_size=VOCAB_SIZE,
                     max_sequence_length=s["seq_length"])
    model = build_tiny_gpt(spec)
    ddp = wrap_in_ddp(model, model.config)
    model.config.deallocate_pipeline_outputs = True  # as Megatron-LM runs
    return ddp


def _schedule_steps(ddp, batches: list[dict], s: dict, pp: int) -> dict[str, Callable[[], list]]:
    """One training step under each schedule: Megatron's 1F1B and the DynaPipe executor running
    a plan of the same micro-batches in the same 1F1B order."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.gpt.tiny import mean_loss_forward_step
    from megatron_dynapipe.runtime.provider import forward_backward_dynapipe

    n, b, seq = s["microbatches"], s["micro_batch_size"], s["seq_length"]
    micro = [MicroBatch(tuple(range(i * b, (i + 1) * b)), seq) for i in range(n)]
    plan = build_execution_plans(one_f_one_b_orders(pp, n), micro, "none", "1f1b")[
        parallel_state.get_pipeline_model_parallel_rank()]
    shape = dict(model=[ddp], num_microbatches=n, seq_length=seq, micro_batch_size=b)

    def core_step():  # CPU mode runs it inside cpu_compat's CUDA-as-CPU scope
        return schedules.forward_backward_pipelining_without_interleaving(
            forward_step_func=mean_loss_forward_step, data_iterator=iter(batches), **shape)

    def dynapipe_step():  # in the same scope, so that both pay its per-op cost alike
        with cpu_compat.cuda_as_cpu():
            return forward_backward_dynapipe(
                forward_step_func=mean_loss_forward_step, data_iterator=iter([PlannedBatch(0, plan, batches)]), **shape)

    return {SCHEDULES[0]: core_step, SCHEDULES[1]: dynapipe_step}


def _time_alternating(steps: dict, ddp, s: dict, rank: int) -> dict:
    """Seconds per timed step of each schedule (alternating order), and whether their losses agree."""
    times, results = time_alternating(steps, warmup=s["warmup"], steps=s["steps"], rank=rank,
                                      before_each=ddp.zero_grad_buffer)
    losses = [[float(d["lm loss"]) for d in results[name]] for name in SCHEDULES]
    return {**times, "losses_match": losses[0] == losses[1]}
