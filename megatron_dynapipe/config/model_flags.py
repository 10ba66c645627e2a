"""A :class:`~megatron_dynapipe.config.model.ModelSpec` as Megatron-LM's flags, both ways.

* :func:`add_model_arguments` / :func:`model_from_args`: this package's commands take a named
  size (``--model 6.7``), Megatron-LM's own flags, or a size with flags that change it;
* :func:`model_from_megatron_args`: the model a parsed ``pretrain_gpt.py`` namespace builds;
* :func:`megatron_model_args`: the ``pretrain_gpt.py`` flags that build a model.

Both readers take the same flag names through one table, so a flag understood once is
understood everywhere.  Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_dynapipe.config.model import (
    CORES,
    MODELS,
    MOE_FIELDS,
    NORMALIZATIONS,
    POSITION_EMBEDDINGS,
    ModelSpec,
    get_model,
)

__all__ = ["add_attention_arguments", "add_model_arguments", "attention_flags_given", "attention_from_args",
           "model_from_args", "model_from_megatron_args", "megatron_model_args", "transformer_engine_layers"]

TRANSFORMER_IMPLS = ("local", "transformer_engine")  # Megatron-LM's --transformer-impl

#: ModelSpec field -> the namespace name of the Megatron-LM flag that sets it
_FLAG_FIELDS = {
    "num_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
    "ffn_hidden_size": "ffn_hidden_size", "vocab_size": "vocab_size", "swiglu": "swiglu",
    "normalization": "normalization", "position_embedding_type": "position_embedding_type",
    "kv_channels": "kv_channels", "make_vocab_size_divisible_by": "make_vocab_size_divisible_by",
    "add_bias_linear": "add_bias_linear", "hidden_dropout": "hidden_dropout",
    "attention_dropout": "attention_dropout", "attention": "attention", **{name: name for name in MOE_FIELDS},
}


def add_model_arguments(parser, moe: bool = False, attention: str = "local") -> None:
    """``--model NAME`` and the Megatron-LM flags that describe a GPT (same names, same meaning),
    with ``moe`` those of its experts too; :func:`model_from_args` reads them back. ``attention``:
    the core the command builds when no flag chooses one (:func:`add_attention_arguments`)."""
    g = parser.add_argument_group("model (a named size, Megatron-LM's flags, or a size with flags that change it)")
    g.add_argument("--model", metavar="NAME", help=f"a named size: {', '.join(MODELS)} (default: the command's)")
    for flag, what in (("--num-layers", "transformer layers"), ("--hidden-size", "model width"),
                       ("--num-attention-heads", "attention heads"),
                       ("--num-query-groups", "key/value groups with --group-query-attention"),
                       ("--ffn-hidden-size", "MLP width (default 4 x hidden, or Megatron's SwiGLU width)"),
                       ("--vocab-size", "tokenizer vocabulary, padded as Megatron pads it"),
                       ("--max-position-embeddings", "longest sequence the model takes"),
                       ("--kv-channels", "width of an attention head (default hidden / heads)"),
                       ("--make-vocab-size-divisible-by", "vocabulary padding multiple (default 128)")):
        g.add_argument(flag, type=int, metavar="N", help=f"{what} (default: --model's)"
                       if "default" not in what else what)
    g.add_argument("--group-query-attention", action="store_true", default=None,
                   help="key/value heads shared by --num-query-groups (default 1) groups of query heads")
    g.add_argument("--swiglu", action="store_true", default=None, help="SwiGLU MLP (default: GELU)")
    g.add_argument("--normalization", choices=NORMALIZATIONS, help="default LayerNorm")
    g.add_argument("--position-embedding-type", metavar="TYPE",
                   help=f"{', '.join(POSITION_EMBEDDINGS)} (default learned_absolute)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None,
                   help="a separate output layer (default: tied to the embedding)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false", default=None,
                   help="no biases in the linear layers (default: biases)")
    add_attention_arguments(g, attention)
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


def _flag_fields(args: Any) -> dict[str, Any]:
    """The ModelSpec fields the flags in ``args`` set (a flag not given, or None, sets nothing)."""
    fields = {name: getattr(args, flag) for name, flag in _FLAG_FIELDS.items() if getattr(args, flag, None) is not None}
    if getattr(args, "untie_embeddings_and_output_weights", None):
        fields["share_embeddings_and_output_weights"] = False
    if getattr(args, "group_query_attention", None):
        fields["num_query_groups"] = getattr(args, "num_query_groups", None) or 1  # Megatron-LM's default
    return fields


def add_attention_arguments(group, attention: str = "local") -> None:
    """The flags that choose the attention core: ``--attention`` and Megatron-LM's
    ``--transformer-impl`` and ``--use-flash-attn`` (:func:`attention_from_args` reads them);
    ``attention``: the core when none of them is given (``transformer_engine`` for the commands
    that model a Megatron-LM job, as Megatron-LM builds transformer-engine's layers by default)."""
    group.set_defaults(default_attention=attention)
    group.add_argument("--attention", choices=CORES,
                       help="the attention core of megatron-core's local layers (implies --transformer-impl local): "
                            "local (megatron-core's unfused one) or sdpa (torch's scaled_dot_product_attention: "
                            f"fused kernels on CUDA, packed micro-batches) (default: {attention})")
    layers = "transformer_engine, as Megatron-LM's" if attention == "transformer_engine" else "local"
    group.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS,
                       help="Megatron-LM's layer implementation: transformer_engine brings its fused attention core, "
                            "priced at that kernel's rate (where transformer-engine is not installed torch's SDPA core "
                            f"stands in for it); local: megatron-core's own layers (default: {layers})")
    group.add_argument("--use-flash-attn", action="store_true", default=None,
                       help="Megatron-LM's flash attention in the local layers: a fused core, as --attention sdpa")


def attention_flags_given(args: Any) -> bool:
    """Whether any of :func:`add_attention_arguments`' flags was given."""
    return any(getattr(args, flag, None) for flag in ("attention", "transformer_impl", "use_flash_attn"))


def attention_from_args(args: Any) -> "str | None":
    """The attention core :func:`add_attention_arguments`' flags ask for, their default where none
    is given (None where there is no such default): ``--transformer-impl transformer_engine``
    transformer-engine's fused core (its layers bring their own); ``--attention`` a core of
    megatron-core's local layers; ``--use-flash-attn`` a flash kernel in them: ``sdpa``, torch's,
    which runs one; ``--transformer-impl local`` alone megatron-core's unfused core."""
    attention, impl = getattr(args, "attention", None), getattr(args, "transformer_impl", None)
    if impl == "transformer_engine":
        if attention or getattr(args, "use_flash_attn", None):
            raise ValueError("--attention and --use-flash-attn choose the core of megatron-core's local layers, and "
                             "--transformer-impl transformer_engine builds transformer-engine's: drop one of them")
        return "transformer_engine"
    if getattr(args, "use_flash_attn", None):
        if attention == "local":
            raise ValueError("--attention local is megatron-core's unfused core, which --use-flash-attn replaces by a "
                             "fused one: drop one of them")
        return "sdpa"
    if attention or impl == "local":
        return attention or "local"
    return getattr(args, "default_attention", None)


def model_from_args(args, default: "str | None" = None) -> ModelSpec:
    """The model of :func:`add_model_arguments`' flags, the named model ``default`` when they name
    none; ValueError (one line) when they describe none and there is no default."""
    fields = _flag_fields(args)
    if attention_from_args(args):
        fields["attention"] = attention_from_args(args)
    if getattr(args, "max_position_embeddings", None) is not None:
        fields["max_sequence_length"] = args.max_position_embeddings
    if getattr(args, "num_query_groups", None) is not None and "num_query_groups" not in fields:
        raise ValueError("--num-query-groups needs --group-query-attention (Megatron-LM ignores it without)")
    name = args.model or (default if not {"num_layers", "hidden_size", "num_attention_heads"} & set(fields) else None)
    if name:
        base = get_model(name)
        if "hidden_size" in fields:
            fields.setdefault("ffn_hidden_size", None)  # 4 x the new hidden size, as Megatron-LM defaults
        # the core alone keeps the name (the label says the core): other fields make another model
        return dataclasses.replace(base, **fields, name="" if set(fields) - {"attention"} else base.name)
    missing = [f"--{n.replace('_', '-')}" for n in ("num_layers", "hidden_size", "num_attention_heads")
               if n not in fields]
    if missing:
        raise ValueError(f"no model given: pass --model NAME ({', '.join(MODELS)}) or {', '.join(missing)}")
    return ModelSpec(**fields)


def transformer_engine_layers(args: Any) -> bool:
    """Whether a Megatron-LM job's parsed arguments build transformer-engine's layers:
    ``--transformer-impl`` given or not, as Megatron-LM's default is transformer_engine."""
    return (getattr(args, "transformer_impl", None) or "transformer_engine") != "local"


def model_from_megatron_args(args: Any) -> ModelSpec:
    """The model Megatron-LM's parsed arguments build (``--num-layers``, ``--hidden-size``, ...):
    sequences up to the longer of ``--seq-length`` and ``--max-position-embeddings``, the
    vocabulary as given or as Megatron padded it, ``--num-experts`` experts, the attention core:
    transformer-engine's with its layers (:func:`transformer_engine_layers`: they bring their own),
    else the one ``--dynapipe-attention`` builds into megatron-core's local layers."""
    fields = _flag_fields(args)
    seq = getattr(args, "seq_length", None) or 0
    fields["max_sequence_length"] = max(seq, getattr(args, "max_position_embeddings", None) or seq)
    fields.setdefault("vocab_size", getattr(args, "padded_vocab_size", None))
    fields["num_experts"] = getattr(args, "num_experts", None) or 0
    fields["attention"] = ("transformer_engine" if transformer_engine_layers(args)
                           else getattr(args, "dynapipe_attention", None))
    return ModelSpec(**{k: v for k, v in fields.items() if v is not None})


def megatron_model_args(spec: ModelSpec, seq_length: int | None = None) -> list[str]:
    """The Megatron-LM flags that build ``spec`` (``pretrain_gpt.py``; its SDPA core with this
    package's ``--dynapipe-attention``)."""
    seq = seq_length or spec.max_sequence_length
    args = [
        "--num-layers", str(spec.num_layers),
        "--hidden-size", str(spec.hidden_size),
        "--num-attention-heads", str(spec.num_attention_heads),
        "--ffn-hidden-size", str(spec.ffn_hidden_size),
        "--seq-length", str(seq),
        "--max-position-embeddings", str(max(seq, spec.max_sequence_length)),
        "--vocab-size", str(spec.vocab_size),
    ]
    if not spec.share_embeddings_and_output_weights:
        args.append("--untie-embeddings-and-output-weights")
    if spec.num_experts:
        args += ["--num-experts", str(spec.num_experts), "--moe-router-topk", str(spec.moe_router_topk)]
        if spec.moe_ffn_hidden_size:
            args += ["--moe-ffn-hidden-size", str(spec.moe_ffn_hidden_size)]
        if spec.moe_expert_capacity_factor is not None:
            args += ["--moe-expert-capacity-factor", f"{spec.moe_expert_capacity_factor:g}"]
        if spec.moe_pad_expert_input_to_capacity:
            args.append("--moe-pad-expert-input-to-capacity")
    if spec.num_query_groups:
        args += ["--group-query-attention", "--num-query-groups", str(spec.num_query_groups)]
    if spec.swiglu:
        args.append("--swiglu")
    if spec.normalization != "LayerNorm":
        args += ["--normalization", spec.normalization]
    if spec.position_embedding_type != "learned_absolute":
        args += ["--position-embedding-type", spec.position_embedding_type]
    if spec.kv_channels:
        args += ["--kv-channels", str(spec.kv_channels)]
    if not spec.add_bias_linear:
        args.append("--disable-bias-linear")
    args += ["--hidden-dropout", f"{spec.hidden_dropout:g}", "--attention-dropout", f"{spec.attention_dropout:g}"]
    if spec.make_vocab_size_divisible_by != 128:
        args += ["--make-vocab-size-divisible-by", str(spec.make_vocab_size_divisible_by)]
    # said either way: Megatron-LM builds transformer-engine's layers unless told otherwise
    if spec.attention == "transformer_engine":
        return args + ["--transformer-impl", "transformer_engine"]
    sdpa = ["--dynapipe-attention", "sdpa"] if spec.attention == "sdpa" else []
    return args + ["--transformer-impl", "local", *sdpa]
