"""Sizes and identities of tensors, meta tensors included (they have shapes, not data)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tensor_bytes", "storage_key", "dtype_name", "is_tensor"]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def storage_key(t: torch.Tensor) -> tuple[int, Any]:
    """An id of the storage ``t`` views (shared by all its views; works for meta tensors), and
    the object that keeps it alive: an id is unique only while its storage lives, so whoever keeps
    ids must keep that object too (a freed storage's address is soon reused)."""
    try:
        storage = t.untyped_storage()
        return storage._cdata, storage
    except Exception:  # tensor subclasses without a plain storage
        return id(t), t


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)
