"""What the recorder knows of each torch.distributed collective it wraps: how to read a call's
arguments into trace fields (:func:`describe`), what to return without calling the backend
(:func:`dry_result`), and what a fake backend's buffers should hold afterwards (:func:`fill`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron_dynapipe.tracer.tensor_sizes import dtype_name, is_tensor, tensor_bytes

__all__ = ["CollectiveSpec", "WRAPPED_COLLECTIVES", "REQUEST_KINDS", "describe", "dry_result", "fill", "DoneWork",
           "DoneCoalesced", "RecordedRequest"]

#: the backend's isend and irecv, whatever wraps them later (a batched op names its function)
ORIGINAL_ISEND, ORIGINAL_IRECV = c10d.isend, c10d.irecv


@dataclass(frozen=True)
class CollectiveSpec:
    kind: str  # op kind in the trace
    style: str  # how to read its arguments (see describe)


#: torch.distributed function -> (trace kind, argument style).
WRAPPED_COLLECTIVES: dict[str, CollectiveSpec] = {
    "all_reduce": CollectiveSpec("all_reduce", "inplace"),
    "broadcast": CollectiveSpec("broadcast", "rooted"),
    "reduce": CollectiveSpec("reduce", "rooted"),
    "all_gather": CollectiveSpec("all_gather", "gather_list"),
    "all_gather_into_tensor": CollectiveSpec("all_gather", "gather_tensor"),
    "_all_gather_base": CollectiveSpec("all_gather", "gather_tensor"),
    "reduce_scatter": CollectiveSpec("reduce_scatter", "scatter_list"),
    "reduce_scatter_tensor": CollectiveSpec("reduce_scatter", "scatter_tensor"),
    "_reduce_scatter_base": CollectiveSpec("reduce_scatter", "scatter_tensor"),
    "all_to_all_single": CollectiveSpec("all_to_all", "a2a_single"),
    "all_to_all": CollectiveSpec("all_to_all", "a2a_list"),
    "barrier": CollectiveSpec("barrier", "barrier"),
    "send": CollectiveSpec("send", "p2p"),
    "recv": CollectiveSpec("recv", "p2p"),
    "isend": CollectiveSpec("isend", "p2p"),
    "irecv": CollectiveSpec("irecv", "p2p"),
    "batch_isend_irecv": CollectiveSpec("batch_isend_irecv", "batch"),
}

#: the kinds that return requests to wait on (the recorder notes when they are waited)
REQUEST_KINDS = ("isend", "irecv", "batch_isend_irecv")


class DoneWork:
    """What a collective returns when the backend was not called: already complete."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self) -> None:
        return None

    def result(self) -> list:
        return []

    def get_future(self):
        future = torch.futures.Future()
        future.set_result([])
        return future


class DoneCoalesced:
    """Stand-in for ``_coalescing_manager``'s handle when the backend is not called."""

    def __init__(self) -> None:
        self.works: list = []

    def append(self, work) -> None:
        self.works.append(work)

    def wait(self) -> None:
        return None


class RecordedRequest:
    """A request whose waits go through ``waited(wait)``, which calls ``wait`` and may record
    it; everything else is the wrapped request's."""

    def __init__(self, work, waited: Callable[[Callable[[], Any]], Any]) -> None:
        self._work, self._waited = work, waited

    def wait(self, *args, **kwargs):
        return self._waited(lambda: self._work.wait(*args, **kwargs))

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def dry_result(spec: CollectiveSpec, a: dict):
    """What a collective returns when the backend is not called (meta tensors)."""
    if spec.style == "batch":
        return [DoneWork() for _ in a["p2p_op_list"]]
    if spec.kind in ("isend", "irecv"):
        return DoneWork()
    if spec.kind == "recv":
        return a.get("src")
    return DoneWork() if a.get("async_op") else None


def describe(spec: CollectiveSpec, a: dict, group_info: Callable) -> dict[str, Any]:
    """The trace fields of one call (``a``: its bound arguments): group, peer, shape, dtype,
    bytes (docs/trace_format.md says which buffer); ``group_info(group)`` gives (group, its
    global ranks, its name)."""
    style = spec.style
    if style == "batch":
        ops = a["p2p_op_list"]
        _, ranks, gname = group_info(ops[0].group if ops else None)
        parts = []
        for p2p in ops:
            fn = getattr(p2p.op, "__recorder_original__", p2p.op)
            kind = "isend" if fn is ORIGINAL_ISEND or fn is c10d.isend else "irecv"
            t = p2p.tensor
            parts.append({
                "kind": kind,
                "peer": int(p2p.peer),
                "shape": list(t.shape),
                "dtype": dtype_name(t.dtype),
                "bytes": tensor_bytes(t),
            })
        return {
            "group": ranks,
            "group_name": gname,
            "bytes": sum(p["bytes"] for p in parts),
            "parts": parts,
        }
    group, ranks, gname = group_info(a.get("group"))
    out: dict[str, Any] = {"group": ranks, "group_name": gname}
    size = len(ranks)
    if style == "inplace":
        t = a["tensor"]
    elif style == "rooted":
        t = a["tensor"]
        key, gkey = ("src", "group_src") if spec.kind == "broadcast" else ("dst", "group_dst")
        peer = a.get(key)
        if peer is None and a.get(gkey) is not None:
            peer = dist.get_global_rank(group, a[gkey])
        out["peer"] = peer
    elif style == "gather_list":
        t = a["tensor"]
        out.update(shape=(size, *t.shape), dtype=dtype_name(t.dtype), bytes=tensor_bytes(t) * size)
        return out
    elif style == "gather_tensor":
        t = a["output_tensor"]
    elif style == "scatter_list":
        t = a["output"]
        out.update(shape=(size, *t.shape), dtype=dtype_name(t.dtype), bytes=tensor_bytes(t) * size)
        return out
    elif style == "scatter_tensor":
        t = a["input"]
    elif style == "a2a_single":
        t = a["input"]
        ins, outs = a.get("input_split_sizes"), a.get("output_split_sizes")
        if ins is not None or outs is not None:
            out["splits"] = {
                "in": None if ins is None else [int(x) for x in ins],
                "out": None if outs is None else [int(x) for x in outs],
            }
    elif style == "a2a_list":
        tensors = a["input_tensor_list"]
        out.update(
            shape=(len(tensors),),
            dtype=dtype_name(tensors[0].dtype) if tensors else None,
            bytes=sum(tensor_bytes(x) for x in tensors),
        )
        return out
    elif style == "barrier":
        return out
    elif style == "p2p":
        t = a["tensor"]
        key, gkey = ("dst", "group_dst") if spec.kind in ("send", "isend") else ("src", "group_src")
        peer = a.get(key)
        if peer is None and a.get(gkey) is not None:
            peer = dist.get_global_rank(group, a[gkey])
        out["peer"] = peer
    else:  # pragma: no cover - every style is handled above
        raise AssertionError(style)
    out.update(shape=tuple(t.shape), dtype=dtype_name(t.dtype), bytes=tensor_bytes(t))
    return out


def _noise(t: torch.Tensor, generator: torch.Generator) -> None:
    if t.device.type == "meta":
        return
    if t.is_floating_point():
        noise = torch.randn(t.shape, generator=generator, dtype=torch.float32)
        t.copy_(noise.to(t.device))
    else:
        t.zero_()

def _is_sum(op) -> bool:
    return op is None or op == dist.ReduceOp.SUM

def fill(spec: CollectiveSpec, a: dict, generator: torch.Generator) -> None:
    """Leave in the call's buffers what a job of identical peers would (module docstring of
    :mod:`.recorder`, ``fill=True``); receives get seeded normal noise."""
    style = spec.style
    with torch.no_grad():
        if style == "batch":
            for p2p in a["p2p_op_list"]:
                fn = getattr(p2p.op, "__recorder_original__", p2p.op)
                if fn is ORIGINAL_IRECV or fn is c10d.irecv:
                    _noise(p2p.tensor, generator)
            return
        tensors = [v for v in a.values() if is_tensor(v)]
        if any(t.device.type == "meta" for t in tensors):
            return
        group = a.get("group")
        if style == "p2p":
            if spec.kind in ("recv", "irecv"):
                _noise(a["tensor"], generator)
        elif style == "inplace":
            if _is_sum(a.get("op")):
                a["tensor"].mul_(dist.get_world_size(group))
        elif style == "gather_list":
            for out in a["tensor_list"]:
                out.copy_(a["tensor"])
        elif style == "gather_tensor":
            out, inp = a["output_tensor"], a["input_tensor"]
            size = out.numel() // max(1, inp.numel())
            out.copy_(inp.reshape(1, -1).expand(size, -1).reshape(out.shape))
        elif style == "scatter_list":
            out = a["output"]
            out.copy_(a["input_list"][dist.get_rank(group)])
            if _is_sum(a.get("op")):
                out.mul_(dist.get_world_size(group))
        elif style == "scatter_tensor":
            out, inp = a["output"], a["input"]
            out.copy_(inp.reshape(-1, out.numel())[dist.get_rank(group)].reshape(out.shape))
            if _is_sum(a.get("op")):
                out.mul_(dist.get_world_size(group))
        elif style == "a2a_single":
            cycle_rows(a["output"], a["input"])
        elif style == "a2a_list":
            for out, inp in zip(a["output_tensor_list"], a["input_tensor_list"]):
                cycle_rows(out, inp)


def cycle_rows(out: torch.Tensor, inp: torch.Tensor) -> None:
    """Fill ``out`` with the rows of ``inp`` repeated (what a symmetric all-to-all delivers)."""
    if out.numel() == 0:
        return
    if inp.numel() == 0 or out.dim() == 0 or inp.dim() == 0 or out.shape[1:] != inp.shape[1:]:
        out.zero_()
        return
    index = torch.arange(out.shape[0], device=inp.device) % inp.shape[0]
    out.copy_(inp.index_select(0, index))
