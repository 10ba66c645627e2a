"""`megatron-dynapipe calibrate`: measure this machine and write a hardware file for it.

N local processes join one process group (gloo on CPU, NCCL with one GPU each) and time
all-reduce, all-gather, reduce-scatter, all-to-all over all N and p2p between pairs, for message
sizes from ``--min-bytes`` to ``--max-bytes`` (powers of 4).  An op's time is the slowest
rank's (each op starts after a barrier), the median of ``--repeats``.  Per kind the latency and
bandwidth of the cost formula in :mod:`.hardware` are fitted to the points by least squares on
the relative error (small messages count as much as large ones); the timing and the fit are
:mod:`megatron_dynapipe.profiling.link`'s, which the profiler's link measurement shares.  Each process also multiplies
matrices (peak FLOP/s of each dtype while all ranks compute at once) and copies a large tensor
(memory bandwidth), and counts how many ranks compute at full speed at once (a GPU each; on a CPU
the cores over each rank's torch threads).  The file says ``gpus_per_node = N``: the measured links are the
intra-node ones, and the inter-node link repeats the slowest measured kind (a single machine
cannot measure a network it does not have: edit it, or use a shipped file for multi-node jobs).

``--from-profile`` starts no process: it fits the compute rates of ``--hardware``'s roofline to a
profile's measured layer times and writes that hardware file with them (:mod:`..hardware.fit`).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

from megatron_dynapipe.files import check_output_file
from megatron_dynapipe.hardware import Hardware, Link, flat_collective_us
from megatron_dynapipe.hardware.kernels import DEFAULT_BACKEND, read_kernel_table
from megatron_dynapipe.local_ranks import run_local_ranks
from megatron_dynapipe.planning.flags import positive_int_argument
from megatron_dynapipe.profiling.link import KINDS, device_and_sync, fit_link, time_kinds

__all__ = ["add_arguments", "run", "measure"]

_DTYPES = ("float32", "bfloat16")
DEFAULT_HARDWARE = "h100"  # whose rates --from-profile and --from-kernels replace unless told


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, metavar="N",
                   help="processes (default: the visible GPUs, else 4 CPU processes)")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with GPUs, else gloo")
    p.add_argument("--min-bytes", type=positive_int_argument, default=1024, metavar="B",
                   help="smallest message (default 1 KiB)")
    p.add_argument("--max-bytes", type=positive_int_argument, metavar="B",
                   help="largest message (default 256 MiB with NCCL, 16 MiB with gloo)")
    p.add_argument("--repeats", type=int, default=5, help="timed ops per size and kind (default 5)")
    p.add_argument("--name", help="the hardware's name in the file (default: host, device and backend)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="give up (and stop every process) after this long (default 600)")
    p.add_argument("-o", "--output", default="hardware.json", metavar="FILE",
                   help="hardware file to write (default hardware.json)")
    fit = p.add_argument_group("compute rates from a profile or a kernel table (no process started)")
    source = fit.add_mutually_exclusive_group()
    source.add_argument("--from-profile", metavar="NAME|FILE",
                        help="fit the roofline's GEMM and memory rates and its per-layer overhead to this profile's "
                             "layer times (a shipped profile's name or a file `megatron-dynapipe profile` wrote)")
    source.add_argument("--from-kernels", metavar="FILE",
                        help="take the roofline's GEMM and memory rates and its fused-attention line from a table of "
                             "kernel times measured on the GPU (benchmarks/bench_kernels.py --json)")
    fit.add_argument("--attention-backend", default=None, metavar="NAME",
                     help=f"with --from-kernels: the attention backend priced (default {DEFAULT_BACKEND}, what "
                          "transformer-engine runs; flash_attention is torch's own)")
    fit.add_argument("--hardware", default=None, metavar="NAME|FILE",
                     help="with --from-profile or --from-kernels: the hardware file whose rates are replaced "
                          "(default h100)")


def _settings(args: argparse.Namespace) -> tuple[int, str, list[int]]:
    """Process count, backend and message sizes, refused in one line when they cannot work."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend or ("nccl" if gpus else "gloo")
    nproc = args.nproc if args.nproc is not None else (gpus or 4)
    if nproc < 2:
        raise ValueError(f"--nproc must be at least 2 (collectives need a group), got {nproc}")
    if backend == "nccl" and nproc > gpus:
        raise ValueError(f"--backend nccl needs a GPU per process: {gpus} visible for --nproc {nproc}; "
                         "lower --nproc or use --backend gloo")
    max_bytes = args.max_bytes or (256 * 2**20 if backend == "nccl" else 16 * 2**20)
    if args.min_bytes < 4 or max_bytes < args.min_bytes:
        raise ValueError(f"need 4 <= --min-bytes <= --max-bytes, got {args.min_bytes} and {max_bytes}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if not args.timeout > 0:  # also refuses nan
        raise ValueError(f"--timeout {args.timeout:g}: give the seconds to wait for the processes, a positive number")
    sizes, size = [], args.min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return nproc, backend, sizes


def run(args: argparse.Namespace) -> int:
    path = check_output_file(args.output, "--output", (".json",))
    if args.attention_backend is not None and not args.from_kernels:
        raise ValueError("--attention-backend prices a kernel table's attention: give --from-kernels FILE, or drop it")
    if args.from_profile:
        return _fit_profile(args, path)
    if args.from_kernels:
        return _from_kernels(args, path)
    if args.hardware is not None:
        raise ValueError("--hardware names the file whose rates --from-profile or --from-kernels replace; measuring "
                         "this machine's collectives writes a file of its own: drop --hardware, or add one of those")
    nproc, backend, sizes = _settings(args)
    started = time.perf_counter()
    points, device = measure(nproc, backend, sizes, repeats=args.repeats, timeout=args.timeout)
    name = args.name or f"{socket.gethostname()}-{device['name']}-{backend}-x{nproc}"
    hardware = hardware_from(points, device, nproc, name=name, backend=backend)
    hardware.write(path)
    for kind in KINDS:
        link = hardware.collectives[kind]
        print(f"{kind:>14}: latency {link.latency_us:8.1f} us, bus bandwidth {link.bandwidth_GBps:8.3f} GB/s"
              f"  (worst fit {_worst_error(kind, points[kind], nproc, link):.0%})")
    peaks = ", ".join(f"{k} {v:.3g}" for k, v in hardware.peak_tflops.items())
    print(f"peak TFLOP/s per rank ({peaks}), memory {hardware.memory_gib:.1f} GiB at "
          f"{hardware.memory_bandwidth_GBps:.1f} GB/s; measured in {time.perf_counter() - started:.0f} s")
    print(f"wrote {path}")
    return 0


def _fit_profile(args: argparse.Namespace, path) -> int:
    """``--from-profile``: the hardware file with its compute rates fitted to the profile."""
    import dataclasses

    from megatron_dynapipe.hardware import load_hardware
    from megatron_dynapipe.hardware.fit import fit_roofline
    from megatron_dynapipe.planning.cost_model.loading import resolve_cost_model_path
    from megatron_dynapipe.planning.cost_model.profile_file import read_complete_document

    hardware = load_hardware(args.hardware or DEFAULT_HARDWARE)
    profile = resolve_cost_model_path(args.from_profile, "--from-profile")
    fit = fit_roofline(hardware, read_complete_document(profile))
    said = fit.describe(profile.stem)
    fitted = dataclasses.replace(hardware, name=args.name or f"{hardware.name}-fit-{profile.stem}",
                                 compute=fit.compute_section(hardware.compute),
                                 source=f"{hardware.source}; compute: {said}")
    fitted.write(path)
    print(said)
    print(f"wrote {path}")
    return 0


def _from_kernels(args: argparse.Namespace, path) -> int:
    """``--from-kernels``: the hardware file with its compute rates read from a kernel table."""
    import dataclasses

    from megatron_dynapipe.hardware import load_hardware

    table = read_kernel_table(args.from_kernels)
    hardware = load_hardware(args.hardware or DEFAULT_HARDWARE)
    backend = args.attention_backend or DEFAULT_BACKEND
    compute = table.compute_section(hardware.compute or {}, hardware.memory_bandwidth_GBps, backend)
    said = table.describe(backend)
    fitted = dataclasses.replace(hardware, name=args.name or f"{hardware.name}-{table.path.stem}", compute=compute,
                                 source=f"{hardware.source}; {said}")
    fitted.write(path)
    attention = compute["fused_attention"]
    print(f"GEMMs at {compute['gemm_efficiency']:.3f} of peak, copies at {compute['memory_efficiency']:.3f} of the "
          f"memory bandwidth, {backend} at {attention['forward_efficiency']:.3f} / "
          f"{attention['backward_efficiency']:.3f} of peak plus {attention['forward_latency_us']:.0f} / "
          f"{attention['backward_latency_us']:.0f} us (forward / backward)")
    print(f"wrote {path}")
    return 0


def measure(nproc: int, backend: str, sizes: list[int], *, repeats: int = 5, timeout: float = 600.0):
    """Time every kind at every size on ``nproc`` local ranks: ``({kind: [(bytes, seconds)]}, device)``."""
    results = run_local_ranks(_rank, nproc, sizes, repeats, timeout=timeout, backend=backend)
    points, device = results[0]
    device["peak_tflops"] = {dtype: statistics.median(r[1]["peak_tflops"][dtype] for r in results)
                             for dtype in device["peak_tflops"]}
    return points, device


def _rank(rank: int, world: int, sizes: list[int], repeats: int):
    points = time_kinds(rank, world, KINDS, sizes, repeats, say=rank == 0)
    device, sync = device_and_sync()
    return points, _device_facts(device, world, sync)


def _device_facts(device, world: int, sync) -> dict[str, Any]:
    """Matrix-multiply peak per dtype (every rank at once), memory size and bandwidth."""
    import torch
    import torch.distributed as dist

    n = 4096 if device.type == "cuda" else 512
    peaks = {}
    for dtype in _DTYPES:
        a = torch.randn(n, n, device=device).to(getattr(torch, dtype))
        b = torch.randn(n, n, device=device).to(getattr(torch, dtype))
        torch.mm(a, b)
        dist.barrier()
        sync()
        started, runs = time.perf_counter(), 10
        for _ in range(runs):
            torch.mm(a, b)
        sync()
        peaks[dtype] = 2 * n**3 * runs / (time.perf_counter() - started) / 1e12
    big = torch.empty(64 * 2**20 // 4 if device.type == "cpu" else 2**30 // 4, device=device)
    other = torch.empty_like(big)
    other.copy_(big)
    sync()
    started = time.perf_counter()
    for _ in range(5):
        other.copy_(big)
    sync()
    bandwidth = 2 * big.numel() * 4 * 5 / (time.perf_counter() - started) / 1e9  # read + write
    if device.type == "cuda":
        memory, name = torch.cuda.get_device_properties(device).total_memory, torch.cuda.get_device_name(device)
    else:
        memory, name = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world, "cpu"
    # a CPU's ranks share its cores: as many compute at full speed at once as their threads fit
    slots = world if device.type == "cuda" else max(1, min(world, (os.cpu_count() or 1) // torch.get_num_threads()))
    return {"peak_tflops": peaks, "memory_bytes": memory, "memory_bandwidth_GBps": bandwidth,
            "name": name.replace(" ", "-"), "compute_slots": slots}


# -- fitting -------------------------------------------------------------------------------------


def _worst_error(kind: str, points, n: int, link: Link) -> float:
    predicted = [flat_collective_us(kind, n, s, link) / 1e6 for s, _ in points]
    return max(abs(p - t) / t for p, (_, t) in zip(predicted, points))


def hardware_from(points: dict[str, list[tuple[int, float]]], device: dict[str, Any], nproc: int, *, name: str,
                  backend: str) -> Hardware:
    links = {kind: fit_link(kind, points[kind], nproc) for kind in KINDS}
    slowest = min(links.values(), key=lambda link: link.bandwidth_GBps)
    return Hardware(
        name=name, peak_tflops=device["peak_tflops"], memory_gib=device["memory_bytes"] / 2**30,
        memory_bandwidth_GBps=device["memory_bandwidth_GBps"], gpus_per_node=nproc,
        intra_node=links["p2p"], inter_node=slowest, collectives=links, compute_slots_per_node=device["compute_slots"],
        source=f"measured by `megatron-dynapipe calibrate` on {socket.gethostname()} ({nproc} x {device['name']}, "
               f"{backend}); inter_node repeats the slowest measured kind (one machine has no network to measure)")
