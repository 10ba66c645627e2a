"""The batch runner with the stand-in tracer: a folder per config, failures contained rank by rank
and config by config, ranks side by side, progress on a terminal; and how rank processes start."""

from __future__ import annotations

import io
import json
import os

import pytest

from megatron_dynapipe import progress
from megatron_dynapipe.tracer import isolation
from megatron_dynapipe.tracer.batch_config import parse_configs
from megatron_dynapipe.tracer.batch_results import ConfigResult, RankResult, exit_code
from megatron_dynapipe.tracer.batch_run import run_batch

from stand_in import CALLS, FakeTTY, cfg, failing_on, meeting_tracer, stand_in_tracer, summary_of

# --------------------------------------------------------------------------------------------
# run_batch with the stand-in


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_run_batch_writes_a_folder_per_config(tmp_path, isolation):
    CALLS.clear()
    configs = parse_configs(["16 2 2", "12 2 4", "8 4 1"])
    results = run_batch(configs, tmp_path, tracer=stand_in_tracer, isolation=isolation, progress=False)
    assert [r.status for r in results] == ["ok", "invalid", "ok"]
    assert results[1].folder is None and "not divisible" in results[1].reasons[0]
    assert exit_code(results) == 0
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert folders == sorted([configs[0].folder_name(), configs[2].folder_name()])
    for result, ranks in ((results[0], [0, 8]), (results[2], [0, 2, 4, 6])):
        names = {p.name for p in result.folder.iterdir()}
        for r in ranks:
            assert {f"fake_rank_{r}.log", f"rank_{r}.trace.jsonl"} <= names
            log = (result.folder / f"fake_rank_{r}.log").read_text()
            assert f"stand-in tracing rank {r}" in log and "status ok" in log
        assert not [n for n in names if n.startswith(".")], "temporary files left behind"
        summary = summary_of(result.folder)
        assert summary["complete"] and summary["status"] == "ok" and summary["timeline"] == "timeline.json"
        timeline = json.loads((result.folder / "timeline.json").read_text())
        spans = [e for e in timeline["traceEvents"] if e["ph"] == "X"]
        assert sorted({e["pid"] for e in spans}) == ranks and len(spans) == 3 * len(ranks)
        assert [x["rank"] for x in summary["ranks"]] == ranks
        assert summary["ranks_traced"] == len(ranks)
        assert summary["reduction_pct"] == pytest.approx(100 * (1 - len(ranks) / result.config.world_size))
        rank0 = summary["ranks"][0]
        assert rank0["files"] == ["rank_0.trace.jsonl"]
        assert rank0["stats"]["ops"] == 3 and rank0["stats"]["rank"] == 0
    if isolation == "inline":
        assert [c["rank"] for c in CALLS] == [0, 8, 0, 2, 4, 6]
        assert CALLS[0]["num_microbatches"] == 2 and CALLS[0]["micro_batch_size"] == 1
        assert CALLS[0]["seq_length"] == 256 and CALLS[0]["shapes_only"] is False


def test_a_layout_traced_with_other_training_flags_keeps_its_own_folder(tmp_path):
    from megatron_dynapipe.config.megatron_options import MegatronOptions

    configs = parse_configs(["16 2 2"])
    plain = run_batch(configs, tmp_path, tracer=stand_in_tracer, isolation="inline", progress=False)[0]
    sp = MegatronOptions(sequence_parallel=True)
    flagged = run_batch(configs, tmp_path, tracer=stand_in_tracer, isolation="inline", progress=False,
                        training=sp)[0]
    assert plain.folder != flagged.folder and plain.folder.is_dir() and flagged.folder.is_dir()
    assert plain.folder.name == configs[0].folder_name() == configs[0].folder_name(MegatronOptions())
    assert flagged.folder.name.startswith(plain.folder.name + "_FLAGS")
    assert configs[0].folder_name(MegatronOptions(sequence_parallel=True, distributed_optimizer=True)) \
        not in (plain.folder.name, flagged.folder.name)
    # priced as the Megatron-LM of 2021 (no flag asks for it): another folder, whose traces say so
    waited = configs[0].folder_name(MegatronOptions(async_tp_backward=False))
    assert waited.startswith(plain.folder.name + "_FLAGS") and waited != flagged.folder.name


def test_a_failed_config_names_its_first_failed_rank_whichever_finished_first():
    result = ConfigResult(cfg("32 2 2"), "ok")
    for rank, status in [(16, "failed"), (8, "ok"), (0, "failed")]:  # the order they finished in
        result.ranks.append(RankResult(rank, rank // 16, 0, status, error=f"boom on rank {rank}"))
        result.note(result.ranks[-1])
    assert result.error == "rank 16: boom on rank 16"
    result.order_ranks([0, 8, 16])
    assert [r.rank for r in result.ranks] == [0, 8, 16] and result.error == "rank 0: boom on rank 0"


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_a_failing_config_does_not_take_the_others_down(tmp_path, isolation):
    configs = parse_configs(["16 2 2", "32 2 2", "8 4 1"])
    results = run_batch(configs, tmp_path, tracer=failing_on(world_size=32), isolation=isolation,
                        progress=False)
    assert [r.status for r in results] == ["ok", "failed", "ok"]
    assert exit_code(results) == 1
    failed = results[1]
    assert "boom on W=32 rank 0" in failed.error
    assert [r.status for r in failed.ranks] == ["failed", "failed"]
    summary = summary_of(failed.folder)
    assert summary["status"] == "failed" and "boom on W=32" in summary["error"]
    assert "RuntimeError: boom on W=32 rank 0" in summary["ranks"][0]["error"]
    log = (failed.folder / "fake_rank_0.log").read_text()
    assert "Traceback" in log and "boom on W=32 rank 0" in log and "status failed" in log


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_a_failing_rank_does_not_stop_the_next_rank(tmp_path, isolation):
    results = run_batch(parse_configs(["8 4 1"]), tmp_path, tracer=failing_on(rank=2), isolation=isolation,
                        progress=False)
    assert [r.status for r in results[0].ranks] == ["ok", "failed", "ok", "ok"]
    assert results[0].status == "failed" and results[0].error.startswith("rank 2:")
    assert (results[0].folder / "rank_4.trace.jsonl").is_file()


@pytest.mark.parametrize("how, message", [("unreadable", "unreadable rank_2.trace.jsonl"),
                                          ("silent", "the tracer wrote no rank_2.trace.jsonl")])
def test_a_rank_without_a_readable_trace_fails(tmp_path, how, message):
    results = run_batch(parse_configs(["8 4 1"]), tmp_path, tracer=failing_on(rank=2, how=how), isolation="inline",
                        progress=False)
    assert [r.status for r in results[0].ranks] == ["ok", "failed", "ok", "ok"]
    assert message in results[0].ranks[1].error and results[0].status == "failed"
    spans = [e for e in json.loads((results[0].folder / "timeline.json").read_text())["traceEvents"]
             if e["ph"] == "X"]
    assert sorted({e["pid"] for e in spans}) == [0, 4, 6]


@pytest.mark.parametrize("how, message", [("unreadable", "unreadable rank_2.trace.jsonl"),
                                          ("silent", "the tracer wrote no rank_2.trace.jsonl")])
def test_without_a_timeline_each_rank_is_still_checked(tmp_path, how, message):
    results = run_batch(parse_configs(["8 4 1"]), tmp_path, tracer=failing_on(rank=2, how=how), isolation="inline",
                        progress=False, timeline=False)
    assert [r.status for r in results[0].ranks] == ["ok", "failed", "ok", "ok"]
    assert message in results[0].ranks[1].error and results[0].status == "failed"
    assert not (results[0].folder / "timeline.json").exists() and results[0].timeline is None


def test_a_crashing_rank_process_is_contained(tmp_path):
    results = run_batch(parse_configs(["16 2 2", "8 4 1"]), tmp_path, tracer=failing_on(world_size=16, rank=8, how="kill"),
                        isolation="process", progress=False)
    assert [r.status for r in results] == ["failed", "ok"]
    assert "SIGKILL" in results[0].ranks[1].error
    assert (results[0].folder / "fake_rank_8.log").is_file()


def test_a_hanging_rank_times_out(tmp_path):
    results = run_batch(parse_configs(["8 4 1"]), tmp_path, tracer=failing_on(rank=4, how="sleep"),
                        isolation="process", rank_timeout=2, progress=False)
    assert [r.status for r in results[0].ranks] == ["ok", "ok", "failed", "ok"]
    assert "timed out after 2 s" in results[0].ranks[2].error


def test_jobs_run_ranks_side_by_side_and_list_them_in_order(tmp_path):
    meet = tmp_path / "meet"
    meet.mkdir()
    [result] = run_batch(parse_configs(["8 2 1"]), tmp_path / "t", tracer=meeting_tracer(meet), jobs=2, progress=False)
    assert result.status == "ok", result.error
    assert [r.rank for r in result.ranks] == [0, 4]
    assert [r["rank"] for r in summary_of(result.folder)["ranks"]] == [0, 4]
    assert {p.name for p in result.folder.glob("*.log")} == {"fake_rank_0.log", "fake_rank_4.log"}


def test_one_job_runs_ranks_one_after_the_other(tmp_path):
    meet = tmp_path / "meet"
    meet.mkdir()
    [result] = run_batch(parse_configs(["8 2 1"]), tmp_path / "t", tracer=meeting_tracer(meet, wait_s=1), jobs=1,
                         progress=False)
    assert [r.status for r in result.ranks] == ["failed", "ok"]
    assert "rank 4 never ran beside rank 0" in result.ranks[0].error


def test_a_rank_killed_beside_others_fails_alone(tmp_path):
    results = run_batch(parse_configs(["16 4 1"]), tmp_path, tracer=failing_on(rank=8, how="kill"), jobs=3,
                        rank_timeout=60, progress=False)
    assert [(r.rank, r.status) for r in results[0].ranks] == [(0, "ok"), (4, "ok"), (8, "failed"), (12, "ok")]
    assert "SIGKILL" in results[0].ranks[2].error


@pytest.mark.parametrize("jobs", [0, -2, 1.5])
def test_run_batch_refuses_a_bad_jobs_count(tmp_path, jobs):
    with pytest.raises(ValueError, match="jobs must be a positive integer"):
        run_batch(parse_configs(["8 2 1"]), tmp_path, tracer=stand_in_tracer, jobs=jobs, progress=False)


def test_shapes_only_choice_reaches_the_tracer(tmp_path):
    CALLS.clear()
    run_batch(parse_configs(["16 2 2"]), tmp_path, tracer=stand_in_tracer, isolation="inline", progress=False,
              shapes_only=True, warmup_iters=2, trace_iters=3)
    assert {c["shapes_only"] for c in CALLS} == {True}
    assert {(c["warmup_iters"], c["trace_iters"]) for c in CALLS} == {(2, 3)}
    CALLS.clear()
    results = run_batch(parse_configs(["16 2 2"], model="6.7"), tmp_path, tracer=stand_in_tracer,
                        isolation="inline", progress=False)
    assert results[0].shapes_only is True and CALLS[0]["shapes_only"] is True  # 6.7B cannot fit here


def test_cost_model_factory_is_called_per_config(tmp_path):
    CALLS.clear()
    seen = []
    run_batch(parse_configs(["16 2 2", "16 2 4"]), tmp_path, tracer=stand_in_tracer, isolation="inline",
              progress=False, cost_model=lambda c: seen.append(c.tp) or f"cost-tp{c.tp}")
    assert seen == [2, 4]
    assert [c["cost_model"] for c in CALLS] == ["cost-tp2", "cost-tp2", "cost-tp4", "cost-tp4"]


def test_progress_only_on_a_terminal(tmp_path):
    assert progress.progress_enabled(True, FakeTTY()) is True
    assert progress.progress_enabled(True, io.StringIO()) is False
    assert progress.progress_enabled(False, FakeTTY()) is False
    plain = io.StringIO()
    run_batch(parse_configs(["16 2 2"]), tmp_path, tracer=stand_in_tracer, isolation="inline",
              progress=True, progress_stream=plain)
    assert plain.getvalue() == ""
    tty = FakeTTY()
    run_batch(parse_configs(["16 2 2"]), tmp_path, tracer=stand_in_tracer, isolation="inline",
              progress=True, progress_stream=tty)
    assert "configs" in tty.getvalue()


def _report_pid_and_argument(value):
    print(f"child {os.getpid()} says {value}")
    return {"value": value, "pid": os.getpid()}


@pytest.mark.slow
def test_ranks_start_as_fresh_interpreters_when_cuda_is_seen_here(tmp_path, monkeypatch):
    """A forked child cannot use CUDA once this process has so much as counted its GPUs; a
    spawned child has no CUDA of this process. The same rank work through a real spawn."""
    import functools

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert isolation.rank_start_method() == "spawn"
    monkeypatch.undo()
    assert isolation.rank_start_method() == ("spawn" if torch.cuda.is_available() else "fork")
    log_path = tmp_path / "rank.log"
    outcome = isolation.run_forked(functools.partial(_report_pid_and_argument, 41), log_path, 120, "spawn")
    assert outcome["ok"] and outcome["value"] == 41 and outcome["pid"] != os.getpid()
    assert f"child {outcome['pid']} says 41" in log_path.read_text()


def test_a_rank_whose_process_cannot_start_fails_alone(tmp_path):
    """A spawned child gets its work by pickling: a lambda cannot be sent, so that rank's
    process never starts; the rank beside it still runs."""
    import functools

    jobs = [(lambda: {}, tmp_path / "a.log"), (functools.partial(_report_pid_and_argument, 7), tmp_path / "b.log")]
    outcomes = {i: o for i, o, _ in isolation.run_forked_many(jobs, 2, 120, "spawn")}
    assert not outcomes[0]["ok"] and outcomes[0]["error"].startswith("cannot start the rank process: ")
    assert outcomes[1]["ok"] and outcomes[1]["value"] == 7




def test_what_else_writes_to_stderr_goes_above_the_bar():
    import sys

    tty = FakeTTY()
    with progress.progress_bar(True, tty) as bar:
        task = bar.add_task("profile", total=2)
        bar.advance(task)
        # as warnings.showwarning and logging's last-resort handler write: to sys.stderr, then
        print("UserWarning: Transformer Engine and Apex are not installed", file=sys.stderr)
        bar.advance(task)
    # a whole line of its own, printed above the bar instead of cutting through it
    assert "\x1b[2KUserWarning: Transformer Engine and Apex are not installed\n" in tty.getvalue()
