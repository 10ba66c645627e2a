"""`megatron-dynapipe plan` as a user runs it: a real subprocess of the installed entry point."""

import json
import os
import subprocess
import sys

import pytest

from conftest import GPT_6_7B_A100


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_plan_json_on_a_lengths_file(tmp_path):
    lengths = [12, 900, 33, 400, 2048, 77, 150, 600, 64, 1500]
    path = tmp_path / "lengths.txt"
    path.write_text("# one length a line\n" + "\n".join(map(str, lengths)) + "\n")
    out = run_cli("plan", "--lengths", str(path), "--cost-model", str(GPT_6_7B_A100), "--pp", "4", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    placed = sorted(i for m in summary["dp_ranks"][0]["microbatches"] for i in m["samples"])
    assert placed == list(range(len(lengths)))
    assert summary["num_samples"] == 10 and summary["tokens"] == sum(lengths)
    assert summary["planning_seconds"] > 0
    assert summary["makespan_ms"] >= summary["lower_bound_ms"] > 0
    assert summary["baseline"]["makespan_ms"] > 0
    assert max(summary["peak_memory_mb"]) <= 36_000


def test_plan_default_mix_with_pictures(tmp_path):
    trace, gantt = tmp_path / "plan.json", tmp_path / "plan.png"
    out = run_cli("plan", "--num-samples", "24", "--pp", "2", "--memory-limit", "70000", "--fast-mode",
                  "--chrome-trace", str(trace), "--gantt", str(gantt))
    assert out.returncode == 0, out.stderr
    assert "fast mode: on" in out.stdout and "predicted iteration" in out.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    computes = [e for e in events if e.get("ph") == "X" and e["cat"] in ("F", "B")]
    assert len(computes) == 2 * 2 * len({e["args"]["microbatch"] for e in computes})
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dp_lengths_split_shows_every_rank():
    out = run_cli("plan", "--num-samples", "20", "--pp", "2", "--dp", "2", "--memory-limit", "70000", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert len(summary["dp_ranks"]) == 2
    placed = sorted(i for r in summary["dp_ranks"] for m in r["microbatches"] for i in m["samples"])
    assert placed == list(range(20))


@pytest.mark.parametrize("args,message", [
    (["--lengths", "/nonexistent/lengths.txt"], "lengths file /nonexistent/lengths.txt not found"),
    (["--cost-model", "/nonexistent/cm.json"], "not found"),
    (["--memory-limit", "1000"], "model state alone needs"),
])
def test_bad_input_is_one_line_naming_the_fix(args, message):
    out = run_cli("plan", *args) if args[0] == "--lengths" else run_cli("plan", "--num-samples", "8", *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_cost_model_without_the_requested_tp(tmp_path):
    out = run_cli("plan", "--num-samples", "8", "--tp", "3", "--cost-model", str(GPT_6_7B_A100))
    assert out.returncode == 2 and "tp=3" in out.stderr and "1, 2, 4, 8" in out.stderr


def test_malformed_lengths_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("[1, 2, \"x\"]")
    out = run_cli("plan", "--lengths", str(path))
    assert out.returncode == 2 and "not a list of integer lengths" in out.stderr


@pytest.mark.parametrize("flag,expected", [(["--fast-mode"], "on"), (["--fast-mode", "true"], "on"),
                                           (["--fast-mode", "false"], "off"), (["--fast-mode", "auto"], "on"),
                                           ([], "off")])
def test_fast_mode_flag_speaks_the_megatron_flags_vocabulary(flag, expected):
    # 24 samples: "auto" is fast above 16.
    env = {k: v for k, v in os.environ.items() if k != "DYNAPIPE_FAST_MODE"}
    out = run_cli("plan", "--num-samples", "24", "--pp", "2", "--memory-limit", "70000", *flag, env=env)
    assert out.returncode == 0, out.stderr
    assert f"fast mode: {expected}" in out.stdout


def test_fast_mode_flag_refuses_other_words():
    out = run_cli("plan", "--num-samples", "8", "--fast-mode", "maybe")
    assert out.returncode == 2 and "'maybe' is not a fast mode: use true, false or auto" in out.stderr
