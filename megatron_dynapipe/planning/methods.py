"""The ways a global batch can be trained, by one name each: Megatron-LM's own and DynaPipe's.

Every command that names methods reads this registry (``simulate``/``search``/``trace
--method``, ``plan``'s and ``bench planner``'s yardsticks, ``bench step``'s rows), so a method
has one name (as its users know it: ``dp_balanced`` is Megatron-LM's
``--sequence-packing-scheduler dp_balanced``) and one label in every report.

Megatron-LM's GPT data path cuts the documents into ``--seq-length`` windows (``megatron``,
``thd``); the whole-sample methods (``pad-to-max``, ``packing``, ``thd-whole``) are what a user
who keeps each sample whole runs, and what ``plan`` and ``bench step`` set DynaPipe against.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Method", "METHODS", "SEARCHED", "MEGATRON_PACKINGS", "PLANNED", "YARDSTICKS", "fast_label", "yardstick"]


@dataclass(frozen=True)
class Method:
    """One method: its name (``--method``), how reports call it, how its micro-batches hold their
    samples (``"pad"``: padded rows; ``"varlen"``: THD rows, each sample attending to itself;
    ``"leaky"``: rows whose samples attend to each other), whether DynaPipe's planner makes its
    plans (else it is Megatron-LM's own, on Megatron's schedule), whether it trains the samples
    whole or cut at ``--seq-length`` windows as Megatron-LM's GPT data path cuts them
    (:mod:`~megatron_dynapipe.planning.documents`), and whether ``simulate``/``search``/``trace``
    price it on traces (``searched``; the rest are ``plan``'s and ``bench step``'s)."""

    name: str
    label: str
    packing: str
    planned: bool
    documents: str = "whole"
    searched: bool = True

    @property
    def leaky(self) -> bool:
        """Its samples attend to each other: its loss differs from the others' by design."""
        return self.packing == "leaky"


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("megatron", "Megatron fixed shapes", "leaky", False, "cut"),
    Method("thd", "THD packing", "varlen", False, "cut"),
    Method("dp_balanced", "dp_balanced packing", "varlen", False),
    Method("dynapipe", "DynaPipe", "pad", True),
    Method("dynapipe-varlen", "DynaPipe varlen", "varlen", True),
    Method("dynapipe-cut", "DynaPipe varlen (cut)", "varlen", True, "cut"),
    # each sample its own row, padded to --seq-length
    Method("pad-to-max", "pad-to-max", "pad", False, searched=False),
    # whole samples first-fit into --seq-length rows, attending to each other
    Method("packing", "packing", "leaky", False, searched=False),
    # the same rows without that leakage (THD): the whole-sample twin of thd
    Method("thd-whole", "THD packing (whole)", "varlen", False, searched=False),
)}
#: the methods ``simulate``, ``search`` and ``trace --method`` price
SEARCHED: tuple[str, ...] = tuple(m.name for m in METHODS.values() if m.searched)
#: Megatron-LM's packed methods those commands set a planned method against at one layout
MEGATRON_PACKINGS: tuple[str, ...] = tuple(m.name for m in METHODS.values()
                                           if m.searched and not m.planned and m.packing == "varlen")
#: the methods DynaPipe's planner plans
PLANNED: tuple[str, ...] = tuple(m.name for m in METHODS.values() if m.planned)
#: what a plan of each packing (``TrainingSpec.packing``) is measured against by ``plan``
YARDSTICKS: dict[str, str] = {"pad": "packing", "varlen": "thd-whole"}


def yardstick(packing: str) -> Method:
    """The Megatron method a plan of this packing (``TrainingSpec.packing``) is measured against."""
    return METHODS[YARDSTICKS[packing]]


def fast_label(name: str) -> str:
    """A planned method's label in fast mode (``--fast-mode``): "DynaPipe (fast)"."""
    return f"{METHODS[name].label} (fast)"
