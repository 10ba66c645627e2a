"""Execution plans: per-stage instruction lists, their wire format, and a deadlock check.

* :mod:`.instructions`: the instruction set (:class:`Op`, :class:`Instruction`) and its text form;
* :mod:`.execution_plan`: :class:`ExecutionPlan`, what one stage of one DP rank runs;
* :mod:`.wire`: the plan's binary form (versioned, CRC-checked);
* :mod:`.lowering`: per-stage compute orders -> instructions, send FINISHes placed so that no
  set of executable orders can deadlock;
* :mod:`.deadlock`: the proof, by replaying every stage's posts and waits.
"""

from megatron_dynapipe.planning.plan.deadlock import CommMismatchError, DeadlockError, check_deadlock_free
from megatron_dynapipe.planning.plan.execution_plan import ExecutionPlan
from megatron_dynapipe.planning.plan.instructions import Instruction, Instructions, Op
from megatron_dynapipe.planning.plan.lowering import build_execution_plans, lower_to_instructions

__all__ = ["Op", "Instruction", "Instructions", "ExecutionPlan", "DeadlockError", "CommMismatchError",
           "lower_to_instructions", "build_execution_plans", "check_deadlock_free"]
