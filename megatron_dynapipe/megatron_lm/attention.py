"""A Megatron-LM job's local layers with DynaPipe's attention cores: SDPA, and the CP ring.

Without transformer-engine (``--transformer-impl local``: every ``--cpu`` run, and a GPU where TE
is not installed) Megatron-LM builds its layers from megatron-core's ``get_gpt_layer_local_spec``,
whose attention core computes attention unfused and refuses packed (THD) micro-batches, so
``--dynapipe-packing varlen`` cannot run on it. With ``--dynapipe-attention sdpa``, while the
model is built, every binding of ``get_gpt_layer_local_spec`` returns its spec with
:class:`~megatron_dynapipe.gpt.attention.SDPAttention` as the core (pretrain_gpt's builder and
megatron-core's MoE block spec both call it); afterwards the original is back. "While the model is
built" is the script's model provider before core_v0.19 (:func:`layer_attention`) and, from
core_v0.19, the ``GPTModelConfig.transformer_layer_spec`` it builds from (:func:`local_attention_layer_spec`). The
builders that never call it (``--spec``, the legacy model, experimental attention variants,
heterogeneous layers) are refused in one line rather than silently keeping the unfused core.

With ``--context-parallel-size`` > 1 on local layers (whose core refuses it), the same seam gives
them their core -- the unfused or the SDPA one -- wrapped to pass keys and values round the
context-parallel group's ring (:mod:`megatron_dynapipe.gpt.context_parallel`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from typing import Callable, Iterator, Optional

from megatron_dynapipe.compat.patching import Patches, check_spots
from megatron_dynapipe.compat.upstream import LOCAL_CORE_ATTENTION
from megatron_dynapipe.config.model_flags import transformer_engine_layers
from megatron_dynapipe.megatron_lm.arguments import DynapipeArgumentError

__all__ = ["check_attention_args", "layer_attention", "local_attention_layer_spec", "local_context_parallel",
           "replaces_local_core"]

REVIEW = "megatron_dynapipe/megatron_lm/attention.py (LOCAL_CORE_ATTENTION in megatron_dynapipe/compat/upstream.py)"


def _with_core(original: Callable, attention: str, context_parallel: bool) -> Callable:
    from megatron_dynapipe.gpt.build import with_local_attention

    @functools.wraps(original)
    def get_gpt_layer_local_spec(*args, **kwargs):
        return with_local_attention(original(*args, **kwargs), attention, context_parallel)

    return get_gpt_layer_local_spec

# (namespace name, flag) of the Megatron-LM builders that never call get_gpt_layer_local_spec
_OTHER_BUILDERS = (("spec", "--spec"), ("use_legacy_models", "--use-legacy-models"),
                   ("experimental_attention_variant", "--experimental-attention-variant"),
                   ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path"))


def _sdpa(args: argparse.Namespace) -> bool:
    return getattr(args, "dynapipe_attention", None) == "sdpa"


def replaces_local_core(args: argparse.Namespace) -> bool:
    """Whether the job's local layers get another attention core than megatron-core's."""
    return _sdpa(args) or local_context_parallel(args)


def local_context_parallel(args: argparse.Namespace) -> bool:
    """Context parallelism on megatron-core's local layers, whose core refuses it: the ring's core runs it."""
    return (getattr(args, "context_parallel_size", 1) or 1) > 1 \
        and not transformer_engine_layers(args)


def check_attention_args(args: argparse.Namespace) -> None:
    """Refuse, in one line naming the fix, a ``--dynapipe-attention sdpa`` the model will not get,
    and context parallelism on local layers with attention dropout (the ring's core draws none, and
    would fail at the first forward on every rank)."""
    dropout = getattr(args, "attention_dropout", 0.0) or 0.0
    if local_context_parallel(args) and dropout > 0 and not getattr(args, "is_scaling_mode", False):  # traces: none
        raise DynapipeArgumentError(
            f"--context-parallel-size {args.context_parallel_size} on megatron-core's local layers runs this "
            f"package's KV ring, which draws no attention dropout (--attention-dropout {dropout:g}, Megatron's "
            "default 0.1): pass --attention-dropout 0, or use --transformer-impl transformer_engine")
    if not _sdpa(args):
        return
    if transformer_engine_layers(args):
        raise DynapipeArgumentError(
            "--dynapipe-attention sdpa replaces the attention core of megatron-core's local layers; "
            "transformer-engine's layers bring their own (which run packed micro-batches): pass "
            "--transformer-impl local, or drop --dynapipe-attention")
    for name, flag in _OTHER_BUILDERS:
        if getattr(args, name, None):
            raise DynapipeArgumentError(
                f"{flag} builds layers without megatron-core's local spec, whose attention core "
                "--dynapipe-attention sdpa replaces: drop one of them (or use "
                "megatron_dynapipe.gpt.attention.SDPAttention as the core_attention of your own spec)")


@contextlib.contextmanager
def layer_attention(args: argparse.Namespace) -> Iterator[None]:
    """Build the model inside this: with ``--dynapipe-attention sdpa`` the local spec's layers get
    the SDPA core (checked first: :func:`check_attention_args`), and with ``--context-parallel-size``
    their core (the local or the SDPA one) passes keys and values round the CP ring; otherwise
    nothing changes."""
    check_attention_args(args)
    if not replaces_local_core(args):
        yield
        return
    [(_spot, owner, name, original)] = check_spots([LOCAL_CORE_ATTENTION], REVIEW)
    with Patches() as patches:
        # every module that bound it: pretrain_gpt's builder (gpt_builders, outside the megatron
        # package) calls its own binding
        patches.replace(owner, name, _with_core(original, "sdpa" if _sdpa(args) else "local",
                                                local_context_parallel(args)), where=lambda _module: True)
        yield


def local_attention_layer_spec(args: argparse.Namespace) -> Callable:
    """A core_v0.19 ``GPTModelConfig.transformer_layer_spec``: Megatron-LM's own choice of layers
    (``default_layer_spec``), made while the local spec gives them DynaPipe's core (:func:`layer_attention`)."""
    from megatron_dynapipe.compat.megatron_lm_script import default_layer_spec

    default = default_layer_spec()

    def transformer_layer_spec(config, vp_stage: Optional[int] = None):
        with layer_attention(args):
            return default(config, vp_stage)

    return transformer_layer_spec
