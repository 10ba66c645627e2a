"""Shapes-only tracing: every tensor on PyTorch's ``meta`` device, so that megatron-core issues
every op of a model too large for this machine with its real shapes while nothing allocates."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_dynapipe.compat.cpu_compat import cuda_type_name
from megatron_dynapipe.compat.patching import Patches, UpstreamChanged

__all__ = ["MetaMode"]


_FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint,
    torch.randperm, torch.arange, torch.linspace, torch.eye, torch.tensor, torch.as_tensor,
    torch.empty_strided, torch.scalar_tensor,
}
#: integer tensors these build from Python values are routing/split metadata (e.g. the MoE
#: dispatcher's per-expert capacities): they keep their values, on the CPU
_VALUE_FACTORIES = {torch.full, torch.tensor, torch.as_tensor}
_MAX_HOST_METADATA = 1 << 16
_ITEM_METHODS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
                 torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


class MetaMode(TorchFunctionMode):
    """Every tensor a factory creates or a device move produces lands on ``meta``; 0-dim
    factory results stay on the CPU (scalars such as Adam's step count keep real values), and so
    do small integer tensors built from Python values (``torch.full``/``torch.tensor``: split
    sizes and capacities, which must keep their values);
    reading a value back from a meta tensor (``.item()``, ``.tolist()``, ``bool()``) answers 0;
    boolean-mask assignment on a meta tensor becomes ``masked_fill_`` (same shape, no data)."""

    #: torch.distributed helpers that pickle Python objects into real byte tensors: they run
    #: with the mode suspended (megatron's optimizer compares parameter-group keys this way).
    OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object",
                          "scatter_object_list", "send_object_list", "recv_object_list")

    def __init__(self) -> None:
        super().__init__()
        self._suspended = 0
        self._patches = Patches()

    def __enter__(self):
        import torch.distributed.distributed_c10d as c10d

        self._patches.rebind({original: self._suspending(original)
                              for original in filter(None, (getattr(c10d, name, None)
                                                            for name in self.OBJECT_COLLECTIVES))},
                             where=lambda module: module in ("torch.distributed", c10d.__name__))
        engine = getattr(torch.autograd, "_engine_run_backward", None)
        if engine is None:
            raise UpstreamChanged("torch.autograd no longer calls _engine_run_backward; review "
                                  "megatron_dynapipe/tracer/meta_mode.py MetaMode._engine_in_mode")
        self._patches.set(torch.autograd, "_engine_run_backward", self._engine_in_mode(engine))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.undo()

    def _engine_in_mode(self, run_backward):
        """``torch.autograd.backward`` and ``grad`` reach this mode first, and torch takes a mode
        off its stack while the mode handles a call: the autograd engine would then run backward
        functions (activation recompute, sequence parallelism's all-gather) without the mode, and
        their factories would allocate on the CPU.  The engine runs with the mode put back."""
        from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

        @functools.wraps(run_backward)
        def run_backward_in_mode(*args, **kwargs):
            if self in _get_current_function_mode_stack():
                return run_backward(*args, **kwargs)
            _push_mode(self)
            try:
                return run_backward(*args, **kwargs)
            finally:
                _pop_mode()

        return run_backward_in_mode

    def _suspending(self, original):
        @functools.wraps(original)  # keeps the signature readable (fake_groups checks it)
        def run_unsuspended(*args, **kwargs):
            self._suspended += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._suspended -= 1

        return run_unsuspended

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._suspended:
            return func(*args, **kwargs)
        if func in _FACTORIES:
            result = func(*args, **dict(kwargs, device="meta"))
            if result.dim() == 0 or (
                func in _VALUE_FACTORIES
                and not result.is_floating_point()
                and result.numel() <= _MAX_HOST_METADATA
            ):
                return func(*args, **dict(kwargs, device="cpu"))
            return result
        if func in _MOVES:
            return self._move(func, args, kwargs)
        if func in _ITEM_METHODS and _is_meta(args[0]):
            t = args[0]
            if func is torch.Tensor.tolist:
                return torch.zeros(t.shape, dtype=t.dtype, device="cpu").tolist()
            if func is torch.Tensor.__bool__:
                return False
            return 0.0 if t.is_floating_point() and func is not torch.Tensor.__index__ else 0
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and _is_meta(args[0]):
            return cuda_type_name(args[0])
        if func is torch.Tensor.__setitem__ and _is_meta(args[0]):
            index = args[1]
            if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
                value = args[2]
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    return None  # a data-dependent number of values: nothing to write on meta
                args[0].masked_fill_(index.to("meta"), value)
                return None
        return func(*args, **kwargs)


    @staticmethod
    def _move(func, args, kwargs):
        """``.to(device)``, ``.cuda()``, ``.cpu()``: a real CPU tensor that stays on the host
        (``.cpu()``, ``.to("cpu")``) or is a scalar keeps its values; everything else goes to
        meta, where a meta tensor stays."""
        t = args[0]
        if func is torch.Tensor.cpu:
            return t
        if func is torch.Tensor.cuda:
            return t if _is_meta(t) or t.dim() == 0 else t.to("meta")
        target = kwargs.get("device")
        rest = []
        for a in args[1:]:
            if _is_device(a) and target is None:
                target = a
            else:
                rest.append(a)
        if target is None:  # .to(dtype) or .to(other_tensor)
            return func(*args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        to_cpu = torch.device(target).type == "cpu" if not isinstance(target, int) else False
        keep_host = t.device.type == "cpu" and (to_cpu or t.dim() == 0)
        return func(t, "cpu" if keep_host else "meta", *rest, **kwargs)


def _is_device(x: Any) -> bool:
    if isinstance(x, torch.device):
        return True
    if isinstance(x, str):
        return x.split(":")[0] in ("cpu", "cuda", "meta")
    return isinstance(x, int) and not isinstance(x, bool)
