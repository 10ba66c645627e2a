"""How a layout is priced on a device (:class:`Pricing`): a named GPT's layers on its roofline for
the commands that plan (``plan``, ``bench planner``) at a scale no profile covers, and a
Megatron-LM job's layout on ``--dynapipe-hardware``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_dynapipe.config.model import ModelSpec, get_model, model_names
from megatron_dynapipe.config.model_flags import add_attention_arguments, attention_flags_given, attention_from_args
from megatron_dynapipe.hardware import Hardware, default_memory_limit_mb, hardware_names, load_hardware
from megatron_dynapipe.planning.cost_model import CostModel, StageCosts, cost_model_from_document
from megatron_dynapipe.planning.planner import pipeline_costs
from megatron_dynapipe.planning.spec import TrainingSpec

DEFAULT_MODEL, DEFAULT_HARDWARE, DTYPE = "6.7B", "a100", "bfloat16"


@dataclass(frozen=True)
class Pricing:
    """How a layout on ``hardware`` plans, as ``search`` prices it: the layers of one TP rank by
    ``profile`` (a cost model), else by the device's roofline; the TP group's collectives beside
    their GEMMs, the CP ring and the stages' transfers at the device's links
    (``Hardware.planner_stages``). A Megatron-LM job's pricing travels to its data pipeline's
    workers as JSON."""

    hardware: Hardware
    model: ModelSpec
    dtype: str  # a peak key: bfloat16, float16, float32
    tp: int
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    profile: "CostModel | None" = None

    @property
    def memory_limit_mb(self) -> float:
        """The planner's default limit on this device (:func:`~megatron_dynapipe.hardware.default_memory_limit_mb`)."""
        return default_memory_limit_mb(self.hardware.memory_gib * 1024)

    def layers(self) -> CostModel:
        """One TP rank's compute, CP 1: the profile, else the device's roofline."""
        if self.profile is not None:
            return self.profile
        return self.hardware.cost_model(self.model, self.tp, self.dtype, sequence_parallel=self.sequence_parallel)

    def stage_costs(self, spec: TrainingSpec) -> StageCosts:
        """The stages of ``spec``'s layout as the planner prices them."""
        if spec.tp != self.tp:
            raise ValueError(f"the pricing is of TP {self.tp}, the layout has TP {spec.tp}")
        return self.hardware.planner_stages(pipeline_costs(self.layers(), spec), self.model, cp=spec.cp,
                                            sequence_parallel=self.sequence_parallel,
                                            tp_comm_overlap=self.tp_comm_overlap)

    def to_json(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dict(fields, hardware=self.hardware.to_json(), model=self.model.to_json(),
                    profile=None if self.profile is None else self.profile.to_document())

    @classmethod
    def from_json(cls, data: dict) -> "Pricing":
        profile = data["profile"]
        if profile is not None:
            profile = cost_model_from_document(profile, data["tp"], source="the job's profile")
        return cls(**dict(data, hardware=Hardware.from_json(data["hardware"], source="the job's hardware"),
                          model=ModelSpec(**data["model"]), profile=profile))


def add_pricing_arguments(parser) -> None:
    group = parser.add_argument_group("pricing a named model on a device (instead of --cost-model)")
    group.add_argument("--model", metavar="NAME",
                       help=f"a named GPT: {', '.join(model_names())} (default {DEFAULT_MODEL} where --hardware is given)")
    group.add_argument("--hardware", metavar="NAME|FILE",
                       help=f"price its layers on this device's roofline, bf16: {', '.join(hardware_names())} or a "
                            f"hardware file (default {DEFAULT_HARDWARE} where --model is given)")
    add_attention_arguments(group, "transformer_engine")


def pricing_from_args(args, tp: int) -> "Pricing | None":
    """The pricing ``--model``/``--hardware`` (and the attention core's flags) ask for at ``tp``, in
    bf16; None when none is given. Giving them with ``--cost-model`` is refused: both say how to
    price the layers."""
    if not (args.model or args.hardware or attention_flags_given(args)):
        return None
    if getattr(args, "cost_model", None):
        if not (args.model or args.hardware):
            raise ValueError("--attention, --transformer-impl and --use-flash-attn choose the core of a model priced "
                             "on --hardware; --cost-model's profile prices the core it measured: drop them")
        raise ValueError("--cost-model and --model/--hardware both say how to price the layers: give one")
    model, hardware = get_model(args.model or DEFAULT_MODEL), load_hardware(args.hardware or DEFAULT_HARDWARE)
    model = dataclasses.replace(model, attention=attention_from_args(args) or model.attention)
    return Pricing(hardware, model, DTYPE, tp)
