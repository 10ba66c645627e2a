"""Pictures of a simulated plan: Chrome-trace JSON (chrome://tracing, Perfetto) and a Gantt PNG."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Sequence

from .planning.simulator import Event

_ROWS = {"F": "compute", "B": "compute", "send-act": "send activations", "send-grad": "send gradients"}
_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "send-act": "#8fbbd9", "send-grad": "#f4b183"}


def write_atomically(path: str | os.PathLike, data: bytes | str) -> None:
    """Write a file so that readers see the old content or the new one, never a torn mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def chrome_trace(events: Sequence[Event], name: str = "dynapipe plan") -> dict:
    """Trace Event Format: one process per pipeline stage, compute and each link as threads."""
    threads = {row: i for i, row in enumerate(dict.fromkeys(_ROWS.values()))}
    out = [{"ph": "M", "name": "process_name", "pid": s, "args": {"name": f"stage {s}"}}
           for s in sorted({e.stage for e in events})]
    for s in sorted({e.stage for e in events}):
        out += [{"ph": "M", "name": "thread_name", "pid": s, "tid": tid, "args": {"name": row}}
                for row, tid in threads.items()]
    for e in events:
        out.append({
            "name": f"{e.kind} {e.microbatch}",
            "cat": e.kind, "ph": "X", "pid": e.stage, "tid": threads[_ROWS[e.kind]],
            "ts": e.start * 1000.0, "dur": (e.end - e.start) * 1000.0,  # ms -> us
            "args": {"microbatch": e.microbatch},
        })
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"name": name}}


def write_chrome_trace(events: Sequence[Event], path: str | os.PathLike, name: str = "dynapipe plan") -> None:
    write_atomically(path, json.dumps(chrome_trace(events, name)))


def write_gantt(events: Sequence[Event], path: str | os.PathLike, title: str = "") -> None:
    """One row per stage: forwards blue, backwards orange, labelled by micro-batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compute = [e for e in events if e.kind in ("F", "B")]
    stages = sorted({e.stage for e in compute})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(stages) + 1.5))
    for e in compute:
        ax.barh(e.stage, e.end - e.start, left=e.start, color=_COLOURS[e.kind], edgecolor="black", linewidth=0.3)
        if e.end - e.start > 0.02 * max(x.end for x in compute):
            ax.text((e.start + e.end) / 2, e.stage, str(e.microbatch), ha="center", va="center", fontsize=6)
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title or "pipeline timeline (blue: forward, orange: backward)")
    fig.tight_layout()
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
