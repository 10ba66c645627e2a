"""What the log and Megatron's writers get per planned iteration: real tokens, padding, plan."""

from __future__ import annotations

import math
import re

import numpy as np

from megatron_dynapipe.data.batch import PlannedBatch
from megatron_dynapipe.data.preprocess import build_iteration
from megatron_dynapipe.megatron_lm.iteration_log import LoggedLoader, describe_iteration, iteration_scalars
from megatron_dynapipe.planning.cost_model import AnalyticalCostModel
from megatron_dynapipe.planning.plan import ExecutionPlan
from megatron_dynapipe.planning.spec import TrainingSpec

COST_MODEL = AnalyticalCostModel(hidden_size=64, num_heads=4, vocab_size=128, saturation_tokens=256)
SPEC = TrainingSpec(num_layers=4, pp=2, dp=2, tp=1, memory_limit_mb=5, fast_mode=True, seqlen_round=8)


def _iteration(iteration: int, seed: int):
    lengths = np.random.default_rng(seed).integers(5, 120, size=64)
    blobs = build_iteration(lengths, SPEC, COST_MODEL, iteration, np.arange(64))
    return lengths, blobs


def test_the_summary_counts_real_and_padded_tokens_of_every_dp_rank():
    lengths, blobs = _iteration(0, seed=1)
    summary = blobs.summary
    assert summary["samples"] == 64 and summary["real_tokens"] == int(lengths.sum())
    padded = 0
    for dp in range(SPEC.dp):
        plan = ExecutionPlan.from_bytes(blobs.plans[dp, 0])
        for mb in plan.microbatches:  # each micro-batch pads its samples to its longest, rounded up to 8
            longest = max(int(lengths[i]) for i in mb.samples)  # batch = samples 0..63 in order
            assert mb.seq_len == math.ceil(longest / 8) * 8
            padded += mb.size * mb.seq_len
    assert summary["padded_tokens"] == padded
    assert len(summary["microbatches"]) == SPEC.dp and sum(summary["recompute"].values()) > 0
    scalars = iteration_scalars(summary, 1000.0)
    assert scalars["padding-fraction"] == 1 - lengths.sum() / padded
    assert scalars["real-tokens-per-second"] == 1000.0
    assert math.isclose(sum(scalars[f"recompute-{k}-fraction"] for k in ("none", "selective", "full")), 1.0)
    line = describe_iteration(summary, 1234.5)
    assert f"{lengths.sum()} real tokens" in line and "1,234 real tokens/s" in line


class Recorder:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))


class Batches:
    def __init__(self, count):
        self.batches = []
        for it in range(count):
            _, blobs = _iteration(it, seed=it)
            self.batches.append(PlannedBatch(it, ExecutionPlan.from_bytes(blobs.plans[0, 0]), [], blobs.summary))
        self.closed = False

    def __iter__(self):
        return self

    def __next__(self):
        return self.batches.pop(0)

    def __len__(self):
        return len(self.batches)

    def close(self):
        self.closed = True


def test_every_interval_the_log_and_the_writers_get_the_iteration(capsys):
    writer = Recorder()
    loader = LoggedLoader(Batches(6), interval=2, label="train", writers=(writer, None))
    for _ in range(6):
        next(loader)
    out = capsys.readouterr().out
    reported = [line for line in out.splitlines() if "global batch" in line]
    assert len(reported) == 3 and reported[0].startswith("> megatron-dynapipe train iteration 1:")
    # iteration 0 trained between the first two requests: the first report has a rate already
    assert all("real tokens/s" in line for line in reported)
    steps = sorted({step for _, _, step in writer.scalars})
    assert steps == [1, 3, 5]
    names = {name for name, _, _ in writer.scalars}
    assert {"dynapipe/train-padding-fraction", "dynapipe/train-real-tokens",
            "dynapipe/train-real-tokens-per-second"} <= names
    loader.close()
    assert loader.loader.closed


def test_the_first_iteration_reports_no_rate_before_anything_was_timed(capsys):
    loader = LoggedLoader(Batches(1), interval=1)
    next(loader)
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "global batch" in line]
    assert "tokens/s" not in line  # no rate rather than a wrong one


def test_a_prediction_not_made_for_this_machine_says_what_priced_it(capsys):
    for priced_by in (None, "the analytical A100 model, not this machine"):
        next(LoggedLoader(Batches(1), interval=1, priced_by=priced_by))
        (line,) = [line for line in capsys.readouterr().out.splitlines() if "global batch" in line]
        predicted = re.search(r"predicted [0-9.]+ ms(.*?), planned in", line).group(1)
        assert predicted == ("" if priced_by is None else f" ({priced_by})")
