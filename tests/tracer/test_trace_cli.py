"""`megatron-dynapipe trace`: in this process with the stand-in tracer, its edges (bad lines, bad
places, Ctrl-C) and with the real tracer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_dynapipe.config.model import get_model
from megatron_dynapipe.tracer import batch_run
from megatron_dynapipe.tracer import cli as trace_cli
from megatron_dynapipe.tracer.batch_config import parse_configs
from megatron_dynapipe.tracer.batch_run import run_batch
from megatron_dynapipe.tracer.trace_format import RankTrace

from stand_in import FakeTTY, cfg, ok_folder, stand_in_seconds, stand_in_trace, stand_in_tracer

# --------------------------------------------------------------------------------------------
# the trace command, in this process with the stand-in


def test_trace_json_summary(tmp_path, stand_in, capsys):
    code = trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "32 2 2", "--config", "12 2 4",
                           "--output-dir", str(tmp_path), "--json", "--isolation", "inline"])
    out, err = capsys.readouterr()
    assert code == 1
    summary = json.loads(out)
    assert [c["status"] for c in summary["configs"]] == ["ok", "failed", "invalid"]
    assert (summary["ok"], summary["failed"], summary["invalid"], summary["exit_code"]) == (1, 1, 1, 1)
    ok, failed, invalid = summary["configs"]
    assert ok["folder"] == str(tmp_path / ok_folder("16 2 2", 0)) and ok["ranks_in_job"] == 16
    assert ok["ranks_traced"] == 2 and ok["reduction_pct"] == 87.5
    assert "boom on W=32" in failed["error"] and failed["ranks"][0]["status"] == "failed"
    assert invalid["folder"] is None and "not divisible" in invalid["reasons"][0]
    assert "\x1b[" not in err and "configs" not in err  # stderr is not a terminal: no progress bar


def test_collect_writes_what_a_trace_run_writes_from_ranks_traced_elsewhere(tmp_path, stand_in, capsys):
    """--collect (the MEGATRON_LM_DIR way of update_pretrain_gpt.sh): summary and timeline from the traces."""
    argv = ["--model", "tiny", "--config", "16 2 2", "--config", "32 4 1", "--output-dir", str(tmp_path), "--json"]
    assert trace_cli.main(argv + ["--isolation", "inline", "--config", "8 4 1"]) == 1  # 32 4 1 fails
    traced = json.loads(capsys.readouterr().out)["configs"]
    ok, failed = (tmp_path / ok_folder("16 2 2", 0)), (tmp_path / ok_folder("32 4 1", 1))
    expected = json.loads((ok / "summary.json").read_text())
    timeline = (ok / "timeline.json").read_text()
    for folder in (ok, failed):
        (folder / "summary.json").unlink()
        (folder / "timeline.json").unlink(missing_ok=True)
    # config 1's four ranks, traced elsewhere: all but rank 24
    for rank in (0, 8, 16):
        stand_in_trace(cfg("32 4 1").layout(), rank, cfg("32 4 1").model,
                       {"shapes_only": True}).write(failed)
    code = trace_cli.main(argv + ["--collect", "--config", "9 2 2"])
    collected = json.loads(capsys.readouterr().out)["configs"]
    assert code == 1 and [c["status"] for c in collected] == ["ok", "failed", "invalid"]
    got = json.loads((ok / "summary.json").read_text())
    same = ("status", "complete", "ranks_traced", "reduction_pct", "timeline", "folder")
    assert {k: got[k] for k in same} == {k: expected[k] for k in same}
    assert [(r["rank"], r["stage"], r["status"], r["files"], r["stats"]) for r in got["ranks"]] == [
        (r["rank"], r["stage"], r["status"], r["files"], r["stats"]) for r in expected["ranks"]]
    assert (ok / "timeline.json").read_text() == timeline
    summary = json.loads((failed / "summary.json").read_text())
    assert [r["status"] for r in summary["ranks"]] == ["ok", "ok", "ok", "failed"]
    assert summary["error"] == "rank 24: no rank_24.trace.jsonl: see fake_rank_24.log"
    assert summary["shapes_only"] is True and (failed / "timeline.json").is_file()
    assert traced[1]["status"] == collected[1]["status"] == "failed"
    # a config's time is what tracing its ranks took (one after another), not the collecting
    assert collected[0]["seconds"] == pytest.approx(sum(stand_in_seconds(r["rank"]) for r in got["ranks"]))
    assert [r["seconds"] for r in summary["ranks"]][:3] == [pytest.approx(stand_in_seconds(r)) for r in (0, 8, 16)]


def test_trace_plain_table_when_not_a_terminal(tmp_path, stand_in, capsys):
    code = trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "24 3 1", "--output-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["#", "config", "model", "ranks", "traced", "reduction", "status", "time", "folder"]
    assert "ok" in lines[1].split() and "87.50%" in lines[1] and ok_folder("16 2 2", 0) in lines[1]
    assert "invalid" in lines[2] and "skipped: 4 layers of model tiny-te do not split evenly into PP = 3" in lines[2]
    assert lines[-1] == f"1 traced, 0 failed, 1 invalid; folders in {tmp_path}"
    assert "\x1b[" not in out + err


def test_trace_strict_and_nothing_valid(tmp_path, stand_in, capsys):
    assert trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "24 3 1", "--output-dir", str(tmp_path),
                           "--strict"]) == 1
    assert trace_cli.main(["--model", "tiny", "--config", "24 3 1", "--output-dir", str(tmp_path)]) == 1


def test_rich_table_on_a_terminal(tmp_path):
    results = run_batch(parse_configs(["16 2 2", "24 3 1"]), tmp_path, tracer=stand_in_tracer,
                        isolation="inline", progress=False)
    tty = FakeTTY()
    trace_cli.print_summary(results, file=tty)
    text = tty.getvalue()
    assert "fake-rank traces" in text and "87.50%" in text and ("┃" in text or "│" in text)


def test_trace_usage_errors_exit_2(tmp_path, capsys):
    assert trace_cli.main(["--configs", str(tmp_path / "nope.txt")]) == 2
    assert trace_cli.main(["--config", "16 2"]) == 2
    assert trace_cli.main(["--config", "16 2 2", "--model", "7b"]) == 2
    err = capsys.readouterr().err
    assert "cannot read config file" in err and "expected 3 to 5 numbers" in err and "unknown model '7b'" in err


def test_print_ranks(capsys):
    code = trace_cli.main(["--config", "8192 16 8", "--config", "100 3 2", "--model", "175", "--print-ranks"])
    out, err = capsys.readouterr()
    assert code == 0
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
    assert [int(r[11]) for r in rows] == [512 * s for s in range(16)]
    te_175 = dataclasses.replace(get_model("175"), attention="transformer_engine")  # Megatron-LM's default layers
    assert {(r[14], r[15], r[16], r[17]) for r in rows} == {
        ("175B-te", "0", "8", cfg("8192 16 8", model=te_175).folder_name())}
    # the rest of the line: the pretrain_gpt.py flags of the model
    flags = {" ".join(r[18:]) for r in rows}
    assert len(flags) == 1 and flags.pop().startswith("--num-layers 96 --hidden-size 12288 --num-attention-heads 96")
    assert "config 1 (100 3 2) is invalid" in err
    trace_cli.main(["--config", "64 2 2 1 4", "--num-experts", "8", "--disable-bias-linear", "--sequence-parallel",
                    "--print-ranks", "--json"])
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert [(r["rank"], r["stage"], r["ep_rank"]) for r in ranks] == [
        (0, 0, 0), (2, 0, 1), (4, 0, 2), (6, 0, 3), (32, 1, 0), (34, 1, 1), (36, 1, 2), (38, 1, 3)]


def test_default_config_is_8192_2_2(capsys):
    assert trace_cli.main(["--print-ranks"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[1], r[2], r[3], r[11]) for r in rows] == [("8192", "2", "2", "0"), ("8192", "2", "2", "4096")]


def test_add_trace_parser_registers_a_subcommand():
    import argparse

    parser = argparse.ArgumentParser(prog="megatron-dynapipe")
    trace_cli.add_trace_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["trace", "--config", "8 2 2", "--shapes-only", "--json"])
    assert args.func is trace_cli.run_trace and args.shapes_only is True and args.json
    assert parser.parse_args(["trace", "--real-compute"]).shapes_only is False
    assert parser.parse_args(["trace"]).shapes_only is None
    with pytest.raises(SystemExit):
        parser.parse_args(["trace", "--real-compute", "--shapes-only"])


# --------------------------------------------------------------------------------------------
# with the real tracer


@pytest.mark.slow
def test_real_tracer_isolates_a_failing_config(tmp_path, monkeypatch, capsys):
    """One config whose trace raises (a rank outside the job) amid real traces."""
    from megatron_dynapipe.tracer import fake_rank

    real = fake_rank.trace_fake_rank

    def sometimes_broken(layout, rank, model, **kw):
        if layout.world_size == 32:
            raise RuntimeError("injected failure")
        return real(layout, rank, model, **kw)

    monkeypatch.setattr(batch_run, "_default_tracer", lambda: sometimes_broken)
    code = trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "32 2 2", "--config", "8 4 1",
                           "--output-dir", str(tmp_path), "--json", "--shapes-only"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 1
    assert [c["status"] for c in summary["configs"]] == ["ok", "failed", "ok"]
    assert "injected failure" in summary["configs"][1]["error"]
    for c in (summary["configs"][0], summary["configs"][2]):
        for r in c["ranks"]:
            assert (Path(c["folder"]) / f"rank_{r['rank']}.trace.jsonl").stat().st_size > 0


# --------------------------------------------------------------------------------------------
# the trace command's edges: bad lines, bad places, Ctrl-C


def test_an_unparsable_config_is_skipped_and_the_others_are_traced(tmp_path, stand_in, capsys):
    code = trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "16 two 2",
                           "--output-dir", str(tmp_path), "--json", "--isolation", "inline"])
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert code == 1 and summary["exit_code"] == 1
    assert [c["status"] for c in summary["configs"]] == ["ok"]
    assert len(summary["unparsable"]) == 1 and "--config #2: PP must be an integer, got 'two'" in summary["unparsable"][0]
    assert "skipping a config that cannot be parsed: --config #2" in err


def test_a_configs_file_line_that_cannot_be_parsed_names_its_line(tmp_path, stand_in, capsys):
    path = tmp_path / "configs.txt"
    path.write_text("# layouts\n16 2 2\n16 2 2 mbs=x\n")
    code = trace_cli.main(["--model", "tiny", "--configs", str(path), "--output-dir", str(tmp_path / "t"),
                           "--isolation", "inline"])
    assert code == 1 and f"{path}:3: mbs must be an integer" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--config", ""], "no configs: --config holds only blanks or comments"),
    (["--config", "1 2"], "no config could be parsed: --config: expected 3 to 5 numbers"),
    (["--output-dir", "{file}"], "is a file, not a folder: choose a folder"),
    (["--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["--jobs", "2", "--isolation", "inline"], "drop --isolation inline, or use --jobs 1"),
    (["--output-dir", "{file}/below"], "is not a writable folder"),
    (["--cost-model", "/missing/profile.json"], "cost model file /missing/profile.json not found"),
    (["--cost-model", "gpt-6.7b-a100", "--model", "6.7", "--config", "16 1 16"], "has no profile for tp=16"),
])
def test_what_would_fail_every_rank_is_refused_before_any_starts(tmp_path, args, message, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(batch_run, "_default_tracer", lambda: lambda *a, **k: calls.append(a))
    (tmp_path / "file").write_text("")
    argv = ["--model", "tiny"] + [a.format(file=tmp_path / "file") for a in args]
    if "--config" not in argv:
        argv += ["--config", "16 2 2"]
    if "--output-dir" not in argv:
        argv += ["--output-dir", str(tmp_path / "traces")]
    assert trace_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert calls == [] and not (tmp_path / "traces").exists()


def test_ctrl_c_marks_the_folder_interrupted_and_stops_the_batch(tmp_path, monkeypatch, capsys):
    def tracer(layout, rank, model, **options):
        if rank > 0:
            raise KeyboardInterrupt
        return stand_in_tracer(layout, rank, model, **options)

    monkeypatch.setattr(batch_run, "_default_tracer", lambda: tracer)
    code = trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "32 2 2",
                           "--output-dir", str(tmp_path), "--isolation", "inline"])
    out, err = capsys.readouterr()
    assert code == 130
    folder = tmp_path / ok_folder("16 2 2", 0)
    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["status"], summary["complete"]) == ("interrupted", False)
    assert summary["error"] == "interrupted after 1 of 2 ranks" and len(summary["ranks"]) == 1
    assert not list(folder.glob(".*")), "hidden partial logs left behind"
    assert (folder / "fake_rank_8.log").read_text().endswith("# status interrupted\n")
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # the second config never started
    assert "interrupted; " + str(folder) in err and "Traceback" not in err
    assert "1 interrupted" in out


def test_trace_defaults_to_the_model_of_the_example_script(capsys):
    assert trace_cli.main(["--config", "8192 16 8", "--print-ranks"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert len(rows) == 16 and {r[14] for r in rows} == {"6.7B-te"}

def test_trace_takes_megatron_model_and_precision_flags(tmp_path, capsys):
    code = trace_cli.main(["--model", "tiny", "--swiglu", "--normalization", "RMSNorm", "--group-query-attention",
                           "--num-query-groups", "2", "--position-embedding-type", "rope", "--ffn-hidden-size", "384",
                           "--fp16", "--config", "8 2 2", "--shapes-only", "--output-dir", str(tmp_path), "--json",
                           "--no-progress", "--jobs", "1"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0, summary
    traces = [RankTrace.read(p) for p in sorted(Path(summary["configs"][0]["folder"]).glob("rank_*.trace.jsonl"))]
    assert [t.rank for t in traces] == [0, 4]
    for trace in traces:
        m = trace.model
        assert (m["swiglu"], m["normalization"], m["num_query_groups"], m["position_embedding_type"],
                m["ffn_hidden_size"], m["dtype"]) == (True, "RMSNorm", 2, "rope", 384, "float16")
        tp = {op.bytes for op in trace.comm_ops if op.group_name == "TENSOR_MODEL_PARALLEL_GROUP"
              and op.kind == "all_reduce" and op.phase == "forward" and op.shape[-1] == 128}
        assert tp == {256 * 1 * 128 * 2}  # tiny: [seq 256, mbs 1, hidden 128] in float16 (not the loss's)


def test_trace_refuses_num_query_groups_without_group_query_attention(tmp_path, capsys):
    assert trace_cli.main(["--model", "tiny", "--num-query-groups", "2", "--output-dir", str(tmp_path)]) == 2
    assert "--num-query-groups needs --group-query-attention" in capsys.readouterr().err


@pytest.mark.parametrize("flags,says", [
    (["--position-embedding-type", "alibi"], "megatron-core's GPTModel has no ALiBi"),
    (["--position-embedding-type", "sinusoid"], "use one of learned_absolute, rope"),
    (["--use-torch-fsdp2"], "--use-torch-fsdp2 is not traced"),
    (["--use-megatron-fsdp"], "trace --use-distributed-optimizer"),
])
def test_what_megatron_core_has_not_or_the_tracer_does_not_follow_is_refused_with_why(tmp_path, capsys, flags, says):
    assert trace_cli.main(["--model", "tiny", *flags, "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_sigterm_during_a_trace_marks_the_folder_interrupted_and_exits_143(tmp_path):
    """SIGTERM to the command alone (a scheduler's, or ``kill``'s) once its first rank is traced: the
    ranks still running are ended, the folder says interrupted, not complete."""
    import signal

    from project import interrupt_when

    command = ["megatron_dynapipe.cli", "trace", "--model", "175", "--config", "8192 16 8", "--output-dir",
               str(tmp_path), "--no-progress", "--jobs", "1"]
    proc, (out, err) = interrupt_when(command, lambda: any(tmp_path.glob("*/fake_rank_*.log")), signal.SIGTERM)
    assert proc.returncode == 143, err[-3000:]
    summary = json.loads(next(tmp_path.glob("*/summary.json")).read_text())
    assert (summary["status"], summary["complete"]) == ("interrupted", False)
    assert 1 <= len(summary["ranks"]) < 16 and "Traceback" not in err
