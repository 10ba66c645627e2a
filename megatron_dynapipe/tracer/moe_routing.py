"""MoE routing every traced rank can predict: each token picks its experts by its position, so a
rank's peers route the counts it routes itself and dropless all-to-alls pair up."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megatron_dynapipe.compat.patching import Patches, UpstreamChanged

__all__ = ["balanced_routing", "balanced_logits"]


@contextlib.contextmanager
def balanced_routing() -> Iterator[None]:
    """Route every token by :func:`balanced_logits` (put back on exit; the router calls it when
    the config asks for ``moe_router_force_load_balancing``, Megatron-LM's benchmark switch).

    Why: with dropless routing the expert all-to-alls are sized by how many tokens each rank
    routes to each expert, and a traced rank sees only its own routing (its fake peers answer
    the count all-gather with copies of its own counts). Megatron's own switch draws random
    scores from a per-rank seed, so the peers' counts would still be unknowable. Routing that
    depends only on a token's position gives every rank the same counts, so what a rank expects
    to receive is what its peers send -- the balanced routing a trained router's auxiliary loss
    aims at; the weights of a model traced with random weights on random tokens say nothing
    about real routing anyway.
    """
    from megatron.core.transformer.moe import moe_utils, router

    with Patches() as patches:
        patches.replace(moe_utils, "apply_random_logits", balanced_logits)
        if vars(router).get("apply_random_logits") is not balanced_logits:
            raise UpstreamChanged("megatron.core.transformer.moe.router no longer calls apply_random_logits: "
                                  "review tracer/moe_routing.py balanced_routing")
        yield


def balanced_logits(logits: torch.Tensor) -> torch.Tensor:
    """Router scores that make token t (in flattened order) pick experts t, t+1, ... (mod E) as
    its top-k: over any E consecutive tokens every expert is picked k times. Straight through:
    the forward sees the scores, the router's gradient is the one its own logits get."""
    experts = logits.shape[-1]
    token = torch.arange(logits.numel() // experts, device=logits.device).reshape(*logits.shape[:-1], 1)
    scores = -torch.remainder(torch.arange(experts, device=logits.device) - token, experts).to(logits.dtype)
    return logits + (scores - logits).detach()
