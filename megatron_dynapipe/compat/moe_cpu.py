"""megatron-core's mixture-of-experts layers on a machine without CUDA or Transformer Engine,
beyond :mod:`.cpu_compat` (which the caller enables too).

Each place is a :class:`~.patching.Spot`, checked against the installed megatron-core before
:func:`moe_on_cpu` changes anything, and put back on exit:

* the router's gating function tests ``te_general_gemm is not None``, a name that is only defined
  when Transformer Engine imports (NameError otherwise): it is defined as None;
* the all-to-all dispatcher turns its split sizes into numpy arrays only for CUDA tensors
  (``maybe_move_tensor_to_cpu(..., as_numpy=True)`` checks ``tensor.is_cuda``); on CPU they stay
  tensors, which ``all_to_all_single`` refuses: CPU tensors are converted too;
* the dispatcher creates a ``torch.cuda.Stream()`` and waits on it to overlap the routing counts'
  device-to-host copies: on CPU those copies are synchronous, so streams that do nothing stand in.

The router also moves its weights with ``.to(device=torch.cuda.current_device())`` and the aux-loss
tracker allocates on ``device="cuda"``: the caller builds the model and runs the forward/backward
passes inside ``cpu_compat.cuda_as_cpu()`` (not the optimizer step: nested scopes would rename a
grad's type twice, ``torch.cuda.cuda.FloatTensor``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megatron_dynapipe.compat.cpu_compat import CPU_STREAM_STANDINS
from megatron_dynapipe.compat.patching import Patches, Spot, check_spots

__all__ = ["MOE_CPU_SPOTS", "moe_on_cpu"]

REVIEW = "megatron_dynapipe/compat/moe_cpu.py"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


def _numpy_splits_on_cpu(original):
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


MOE_CPU_SPOTS: tuple[Spot, ...] = (
    Spot(_MOE_UTILS, "RouterGatingLinearFunction.forward", ("te_general_gemm is not None",),
         "uses te_general_gemm when it is not None: a name only Transformer Engine's import defines"),
    Spot(_MOE_UTILS, "maybe_move_tensor_to_cpu", ("tensor.is_cuda", "as_numpy"),
         "makes numpy split sizes of CUDA tensors only", kind="replace", replacement=_numpy_splits_on_cpu),
    Spot(_DISPATCHER, "MoEAlltoAllTokenDispatcher.__init__", ("torch.cuda.Stream()",),
         "creates a side CUDA stream for the routing counts' device-to-host copies"),
    Spot(_DISPATCHER, "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
         ("torch.cuda.current_stream()", "torch.cuda.stream(self.cuda_dtoh_stream)"),
         "waits on that stream and copies on it"),
)


@contextlib.contextmanager
def moe_on_cpu() -> Iterator[None]:
    """Within: megatron-core's MoE layers run on the CPU (module docstring)."""
    from megatron.core.transformer.moe import moe_utils

    resolved = check_spots(MOE_CPU_SPOTS, REVIEW)
    with Patches() as patches:
        if "te_general_gemm" not in vars(moe_utils):
            patches.set(moe_utils, "te_general_gemm", None)
        for spot, owner, name, original in resolved:
            if spot.kind == "replace":
                patches.replace(owner, name, spot.replacement(original))
        for name, standin in CPU_STREAM_STANDINS.items():
            patches.set(torch.cuda, name, standin)
        yield
