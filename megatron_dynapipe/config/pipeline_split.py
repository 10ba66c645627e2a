"""How megatron-core places a GPT's transformer layers on pipeline stages.

Evenly by default.  Megatron-LM's ``--decoder-first-pipeline-num-layers`` and
``--decoder-last-pipeline-num-layers`` give the first and last stage their own count and split
the rest evenly over the middle (Llama 3 405B: 126 layers on 16 stages); with
``--account-for-embedding-in-pipeline-split`` (``--account-for-loss-in-pipeline-split``) the
embedding (the loss) counts as one layer of the first (last) stage, which then builds one
transformer layer fewer.  With interleaving each rank's layers split evenly into its model chunks,
and the embedding and loss come off the very first and very last chunk.  The rules and their
refusals are megatron-core's ``TransformerConfig`` and ``get_num_layers_to_build``; torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_dynapipe.config.layout import is_positive_int, layers_problem

__all__ = ["PipelineSplit"]

_FIRST, _LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"


@dataclass(frozen=True)
class PipelineSplit:
    """Megatron-LM's pipeline-split flags (None/False: an even split)."""

    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    account_for_embedding: bool = False
    account_for_loss: bool = False

    @classmethod
    def from_args(cls, args) -> "PipelineSplit":
        """The split Megatron-LM's parsed flags (an argparse namespace) ask for."""
        return cls(getattr(args, "decoder_first_pipeline_num_layers", None),
                   getattr(args, "decoder_last_pipeline_num_layers", None),
                   bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
                   bool(getattr(args, "account_for_loss_in_pipeline_split", False)))

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    @property
    def even(self) -> bool:
        return not self.uneven and not self.accounted

    @property
    def accounted(self) -> int:
        """Layers the embedding and the loss count as."""
        return int(self.account_for_embedding) + int(self.account_for_loss)

    def flags_problem(self) -> Optional[str]:
        """What megatron-core refuses whatever the model (one line naming the flag)."""
        for flag, value in ((_FIRST, self.first_stage_layers), (_LAST, self.last_stage_layers)):
            if value is not None and not is_positive_int(value):
                return f"{flag} must be a positive integer, got {value!r}"
        if self.uneven and self.accounted:
            return (f"{_FIRST}/{_LAST} and --account-for-embedding/loss-in-pipeline-split cannot be combined "
                    "(megatron-core's rule): give one of them")
        return None

    def rank_layers(self, num_layers: int, pp: int) -> list[int]:
        """Layers each pipeline rank holds, the embedding and loss counted as layers where
        accounted (call :meth:`problem` first)."""
        if not self.uneven:
            return [(num_layers + self.accounted) // pp] * pp
        given = [self.first_stage_layers, self.last_stage_layers]
        middle_stages = pp - sum(g is not None for g in given)
        rest = num_layers - sum(g or 0 for g in given)
        middle = rest // middle_stages if middle_stages else 0
        out = [middle] * pp
        if self.first_stage_layers is not None:
            out[0] = self.first_stage_layers
        if self.last_stage_layers is not None:
            out[-1] = self.last_stage_layers
        return out

    def problem(self, num_layers: int, pp: int) -> Optional[str]:
        """Why megatron-core cannot place ``num_layers`` on ``pp`` ranks this way (one line naming
        the fix), or None."""
        problem = self.flags_problem()
        if problem:
            return problem
        if self.uneven:
            problem = self._uneven_problem(num_layers, pp)
        elif self.accounted:
            total = num_layers + self.accounted
            if total % pp:
                problem = (f"{num_layers} layers and the {self.accounted} the embedding/loss count as do not "
                           f"split evenly into PP = {pp} stages: change PP or drop --account-for-*-in-pipeline-split")
        else:
            problem = layers_problem(num_layers, pp)
            problem = problem and f"{problem}, or give the first and last stages their own ({_FIRST}/{_LAST})"
        return problem

    def chunks_problem(self, num_layers: int, pp: int, chunks: int) -> Optional[str]:
        """Why the ranks' layers (once :meth:`problem` passes) do not split into ``chunks`` model
        chunks each, or None."""
        if self.first_stage_layers is not None and self.last_stage_layers is not None and pp == 2:
            return (f"megatron-core cannot interleave a pipeline whose first and last stages are its only ones (its "
                    f"layer offsets divide by the middle stages): give only {_FIRST} or {_LAST} at PP = 2")
        for stage, layers in enumerate(self.rank_layers(num_layers, pp)):
            if layers % chunks:
                return (f"the {layers} layers of pipeline stage {stage} do not split into {chunks} model chunks: "
                        "change the virtual pipeline size or the stages' layers")
        return None

    def _uneven_problem(self, num_layers: int, pp: int) -> Optional[str]:
        given = [g for g in (self.first_stage_layers, self.last_stage_layers) if g is not None]
        if pp < 2:
            return f"{_FIRST}/{_LAST} need pipeline parallelism (PP > 1), got PP = {pp}"
        rest, middle_stages = num_layers - sum(given), pp - len(given)
        if rest < 0 or bool(rest) != bool(middle_stages):
            return (f"the first/last stages' {sum(given)} layers leave {rest} of {num_layers} for {middle_stages} "
                    f"middle stage(s): change {_FIRST}/{_LAST}")
        if middle_stages and rest % middle_stages:
            return (f"the {rest} layers left for the {middle_stages} middle stages do not split evenly: "
                    f"change {_FIRST}/{_LAST}")
        return None

    def chunk_layers(self, num_layers: int, pp: int, chunks: int = 1) -> list[int]:
        """Transformer layers each of the ``pp x chunks`` virtual stages builds, chunk ``c`` of
        rank ``s`` at ``c pp + s`` (megatron-core's order): a rank's layers split evenly over its
        chunks, one fewer in the very first (embedding) and very last (loss) where accounted."""
        ranks = self.rank_layers(num_layers, pp)
        out = [ranks[s] // chunks for c in range(chunks) for s in range(pp)]
        out[0] -= int(self.account_for_embedding)
        out[-1] -= int(self.account_for_loss)
        return out

    def megatron_args(self) -> list[str]:
        out = []
        for flag, value in ((_FIRST, self.first_stage_layers), (_LAST, self.last_stage_layers)):
            if value is not None:
                out += [flag, str(value)]
        if self.account_for_embedding:
            out.append("--account-for-embedding-in-pipeline-split")
        if self.account_for_loss:
            out.append("--account-for-loss-in-pipeline-split")
        return out

    def transformer_fields(self) -> dict:
        """``TransformerConfig`` fields (none for an even split)."""
        fields: dict = {}
        if self.first_stage_layers is not None:
            fields["num_layers_in_first_pipeline_stage"] = self.first_stage_layers
        if self.last_stage_layers is not None:
            fields["num_layers_in_last_pipeline_stage"] = self.last_stage_layers
        if self.account_for_embedding:
            fields["account_for_embedding_in_pipeline_split"] = True
        if self.account_for_loss:
            fields["account_for_loss_in_pipeline_split"] = True
        return fields
