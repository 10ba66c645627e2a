"""The planner benchmark, run as a user runs it."""

import json
import subprocess
import sys

from project import GPT_6_7B_A100, ROOT


def test_planner_benchmark_rows(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_planner.py"), "--sizes", "8", "16",
                          "--seeds", "1", "--json", "--cost-model", str(GPT_6_7B_A100), "--all-cores"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["samples"] for r in rows] == [8, 16]
    for r in rows:
        assert r["normal_plan_s"] > 0 and r["fast_plan_s"] > 0
        assert r["makespan_over_lower_bound"] >= 1.0  # a lower bound is never beaten
        assert r["speedup_vs_packing"] > 0 and r["ideal_gain"] > 1.0


def test_planner_benchmark_shows_where_time_goes():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_planner.py"), "--sizes", "8", "--seeds", "1",
                          "--phases", "--mix", "long", "--all-cores"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("where planning time goes")[1].splitlines()
    assert "| samples | micro-batching | scheduling | lowering |" in table
    row = next(line for line in table if line.startswith("| 8 |"))
    assert row.count("/") == 3  # normal / fast for each phase
