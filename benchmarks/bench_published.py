"""Predicted against published TFLOP/s per GPU: Megatron-LM's weak-scaling runs on A100s.

    python benchmarks/bench_published.py [--rows 6 | --rows 6-8] [--micro-batch-sizes 1 2 4] [--json]

The runs are Table 1 of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC'21): GPT models of 1.7 B to 1 T parameters (sequence 2048,
vocabulary 51200) on 32 to 3072 A100-80GB GPUs with the tensor- and pipeline-parallel sizes and
batch sizes the table gives, activation recomputation on, FLOP/s counted by the paper's formula
``96 B s l h^2 (1 + s / 6h + V / 16 l h)`` (which includes the recomputed forward).

For each run of ``--rows`` (the first N, or a range such as 6-8), ``search`` with the table's TP
and PP fixed, full recompute, the plain (all-reduce) optimizer and ``--micro-batch-sizes``
traces and simulates the layout on the shipped ``a100`` hardware file; the fastest that fits
is compared.  Compute times come from that file's roofline (GEMMs by shape, elementwise
kernels at memory bandwidth: docs/cost_model.md); where a shipped profile matches the model's
width (``gpt-6.7b-a100``: hidden 4096) a second prediction uses it.  Communication is NCCL's
ring or tree over NVLink and one 200 Gb/s rail per GPU (docs/simulate.md).  The table gives
neither micro-batch sizes nor which runs interleave, so the search tries 1, 2 and 4 model chunks
a rank where they apply (printed as V); sequence parallelism postdates the paper and stays off, and
so does overlapped pipeline communication: the paper's Megatron-LM blocked on each transfer
(``--no-overlap-p2p-communication``, with which megatron-core interleaves only at PP > 2), and
for each TP all-reduce of a column-parallel linear's backward, which megatron-core now runs beside
the weight-gradient GEMM (``SearchSpace.async_tp_backward=False``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

# billions of parameters, heads, hidden, layers, TP, PP, GPUs, batch, published TFLOP/s per GPU
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB = 2048, 51200
PROFILES = {4096: "gpt-6.7b-a100"}


def paper_flops(batch: int, layers: int, hidden: int) -> float:
    s, l, h, V = SEQ, layers, hidden, VOCAB
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def predict(row, cost_model, out: str, micro_batch_sizes) -> dict:
    from megatron_dynapipe.config.model import ModelSpec
    from megatron_dynapipe.hardware import load_hardware
    from megatron_dynapipe.simulate.search import SearchSpace, run_search

    _, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    # SC'21's runs predate transformer-engine: megatron-core's local layers, its unfused core
    model = ModelSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=VOCAB,
                      max_sequence_length=SEQ, attention="local")
    space = SearchSpace(model, gpus, batch, SEQ, load_hardware("a100"), tp=(tp,), pp=(pp,),
                        micro_batch_sizes=tuple(micro_batch_sizes), recompute=("full",), distributed_optimizer=(False,),
                        sequence_parallel=(False,), cost_model=cost_model, overlap_p2p_comm=False,
                        async_tp_backward=False)
    result = run_search(space, out, progress=sys.stderr.isatty())
    best = result.ranked()[0]
    return {"iteration_s": best.iteration_s, "micro_batch_size": best.candidate.micro_batch_size,
            "virtual_stages": best.candidate.virtual_stages,
            "tflops": paper_flops(batch, layers, hidden) / best.iteration_s / gpus / 1e12,
            "bubble": best.report.bubble_fraction, "exposed_comm_s": best.report.exposed_comm_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="6", help="the first N runs of the table, or runs A-B (default 6)")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4], metavar="B",
                        help="micro-batch sizes searched (default 1 2 4)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    out = tempfile.mkdtemp(prefix="bench_published_")
    rows = []
    print("params  TP  PP  GPUs  batch  published  predicted (roofline)  error   predicted (profiled)  error")
    first, _, last = args.rows.partition("-")
    chosen = TABLE_1[int(first) - 1:int(last)] if last else TABLE_1[:int(first)]
    for row in chosen:
        roofline = predict(row, None, out, args.micro_batch_sizes)
        profile = PROFILES.get(row[2])
        profiled = predict(row, profile, out, args.micro_batch_sizes) if profile else None
        published = row[-1]
        line = (f"{row[0]:>6}B {row[4]:>3} {row[5]:>3} {row[6]:>5} {row[7]:>6} {published:>10} "
                f"{roofline['tflops']:>15.1f} (mbs {roofline['micro_batch_size']}, V {roofline['virtual_stages']}) "
                f"{roofline['tflops'] / published - 1:>+7.1%}")
        if profiled:
            choice = f"mbs {profiled['micro_batch_size']}, V {profiled['virtual_stages']}"
            line += f" {profiled['tflops']:>14.1f} ({choice}) {profiled['tflops'] / published - 1:>+7.1%}"
        print(line, flush=True)
        rows.append({"params_b": row[0], "tp": row[4], "pp": row[5], "gpus": row[6], "batch": row[7],
                     "published_tflops": published, "roofline": roofline, "profiled": profiled})
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
