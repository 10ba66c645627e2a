"""The profiler called as a library (``profile_model``), in this process: the grid it measures,
the file the planner reads, and a resume that measures nothing twice."""

import dataclasses
import json
import time

import pytest
import torch

from megatron_dynapipe.config.model import get_model
from megatron_dynapipe.planning.cost_model import Link, ProfiledCostModel, StageCosts, split_over_cp
from megatron_dynapipe.planning.types import RecomputeType
from megatron_dynapipe.profiling.profiler import ProfileSettings, profile_model

TINY = dataclasses.replace(get_model("tiny"), hidden_dropout=0.0, attention_dropout=0.0)
SETTINGS = ProfileSettings(tp_sizes=(1,), recompute=(RecomputeType.NONE, RecomputeType.FULL), max_seq_length=64,
                           max_tokens=128, repeats=1, warmup=0, min_time_ms=0.0, max_refinements=0)
# lengths double from 32 to 64; micro-batches double from 1 while mbs x seqlen <= 128 tokens
GRID = [(32, 1), (32, 2), (32, 4), (64, 1), (64, 2)]


@pytest.mark.slow
def test_a_profile_measures_its_grid_loads_and_resumes_without_measuring_again(tmp_path):
    out = tmp_path / "tiny.json"
    seen: list[tuple[str, int]] = []
    lefts: list = []
    milestones: list = []

    def progress(what, points, left=None, milestone=False):
        seen.append((what, points))
        lefts.append(left)
        milestones.append(milestone)

    doc = profile_model(TINY, out, SETTINGS, device=torch.device("cpu"), allow_noisy=True, progress=progress)
    overhead = [(32, 1), (32, 4), (64, 1), (64, 2)]  # each length's first point, the longest's and shortest's last
    assert seen == [(f"tp 1 none/full seq {s} mbs {m}", 2) for s, m in GRID] + [
        (f"tp 1 whole-step overhead ({m} x {s} tokens, {k} of 4)", int(k == 1))
        for k, (s, m) in enumerate(overhead, 1)] + [("link between two local ranks (gloo)", 1)]
    # the grid's time left, once two points of different size have been timed; the overhead's from the parts' times
    assert [left is not None for left in lefts] == [False, False] + [True] * (len(GRID) - 2) + [True] * 4 + [False]
    # the overhead's start is a phase of its own, said at once off a terminal too
    assert milestones == [False] * len(GRID) + [True, False, False, False] + [False]
    assert lefts[len(GRID):len(GRID) + 4] == sorted(lefts[len(GRID):len(GRID) + 4], reverse=True)
    # the progress bar counts grid points: a full grid ends exactly at the total it announced
    assert sum(points for _, points in seen) == SETTINGS.grid_points() == len(GRID) * 2 + 1 + 1
    link = doc["metadata"]["link"]
    assert link["backend"] == "gloo" and link["latency_us"] >= 0 and link["bandwidth_GBps"] > 0
    assert StageCosts(ProfiledCostModel.from_json(out, tp=1), 4, 2).p2p_link == Link(link["bandwidth_GBps"],
                                                                                     link["latency_us"])
    points = {(r["recompute"], r["layer"], r["phase"], r["seqlen"], r["mbs"]) for r in doc["layer_time"]}
    assert points == {(rc, layer, phase, s, m) for rc in ("none", "full") for layer in ("encoder", "postprocess",
                      "preprocess") for phase in ("forward", "backward") for s, m in GRID}
    assert json.loads(out.read_text()) == doc and doc["metadata"]["complete"]
    # the attention core alone, once a point whatever the recompute: what context parallelism repeats
    assert sorted((r["phase"], r["seqlen"], r["mbs"]) for r in doc["attention_core_time"]) == sorted(
        (phase, s, m) for phase in ("forward", "backward") for s, m in GRID)
    assert all(r["ms"] > 0 for r in doc["attention_core_time"])

    model = ProfiledCostModel.from_json(out, tp=1)
    for rc in SETTINGS.recompute:
        assert 0 < model.layer_ms("encoder", "forward", rc, 2, 64) < float("inf")
    assert model.layer_ms("encoder", "forward", RecomputeType.NONE, 4, 64) == float("inf")  # past the grid
    assert split_over_cp(model, 2).attention is model  # the ring's blocks priced by the measured core

    again: list = []
    resumed = profile_model(TINY, out, SETTINGS, device=torch.device("cpu"), allow_noisy=True, resume=True,
                            progress=lambda *call: again.append(call))
    assert again == []  # every point, the overhead and the link were there already
    assert resumed["metadata"]["link"] == link
    assert resumed["layer_time"] == doc["layer_time"] and resumed["microbatch_overhead"] == doc["microbatch_overhead"]
    assert resumed["attention_core_time"] == doc["attention_core_time"]


def test_a_core_that_cannot_run_alone_is_said_once_and_left_out(capsys):
    # transformer-engine's core refusing a mask type, say: the layers' times are still measured
    from megatron_dynapipe.profiling.layers import build_parts, fake_tp_rank
    from megatron_dynapipe.profiling.profiler import ProfileRun, measure_point

    def refuses(*tensors):
        raise RuntimeError("no_mask is not supported here")

    run = ProfileRun(TINY, SETTINGS, torch.device("cpu"))
    with fake_tp_rank(1, torch.device("cpu")):
        parts = build_parts(TINY, 1, torch.float32, torch.device("cpu"), [RecomputeType.NONE])
        parts.attention_core = refuses
        for s, m in GRID[:2]:
            assert measure_point(run, parts, 1, [RecomputeType.NONE], s, m) == [RecomputeType.NONE]
    assert run.records.core_times == {} and (1, "none", "encoder", "forward", 32, 2) in run.records.times
    assert capsys.readouterr().err.count("the attention core does not run alone here (RuntimeError: no_mask") == 1


def test_a_link_that_cannot_be_measured_is_said_and_the_profile_still_completes(tmp_path, monkeypatch, capsys):
    # two local ranks failing to start (a port refused, say): hours of layer times are not lost to it
    from megatron_dynapipe.local_ranks import LocalRanksError
    from megatron_dynapipe.profiling import profiler

    def cannot_start(backend):
        raise LocalRanksError("rank 1 died without a word (exit code -9)")

    monkeypatch.setattr(profiler, "measure_link", cannot_start)
    out = tmp_path / "tiny.json"
    small = dataclasses.replace(SETTINGS, recompute=(RecomputeType.NONE,), max_seq_length=32, max_tokens=32)
    doc = profile_model(TINY, out, small, device=torch.device("cpu"), allow_noisy=True)
    assert doc["metadata"]["complete"] and "link" not in doc["metadata"]
    assert "the link between two local ranks could not be measured (rank 1 died without a word" in capsys.readouterr().err
    assert StageCosts(ProfiledCostModel.from_json(out, tp=1), 4, 2).p2p_link == Link(100.0, 0.0)  # the default
    monkeypatch.undo()
    again = profile_model(TINY, out, small, device=torch.device("cpu"), allow_noisy=True, resume=True)
    assert again["metadata"]["link"]["backend"] == "gloo"  # --resume measures what is missing


@pytest.mark.slow
def test_a_profile_times_the_layer_on_a_real_cp_group_and_cp_is_priced_by_it(tmp_path):
    # two local ranks of a CP 2 group, gloo, the ring over them: padded and packed rows at every
    # point whose whole rows split into 4 chunks (all of them here)
    sdpa = dataclasses.replace(TINY, attention="sdpa")
    settings = dataclasses.replace(SETTINGS, recompute=(RecomputeType.NONE,), cp_sizes=(2,))
    out = tmp_path / "tiny-cp.json"
    seen: list[tuple[str, int]] = []
    doc = profile_model(sdpa, out, settings, device=torch.device("cpu"), allow_noisy=True,
                        progress=lambda what, points, **_: seen.append((what, points)))
    assert seen[-2:] == [("tp 1 cp 2: the layer on 2 local ranks (gloo), 5 points", 1),
                         ("link between two local ranks (gloo)", 1)]
    assert sum(points for _, points in seen) == settings.grid_points()
    measured = {(r.get("layout", "padded"), r["phase"], r["seqlen"], r["mbs"]): r["ms"]
                for r in doc["layer_time"] if r.get("cp") == 2}
    assert measured.keys() == {(layout, phase, s, m) for layout in ("padded", "thd")
                               for phase in ("forward", "backward") for s, m in GRID}
    assert all(ms > 0 for ms in measured.values()) and doc["metadata"]["settings"]["cp_sizes"] == [2]
    # the planner's CP 2 model answers the group's times where they were measured
    split = split_over_cp(ProfiledCostModel.from_json(out, tp=1), 2)
    assert "corrected by a CP 2 group's times" in split.describe()
    for (layout, phase, s, m), ms in measured.items():
        model = split.packed() if layout == "thd" else split
        assert model.layer_ms("encoder", phase, RecomputeType.NONE, m, s) == pytest.approx(ms, rel=1e-3)
    # and what a rank stores: at least the CP 1 layer's at its half of the tokens and the other
    # half's keys and values, which the ring keeps for its backward (fp32, 4 B a value)
    memory = {(r.get("layout", "padded"), r["kind"], r["seqlen"], r["mbs"]): r["mb"]
              for r in doc["activation_memory"] if r.get("cp") == 2}
    assert memory.keys() == {(layout, kind, s, m) for layout in ("padded", "thd") for kind in ("stored", "peak")
                             for s, m in GRID}
    cp1 = {(r["kind"], r["seqlen"], r["mbs"]): r["mb"] for r in doc["activation_memory"]
           if r.get("cp", 1) == 1 and r.get("layout", "padded") == "padded"}
    for s, m in ((64, 1), (64, 2)):
        keys_and_values = m * (s // 2) * 2 * TINY.hidden_size * 4 / 2**20
        assert memory["padded", "stored", s, m] >= cp1["stored", s // 2, m] + keys_and_values
        priced = split.activation_mb("stored", RecomputeType.NONE, m, s)
        assert priced == pytest.approx(memory["padded", "stored", s, m], rel=1e-3)
    assert "corrected by a CP 2 group's times and memory" in split.describe()

    again: list = []
    profile_model(sdpa, out, settings, device=torch.device("cpu"), allow_noisy=True, resume=True,
                  progress=lambda *call: again.append(call))
    assert again == []  # the group's times were there already


def _slower_on_rank_one(rank: int, world: int):
    from megatron_dynapipe.profiling.context_parallel import time_in_lockstep

    weight = torch.ones(4, requires_grad=True)

    def step():
        if rank == 1:
            time.sleep(0.05)
        return weight * 2

    return time_in_lockstep(step, lambda: None, dataclasses.replace(SETTINGS, warmup=1, repeats=3, min_time_ms=0.0))


def test_every_rank_of_a_group_times_the_slowest_ranks_runs():
    """Rank 0's own step takes no time; what it records is rank 1's, which sleeps 50 ms a forward
    (a lower bound a slow machine cannot break), and both ranks ran as many times (or one would
    have waited on the other for ever)."""
    from megatron_dynapipe.local_ranks import run_local_ranks

    fast, slow = run_local_ranks(_slower_on_rank_one, 2, timeout=600)
    assert fast == slow and fast.forward_ms >= 50.0


def test_a_cp_groups_time_is_said_from_its_points_cp1_times_and_runs():
    """Before a CP group runs, its time is said: each point's layouts at their CP 1 forward +
    backward, as many runs as the group makes (one warm-up, at least 3 timed, enough for 100 ms, and
    one that measures memory)."""
    from megatron_dynapipe.planning.cost_model.profile_file import ProfileRecords
    from megatron_dynapipe.profiling.context_parallel import cp_seconds

    r = ProfileRecords()
    for phase, ms in (("forward", 10.0), ("backward", 20.0)):
        r.times[(1, "none", "encoder", phase, 64, 1)] = ms  # 30 ms a run: 1 + 4 + 1 runs
        r.times[(1, "none", "encoder", phase, 128, 2)] = 4 * ms  # 120 ms: 1 + 3 + 1
        r.packed_times[(1, "none", "encoder", phase, 128, 2)] = 2 * ms  # 60 ms: 1 + 3 + 1
    settings = dataclasses.replace(SETTINGS, warmup=1, repeats=3, min_time_ms=100.0)
    assert cp_seconds(r, [("none", 64, 1), ("none", 128, 2)], settings) == pytest.approx(
        (6 * 30 + 5 * 120 + 5 * 60) / 1e3)
    assert cp_seconds(r, [("full", 64, 1)], settings) == 0.0  # nothing measured at CP 1: nothing to say


@pytest.mark.slow
def test_a_resumed_profile_does_not_probe_its_refinement_again(tmp_path, monkeypatch):
    """The refinement probes a length between two profiled ones and keeps it where the time bends:
    timed again on resume, a probe could come out otherwise and add a length to a finished profile."""
    from megatron_dynapipe.profiling import profiler

    probes: list = []
    # every probe bends, whatever the timing: two real probes with zero tolerance still land on
    # opposite sides of the line now and then, and the test is about the resume, not the probe
    monkeypatch.setattr(profiler, "_bends", lambda *args: probes.append(args[3:]) or True)
    settings = dataclasses.replace(SETTINGS, recompute=(RecomputeType.NONE,), max_refinements=1)
    out = tmp_path / "tiny.json"
    doc = profile_model(TINY, out, settings, device=torch.device("cpu"), allow_noisy=True)
    assert probes == [(32, 48, 64)] and {r["seqlen"] for r in doc["layer_time"]} == {32, 48, 64}
    probes.clear()
    again = profile_model(TINY, out, settings, device=torch.device("cpu"), allow_noisy=True, resume=True)
    assert probes == [] and again["layer_time"] == doc["layer_time"]


@pytest.mark.slow
def test_a_point_measured_far_slower_than_a_larger_one_is_measured_again(tmp_path):
    """A profile whose point (32 tokens x 2) took 50 times a larger shape's time, as a busy moment
    makes it, is resumed: that point is measured again, and the profile is
    complete where the new time hangs together, else left for --resume with the point named.
    Either way the doctored time is gone."""
    from megatron_dynapipe.files import write_atomically
    from megatron_dynapipe.planning.cost_model.profile_file import to_text
    from megatron_dynapipe.profiling.profiler import ProfileError

    out = tmp_path / "tiny.json"
    small = dataclasses.replace(SETTINGS, recompute=(RecomputeType.NONE,))
    doc = profile_model(TINY, out, small, device=torch.device("cpu"), allow_noisy=True)
    doctored = 1000.0 + 50 * max(r["ms"] for r in doc["layer_time"])
    for r in doc["layer_time"]:
        if (r["layer"], r["phase"], r["seqlen"], r["mbs"]) == ("encoder", "backward", 32, 2):
            r["ms"] = doctored
    doc["metadata"]["complete"] = False
    write_atomically(out, to_text(doc))
    seen = []
    try:
        again = profile_model(TINY, out, small, device=torch.device("cpu"), resume=True,
                              progress=lambda what, points, **_: seen.append(what))
    except ProfileError as error:
        assert "stay out of line with shapes beside them" in str(error) and "--resume" in str(error)
        again = json.loads(out.read_text())
        assert again["metadata"]["complete"] is False and again["metadata"]["inconsistent"]
    else:
        assert again["metadata"]["complete"] is True and "inconsistent" not in again["metadata"]
    # (on a busy machine other points may be found slow too, and measured again with it)
    assert "tp 1 none seq 32 mbs 2 again (out of line with a shape beside it)" in seen
    [new] = [r["ms"] for r in again["layer_time"]
             if (r["layer"], r["phase"], r["seqlen"], r["mbs"]) == ("encoder", "backward", 32, 2)]
    assert new != doctored


@pytest.mark.parametrize("rounds, refined", [
    # ms at 32, 48 and 64 tokens in each of three rounds; the line's value at 48 is the mean of the ends
    ([(0.5, 1.2, 1.5)] * 3, True),  # 20% above the line every round: the layer bends there
    ([(0.5, 1.0, 1.5), (0.5, 2.5, 1.5), (0.5, 1.0, 1.5)], False),  # one slow probe is outvoted
    ([(0.5, 1.0, 1.5), (1.0, 2.0, 3.0), (0.5, 1.0, 1.5)], False),  # a round slowed as a whole
    ([(0.5, 1.05, 1.5)] * 3, False),  # within the tolerance
    ([(2.0, 2.5, 3.0)] * 3, False),  # on the probes' own line, whatever the grid measured at the ends
    ([(0.2, 1.0, 1.2)] * 3, True),  # the grid's ends (0.5, 1.5) would put 1.0 on the line
])
def test_a_length_is_added_where_it_bends_against_its_ends_timed_in_the_same_moment(monkeypatch, rounds, refined):
    from megatron_dynapipe.profiling import profiler
    from megatron_dynapipe.profiling.measure import Timing
    from megatron_dynapipe.profiling.profiler import ProfileRun

    run = ProfileRun(TINY, SETTINGS, torch.device("cpu"))
    run.records.times[(1, "none", "encoder", "forward", 32, 1)] = 0.5
    run.records.times[(1, "none", "encoder", "forward", 64, 1)] = 1.5
    scripted = {seq: [r[k] for r in rounds] for k, seq in enumerate((32, 48, 64))}
    taken = []

    def time_step(step, device, **kwargs):
        seq = step().shape[0]  # the scripted layer returns its input
        taken.append(seq)
        return Timing(scripted[seq].pop(0), 2.0, 0.0, 0.0)

    monkeypatch.setattr(profiler, "time_step", time_step)
    parts = type("Parts", (), {"encoders": {RecomputeType.NONE: lambda x: x}})()
    assert profiler._bends(run, parts, 1, 32, 48, 64) is refined
    assert taken == [32, 48, 64] * 3  # the three in turn, round after round
    del run.records.times[(1, "none", "encoder", "forward", 64, 1)]  # a row that does not reach mbs 1 at 64
    assert profiler._bends(run, parts, 1, 32, 48, 64) is False and len(taken) == 9
