"""``--model`` on ``--hardware``: pricing a named GPT's layers on a device's roofline, for the
commands that plan (``plan``, ``bench planner``) at a scale no profile covers; and a Megatron-LM
job's layout on ``--dynapipe-hardware`` (:class:`JobPricing`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_dynapipe.config.model import ModelSpec, get_model, model_names
from megatron_dynapipe.config.model_flags import add_attention_arguments, attention_from_args
from megatron_dynapipe.hardware import Hardware, default_memory_limit_mb, hardware_names, load_hardware
from megatron_dynapipe.planning.cost_model import CostModel, cost_model_from_document

DEFAULT_MODEL, DEFAULT_HARDWARE, DTYPE = "6.7B", "a100", "bfloat16"


@dataclass(frozen=True)
class Pricing:
    cost_model: CostModel
    num_layers: int
    memory_limit_mb: float  # default_memory_limit_mb of the device


def add_pricing_arguments(parser) -> None:
    group = parser.add_argument_group("pricing a named model on a device (instead of --cost-model)")
    group.add_argument("--model", metavar="NAME",
                       help=f"a named GPT: {', '.join(model_names())} (default {DEFAULT_MODEL} where --hardware is given)")
    group.add_argument("--hardware", metavar="NAME|FILE",
                       help=f"price its layers on this device's roofline, bf16: {', '.join(hardware_names())} or a "
                            f"hardware file (default {DEFAULT_HARDWARE} where --model is given)")
    add_attention_arguments(group, "the model's: local")


def pricing_from_args(args, tp: int, cp: int = 1) -> "Pricing | None":
    """The pricing ``--model``/``--hardware`` (and the attention core's flags) ask for at ``tp``
    and ``cp``, as a search plans a layout on that device (the CP ring and the TP group's
    collectives at its links: ``Hardware.planner_model``); None when none is given. Giving them
    with ``--cost-model`` is refused: both say how to price the layers."""
    attention = attention_from_args(args)
    if not (args.model or args.hardware or attention):
        return None
    if getattr(args, "cost_model", None):
        if not (args.model or args.hardware):
            raise ValueError("--attention, --transformer-impl and --use-flash-attn choose the core of a model priced "
                             "on --hardware; --cost-model's profile prices the core it measured: drop them")
        raise ValueError("--cost-model and --model/--hardware both say how to price the layers: give one")
    model, hardware = get_model(args.model or DEFAULT_MODEL), load_hardware(args.hardware or DEFAULT_HARDWARE)
    if attention:
        model = dataclasses.replace(model, attention=attention)
    priced = hardware.planner_model(hardware.cost_model(model, tp, DTYPE), model, tp=tp, cp=cp)
    return Pricing(priced, model.num_layers, default_memory_limit_mb(hardware.memory_gib * 1024))


@dataclass(frozen=True)
class JobPricing:
    """How a Megatron-LM job run with ``--dynapipe-hardware`` plans, as ``search`` prices its
    layout: the layers by ``profile`` (a cost model), else by the device's roofline; the TP
    group's collectives beside their GEMMs and the CP ring at the device's links
    (``Hardware.planner_model``). It travels to the data pipeline's workers as JSON."""

    hardware: Hardware
    model: ModelSpec
    dtype: str  # a peak key: bfloat16, float16, float32
    tp: int
    cp: int = 1
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    profile: "CostModel | None" = None

    def cost_model(self) -> CostModel:
        layers = self.profile if self.profile is not None else self.hardware.cost_model(
            self.model, self.tp, self.dtype, sequence_parallel=self.sequence_parallel)
        return self.hardware.planner_model(layers, self.model, tp=self.tp, cp=self.cp,
                                           sequence_parallel=self.sequence_parallel,
                                           tp_comm_overlap=self.tp_comm_overlap)

    def to_json(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dict(fields, hardware=self.hardware.to_json(), model=self.model.to_json(),
                    profile=None if self.profile is None else self.profile.to_document())

    @classmethod
    def from_json(cls, data: dict) -> "JobPricing":
        profile = data["profile"]
        if profile is not None:
            profile = cost_model_from_document(profile, data["tp"], source="the job's profile")
        return cls(**dict(data, hardware=Hardware.from_json(data["hardware"], source="the job's hardware"),
                          model=ModelSpec(**data["model"]), profile=profile))
