"""Real tokens per second of Megatron-LM's pretrain_gpt.py: its packed 1F1B against DynaPipe
(normal and fast mode; with ``--attention sdpa`` also packed micro-batches, ``--dynapipe-packing
varlen``), on your corpus, through `megatron-dynapipe launch`.

Packed 1F1B trains --global-batch-size sequences of --seq-length tokens of concatenated
documents per iteration, every token real; DynaPipe trains the same number of whole documents
(or --seq-length windows of longer ones), its real tokens per iteration from its own log line.
Each rate is the median over the iterations after the first two of real tokens / Megatron's
"elapsed time per iteration". The losses are printed too (per token, --calculate-per-token-loss).

    python benchmarks/bench_megatron_lm_throughput.py --checkout ~/Megatron-LM \\
        --data-path corpus_text_document --tokenizer-model tok --layouts 2x1 2x2 -- --cpu

The arguments after ``--`` go to the launcher (``--cpu`` for a CPU run over gloo). With
``--attention sdpa`` every method, Megatron's own packed 1F1B included, builds megatron-core's local
layers with the SDPA core (``--dynapipe-attention sdpa``), so all of them run the same layers.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)"
                       r".*?lm loss: ([0-9.eE+-]+)")
REAL_TOKENS = re.compile(r"> megatron-dynapipe train iteration (\d+): global batch of \d+ samples, (\d+) real tokens")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_flags(args) -> list[str]:
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads",
            str(args.num_attention_heads), "--seq-length", str(args.seq_length), "--max-position-embeddings",
            str(args.seq_length), "--position-embedding-type", "learned_absolute", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            args.tokenizer_model, "--micro-batch-size", "2", "--global-batch-size", str(args.global_batch_size),
            "--train-iters", str(args.iterations), "--lr", "1e-3", "--lr-decay-style", "constant",
            "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--data-path", args.data_path,
            "--split", "100,0,0", "--calculate-per-token-loss", "--seed", "1234",
            "--dynapipe-attention", args.attention]  # every method's layers, Megatron's own 1F1B's too


def _run(args, launcher_args, nproc: int, pp: int, method: str) -> tuple[float, list[float]]:
    dynapipe = [] if method == "packed" else [
        "--dynapipe", "--dynapipe-memory-limit", str(args.memory_limit), "--dynapipe-preprocess-workers", "1",
        "--dynapipe-fast-mode", "true" if method == "fast" else "false", "--dynapipe-kv-port", str(_port()),
        "--dynapipe-packing", "varlen" if method == "varlen" else "pad"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(_port()), "-m", "megatron_dynapipe.megatron_lm.launcher",
               *launcher_args, os.path.join(args.checkout, "pretrain_gpt.py"), *_model_flags(args),
               "--pipeline-model-parallel-size", str(pp), *dynapipe]
    proc = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode:
        sys.exit(f"{method} at {nproc} ranks failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    iterations = [(int(i), float(ms), float(loss)) for i, ms, loss in ITERATION.findall(proc.stdout)]
    real = {int(i) + 1: int(n) for i, n in REAL_TOKENS.findall(proc.stdout)}  # Megatron counts from 1
    packed_tokens = args.global_batch_size * args.seq_length
    rates = [(packed_tokens if method == "packed" else real[i]) / (ms / 1000) for i, ms, _ in iterations[2:]]
    return statistics.median(rates), [loss for _, _, loss in iterations]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", required=True, help="a Megatron-LM checkout (tag core_v0.16.1)")
    parser.add_argument("--data-path", required=True, help="a .bin/.idx prefix (tools/preprocess_data.py)")
    parser.add_argument("--tokenizer-model", required=True, help="the Hugging Face tokenizer it was made with")
    parser.add_argument("--layouts", nargs="+", default=["2x1", "2x2"], metavar="PPxDP",
                        help="pipeline x data-parallel sizes (default 2x1 2x2)")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--memory-limit", type=float, default=3000, help="--dynapipe-memory-limit MB (default 3000)")
    parser.add_argument("--attention", choices=("local", "sdpa"), default="local",
                        help="attention core of every method's layers (--dynapipe-attention); sdpa adds DynaPipe "
                             "varlen (default local)")
    args = parser.parse_args(argv)
    methods = ("packed", "dynapipe", "fast") + (("varlen",) if args.attention == "sdpa" else ())
    print(f"{'layout':<12}" + "".join(f" {m:>9}" for m in methods)
          + "".join(f" {m + '/packed':>15}" for m in methods[1:]))
    for layout in args.layouts:
        pp, dp = (int(x) for x in layout.lower().split("x"))
        rates, losses = {}, {}
        for method in methods:
            rates[method], losses[method] = _run(args, launcher_args, pp * dp, pp, method)
        print(f"PP {pp} x DP {dp}:".ljust(12) + "".join(f" {rates[m]:>9.0f}" for m in methods)
              + "".join(f" {rates[m] / rates['packed']:>14.2f}x" for m in methods[1:]), flush=True)
        print("  losses: " + ", ".join(f"{m} {[round(x, 3) for x in losses[m]]}" for m in methods))
    return 0


if __name__ == "__main__":
    sys.exit(main())
