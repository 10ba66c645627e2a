"""The ways a global batch can be trained, by one name each: Megatron-LM's own and DynaPipe's.

Every command that names methods (``simulate``/``search --method``, ``trace --method``) reads
this registry, so a method has one name (as its users know it: ``dp_balanced`` is Megatron-LM's
``--sequence-packing-scheduler dp_balanced``) and one label in every report.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Method", "METHODS", "MEGATRON_PACKINGS", "PLANNED"]


@dataclass(frozen=True)
class Method:
    """One method: its name (``--method``), how reports call it, how its micro-batches hold their
    samples (``"pad"``: padded rows; ``"varlen"``: THD rows, each sample attending to itself;
    ``"leaky"``: rows whose samples attend to each other), whether DynaPipe's planner makes its
    plans (else it is Megatron-LM's own, on Megatron's schedule), and whether it trains the samples
    whole or cut at ``--seq-length`` windows as Megatron-LM's GPT data path cuts them
    (:mod:`~megatron_dynapipe.planning.documents`)."""

    name: str
    label: str
    packing: str
    planned: bool
    documents: str = "whole"


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("megatron", "Megatron fixed shapes", "leaky", False, "cut"),
    Method("thd", "THD packing", "varlen", False, "cut"),
    Method("dp_balanced", "dp_balanced packing", "varlen", False),
    Method("dynapipe", "DynaPipe", "pad", True),
    Method("dynapipe-varlen", "DynaPipe varlen", "varlen", True),
    Method("dynapipe-cut", "DynaPipe varlen (cut)", "varlen", True, "cut"),
)}
#: Megatron-LM's packed methods, the yardsticks a planned method is set against at one layout
MEGATRON_PACKINGS: tuple[str, ...] = tuple(m.name for m in METHODS.values() if not m.planned and m.packing == "varlen")
#: the methods DynaPipe's planner plans
PLANNED: tuple[str, ...] = tuple(m.name for m in METHODS.values() if m.planned)
