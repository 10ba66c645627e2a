"""The planning core: pure Python and numpy, imports neither torch nor Megatron.

    from megatron_dynapipe.planning import TrainingSpec, generate_execution_plan
"""

from .plan import ExecutionPlan, Instruction, Op, check_deadlock_free
from .planner import (
    PlanningError,
    PlanResult,
    adjust_rc_plan,
    build_candidates,
    generate_execution_plan,
    optimize_schedule,
)
from .spec import TrainingSpec, fast_mode_from_env, resolve_fast_mode
from .types import MicroBatch, RecomputeType

__all__ = [
    "ExecutionPlan", "Instruction", "Op", "check_deadlock_free", "PlanningError", "PlanResult",
    "adjust_rc_plan", "build_candidates", "generate_execution_plan", "optimize_schedule",
    "TrainingSpec", "fast_mode_from_env", "resolve_fast_mode", "MicroBatch", "RecomputeType",
]
