"""megatron-core's MoE layers on the CPU: the spots hold for the installed megatron-core, and the
shims are in place only inside ``moe_on_cpu``."""

import torch

from megatron_dynapipe.compat.cpu_compat import CpuStream
from megatron_dynapipe.compat.moe_cpu import MOE_CPU_SPOTS, REVIEW, moe_on_cpu
from megatron_dynapipe.compat.patching import check_spots


def test_every_moe_spot_matches_installed_megatron_core():
    assert len(check_spots(MOE_CPU_SPOTS, REVIEW)) == len(MOE_CPU_SPOTS)


def test_the_shims_live_only_inside_the_scope():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    had_gemm = "te_general_gemm" in vars(moe_utils)
    move, stream = moe_utils.maybe_move_tensor_to_cpu, torch.cuda.Stream
    counts = torch.tensor([3, 1])
    with moe_on_cpu():
        assert moe_utils.te_general_gemm is None or had_gemm
        # split sizes the dispatcher asks for as numpy come as numpy from CPU tensors too
        assert token_dispatcher.maybe_move_tensor_to_cpu(counts, as_numpy=True).tolist() == [3, 1]
        assert isinstance(torch.cuda.Stream(), CpuStream) and torch.cuda.current_stream() == CpuStream()
    assert moe_utils.maybe_move_tensor_to_cpu is move and torch.cuda.Stream is stream
    assert ("te_general_gemm" in vars(moe_utils)) == had_gemm
    assert torch.is_tensor(moe_utils.maybe_move_tensor_to_cpu(counts, as_numpy=True))  # upstream: CUDA only
