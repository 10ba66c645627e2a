"""DynaPipe's plans against Megatron-LM's own packings at one layout, pipeline time only.

A GPT on a world of H100s (the shipped roofline, 2,097,152 tokens a step; transformer-engine's
layers, as ``search`` builds them, unless ``--attention`` names another core) at each layout of
LAYOUTS and each mix: per drawn batch, THD packing as Megatron's GPT data path feeds it (windows
that cut documents), ``dp_balanced`` (whole samples), and DynaPipe varlen and padded in fast and
normal mode, and DynaPipe varlen on THD's own pieces (``documents="cut"``), each the pipeline's
makespan as the planner simulates it. What a traced step adds
besides the pipeline (gradient reduction, optimizer) is the same for every method and left out:
``search --mix`` adds it at traced layouts. One JSON line a batch, then a table of ratios
(Megatron's step over DynaPipe's: above 1, DynaPipe is faster).

    python benchmarks/bench_packings.py --seq-lengths 4096 16384 --mixes longtail multitask --batches 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

from megatron_dynapipe.config.model import ATTENTIONS, get_model
from megatron_dynapipe.hardware import load_hardware
from megatron_dynapipe.planning.baselines import dp_balanced_rows, megatron_thd_rows
from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.planning.microbatching import round_up
from megatron_dynapipe.planning.planner import PlanningError, generate_execution_plan
from megatron_dynapipe.planning.samples import MIXES, LengthSource
from megatron_dynapipe.planning.spec import TrainingSpec, packed_sample_multiple, seqlen_round_for
from megatron_dynapipe.simulate.search import SearchSpace

TOKENS = 2_097_152
#: (TP, PP, chunks, CP) priced at each sequence length: layouts the 13B searches rank high
LAYOUTS = {4096: [(2, 2, 4, 1), (4, 2, 1, 1), (2, 4, 2, 1)], 16384: [(4, 2, 4, 4), (4, 4, 2, 8)],
           32768: [(4, 2, 2, 8), (8, 2, 2, 4)], 65536: [(8, 2, 2, 8), (4, 4, 2, 8)],
           131072: [(8, 2, 2, 16), (8, 4, 1, 8)]}


def price(model: str, world: int, seq: int, layout: tuple, mix: str, batch: int, normal: bool,
          attention: str = "transformer_engine") -> dict:
    tp, pp, chunks, cp = layout
    hw = load_hardware("h100")
    spec_model = dataclasses.replace(get_model(model), max_sequence_length=max(seq, 2048), attention=attention)
    space = SearchSpace(spec_model, world, TOKENS // seq, seq, hw)
    dp = world // (tp * pp * cp)
    layers = StageCosts(space.cost_model_for(tp, tp > 1), num_layers=spec_model.num_layers, pp=pp * chunks, dp=dp,
                        zero_stage=1)
    costs = hw.planner_stages(layers, spec_model, cp=cp, sequence_parallel=tp > 1)
    limit = hw.memory_gib * 1024
    lengths = LengthSource.from_mix(mix).batches(TOKENS, seq, batch + 1, 0)[batch]
    row = {"seq_length": seq, "layout": layout, "mix": mix, "batch": batch, "samples": len(lengths)}
    thd = megatron_thd_rows(lengths, seq, costs, limit, chunks, cp)
    row["thd"] = thd.makespan_ms if thd else math.inf
    try:
        padded = round_up(lengths, packed_sample_multiple(cp)).tolist()
        found = dp_balanced_rows(padded, seq, costs, limit, chunks, seqlen_round_for(cp))
        row["dp_balanced"] = found.makespan_ms if found else math.inf
    except ValueError:
        row["dp_balanced"] = math.nan  # Megatron-LM refuses the batch
    for name, packing, documents in (("varlen", "varlen", "whole"), ("cut", "varlen", "cut"), ("pad", "pad", "whole")):
        for fast in (True, False) if normal else (True,):
            key = name + ("" if fast else "-normal")
            spec = TrainingSpec(num_layers=spec_model.num_layers, pp=pp, tp=tp, dp=dp, chunks=chunks, cp=cp,
                                seqlen_round=seqlen_round_for(cp), zero_stage=1, memory_limit_mb=limit,
                                fast_mode=fast, packing=packing, seq_length=seq, documents=documents)
            started = time.perf_counter()
            try:
                row[key] = generate_execution_plan(lengths, spec, costs).makespan_ms
            except PlanningError:
                row[key] = math.inf
            row[key + "-s"] = time.perf_counter() - started
    return row


def table(rows: list[dict]) -> str:
    """One line a (sequence length, layout, mix): each ratio's range over the batches."""
    def span(key, over):
        values = [r[key] / r[over] for r in group if r.get(over) and math.isfinite(r.get(key, math.nan))]
        return "-" if not values else f"{min(values):.2f}" if len(values) == 1 or round(min(values), 2) == round(
            max(values), 2) else f"{min(values):.2f}-{max(values):.2f}"

    lines = []
    for key in dict.fromkeys((r["seq_length"], tuple(r["layout"]), r["mix"]) for r in rows):
        group = [r for r in rows if (r["seq_length"], tuple(r["layout"]), r["mix"]) == key]
        seq, (tp, pp, chunks, cp), mix = key
        normal = "varlen-normal" in group[0]
        lines.append(f"| {seq:,} | TP {tp}, PP {pp}" + (f" x {chunks}" if chunks > 1 else "") + f", CP {cp} | {mix} | "
                     f"{span('thd', 'varlen')}" + (f"; {span('thd', 'varlen-normal')}" if normal else "")
                     + f" | {span('thd', 'cut')}" + (f"; {span('thd', 'cut-normal')}" if normal else "")
                     + f" | {span('dp_balanced', 'varlen')} | {span('thd', 'pad')}"
                     + (f"; {span('thd', 'pad-normal')}" if normal else "") + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="13")
    p.add_argument("--world-size", type=int, default=256)
    p.add_argument("--seq-lengths", type=int, nargs="+", default=sorted(LAYOUTS), choices=sorted(LAYOUTS))
    p.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--attention", default="transformer_engine", choices=ATTENTIONS,
                   help="the attention core priced (default: transformer-engine's, Megatron-LM's default layers)")
    p.add_argument("--fast-only", action="store_true", help="skip normal mode (minutes at 4K on one core)")
    args = p.parse_args(argv)
    rows = []
    for seq in args.seq_lengths:
        for layout in LAYOUTS[seq]:
            for mix in args.mixes:
                for batch in range(args.batches):
                    rows.append(price(args.model, args.world_size, seq, layout, mix, batch, not args.fast_only,
                                      args.attention))
                    print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
