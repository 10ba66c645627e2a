"""The planner benchmark, run as a user runs it."""

import json
import math
import subprocess
import sys

import pytest

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


def test_packed_plans_are_measured_against_thd_packing_without_a_padded_ideal():
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_planner.py"), "--sizes", "16", "--seeds", "1",
               "--packing", "varlen", "--cost-model", str(GPT_6_7B_A100), "--all-cores"]
    rows, table = (subprocess.run(command + extra, capture_output=True, text=True, timeout=300, cwd=ROOT)
                   for extra in (["--json"], []))
    assert rows.returncode == 0 and table.returncode == 0, rows.stderr + table.stderr
    (row,) = [json.loads(line) for line in rows.stdout.splitlines()]
    assert row["speedup_vs_packing"] > 0 and row["makespan_over_lower_bound"] >= 1.0
    assert math.isnan(row["ideal_gain"]) and math.isnan(row["share_of_ideal"])
    assert "varlen micro-batches" in table.stdout and "THD packing (whole) to 4096" in table.stdout
    (line,) = [line for line in table.stdout.splitlines() if line.startswith("| 16 |")]
    assert line.split("|")[9:11] == [" - ", " - "]  # ideal, share


def test_planner_benchmark_shows_where_time_goes():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_planner.py"), "--sizes", "8", "--seeds", "1",
                          "--phases", "--mix", "long", "--all-cores"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("where planning time goes")[1].splitlines()
    assert "| samples | micro-batching | scheduling | lowering |" in table
    row = next(line for line in table if line.startswith("| 8 |"))
    assert row.count("/") == 3  # normal / fast for each phase


def test_the_tight_memory_limit_is_the_least_that_plans(tmp_path):
    from megatron_dynapipe.planning.cost_model import StageCosts, load_cost_model
    from megatron_dynapipe.planning.planner import PlanningError, generate_execution_plan
    from megatron_dynapipe.planning.samples import synthetic_lengths
    from megatron_dynapipe.planning.spec import TrainingSpec

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_planner.py"), "--sizes", "16",
                          "--seeds", "1", "--mix", "long", "--memory-limit", "tight", "--json", "--cost-model", str(GPT_6_7B_A100),
                          "--all-cores"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    (row,) = [json.loads(line) for line in out.stdout.splitlines()]
    costs = StageCosts(load_cost_model(str(GPT_6_7B_A100), tp=1), num_layers=32, pp=4)
    lengths = synthetic_lengths(16, 0, "long")
    limit = row["limit_mb"]
    assert limit < 36_000 and row["normal_plan_s"] > 0 and row["fast_over_normal_makespan"] > 0
    generate_execution_plan(lengths, TrainingSpec(memory_limit_mb=limit), costs)
    with pytest.raises(PlanningError):
        generate_execution_plan(lengths, TrainingSpec(memory_limit_mb=limit - 16), costs)


def test_no_seeds_is_refused_before_any_planning():
    out = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "bench", "planner", "--seeds", "0"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "--seeds 0: give how many batches to plan per size, at least 1" in out.stderr


def test_a_memory_limit_that_is_not_one_is_refused_naming_the_choices():
    out = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "bench", "planner", "--memory-limit", "lots"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2
    assert "'lots' is not a memory limit: give MB (e.g. 36000) or 'tight'" in out.stderr


def test_interleaved_plans_are_measured_against_megatrons_interleaved_1f1b():
    """--chunks 2: the plan runs 4 ranks x 2 chunks, and so does its packing baseline, on
    Megatron's interleaved 1F1B, faster here than its 1F1B on the same ranks (the baseline at
    --chunks 1), and the bound holds."""
    from megatron_dynapipe.planning.baselines import fixed_length_baseline, pack_fixed_length
    from megatron_dynapipe.planning.cost_model import StageCosts, load_cost_model
    from megatron_dynapipe.planning.samples import synthetic_lengths

    def bench(chunks, *extra):
        command = [sys.executable, str(ROOT / "benchmarks" / "bench_planner.py"), "--sizes", "16", "--seeds", "1",
                   "--mix", "multitask", "--cost-model", str(GPT_6_7B_A100), "--all-cores", "--chunks", str(chunks)]
        out = subprocess.run(command + list(extra), capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        return out.stdout

    plain, interleaved = (json.loads(bench(chunks, "--json")) for chunks in (1, 2))
    packing = [row["normal_makespan_ms"] * row["speedup_vs_packing"] for row in (plain, interleaved)]
    model = load_cost_model(str(GPT_6_7B_A100), tp=1)
    sequences = len(pack_fixed_length(synthetic_lengths(16, 0, "multitask"), 4096))
    expected = [fixed_length_baseline(sequences, 4096, StageCosts(model, num_layers=32, pp=4 * chunks), 36_000,
                                      chunks=chunks).makespan_ms for chunks in (1, 2)]
    assert packing == pytest.approx(expected, rel=1e-9)
    assert packing[1] < packing[0]
    assert interleaved["makespan_over_lower_bound"] >= 1.0
    assert "PP=4 x 2 chunks" in bench(2) and "packing to 4096 on interleaved 1F1B" in bench(2)


def test_context_parallel_plans_price_each_rank_of_the_group(capsys):
    """--cp 2: each rank of a pair runs the plan on half of every row's tokens, every method
    priced alike; a profile that does not record its GPT cannot say what attention is repeated."""
    def bench(*extra):
        command = [sys.executable, str(ROOT / "benchmarks" / "bench_planner.py"), "--sizes", "64", "--seeds", "1",
                   "--mix", "long", "--all-cores", "--json", *extra]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)

    plain, split = (json.loads(bench("--cp", str(cp)).stdout) for cp in (1, 2))
    assert split["makespan_over_lower_bound"] >= 1.0
    assert split["normal_makespan_ms"] < plain["normal_makespan_ms"]  # twice the GPUs a pipeline
    from megatron_dynapipe.cli import main

    assert main(["bench", "planner", "--sizes", "8", "--cp", "2", "--all-cores", "--cost-model", str(GPT_6_7B_A100)]) == 2
    err = capsys.readouterr().err
    assert "does not record the GPT it measured" in err and err.count("\n") == 1, err
