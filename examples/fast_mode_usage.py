"""The three ways to turn on DynaPipe's fast mode, and what it changes.

    python examples/fast_mode_usage.py

1. On the spec:        TrainingSpec(fast_mode=True)   (or "auto": fast above 16 samples)
2. Per call:           generate_execution_plan(lengths, spec, fast_mode=True)
3. From the shell:     DYNAPIPE_FAST_MODE=true         (what --dynapipe-fast-mode sets for Megatron runs)
"""

import os

from megatron_dynapipe.planning.planner import generate_execution_plan
from megatron_dynapipe.planning.samples import synthetic_lengths
from megatron_dynapipe.planning.spec import TrainingSpec


def show(title, result):
    choice = result.choices[0]
    print(f"{title:<28} fast={result.fast_mode!s:<5} planned in {result.planning_seconds:.3f} s, "
          f"{choice.candidates_tried:>3} candidates, {choice.candidate.schedule}, "
          f"predicted {result.makespan_ms:.0f} ms")


def main():
    lengths = synthetic_lengths(256, seed=0)  # built-in multi-task mix
    spec = TrainingSpec(pp=4, memory_limit_mb=36_000)  # GPT-6.7B shapes, analytical A100 costs

    show("normal mode", generate_execution_plan(lengths, spec, fast_mode=False))
    show("1. TrainingSpec(fast_mode)", generate_execution_plan(lengths, TrainingSpec(pp=4, fast_mode=True)))
    show("2. fast_mode= argument", generate_execution_plan(lengths, spec, fast_mode=True))
    os.environ["DYNAPIPE_FAST_MODE"] = "true"
    show("3. DYNAPIPE_FAST_MODE=true", generate_execution_plan(lengths, spec))
    del os.environ["DYNAPIPE_FAST_MODE"]
    show('"auto" on 16 samples', generate_execution_plan(lengths[:16], TrainingSpec(pp=4, fast_mode="auto")))


if __name__ == "__main__":
    main()
