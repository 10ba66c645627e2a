"""Where the tests find the project: its root and the profile shipped inside the package (every test
that plans on it runs on a fresh clone)."""

import os
import random
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT_6_7B_A100 = ROOT / "megatron_dynapipe" / "planning" / "profiles" / "gpt-6.7b-a100.json"

#: The Megatron-LM checkout the end-to-end tests run (CI extracts core_v0.16.1 and core_v0.19.0 into
#: one each); those tests skip, saying so, where it is not set.
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR", "")
NO_CHECKOUT = ("MEGATRON_LM_DIR is not set: point it at a Megatron-LM checkout of tag core_v0.16.1 through "
               "core_v0.19.x (git clone https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout "
               "core_v0.19.0) to run the Megatron-LM end-to-end tests")


def patch_for(checkout: Path) -> Path:
    """The one patch in patches/ that applies to ``checkout``'s pretrain_gpt.py (``git apply --check``)."""
    fits = [patch for patch in sorted((ROOT / "patches").glob("*.patch"))
            if subprocess.run(["git", "apply", "--check", str(patch)], cwd=checkout, capture_output=True).returncode == 0]
    assert len(fits) == 1, f"{len(fits)} of the patches in patches/ apply to {checkout}: {[p.name for p in fits]}"
    return fits[0]


def interrupt_when(command: list, ready, signum: int, *, timeout: float = 600):
    """Start ``command``, send it (alone, as a scheduler or ``kill`` does) ``signum`` once ``ready()``
    holds, and return it finished with its ``(out, err)``. Polls: no test waits on a speed."""
    import signal
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, f"{command} ended before it was ready to interrupt: {proc.stderr.read()[-2000:]}"
        proc.send_signal(signum)
        return proc, proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def free_ports(n: int) -> list[int]:
    """``n`` consecutive free TCP ports on 127.0.0.1 (torchrun's master port, the data pipeline's KV
    stores at --dynapipe-kv-port and the next one), below Linux's ephemeral range (32768-60999):
    the ranks' own connections (gloo opens many) take their local ports from that range and could
    take a store's port before it binds."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32768 - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return list(range(base, base + n))
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports between 20000 and 32768")


def stream_windows(lengths, seq_length):
    """Megatron's GPT data path, token by token: the samples' tokens laid back to back, a new window
    every ``seq_length`` of them; per window, the [sample, tokens] runs it holds (the tests' own
    account of ``planning.documents.cut_documents``)."""
    windows = []
    position = 0
    for sample, n in enumerate(lengths):
        for _ in range(n):
            if position % seq_length == 0:
                windows.append([])
            if windows[-1] and windows[-1][-1][0] == sample:
                windows[-1][-1][1] += 1
            else:
                windows[-1].append([sample, 1])
            position += 1
    return windows
