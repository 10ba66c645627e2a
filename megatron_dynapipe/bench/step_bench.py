"""Step benchmark: real megatron-core training steps on one global batch of variable-length samples.

The same samples (random tokens of the given lengths) go through the same GPT in up to nine ways
(each named as the method registry, :mod:`~megatron_dynapipe.planning.methods`, names it):

* **DynaPipe** and **DynaPipe (fast)**: the planner's variable-length micro-batches, schedule and
  recompute choices, from the cost model given, each sample padded to its micro-batch's longest;
* **DynaPipe varlen**: the same planner with packed micro-batches (``--packing varlen``): each
  micro-batch one row of its samples back to back, each attending to itself alone (THD);
* **pad-to-max**: Megatron's fixed ``--seq-length``: every sample padded to the longest allowed;
* **packing**: samples packed first-fit into sequences of that length, as Megatron's GPT dataset
  does (causal attention over the whole sequence, positions counted through it, each sample's
  own next-token loss): cheap, but samples attend to their neighbours;
* **THD packing (whole)**: the same sequences without that leakage (THD with ``cu_seqlens``):
  each micro-batch a fixed budget of k sequences in one row, every sample attending to itself
  alone with its own positions. Where it differs from core_v0.19's THD packing
  (``--dataloader-inter-document-masking``): Megatron concatenates the documents and cuts the
  stream into ``--seq-length`` rows, so its rows carry no padding and a document can straddle two
  rows (the second part a segment of its own, without the first's context); here whole samples
  are packed first-fit, so every sample keeps its context and rows carry what padding first-fit
  leaves.
* with ``--cut-documents``, two more that train the documents as Megatron-LM's GPT data path cuts
  them (back to back, a new row every ``--max-seq-length`` tokens; :mod:`~megatron_dynapipe.planning.documents`):
  **THD packing**, those windows in rows of k as core_v0.19 trains them (``search``'s ``thd``), and
  **DynaPipe varlen (cut)**, the planner on the same pieces (``--documents cut``). They train the
  same pieces as each other, so their losses agree with each other, not with the whole samples';
* **dp_balanced packing**: Megatron-LM's ``--sequence-packing-scheduler dp_balanced`` (after
  core_v0.19): whole samples in arrival order, next-fit into THD packs of ``--max-seq-length``
  tokens, as many as a multiple of DP (x PP where interleaved), one pack a micro-batch
  (:func:`~megatron_dynapipe.planning.baselines.dp_balanced_packs`); left out, saying why, for a
  batch Megatron-LM refuses to deal out.

The packed ways need an attention core that runs packed micro-batches: the model is built with
``--attention sdpa`` unless told otherwise (with ``--attention local`` they are left out).
Each way is an ExecutionPlan run by the same executor (the baselines' plans are 1F1B, with the
micro-batch size and uniform recompute the cost model finds fastest within the memory limit, as
``megatron-dynapipe plan`` prices packing), so the methods differ only in how the samples are cut,
padded and packed; ``bench executor`` compares that executor with megatron-core's own schedule. A
step is one forward-backward of the whole global batch (no optimizer step: the weights stay the
same, so every method computes the same per-token losses but leaky packing's; the model runs
without dropout for the same reason, and its profile must have been made so).
With ``--chunks V`` (``--pp`` 2 or more) each rank holds V model chunks, built as Megatron-LM's
``get_model`` builds them: the baselines run Megatron's interleaved 1F1B and DynaPipe plans its
interleaved pipeline, each priced per virtual stage; ``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers`` give the first or last stage its own layers, as in
Megatron-LM (megatron-core builds the chunks, the planner prices each virtual stage's).
With ``--cp C`` every row is split over C context-parallel ranks (chunks r and 2C-1-r of it, the
keys and values passed round the CP group's ring): the cost model is priced on one rank of the
group, packed samples take whole chunks of their rows, and the baselines pack with that room too.
Methods alternate step by step, so drift in the machine's load hits all alike; step time is the
slowest rank's, and the median over steps is reported, with real (non-pad) tokens per second,
the cost model's prediction for each method and its error, and peak memory (on CUDA the
allocator's peak; on the CPU the bytes of the tensors a step creates). ``--chrome-trace`` adds one
more step of each method, every instruction timed (:mod:`.step_timeline`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys

from megatron_dynapipe.bench import step_timeline
from megatron_dynapipe.bench.pace import (Pace, pace_line, paced_error_pct, profiled_ms, reference_layer,
                                          reference_points)
from megatron_dynapipe.bench.step_methods import (CUT, CUT_PIECES, DP_BALANCED, DYNAPIPE, LEAKY, PACK, PAD, THD,
                                                 THD_WHOLE, StepJob, VARLEN, Method, build_methods,
                                                 stage_costs)
from megatron_dynapipe.bench.timing import time_alternating
from megatron_dynapipe.config.layout import layers_problem
from megatron_dynapipe.config.model_flags import add_model_arguments, attention_from_args, model_from_args
from megatron_dynapipe.config.pipeline_split import PipelineSplit
from megatron_dynapipe.files import check_output_file
from megatron_dynapipe.gpt.build import runs_packed
from megatron_dynapipe.gpt.device import add_device_arguments, resolve_device, torch_dtype
from megatron_dynapipe.hardware import MEMORY_HEADROOM, default_memory_limit_mb
from megatron_dynapipe.local_ranks import LocalRanksError, run_local_ranks
from megatron_dynapipe.planning.cost_model import load_job_cost_model, split_over_cp
from megatron_dynapipe.planning.flags import positive_int_argument, positive_number_argument, seed_argument
from megatron_dynapipe.planning.samples import MIXES, read_lengths, scaled_lengths
from megatron_dynapipe.planning.spec import TrainingSpec
from megatron_dynapipe.runtime.stage import build_training_chunks, planned_step

__all__ = ["add_arguments", "run"]

DEFAULT_SAMPLES = 64
# relative, each method without leakage against pad-to-max
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}
ATTENTION = "sdpa"  # without --attention: the core that runs the packed methods too


def add_arguments(p) -> None:
    add_model_arguments(p, attention=ATTENTION)
    p.add_argument("--cost-model", metavar="NAME|FILE",
                   help="the planner's cost model: a profile of this model on this device (megatron-dynapipe "
                        "profile) or a shipped profile's name (default: the analytical GPT model)")
    p.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1,
                   help="pipeline stages (default 1)")
    p.add_argument("--chunks", "--num-virtual-stages-per-pipeline-rank", dest="chunks", type=int, default=1,
                   metavar="V", help="model chunks a rank: an interleaved pipeline, Megatron's interleaved 1F1B "
                                     "for the baselines and DynaPipe's planned interleaved-1f1b (default 1)")
    for which in ("first", "last"):
        p.add_argument(f"--decoder-{which}-pipeline-num-layers", type=int, metavar="N",
                       help=f"transformer layers of the {which} pipeline stage, the rest split evenly over the others "
                            "(Megatron-LM's flag; default: every stage alike)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--cp", "--context-parallel-size", dest="cp", type=int, default=1,
                   help="context-parallel ranks each micro-batch's rows are split over (default 1); PP x DP x CP "
                        "local processes run the steps")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, metavar="N",
                   help=f"samples in the global batch (default {DEFAULT_SAMPLES})")
    p.add_argument("--mix", choices=MIXES, default="multitask",
                   help="built-in length mix, scaled to --max-seq-length (default multitask)")
    p.add_argument("--lengths", metavar="FILE", help="sample lengths instead of the mix (one a line, or a JSON list)")
    p.add_argument("--seq-length", "--max-seq-length", dest="max_seq_length", type=positive_int_argument, metavar="N",
                   help="Megatron's --seq-length: the longest sample, pad-to-max and packing length (default: the "
                        "model's positions)")
    p.add_argument("--memory-limit", type=positive_number_argument, metavar="MB",
                   help=f"per-device memory the plans must fit (default: {1 - MEMORY_HEADROOM:g} of the GPU's memory, the "
                        f"rest left for the CUDA context, NCCL and the allocator; {default_memory_limit_mb(None):.0f} on the CPU)")
    add_device_arguments(p, "run")
    p.add_argument("--steps", type=int, default=5, help="timed steps per method (default 5, at least 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per method first (default 1)")
    p.add_argument("--seed", type=seed_argument, default=0, help="seed of the lengths and tokens (default 0)")
    p.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds (default 1800)")
    p.add_argument("--cut-documents", action="store_true",
                   help="also run THD packing on Megatron's windows (the documents back to back, cut every "
                        "--max-seq-length tokens) and DynaPipe varlen on the same pieces (--documents cut)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--chrome-trace", metavar="FILE.json",
                   help="after the timed steps, one more step of each method with every instruction timed on every "
                        "rank: written as Chrome-trace JSON (each compute op with its price), and each rank's compute "
                        "and waiting reported")
    p.set_defaults(model="tiny")




def run(args) -> int:
    job = _checked(args)
    lengths = _lengths(args, job.max_seq_length)
    methods = build_methods(lengths, job, args)
    print(f"running {len(methods)} methods x {args.warmup + args.steps} steps on {job.device} "
          f"({_layout(job.layout)}) ...", file=sys.stderr, flush=True)
    per_rank, failed = run_methods(methods, job, warmup=args.warmup, steps=args.steps, timeout=args.timeout)
    pace = _pace(job, per_rank)
    ran = {name: m for name, m in methods.items() if name not in failed}
    prices = _op_prices(ran, per_rank, job) if job.timeline else None
    row = summarize(per_rank, ran, lengths, job, failed, prices, pace)
    if args.chrome_trace:
        timelines = {name: [(_rank_name(rank, job), rank["timelines"][name]) for rank in per_rank]
                     for name in row["methods"]}
        trace = step_timeline.chrome_trace(timelines, prices, name="bench step", layout=_layout(row["settings"]))
        row["chrome_trace"] = str(trace.write(args.chrome_trace))
    print(json.dumps(row) if args.json else format_table(row))
    if failed:
        print(f"bench step: {', '.join(failed)} failed (its row says why); the other methods' results stand",
              file=sys.stderr)
    return 1 if failed else 0


def _pace(job: StepJob, per_rank: list[dict]) -> "Pace | None":
    """The machine's pace beside the steps: the ranks' times of the profile's points over their profiled times."""
    if job.pace is None:
        return None
    points, _ = job.pace
    profiled = [profiled_ms(job.profile, point) for point in points]
    return Pace(points[0][0], tuple(mbs for _, mbs, _ in points),
                tuple(ms / p for rank in per_rank for round_ms in rank["pace_ms"] for ms, p in zip(round_ms, profiled)))


def _pace_reference(profile, device: str, max_seq_length: int) -> "tuple | None":
    """(points, timing) of the profile's layer to time beside the steps, as the profile timed it;
    None off the CPU (a GPU's pace does not drift so) or without a measured profile (:mod:`.pace`)."""
    from megatron_dynapipe.profiling.profiler import ProfileSettings

    points = reference_points(profile, max_seq_length) if device == "cpu" else []
    if not points:
        return None
    settings, default = profile.metadata.get("settings") or {}, ProfileSettings()
    return points, {key: settings.get(key, getattr(default, key)) for key in ("warmup", "repeats", "min_time_ms")}


def _checked(args) -> StepJob:
    """Everything refusable before any work, one line each that names the fix."""
    import torch

    if args.hidden_dropout or args.attention_dropout:
        raise ValueError("bench step runs without dropout (DynaPipe's and pad-to-max's losses must agree): "
                         "drop --hidden-dropout / --attention-dropout")
    spec = dataclasses.replace(model_from_args(args), hidden_dropout=0.0, attention_dropout=0.0,
                               attention=attention_from_args(args))
    if args.steps < 3:
        raise ValueError(f"--steps {args.steps}: a median needs at least 3 timed steps")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: give how many untimed steps to run first, 0 or more")
    if not args.timeout > 0:
        raise ValueError(f"--timeout {args.timeout:g}: give the seconds to wait for the ranks, a positive number")
    if args.samples < 1:
        raise ValueError(f"--samples {args.samples}: the global batch needs at least one sample")
    if args.chunks < 1 or (args.chunks > 1 and args.pp < 2):
        raise ValueError(f"--chunks {args.chunks} with --pp {args.pp}: model chunks interleave a pipeline of at least "
                         "2 stages; give --pp 2 or more, or --chunks 1")
    split = PipelineSplit.from_args(args)
    if split.uneven:
        problem = split.problem(spec.num_layers, args.pp) or split.chunks_problem(spec.num_layers, args.pp, args.chunks)
    else:
        problem = layers_problem(spec.num_layers, args.pp * args.chunks,
                                 pp_name="--pp x --chunks" if args.chunks > 1 else "--pp")
    if problem:
        raise ValueError(problem)
    if args.dp < 1:
        raise ValueError(f"--dp {args.dp}: give at least 1 data-parallel rank")
    round_to = TrainingSpec.seqlen_round  # what the planner pads lengths to: 2 x CP chunks must divide it
    if args.cp < 1 or round_to % (2 * args.cp):
        sizes = [c for c in range(1, round_to // 2 + 1) if round_to % (2 * c) == 0]
        raise ValueError(f"--cp {args.cp}: context parallelism splits each row into 2 x CP chunks of lengths padded "
                         f"to multiples of {round_to}, so give {', '.join(map(str, sizes[:-1]))} or {sizes[-1]}")
    if args.samples < args.dp and not args.lengths:
        raise ValueError(f"--samples {args.samples} cannot feed --dp {args.dp} ranks: give at least {args.dp}")
    device = resolve_device(args.device)
    ranks = args.pp * args.dp * args.cp
    if device == "cuda" and torch.cuda.device_count() < ranks:
        raise ValueError(f"--device cuda with --pp {args.pp} --dp {args.dp} --cp {args.cp} needs {ranks} GPUs (NCCL "
                         f"puts one rank on each), this machine has {torch.cuda.device_count()}: lower them or use "
                         "--device cpu")
    if device == "cpu" and args.dtype != "fp32":
        raise ValueError(f"--{args.dtype} on the CPU: megatron-core's CPU path is fp32, drop the flag or use --device cuda")
    max_seq_length = args.max_seq_length or spec.max_sequence_length
    if not 2 <= max_seq_length <= spec.max_sequence_length or max_seq_length % 8:
        raise ValueError(f"--max-seq-length {max_seq_length}: pick a multiple of 8 up to the model's "
                         f"{spec.max_sequence_length} positions (the planner pads lengths to multiples of 8)")
    if args.chrome_trace:
        check_output_file(args.chrome_trace, "--chrome-trace", (".json",))
    memory_limit = args.memory_limit or default_memory_limit_mb(
        torch.cuda.get_device_properties(0).total_memory / 2**20 if device == "cuda" else None)
    profile = load_job_cost_model(args.cost_model, spec.to_json(), tp=1, dtype=args.dtype)
    packs = runs_packed(spec, device)
    return StepJob(model=spec, device=device, packs=packs, dtype=args.dtype, max_seq_length=max_seq_length,
                   memory_limit_mb=memory_limit, cost_model=split_over_cp(profile, args.cp), pp=args.pp,
                   chunks=args.chunks, dp=args.dp, cp=args.cp, split=split, seed=args.seed,
                   cost_model_name=args.cost_model or "analytical", predicts=args.cost_model is not None,
                   timeline=bool(args.chrome_trace), cut=bool(args.cut_documents), profile=profile,
                   pace=_pace_reference(profile, device, max_seq_length))


def _lengths(args, max_seq_length: int) -> list[int]:
    """The file's lengths, or the mix scaled from its cap to ``max_seq_length`` (so a short-context
    model sees the mix's shape, not a batch of samples all cut to its length)."""
    if args.lengths:
        lengths = read_lengths(args.lengths)
        too_long = [n for n in lengths if n > max_seq_length]
        if too_long:
            raise ValueError(f"{args.lengths} has a sample of {max(too_long)} tokens, over --max-seq-length "
                             f"{max_seq_length}: raise it (up to the model's positions) or cut the samples")
        return lengths
    return scaled_lengths(args.samples, args.seed, args.mix, max_seq_length)


# --------------------------------------------------------------------------------------------
# Ranks
# --------------------------------------------------------------------------------------------


class MethodFailed(RuntimeError):
    """One method's step raised on a rank (out of memory, say): the others may still run."""

    def __init__(self, method: str, reason: str):
        super().__init__(method, reason)
        self.method, self.reason = method, reason

    def __str__(self) -> str:
        return f"{self.method}: {self.reason}"


def run_methods(methods: dict[str, Method], job: StepJob, *, warmup: int, steps: int,
                timeout: float) -> tuple[list[dict], dict[str, str]]:
    """Every method's steps on the local ranks: the per-rank results, and ``{method: why}`` for the
    methods that failed. A failing method takes its peers down with it (a stage waits on the one
    that raised), so the others run again without it: one method's out-of-memory costs a rerun,
    not every method's results."""
    failed: dict[str, str] = {}
    while True:
        remaining = {name: method for name, method in methods.items() if name not in failed}
        try:
            return run_local_ranks(_rank, job.pp * job.dp * job.cp, job, remaining, warmup, steps,
                                   timeout=timeout, backend="nccl" if job.device == "cuda" else "gloo"), failed
        except LocalRanksError as error:
            failure = next((e for e in error.raised.values() if isinstance(e, MethodFailed)), None)
            if failure is None or len(remaining) == 1:
                raise
            failed[failure.method] = failure.reason
            print(f"{failure}; running the other methods again without it", file=sys.stderr, flush=True)


def _failing_as(name: str, run):
    """``run`` whose exceptions name the method they ended."""
    def step():
        try:
            return run()
        except Exception as error:
            lines = str(error).strip().splitlines()
            raise MethodFailed(name, f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]) from error
    return step


def _rank(rank: int, world_size: int, job: StepJob, methods: dict[str, Method], warmup: int, steps: int) -> dict:
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.gpt.tiny import destroy_model_parallel, init_model_parallel
    from megatron_dynapipe.profiling.measure import steady_cpu_allocator

    on_cpu = job.device == "cpu"
    if on_cpu:
        steady_cpu_allocator()  # as the profile was made: timings that do not hang on the steps before
        cpu_compat.enable_cpu_mode()
    # the data-parallel size follows from the world
    init_model_parallel(1, job.pp, virtual_pp=job.chunks if job.chunks > 1 else None,
                        context_parallel_size=job.cp)
    try:
        model_parallel_cuda_manual_seed(job.seed)  # megatron's RNG tracker; weights and tokens as seeded
        torch.manual_seed(job.seed)
        device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        chunks = build_training_chunks(job.model, dtype=torch_dtype(job.dtype), device=device, pp=job.pp,
                                       cp=job.cp, chunks=job.chunks, split=job.split)
        stage, dp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_data_parallel_rank()
        runs = {name: _failing_as(name, planned_step(chunks, method.plans[dp_rank][stage], method.microbatches[dp_rank],
                                                     device))
                for name, method in methods.items()}

        def zero_grads():
            for chunk in chunks:
                chunk.zero_grad_buffer()

        paced: list[list[float]] = []  # the profile's layer at its points, ms, after each timed round (bench.pace)
        layer_ms = job.pace and reference_layer(job.model, job.pace[0], torch_dtype(job.dtype), device, job.pace[1])
        times, results = time_alternating(runs, warmup=warmup, steps=steps, rank=rank, before_each=zero_grads,
                                          synchronize=(lambda: None) if on_cpu else torch.cuda.synchronize,
                                          after_round=layer_ms and (lambda: paced.append(layer_ms())))
        timelines = ({name: step_timeline.record(run, zero_grads) for name, run in runs.items()}
                     if job.timeline else {})
        return {"times": times, "losses": _loss_sums(results), "threads": torch.get_num_threads(),
                "memory_mb": {name: _memory_mb(run, zero_grads, device) for name, run in runs.items()},
                "timelines": timelines, "stage": stage, "dp_rank": dp_rank, "pace_ms": paced,
                "cp_rank": parallel_state.get_context_parallel_rank()}
    finally:
        destroy_model_parallel()
        if on_cpu:
            cpu_compat.disable_cpu_mode()


def _loss_sums(results: dict[str, list]) -> dict[str, tuple[float, float]]:
    """Each method's (loss sum, loss tokens) over this rank's micro-batches, on a last stage
    (other stages return no loss dicts); :func:`summarize` adds the data-parallel ranks' up."""
    import torch

    sums = {}
    for name, dicts in results.items():
        if dicts:
            total = torch.stack([d["lm loss"] for d in dicts]).sum(dim=0)  # [loss sum, token count]
            sums[name] = (float(total[0]), float(total[1]))
    return sums


def _global_loss(per_rank: list[dict], name: str) -> tuple[float, int]:
    """The mean over the global batch's loss tokens of the per-token loss, and how many tokens that
    is: every last stage's sums added up (one per data-parallel and context-parallel rank, each
    over its own tokens)."""
    sums = [rank["losses"][name] for rank in per_rank if name in rank["losses"]]
    tokens = sum(n for _, n in sums)
    return sum(s for s, _ in sums) / tokens, round(tokens)


def _memory_mb(run, zero_grads, device) -> tuple[float, "float | None"]:
    """What one step allocates on top of what was there before it (the weights and gradient
    buffers; a step benchmark makes no optimizer), and on CUDA the allocator's peak in all. On the
    CPU, which keeps no counters, the first is the bytes of the tensors the step creates, the
    second unknown."""
    import torch

    from megatron_dynapipe.profiling.measure import LiveBytes

    zero_grads()
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return (peak - before) / 2**20, peak / 2**20
    with LiveBytes() as live:
        run()
    return live.peak / 2**20, None


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def summarize(per_rank: list[dict], methods: dict[str, Method], lengths: list[int], job: StepJob,
              failed: "dict[str, str] | None" = None, prices: "dict[str, list[dict]] | None" = None,
              pace: "Pace | None" = None) -> dict:
    """Per method: median step time (slowest rank each step), real tokens per second, predicted
    time and its error (and at the machine's ``pace``, where measured), peak memory (largest rank);
    speed-ups and whether the losses agree; and why each method in ``failed`` did not run.
    ``prices``: :func:`_op_prices`, each rank's timed step's compute priced beside it."""
    real_tokens = sum(lengths)
    rows = {}
    for name, method in methods.items():
        loss, loss_tokens = _global_loss(per_rank, name)
        steps = [max(rank["times"][name][i] for rank in per_rank) for i in range(len(per_rank[0]["times"][name]))]
        median = statistics.median(steps)
        rows[name] = dict(
            median_ms=median * 1e3, spread_ms=(max(steps) - min(steps)) * 1e3, tokens_per_s=real_tokens / median,
            # the default analytical model prices an A100, not this device: its times are no prediction
            predicted_ms=method.predicted_ms if job.predicts else None,
            prediction_error_pct=(method.predicted_ms / (median * 1e3) - 1) * 100 if job.predicts else None,
            paced_error_pct=paced_error_pct(method.predicted_ms, median * 1e3, pace) if pace else None,
            schedule=method.plans[0][0].schedule, microbatches=sum(map(len, method.microbatches)),
            recompute=sorted({rc.label for plans in method.plans for plan in plans for rc in plan.recompute}),
            padded_tokens=int(sum(mb["tokens"].size for mine in method.microbatches for mb in mine)),
            activations_mb=max(rank["memory_mb"][name][0] for rank in per_rank),
            predicted_activations_mb=method.predicted_activations_mb,
            peak_mb=_largest([rank["memory_mb"][name][1] for rank in per_rank]),
            planning_s=method.planning_s,
            loss=loss, loss_tokens=loss_tokens)
        if job.timeline:
            rows[name]["timeline"] = [_rank_timeline(rank, name, job, None if prices is None else prices[name][k])
                                      for k, rank in enumerate(per_rank)]
    gaps = {name: abs(row["loss"] - rows[PAD]["loss"]) / abs(rows[PAD]["loss"])
            for name, row in rows.items() if name not in LEAKY + CUT_PIECES and name != PAD and PAD in rows}
    if CUT in rows and THD in rows:  # the same pieces
        gaps[CUT] = abs(rows[CUT]["loss"] - rows[THD]["loss"]) / abs(rows[THD]["loss"])
    speedups = {f"{a} over {b}": rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"]
                for a, b in ((DYNAPIPE, PAD), (DYNAPIPE, PACK), (VARLEN, THD_WHOLE), (VARLEN, DP_BALANCED),
                             (VARLEN, DYNAPIPE), (THD_WHOLE, PAD), (CUT, THD), (CUT, DP_BALANCED))
                if a in rows and b in rows}
    return dict(
        settings=dict(model=job.model.name or "custom", device=job.device, dtype=job.dtype, **job.layout,
                      attention=job.model.attention,
                      samples=len(lengths), real_tokens=real_tokens, max_seq_length=job.max_seq_length,
                      cost_model=job.cost_model_name, memory_limit_mb=job.memory_limit_mb),
        methods=rows, failed=dict(failed or {}), speedups=speedups,
        loss_gaps=gaps, losses_agree=all(gap <= LOSS_TOLERANCE[job.dtype] for gap in gaps.values()),
        threads_per_rank=per_rank[0]["threads"] if job.device == "cpu" else None,
        cores=os.cpu_count() if job.device == "cpu" else None,
        profile_threads=getattr(job.cost_model, "metadata", {}).get("cpu_threads"),
        cp_group_timed=bool(getattr(job.cost_model, "measured", None)) if job.cp > 1 else None,
        pace=dataclasses.asdict(pace) if pace else None)


def _layout(settings: dict) -> str:
    """"PP=2 x 2 chunks (first stage 2 layers), DP=1, CP=2": the chunks and CP where there are
    several, the first and last stages' layers where they are their own."""
    chunks = f" x {settings['chunks']} chunks" if settings["chunks"] > 1 else ""
    own = [f"{which} stage {layers} layers" for which in ("first", "last")
           if (layers := settings.get(f"{which}_stage_layers")) is not None]
    split = f" ({', '.join(own)})" if own else ""
    cp = f", CP={settings['cp']}" if settings["cp"] > 1 else ""
    return f"PP={settings['pp']}{chunks}{split}, DP={settings['dp']}{cp}"


def _rank_name(rank: dict, job: StepJob) -> str:
    """"stage 1", or with several data- or context-parallel ranks "stage 1, dp 0, cp 1"."""
    name = f"stage {rank['stage']}"
    if job.dp > 1:
        name += f", dp {rank['dp_rank']}"
    if job.cp > 1:
        name += f", cp {rank['cp_rank']}"
    return name


def _op_prices(methods: dict[str, Method], per_rank: list[dict], job: StepJob) -> "dict[str, list[dict]] | None":
    """Per method, each rank's compute ops' prices (:func:`~.step_timeline.op_prices`), for the
    report and the Chrome trace alike; None without a cost model of this device (the default
    analytical model prices an A100)."""
    if not job.predicts:
        return None
    costs = stage_costs(job)
    return {name: [step_timeline.op_prices(m.plans[rank["dp_rank"]][rank["stage"]], costs, rank["stage"])
                   for rank in per_rank] for name, m in methods.items()}


def _rank_timeline(rank: dict, name: str, job: StepJob, prices: "dict | None") -> dict:
    """A rank's extra timed step of method ``name`` split up, and what its compute ops were priced
    at in all (None without prices)."""
    return {"rank": _rank_name(rank, job), **step_timeline.breakdown(rank["timelines"][name]),
            "priced_compute_ms": None if prices is None else sum(prices.values())}


def _timeline_lines(row: dict) -> list[str]:
    """Each method's extra timed step, rank by rank: compute, waiting, the rest."""
    lines = []
    for name, m in row["methods"].items():
        if "timeline" in m:
            ranks = "; ".join(f"{r['rank']} {r['step_ms']:.0f} ms = compute {r['compute_ms']:.0f}"
                              + ("" if r["priced_compute_ms"] is None else f" (priced {r['priced_compute_ms']:.0f})")
                              + f" + waiting {r['waiting_ms']:.0f} + other {r['other_ms']:.0f}" for r in m["timeline"])
            lines.append(f"timeline of {name} (one more step, every instruction timed): {ranks}")
    if "chrome_trace" in row:
        lines.append(f"wrote {row['chrome_trace']} (chrome://tracing or ui.perfetto.dev)")
    return lines


def _sharing_lines(settings: dict, cores: "int | None", methods: dict) -> list[str]:
    """A note where the CPU has fewer cores than the job has ranks: the profile priced a rank with
    a core of its own, so while more ranks compute than there are cores each runs slower."""
    ranks = settings["pp"] * settings["dp"] * settings["cp"]
    if not cores or ranks <= cores or not any(m["predicted_ms"] is not None for m in methods.values()):
        return []
    return [f"note: {ranks} ranks shared {cores} cores, the predictions price a core for each: expect steps up to "
            f"{ranks / cores:.1f}x them here (their ratios still compare); a machine with {ranks} cores checks them"]


def _cp_group_lines(row: dict) -> list[str]:
    """A note where a CP run is predicted from a profile that timed no group of its size: the ring
    is then priced from the layer at CP 1, which sees neither its per-sample steps on packed rows
    nor the ranks' waits on each other (docs/benchmarks.md: 35-51% low on this package's CPU runs)."""
    cp = row["settings"]["cp"]
    if row.get("cp_group_timed") is not False or not any(m["predicted_ms"] is not None for m in row["methods"].values()):
        return []
    return [f"note: the profile timed no CP {cp} group, so the ring is priced from the layer alone and packed rows' "
            f"predictions run low: profile with --cp {cp} to time it on a real group"]


def _largest(values: list) -> "float | None":
    """The largest, or None where any is unknown."""
    return None if None in values else max(values)


def _loss_lines(row: dict) -> list[str]:
    """Whether the methods without leakage agree with pad-to-max, where it ran."""
    methods = row["methods"]
    if PAD not in methods:
        return ["losses: pad-to-max failed, so none is checked against it"]
    agree = "agree" if row["losses_agree"] else "DISAGREE"
    gaps = ", ".join(f"{name} {gap:.1e}" for name, gap in row["loss_gaps"].items())
    leaky = (f"; packing {methods[PACK]['loss']:.5f} (samples attend to their neighbours)" if PACK in methods
             else "")
    cut = (f"; {THD} {methods[THD]['loss']:.5f} (the documents cut: {CUT}'s gap is to it)"
           if THD in methods else "")
    return [f"losses: pad-to-max {methods[PAD]['loss']:.5f}; the others without leakage {agree} with it "
            f"(relative gaps: {gaps}){leaky}{cut}"]


def format_table(row: dict) -> str:
    s = row["settings"]
    lines = [
        f"step benchmark: {s['model']} GPT, {s['dtype']} on {s['device']}, {_layout(s)}, {s['samples']} samples "
        f"({s['real_tokens']} real tokens, up to {s['max_seq_length']}), attention {s['attention']}, "
        f"cost model {s['cost_model']}",
        "| method | micro-batches | padded tokens | median ms | real tokens/s | predicted ms | error "
        "| activations MB (predicted) | peak MB | planning s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in row["methods"].items():
        planning = "" if m["planning_s"] is None else f"{m['planning_s']:.2f}"
        peak = "-" if m["peak_mb"] is None else f"{m['peak_mb']:.0f}"  # the CPU keeps no allocator peak
        predicted, error = (("-", "-") if m["predicted_ms"] is None
                            else (f"{m['predicted_ms']:.1f}", f"{m['prediction_error_pct']:+.0f}%"))
        lines.append(f"| {name} | {m['microbatches']} | {m['padded_tokens']} | {m['median_ms']:.1f} | "
                     f"{m['tokens_per_s']:.0f} | {predicted} | {error} | {m['activations_mb']:.0f} "
                     f"({m['predicted_activations_mb']:.0f}) | {peak} | {planning} |")
    lines += [f"| {name} | failed: {why} | | | | | | | | |" for name, why in row["failed"].items()]
    lines.append("real tokens per second: " + ", ".join(f"{name} {x:.2f}x" for name, x in row["speedups"].items()))
    lines += _loss_lines(row)
    lines += _timeline_lines(row)
    if not any(m["predicted_ms"] is not None for m in row["methods"].values()):
        lines.append("no predictions: the default analytical model prices an A100, not this device; profile the "
                     "model here (megatron-dynapipe profile, or profile --calibrate for a quick fit) and pass "
                     "--cost-model FILE to compare predicted with measured")
    lines += pace_line(row["pace"], [m["paced_error_pct"] for m in row["methods"].values()
                                     if m["paced_error_pct"] is not None])
    lines += _sharing_lines(row["settings"], row["cores"], row["methods"])
    lines += _cp_group_lines(row)
    mine, profiled = row["threads_per_rank"], row["profile_threads"]
    if mine and profiled and mine != profiled:
        lines.append(f"note: the profile was measured with {profiled} CPU threads, each rank here ran with {mine}: "
                     f"profile with OMP_NUM_THREADS={mine} to predict this run")
    return "\n".join(lines)
