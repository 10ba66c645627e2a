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

__all__ = ["MODELS", "DEFAULT_MODEL", "ModelSpec", "get_model", "model_names", "MOE_FIELDS", "NORMALIZATIONS",
           "POSITION_EMBEDDINGS", "ATTENTIONS", "ATTENTION_WORDS", "CORES", "padded_vocab_size"]


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int = 1) -> int:
    """The vocabulary Megatron-LM builds: ``vocab_size`` padded to a multiple of ``divisible_by * tp``
    (its ``--make-vocab-size-divisible-by`` times the tensor-parallel size)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
#: attention cores: megatron-core's unfused one, torch's SDPA (what --attention sdpa builds) and
#: transformer-engine's fused one (--transformer-impl transformer_engine; built as SDPA where
#: transformer-engine is not installed); CORES are the ones a local layer spec builds (--attention)
ATTENTIONS = ("local", "sdpa", "transformer_engine")
CORES = ("local", "sdpa")
#: the label suffix of a fused core's model (its traces time another attention)
_CORE_LABELS = {"sdpa": "-sdpa", "transformer_engine": "-te"}
#: each attention core in words, with the flag that chooses it
ATTENTION_WORDS = {
    "local": "megatron-core's unfused local core (--transformer-impl local)",
    "sdpa": "torch's scaled_dot_product_attention on megatron-core's local layers (--attention sdpa)",
    "transformer_engine": "transformer-engine's fused core (--transformer-impl transformer_engine)",
}


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
    #: the attention core: "local", megatron-core's own unfused one (an s x s score matrix per
    #: head), "sdpa", torch's scaled_dot_product_attention (flash and memory-efficient kernels on
    #: CUDA; also runs packed micro-batches), or "transformer_engine", the fused core of
    #: transformer-engine's layers (cuDNN's on Hopper), priced at its own kernel's rate. The
    #: commands that model a Megatron-LM job (trace, search, plan on --hardware) build the last one
    #: unless told otherwise, as Megatron-LM does; a spec made here runs on any machine, TE or not
    attention: str = "local"
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
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention {self.attention!r}: use one of {', '.join(ATTENTIONS)}")
        self._check_moe()
        if self.position_embedding_type == "alibi":
            raise ValueError("position_embedding_type 'alibi': megatron-core's GPTModel has no ALiBi (BLOOM trained "
                             "it with Megatron-DeepSpeed); use rope, which like ALiBi adds no parameters and "
                             "costs about as little")
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
    def fused_attention(self) -> bool:
        """Whether its attention core is fused (torch's SDPA, flash, transformer-engine's): the
        causal half computed, no scores kept; megatron-core's local core is not."""
        return self.attention != "local"

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups``, else one per attention head."""
        return self.num_query_groups or self.num_attention_heads

    def padded_vocab_size(self, tp: int = 1) -> int:
        """The vocabulary Megatron-LM builds at tensor-parallel size ``tp``: padded to a multiple
        of ``make_vocab_size_divisible_by * tp``."""
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

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

    @property
    def label(self) -> str:
        """The name used in folder names: the registry name, or ``h<hidden>l<layers>``; ``-sdpa``
        or ``-te`` after it for a fused attention core (its traces time another attention)."""
        name = self.name or f"h{self.hidden_size}l{self.num_layers}"
        return name + _CORE_LABELS.get(self.attention, "")

    def with_experts(self, num_experts: int) -> "ModelSpec":
        return dataclasses.replace(self, num_experts=num_experts)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- structure ---------------------------------------------------------------------------

    def stage_layers(self, pp: int) -> int:
        """Layers of the busiest of ``pp`` stages (the first ones when they do not split evenly)."""
        return -(-self.num_layers // pp)

    def rank_seq_length(self, seq_length: int | None, cp: int = 1) -> int:
        """Tokens of a sequence one context-parallel rank holds (``seq_length`` defaults to the
        model's maximum)."""
        return (seq_length or self.max_sequence_length) // cp or 1


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


#: The model the commands (trace, search) use when the command line names none.
DEFAULT_MODEL = "6.7"


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
