"""GPT layer costs from FLOP counts and activation-memory formulas
(:mod:`megatron_dynapipe.config.accounting`), for a model too large to profile in the time at
hand or a device not at hand; ``profile --calibrate`` fits its rates to a few measured points."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from megatron_dynapipe.config.accounting import (
    activation_bytes,
    layer_flops_per_token,
    layer_params,
    norm_params,
    output_flops_per_token,
)
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.planning.cost_model import profile_file
from megatron_dynapipe.planning.cost_model.base import (
    INF,
    KINDS,
    LAYERS,
    MB,
    PARAM_LAYERS,
    PHASES,
    CostModel,
    CostModelError,
    as_float,
    as_recompute,
    check_choice,
)
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["AnalyticalCostModel", "gpt_shape"]


def gpt_shape(spec: ModelSpec, tp: int) -> dict:
    """The keyword arguments that give :class:`AnalyticalCostModel` (and the roofline) the shape of
    ``spec`` at ``tp``: its widths, query groups, gated MLP, vocabulary as padded at ``tp``, and
    whether its attention core is fused (anything but megatron-core's unfused local one)."""
    return dict(hidden_size=spec.hidden_size, num_heads=spec.num_attention_heads, ffn_hidden_size=spec.ffn_hidden_size,
                vocab_size=spec.padded_vocab_size(tp), tp=tp, num_query_groups=spec.num_query_groups,
                swiglu=spec.swiglu, fused_attention=spec.fused_attention)


class AnalyticalCostModel(CostModel):
    """GPT layer costs from FLOP counts and activation-memory formulas (docs/cost_model.md).

    Time is ``FLOPs / (peak_tflops * mfu)`` plus ``overhead_ms`` per layer and phase, where the
    attention core's FLOPs (scores and their weighted sum, quadratic in the sequence) run at
    ``attention_mfu`` (default: ``mfu``) and the matmuls at ``mfu``. The matmuls are every one the
    layer has: query groups narrow the key and value projections (``num_query_groups``), SwiGLU
    doubles the first MLP matmul (``swiglu``). An unfused attention core (megatron-core's local
    one) computes and keeps the whole ``s x s`` score square; a fused one (``fused_attention``:
    flash, cuDNN or torch's SDPA kernels) computes the causal half and keeps no scores. A layer on
    fewer than ``saturation_tokens`` tokens takes as long as on that many, because small kernels
    leave the GPU under-used (the A100 profile flattens below about 1k tokens per layer). Memory is
    16-bit activations as Korthikanti et al. (2022) count them, with Megatron's sequence parallelism
    where ``sequence_parallel`` (the layer's activations outside tensor-parallel regions split over
    TP too; times are unchanged: the same FLOPs, its collectives priced apart). A micro-batch whose
    single encoder layer (its stored and peak activations plus the 16-byte-per-parameter model
    state of that layer) exceeds ``device_memory_mb`` is infeasible (``inf``).
    """

    prices_attention_core = True

    def __init__(
        self,
        hidden_size: int = 4096,
        num_heads: int = 32,
        ffn_hidden_size: int | None = None,
        vocab_size: int = 50257,
        tp: int = 1,
        peak_tflops: float = 312.0,
        mfu: float = 0.5,
        attention_mfu: float | None = None,
        device_memory_mb: float = 40960,
        overhead_ms: float = 0.0,
        saturation_tokens: int = 1024,
        microbatch_overhead: Mapping[tuple[str, str], tuple[float, float]] | None = None,
        metadata: dict | None = None,
        num_query_groups: int | None = None,
        swiglu: bool = False,
        fused_attention: bool = False,
        sequence_parallel: bool = False,
    ):
        ffn = 4 * hidden_size if ffn_hidden_size is None else ffn_hidden_size
        for what, v in (("hidden_size", hidden_size), ("num_heads", num_heads),
                        ("ffn_hidden_size", ffn), ("vocab_size", vocab_size), ("tp", tp)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{what} must be a positive integer, got {v!r}")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        if num_heads % tp:
            raise ValueError(f"num_heads {num_heads} is not divisible by tp {tp}")
        if not (peak_tflops > 0 and 0 < mfu <= 1 and device_memory_mb > 0 and overhead_ms >= 0
                and saturation_tokens >= 0):
            raise ValueError("need peak_tflops > 0, 0 < mfu <= 1, device_memory_mb > 0, overhead_ms >= 0, "
                             "saturation_tokens >= 0")
        self.hidden_size = int(hidden_size)
        self.num_heads = int(num_heads)
        self.ffn_hidden_size = int(ffn)
        self.vocab_size = int(vocab_size)
        self.tp = int(tp)
        self.peak_tflops = float(peak_tflops)
        self.mfu = float(mfu)
        self.attention_mfu = self.mfu if attention_mfu is None else float(attention_mfu)
        if not self.attention_mfu > 0:
            raise ValueError(f"need attention_mfu > 0, got {attention_mfu}")
        self.device_memory_mb = float(device_memory_mb)
        self.overhead_ms = float(overhead_ms)
        self.saturation_tokens = int(saturation_tokens)
        self.microbatch_overhead = dict(microbatch_overhead or {})
        self.metadata = dict(metadata or {})  # a calibrated model's: what `profile --calibrate` recorded
        self.layer = ModelSpec(num_layers=1, hidden_size=self.hidden_size, num_attention_heads=self.num_heads,
                               ffn_hidden_size=self.ffn_hidden_size, vocab_size=self.vocab_size,
                               num_query_groups=num_query_groups, swiglu=bool(swiglu))  # checks the groups
        if self.layer.query_groups % tp:
            raise ValueError(f"num_query_groups {self.layer.query_groups} is not divisible by tp {tp}")
        self.num_query_groups = self.layer.num_query_groups
        self.swiglu = self.layer.swiglu
        self.fused_attention = bool(fused_attention)
        self.sequence_parallel = bool(sequence_parallel)
        self.name = f"analytical(h={hidden_size}, heads={num_heads}, ffn={ffn}, vocab={vocab_size})"
        self._flop_per_ms = self.peak_tflops * 1e9 * self.mfu  # TFLOP/s -> FLOP/ms
        t = self.tp
        # an unfused attention core computes the whole square; a fused one the causal half
        layer = layer_flops_per_token(self.layer, 1, causal=self.fused_attention)
        self._matmul_flop_per_token = layer.linear / t
        self._attention_flop = layer.attention / t  # times b * s^2
        self._head_flop_per_token = output_flops_per_token(self.hidden_size, self.vocab_size) / t
        self._encoder_state_mb = 8.0 * self.param_mb("encoder")

    def describe(self) -> str:
        return (f"the analytical GPT model (hidden {self.hidden_size}, "
                f"{self.num_heads} heads, FFN {self.ffn_hidden_size}, vocabulary {self.vocab_size}, "
                f"{self._core_label}, {self.peak_tflops:g} TFLOP/s peak at {self.mfu:g} of it), "
                f"tp {self.tp}{self._sp_label}")

    @property
    def _core_label(self) -> str:
        return "fused attention core" if self.fused_attention else "unfused attention core"

    @property
    def _sp_label(self) -> str:
        return " with sequence parallelism" if self.sequence_parallel else ""

    def __repr__(self) -> str:
        return (f"AnalyticalCostModel(hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, vocab_size={self.vocab_size}, tp={self.tp}, "
                f"peak_tflops={self.peak_tflops}, mfu={self.mfu}, attention_mfu={self.attention_mfu}, "
                f"device_memory_mb={self.device_memory_mb}, overhead_ms={self.overhead_ms}, "
                f"saturation_tokens={self.saturation_tokens}, num_query_groups={self.num_query_groups}, "
                f"swiglu={self.swiglu}, fused_attention={self.fused_attention}, "
                f"sequence_parallel={self.sequence_parallel})")

    @classmethod
    def calibrated(cls, doc: dict, tp: int, *, source: str) -> "AnalyticalCostModel":
        """The model ``megatron-dynapipe profile --calibrate`` wrote (docs/cost_model.md): the
        GPT sizes and fitted settings of its ``analytical`` object, at any ``tp``."""
        settings = profile_file.calibrated_settings(doc, source)
        try:
            return cls(tp=tp, **settings, metadata=profile_file.metadata_of(doc),
                       microbatch_overhead=profile_file.overhead_of(doc, tp, source))
        except (TypeError, ValueError) as error:
            if isinstance(error, CostModelError):
                raise
            raise CostModelError(f"cost model file {source} has an 'analytical' object no model can be built from "
                                 f"({error}): {profile_file.FORMAT_HINT}") from None

    def to_document(self) -> dict:
        """This model as a calibrated file (its GPT sizes, rates and per-micro-batch overhead)."""
        settings = {key: getattr(self, key) for key in profile_file.CALIBRATED + profile_file.CALIBRATED_SHAPE}
        overhead = [dict(tp=self.tp, per=per, phase=phase, ms=ms, ms_per_token=per_token)
                    for (per, phase), (ms, per_token) in sorted(self.microbatch_overhead.items())]
        return profile_file.calibrated_document(name=self.name, source=self.metadata.get("source", self.name),
                                                hidden_size=self.hidden_size, metadata=self.metadata,
                                                settings=settings, overhead=overhead)

    # -- FLOPs -----------------------------------------------------------------------------------
    def encoder_flops(self, phase: str, recompute, mbs, seqlen):
        """FLOPs of one encoder layer on one TP rank (MAC = 2 FLOPs)."""
        matmul, attention = self.encoder_flop_parts(phase, recompute, mbs, seqlen)
        return matmul + attention

    def encoder_flop_parts(self, phase: str, recompute, mbs, seqlen):
        """:meth:`encoder_flops` as (linear layers', attention core's)."""
        check_choice("phase", phase, PHASES)
        rc = as_recompute(recompute)
        b, s = as_float(mbs), as_float(seqlen)
        matmul, attention = self._matmul_flop_per_token * b * s, self._attention_flop * b * s * s
        if phase == "forward":
            return matmul, attention
        if rc == RecomputeType.NONE:
            return 2.0 * matmul, 2.0 * attention
        if rc == RecomputeType.SELECTIVE:
            return 2.0 * matmul, 3.0 * attention
        return 3.0 * matmul, 3.0 * attention

    def attention_core_share(self, seqlen) -> float:
        """The attention core's share (scores and their product with the values) of an encoder
        layer's forward FLOPs at ``seqlen`` tokens: what selective recompute runs again, and the
        unit of context parallelism's extra attention blocks."""
        matmul, attention = self.encoder_flop_parts("forward", "none", 1, seqlen)
        return float(attention / (matmul + attention))

    def attention_core_ms(self, phase: str, recompute, mbs, seqlen):
        """The attention core's part of an encoder layer's :meth:`layer_ms` (in backward, the
        core run again by ``recompute`` too): the work context parallelism's ring repeats."""
        check_choice("phase", phase, PHASES)
        _, attention = self.encoder_flop_parts(phase, recompute, mbs, seqlen)
        return self._mask(self._compute_ms(attention * (self.mfu / self.attention_mfu), mbs, seqlen), mbs, seqlen)

    def postprocess_flops(self, phase: str, mbs, seqlen):
        """FLOPs of the LM head (logits) on one TP rank; recomputation does not touch it."""
        check_choice("phase", phase, PHASES)
        forward = self._head_flop_per_token * as_float(mbs) * as_float(seqlen)
        return forward if phase == "forward" else 2.0 * forward

    def layer_ms(self, layer, phase, recompute, mbs, seqlen):
        check_choice("layer", layer, LAYERS)
        if layer == "preprocess":  # a lookup: no FLOPs to price
            return self._mask(0.0 * as_float(mbs) * as_float(seqlen), mbs, seqlen)
        if layer == "encoder":
            matmul, attention = self.encoder_flop_parts(phase, recompute, mbs, seqlen)
            flops = matmul + attention * (self.mfu / self.attention_mfu)  # as matmul FLOPs at mfu
        else:
            flops = self.postprocess_flops(phase, mbs, seqlen)
        return self._mask(self._compute_ms(flops, mbs, seqlen) + self.overhead_ms, mbs, seqlen)

    def _compute_ms(self, flops, mbs, seqlen):
        """Milliseconds of ``flops`` (as matmul FLOPs at ``mfu``) on a micro-batch of ``mbs`` x
        ``seqlen`` tokens: fewer than ``saturation_tokens`` take as long as that many."""
        under_used = np.maximum(1.0, self.saturation_tokens / (as_float(mbs) * as_float(seqlen)))
        return flops * under_used / self._flop_per_ms

    # -- memory ----------------------------------------------------------------------------------
    def _activation_bytes(self, rc: RecomputeType, b, s):
        return activation_bytes(s, b, self.hidden_size, self.num_heads, self.tp, recompute=rc.label,
                                fused_attention=self.fused_attention, sequence_parallel=self.sequence_parallel)

    def activation_mb(self, kind, recompute, mbs, seqlen):
        check_choice("activation kind", kind, KINDS)
        return self._mask(self._activation_mb(kind, as_recompute(recompute), as_float(mbs), as_float(seqlen)),
                          mbs, seqlen)

    def _activation_mb(self, kind: str, rc: RecomputeType, b, s):
        """:meth:`activation_mb` whether the micro-batch fits or not."""
        stored = self._activation_bytes(rc, b, s)
        if kind == "stored":
            return stored / MB
        # backward materialises the whole layer plus as much again in gradients
        return (2.0 * self._activation_bytes(RecomputeType.NONE, b, s) - stored) / MB

    def vocab_per_rank(self) -> float:
        return self.vocab_size / self.tp

    def param_mb(self, layer):
        check_choice("parameter layer", layer, PARAM_LAYERS)
        h, t = self.hidden_size, self.tp
        if layer == "embedding":
            params = self.vocab_size * h / t
        else:  # everything TP-split but the two layer norms and the row-parallel biases
            replicated = norm_params(self.layer) + 2 * h
            params = (layer_params(self.layer) - replicated) / t + replicated
        return 2.0 * params / MB

    def fits(self, mbs, seqlen):
        """Whether one micro-batch can run one encoder layer on the device at all."""
        b, s = as_float(mbs), as_float(seqlen)
        need = 2.0 * self._activation_bytes(RecomputeType.NONE, b, s) / MB + self._encoder_state_mb
        return need <= self.device_memory_mb

    def no_time_fix(self) -> str:
        """A formula prices every length: it has no time where one layer's activations alone
        exceed the device (:meth:`fits`)."""
        fused = "" if self.fused_attention else ", a fused attention core (--attention sdpa: no s x s scores kept)"
        return (f"one layer's activations alone exceed the device's {self.device_memory_mb / 1024:.0f} GiB: add tensor "
                f"or context parallelism{fused}, or truncate long samples")

    def _mask(self, value, mbs, seqlen):
        ok = self.fits(mbs, seqlen)
        if isinstance(value, np.ndarray) or isinstance(ok, np.ndarray):
            return np.where(ok, value, INF)
        return float(value) if ok else INF
