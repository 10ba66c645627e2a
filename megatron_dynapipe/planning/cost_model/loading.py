"""Which cost model a job plans with: a profile shipped with the package (by name), a file (a
measured profile or a calibrated analytical model), or the analytical model of its GPT; and
whether a profile was made for the job's model and dtype."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from megatron_dynapipe.planning.cost_model import profile_file
from megatron_dynapipe.planning.cost_model.analytical import AnalyticalCostModel
from megatron_dynapipe.planning.cost_model.base import CostModel, CostModelError
from megatron_dynapipe.planning.cost_model.profiled import ProfiledCostModel
from megatron_dynapipe.planning.cost_model.stage import StageCosts

__all__ = ["shipped_profiles", "resolve_cost_model_path", "profile_mismatch", "load_cost_model",
           "load_job_cost_model", "cost_model_from_document", "as_stage_costs", "PROFILES_DIR"]

PROFILES_DIR = Path(__file__).parents[1] / "profiles"  # profiles shipped with the package, by name


def shipped_profiles() -> dict[str, Path]:
    """Profiles that come with the package, by name (the file name without ``.json``)."""
    return {p.stem: p for p in sorted(PROFILES_DIR.glob("*.json"))}


def resolve_cost_model_path(name_or_path: str | os.PathLike, flag: str = "--cost-model") -> Path:
    """An existing file as given, else the shipped profile of that name (``gpt-6.7b-a100``,
    with or without ``.json``); a path that is neither raises CostModelError naming both and
    the ``flag`` that takes them."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_profiles()
    name = path.name[:-len(".json")] if path.name.endswith(".json") else path.name
    if path.parent == Path(".") and name in shipped:
        return shipped[name]
    raise CostModelError(
        f"cost model file {os.fspath(name_or_path)} not found: pass {flag} PATH to a JSON file in the "
        f"format of docs/cost_model.md, or a shipped profile ({', '.join(shipped) or 'none'})"
    )


#: The model fields a layer's time and memory depend on (num_layers does not: a profile is per layer).
#: Dropout is one: drawing and applying its masks is work of its own.
ARCHITECTURE_FIELDS = ("hidden_size", "num_attention_heads", "query_groups", "ffn_hidden_size", "vocab_size",
                       "swiglu", "normalization", "position_embedding_type", "hidden_dropout", "attention_dropout",
                       "attention")


def profile_mismatch(metadata: Mapping, *, model: "Mapping | None" = None, dtype: "str | None" = None) -> "str | None":
    """How a profile's recorded model and dtype differ from a job's (``model``: ModelSpec fields),
    in words; None when they agree or the profile records neither (as the shipped A100 one)."""
    differences = [f"{k} {theirs} (job: {mine})" for k, (theirs, mine) in _differences(metadata, model).items()]
    if dtype is not None and metadata.get("dtype") not in (None, dtype):
        differences.append(f"dtype {metadata['dtype']} (job: {dtype})")
    return "; ".join(differences) or None


def _differences(metadata: Mapping, model: "Mapping | None") -> dict:
    """``{field: (profiled, job's)}`` for the architecture fields where they differ."""
    profiled = metadata.get("model")
    if model is None or not isinstance(profiled, Mapping):
        return {}
    mine, theirs = _architecture(model), _architecture(profiled)
    return {k: (theirs[k], mine[k]) for k in ARCHITECTURE_FIELDS if mine[k] != theirs[k]}


#: Fields whose profile flag is ``--`` and the field's name in dashes, with the value as its argument.
_VALUED_FLAGS = {"hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size", "normalization",
                 "position_embedding_type", "hidden_dropout", "attention_dropout", "attention"}


def _profile_fix(metadata: Mapping, model: Mapping) -> str:
    """How to make the profile this job needs: the flags that set the differing fields where each is
    one flag and a value (dropout, sizes, the attention core), else the job's flags in general."""
    differences = _differences(metadata, model)
    if differences and set(differences) <= _VALUED_FLAGS and all(mine is not None for _, mine in differences.values()):
        flags = " ".join(_flag(k, mine) for k, (_, mine) in differences.items())
        return f"megatron-dynapipe profile with {flags} and this job's other model flags"
    return "megatron-dynapipe profile with its flags"


def _flag(field: str, value) -> str:
    """The profile flag that sets ``field`` to ``value`` (transformer-engine's core: its layers)."""
    if field == "attention" and value == "transformer_engine":
        return "--transformer-impl transformer_engine"
    return f"--{field.replace('_', '-')} " + (f"{value:g}" if isinstance(value, float) else f"{value}")


def _architecture(fields: Mapping) -> dict:
    defaults = dict(vocab_size=None, swiglu=False, normalization="LayerNorm",
                    position_embedding_type="learned_absolute", hidden_dropout=0.1, attention_dropout=0.1,
                    attention="local")  # a profile made before attention was recorded measured the local one
    arch = {k: fields.get(k, defaults.get(k)) for k in ARCHITECTURE_FIELDS}
    arch["ffn_hidden_size"] = arch["ffn_hidden_size"] or 4 * arch["hidden_size"]
    arch["query_groups"] = fields.get("num_query_groups") or fields.get("num_attention_heads")
    return arch


def load_cost_model(path: str | os.PathLike | None, tp: int, **analytical_kwargs) -> CostModel:
    """The profiled model in ``path`` (a file or a shipped profile's name), or the analytical
    model when ``path`` is None.

    With a path, only ``hidden_size`` among the keyword arguments is used (for p2p sizes).
    """
    if path is None:
        return AnalyticalCostModel(tp=tp, **analytical_kwargs)
    path = resolve_cost_model_path(path)
    return cost_model_from_document(profile_file.read_complete_document(path), tp, source=os.fspath(path),
                                    hidden_size=analytical_kwargs.get("hidden_size"))


def cost_model_from_document(doc: Mapping, tp: int, *, source: str, hidden_size: "int | None" = None) -> CostModel:
    """The model of a cost-model file's JSON object (a measured profile or a calibrated analytical
    model) at ``tp``: what :meth:`CostModel.to_document` gives back."""
    if profile_file.is_calibrated(doc):
        return AnalyticalCostModel.calibrated(dict(doc), tp, source=source)
    return ProfiledCostModel.from_document(dict(doc), tp, source=source, hidden_size=hidden_size)


def load_job_cost_model(path: "str | os.PathLike | None", model: Mapping, *, tp: int, dtype: str,
                        flag: str = "--cost-model") -> CostModel:
    """The cost model a job of ``model`` (ModelSpec fields) in ``dtype`` plans with: the profile
    ``path`` (a file or a shipped profile's name), or the analytical model of that GPT when
    ``path`` is None. A profile made for another model or dtype raises CostModelError, one line
    naming the difference and the fix."""
    kwargs = dict(hidden_size=model["hidden_size"])
    if path is None:
        kwargs.update(num_heads=model["num_attention_heads"], ffn_hidden_size=model.get("ffn_hidden_size"),
                      vocab_size=model.get("vocab_size") or 50257)
    cost_model = load_cost_model(path, tp=tp, **kwargs)
    mismatch = path is not None and profile_mismatch(cost_model.metadata, model=model, dtype=dtype)
    if mismatch:
        raise CostModelError(f"{flag} {os.fspath(path)} was profiled with another model or dtype: {mismatch}; "
                             f"profile this job's model ({_profile_fix(cost_model.metadata, model)}) or drop the flag")
    return cost_model


def as_stage_costs(cost_model: "CostModel | StageCosts | str | os.PathLike | None", *, tp: int, num_layers: int,
                   pp: int, dp: int, zero_stage: int = 0, layers: "tuple[int, ...] | None" = None,
                   **analytical_kwargs) -> StageCosts:
    """What a caller holds -- per-stage costs, a cost model, a profile's path or name, or None
    for the analytical model (``analytical_kwargs`` describe its GPT) -- as the per-stage costs
    of ``num_layers`` layers over ``pp`` stages (``layers`` of each, where not split evenly)."""
    if isinstance(cost_model, StageCosts):
        return cost_model
    if cost_model is None or isinstance(cost_model, (str, os.PathLike)):
        cost_model = load_cost_model(cost_model, tp, **analytical_kwargs)
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel, StageCosts, path or None, got {cost_model!r}")
    return StageCosts(cost_model, num_layers=num_layers, pp=pp, dp=dp, zero_stage=zero_stage, layers=layers)
