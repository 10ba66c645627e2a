"""bench step's pace: the profile's reference layer timed again beside the steps, against its profiled time."""

import pytest

from megatron_dynapipe.bench.pace import Pace, pace_line, paced_error_pct, profiled_ms, reference_points
from megatron_dynapipe.planning.cost_model import AnalyticalCostModel, load_cost_model
from megatron_dynapipe.planning.cost_model.profile_file import ProfileRecords, to_text
from megatron_dynapipe.planning.types import RecomputeType


@pytest.fixture
def profile(tmp_path):
    """A profile of rows of 64 and 128 tokens, one and two rows, whose encoder layer takes 1 ms
    forward and 2 backward a row of 64 tokens (in proportion to the tokens), recompute none first."""
    records = ProfileRecords()
    for s in (64, 128):
        for m in (1, 2):
            for layer in ("encoder", "postprocess", "preprocess"):
                for phase, ms in (("forward", 1.0), ("backward", 2.0)):
                    records.times[(1, "none", layer, phase, s, m)] = ms * s * m / 64
            for kind in ("stored", "peak"):
                records.memory[(1, "none", kind, s, m)] = 1.0
    records.params.update({(1, "none", "encoder"): 2.0, (1, "none", "embedding"): 8.0})
    path = tmp_path / "p.json"
    path.write_text(to_text({"name": "test", "hidden_size": 64, **records.records()}))
    return load_cost_model(path, tp=1)


def test_the_reference_points_are_rows_of_the_longest_length_the_steps_reach(profile):
    none = RecomputeType.NONE
    assert reference_points(profile, 128) == [(128, 1, none), (128, 2, none)]  # 4 rows were not measured
    assert reference_points(profile, 100) == [(64, 1, none), (64, 2, none)]  # 128 is longer than the steps' rows
    assert reference_points(profile, 32) == []  # shorter than any measured row
    assert reference_points(AnalyticalCostModel(), 128) == []  # nothing measured to time again


def test_the_profiled_time_is_the_layers_forward_and_backward_at_the_point(profile):
    # 2 ms forward + 4 backward for a row of 128 tokens; 2 + 4 for two rows of 64
    assert profiled_ms(profile, (128, 1, RecomputeType.NONE)) == pytest.approx(6.0)
    assert profiled_ms(profile, (64, 2, RecomputeType.NONE)) == pytest.approx(6.0)


def test_an_error_at_the_machines_pace_scales_the_prediction_by_it():
    pace = Pace(seqlen=128, rows=(1, 2), ratios=(1.3, 1.1, 1.2, 1.25, 1.15))
    assert pace.ratio == pytest.approx(1.2)  # the median of every rank's rounds and points
    assert paced_error_pct(500.0, 600.0, pace) == pytest.approx(0.0)  # 500 ms at 1.2x the profile's pace
    assert paced_error_pct(500.0, 500.0, pace) == pytest.approx(20.0)
    line = pace_line({"seqlen": 128, "rows": [1, 2, 4], "ratios": [1.3, 1.1, 1.2, 1.25, 1.15]}, [-4.0, 6.0])
    assert line == ["pace: the profile's layer on 1, 2 and 4 x 128 tokens took 1.20x its profiled time beside the "
                    "steps (1.10-1.30x, 5 timings on the ranks; a CPU's pace moves with its load); at that pace the "
                    "predictions are -4% to +6% off"]
    assert pace_line({"seqlen": 64, "rows": [1], "ratios": [0.9]}, [])[0].startswith(
        "pace: the profile's layer on 1 x 64 tokens took 0.90x")
    assert pace_line(None, []) == []
