"""How fast the data pipeline fails every rank when a part of it dies or stops.

A real pipeline (rank 0's store, poller and one preprocessing worker; two pipeline stages as
training ranks, stage 0 here, stage 1 a process of its own) runs until both stages took their
first iteration; then one part is killed or stopped and the clock runs until each surviving
rank's loader raises its one-line error. Reported: the median and the worst over --repeats of
fault -> error per fault, and each error's first words.

    python benchmarks/bench_data_faults.py --repeats 3
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import sys
import time

import numpy as np

from megatron_dynapipe.data import (
    DataPipelineError,
    DataPipelineHost,
    DynaPipeDataLoader,
    TokenListDataset,
    job_secret,
)
from megatron_dynapipe.planning.cost_model import AnalyticalCostModel
from megatron_dynapipe.planning.spec import TrainingSpec

SECRET = "bench-data-faults"
COST_MODEL = AnalyticalCostModel(hidden_size=64, num_heads=4, vocab_size=128, saturation_tokens=256)
SPEC = TrainingSpec(num_layers=4, pp=2, dp=1, tp=1, memory_limit_mb=5, fast_mode=True)
FAULTS = ("worker killed", "worker stopped", "rank killed", "poller killed")


def _loader(port: int, stage: int) -> DynaPipeDataLoader:
    return DynaPipeDataLoader(dp_rank=0, stage=stage, host_pipeline=False, master_addr="127.0.0.1", port=port,
                              secret=SECRET, connect_timeout_s=120, timeout_s=120)


def _stage_1(port: int, took, failed) -> None:
    """The other training rank: take batches until the loader fails; report when it failed."""
    try:
        with _loader(port, 1) as loader:
            for batch in loader:
                if batch.iteration == 0:
                    took.set()
    except DataPipelineError as error:
        failed.put((time.time(), str(error)))


def _until_raises(loader, limit_s: float = 120.0) -> "tuple[float, str]":
    deadline = time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline:
            next(loader)
    except DataPipelineError as error:
        return time.time(), str(error)
    raise RuntimeError("no error within the limit: the fault went unnoticed")


def _one(fault: str) -> list[tuple[float, str]]:
    data = TokenListDataset([np.arange(int(n)) for n in np.random.default_rng(0).integers(5, 120, 40)], 128)
    ctx = multiprocessing.get_context("forkserver")
    host = DataPipelineHost(data, SPEC, COST_MODEL, 4, secret=job_secret(SECRET), port=0, num_workers=1,
                            lookahead=1)
    took, failed = ctx.Event(), ctx.Queue()
    other = ctx.Process(target=_stage_1, args=(host.port, took, failed), daemon=True)
    other.start()
    try:
        with _loader(host.port, 0) as loader:
            next(loader)
            if not took.wait(120):
                raise RuntimeError("stage 1 did not start")
            with open(f"/proc/{host.proc.pid}/task/{host.proc.pid}/children") as f:
                worker = int(f.read().split()[0])
            at = time.time()
            if fault == "worker killed":
                os.kill(worker, signal.SIGKILL)
            elif fault == "worker stopped":
                os.kill(worker, signal.SIGSTOP)
            elif fault == "rank killed":
                other.kill()
            else:
                host.proc.kill()
            seen = [_until_raises(loader)]
            if fault != "rank killed":
                seen.append(failed.get(timeout=120))
            if fault == "worker stopped":
                os.kill(worker, signal.SIGCONT)
            return [(when - at, message) for when, message in seen]
    finally:
        other.kill()
        other.join()
        host.close(wait_for_ranks=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs per fault (default 3)")
    args = parser.parse_args(argv)
    print(f"{'fault':<16} {'ranks':>5} {'median s':>9} {'worst s':>8}  error")
    for fault in FAULTS:
        delays, message = [], ""
        for _ in range(args.repeats):
            seen = _one(fault)
            delays += [delay for delay, _ in seen]
            message = seen[0][1]
        print(f"{fault:<16} {len(seen):>5} {statistics.median(delays):>9.2f} {max(delays):>8.2f}  "
              f"{message[:90]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
