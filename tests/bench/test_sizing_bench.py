"""The sizing benchmark's pairing of predicted and measured steps (running it needs a profile
and minutes of real steps: benchmarks/bench_sizing.py)."""

import argparse
import importlib.util

import pytest

from project import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("bench_sizing", ROOT / "benchmarks" / "bench_sizing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_drawn_batches_are_written_out_whole_from_the_scaled_mix(tmp_path):
    bench = _bench()
    args = argparse.Namespace(lengths=None, mix="long", seq_length=256, global_batch_size=4, batches=3, seed=7)
    pool = [int(n) for n in open(bench.lengths_file(args, tmp_path)).read().split()]
    assert len(pool) == 512 and max(pool) == 256 and min(pool) >= 2
    written = [[int(n) for n in p.read_text().split()] for p in bench.draw(args, str(tmp_path / "lengths.txt"), tmp_path)]
    assert len(written) == 3 and len({tuple(b) for b in written}) == 3
    for batch in written:  # global batch x seq-length tokens, every sample but the last (cut) one from the pool
        assert sum(batch) == 4 * 256 and set(batch[:-1]) <= set(pool) and batch[-1] <= max(pool)


def test_planned_methods_compare_steps_and_packings_compare_rows():
    bench = _bench()
    args = argparse.Namespace(global_batch_size=16, seq_length=256)
    measured = {"DynaPipe": (400.0, 4200), "DynaPipe varlen": (300.0, 4096), "THD packing (whole)": (340.0, 17 * 256),
                "packing": (306.0, 17 * 256)}
    run = {"settings": {"real_tokens": 4000},
           "methods": {name: {"median_ms": ms, "spread_ms": 10.0, "tokens_per_s": 4000 / ms * 1e3, "padded_tokens": t}
                       for name, (ms, t) in measured.items()}}
    steps = {"dynapipe": [360.0], "dynapipe-varlen": [330.0], "thd": [320.0], "megatron": [288.0]}
    rows = {r["method"]: r for r in bench.compare(args, steps, [run])}
    assert rows["dynapipe"]["error_pct"] == pytest.approx(-10.0)  # 360 / 400
    assert rows["dynapipe-varlen"]["error_pct"] == pytest.approx(10.0)  # 330 / 300
    # 16 windows in 320 ms against 17 first-fit rows in 340 ms: 20 ms a row each
    assert rows["thd"]["per"] == "row" and rows["thd"]["error_pct"] == pytest.approx(0.0)
    assert rows["megatron"]["predicted_ms"] == 18.0 and rows["megatron"]["error_pct"] == pytest.approx(0.0)
    assert rows["dynapipe"]["predicted_tokens_per_s"] == pytest.approx(4000 / 0.360)
