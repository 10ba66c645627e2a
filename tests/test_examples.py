"""The example scripts, run as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from project import ROOT

EXAMPLES = ROOT / "examples"


# --------------------------------------------------------------------------------------------
# example scripts (subprocesses, like a user runs them)


def run_script(name, *args, env=None, timeout=600):
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)


def test_rank_mapping_script_passes():
    out = run_script("test_rank_mapping.sh")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout and "all" in out.stdout.splitlines()[-1]


def test_rank_mapping_script_fails_on_a_wrong_expectation(tmp_path):
    wrong = tmp_path / "expect.txt"
    wrong.write_text("8192 2 2 : 0 4096\n16 4 1 : 0 4 8 13   # 13 is wrong\n")
    out = run_script("test_rank_mapping.sh", str(wrong))
    assert out.returncode != 0
    assert "FAIL 16 4 1" in out.stdout and "PASS 8192 2 2" in out.stdout


@pytest.mark.slow
def test_batch_config_script_passes(tmp_path):
    out = run_script("test_batch_config.sh", env={"WORK_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout


def test_batch_config_script_fails_on_a_wrong_expectation(tmp_path):
    wrong = tmp_path / "expect.txt"  # nothing valid to trace: fast
    wrong.write_text("12 2 4 : ok SIM_GPT_tiny_Config0_WS12  # it is invalid\n24 3 1 : invalid\n")
    out = run_script("test_batch_config.sh", str(wrong), env={"WORK_DIR": str(tmp_path / "w")})
    assert out.returncode == 1
    assert "FAIL 12 2 4 : status invalid, expected ok" in out.stdout and "PASS 24 3 1" in out.stdout


def test_update_pretrain_gpt_builds_megatron_commands(tmp_path):
    out = run_script("update_pretrain_gpt.sh", "8192 2 2", "4096 16 4",
                     env={"MEGATRON_LM_DIR": str(tmp_path / "Megatron-LM"), "DRY_RUN": "1",
                          "MODEL_SIZE": "175", "OUTPUT_DIR": str(tmp_path / "out")})
    assert out.returncode == 0, out.stdout + out.stderr
    commands = [line for line in out.stdout.splitlines() if " -m megatron_dynapipe.megatron.launcher " in line]
    assert len(commands) == 2 + 16
    first = commands[0]
    for flag in ("--is-scaling-mode", "--fake-world-size 8192", "--fake-pp 2", "--fake-tp 2",
                 "--fake-current-rank-id 0", "--hidden-size 12288", "--num-layers 96",
                 "--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2",
                 "--trace-dir " + str(tmp_path / "out" / "SIM_GPT_175B-te_Config0_WS8192_PP2_TP2_DP2048_"),
                 "--trace-start 1", "--trace-iters 1",
                 str(tmp_path / "Megatron-LM" / "pretrain_gpt.py")):
        assert flag in first, flag
    assert "--fake-current-rank-id 4096" in commands[1]
    assert [c.split("--fake-current-rank-id ")[1].split()[0] for c in commands[2:]] == [
        str(256 * s) for s in range(16)]


def test_update_pretrain_gpt_passes_the_model_and_training_flags_to_megatron(tmp_path):
    """TRACE_ARGS describe the model and how it trains on both ways: each rank's pretrain_gpt.py
    command carries them, and the configs they do not fit are skipped before any command."""
    flags = "--bf16 --disable-bias-linear --sequence-parallel --num-layers-per-virtual-pipeline-stage 1"
    out = run_script("update_pretrain_gpt.sh", "64 2 2 1 4 experts=8", "64 2 2 nmb=3",
                     env={"MEGATRON_LM_DIR": str(tmp_path / "Megatron-LM"), "DRY_RUN": "1", "MODEL_SIZE": "tiny",
                          "TRACE_ARGS": flags, "OUTPUT_DIR": str(tmp_path / "out")})
    assert out.returncode == 0, out.stdout + out.stderr
    commands = [line for line in out.stdout.splitlines() if " -m megatron_dynapipe.megatron.launcher " in line]
    assert len(commands) == 2 * 4  # PP 2 x EP 4
    for command in commands:
        for flag in (*flags.split(" --"), "--num-experts 8", "--expert-model-parallel-size 4"):
            assert (flag if flag.startswith("--") else "--" + flag) in command
    assert "config 1 (64 2 2) is invalid: interleaved 1F1B runs micro-batches in groups of PP=2" in out.stderr


@pytest.mark.slow
def test_update_pretrain_gpt_default_run_on_cpu(tmp_path):
    out = run_script("update_pretrain_gpt.sh", env={"OUTPUT_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith("SIM_GPT_6.7B-te_Config0_WS8192_PP2_TP2_DP2048_"), folder.name
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["shapes_only"] is True and summary["timeline"]
    assert {"fake_rank_0.log", "fake_rank_4096.log", "rank_0.trace.jsonl", "rank_4096.trace.jsonl",
            "summary.json"} <= {p.name for p in folder.iterdir()}


def test_fast_mode_example_shows_all_three_switches():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "fast_mode_usage.py")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "fast=False" in lines[0]
    assert all("fast=True" in line for line in lines[1:4])
    assert "fast=False" in lines[4]  # "auto" stays off on 16 samples
