"""examples/megatron_fast_mode_example.py under torchrun with 2 processes: a tiny megatron-core
GPT trains on CPU with DynaPipe's planned schedule, planned in fast mode, and its loss falls."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from project import ROOT, free_ports

EXAMPLE = ROOT / "examples" / "megatron_fast_mode_example.py"
BUDGET_S = 110  # the example must run in under 2 minutes here, start-up included


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--pp", "2"], ["--pp", "1", "--iters", "8"]], ids=["pp2", "dp2"])
def test_example_trains_with_planned_fast_mode_schedule(tmp_path, layout):
    summary_file = tmp_path / "summary.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DYNAPIPE_FAST_MODE", None)  # the example turns fast mode on itself
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_ports(2)[0]), str(EXAMPLE), *layout, "--summary", str(summary_file)]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BUDGET_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]  # within BUDGET_S, or it timed out

    summary = json.loads(summary_file.read_text())
    pp = int(layout[1])
    assert summary["layout"] == {"pp": pp, "dp": 2 // pp, "tp": 1}
    # Fast mode: the setting the planning workers read from the KV store, and its effect: fast
    # mode schedules wait-free-cyclic only (normal mode may also pick 1F1B).
    assert summary["fast_mode"] is True
    assert summary["schedules"] == ["wait-free-cyclic"]
    assert summary["planning_one_batch"]["fast"]["schedule"] == "wait-free-cyclic"
    # Planned micro-batches: several per global batch (the 6 MB limit forces it).
    assert all(n >= 2 for n in summary["microbatch_counts"])
    losses = summary["losses"]
    assert len(losses) == (20 if pp == 2 else 8)
    assert losses[-1] < losses[0] - 0.5, losses
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    assert "fast mode (as the planning workers read it): true" in proc.stdout
