"""A fused attention core for megatron-core's local layer spec: torch's scaled_dot_product_attention.

megatron-core's local spec computes attention unfused (:class:`DotProductAttention`: an s x s score
matrix per head, softmax, then a second matmul), which is what Megatron-LM runs without
transformer-engine and what a profile made without it measures; it is slower and far hungrier
than the flash attention real jobs use, and it refuses packed (THD) micro-batches.
:class:`SDPAttention` is the same module with its forward replaced by torch's fused kernels
(flash or memory-efficient on CUDA, the math kernel on the CPU), and it runs packed micro-batches:
megatron-core's ``PackedSeqParams`` with ``qkv_format="thd"``, every sample attending causally to
itself alone. ``ModelSpec(attention="sdpa")`` (``--attention sdpa``) selects it wherever a model
is built.  Imports torch and megatron-core.
"""

from __future__ import annotations

import inspect
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

__all__ = ["SDPAttention", "every_heads_keys", "segment_bounds"]


class SDPAttention(DotProductAttention):
    """megatron-core's local attention core computed by ``scaled_dot_product_attention``: same
    inputs (``[s, b, heads, head dim]``, or ``[t, heads, head dim]`` packed), same output
    (``[s, b, heads x head dim]``, or ``[t, heads x head dim]``), same softmax scale and dropout."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if self.softmax_offset is not None or self.scale_mask_softmax.window_size is not None:
            raise ValueError("attention sdpa has no softmax offset or sliding window: use --attention local")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention sdpa takes no attention bias: use --attention local")
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"attention sdpa packs only the thd format, got {packed_seq_params.qkv_format!r}")
            return self._packed(query, key, value, packed_seq_params, causal)
        # [s, b, heads, dim] -> [b, heads, s, dim], the layout scaled_dot_product_attention takes
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask = None if attention_mask is None or causal else ~attention_mask  # megatron masks out where True
        out = self._attend(q, k, v, mask, causal)
        return out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)

    def _packed(self, query, key, value, params, causal: bool):
        """[t, heads, dim] packed samples, each attending to itself alone."""
        cu_seqlens = params.cu_seqlens_q
        if params.cu_seqlens_kv is not None and not torch.equal(params.cu_seqlens_kv, cu_seqlens):
            raise ValueError("attention sdpa packs self-attention only: cu_seqlens_q and cu_seqlens_kv must be equal")
        gqa = self._gqa()
        if query.is_cuda and _VARLEN is not None and query.dtype in (torch.float16, torch.bfloat16) \
                and causal and not self._dropout_p() and (_VARLEN.gqa or not gqa):
            out = _VARLEN.attend(query, key, value, cu_seqlens, cu_seqlens, params.max_seqlen_q, params.max_seqlen_q,
                                 scale=self.softmax_scale, window_size=(-1, 0),  # causal
                                 **({"enable_gqa": True} if gqa else {}))
            return out.reshape(query.size(0), -1)
        # one sample at a time, [len, heads, dim] -> [1, heads, len, dim]. Cut by split, whose backward
        # joins the samples' gradients in one cat (a slice's backward fills a zero tensor the size of
        # the whole row for every sample), and joined by cat, whose backward hands each a view
        sizes = [end - start for start, end in segment_bounds(cu_seqlens)]
        outs = [self._attend(*(x.transpose(0, 1).unsqueeze(0) for x in sample), None, causal)[0].transpose(0, 1)
                for sample in zip(*(x.split(sizes) for x in (query, key, value)))]
        return torch.cat(outs, dim=0).reshape(query.size(0), -1)

    def _attend(self, q, k, v, mask, causal: bool):
        if q.is_meta and mask is None:
            return self._fused_on_meta(q, k, v, causal)
        dropout = self._dropout_p()

        def attend():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                  scale=self.softmax_scale, enable_gqa=self._gqa())

        if dropout and not self.config.sequence_parallel:  # as DotProductAttention draws its dropout
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return attend()
        return attend()

    def _fused_on_meta(self, q, k, v, causal: bool):
        """Meta tensors (a shapes-only trace) would take the math kernel, which keeps the s x s
        probabilities for backward; a fused kernel on a GPU keeps only q, k, v, the output and a
        log-sum-exp per row (with dropout, a seed: its mask is drawn again). The CPU flash kernel
        saves exactly those, so autograd records what the GPU job holds; query groups are
        repeated up to the heads first (the kernel takes no groups), counting k and v as wide."""
        k, v = every_heads_keys(q, k, v)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                           scale=self.softmax_scale)[0]

    def _dropout_p(self) -> float:
        return self.attention_dropout.p if self.training else 0.0

    def _gqa(self) -> bool:
        return self.num_attention_heads_per_partition != self.num_query_groups_per_partition


def every_heads_keys(q, k, v):
    """``k`` and ``v`` (``[b, groups, tokens, dim]``) with each query group's keys and values
    repeated for its heads, as ``q`` (``[b, heads, tokens, dim]``) has them: for kernels that take
    no groups."""
    if k.size(1) == q.size(1):
        return k, v
    repeat = q.size(1) // k.size(1)
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)


def segment_bounds(cu_seqlens) -> list[tuple[int, int]]:
    """(start, end) of every non-empty segment of cumulative lengths ``cu_seqlens``."""
    bounds = cu_seqlens.tolist()
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


class _Varlen(NamedTuple):
    attend: Callable
    gqa: bool  # whether it takes enable_gqa (torch 2.12 on)


def _varlen_kernel() -> Optional[_Varlen]:
    """torch's flash varlen attention where this torch takes a softmax scale and a causal window
    (torch 2.11 on; 2.10's has neither), else None (the per-sample loop runs)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "scale" not in params or "window_size" not in params:
        return None
    return _Varlen(varlen_attn, "enable_gqa" in params)


_VARLEN = _varlen_kernel()
