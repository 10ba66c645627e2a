"""``--dynapipe-attention sdpa``: a Megatron-LM job's local layers with the SDPA attention core.

Without transformer-engine (``--transformer-impl local``: every ``--cpu`` run, and a GPU where TE
is not installed) Megatron-LM builds its layers from megatron-core's ``get_gpt_layer_local_spec``,
whose attention core computes attention unfused and refuses packed (THD) micro-batches, so
``--dynapipe-packing varlen`` cannot run on it. With ``--dynapipe-attention sdpa``, while the
script's model provider builds the model, every binding of ``get_gpt_layer_local_spec`` returns
its spec with :class:`~megatron_dynapipe.gpt.attention.SDPAttention` as the core (pretrain_gpt's
builder and megatron-core's MoE block spec both call it); afterwards the original is back. The
builders that never call it (``--spec``, the legacy model, experimental attention variants,
heterogeneous layers) are refused in one line rather than silently keeping the unfused core.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from typing import Callable, Iterator

from megatron_dynapipe.compat.patching import Patches, Spot, check_spots
from megatron_dynapipe.megatron_lm.arguments import DynapipeArgumentError

__all__ = ["LOCAL_SPEC_SPOT", "check_attention_args", "layer_attention"]

REVIEW = "LOCAL_SPEC_SPOT in megatron_dynapipe/megatron_lm/attention.py (written for megatron-core 0.16.1)"


def _with_sdpa_core(original: Callable) -> Callable:
    from megatron_dynapipe.gpt.attention import SDPAttention
    from megatron_dynapipe.gpt.build import with_core_attention

    @functools.wraps(original)
    def get_gpt_layer_local_spec(*args, **kwargs):
        return with_core_attention(original(*args, **kwargs), SDPAttention)

    return get_gpt_layer_local_spec


LOCAL_SPEC_SPOT = Spot("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec",
                       ("core_attention=backend.core_attention()",),
                       "the attention core of the local spec's layers is what the SDPA core replaces",
                       kind="replace", replacement=_with_sdpa_core)

# (namespace name, flag) of the Megatron-LM builders that never call get_gpt_layer_local_spec
_OTHER_BUILDERS = (("spec", "--spec"), ("use_legacy_models", "--use-legacy-models"),
                   ("experimental_attention_variant", "--experimental-attention-variant"),
                   ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path"))


def _sdpa(args: argparse.Namespace) -> bool:
    return getattr(args, "dynapipe_attention", None) == "sdpa"


def check_attention_args(args: argparse.Namespace) -> None:
    """Refuse, in one line naming the fix, a ``--dynapipe-attention sdpa`` the model will not get."""
    if not _sdpa(args):
        return
    if getattr(args, "transformer_impl", "transformer_engine") != "local":
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
    the SDPA core (checked first: :func:`check_attention_args`); otherwise nothing changes."""
    check_attention_args(args)
    if not _sdpa(args):
        yield
        return
    [(spot, owner, name, original)] = check_spots([LOCAL_SPEC_SPOT], REVIEW)
    with Patches() as patches:
        # every module that bound it: pretrain_gpt's builder (gpt_builders, outside the megatron
        # package) calls its own binding
        patches.replace(owner, name, spot.replacement(original), where=lambda _module: True)
        yield
