"""Where and in what precision a GPT runs: the ``--bf16``/``--fp16``/``--device`` flags of the
commands that build one (``profile``, ``bench step``) and torch's dtypes by name.  Profiles name
dtypes ``fp32``/``bf16``/``fp16`` and traces ``float32``/``bfloat16``/``float16``; both are read
here.  Imports torch when a dtype or device is resolved."""

from __future__ import annotations

__all__ = ["PROFILE_DTYPES", "TRACE_DTYPES", "torch_dtype", "add_device_arguments", "resolve_device"]

PROFILE_DTYPES = ("fp32", "bf16", "fp16")
TRACE_DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str):
    """torch's dtype of a profile's or a trace's dtype name."""
    import torch

    by_name = dict(zip(PROFILE_DTYPES + TRACE_DTYPES, (torch.float32, torch.bfloat16, torch.float16) * 2))
    try:
        return by_name[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: use one of {', '.join(by_name)}") from None


def add_device_arguments(p, verb: str) -> None:
    """``--bf16``/``--fp16`` (``args.dtype``, fp32 without either) and ``--device``; read back
    with :func:`resolve_device`."""
    dtype = p.add_mutually_exclusive_group()
    dtype.add_argument("--bf16", action="store_const", dest="dtype", const="bf16", help="bfloat16 (default fp32)")
    dtype.add_argument("--fp16", action="store_const", dest="dtype", const="fp16", help="float16 (default fp32)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help=f"where to {verb} (default: cuda when there is one, else cpu)")
    p.set_defaults(dtype="fp32")


def resolve_device(choice: str) -> str:
    """``--device``'s choice as "cuda" or "cpu"; "cuda" without a CUDA device is refused."""
    import torch

    device = choice if choice != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch sees no CUDA device; use --device cpu")
    return device
