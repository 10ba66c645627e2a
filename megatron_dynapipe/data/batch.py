"""What a training rank receives for one iteration: its stage's plan and its micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays out of the import path of the planning core
    import torch

    from megatron_dynapipe.planning.plan import ExecutionPlan

# Keys of one micro-batch, each a tensor of shape [micro-batch size, padded sequence length],
# named as Megatron's GPT get_batch names them.
MICROBATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass
class PlannedBatch:
    """One iteration of one (data-parallel rank, pipeline stage): `microbatches[m]` holds the
    tensors of micro-batch m of `plan` (shapes from `plan.microbatches[m]`). Every
    tensor-parallel rank of the stage receives the same PlannedBatch."""

    iteration: int
    plan: "ExecutionPlan"
    microbatches: "list[dict[str, torch.Tensor]]"
    #: what the whole iteration trains, every DP rank's part (preprocess.iteration_summary)
    summary: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Tokens that count towards the loss (Megatron's per-token loss denominator)."""
        return int(sum(int(mb["loss_mask"].sum()) for mb in self.microbatches))
