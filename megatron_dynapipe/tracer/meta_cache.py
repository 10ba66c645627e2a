"""Remember what meta kernels answer: shapes-only tracing runs the same ops on the same shapes.

A shapes-only trace runs every micro-batch of every layer of a stage on meta tensors; their
shapes repeat exactly, yet torch works each answer out again, many through Python reference
implementations (a layer norm's backward is about a millisecond of Python on meta).
:class:`MetaKernelCache` is a dispatch mode that keys each call by its operator and the shapes,
strides and dtypes of its meta tensor arguments (plus its other, hashable, arguments) and, when
it has seen the key, makes fresh meta tensors of the remembered layout instead of calling the
kernel.

Only calls whose answer is a pure function of that key are remembered: every tensor argument on
meta, no argument written to and no result aliasing an argument (by the operator's schema), and
results that are meta tensors (or tuples of them, or None).  Everything else runs as usual.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MetaKernelCache"]

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _arg_key(value: Any) -> Any:
    """A hashable stand-in for one argument, or raise TypeError when there is none."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta":
            raise TypeError("not a meta tensor")
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.storage_offset())
    if isinstance(value, _SCALARS):
        return (type(value), value)  # 1, 1.0 and True hash alike; their results may not
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_arg_key(v) for v in value))
    raise TypeError(f"unkeyable {type(value).__name__}")


def _pure(func) -> bool:
    """The operator writes none of its arguments and returns no view of them."""
    schema = func._schema
    if any(a.alias_info is not None for a in schema.arguments):
        return False
    return all(r.alias_info is None for r in schema.returns)


def _layout(result: Any) -> Any:
    """The remembered form of a result: per tensor its shape, strides and dtype."""
    if isinstance(result, torch.Tensor):
        if result.device.type != "meta" or result.storage_offset() != 0:
            raise TypeError("not a fresh meta tensor")
        return ("T", tuple(result.shape), result.stride(), result.dtype)
    if result is None:
        return ("N",)
    if isinstance(result, (tuple, list)):
        return ("S", tuple(_layout(r) for r in result))
    raise TypeError(f"unremembered {type(result).__name__}")


def _rebuild(layout: tuple) -> Any:
    kind = layout[0]
    if kind == "T":
        _, shape, stride, dtype = layout
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    if kind == "S":
        return tuple(_rebuild(item) for item in layout[1])
    return None


class MetaKernelCache(TorchDispatchMode):
    """Answer repeated pure meta-kernel calls from memory (see the module's docstring).

    ``hits`` and ``misses`` count the calls answered from memory and those that ran the kernel
    and were remembered; calls that cannot be remembered count in neither.
    """

    def __init__(self) -> None:
        super().__init__()
        self._answers: dict[Any, Any] = {}
        self._rememberable: dict[Any, bool] = {}  # per operator
        self.hits = 0
        self.misses = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = self._key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        layout = self._answers.get(key)
        if layout is not None:
            self.hits += 1
            return _rebuild(layout)
        result = func(*args, **kwargs)
        try:
            self._answers[key] = _layout(result)
            self.misses += 1
        except TypeError:
            self._rememberable[func] = False  # e.g. returns a number or a CPU tensor: never remember it
        return result

    def _key(self, func, args, kwargs) -> Optional[tuple]:
        rememberable = self._rememberable.get(func)
        if rememberable is None:
            rememberable = self._rememberable[func] = _pure(func)
        if not rememberable:
            return None
        if not any(isinstance(a, torch.Tensor) for a in args):
            return None  # factories: cheap already, and their device comes from the arguments
        try:
            return (func, _arg_key(args), _arg_key(tuple(sorted(kwargs.items()))))
        except TypeError:
            return None
