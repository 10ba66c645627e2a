"""Sizing on your data, checked where it can be measured: ``trace --method all`` and ``simulate``
predict each drawn batch's step; ``bench step`` then runs the same batches as real megatron-core
steps through the same executor, and the two are set side by side. Links and shared cores are
priced by a hardware file ``calibrate`` makes here first (``--hardware`` to give one).

    megatron-dynapipe profile --model tiny --hidden-dropout 0 --attention-dropout 0 \\
        --attention sdpa --recompute none -o tiny.json        # OMP_NUM_THREADS=1 for PP 2 on 2 cores
    python benchmarks/bench_sizing.py --cost-model tiny.json --pp 2 [--dp 2] [--json]

Per batch and method, the predicted step (the traced step replayed: DynaPipe's and DynaPipe
varlen's plans, THD packing's rows of Megatron's windows, and Megatron's fixed shapes) against the
median measured step. The planned methods run the same micro-batches in both. The packings do
not: the sizing follows Megatron's data path (documents back to back, cut into windows of
``--seq-length``; ``global batch`` windows), while ``bench step`` packs whole samples first-fit
(a few more rows), so THD packing (against ``bench step``'s THD packing (whole)) and Megatron's
fixed shapes (against its leaky packing, which attends across documents as Megatron's windows do)
are compared per row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_dynapipe.planning.methods import METHODS

MODEL = "--model tiny --attention sdpa --hidden-dropout 0 --attention-dropout 0"
#: trace's method -> the label of bench step's row it is set against, and whether the two run the
#: same micro-batches (the windows' methods against their whole-sample twins, row for row)
PAIRS = {traced: (METHODS[run].label, same) for traced, run, same in (
    ("dynapipe", "dynapipe", True), ("dynapipe-varlen", "dynapipe-varlen", True),
    ("thd", "thd-whole", False), ("megatron", "packing", False))}


def cli(*args: str, env: "dict | None" = None) -> str:
    """``megatron-dynapipe ARGS``; its standard output (a failure stops the benchmark, saying why)."""
    done = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", *args], capture_output=True, text=True,
                          env=None if env is None else {**os.environ, **env})
    if done.returncode:
        sys.exit(f"megatron-dynapipe {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


def lengths_file(args, work: Path) -> str:
    """``--lengths``, or 512 samples of ``--mix`` scaled to ``--seq-length`` as ``bench step``
    scales it, written out for ``trace`` to draw from."""
    from megatron_dynapipe.planning.samples import scaled_lengths

    if args.lengths:
        return args.lengths
    pool = scaled_lengths(512, args.seed, args.mix, args.seq_length)
    path = work / "lengths.txt"
    path.write_text("".join(f"{n}\n" for n in pool))
    return str(path)


def draw(args, lengths: str, work: Path) -> list[Path]:
    """The batches ``trace`` draws from ``lengths``, written out one length a line for ``bench step``."""
    from megatron_dynapipe.planning.samples import LengthSource

    paths = []
    for index, batch in enumerate(LengthSource.from_file(lengths).batches(
            args.global_batch_size * args.seq_length, args.seq_length, args.batches, args.seed)):
        paths.append(work / f"batch{index}.txt")
        paths[-1].write_text("".join(f"{n}\n" for n in batch))
    return paths


def calibrated(args, work: Path) -> str:
    """This machine as ``bench step``'s ranks use it: ``calibrate`` with as many gloo processes,
    each with the threads ``bench step`` gives a rank, so that the file's compute slots say how many
    ranks compute at full speed at once (4 single-threaded ranks on 2 cores: 2)."""
    world = args.pp * args.dp
    threads = max(1, (os.cpu_count() or 1) // world)
    path = str(work / "hardware.json")
    cli("calibrate", "--nproc", str(world), "-o", path, env={"OMP_NUM_THREADS": str(threads)})
    return path


def predicted(args, lengths: str, work: Path) -> dict[str, list[float]]:
    """Each method's predicted step per batch, ms: ``trace --method all`` then ``simulate``."""
    config = f"{args.pp * args.dp} {args.pp} 1 gbs={args.global_batch_size} seq={args.seq_length}"
    cli("trace", *args.model.split(), "--config", config, "--cost-model", args.cost_model, "--hardware", args.hardware,
        "--lengths", lengths, "--method", "all",
        "--batches", str(args.batches), "--seed", str(args.seed), "--output-dir", str(work / "traces"), "--no-progress")
    out = {}
    for folder in sorted((work / "traces").iterdir()):
        report = json.loads(cli("simulate", str(folder), "--hardware", args.hardware, "--json"))
        planned = report.get("planned")
        method = planned["method"] if planned else "megatron"
        out[method] = ([1e3 * b["step_s"] for b in planned["batches"]] if planned
                       else [1e3 * report["iteration_s"]] * args.batches)  # one shape: every batch alike
    return out


def measured(args, batch: Path) -> dict:
    """``bench step`` on one batch: each method's median step, its spread and its rows."""
    return json.loads(cli("bench", "step", *args.model.split(), "--cost-model", args.cost_model, "--lengths",
                          str(batch), "--seq-length", str(args.seq_length), "--pp", str(args.pp), "--dp",
                          str(args.dp), "--steps", str(args.steps), "--json"))


def compare(args, steps: dict[str, list[float]], runs: list[dict]) -> list[dict]:
    rows = []
    for method, (bench_name, same) in PAIRS.items():
        for index, run in enumerate(runs):
            got = run["methods"][bench_name]
            # a sizing step trains global-batch windows; bench step's packings, padded_tokens / seq rows
            units = (1, 1) if same else (args.global_batch_size, got["padded_tokens"] / args.seq_length)
            predicted_ms, measured_ms = steps[method][index] / units[0], got["median_ms"] / units[1]
            rows.append({"method": method, "batch": index, "per": "step" if same else "row",
                         "predicted_ms": predicted_ms, "measured_ms": measured_ms, "spread_ms": got["spread_ms"] / units[1],
                         "error_pct": 100 * (predicted_ms / measured_ms - 1),
                         "predicted_tokens_per_s": 1e3 * run["settings"]["real_tokens"] / steps[method][index],
                         "measured_tokens_per_s": got["tokens_per_s"]})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost-model", required=True, metavar="FILE", help="the model's profile (see above)")
    p.add_argument("--model", default=MODEL, metavar="FLAGS", help=f"the model's flags (default {MODEL!r})")
    p.add_argument("--hardware", metavar="NAME|FILE",
                   help="the hardware trace and simulate price links and shared cores with (default: calibrated here)")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=256)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--lengths", metavar="FILE", help="the samples' lengths (default: --mix's)")
    source.add_argument("--mix", default="multitask", help="a documented mix, scaled to --seq-length (default multitask)")
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=5, help="bench step's timed steps per method (default 5)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    data = args.lengths or f"the {args.mix} mix scaled to {args.seq_length}"
    with tempfile.TemporaryDirectory(prefix="bench-sizing-") as tmp:
        work = Path(tmp)
        lengths = lengths_file(args, work)
        batches = draw(args, lengths, work)
        args.hardware = args.hardware or calibrated(args, work)
        steps = predicted(args, lengths, work)
        runs = [measured(args, batch) for batch in batches]
    rows = compare(args, steps, runs)
    if args.json:
        print(json.dumps({"settings": {**vars(args), "lengths": data}, "rows": rows}, indent=1))
        return 0
    print(f"PP {args.pp} x DP {args.dp}, global batch {args.global_batch_size} x {args.seq_length} tokens, "
          f"{args.batches} batches of {data}")
    print("| method | batch | per | predicted ms | measured ms (spread) | predicted / measured - 1 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['batch']} | {r['per']} | {r['predicted_ms']:.1f} | "
              f"{r['measured_ms']:.1f} ({r['spread_ms']:.1f}) | {r['error_pct']:+.1f}% |")
    errors = [abs(r["error_pct"]) for r in rows]
    print(f"|error|: median {statistics.median(errors):.1f}%, largest {max(errors):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
