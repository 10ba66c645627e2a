"""The GPT model sizes the tracer knows by name: one registry shared by the CLI and the examples.

==========  ======  =====  ======
name        hidden  heads  layers
==========  ======  =====  ======
tiny           128      8       4
6.7B          4096     32      32
13B           5120     32      40
30B           7680     48      40
40B           9216     72      40
70B           8192     64      80
175B         12288     96      96
485B         20480    160      96
1T           25600    160     128
2T           25600    160     256
==========  ======  =====  ======

The feed-forward width is ``4 * hidden`` and the (padded) vocabulary 51200 unless given.  Names
are looked up case-insensitively, with or without the trailing ``B`` and an optional ``gpt-``
prefix (``6.7``, ``6.7b``, ``gpt-6.7B`` all name the same model).  Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["GPTShape", "MODELS", "get_model", "model_names"]

#: Bytes per parameter while training in fp32 on CPU: weight, gradient, Adam's two moments.
TRAIN_BYTES_PER_PARAM = 16
#: Bytes per activation element kept for backward (fp32 on CPU).
ACTIVATION_BYTES = 4


def _is_pos_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class GPTShape:
    """The shape of a GPT decoder: what the tracer needs to build one pipeline stage of it.

    ``ffn`` defaults to ``4 * hidden``.  ``seq_length`` is the default sequence length of a
    trace (and Megatron's ``--max-position-embeddings``).  ``num_experts`` is 0 for a dense model;
    a mixture-of-experts variant is ``shape.with_experts(n)``.
    """

    hidden: int
    heads: int
    layers: int
    ffn: int | None = None
    vocab: int = 51200
    name: str = ""
    seq_length: int = 2048
    num_experts: int = 0

    def __post_init__(self) -> None:
        if self.ffn is None:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        for field in ("hidden", "heads", "layers", "ffn", "vocab", "seq_length"):
            value = getattr(self, field)
            if not _is_pos_int(value):
                raise ValueError(f"GPTShape.{field} must be a positive int, got {value!r}")
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"GPTShape.num_experts must be an int >= 0, got {self.num_experts!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden {self.hidden} is not divisible by heads {self.heads}; "
                f"pick a hidden size that is a multiple of {self.heads}"
            )

    @property
    def label(self) -> str:
        """The name used in folder names: the registry name, or ``h<hidden>l<layers>``."""
        return self.name or f"h{self.hidden}l{self.layers}"

    def with_experts(self, num_experts: int) -> "GPTShape":
        return dataclasses.replace(self, num_experts=num_experts)

    # ---- sizes -----------------------------------------------------------------------------

    def layer_params(self) -> int:
        """Parameters of one transformer layer (attention, MLP, two layer norms, biases)."""
        h, f = self.hidden, self.ffn
        attention = 4 * h * h + 4 * h
        mlp = 2 * h * f + f + h
        if self.num_experts:
            mlp *= self.num_experts
        return attention + mlp + 4 * h

    def embedding_params(self) -> int:
        """Word plus position embeddings."""
        return self.vocab * self.hidden + self.seq_length * self.hidden

    def total_params(self) -> int:
        """Parameters of the whole model (output layer tied to the word embedding)."""
        return self.layers * self.layer_params() + self.embedding_params() + 2 * self.hidden

    def stage_params(self, pp: int, tp: int = 1, ep: int = 1, *, stage: int = 0) -> int:
        """Parameters one rank of ``stage`` holds (layers split evenly over ``pp``).

        The first stage holds the embeddings, the last the (untied) output layer; tensor
        parallelism divides everything but the layer norms, expert parallelism the experts.
        """
        layers = -(-self.layers // pp)
        per_layer = self.layer_params()
        if self.num_experts:
            h, f = self.hidden, self.ffn
            expert = 2 * h * f + f + h
            per_layer -= expert * self.num_experts
            per_layer += expert * -(-self.num_experts // ep)
        params = layers * per_layer // tp
        if stage == 0 or stage == pp - 1:
            params += self.vocab * self.hidden // tp
        if stage == 0:
            params += self.seq_length * self.hidden
        return params

    def training_bytes(
        self,
        pp: int,
        tp: int = 1,
        ep: int = 1,
        *,
        micro_batch_size: int = 1,
        seq_length: int | None = None,
        in_flight: int | None = None,
        cp: int = 1,
    ) -> int:
        """Estimated bytes the busiest rank needs to really run a training step on CPU (fp32).

        Weights, gradients and Adam state (16 bytes per parameter) of the larger of the first and
        last stage, plus the activations of ``in_flight`` micro-batches (default ``pp``, what
        1F1B keeps on the first stage) and the logits of one micro-batch.  An order-of-magnitude
        figure for deciding whether a model can run for real on this machine, not a profile.
        """
        seq = (seq_length or self.seq_length) // cp or 1
        in_flight = pp if in_flight is None else in_flight
        params = max(self.stage_params(pp, tp, ep, stage=0), self.stage_params(pp, tp, ep, stage=pp - 1))
        layers = -(-self.layers // pp)
        b, s, h, a = micro_batch_size, seq, self.hidden, self.heads
        # Korthikanti et al. (2022): 34*s*b*h + 5*a*s^2*b 16-bit bytes per layer without TP;
        # in fp32 elements that is 17*s*b*h + 2.5*a*s*s*b, split by TP.
        elements = (17 * s * b * h + 5 * a * s * s * b // 2) // tp
        activations = layers * elements * ACTIVATION_BYTES * in_flight
        logits = b * s * self.vocab // tp * ACTIVATION_BYTES * 3  # logits, softmax, its gradient
        return params * TRAIN_BYTES_PER_PARAM + activations + logits

    def training_flops(
        self,
        pp: int,
        tp: int = 1,
        ep: int = 1,
        *,
        micro_batch_size: int = 1,
        seq_length: int | None = None,
        cp: int = 1,
    ) -> int:
        """Floating-point operations of one micro-batch's forward and backward on the busiest
        rank: ``6 * parameters * tokens`` for the layers (MoE: the ``top-2`` experts a token
        visits, at most all), the causal attention scores, and the output layer on the last stage.
        """
        seq = (seq_length or self.seq_length) // cp or 1
        tokens = micro_batch_size * seq
        layers = -(-self.layers // pp)
        h, f = self.hidden, self.ffn
        dense_params = 4 * h * h + 2 * h * f
        if self.num_experts:
            dense_params = 4 * h * h + 2 * h * f * min(2, self.num_experts)
        layer = 2 * dense_params * tokens // tp + 2 * micro_batch_size * seq * seq * h // tp
        logits = 2 * tokens * h * self.vocab // tp  # the last stage's; counted for the busiest rank
        return 3 * (layers * layer + logits)

    # ---- Megatron ----------------------------------------------------------------------------

    def megatron_args(self, seq_length: int | None = None) -> list[str]:
        """The Megatron-LM flags that build this model (``pretrain_gpt.py``)."""
        seq = seq_length or self.seq_length
        args = [
            "--num-layers", str(self.layers),
            "--hidden-size", str(self.hidden),
            "--num-attention-heads", str(self.heads),
            "--ffn-hidden-size", str(self.ffn),
            "--seq-length", str(seq),
            "--max-position-embeddings", str(max(seq, self.seq_length)),
            "--vocab-size", str(self.vocab),
        ]
        if self.num_experts:
            args += ["--num-experts", str(self.num_experts)]
        return args


def _registry(*shapes: GPTShape) -> dict[str, GPTShape]:
    return {shape.name: shape for shape in shapes}


#: Every named model, in size order.
MODELS: dict[str, GPTShape] = _registry(
    GPTShape(128, 8, 4, vocab=1024, name="tiny", seq_length=256),
    GPTShape(4096, 32, 32, name="6.7B"),
    GPTShape(5120, 32, 40, name="13B"),
    GPTShape(7680, 48, 40, name="30B"),
    GPTShape(9216, 72, 40, name="40B"),
    GPTShape(8192, 64, 80, name="70B"),
    GPTShape(12288, 96, 96, name="175B"),
    GPTShape(20480, 160, 96, name="485B"),
    GPTShape(25600, 160, 128, name="1T"),
    GPTShape(25600, 160, 256, name="2T"),
)


def model_names() -> list[str]:
    """The registry names, smallest model first."""
    return list(MODELS)


def _key(name: str) -> str:
    key = name.strip().lower()
    if key.startswith("gpt-") or key.startswith("gpt_"):
        key = key[4:]
    if key.endswith("b") and key[:-1].replace(".", "", 1).isdigit():
        key = key[:-1]
    return key


_BY_KEY = {_key(name): shape for name, shape in MODELS.items()}


def get_model(name: str | GPTShape) -> GPTShape:
    """The model called ``name`` (``"tiny"``, ``"6.7"``, ``"175B"``, ``"1T"``, ...).

    A :class:`GPTShape` is returned as is.  An unknown name raises ``ValueError`` listing the
    valid ones.
    """
    if isinstance(name, GPTShape):
        return name
    shape = _BY_KEY.get(_key(str(name)))
    if shape is None:
        raise ValueError(f"unknown model {name!r}; use one of {', '.join(MODELS)}")
    return shape
