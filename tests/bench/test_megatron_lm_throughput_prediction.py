"""The Megatron-LM throughput benchmark's prediction of Megatron's own iterations, without a
Megatron-LM checkout (the runs themselves need one: tests/megatron_lm)."""

import argparse
import importlib.util

import pytest

from project import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("bench_throughput", ROOT / "benchmarks" / "bench_megatron_lm_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("method", ["padded", "masked"])
def test_each_global_batch_is_priced_by_the_slowest_data_parallel_rank(method):
    bench = _bench()
    args = argparse.Namespace(cost_model=None, hidden_size=256, num_layers=4, seq_length=128, global_batch_size=8)
    rows = [[40, 60], [128], [10, 20, 30], [100], [64, 64], [7], [90], [50, 50]] * 2  # two global batches
    one = bench.predicted_megatron_ms(args, rows, pp=2, dp=1, method=method)
    assert len(one) == 2 and all(t > 0 for t in one) and one[0] == pytest.approx(one[1])  # the same rows twice
    # two DP ranks each take half the rows of a batch: each iteration at most the one-rank time
    two = bench.predicted_megatron_ms(args, rows, pp=2, dp=2, method=method)
    assert all(0 < b < a for a, b in zip(one, two))
