"""GPT layer times from the shapes of their kernels, for a device described by its hardware
file: every GEMM on a wave-quantised roofline, every elementwise kernel at memory bandwidth.

How a GPU runs a GEMM ``(m x k) @ (k x n)``: the library cuts the output into tiles of
``tile_m x tile_n``, and the device's ``sms`` streaming multiprocessors take them in waves.
Each tile costs ``2 tile_m tile_n k`` FLOPs at ``peak * gemm_efficiency / sms`` per SM (the
efficiency is what the library reaches on large GEMMs), so the GEMM takes
``ceil(tiles / sms)`` such waves; with fewer tiles than SMs it splits ``k`` over the idle
ones (split-K, slices of at least 128).  A small or oddly sized GEMM leaves SMs idle in its last wave
and computes padding in its edge tiles; a GEMM moving more bytes than it computes is bound by
memory (``2 (mk + kn + mn)`` bytes of 16-bit operands at ``memory_bandwidth * memory_efficiency``).
Efficiency thus rises with GEMM size, as measured GEMM throughput does.

A transformer layer on one TP rank (``T = b s`` tokens, ``a`` heads and ``g`` key/value groups of
this rank, head size ``d``) runs, forward: the QKV projection ``(T, (a + 2g) d, h)``, the attention
core, the output projection ``(T, h, ad)`` and the two FFN GEMMs ``(T, u/t, h)`` and
``(T, h, f/t)`` (``u = 2f`` with SwiGLU's gate, else ``f``); and the elementwise kernels of
megatron-core's local layer: two layer norms, two fused bias-dropout-add and the fused bias-GeLU
(or SwiGLU). megatron-core's unfused local core computes the scores ``b a`` x ``(s, s, d)`` and
their weighted sum ``b a`` x ``(s, d, s)`` as GEMMs over the whole square and runs the fused
scale-mask-softmax and the attention dropout over it at memory bandwidth; a fused core (flash,
cuDNN, torch's SDPA) computes the causal half, ``2 b a s^2 d`` FLOPs forward and 2.5 times that
backward, at the device's measured ``attention_efficiency`` plus a fixed ``attention_latency_us`` a
call (the line ``benchmarks/bench_kernels.py`` fits to the device's causal attention).  The backward pass runs two GEMMs per
forward GEMM (the input's gradient ``(m, k, n)`` and the weight's ``(k, n, m)``) and moves twice
the forward's elementwise bytes.  Selective recompute adds the attention core's forward, full
recompute the whole forward.  The LM head is the logits GEMM ``(T, V/t, h)`` and the
cross-entropy's passes over the fp32 logits.

Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from megatron_dynapipe.planning.cost_model.analytical import AnalyticalCostModel
from megatron_dynapipe.planning.cost_model.base import INF, KINDS, LAYERS, PHASES, as_float, as_recompute, check_choice
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["DeviceRoofline", "RooflineCostModel"]

BYTES = 2.0  # 16-bit activations and weights
SPLIT_K_SLICE = 128  # the shortest stretch of k one SM takes under split-K
#: elements read or written per token by the elementwise kernels of one forward layer, per
#: hidden unit (2 layer norms: 2 each; 2 bias-dropout-adds: 3 each plus a 1-byte mask), per FFN
#: unit (bias-GeLU: read and write) and per attention score (softmax: 2, dropout: 2 + a mask)
ELEMENTS_PER_HIDDEN = 2 * 2 + 2 * 3.5
ELEMENTS_PER_FFN = 2.0
ELEMENTS_PER_GATED_FFN = 3.0  # SwiGLU reads the gate and the value, writes their product
ELEMENTS_PER_SCORE = 2.0 + 2.5
#: bytes per logit the cross-entropy moves in fp32: forward max, exp-sum and loss passes, backward one pass
CROSS_ENTROPY_BYTES = {"forward": 12.0, "backward": 8.0}


@dataclass(frozen=True)
class DeviceRoofline:
    """A device as its kernels see it (docs/cost_model.md, "The roofline model")."""

    peak_tflops: float
    memory_bandwidth_GBps: float
    sms: int
    gemm_tile: tuple[int, int] = (256, 128)
    gemm_efficiency: float = 0.8
    memory_efficiency: float = 0.85
    #: a fused causal attention core's FLOP rate over the peak and fixed time a call, by phase
    #: (None: the GEMM efficiency and no latency, for a device whose attention was not measured)
    attention_efficiency: "tuple[float, float] | None" = None
    attention_latency_us: tuple[float, float] = (0.0, 0.0)
    #: fixed time an encoder layer's pass pays beyond its kernels' shapes (launches, host work):
    #: 0 for rates measured kernel by kernel, fitted where they come from a profile (hardware/fit.py)
    layer_overhead_us: float = 0.0

    def __post_init__(self) -> None:
        attention = self.fused_attention_efficiency
        if not (self.peak_tflops > 0 and self.memory_bandwidth_GBps > 0 and self.sms >= 1
                and all(t >= 1 for t in self.gemm_tile) and 0 < self.gemm_efficiency <= 1
                and 0 < self.memory_efficiency <= 1 and len(attention) == 2 and all(0 < e <= 1 for e in attention)
                and len(self.attention_latency_us) == 2 and all(t >= 0 for t in self.attention_latency_us)
                and self.layer_overhead_us >= 0):
            raise ValueError(f"a device roofline needs positive peak, bandwidth, SMs and tile sizes, efficiencies "
                             f"in (0, 1] and latencies >= 0, got {self}")

    @classmethod
    def from_section(cls, section, peak_tflops: float, memory_bandwidth_GBps: float,
                     core: str = "transformer_engine") -> "DeviceRoofline":
        """The roofline of a hardware file's ``compute`` section (``sms`` and, optionally, the
        other fields; the defaults above for those it leaves out) at that device's peak, its
        attention line the one of ``core``: ``sdpa_attention`` (torch's kernel) for ``sdpa`` where
        the section measured it, else ``fused_attention`` (transformer-engine's)."""
        optional = {key: float(section[key]) for key in ("gemm_efficiency", "memory_efficiency", "layer_overhead_us")
                    if key in section}
        if "gemm_tile" in section:
            optional["gemm_tile"] = tuple(section["gemm_tile"])
        attention = (core == "sdpa" and section.get("sdpa_attention")) or section.get("fused_attention")
        if attention is not None:
            optional["attention_efficiency"] = (float(attention["forward_efficiency"]),
                                                float(attention["backward_efficiency"]))
            optional["attention_latency_us"] = (float(attention["forward_latency_us"]),
                                                float(attention["backward_latency_us"]))
        return cls(peak_tflops=peak_tflops, memory_bandwidth_GBps=memory_bandwidth_GBps, sms=int(section["sms"]),
                   **optional)

    @property
    def fused_attention_efficiency(self) -> tuple[float, float]:
        """(forward, backward): the measured ones, else the GEMM efficiency."""
        return self.attention_efficiency or (self.gemm_efficiency,) * 2

    def fused_attention_ms(self, phase: str, flops):
        """Milliseconds of a fused causal attention core doing ``flops`` in ``phase``."""
        k = PHASES.index(phase)
        rate = self.peak_tflops * 1e9 * self.fused_attention_efficiency[k]  # FLOP/ms
        return flops / rate + self.attention_latency_us[k] / 1e3

    def gemm_ms(self, m, n, k, batch=1.0):
        """Milliseconds of ``batch`` GEMMs of ``(m x k) @ (k x n)`` (arrays broadcast)."""
        tm, tn = self.gemm_tile
        tiles = np.ceil(m / tm) * np.ceil(n / tn) * batch
        waves = np.ceil(tiles / self.sms)
        # fewer tiles than SMs: the library splits k over the idle SMs (split-K), in slices of at least a tile
        split = np.maximum(1.0, np.minimum(np.floor(self.sms / tiles), np.floor(k / SPLIT_K_SLICE)))
        per_sm_flop_per_ms = self.peak_tflops * 1e9 * self.gemm_efficiency / self.sms
        compute = waves * 2.0 * tm * tn * (k / split) / per_sm_flop_per_ms
        return np.maximum(compute, self.memory_ms(BYTES * (m * k + k * n + m * n) * batch))

    def without_sms(self, taken: int) -> "DeviceRoofline":
        """This device less ``taken`` of its SMs (each SM's rate and the memory's as before): where
        a kernel runs beside one that holds them."""
        left = self.sms - taken
        return dataclasses.replace(self, sms=left, peak_tflops=self.peak_tflops * left / self.sms)

    def memory_ms(self, nbytes):
        """Milliseconds to move ``nbytes`` through device memory."""
        return nbytes / (self.memory_bandwidth_GBps * 1e6 * self.memory_efficiency)


class RooflineCostModel(AnalyticalCostModel):
    """The analytical GPT's FLOPs and memory, its times from :class:`DeviceRoofline`."""

    def __init__(self, roofline: DeviceRoofline, **gpt):
        super().__init__(peak_tflops=roofline.peak_tflops, **gpt)
        self.roofline = roofline
        self.name = self.name.replace("analytical", "roofline", 1)

    def describe(self) -> str:
        r = self.roofline
        return (f"the roofline GPT model (hidden {self.hidden_size}, {self.num_heads} heads, "
                f"FFN {self.ffn_hidden_size}, vocabulary {self.vocab_size}, {self._core_label}; "
                f"{r.peak_tflops:g} TFLOP/s on {r.sms} SMs at {r.gemm_efficiency:g}, "
                f"{r.memory_bandwidth_GBps:g} GB/s), tp {self.tp}{self._sp_label}")

    def __repr__(self) -> str:
        return (f"RooflineCostModel({self.roofline!r}, hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, vocab_size={self.vocab_size}, tp={self.tp}, "
                f"sequence_parallel={self.sequence_parallel})")

    # -- kernels ----------------------------------------------------------------------------------
    def _gemms(self, shapes, phase: str):
        """Time of forward GEMMs ``(m, n, k, batch)``, or of their two backward GEMMs each."""
        g = self.roofline.gemm_ms
        if phase == "forward":
            return sum(g(m, n, k, batch) for m, n, k, batch in shapes)
        return sum(g(m, k, n, batch) + g(k, n, m, batch) for m, n, k, batch in shapes)

    def _attention_core_ms(self, phase: str, b, s):
        heads, d = self.num_heads / self.tp, self.layer.head_dim
        if self.fused_attention:
            forward = 2.0 * b * heads * s * s * d  # two GEMMs over the causal half
            return self.roofline.fused_attention_ms(phase, forward if phase == "forward" else 2.5 * forward)
        gemms = self._gemms([(s, s, d, b * heads), (s, d, s, b * heads)], phase)
        elementwise = self.roofline.memory_ms(BYTES * ELEMENTS_PER_SCORE * b * s * s * heads)
        return gemms + elementwise * (1.0 if phase == "forward" else 2.0)

    def _linear_ms(self, phase: str, b, s):
        h, f, t, spec = self.hidden_size, self.ffn_hidden_size, self.tp, self.layer
        q, kv = spec.num_attention_heads * spec.head_dim, spec.query_groups * spec.head_dim
        up = 2 * f if spec.swiglu else f
        tokens = b * s
        gemms = self._gemms([(tokens, (q + 2 * kv) / t, h, 1.0), (tokens, h, q / t, 1.0),
                             (tokens, up / t, h, 1.0), (tokens, h, f / t, 1.0)], phase)
        per_ffn = ELEMENTS_PER_GATED_FFN if spec.swiglu else ELEMENTS_PER_FFN
        elements = tokens * (ELEMENTS_PER_HIDDEN * h + per_ffn * f / t)
        overhead = self.roofline.layer_overhead_us / 1e3  # with the linear part: full recompute pays it again
        return gemms + self.roofline.memory_ms(BYTES * elements) * (1.0 if phase == "forward" else 2.0) + overhead

    def _encoder_ms(self, phase: str, rc: RecomputeType, b, s):
        return self._encoder_parts(b, s).ms(phase, rc)

    def _encoder_parts(self, b, s) -> "_EncoderParts":
        return _EncoderParts(*(self._linear_ms(phase, b, s) for phase in PHASES),
                             *(self._attention_core_ms(phase, b, s) for phase in PHASES))

    def _head_ms(self, phase: str, b, s):
        tokens, vocab = b * s, self.vocab_size / self.tp
        logits = self._gemms([(tokens, vocab, self.hidden_size, 1.0)], phase)
        return logits + self.roofline.memory_ms(CROSS_ENTROPY_BYTES[phase] * tokens * vocab)

    def _embedding_ms(self, phase: str, b, s):
        """The embedding lookup writes (forward) or accumulates (backward) T x h."""
        return self.roofline.memory_ms(BYTES * b * s * self.hidden_size * (1.0 if phase == "forward" else 2.0))

    def layer_ms(self, layer, phase, recompute, mbs, seqlen):
        check_choice("layer", layer, LAYERS)
        check_choice("phase", phase, PHASES)
        b, s = as_float(mbs), as_float(seqlen)
        if layer == "preprocess":
            value = self._embedding_ms(phase, b, s)
        elif layer == "encoder":
            value = self._encoder_ms(phase, as_recompute(recompute), b, s)
        else:
            value = self._head_ms(phase, b, s)
        return self._mask(value, mbs, seqlen)

    def attention_core_ms(self, phase: str, recompute, mbs, seqlen):
        check_choice("phase", phase, PHASES)
        return self._mask(self._encoder_parts(as_float(mbs), as_float(seqlen)).attention_ms(phase, as_recompute(recompute)),
                          mbs, seqlen)

    def shape_costs(self, types, mbs, seqlen) -> np.ndarray:
        """:meth:`CostModel.shape_costs` pricing each kernel once a shape: recompute types differ
        only in what the backward runs again (the planner asks every type of thousands of shapes)."""
        b, s = as_float(mbs), as_float(seqlen)
        shape = np.broadcast_shapes(np.shape(mbs), np.shape(seqlen))
        fits = self.fits(mbs, seqlen)
        encoder = self._encoder_parts(b, s)
        rest = [self._head_ms(phase, b, s) for phase in PHASES] + [self._embedding_ms(phase, b, s) for phase in PHASES]
        rows = []
        for rc in map(as_recompute, types):
            values = (encoder.ms("forward", rc), encoder.ms("backward", rc), *rest,
                      *(self._activation_mb(kind, rc, b, s) for kind in KINDS))
            rows.append([np.broadcast_to(np.where(fits, v, INF), shape) for v in values])  # fits: asked once
        return np.array(rows, dtype=float)


@dataclass(frozen=True)
class _EncoderParts:
    """One encoder layer's kernels at one shape (ms, numbers or arrays): its linear layers' and
    its attention core's, forward and backward."""

    linear_forward: object
    linear_backward: object
    attention_forward: object
    attention_backward: object

    def ms(self, phase: str, rc: RecomputeType):
        """The layer's time in ``phase``; the backward runs again what ``rc`` recomputes: the
        attention core (selective) or the whole forward (full)."""
        if phase == "forward":
            return self.linear_forward + self.attention_forward
        linear_again = self.linear_forward if rc == RecomputeType.FULL else 0.0
        return self.linear_backward + linear_again + self.attention_ms(phase, rc)

    def attention_ms(self, phase: str, rc: RecomputeType):
        """The attention core's part of :meth:`ms`: both recompute types run the core again."""
        if phase == "forward":
            return self.attention_forward
        return self.attention_backward + (0.0 if rc == RecomputeType.NONE else self.attention_forward)
