"""Costs interpolated from a profile: what ``megatron-dynapipe profile`` measured on a device
(or the DynaPipe authors' published A100 table), read through :mod:`.profile_file`."""

from __future__ import annotations

import math
import os
from typing import Mapping

import numpy as np

from megatron_dynapipe.config.model import ModelSpec, padded_vocab_size
from megatron_dynapipe.planning.cost_model import profile_file
from megatron_dynapipe.planning.cost_model.base import (
    KINDS,
    LAYERS,
    MB,
    PARAM_LAYERS,
    PHASES,
    TIMED,
    CostModel,
    CostModelError,
    as_recompute,
    check_choice,
    full_inf,
    is_scalar,
)
from megatron_dynapipe.planning.cost_model.grid import Grid, GridStack
from megatron_dynapipe.planning.cost_model.link import Link
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["ProfiledCostModel"]


class ProfiledCostModel(CostModel):
    """Costs interpolated from a profile (docs/cost_model.md).

    Within a profiled sequence length, cost is linear in the micro-batch size between profiled
    sizes; between two profiled sequence lengths it is linear in the sequence length. Shorter
    sequences than the shortest profiled cost as much as the shortest; longer sequences than the
    longest profiled, and micro-batches larger than a bracketing row profiled, are ``inf``.
    A recompute type absent from the profile is ``inf`` everywhere.  Where the profile measured
    the encoder on packed rows, :meth:`packed` prices packed micro-batches from those.  Where it
    measured the encoder on context-parallel groups (``cp_measured``: (cp, layout, phase or kind,
    recompute) -> {(seqlen, mbs): ms or MB}), :meth:`context_parallel_encoder` hands those of the rows
    it prices (``cp_layout``) to the :class:`~.context_parallel.ContextParallelCostModel` around it.
    """

    def __init__(
        self,
        *,
        tp: int,
        hidden_size: int,
        times: dict[tuple[str, str, RecomputeType], Grid],
        memory: dict[tuple[str, RecomputeType], Grid],
        params_mb: dict[str, float],
        name: str = "",
        metadata: dict | None = None,
        microbatch_overhead: Mapping[tuple[str, str], tuple[float, float]] | None = None,
        document: Mapping | None = None,
        packed_times: dict[tuple[str, str, RecomputeType], Grid] | None = None,
        packed_memory: dict[tuple[str, RecomputeType], Grid] | None = None,
        core_times: Mapping[str, Grid] | None = None,
        cp_measured: Mapping[tuple, Mapping[tuple[int, int], float]] | None = None,
        cp_layout: str = "padded",
        packed_segment_ms: Mapping[tuple[str, RecomputeType], float] | None = None,
    ):
        self.tp = int(tp)
        self.hidden_size = int(hidden_size)
        self.name = name
        self.metadata = dict(metadata or {})  # what `megatron-dynapipe profile` records: model, dtype, device
        self._times = dict(times)
        self._memory = dict(memory)
        self._params = dict(params_mb)
        self.microbatch_overhead = dict(microbatch_overhead or {})
        self.recompute_types = tuple(sorted({rc for _, _, rc in self._times}))
        self._stacks: dict[tuple, GridStack | None] = {}  # by tuple of recompute types, built on first use
        self._document = None if document is None else dict(document)  # the file it came from, for to_document
        self._packed_times = dict(packed_times or {})  # the encoder on packed rows, where measured
        self._packed_memory = dict(packed_memory or {})
        self._core_times = dict(core_times or {})  # phase -> the attention core alone, where measured
        self.prices_attention_core = bool(self._core_times)
        self._cp_measured = dict(cp_measured or {})
        self._cp_layout = cp_layout
        # (phase, recompute) -> ms a layer adds per segment of a packed row (packed_segment_costs);
        # padded micro-batches run no segments beyond their rows, so only packed ones pay it
        self._packed_segment_ms = dict(packed_segment_ms or {})

    def describe(self) -> str:
        model = self.metadata.get("model") or {}
        measured = (f", layers measured on a {model['num_layers']}-layer model" if model.get("num_layers") else "")
        where = ", ".join(str(v) for v in (self.metadata.get("device"), self.metadata.get("dtype")) if v)
        device = f" ({where})" if where else ""
        return f"profile {self.name!r}{device}, hidden {self.hidden_size}, tp {self.tp}{measured}"

    def __repr__(self) -> str:
        kinds = ", ".join(rc.label for rc in self.recompute_types)
        return f"ProfiledCostModel({self.name!r}, tp={self.tp}, recompute: {kinds})"

    def shape_costs(self, types, mbs, seqlen):
        types = tuple(types)
        if types not in self._stacks:  # grids in the returned order: per type, 6 times then 2 memories
            self._stacks[types] = GridStack.of([grid for rc in types for grid in (
                *(self._times.get((layer, phase, rc)) for layer, phase in TIMED),
                *(self._memory.get((kind, rc)) for kind in KINDS))])
        stack = self._stacks[types]
        if stack is None or is_scalar(seqlen):  # scalar sequence lengths take the grids' own fast paths
            return super().shape_costs(types, mbs, seqlen)
        values = stack.general(np.asarray(mbs, dtype=float), np.asarray(seqlen, dtype=float))
        return values.reshape((len(types), len(TIMED) + len(KINDS)) + values.shape[1:])

    def packed(self) -> "ProfiledCostModel":
        """This profile with the encoder's times and memory of packed rows in place of padded ones,
        for the recompute types measured so; itself where none were. Packed micro-batches query at
        their :func:`~megatron_dynapipe.planning.types.packed_cost_shape`, which for a row of
        ``mbs`` samples of ``seqlen`` tokens each is ``(mbs, seqlen)``: the point it was measured at."""
        if not self._packed_times:
            return self
        return ProfiledCostModel(
            tp=self.tp, hidden_size=self.hidden_size, times={**self._times, **self._packed_times},
            memory={**self._memory, **self._packed_memory}, params_mb=self._params, name=self.name,
            metadata=self.metadata, microbatch_overhead=self.microbatch_overhead, document=self._document,
            core_times=self._core_times, cp_measured=self._cp_measured, cp_layout="thd",
            packed_segment_ms=self._packed_segment_ms)

    def segment_ms(self, phase, recompute):
        return self._packed_segment_ms.get((phase, as_recompute(recompute)), 0.0)

    def measured_points(self, recompute) -> list[tuple[int, int]]:
        """The (seqlen, mbs) the encoder's padded rows were measured at under ``recompute``: each
        row's micro-batch sizes of the grid up to its largest."""
        grid = self._times.get(("encoder", "forward", as_recompute(recompute)))
        if grid is None:
            return []
        return [(int(s), int(m)) for s, top in zip(grid.S, grid.max_mbs) for m in grid.M if m <= top]

    def context_parallel_encoder(self, cp):
        return {(what, rc): points for (c, layout, what, rc), points in self._cp_measured.items()
                if c == cp and layout == self._cp_layout}

    def layer_ms(self, layer, phase, recompute, mbs, seqlen):
        rc = as_recompute(recompute)
        grid = self._times.get((layer, phase, rc))
        if grid is None:
            check_choice("layer", layer, LAYERS)
            check_choice("phase", phase, PHASES)
            return full_inf(mbs, seqlen)
        return grid(mbs, seqlen)

    def attention_core_ms(self, phase, recompute, mbs, seqlen):
        """A causal attention core's worth of the blocks context parallelism's ring adds: half of the
        core measured without a mask (a causal core's pairs of queries and keys, at the rate of the
        ring's unmasked blocks; in backward, the forward again where ``recompute`` reruns the core)."""
        check_choice("phase", phase, PHASES)
        if not self.prices_attention_core:
            raise CostModelError(f"{self.describe()} did not measure the attention core alone: profile again with "
                                 "this megatron-dynapipe, or price the core from the GPT's shape (split_over_cp)")
        ms = self._core_times[phase](mbs, seqlen)
        if phase == "backward" and as_recompute(recompute) != RecomputeType.NONE:
            ms = ms + self._core_times["forward"](mbs, seqlen)
        return 0.5 * ms

    def activation_mb(self, kind, recompute, mbs, seqlen):
        rc = as_recompute(recompute)
        grid = self._memory.get((kind, rc))
        if grid is None:
            check_choice("activation kind", kind, KINDS)
            return full_inf(mbs, seqlen)
        return grid(mbs, seqlen)

    def vocab_per_rank(self) -> float:
        model = self.metadata.get("model") or {}
        if not model.get("vocab_size"):  # a profile that records no model (the shipped A100 one)
            return super().vocab_per_rank()
        divisible_by = model.get("make_vocab_size_divisible_by") or ModelSpec.make_vocab_size_divisible_by
        return padded_vocab_size(model["vocab_size"], divisible_by, self.tp) / self.tp

    def param_mb(self, layer):
        try:
            return self._params[layer]
        except KeyError:
            check_choice("parameter layer", layer, PARAM_LAYERS)
            raise

    @classmethod
    def from_json(cls, path, tp: int, *, hidden_size: int | None = None) -> "ProfiledCostModel":
        """Load the profile of tensor-parallel size ``tp`` from a JSON file.

        ``hidden_size`` (for p2p message sizes) comes from this argument, else from the file's
        optional ``hidden_size`` key, else it is estimated from the encoder parameter memory.
        """
        path = os.fspath(path)
        return cls.from_document(profile_file.read_complete_document(path), tp, source=path, hidden_size=hidden_size)

    @classmethod
    def from_document(cls, doc, tp: int, *, source: str, hidden_size: int | None = None) -> "ProfiledCostModel":
        """The profile of tensor-parallel size ``tp`` in a measured profile's JSON object."""
        if profile_file.is_calibrated(doc):
            raise CostModelError(f"cost model file {source} is a calibrated analytical model, not a measured "
                                 "profile: load it with load_cost_model")
        records = profile_file.ProfileRecords.from_document(doc, source)
        Link.of(profile_file.metadata_of(doc) or {}, source)  # a bad link record is refused here, not mid-plan
        tp = int(tp)
        available = records.tps()
        if tp not in available:
            listed = ", ".join(str(t) for t in sorted(available)) or "none"
            raise CostModelError(
                f"cost model {source} has no profile for tp={tp} (profiled: {listed}): choose one "
                "of those tensor-parallel sizes or profile this one"
            )
        times, memory, params = records.tables(tp, source)
        packed_times, packed_memory = records.packed_tables(tp)
        if hidden_size is None:
            hidden_size = profile_file.hidden_size_of(doc, source)
        if hidden_size is None:
            hidden_size = _estimate_hidden_size(params["encoder"], tp)
        return cls(
            tp=tp,
            hidden_size=hidden_size,
            times={k: Grid(v) for k, v in times.items()},
            memory={k: Grid(v) for k, v in memory.items()},
            params_mb=params,
            name=str(doc.get("name", os.path.basename(source))),
            metadata=profile_file.metadata_of(doc),
            microbatch_overhead=records.overhead.get(tp, {}),
            document=dict(doc, hidden_size=hidden_size),
            packed_times={k: Grid(v) for k, v in packed_times.items()},
            packed_memory={k: Grid(v) for k, v in packed_memory.items()},
            core_times={phase: Grid(v) for phase, v in records.core_tables(tp).items()},
            cp_measured=records.cp_tables(tp),
            packed_segment_ms=packed_segment_costs(times, packed_times),
        )

    def to_document(self) -> dict:
        if self._document is None:
            return super().to_document()  # built from grids in code: no file to give
        return self._document


def packed_segment_costs(times: Mapping, packed_times: Mapping) -> dict[tuple[str, RecomputeType], float]:
    """(phase, recompute) -> what a layer adds per segment of a packed row, from points measured
    both ways: a packed row of ``mbs`` samples of ``seqlen`` tokens does the work of ``mbs`` padded
    rows of them, so the packed time less the padded one, over the ``mbs - 1`` segments beyond the
    first, is the core's cost per segment (the median over the points, at least 0; the SDPA core
    on the CPU runs a row's samples one by one, at about 0.1 ms each a layer and phase for the tiny
    GPT). Nothing where packed rows were not measured."""
    found = {}
    for (layer, phase, rc), packed in packed_times.items():
        padded = times.get((layer, phase, rc), {})
        per_segment = [(ms - padded[point]) / (point[1] - 1) for point, ms in packed.items()
                       if point[1] > 1 and point in padded]
        if layer == "encoder" and per_segment:
            found[phase, rc] = max(0.0, float(np.median(per_segment)))
    return found


def _estimate_hidden_size(encoder_param_mb: float, tp: int) -> int:
    """Hidden size of a GPT layer with a 4h FFN (about 12 h^2 parameters) from its 16-bit
    parameter MB at ``tp``, rounded to a multiple of 256."""
    params = encoder_param_mb * MB / 2 * tp
    return max(256, int(round(math.sqrt(params / 12) / 256)) * 256)


