"""A worker pool's exit ends workers that are still starting (interrupts.worker_pool)."""

import subprocess
import sys

from project import ROOT

# a fork hook slow enough that the pool exits while both workers are still in it: its terminate()
# sends them SIGTERM there, where the command's handler would raise a KeyboardInterrupt that
# Python drops (a worker that went on to wait for work would leave the pool's join hanging)
SCRIPT = """
import multiprocessing, os, time
from megatron_dynapipe.interrupts import noted_interrupts, worker_pool
os.register_at_fork(after_in_child=lambda: time.sleep(2))
with noted_interrupts():
    with worker_pool(multiprocessing.get_context("fork"), 2):
        pass
print("joined")
"""


def test_a_pool_that_exits_while_its_workers_start_ends_them():
    try:
        run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise AssertionError("the pool's exit waited on a worker its SIGTERM did not end") from None
    assert run.returncode == 0 and run.stdout == "joined\n", run.stderr[-2000:]
