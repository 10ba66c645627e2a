"""Real tokens per second of Megatron-LM's pretrain_gpt.py, its own packing against DynaPipe, on
your corpus, through `megatron-dynapipe launch`, with each method's predicted iteration time.

The methods (``--methods``; the default is every one the checkout and ``--attention`` allow):

* ``packed`` -- Megatron's GPT dataset: ``--global-batch-size`` rows of ``--seq-length`` tokens of
  concatenated documents, every token real, documents attending to each other across their
  boundaries (leaky); Megatron's 1F1B.
* ``masked`` -- the same rows with Megatron-LM core_v0.19's ``--dataloader-inter-document-masking``:
  each document (or the part of it a row holds) attends to itself alone (THD); Megatron's 1F1B.
  Needs a core_v0.19 checkout and an attention core that takes packed rows (``--attention sdpa``).
  At PP > 1 it runs one row a micro-batch: core_v0.19.0 flattens a micro-batch of m rows into one
  packed row of m x --seq-length tokens, which the next stage receives into 1F1B's fixed
  [--seq-length, m, hidden] buffer, so with m > 1 the second stage fails in attention.
* ``dynapipe``, ``fast`` -- DynaPipe in normal and fast mode: the same number of whole documents
  (or --seq-length windows of longer ones) a batch, padded micro-batches of the planned sizes.
* ``varlen`` -- DynaPipe with ``--dynapipe-packing varlen``: each planned micro-batch one packed row,
  every document attending to itself alone (``--attention sdpa``).

With ``--attention sdpa`` every method builds megatron-core's local layers with the SDPA core
(``--dynapipe-attention sdpa``, Megatron's own methods included), so the ratios measure batching and
scheduling, not kernels. Each rate is the median, over the iterations after the first two, of real
tokens / Megatron's "elapsed time per iteration" (the spread: their smallest and largest). Every
method logs its per-token loss (``--calculate-per-token-loss``): DynaPipe's three train the same
documents and must agree; Megatron's rows are other samples of the corpus.

With ``--cost-model PROFILE`` (``megatron-dynapipe profile`` of this model on this machine) DynaPipe
plans with it and logs its prediction, and Megatron's methods are predicted by the same model from
the rows Megatron's own GPT dataset gives each micro-batch of each iteration (built here from the
checkout, as pretrain_gpt.py builds it): 1F1B, no recompute, the slowest data-parallel rank.

    python benchmarks/bench_megatron_lm_throughput.py --checkout ~/Megatron-LM \\
        --data-path corpus_text_document --tokenizer-model tok --attention sdpa --cost-model prof.json \\
        --layouts 2x1 2x2 -- --cpu

The arguments after ``--`` go to the launcher (``--cpu`` for a CPU run over gloo).
``benchmarks/make_stdlib_corpus.py`` makes a corpus and tokenizer on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)"
                       r".*?lm loss: ([0-9.eE+-]+)")
PLANNED = re.compile(r"> megatron-dynapipe train iteration (\d+): global batch of \d+ samples, (\d+) real tokens,"
                     r".*?predicted ([0-9.]+) ms")
METHODS = ("packed", "masked", "dynapipe", "fast", "varlen")
MEGATRONS = ("packed", "masked")
CELL = 18  # a column of the report: "2363 [2217-2471]", "1.02x [0.95-1.10]"
MICRO_BATCH_SIZE = 2  # Megatron's own methods' (DynaPipe plans its own micro-batches)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _micro_batch_size(method: str, pp: int) -> int:
    return 1 if method == "masked" and pp > 1 else MICRO_BATCH_SIZE  # see the module docstring


def _model_flags(args) -> list[str]:
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads",
            str(args.num_attention_heads), "--seq-length", str(args.seq_length), "--max-position-embeddings",
            str(args.seq_length), "--position-embedding-type", "learned_absolute", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            args.tokenizer_model, "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.iterations), "--lr", "1e-3",
            "--lr-decay-style", "constant", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
            "--data-path", args.data_path, "--split", "100,0,0", "--calculate-per-token-loss", "--seed", "1234",
            "--dynapipe-attention", args.attention]  # every method's layers, Megatron's own too


def _method_flags(args, method: str, pp: int) -> list[str]:
    flags = ["--pipeline-model-parallel-size", str(pp), "--micro-batch-size", str(_micro_batch_size(method, pp))]
    if method in MEGATRONS:
        return flags + (["--dataloader-inter-document-masking"] if method == "masked" else [])
    flags += ["--dynapipe", "--dynapipe-memory-limit", str(args.memory_limit), "--dynapipe-preprocess-workers", "1",
             "--dynapipe-fast-mode", "true" if method == "fast" else "false", "--dynapipe-kv-port", str(_port()),
             "--dynapipe-packing", "varlen" if method == "varlen" else "pad"]
    return flags + (["--dynapipe-cost-model", args.cost_model] if args.cost_model else [])


def _run(args, launcher_args, pp: int, dp: int, method: str) -> list[dict]:
    """One run of ``method``: per iteration its time, loss, real tokens and (DynaPipe) prediction."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(pp * dp), "--master-addr",
               "127.0.0.1", "--master-port", str(_port()), "-m", "megatron_dynapipe.megatron_lm.launcher",
               *launcher_args, os.path.join(args.checkout, "pretrain_gpt.py"), *_model_flags(args),
               *_method_flags(args, method, pp)]
    proc = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode:
        sys.exit(f"{method} at PP {pp} x DP {dp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    planned = {int(i) + 1: (int(n), float(ms)) for i, n, ms in PLANNED.findall(proc.stdout)}  # Megatron counts from 1
    rows = []
    for i, ms, loss in ITERATION.findall(proc.stdout):
        tokens, predicted = planned.get(int(i), (args.global_batch_size * args.seq_length, None))
        rows.append(dict(iteration=int(i), ms=float(ms), loss=float(loss), tokens=tokens, predicted_ms=predicted))
    return rows


# --------------------------------------------------------------------------------------------
# Megatron's rows, and their predicted time
# --------------------------------------------------------------------------------------------

_ROWS = """
import json, os, sys
sys.argv = ["pretrain_gpt.py", *json.loads(os.environ["BENCH_FLAGS"])]
from megatron.training.arguments import parse_and_validate_args
from megatron_dynapipe.megatron_lm.pretrain_hooks import extra_args_provider
args = parse_and_validate_args(extra_args_provider=extra_args_provider(), args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
import pretrain_gpt
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset
config = pretrain_gpt.core_gpt_dataset_config_from_args(args)
count = args.global_batch_size * args.train_iters
train = BlendedMegatronDatasetBuilder(GPTDataset, [count, 0, 0], lambda: True, config).build()[0]
rows = []
for i in range(count):
    sample = train[i]
    ends = sorted(set(sample["cu_seqlens"].tolist())) if "cu_seqlens" in sample else [0, args.seq_length]
    rows.append([b - a for a, b in zip(ends, ends[1:])])
print("ROWS " + json.dumps(rows))
"""


def megatron_rows(args, pp: int, dp: int, method: str) -> list[list[int]]:
    """The document segments of every row Megatron's GPT dataset gives the run, in sample order."""
    flags = [*_model_flags(args), "--transformer-impl", "local", "--use-cpu-initialization",
             *_method_flags(args, method, pp)]
    env = dict(os.environ, BENCH_FLAGS=json.dumps(flags), WORLD_SIZE=str(pp * dp), RANK="0",
               PYTHONPATH=os.pathsep.join([args.checkout, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _ROWS], capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"building Megatron's rows failed:\n{proc.stderr[-3000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("ROWS "))
    return json.loads(line[5:])


def predicted_megatron_ms(args, rows: list[list[int]], pp: int, dp: int, method: str) -> list[float]:
    """Each iteration's time as the cost model prices Megatron's micro-batches of these rows (its
    sampler gives DP rank r rows r*m..r*m+m-1 of each m*DP): 1F1B without recompute, the slowest rank."""
    import numpy as np

    from megatron_dynapipe.planning.cost_model import StageCosts, load_cost_model
    from megatron_dynapipe.planning.schedules import one_f_one_b_orders
    from megatron_dynapipe.planning.simulator import simulate, stage_work
    from megatron_dynapipe.planning.types import MicroBatch

    costs = StageCosts(load_cost_model(args.cost_model, tp=1, hidden_size=args.hidden_size),
                       num_layers=args.num_layers, pp=pp, dp=dp)
    m, seq = _micro_batch_size(method, pp), args.seq_length
    times = []
    for start in range(0, len(rows), args.global_batch_size):
        batch = rows[start:start + args.global_batch_size]
        slowest = 0.0
        for rank in range(dp):
            mine = [batch[at + rank * m:at + rank * m + m] for at in range(0, len(batch), m * dp)]
            if method == "masked":  # a micro-batch is one packed row of its rows' segments (THD)
                microbatches = [MicroBatch(tuple(range(sum(map(len, mb)))), m * seq,
                                           tuple(s for row in mb for s in row)) for mb in mine]
            else:
                microbatches = [MicroBatch(tuple(range(len(mb))), seq) for mb in mine]
            work = stage_work(costs, microbatches, np.zeros((pp, len(microbatches)), dtype=int))
            slowest = max(slowest, simulate(one_f_one_b_orders(pp, len(microbatches)), work).makespan)
        times.append(slowest)
    return times


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


def summarize(runs: list[dict], predicted: "list[float] | None") -> dict:
    """One run: median real tokens/s over the iterations after the first two, the median predicted
    and measured iteration times over those iterations, and the losses."""
    timed = runs[2:]
    predicted = [p for p in (predicted or [r["predicted_ms"] for r in runs])[2:] if p]
    return dict(rate=statistics.median(r["tokens"] / (r["ms"] / 1000) for r in timed),
                measured_ms=statistics.median(r["ms"] for r in timed),
                predicted_ms=statistics.median(predicted) if predicted else None,
                losses=[r["loss"] for r in runs], iterations=runs)


def combine(repeats: list[dict]) -> dict:
    """The repeats of one method: the median of their rates and times, their spread, the first's losses
    (every repeat trains the same samples from the same seed)."""
    rates = [r["rate"] for r in repeats]
    predicted = [r["predicted_ms"] for r in repeats if r["predicted_ms"]]
    return dict(rate=statistics.median(rates), low=min(rates), high=max(rates),
                measured_ms=statistics.median(r["measured_ms"] for r in repeats),
                predicted_ms=statistics.median(predicted) if predicted else None,
                losses=repeats[0]["losses"], same_losses=all(r["losses"] == repeats[0]["losses"] for r in repeats),
                repeats=repeats)


def _checkout_has(args, flag: str) -> bool:
    with open(os.path.join(args.checkout, "megatron", "training", "arguments.py")) as f:
        return flag in f.read()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", required=True, help="a Megatron-LM checkout (core_v0.16.1 to core_v0.19.x)")
    parser.add_argument("--data-path", required=True, help="a .bin/.idx prefix (tools/preprocess_data.py)")
    parser.add_argument("--tokenizer-model", required=True, help="the Hugging Face tokenizer it was made with")
    parser.add_argument("--layouts", nargs="+", default=["2x1", "2x2"], metavar="PPxDP",
                        help="pipeline x data-parallel sizes (default 2x1 2x2)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, help="default: every one this checkout and "
                        "--attention allow")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--memory-limit", type=float, default=3000, help="--dynapipe-memory-limit MB (default 3000)")
    parser.add_argument("--attention", choices=("local", "sdpa"), default="local",
                        help="attention core of every method's layers (--dynapipe-attention); sdpa adds the "
                             "packed methods, varlen and masked (default local)")
    parser.add_argument("--cost-model", help="a profile of this model on this machine: DynaPipe plans with it, and "
                                             "every method's iteration time is predicted with it")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each method, in turn (default 1)")
    parser.add_argument("--json", metavar="FILE", help="also write every run's iterations and summary here")
    args = parser.parse_args(argv)
    packed_ok = args.attention == "sdpa"
    methods = args.methods or [m for m in METHODS if (m not in ("varlen", "masked") or packed_ok)
                               and (m != "masked" or _checkout_has(args, "--dataloader-inter-document-masking"))]
    if not packed_ok and {"varlen", "masked"} & set(methods):
        parser.error("varlen and masked train packed rows: pass --attention sdpa (or transformer-engine's layers)")
    base = methods[0]
    print(f"{'layout':<12}" + "".join(f" {m:>{CELL}}" for m in methods) + "   (real tokens/s: median [min-max]"
          f"{' of the runs' if args.repeats > 1 else ' of the iterations'}; x {base}"
          f"{' (median [min-max] of the rounds)' if args.repeats > 1 else ''}; predicted / measured - 1)")
    report = {}
    for layout in args.layouts:
        pp, dp = (int(x) for x in layout.lower().split("x"))
        report[layout] = measure_layout(args, launcher_args, pp, dp, methods)
        print_layout(pp, dp, report[layout], base)
    if args.json:  # written whole or not at all
        with open(args.json + ".partial", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(args.json + ".partial", args.json)
    return 0


def measure_layout(args, launcher_args, pp: int, dp: int, methods: list[str]) -> dict:
    """Every method's summary at PP x DP: ``--repeats`` runs each, in turn."""
    predicted = {}
    for method in methods:
        if method in MEGATRONS and args.cost_model:
            rows = (megatron_rows(args, pp, dp, method) if method == "masked"
                    else [[args.seq_length]] * (args.global_batch_size * args.iterations))
            predicted[method] = predicted_megatron_ms(args, rows, pp, dp, method)
    runs = {method: [] for method in methods}
    for _ in range(args.repeats):
        for method in methods:
            runs[method].append(summarize(_run(args, launcher_args, pp, dp, method), predicted.get(method)))
    if args.repeats > 1:
        summaries = {method: combine(runs[method]) for method in methods}
        for method in methods:  # each round's ratio to the same round's baseline: drift between rounds cancels
            summaries[method]["ratios"] = [r["rate"] / b["rate"] for r, b in zip(runs[method], runs[methods[0]])]
        return summaries
    summaries = {}
    for method, (run,) in runs.items():  # one run: the spread of its iterations
        rates = [r["tokens"] / (r["ms"] / 1000) for r in run["iterations"][2:]]
        summaries[method] = dict(run, low=min(rates), high=max(rates))
    return summaries


def print_layout(pp: int, dp: int, summaries: dict, base: str) -> None:
    def row(head: str, cells) -> str:
        return head.ljust(12) + "".join(f" {cell:>{CELL}}" for cell in cells)

    print(row(f"PP {pp} x DP {dp}:", (f"{s['rate']:.0f} [{s['low']:.0f}-{s['high']:.0f}]" for s in summaries.values())))
    print(row("", (_ratio(s, summaries[base]) for s in summaries.values())))
    print(row("", (_error(s) for s in summaries.values())), flush=True)
    for method, s in summaries.items():
        print(f"  {method} losses: {[round(x, 4) for x in s['losses']]}")


def _ratio(summary: dict, base: dict) -> str:
    """x the baseline: the median of the rounds' own ratios and their spread, where there are rounds."""
    ratios = summary.get("ratios")
    if not ratios:
        return f"{summary['rate'] / base['rate']:.2f}x"
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


def _error(summary: dict) -> str:
    if not summary["predicted_ms"]:
        return "-"
    return f"{summary['predicted_ms'] / summary['measured_ms'] - 1:+.0%}"


if __name__ == "__main__":
    sys.exit(main())
