"""The one description of a GPT: named sizes, Megatron's flags, the tracer's model and the tiny
test model are all a :class:`ModelSpec`. Nothing here imports torch.

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
prefix (``6.7``, ``6.7b``, ``gpt-6.7B`` all name the same model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = ["MODELS", "ModelSpec", "get_model", "model_names", "add_model_arguments", "model_from_args"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
#: Bytes per parameter while training in fp32 on CPU: weight, gradient, Adam's two moments.
TRAIN_BYTES_PER_PARAM = 16
#: ... of which Adam's two fp32 moments, what the distributed optimizer shards over data parallelism.
ADAM_MOMENT_BYTES = 8
#: Bytes per activation element kept for backward (fp32 on CPU).
ACTIVATION_BYTES = 4


def _is_pos_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class ModelSpec:
    """A GPT decoder, in Megatron's terms (each field is the Megatron-LM flag of the same name).

    ``ffn_hidden_size`` defaults to ``4 * hidden_size``; ``max_sequence_length`` is Megatron's
    ``--max-position-embeddings`` and the default sequence length of a trace. ``num_experts`` is
    0 for a dense model (a mixture-of-experts variant: ``spec.with_experts(n)``); the ``moe_*``
    fields are Megatron's. ``init_method_std`` matters only where weights are really drawn.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int = 51200
    max_sequence_length: int = 2048
    ffn_hidden_size: Optional[int] = None
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_token_dispatcher_type: str = "alltoall"
    #: tokens per expert = capacity factor x fair share; with padding, every all-to-all has a
    #: fixed size (Megatron's drop-and-pad), otherwise sizes follow the routing (dropless: None)
    moe_expert_capacity_factor: Optional[float] = None
    moe_pad_expert_input_to_capacity: bool = False
    share_embeddings_and_output_weights: bool = True
    #: grouped-query attention: key/value heads (None: one per attention head, Megatron's default)
    num_query_groups: Optional[int] = None
    swiglu: bool = False
    normalization: str = "LayerNorm"  # or "RMSNorm"
    position_embedding_type: str = "learned_absolute"  # or "rope"
    #: width of an attention head (None: hidden / heads, Megatron's default)
    kv_channels: Optional[int] = None
    add_bias_linear: bool = True  # False: Megatron-LM's --disable-bias-linear
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    #: the vocabulary is padded to a multiple of this times TP, as Megatron-LM pads it
    make_vocab_size_divisible_by: int = 128
    init_method_std: float = 0.02
    name: str = ""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        for field in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_sequence_length",
                      "ffn_hidden_size", "head_dim", "make_vocab_size_divisible_by"):
            value = getattr(self, field)
            if not _is_pos_int(value):
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"num_experts must be an int >= 0, got {self.num_experts!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden size {self.hidden_size} is not divisible by {self.num_attention_heads} attention "
                f"heads; pick a hidden size that is a multiple of {self.num_attention_heads}")
        groups = self.query_groups
        if not _is_pos_int(groups) or self.num_attention_heads % groups:
            raise ValueError(f"num_query_groups {self.num_query_groups!r} must divide the {self.num_attention_heads} "
                             "attention heads")
        for field in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
                raise ValueError(f"{field} must be a probability in [0, 1), got {value!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization {self.normalization!r}: use one of {', '.join(NORMALIZATIONS)}")
        self._check_moe()
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(f"position_embedding_type {self.position_embedding_type!r}: use one of "
                             f"{', '.join(POSITION_EMBEDDINGS)}")

    def _check_moe(self) -> None:
        if not _is_pos_int(self.moe_router_topk):
            raise ValueError(f"moe_router_topk must be a positive int, got {self.moe_router_topk!r}")
        if self.moe_ffn_hidden_size is not None and not _is_pos_int(self.moe_ffn_hidden_size):
            raise ValueError(f"moe_ffn_hidden_size must be a positive int, got {self.moe_ffn_hidden_size!r}")
        factor = self.moe_expert_capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
            raise ValueError(f"moe_expert_capacity_factor must be a positive number, got {factor!r}")
        if self.moe_pad_expert_input_to_capacity and factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity pads to a capacity: give moe_expert_capacity_factor "
                             "(--moe-expert-capacity-factor F) too")

    @property
    def head_dim(self) -> int:
        """Width of an attention head: ``kv_channels``, else hidden / heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups``, else one per attention head."""
        return self.num_query_groups or self.num_attention_heads

    def padded_vocab_size(self, tp: int = 1) -> int:
        """The vocabulary Megatron-LM builds at tensor-parallel size ``tp``: padded to a multiple
        of ``make_vocab_size_divisible_by * tp``."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    @classmethod
    def from_any(cls, model: "ModelSpec | str | Mapping[str, Any]") -> "ModelSpec":
        """A ModelSpec as is, a registry name (``"6.7B"``) or a mapping of fields."""
        if isinstance(model, ModelSpec):
            return model
        if isinstance(model, str):
            return get_model(model)
        if isinstance(model, Mapping):
            return cls(**model)
        raise TypeError(f"cannot describe a model with {type(model).__name__}; pass a ModelSpec, a model "
                        "name or a mapping of ModelSpec fields")

    @classmethod
    def from_megatron_args(cls, args: Any) -> "ModelSpec":
        """The model Megatron-LM's parsed arguments build (``--num-layers``, ``--hidden-size``, ...)."""
        seq = getattr(args, "seq_length", None) or 0
        fields = dict(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
            vocab_size=getattr(args, "vocab_size", None) or getattr(args, "padded_vocab_size", None),
            max_sequence_length=max(seq, getattr(args, "max_position_embeddings", None) or seq),
            ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
            num_experts=getattr(args, "num_experts", None) or 0,
            share_embeddings_and_output_weights=not getattr(args, "untie_embeddings_and_output_weights", False),
            num_query_groups=(getattr(args, "num_query_groups", None) or 1) if getattr(args, "group_query_attention", None)
            else None,
            swiglu=bool(getattr(args, "swiglu", False)),
            normalization=getattr(args, "normalization", None),
            position_embedding_type=getattr(args, "position_embedding_type", None),
            kv_channels=getattr(args, "kv_channels", None),
            add_bias_linear=getattr(args, "add_bias_linear", None),
            hidden_dropout=getattr(args, "hidden_dropout", None),
            attention_dropout=getattr(args, "attention_dropout", None),
            make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", None),
            **{name: getattr(args, name, None) for name in MOE_FIELDS})
        return cls(**{k: v for k, v in fields.items() if v is not None})

    @property
    def label(self) -> str:
        """The name used in folder names: the registry name, or ``h<hidden>l<layers>``."""
        return self.name or f"h{self.hidden_size}l{self.num_layers}"

    def with_experts(self, num_experts: int) -> "ModelSpec":
        return dataclasses.replace(self, num_experts=num_experts)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- sizes -----------------------------------------------------------------------------

    def layer_params(self) -> int:
        """Parameters of one transformer layer (attention, MLP, two norms, biases)."""
        h, bias = self.hidden_size, int(self.add_bias_linear)
        query = self.num_attention_heads * self.head_dim
        kv = 2 * self.query_groups * self.head_dim  # key and value widths
        attention = h * (query + kv) + query * h + bias * (query + kv + h)  # QKV and output projections
        mlp = self.expert_params()
        if self.num_experts:
            mlp *= self.num_experts
        return attention + mlp + self.norm_params()

    def expert_params(self) -> int:
        """Parameters of one MLP (one expert): ``fc1`` (doubled by SwiGLU's gate), ``fc2``, biases."""
        h, f = self.hidden_size, self.ffn_hidden_size
        up = 2 * f if self.swiglu else f
        return h * up + f * h + int(self.add_bias_linear) * (up + h)

    def norm_params(self) -> int:
        """The two norms of a layer: weight and bias each (LayerNorm) or weight only (RMSNorm)."""
        return 2 * self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)

    def embedding_params(self) -> int:
        """Word embeddings, plus position embeddings when they are learned."""
        positions = self.max_sequence_length if self.position_embedding_type == "learned_absolute" else 0
        return (self.vocab_size + positions) * self.hidden_size

    def total_params(self) -> int:
        """Parameters of the whole model (output layer tied to the word embedding)."""
        return self.num_layers * self.layer_params() + self.embedding_params() + self.norm_params() // 2

    def stage_layers(self, pp: int) -> int:
        """Layers of the busiest of ``pp`` stages (the first ones when they do not split evenly)."""
        return -(-self.num_layers // pp)

    def rank_seq_length(self, seq_length: int | None, cp: int = 1) -> int:
        """Tokens of a sequence one context-parallel rank holds (``seq_length`` defaults to the
        model's maximum)."""
        return (seq_length or self.max_sequence_length) // cp or 1

    def stage_params(self, pp: int, tp: int = 1, ep: int = 1, *, stage: int = 0) -> int:
        """Parameters one rank of ``stage`` holds (layers split evenly over ``pp``).

        The first stage holds the embeddings, the last the (untied) output layer; tensor
        parallelism divides everything but the layer norms, expert parallelism the experts.
        """
        layers = self.stage_layers(pp)
        per_layer = self.layer_params()
        if self.num_experts:
            expert = self.expert_params()
            per_layer -= expert * self.num_experts
            per_layer += expert * -(-self.num_experts // ep)
        params = layers * per_layer // tp
        if stage == 0 or stage == pp - 1:
            params += self.vocab_size * self.hidden_size // tp
        if stage == 0:
            params += self.embedding_params() - self.vocab_size * self.hidden_size
        return params

    def training_bytes(
        self,
        pp: int,
        tp: int = 1,
        ep: int = 1,
        *,
        micro_batch_size: int = 1,
        seq_length: int | None = None,
        in_flight: float | None = None,
        cp: int = 1,
        recomputed_layers: int = 0,
        selective_recompute: bool = False,
        optimizer_shards: int = 1,
    ) -> int:
        """Estimated bytes the busiest rank needs to really run a training step on CPU (fp32).

        Weights, gradients and Adam state (16 bytes per parameter; the 8 of Adam's moments split
        over ``optimizer_shards`` ranks by the distributed optimizer) of the larger of the first
        and last stage, plus the activations of ``in_flight`` micro-batches (default ``pp``, what
        1F1B keeps on the first stage; a fraction under interleaving) and the logits of one
        micro-batch.  A layer whose forward is recomputed (``recomputed_layers`` of the stage's)
        keeps only its input, and one layer's activations come back at a time; selective
        recompute drops the attention scores.  An order-of-magnitude figure for deciding whether a
        model can run for real on this machine, not a profile.
        """
        seq = self.rank_seq_length(seq_length, cp)
        in_flight = pp if in_flight is None else in_flight
        params = max(self.stage_params(pp, tp, ep, stage=0), self.stage_params(pp, tp, ep, stage=pp - 1))
        layers = self.stage_layers(pp)
        recomputed_layers = min(recomputed_layers, layers)
        b, s, h, a = micro_batch_size, seq, self.hidden_size, self.num_attention_heads
        # Korthikanti et al. (2022): 34*s*b*h + 5*a*s^2*b 16-bit bytes per layer without TP;
        # in fp32 elements that is 17*s*b*h + 2.5*a*s*s*b, split by TP (the second term is what
        # selective recompute drops).
        elements = (17 * s * b * h + (0 if selective_recompute else 5 * a * s * s * b // 2)) // tp
        kept = (layers - recomputed_layers) * elements + recomputed_layers * s * b * h
        rematerialised = elements if recomputed_layers else 0
        activations = int((kept * in_flight + rematerialised) * ACTIVATION_BYTES)
        logits = b * s * self.vocab_size // tp * ACTIVATION_BYTES * 3  # logits, softmax, its gradient
        state = TRAIN_BYTES_PER_PARAM - ADAM_MOMENT_BYTES + ADAM_MOMENT_BYTES / optimizer_shards
        return int(params * state) + activations + logits

    def training_flops(
        self,
        pp: int,
        tp: int = 1,
        ep: int = 1,
        *,
        micro_batch_size: int = 1,
        seq_length: int | None = None,
        cp: int = 1,
        recomputed_layers: int = 0,
    ) -> int:
        """Floating-point operations of one micro-batch's forward and backward on the busiest
        rank: ``6 * parameters * tokens`` for the layers (MoE: the ``top-2`` experts a token
        visits, at most all), the causal attention scores, and the output layer on the last stage;
        a recomputed layer runs its forward twice.
        """
        seq = self.rank_seq_length(seq_length, cp)
        tokens = micro_batch_size * seq
        layers = self.stage_layers(pp)
        h, f = self.hidden_size, self.ffn_hidden_size
        dense_params = 4 * h * h + 2 * h * f
        if self.num_experts:
            dense_params = 4 * h * h + 2 * h * f * min(2, self.num_experts)
        layer = 2 * dense_params * tokens // tp + 2 * micro_batch_size * seq * seq * h // tp
        logits = 2 * tokens * h * self.vocab_size // tp  # the last stage's; counted for the busiest rank
        return (3 * layers + min(recomputed_layers, layers)) * layer + 3 * logits

    # ---- Megatron ----------------------------------------------------------------------------

    def megatron_args(self, seq_length: int | None = None) -> list[str]:
        """The Megatron-LM flags that build this model (``pretrain_gpt.py``)."""
        seq = seq_length or self.max_sequence_length
        args = [
            "--num-layers", str(self.num_layers),
            "--hidden-size", str(self.hidden_size),
            "--num-attention-heads", str(self.num_attention_heads),
            "--ffn-hidden-size", str(self.ffn_hidden_size),
            "--seq-length", str(seq),
            "--max-position-embeddings", str(max(seq, self.max_sequence_length)),
            "--vocab-size", str(self.vocab_size),
        ]
        if not self.share_embeddings_and_output_weights:
            args.append("--untie-embeddings-and-output-weights")
        if self.num_experts:
            args += ["--num-experts", str(self.num_experts), "--moe-router-topk", str(self.moe_router_topk)]
            if self.moe_ffn_hidden_size:
                args += ["--moe-ffn-hidden-size", str(self.moe_ffn_hidden_size)]
            if self.moe_expert_capacity_factor is not None:
                args += ["--moe-expert-capacity-factor", f"{self.moe_expert_capacity_factor:g}"]
            if self.moe_pad_expert_input_to_capacity:
                args.append("--moe-pad-expert-input-to-capacity")
        if self.num_query_groups:
            args += ["--group-query-attention", "--num-query-groups", str(self.num_query_groups)]
        if self.swiglu:
            args.append("--swiglu")
        if self.normalization != "LayerNorm":
            args += ["--normalization", self.normalization]
        if self.position_embedding_type != "learned_absolute":
            args += ["--position-embedding-type", self.position_embedding_type]
        if self.kv_channels:
            args += ["--kv-channels", str(self.kv_channels)]
        if not self.add_bias_linear:
            args.append("--disable-bias-linear")
        args += ["--hidden-dropout", f"{self.hidden_dropout:g}", "--attention-dropout", f"{self.attention_dropout:g}"]
        if self.make_vocab_size_divisible_by != 128:
            args += ["--make-vocab-size-divisible-by", str(self.make_vocab_size_divisible_by)]
        return args


#: the MoE fields of a ModelSpec, named as Megatron-LM's flags (``--moe-router-topk``, ...)
MOE_FIELDS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_expert_capacity_factor",
              "moe_pad_expert_input_to_capacity")


def _registry(*specs: ModelSpec) -> dict[str, ModelSpec]:
    return {spec.name: spec for spec in specs}


def _gpt(name: str, hidden: int, heads: int, layers: int, **fields: Any) -> ModelSpec:
    return ModelSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, name=name, **fields)


#: Every named model, in size order.
MODELS: dict[str, ModelSpec] = _registry(
    _gpt("tiny", 128, 8, 4, vocab_size=1024, max_sequence_length=256),
    _gpt("6.7B", 4096, 32, 32),
    _gpt("13B", 5120, 32, 40),
    _gpt("30B", 7680, 48, 40),
    _gpt("40B", 9216, 72, 40),
    _gpt("70B", 8192, 64, 80),
    _gpt("175B", 12288, 96, 96),
    _gpt("485B", 20480, 160, 96),
    _gpt("1T", 25600, 160, 128),
    _gpt("2T", 25600, 160, 256),
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


def get_model(name: str | ModelSpec) -> ModelSpec:
    """The model called ``name`` (``"tiny"``, ``"6.7"``, ``"175B"``, ``"1T"``, ...).

    A :class:`ModelSpec` is returned as is.  An unknown name raises ``ValueError`` listing the
    valid ones.
    """
    if isinstance(name, ModelSpec):
        return name
    shape = _BY_KEY.get(_key(str(name)))
    if shape is None:
        raise ValueError(f"unknown model {name!r}; use one of {', '.join(MODELS)}")
    return shape


# --------------------------------------------------------------------------------------------
# the model as command-line flags: a named size, Megatron-LM's own flags, or both


def add_model_arguments(parser, moe: bool = False) -> None:
    """``--model NAME`` and the Megatron-LM flags that describe a GPT (same names, same meaning),
    with ``moe`` those of its experts too; :func:`model_from_args` reads them back."""
    g = parser.add_argument_group("model (a named size, Megatron-LM's flags, or a size with flags that change it)")
    g.add_argument("--model", metavar="NAME", help=f"a named size: {', '.join(MODELS)}")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--num-query-groups", "--ffn-hidden-size",
                 "--vocab-size", "--max-position-embeddings", "--kv-channels", "--make-vocab-size-divisible-by"):
        g.add_argument(flag, type=int, metavar="N")
    g.add_argument("--group-query-attention", action="store_true", default=None,
                   help="key/value heads shared by --num-query-groups (default 1) groups of query heads")
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--normalization", choices=NORMALIZATIONS)
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDINGS)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false", default=None)
    for flag in ("--hidden-dropout", "--attention-dropout"):
        g.add_argument(flag, type=float, metavar="P", help="default 0.1")
    if moe:
        _add_moe_arguments(parser)


def _add_moe_arguments(parser) -> None:
    moe = parser.add_argument_group("mixture of experts (Megatron-LM's flags; with --num-experts)")
    moe.add_argument("--moe-router-topk", type=int, metavar="K", help="experts each token is routed to (default 2)")
    moe.add_argument("--moe-ffn-hidden-size", type=int, metavar="N",
                     help="an expert's FFN width (default --ffn-hidden-size)")
    moe.add_argument("--moe-expert-capacity-factor", type=float, metavar="F",
                     help="tokens an expert takes, as a multiple of its fair share (default: dropless)")
    moe.add_argument("--moe-pad-expert-input-to-capacity", action="store_true", default=None,
                     help="pad every expert's input to its capacity (fixed all-to-all sizes)")


def model_from_args(args) -> ModelSpec:
    """The model of :func:`add_model_arguments`' flags; ValueError (one line) when they describe none."""
    fields = {name: getattr(args, flag) for name, flag in (
        ("num_layers", "num_layers"), ("hidden_size", "hidden_size"), ("num_attention_heads", "num_attention_heads"),
        ("num_query_groups", "num_query_groups"), ("ffn_hidden_size", "ffn_hidden_size"), ("vocab_size", "vocab_size"),
        ("max_sequence_length", "max_position_embeddings"), ("swiglu", "swiglu"), ("normalization", "normalization"),
        ("position_embedding_type", "position_embedding_type"), ("kv_channels", "kv_channels"),
        ("make_vocab_size_divisible_by", "make_vocab_size_divisible_by"), ("add_bias_linear", "add_bias_linear"),
        ("hidden_dropout", "hidden_dropout"), ("attention_dropout", "attention_dropout"),
    ) if getattr(args, flag, None) is not None}
    fields.update({name: getattr(args, name) for name in MOE_FIELDS if getattr(args, name, None) is not None})
    if getattr(args, "untie_embeddings_and_output_weights", None):
        fields["share_embeddings_and_output_weights"] = False
    if getattr(args, "group_query_attention", None):
        fields.setdefault("num_query_groups", 1)  # Megatron-LM's default
    elif "num_query_groups" in fields:
        raise ValueError("--num-query-groups needs --group-query-attention (Megatron-LM ignores it without)")
    if args.model:
        base = get_model(args.model)
        if "hidden_size" in fields:
            fields.setdefault("ffn_hidden_size", None)  # 4 x the new hidden size, as Megatron-LM defaults
        return dataclasses.replace(base, **fields, name=base.name if not fields else "")
    missing = [f"--{n.replace('_', '-')}" for n in ("num_layers", "hidden_size", "num_attention_heads") if n not in fields]
    if missing:
        raise ValueError(f"no model given: pass --model NAME ({', '.join(MODELS)}) or {', '.join(missing)}")
    return ModelSpec(**fields)

