"""Train a tiny GPT on CPU with DynaPipe's planned schedule and fast mode on (megatron-core only).

    torchrun --nproc-per-node 2 examples/megatron_fast_mode_example.py            # PP=2
    torchrun --nproc-per-node 2 examples/megatron_fast_mode_example.py --pp 1     # DP=2

Two processes over gloo, no GPU and no Megatron-LM checkout: megatron-core's GPTModel (4 layers,
hidden 64) is built on the CPU (``cpu_compat`` redirects megatron-core's CUDA-only spots), wrapped
in megatron-core's DDP and optimizer. Every iteration a global batch of 16 variable-length samples
goes through DynaPipe's data pipeline: rank 0 hosts the KV store and the planning workers, which
plan each batch in **fast mode** (``DynaPipeDataLoader(..., fast_mode=True)``; the same as
``TrainingSpec(fast_mode=True)`` or ``DYNAPIPE_FAST_MODE=true``) into micro-batches of different
sizes and padded lengths, a schedule and a recompute choice per micro-batch, under a 6 MB memory
limit that forces several micro-batches; each rank receives its pipeline stage's plan and runs it
with DynaPipe's forward-backward function in place of megatron-core's 1F1B.

The samples count up modulo the vocabulary from a random start, so the loss falls within a few
iterations. The last stage prints one line per iteration; rank 0 prints a summary (and writes it
as JSON with ``--summary FILE``), including the fast-mode setting the planning workers read from
the KV store and, for one batch, how long planning took in fast and in normal mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

SEQ_LEN = 64
VOCAB = 128
GLOBAL_BATCH = 16
MEMORY_LIMIT_MB = 6.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20, help="training iterations (default 20)")
    p.add_argument("--pp", type=int, default=2, choices=(1, 2),
                   help="pipeline stages; the rest of the 2 processes are data-parallel (default 2)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--summary", metavar="FILE", help="rank 0 writes the run's summary here as JSON")
    return p.parse_args(argv)


def counting_dataset(num_samples: int, seed: int = 0):
    """Samples of 8..64 tokens; sample k is start_k, start_k + 1, ... modulo the vocabulary."""
    from megatron_dynapipe.data import TokenListDataset

    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, SEQ_LEN + 1, size=num_samples)
    starts = rng.integers(0, VOCAB, size=num_samples)
    return TokenListDataset([(s + np.arange(n)) % VOCAB for s, n in zip(starts, lengths)], SEQ_LEN)


def forward_step(data_iterator, model):
    """megatron-core's forward-step contract: the executor hands over one micro-batch dict."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token_loss):
        mask = batch["loss_mask"].view(-1).float()
        loss = torch.sum(per_token_loss.view(-1).float() * mask)
        tokens = mask.sum().to(torch.int)
        return loss, tokens, {"lm loss": torch.stack([loss.detach().clone(), tokens.float()])}

    return output, loss_func


def planning_times(lengths, spec, cost_model) -> dict:
    """Plan one batch in fast and in normal mode (rank 0 only, for the summary)."""
    from megatron_dynapipe.planning.planner import generate_execution_plan

    out = {}
    for name, fast in (("fast", True), ("normal", False)):
        result = generate_execution_plan(lengths, spec, cost_model, fast_mode=fast)
        plan = result.plans[0][0]
        out[name] = {"planning_ms": round(result.planning_seconds * 1000, 2), "schedule": plan.schedule,
                     "microbatches": [[mb.size, mb.seq_len] for mb in plan.microbatches]}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run me under torchrun: torchrun --nproc-per-node 2 examples/megatron_fast_mode_example.py",
              file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.monotonic()

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.config.model import ModelSpec
    from megatron_dynapipe.data import DynaPipeDataLoader, KVStoreMetaKeys, TrainingSpec
    from megatron_dynapipe.gpt.tiny import build_tiny_gpt, destroy_model_parallel, init_model_parallel
    from megatron_dynapipe.megatron import configure, get_forward_backward_func
    from megatron_dynapipe.planning.cost_model import AnalyticalCostModel

    cpu_compat.enable_cpu_mode()  # megatron-core's CUDA-only spots, redirected to the CPU
    init_model_parallel(tp=1, pp=args.pp)
    cfg = ModelSpec(hidden_size=64, num_attention_heads=4, num_layers=4, vocab_size=VOCAB,
                    max_sequence_length=SEQ_LEN)
    model = build_tiny_gpt(cfg, calculate_per_token_loss=True)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, clip_grad=1.0), [ddp])

    pp, dp = args.pp, world // args.pp
    spec = TrainingSpec(num_layers=cfg.num_layers, pp=pp, tp=1, dp=dp, memory_limit_mb=MEMORY_LIMIT_MB,
                        fast_mode=True)
    cost_model = AnalyticalCostModel(hidden_size=64, num_heads=4, vocab_size=VOCAB, saturation_tokens=256)
    dataset = counting_dataset(GLOBAL_BATCH * args.iters) if rank == 0 else None

    configure(enabled=True)  # megatron-core users: DynaPipe's get_forward_backward_func, no install needed
    forward_backward = get_forward_backward_func()
    is_last = parallel_state.is_pipeline_last_stage()
    history = []
    with DynaPipeDataLoader.from_parallel_state(dataset, spec, cost_model, GLOBAL_BATCH, num_iterations=args.iters,
                                                shuffle=False, fast_mode=True, num_workers=1) as loader:
        # what the workers plan with: the TrainingSpec rank 0 shipped, its fast mode resolved there
        fast_mode = loader.client.get_json(KVStoreMetaKeys.PLANNER)["spec"]["fast_mode"]
        for batch in loader:
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            losses = forward_backward(forward_step_func=forward_step, data_iterator=iter([batch]), model=[ddp],
                                      num_microbatches=len(batch.microbatches), seq_length=SEQ_LEN,
                                      micro_batch_size=1)
            _, grad_norm, _ = optimizer.step()
            plan = batch.plan
            record = {"iteration": batch.iteration, "schedule": plan.schedule,
                      "microbatches": [[mb.size, mb.seq_len] for mb in plan.microbatches],
                      "recompute": [r.name.lower() for r in plan.recompute]}
            if is_last:
                total = torch.stack([d["lm loss"] for d in losses]).sum(dim=0)
                dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
                record["loss"] = float(total[0] / total[1])
                shapes = " ".join(f"{s}x{n}" for s, n in record["microbatches"])
                print(f"[rank {rank}] iteration {batch.iteration:3d} | loss {record['loss']:.4f} | grad norm "
                      f"{grad_norm:.3f} | {len(plan.microbatches)} micro-batches [{shapes}] | {plan.schedule} | "
                      f"recompute {''.join(r[0] for r in record['recompute'])}", flush=True)
            history.append(record)

    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                                      "dp_rank": parallel_state.get_data_parallel_rank(), "history": history})
    if rank == 0:
        last = next(g for g in gathered if g["pp_rank"] == pp - 1 and g["dp_rank"] == 0)
        lengths = [len(dataset[i]) for i in range(GLOBAL_BATCH)]
        summary = {
            "layout": {"pp": pp, "dp": dp, "tp": 1},
            "fast_mode": fast_mode,
            "losses": [h["loss"] for h in last["history"]],
            "schedules": sorted({h["schedule"] for g in gathered for h in g["history"]}),
            "microbatch_counts": [len(h["microbatches"]) for h in last["history"]],
            "recompute_choices": sorted({r for g in gathered for h in g["history"] for r in h["recompute"]}),
            "planning_one_batch": planning_times(lengths, spec, cost_model),
            "seconds": round(time.monotonic() - started, 1),
        }
        losses = summary["losses"]
        print(f"fast mode (as the planning workers read it): {str(fast_mode).lower()}; loss {losses[0]:.3f} -> {losses[-1]:.3f} "
              f"over {len(losses)} iterations; schedules {summary['schedules']}; micro-batches per batch "
              f"{summary['microbatch_counts']}; planning one batch: fast "
              f"{summary['planning_one_batch']['fast']['planning_ms']} ms, normal "
              f"{summary['planning_one_batch']['normal']['planning_ms']} ms", flush=True)
        if args.summary:
            Path(args.summary).write_text(json.dumps(summary, indent=1))
    destroy_model_parallel()
    cpu_compat.disable_cpu_mode()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
