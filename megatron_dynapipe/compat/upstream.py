"""Where the supported megatron-core versions differ, and the one way this package calls each.

Supported: megatron-core 0.16.1 through 0.19.x (:data:`SUPPORTED`), and Megatron-LM's
``pretrain_gpt.py`` of the matching tags (:mod:`.megatron_lm_script`). A version is recognised by
what its code contains -- a parameter, a module, a source fragment (:class:`~.patching.OneOf`) --
never by its number, so a Megatron-LM checkout's own ``megatron/core`` (the one a job imports)
works whatever it calls itself. The number is read for one thing: to refuse, before any work and
in one line, a megatron-core outside the tested range (:func:`check_supported`).

What differs, and what here bridges it (docs/compatibility.md has the whole list, Megatron-LM's
script and the CPU redirection included):

* ``schedules.backward_step`` lost its ``model_type`` parameter (0.17): :func:`backward_step`.
* ``schedules.get_tensor_shapes`` answers ``[()]`` ("exchanged at run time") when
  ``config.variable_seq_lengths`` is on (0.17), which DynaPipe's jobs turn on; the plan knows
  every shape, so :func:`activation_shape` asks it for the fixed-length shape of the plan's
  micro-batch.
* megatron-core's ``get_forward_backward_func`` takes ``schedule_pg_collection`` (0.19), which
  Megatron-LM's ``train`` and ``evaluate`` pass: :func:`core_forward_backward_func`.
* the schedules' process-group collection gained ``tp_dp_cp`` and ``dp`` (0.19):
  :func:`process_groups` takes megatron-core's own ``use_mpu_process_groups``.
* full recompute's layer loop moved from ``TransformerBlock._checkpointed_forward`` to
  ``megatron.core.recompute.checkpointed_forward`` (0.18): :data:`RECOMPUTE_READS`.
* the local layer spec's attention core moved into ``get_gpt_layer_local_submodules`` (0.17):
  :data:`LOCAL_CORE_ATTENTION`.
* ``build_tokenizer`` moved from ``tokenizers.text.utils`` to ``tokenizers.utils`` (0.17):
  :func:`build_tokenizer`.

megatron-core also says at import, once per module and per process, that transformer-engine or
Apex is missing and which local code it falls back to; each ``TransformerConfig`` of 0.16 warns of
its own default CUDA-graph scope; a tensor-parallel linear layer recommends
``CUDA_DEVICE_MAX_CONNECTIONS=1`` for overlapping a gradient all-reduce that the profiler's fake
group never runs; and 0.19 adds that absl is missing. Some 20 lines on stderr for every command and
local rank, none of them about the user's job (which layers a profile timed is in its
``layer_spec``). This package's commands silence those, and only those
(:func:`silence_upstream_notices`); a Megatron-LM job this package launches keeps them.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_dynapipe.compat.patching import (OneOf, Spot, UpstreamChanged, check_spots, megatron_core_version,
                                               release_name)

__all__ = [
    "LOCAL_CORE_ATTENTION",
    "RECOMPUTE_READS",
    "SUPPORTED",
    "UPSTREAM_NOTICES",
    "UnsupportedUpstream",
    "activation_shape",
    "backward_step",
    "build_tokenizer",
    "check_supported",
    "core_forward_backward_func",
    "describe",
    "find_megatron_core",
    "is_supported",
    "process_groups",
    "silence_upstream_notices",
    "supported_range",
]

REVIEW = "megatron_dynapipe/compat/upstream.py"

#: megatron-core releases this package is tested with: [first, first unsupported).
SUPPORTED = ((0, 16, 1), (0, 20))


class UnsupportedUpstream(RuntimeError):
    """The installed megatron-core is outside :data:`SUPPORTED`."""


def supported_range() -> str:
    low, high = SUPPORTED
    return f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"


#: the start of each of megatron-core's notices that :func:`silence_upstream_notices` silences
UPSTREAM_NOTICES = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",  # 0.16's TransformerConfig, of its own default cuda_graph_scope
    "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    "absl.logging is not installed",  # 0.19's hyper_comm_grid, at import
    # TransformerConfig, whenever selective recompute names core_attn (the profiler's selective
    # points): advice for transformer-engine's fused core, which these layers do not run
    "If you are using transformer_engine as the transformer implementation, the core_attn",
)


def silence_upstream_notices() -> None:
    """Ignore megatron-core's :data:`UPSTREAM_NOTICES` in this process (and so on its local ranks,
    which take its warning filters)."""
    import re
    import warnings

    for notice in UPSTREAM_NOTICES:
        warnings.filterwarnings("ignore", message=re.escape(notice), category=UserWarning)


def _release(version: str) -> Optional[tuple[int, ...]]:
    """(major, minor, patch) of a version string such as ``0.19.2`` or ``0.17.0rc1``; None if unreadable."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) if parts else None


def is_supported(version: str) -> Optional[bool]:
    """Whether megatron-core ``version`` is in :data:`SUPPORTED`; None when it cannot be read."""
    release = _release(version)
    if release is None:
        return None
    low, high = SUPPORTED
    return low <= release < high


def find_megatron_core() -> Optional[tuple[str, Path]]:
    """``(version, folder)`` of the megatron-core ``import megatron.core`` loads (a Megatron-LM
    checkout's own when it is first on ``sys.path``), read from its ``package_info.py`` without
    importing it; None where there is none."""
    loaded = sys.modules.get("megatron.core")
    if loaded is not None:
        locations = list(getattr(loaded, "__path__", []))
    else:
        try:
            spec = importlib.util.find_spec("megatron.core")
        except ModuleNotFoundError:  # no megatron package at all
            return None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        return None
    folder = Path(locations[0])
    return _package_info_version(folder / "package_info.py"), folder


def _package_info_version(path: Path) -> str:
    values: dict[str, Any] = {}
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return "unknown"
    for node in tree.body:  # MAJOR = 0 / MINOR = 19 / PATCH = 2 / PRE_RELEASE = ""
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and isinstance(node.value, ast.Constant):
            values[node.targets[0].id] = node.value.value
    if not all(key in values for key in ("MAJOR", "MINOR", "PATCH")):
        return "unknown"
    return release_name((values["MAJOR"], values["MINOR"], values["PATCH"], values.get("PRE_RELEASE") or ""))


def check_supported() -> str:
    """The version of the megatron-core ``import megatron.core`` loads; :class:`UnsupportedUpstream`
    (one line naming the supported range) where there is none or it is outside the range. An
    unreadable version passes: what its code contains is checked where it is used."""
    found = find_megatron_core()
    if found is None:
        raise UnsupportedUpstream(f"megatron-core is not installed: pip install 'megatron-core{supported_range()}'")
    version, folder = found
    if is_supported(version) is False:
        raise UnsupportedUpstream(
            f"megatron-core {version} ({folder}) is not supported: megatron-dynapipe runs megatron-core "
            f"{supported_range()} (pip install 'megatron-core{supported_range()}', or a Megatron-LM checkout of tag "
            "core_v0.16.1 through core_v0.19.x)")
    return version


def describe() -> list[str]:
    """What ``megatron-dynapipe --version`` says of the upstream it would run: megatron-core's
    version, where it is and whether it is supported; the Megatron-LM checkout ``MEGATRON_LM_DIR``
    names, likewise (the launcher runs the checkout of the script it is given)."""
    lines = []
    found = find_megatron_core()
    if found is None:
        lines.append(f"megatron-core: not installed (supported: {supported_range()})")
    else:
        lines.append(f"megatron-core {found[0]} ({found[1]}): {_verdict(found[0])}")
    checkout = os.environ.get("MEGATRON_LM_DIR")
    if not checkout:
        lines.append("Megatron-LM: MEGATRON_LM_DIR not set (the launcher takes the checkout of the script it runs)")
    else:
        version = _package_info_version(Path(checkout, "megatron", "core", "package_info.py"))
        script = "pretrain_gpt.py found" if Path(checkout, "pretrain_gpt.py").is_file() else "no pretrain_gpt.py"
        lines.append(f"Megatron-LM checkout {checkout} (megatron-core {version} inside, {script}): {_verdict(version)}")
    return lines


def _verdict(version: str) -> str:
    supported = is_supported(version)
    if supported is None:
        return f"version unreadable (supported: {supported_range()})"
    return f"supported ({supported_range()})" if supported else f"NOT supported (supported: {supported_range()})"


# --------------------------------------------------------------------------------------------
# Calls whose signature differs
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _takes(fn: Callable, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(fn).parameters
    except (TypeError, ValueError) as error:
        raise UpstreamChanged(f"cannot read the signature of {fn!r}: {error}; review {REVIEW}") from None


def backward_step(schedules, input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """megatron-core's ``schedules.backward_step`` (``model_type`` only where it still takes it)."""
    if _takes(schedules.backward_step, "model_type"):
        return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config)
    return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)


class _FixedLengths:
    """``config`` as a fixed-length job sees it: megatron-core's shape rule for a micro-batch whose
    length is known (the plan's), where ``variable_seq_lengths`` would make it ask at run time."""

    variable_seq_lengths = False

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def activation_shape(schedules, *, seq_length: int, micro_batch_size: int, config, tp_group, cp_group):
    """The shapes megatron-core's ``get_tensor_shapes`` gives the activations a stage sends for a
    micro-batch of ``micro_batch_size`` rows of ``seq_length`` tokens (its own context- and
    sequence-parallel division, whatever ``config.variable_seq_lengths`` says)."""
    return schedules.get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size,
                                       decoder_seq_length=None, config=_FixedLengths(config),
                                       tp_group=tp_group, cp_group=cp_group)


def core_forward_backward_func(pp_size=None, vp_size=None, **kwargs) -> Callable:
    """megatron-core's ``get_forward_backward_func``, passed the keywords this version takes
    (``schedule_pg_collection``: 0.19; a keyword it lacks must be None)."""
    from megatron.core.pipeline_parallel import schedules

    fn = schedules.get_forward_backward_func
    passed = {}
    for name, value in kwargs.items():
        if _takes(fn, name):
            passed[name] = value
        elif value is not None:
            raise UpstreamChanged(f"megatron-core {megatron_core_version()}'s get_forward_backward_func takes no "
                                  f"{name!r}; review {REVIEW}")
    return fn(pp_size, vp_size, **passed)


def process_groups():
    """The process groups megatron-core's schedules use, from ``parallel_state`` (megatron-core's
    own ``ProcessGroupCollection.use_mpu_process_groups``: every group this version has)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


# --------------------------------------------------------------------------------------------
# Upstream code this package relies on, by version
# --------------------------------------------------------------------------------------------

_BLOCK = "megatron.core.transformer.transformer_block"

#: megatron-core must still read these at forward time, per micro-batch (the executor's
#: per-micro-batch recompute sets them around each FORWARD and BACKWARD).
RECOMPUTE_READS = (
    Spot(_BLOCK, "TransformerBlock.forward", ("self.config.recompute_granularity == 'full'",),
         "full recompute is read per forward"),
    OneOf(Spot("megatron.core.recompute", "checkpointed_forward", ("self.config.recompute_method == 'uniform'",),
               "the recompute method is read per forward (0.18 and later)"),
          Spot(_BLOCK, "TransformerBlock._checkpointed_forward", ("self.config.recompute_method == 'uniform'",),
               "the recompute method is read per forward")),
    Spot("megatron.core.transformer.attention", "Attention.forward",
         ("if self.checkpoint_core_attention and self.training",), "selective recompute is read per forward"),
)

_SPECS = "megatron.core.models.gpt.gpt_layer_specs"
_CORE = "core_attention=backend.core_attention()"

#: ``get_gpt_layer_local_spec`` builds the local layers' attention core from its backend: the
#: SDPA core replaces exactly that entry of the spec it returns (``megatron_lm/attention.py``
#: rebinds the function while a Megatron-LM job's model is built).
LOCAL_CORE_ATTENTION = OneOf(
    Spot(_SPECS, "get_gpt_layer_local_spec", ("get_gpt_layer_local_submodules(", _CORE),
         "the local spec's layers, whose attention core the SDPA core replaces (0.17 and later)",
         also_reads=((_SPECS, "get_gpt_layer_local_submodules"),)),
    Spot(_SPECS, "get_gpt_layer_local_spec", (_CORE,),
         "the local spec's layers, whose attention core the SDPA core replaces"),
)

_BUILD_TOKENIZER = OneOf(
    Spot("megatron.core.tokenizers.utils.build_tokenizer", "build_tokenizer", (), "0.17 and later"),
    Spot("megatron.core.tokenizers.text.utils.build_tokenizer", "build_tokenizer", ()),
)


def build_tokenizer(args):
    """megatron-core's ``build_tokenizer(args)``, from where this version keeps it."""
    [(_spot, _owner, _name, fn)] = check_spots([_BUILD_TOKENIZER], REVIEW)
    return fn(args)
