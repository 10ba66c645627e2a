"""The planning core: pure Python and numpy, imports neither torch nor Megatron.

    from megatron_dynapipe.planning import TrainingSpec, generate_execution_plan
"""

from megatron_dynapipe.planning.fast_mode import fast_mode_from_env, resolve_fast_mode
from megatron_dynapipe.planning.plan import ExecutionPlan, Instruction, Op, check_deadlock_free
from megatron_dynapipe.planning.planner import PlanResult, generate_execution_plan
from megatron_dynapipe.planning.recompute import adjust_rc_plan
from megatron_dynapipe.planning.schedule_search import PlanningError, build_candidates, optimize_schedule
from megatron_dynapipe.planning.spec import TrainingSpec
from megatron_dynapipe.planning.types import MicroBatch, RecomputeType

__all__ = [
    "ExecutionPlan", "Instruction", "Op", "check_deadlock_free", "PlanningError", "PlanResult",
    "adjust_rc_plan", "build_candidates", "generate_execution_plan", "optimize_schedule",
    "TrainingSpec", "fast_mode_from_env", "resolve_fast_mode", "MicroBatch", "RecomputeType",
]
