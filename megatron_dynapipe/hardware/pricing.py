"""``--model`` on ``--hardware``: pricing a named GPT's layers on a device's roofline, for the
commands that plan (``plan``, ``bench planner``) at a scale no profile covers."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dynapipe.config.model import get_model, model_names
from megatron_dynapipe.hardware import MEMORY_HEADROOM, hardware_names, load_hardware
from megatron_dynapipe.planning.cost_model import CostModel

DEFAULT_MODEL, DEFAULT_HARDWARE, DTYPE = "6.7B", "a100", "bfloat16"


@dataclass(frozen=True)
class Pricing:
    cost_model: CostModel
    num_layers: int
    memory_limit_mb: float  # (1 - MEMORY_HEADROOM) of the device's memory


def add_pricing_arguments(parser) -> None:
    group = parser.add_argument_group("pricing a named model on a device (instead of --cost-model)")
    group.add_argument("--model", metavar="NAME",
                       help=f"a named GPT: {', '.join(model_names())} (default {DEFAULT_MODEL} where --hardware is given)")
    group.add_argument("--hardware", metavar="NAME|FILE",
                       help=f"price its layers on this device's roofline, bf16: {', '.join(hardware_names())} or a "
                            f"hardware file (default {DEFAULT_HARDWARE} where --model is given)")


def pricing_from_args(args, tp: int) -> "Pricing | None":
    """The pricing ``--model``/``--hardware`` ask for at ``tp``; None when neither is given.
    Giving them with ``--cost-model`` is refused: both say how to price the layers."""
    if not (args.model or args.hardware):
        return None
    if getattr(args, "cost_model", None):
        raise ValueError("--cost-model and --model/--hardware both say how to price the layers: give one")
    model, hardware = get_model(args.model or DEFAULT_MODEL), load_hardware(args.hardware or DEFAULT_HARDWARE)
    return Pricing(hardware.cost_model(model, tp, DTYPE), model.num_layers,
                   hardware.memory_gib * 1024 * (1 - MEMORY_HEADROOM))
