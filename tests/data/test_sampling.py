"""Which samples each iteration trains: epochs of shuffled samples, fixed or ramping batches."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_dynapipe.data.sampling import BatchSchedule


def test_iterations_walk_the_sample_stream_epoch_after_epoch():
    schedule = BatchSchedule(10, 4, seed=3)
    batches = [schedule.ids(i).tolist() for i in range(5)]  # 20 samples: two epochs exactly
    stream = sum(batches, [])
    for epoch in (stream[:10], stream[10:]):
        assert sorted(epoch) == list(range(10))  # each epoch visits every sample once
    assert stream[:10] != stream[10:]  # a fresh shuffle per epoch
    assert batches[2] == stream[8:12]  # a batch may straddle two epochs
    assert schedule.ids(3).tolist() == BatchSchedule(10, 4, seed=3).ids(3).tolist()  # resumable
    assert BatchSchedule(10, 4, shuffle=False).ids(2).tolist() == [8, 9, 0, 1]
    assert schedule.iterations_per_epoch == 2


@pytest.mark.parametrize("gbs,start,increment,samples,mbs,dp,decrease", [
    (64, 8, 8, 1000, 2, 2, False), (60, 6, 6, 500, 1, 3, False), (64, 10, 6, 300, 2, 2, True)])
def test_rampup_feeds_the_batch_sizes_megatron_counts(gbs, start, increment, samples, mbs, dp, decrease):
    calculators = pytest.importorskip("megatron.core.num_microbatches_calculator")
    if not hasattr(calculators, "RampupBatchsizeNumMicroBatchesCalculator"):
        pytest.skip("this megatron-core has no ramp-up calculator to compare with (0.19 replaced "
                    "--rampup-batch-size by --step-batch-size-schedule)")
    RampupBatchsizeNumMicroBatchesCalculator = calculators.RampupBatchsizeNumMicroBatchesCalculator

    ours = BatchSchedule(100_000, gbs, rampup=(start, increment, samples), divisor=mbs * dp if decrease else 1)
    megatron = RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, decrease, 1, start, increment, samples)
    consumed = 0
    for iteration in range(80):
        megatron.update(consumed, consistency_check=False)
        size = megatron.get_current_running_global_batch_size()
        assert ours.offset(iteration) == consumed and len(ours.ids(iteration)) == size
        consumed += size
    assert ours.iteration_at(ours.offset(37)) == 37
    with pytest.raises(ValueError, match="do not end an iteration"):
        ours.iteration_at(ours.offset(37) + 1)


def test_schedules_travel_as_json_and_bad_rampups_are_refused():
    schedule = BatchSchedule(100, 8, rampup=(2, 2, 40), seed=1)
    again = BatchSchedule.from_json(json.loads(json.dumps(schedule.to_json())))
    assert again == schedule and again.ids(5).tolist() == schedule.ids(5).tolist()
    with pytest.raises(ValueError, match="not a multiple of the increment 4"):
        BatchSchedule(100, 8, rampup=(2, 4, 40))
    with pytest.raises(ValueError, match="0 < start <= the global batch size 8"):
        BatchSchedule(100, 8, rampup=(16, 2, 40))
    assert np.all(np.diff([BatchSchedule(100, 8, rampup=(2, 2, 40)).batch_size(c) for c in range(0, 60, 5)]) >= 0)
