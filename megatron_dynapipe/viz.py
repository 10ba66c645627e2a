"""Pictures of simulated plans: Chrome-trace JSON (chrome://tracing, Perfetto) and a Gantt chart.

Both take one timeline (list of events) per data-parallel rank: any rank may set the iteration
time, so every rank is shown.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from megatron_dynapipe.chrome_trace import ChromeTrace
from megatron_dynapipe.files import atomic_path
from megatron_dynapipe.planning.simulator import Event
from megatron_dynapipe.planning.types import Op

GANTT_SUFFIXES = (".png", ".svg", ".pdf")  # formats matplotlib writes by suffix
# An event's row, name and colour by its kind (a KeyError for a kind shown nowhere yet)
_ROWS = {Op.FORWARD: "compute", Op.BACKWARD: "compute", Op.SEND_ACT_START: "send activations",
         Op.SEND_GRAD_START: "send gradients"}
_NAMES = {Op.FORWARD: "F", Op.BACKWARD: "B", Op.SEND_ACT_START: "send-act", Op.SEND_GRAD_START: "send-grad"}
_COLOURS = {Op.FORWARD: "#4C72B0", Op.BACKWARD: "#DD8452", Op.SEND_ACT_START: "#8fbbd9",
            Op.SEND_GRAD_START: "#f4b183"}
_LABEL_POINTS_PER_CHAR = 4.0  # width of one digit at the label's 6-point font


def chrome_trace(timelines: Sequence[Sequence[Event]], name: str = "dynapipe plan") -> ChromeTrace:
    """One process per (DP rank, stage), with rows for compute and each link."""
    stages = sorted({e.stage for events in timelines for e in events})
    trace = ChromeTrace(name=name)
    for rank, events in enumerate(timelines):
        for s in stages:
            pid = rank * len(stages) + s
            trace.process(pid, f"stage {s}" if len(timelines) == 1 else f"dp rank {rank}, stage {s}")
            for row in dict.fromkeys(_ROWS.values()):  # every row, in the same order, on every stage
                trace.row(pid, row)
        for e in events:
            kind = _NAMES[e.kind]
            trace.span(rank * len(stages) + e.stage, _ROWS[e.kind], f"{kind} {e.microbatch}", cat=kind,
                       start_us=e.start * 1000.0, dur_us=(e.end - e.start) * 1000.0,
                       args={"microbatch": e.microbatch, "dp_rank": rank})
    return trace


def write_chrome_trace(timelines: Sequence[Sequence[Event]], path: str | os.PathLike,
                       name: str = "dynapipe plan") -> Path:
    return chrome_trace(timelines, name).write(path)


def write_gantt(timelines: Sequence[Sequence[Event]], path: str | os.PathLike,
                titles: Sequence[str] = ()) -> Path:
    """One panel per DP rank, one row per stage, on a shared time axis; forwards blue,
    backwards orange (backward time includes recomputation), each box labelled with its
    micro-batch where the label fits. The format follows the suffix (GANTT_SUFFIXES)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    computes = [[e for e in events if e.kind.is_compute] for events in timelines]
    stages = sorted({e.stage for compute in computes for e in compute})
    end = max((e.end for compute in computes for e in compute), default=1.0)
    width_inches = 12.0
    fig, axes = plt.subplots(len(computes), 1, sharex=True, squeeze=False,
                             figsize=(width_inches, (0.5 * len(stages) + 0.8) * len(computes) + 1.0))
    points_per_ms = 0.85 * width_inches * 72 / end  # the axes take about 85% of the figure
    for rank, (ax, compute) in enumerate(zip(axes[:, 0], computes)):
        for e in compute:
            ax.barh(e.stage, e.end - e.start, left=e.start, color=_COLOURS[e.kind], edgecolor="black",
                    linewidth=0.3)
            label = str(e.microbatch)
            if (e.end - e.start) * points_per_ms >= _LABEL_POINTS_PER_CHAR * (len(label) + 1):
                ax.text((e.start + e.end) / 2, e.stage, label, ha="center", va="center", fontsize=6)
        ax.set_yticks(stages, [f"stage {s}" for s in stages])
        ax.set_ylim(max(stages) + 0.6, min(stages) - 0.6)  # stage 0 on top
        ax.set_title(titles[rank] if rank < len(titles) else f"dp rank {rank}", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time (ms)")
    fig.legend(handles=[Patch(color=_COLOURS[Op.FORWARD], label="forward"),
                        Patch(color=_COLOURS[Op.BACKWARD], label="backward (with recomputation)")],
               loc="upper right", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)
    return Path(path)
