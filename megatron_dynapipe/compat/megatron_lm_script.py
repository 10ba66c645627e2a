"""Where Megatron-LM's ``pretrain_gpt.py`` differs between the supported tags (core_v0.16.1 to
core_v0.19.x), recognised by what the checkout contains:

* **where arguments are parsed.** Through core_v0.17 ``pretrain`` parses them (from its
  ``extra_args_provider`` and ``args_defaults``). From core_v0.18 the script's ``__main__`` calls
  ``megatron.training.arguments.parse_and_validate_args`` before ``pretrain``:
  :func:`argument_parser` finds that function where it exists, so DynaPipe's flags join that
  parse and its setup runs right after Megatron's validation.
* **``pretrain``'s parameters.** core_v0.18 puts a config container first; core_v0.19 drops the
  model provider (the model comes from the container's ``GPTModelConfig``).
  :func:`bind_pretrain` binds a call by ``pretrain``'s own signature, so each hook is put in by
  parameter name, whatever the order.
* **the model's layer spec.** Before core_v0.19 the script's model provider builds the model
  (from megatron-core's ``get_gpt_layer_local_spec``); from core_v0.19 ``GPTModelConfig`` does,
  from its ``transformer_layer_spec``, the supported way to choose layers: :func:`model_config`.
* **what ``get_batch`` returns.** A six-tuple (tokens, labels, loss mask, attention mask,
  positions, packed-sequence parameters) through core_v0.17; from core_v0.18 the values of the
  script's ``BATCH_KEYS`` in that order: :func:`batch_keys`.
* **an SFT conversation's end.** Megatron-LM's ``SFTDataset`` appended an EOD token to each
  conversation (trained as a target) before core_v0.19, and does not since: :func:`sft_appends_eod`.

megatron-core's differences are :mod:`.upstream`'s, and the CPU redirection's are the
:class:`~.patching.OneOf` entries of :mod:`.cpu_compat` and :mod:`.megatron_lm_cpu`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional, Sequence

from megatron_dynapipe.compat.patching import OneOf, Spot, UpstreamChanged, check_spots

__all__ = ["ARGUMENT_PARSING", "DEFAULT_LAYER_SPEC", "SFT_EOD", "argument_parser", "batch_keys", "bind_pretrain",
           "default_layer_spec", "model_config", "sft_appends_eod"]

REVIEW = "megatron_dynapipe/compat/megatron_lm_script.py"

#: Who parses Megatron-LM's arguments: the script, through ``parse_and_validate_args`` (which sets
#: Megatron's global arguments once they are validated: core_v0.18 and later), or ``pretrain``
#: itself, through ``initialize_megatron``.
ARGUMENT_PARSING = OneOf(
    Spot("megatron.training.arguments", "parse_and_validate_args",
         ("parse_args(extra_args_provider", "validate_args(args", "set_global_variables(args)"),
         "the script parses and validates the arguments before pretrain (core_v0.18 and later)"),
    Spot("megatron.training.initialize", "initialize_megatron", ("parse_args(extra_args_provider",),
         "pretrain parses the arguments, from its extra_args_provider"),
)


def argument_parser() -> Optional[tuple[Any, str, Callable]]:
    """``(module, name, function)`` of ``parse_and_validate_args`` where the script parses the
    arguments itself (core_v0.18 and later), None where ``pretrain`` does."""
    [(spot, owner, name, original)] = check_spots([ARGUMENT_PARSING], REVIEW)
    return (owner, name, original) if spot.qualname == "parse_and_validate_args" else None


#: pretrain's parameters the launcher hooks, by name (the same in every supported tag)
_DATASETS, _FORWARD_STEP = "train_valid_test_dataset_provider", "forward_step_func"


def bind_pretrain(pretrain: Callable, args: Sequence, kwargs: Mapping) -> inspect.BoundArguments:
    """A call of ``pretrain`` bound to its parameters (defaults applied), so that each hook is put
    in by parameter name: ``train_valid_test_dataset_provider`` and ``forward_step_func`` always,
    ``model_provider``, ``extra_args_provider`` and ``cfg_container`` where this tag has them."""
    signature = inspect.signature(pretrain)
    missing = [name for name in (_DATASETS, _FORWARD_STEP) if name not in signature.parameters]
    if missing:
        raise UpstreamChanged(f"megatron.training.pretrain takes no {missing[0]!r} (its parameters: "
                              f"{', '.join(signature.parameters)}); review {REVIEW}")
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


#: core_v0.19's default choice of layers, which the SDPA core is put into (``GPTModelConfig``'s
#: ``transformer_layer_spec`` is called instead of it where set).
DEFAULT_LAYER_SPEC = Spot("megatron.training.models.gpt", "default_layer_spec", ("get_gpt_layer_local_spec(",),
                          "chooses the layers of a GPTModelConfig without transformer_layer_spec; the local ones "
                          "from get_gpt_layer_local_spec", also_reads=(("megatron.training.models.gpt",
                                                                        "_te_or_local_layer_spec"),))


def default_layer_spec() -> Callable:
    """core_v0.19's ``default_layer_spec(config, vp_stage)`` (checked: :data:`DEFAULT_LAYER_SPEC`)."""
    [(_spot, _owner, _name, fn)] = check_spots([DEFAULT_LAYER_SPEC], REVIEW)
    return fn


def model_config(bound: inspect.BoundArguments) -> Optional[Any]:
    """The ``GPTModelConfig`` a ``pretrain`` call builds its model from (core_v0.19: the config
    container's ``model``, whose ``transformer_layer_spec`` chooses the layers), or None where the
    script's model provider builds the model."""
    container = bound.arguments.get("cfg_container")
    model = getattr(container, "model", None)
    if model is None or not hasattr(model, "transformer_layer_spec"):
        return None
    return model


def batch_keys(script_globals: Mapping[str, Any]) -> Optional[tuple[str, ...]]:
    """The keys whose values the script's ``get_batch`` returns, in order (its ``BATCH_KEYS``:
    core_v0.18 and later); None where it returns the six-tuple."""
    keys = script_globals.get("BATCH_KEYS")
    return None if keys is None else tuple(keys)


_SFT_ITEM = ("megatron.training.datasets.sft_dataset", "SFTDataset.__getitem__")
#: Whether Megatron-LM's SFT dataset ends each conversation with an EOD token.
SFT_EOD = OneOf(
    Spot(*_SFT_ITEM, ("tokens_list.append(eod)",), "appends an EOD token to each conversation (before core_v0.19)"),
    Spot(*_SFT_ITEM, ("tokenize_conversation(",), "leaves each conversation as tokenized (core_v0.19)",
         lacks=("append(eod)",)),
)


def sft_appends_eod() -> bool:
    """Whether the checkout's SFT dataset appends an EOD token to each conversation (:data:`SFT_EOD`)."""
    [(spot, *_rest)] = check_spots([SFT_EOD], REVIEW)
    return spot is SFT_EOD.alternatives[0]
