"""Activation memory a traced rank holds, counted from what autograd saves for backward."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

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
    Transient buffers that are freed within the forward or the backward, and tensors a custom
    autograd function stashes on ``ctx`` without ``save_for_backward``, are not counted.
    Works on meta tensors (it reads sizes, not data).
    """

    def __init__(self) -> None:
        self.static: dict[int, Any] = {}  # storage id -> the storage, kept alive with its id
        self.live = 0
        self.peak_bytes = 0
        self.peak_in_flight = 0
        self.per_microbatch: dict[Any, int] = {}
        self.enabled = True

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

    @contextlib.contextmanager
    def forward(self, key) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        seen: dict[int, Any] = {}  # as static: held until the forward ends, so no id is reused
        total = [0]

        def pack(t):
            k, storage = storage_key(t)
            if k not in self.static and k not in seen:
                seen[k] = storage
                try:
                    total[0] += t.untyped_storage().nbytes()
                except Exception:
                    total[0] += tensor_bytes(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.per_microbatch[key] = self.per_microbatch.get(key, 0) + total[0]
        self.live += total[0]
        if self.live > self.peak_bytes:
            self.peak_bytes = self.live
        self.peak_in_flight = max(self.peak_in_flight, len(self.per_microbatch))

    def backward_done(self, key) -> None:
        self.live -= self.per_microbatch.pop(key, 0)
