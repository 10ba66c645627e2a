"""What each planned iteration trains, in Megatron's log and its TensorBoard / W&B writers.

Megatron's own log line counts iterations, not real tokens: with variable-length micro-batches
that hides both the throughput and the padding. Every ``--log-interval`` iterations one rank of
each pipeline stage (data- and tensor-parallel rank 0) prints its stage's plan
(:func:`describe_plan`), and the hosting rank the whole global batch
(:func:`describe_iteration`: samples, real tokens, padding share, micro-batches per DP rank,
schedules, recompute choices, predicted and planning time, real tokens per second), and the rank
that holds Megatron's writers logs the same numbers under ``dynapipe/``.
"""

from __future__ import annotations

import time

__all__ = ["LoggedLoader", "describe_iteration", "describe_plan", "iteration_scalars"]


def describe_plan(batch) -> str:
    """One line about this stage's plan: micro-batches (size x padded length), schedule and
    recompute choices (one letter a micro-batch; with model chunks, one run of letters a chunk)."""
    plan = batch.plan
    shapes = " ".join(mb.label for mb in plan.microbatches)
    n = len(plan.microbatches)
    letters = "".join(str(r.name)[0].lower() for r in plan.recompute)
    recompute = "/".join(letters[c * n:(c + 1) * n] for c in range(plan.chunks))  # one run a model chunk
    return (f"iteration {batch.iteration}: {len(plan.microbatches)} micro-batches [{shapes}], "
            f"schedule {plan.schedule}, recompute [{recompute}] (n/s/f), stage {plan.stage} of {plan.num_stages}")


def iteration_scalars(summary: dict, tokens_per_second: "float | None") -> dict[str, float]:
    """The numbers logged per iteration (``dynapipe/`` scalars)."""
    padded = max(1, summary["padded_tokens"])
    recompute = summary["recompute"]
    choices = max(1, sum(recompute.values()))
    scalars = {"padding-fraction": 1 - summary["real_tokens"] / padded,
               "microbatches-per-dp-rank": sum(summary["microbatches"]) / len(summary["microbatches"]),
               "predicted-iteration-ms": summary["predicted_ms"], "planning-seconds": summary["planning_s"],
               "real-tokens": summary["real_tokens"]}
    scalars.update({f"recompute-{kind}-fraction": recompute.get(kind, 0) / choices
                    for kind in ("none", "selective", "full")})
    if tokens_per_second is not None:
        scalars["real-tokens-per-second"] = tokens_per_second
    return scalars


def describe_iteration(summary: dict, tokens_per_second: "float | None", priced_by: "str | None" = None) -> str:
    """One line about the whole global batch of an iteration (``priced_by``: what the prediction
    is priced with, where it is not this machine)."""
    recompute = summary["recompute"]
    schedules = sorted(set(summary["schedules"]))
    rate = "" if tokens_per_second is None else f"; {tokens_per_second:,.0f} real tokens/s"
    padding = 1 - summary["real_tokens"] / max(1, summary["padded_tokens"])
    return (f"iteration {summary['iteration']}: global batch of {summary['samples']} samples, "
            f"{summary['real_tokens']} real tokens, {padding:.1%} "
            f"padding, micro-batches per DP rank {summary['microbatches']}, schedule {'/'.join(schedules)}, "
            f"recompute {recompute.get('none', 0)} none / {recompute.get('selective', 0)} selective / "
            f"{recompute.get('full', 0)} full, predicted {summary['predicted_ms']:.1f} ms"
            f"{'' if priced_by is None else f' ({priced_by})'}, planned in "
            f"{summary['planning_s']:.3f} s{rate}")


class LoggedLoader:
    """Iterates a loader, reporting every ``interval`` iterations (module docstring): the global
    batch's line printed when ``verbose`` (the hosting rank), this stage's plan line when
    ``plan_line`` (default: ``verbose``; one rank of each stage), logged to ``writers`` (Megatron's
    TensorBoard writer and W&B, where this rank has them); ``priced_by`` follows the predicted time
    where it is not this machine's."""

    def __init__(self, loader, interval: int, label: str = "train", verbose: bool = True, writers=(None, None),
                 priced_by: "str | None" = None, plan_line: "bool | None" = None):
        self.loader, self.interval, self.label, self.verbose = loader, max(1, int(interval)), label, verbose
        self.priced_by = priced_by
        self.plan_line = verbose if plan_line is None else plan_line
        self.tensorboard, self.wandb = writers
        # real tokens trained since the last report, counted when the next batch is asked for
        self._since, self._tokens, self._pending = None, 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.loader)
        now = time.monotonic()
        summary = batch.summary
        self._tokens, self._pending = self._tokens + self._pending, summary.get("real_tokens", 0)
        if self._since is None:
            self._since = now
        if (batch.iteration + 1) % self.interval == 0 and summary:
            rate = self._tokens / (now - self._since) if self._tokens and now > self._since else None
            self._report(batch, summary, rate)
            self._since, self._tokens = now, 0
        return batch

    def _report(self, batch, summary: dict, rate: "float | None") -> None:
        if self.plan_line:
            print(f"> megatron-dynapipe {self.label} {describe_plan(batch)}", flush=True)
        if self.verbose:
            print(f"> megatron-dynapipe {self.label} {describe_iteration(summary, rate, self.priced_by)}", flush=True)
        if self.tensorboard is None and self.wandb is None:
            return
        scalars = {f"dynapipe/{self.label}-{name}": value for name, value in iteration_scalars(summary, rate).items()}
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, batch.iteration)
        if self.wandb is not None:
            self.wandb.log(scalars, batch.iteration)

    def __len__(self) -> int:
        return len(self.loader)

    def close(self) -> None:
        self.loader.close()
