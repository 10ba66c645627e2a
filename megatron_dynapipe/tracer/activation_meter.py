"""Activation memory a traced rank holds, counted from what autograd saves for backward."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional

import torch

from megatron_dynapipe.tracer.tensor_sizes import is_tensor, storage_key, tensor_bytes

__all__ = ["ActivationMeter"]


class ActivationMeter:
    """Activation bytes a rank holds, counted from what autograd saves for backward.

    Around each micro-batch forward a ``saved_tensors_hooks`` pair sees every tensor autograd
    keeps for the backward pass; the bytes of their distinct storages (parameters, gradient
    buffers and optimizer state excluded: they are registered with :meth:`set_static`) are that
    micro-batch's activations, held until its backward finishes.  ``peak_bytes`` is the largest
    sum over forward passes in flight at once (1F1B keeps up to ``pp - stage`` micro-batches;
    interleaving counts each micro-batch once per model chunk it has passed).
    Transient buffers that are freed within the forward or the backward, saved tensors no longer
    held when the forward ends (a graph built and dropped inside it), and tensors a custom
    autograd function stashes on ``ctx`` without ``save_for_backward``, are not counted.
    Works on meta tensors (it reads sizes, not data).

    :meth:`probe` measures what one module saves of that: a transformer layer, its attention
    core, the layer's input, which is what activation recomputation would keep or free
    (``probes``: label -> bytes of one call, the largest seen).
    """

    def __init__(self) -> None:
        self.static: dict[int, Any] = {}  # storage id -> the storage, kept alive with its id
        self.live = 0
        self.peak_bytes = 0
        self.peak_in_flight = 0
        self.per_microbatch: dict[Any, int] = {}
        self.probes: dict[str, int] = {}
        self.enabled = True
        self._saved = 0  # bytes counted so far in the forward under way

    def set_static(self, tensors) -> None:
        for t in tensors:
            if is_tensor(t):
                key, storage = storage_key(t)
                self.static[key] = storage

    def reset(self) -> None:
        self.live = 0
        self.peak_bytes = 0
        self.peak_in_flight = 0
        self.per_microbatch.clear()
        self.probes.clear()

    def probe(self, module, label: str, input_label: Optional[str] = None, inputs: int = 1) -> None:
        """Count under ``label`` the bytes ``module``'s forward saves for backward, and under
        ``input_label`` the bytes of the distinct storages of its first ``inputs`` tensor arguments
        (positional, then keyword) (a layer's hidden states; an attention core's query, key and value)."""
        started: list[int] = []

        def before(_module, args, kwargs):
            started.append(self._saved)
            if input_label:
                given = [a for a in (*args, *kwargs.values()) if is_tensor(a)]
                sizes = {storage_key(a)[0]: _storage_bytes(a) for a in given[:inputs]}
                self._keep(input_label, sum(sizes.values()))

        def after(_module, _args, _output):
            if started:
                self._keep(label, self._saved - started.pop())

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after)

    def _keep(self, label: str, nbytes: int) -> None:
        if self.enabled:
            self.probes[label] = max(self.probes.get(label, 0), int(nbytes))

    @contextlib.contextmanager
    def forward(self, key) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        seen: dict[int, Any] = {}  # as static: held until the forward ends, so no id is reused
        sizes: dict[int, int] = {}
        saved: list[tuple[int, weakref.ref]] = []
        self._saved = 0

        def pack(t):
            k, storage = storage_key(t)
            if k not in self.static:
                saved.append((k, weakref.ref(t)))
                if k not in seen:
                    seen[k] = storage
                    sizes[k] = _storage_bytes(t)
                    self._saved += sizes[k]
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        # a graph built and dropped inside the forward (megatron's bias-dropout-add runs under
        # enable_grad inside a recomputed layer's no_grad forward) keeps nothing
        total = sum(sizes[k] for k in {k for k, ref in saved if ref() is not None})
        self.per_microbatch[key] = self.per_microbatch.get(key, 0) + total
        self.live += total
        if self.live > self.peak_bytes:
            self.peak_bytes = self.live
        self.peak_in_flight = max(self.peak_in_flight, len(self.per_microbatch))

    def backward_done(self, key) -> None:
        self.live -= self.per_microbatch.pop(key, 0)


def _storage_bytes(t) -> int:
    """Bytes of the storage ``t`` views (of ``t`` itself for tensor subclasses without one)."""
    try:
        return t.untyped_storage().nbytes()
    except Exception:
        return tensor_bytes(t)
