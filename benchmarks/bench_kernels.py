"""Kernel rates of a GPU at the shapes large GPT runs use, against the hardware file's roofline.

What the roofline cost model (``planning/cost_model/roofline.py``) and ``simulate`` assume of a
device is a GEMM efficiency, a memory efficiency and, for fused attention, an attention
efficiency. This measures them on the device in hand, in bf16, each the median of ``--repeats``
timed runs after warm-up (CUDA events), with the spread:

* **GEMMs** of a transformer layer on one TP rank: QKV ``(T, 3h/t, h)``, the attention output
  ``(T, h, h/t)``, FFN up ``(T, 4h/t, h)`` and down ``(T, h, 4h/t)``, and each one's two backward
  GEMMs, for hidden sizes 4096-16384, TP 1-8 and 2048-8192 tokens; each against the roofline's
  time for the same shape (``measured / roofline``).
* **Causal attention** (torch's ``scaled_dot_product_attention``, flash and cuDNN backends), head
  dim 128, sequence lengths 2048-16384, forward and backward, in TFLOP/s counted on the causal
  half (forward 2 GEMMs, backward 5, ``2 s^2 d / 2`` FLOPs each per head), and per backend and
  phase the line ``flops / rate + latency`` fitted to them: the hardware file's ``fused_attention``.
* **Memory bandwidth**: a device-to-device copy, bytes read and written.

    python benchmarks/bench_kernels.py --hardware h100 --json > kernels.json
    python benchmarks/bench_kernels.py --summarize benchmarks/results/h100-kernels.json
    megatron-dynapipe calibrate --from-kernels kernels.json --hardware h100 -o mine.json

The summary's fits live in ``megatron_dynapipe/hardware/kernels.py``; ``calibrate --from-kernels``
writes them into a hardware file.

On a CPU (no CUDA) it runs a token-sized version of every measurement, to check the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from megatron_dynapipe.hardware import load_hardware
from megatron_dynapipe.hardware.kernels import summary

HIDDEN = (4096, 8192, 12288, 16384)
TP = (1, 2, 4, 8)
TOKENS = (2048, 4096, 8192)
SEQ = (2048, 4096, 8192, 16384)
HEAD_DIM = 128


def timed_ms(fn, *, warmup: int, repeats: int) -> tuple[float, float]:
    """Median and spread (max - min) of ``fn``'s time in ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times), max(times) - min(times)


def layer_gemms(h: int, t: int, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of a layer's forward GEMMs on one TP rank and of their backward GEMMs."""
    forward = [("qkv", tokens, 3 * h // t, h), ("proj", tokens, h, h // t),
               ("fc1", tokens, 4 * h // t, h), ("fc2", tokens, h, 4 * h // t)]
    out = []
    for name, m, n, k in forward:
        out += [(f"{name} fwd", m, n, k), (f"{name} dgrad", m, k, n), (f"{name} wgrad", k, n, m)]
    return out


def gemm_rows(roofline, device, dtype, shapes, args) -> list[dict]:
    rows = []
    for h, t, tokens in shapes:
        for name, m, n, k in layer_gemms(h, t, tokens):
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            ms, spread = timed_ms(lambda: a @ b, warmup=args.warmup, repeats=args.repeats)
            predicted = float(roofline.gemm_ms(m, n, k))
            rows.append(dict(kind="gemm", gemm=name, hidden=h, tp=t, tokens=tokens, m=m, n=n, k=k, ms=ms,
                             spread_ms=spread, tflops=2 * m * n * k / ms / 1e9, roofline_ms=predicted,
                             measured_over_roofline=ms / predicted))
            del a, b
    return rows


def attention_rows(device, dtype, shapes, backends, args) -> list[dict]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for backend in backends:
        for seq, heads in shapes:
            q, k, v = (torch.randn(1, heads, seq, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            with sdpa_kernel(getattr(SDPBackend, backend)):
                try:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                except RuntimeError as error:  # this backend does not run here
                    rows.append(dict(kind="attention", backend=backend, seq=seq, heads=heads, error=str(error)[:200]))
                    continue
                grad = torch.randn_like(out)
                fwd, fwd_spread = timed_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                           warmup=args.warmup, repeats=args.repeats)
                both, _ = timed_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad),
                                   warmup=args.warmup, repeats=args.repeats)
            causal_flops = 2 * seq * seq * HEAD_DIM * heads / 2  # one GEMM over the causal half
            bwd = max(both - fwd, 1e-9)
            rows.append(dict(kind="attention", backend=backend, seq=seq, heads=heads, head_dim=HEAD_DIM,
                             forward_ms=fwd, forward_spread_ms=fwd_spread, backward_ms=bwd,
                             forward_tflops=2 * causal_flops / fwd / 1e9, backward_tflops=5 * causal_flops / bwd / 1e9))
            del q, k, v, out, grad
    return rows


def copy_row(device, nbytes: int, args) -> dict:
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms, spread = timed_ms(lambda: dst.copy_(src), warmup=args.warmup, repeats=args.repeats)
    return dict(kind="copy", bytes=nbytes, ms=ms, spread_ms=spread, GBps=2 * nbytes / ms / 1e6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="h100", help="the hardware file to compare with (default h100)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--summarize", metavar="FILE", help="summarize an earlier run's JSON instead of measuring")
    args = parser.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            earlier = json.load(f)
        print(json.dumps(summary(earlier["rows"], earlier["peak_tflops"],
                                 load_hardware(earlier["hardware"]).memory_bandwidth_GBps), indent=1))
        return 0
    hardware = load_hardware(args.hardware)
    roofline = hardware.roofline("bfloat16")
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if cuda:
        shapes = [(h, t, tokens) for h in HIDDEN for t in TP for tokens in TOKENS]
        attention = [(seq, heads) for seq in SEQ for heads in (8, 16, 32, 64)]
        backends, copy_bytes = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"), (2**28, 2**31)
    else:  # the script's own check: every measurement, token-sized
        shapes, attention, backends, copy_bytes = [(256, 2, 64)], [(64, 2)], ("MATH",), (2**20,)
    started = time.perf_counter()
    rows = gemm_rows(roofline, device, dtype, shapes, args)
    rows += attention_rows(device, dtype, attention, backends, args)
    rows += [copy_row(device, n, args) for n in copy_bytes]
    peak = hardware.peak("bfloat16")
    result = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                  hardware=hardware.name, peak_tflops=peak, seconds=time.perf_counter() - started,
                  summary=summary(rows, peak, hardware.memory_bandwidth_GBps), rows=rows)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(json.dumps(result["summary"], indent=1))
        print(f"{len(rows)} measurements in {result['seconds']:.0f} s on {result['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
