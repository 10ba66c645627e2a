"""What a GPT layer costs: time per micro-batch, activation memory, parameter memory.

Two sources answer the same questions (see docs/cost_model.md):

* :class:`ProfiledCostModel` (:mod:`.profiled`) reads a measured table and interpolates it
  (:mod:`.grid`);
* :class:`AnalyticalCostModel` (:mod:`.analytical`) derives the costs from FLOP counts and the
  activation-memory formulas of Korthikanti et al. (2022).

Both answer per *layer* and per *micro-batch* (:mod:`.base`); :class:`StageCosts` (:mod:`.stage`)
turns that into what one pipeline stage costs, which is what the planner asks;
:class:`ContextParallelCostModel` (:mod:`.context_parallel`) is a model's cost on one rank of a
context-parallel group; :class:`TensorParallelCollectives` (:mod:`.tensor_parallel`) adds the
collectives of a TP group to a rank's times; :class:`Link` (:mod:`.link`) what a transfer between
two ranks takes.  The file format is read and written in :mod:`.profile_file` only; :mod:`.loading`
picks the model a job plans with.
"""

from megatron_dynapipe.planning.cost_model.analytical import AnalyticalCostModel, gpt_shape
from megatron_dynapipe.planning.cost_model.base import (
    KINDS,
    LAYERS,
    MB,
    PARAM_LAYERS,
    PHASES,
    CostModel,
    CostModelError,
)
from megatron_dynapipe.planning.cost_model.loading import (
    as_stage_costs,
    cost_model_from_document,
    load_cost_model,
    load_job_cost_model,
    profile_mismatch,
    resolve_cost_model_path,
    shipped_profiles,
)
from megatron_dynapipe.planning.cost_model.context_parallel import ContextParallelCostModel, split_over_cp
from megatron_dynapipe.planning.cost_model.link import Link
from megatron_dynapipe.planning.cost_model.profile_file import CALIBRATED
from megatron_dynapipe.planning.cost_model.profiled import ProfiledCostModel
from megatron_dynapipe.planning.cost_model.stage import StageCosts
from megatron_dynapipe.planning.cost_model.tensor_parallel import TensorParallelCollectives, tp_collectives

__all__ = [
    "AnalyticalCostModel", "gpt_shape", "CostModel", "ContextParallelCostModel", "split_over_cp", "CostModelError", "Link", "ProfiledCostModel", "StageCosts", "as_stage_costs",
    "TensorParallelCollectives", "tp_collectives",
    "cost_model_from_document",
    "load_cost_model", "load_job_cost_model", "profile_mismatch", "resolve_cost_model_path", "shipped_profiles",
    "CALIBRATED", "KINDS", "LAYERS", "MB", "PARAM_LAYERS", "PHASES",
]
