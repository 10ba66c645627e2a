"""The parts of Megatron-LM's ``pretrain_gpt.py`` that DynaPipe replaces.

Shared by the launcher (``megatron-dynapipe launch pretrain_gpt.py ...``, which installs them
into an unmodified checkout) and by ``patches/pretrain_gpt_core_v0.16.1.patch`` (which calls them
explicitly). With ``--dynapipe`` off every hook hands over to the script's own function, so a
patched script trains exactly as before.

Why each piece exists:

* :func:`extra_args_provider` -- Megatron parses the command line once; DynaPipe's argument
  groups (:mod:`.arguments`) and the small ``dynapipe data`` group below join the script's own
  provider (ModelOpt's, when present) through :func:`~.arguments.chain_providers`.
* :func:`model_provider` -- the first hook that runs after Megatron's ``validate_args`` and before
  the model's ``TransformerConfig`` is built from the arguments. It runs :func:`setup` once:
  DynaPipe's validation (:func:`~.arguments.validate_dynapipe_args`, which turns
  ``variable_seq_lengths`` back on after Megatron forced it off), the Megatron-LM checks of
  :func:`~.arguments.check_data_pipeline_args`, ``--dataloader-type external`` (so Megatron passes DynaPipe's
  loaders through untouched) and :func:`~.provider.install` (Megatron-LM's ``train_step`` and
  ``evaluate`` then run the planned schedule).
* :func:`datasets_provider` -- instead of fixed-length GPT datasets, every rank (all pipeline
  stages and tensor-parallel ranks, hence ``is_distributed``) gets a
  :class:`~megatron_dynapipe.data.DynaPipeDataLoader`: rank 0 hosts the planning pipeline over
  the variable-length samples of ``--data-path`` (or of ``--mock-data``), each rank receives its
  stage's :class:`~megatron_dynapipe.data.PlannedBatch` per iteration.
* :func:`get_batch` -- pretrain_gpt's ``get_batch`` broadcasts fixed ``(micro_batch_size,
  seq_length)`` tensors from tensor-parallel rank 0. Under DynaPipe every tensor-parallel rank
  already holds the identical micro-batch (the executor hands ``forward_step`` an iterator over
  that one dict), so it is taken as it is: no broadcast, the micro-batch's own shape.

Micro-batch count. Megatron-LM's ``train_step`` passes ``get_num_microbatches()`` (global batch /
(micro-batch size x DP)) to the forward-backward function; the planned schedule ignores it and
scales each micro-batch's loss by the plan's own count. The other uses stay right as long as one
iteration consumes exactly ``--global-batch-size`` samples, which the loaders guarantee: the
scheduler's sample increment and ``consumed_train_samples`` are ``get_num_microbatches() x
micro_batch_size x DP = global_batch_size``, and the reported ``lm loss`` is summed as
``[loss sum, token count]`` pairs over however many micro-batches there were. Hence
``--rampup-batch-size`` (a changing global batch) is refused.
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import logging
import threading
import warnings
from typing import Any, Callable, Mapping, Optional

import numpy as np

from megatron_dynapipe.config.model_flags import model_from_megatron_args
from megatron_dynapipe.data import TokenListDataset, open_dataset
from megatron_dynapipe.megatron_lm.arguments import (
    DynapipeArgumentError,
    add_arguments,
    chain_providers,
    check_data_pipeline_args,
    data_prefix,
    training_spec_from_args,
    validate_dynapipe_args,
)
from megatron_dynapipe.planning.cost_model import load_job_cost_model

__all__ = [
    "LoggedLoader",
    "SplitDataset",
    "add_data_arguments",
    "build_data_loaders",
    "close_loaders",
    "datasets_provider",
    "describe_plan",
    "enabled",
    "extra_args_provider",
    "get_batch",
    "is_hook",
    "make_get_batch",
    "mock_dataset",
    "model_provider",
    "setup",
    "split_dataset",
]

logger = logging.getLogger("megatron_dynapipe")

DATA_GROUP = "dynapipe data"
VALID_NAMESPACE = "dynapipe/valid"
_MICROBATCH_TENSORS = ("tokens", "labels", "loss_mask", "position_ids")


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def add_data_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``dynapipe data`` group: how Megatron's data flags become variable-length samples."""
    g = parser.add_argument_group(title=DATA_GROUP)
    g.add_argument("--dynapipe-truncate-samples", action="store_true",
                   help="keep the first --seq-length tokens of longer documents (default: a longer "
                        "document is an error that names it)")
    g.add_argument("--dynapipe-mock-samples", type=int, default=None, metavar="N",
                   help="samples of the --mock-data dataset (default: 8 global batches, at least 256)")
    return parser


def extra_args_provider(other: "Optional[Callable]" = None) -> Callable:
    """The ``extra_args_provider`` for ``pretrain``: ``other`` (the script's own, may be None),
    then DynaPipe's argument groups and the ``dynapipe data`` group."""
    provider = chain_providers(other, add_arguments, add_data_arguments)
    provider.__dynapipe_hook__ = True  # type: ignore[attr-defined]
    return provider


def is_hook(obj: Any) -> bool:
    """Whether ``obj`` is one of this module's wrappers (a script already patched to use them)."""
    return bool(getattr(obj, "__dynapipe_hook__", False))


def _get_args():
    from megatron.training import get_args

    return get_args()


# --------------------------------------------------------------------------------------------
# Setup: validation, Megatron-LM checks, install
# --------------------------------------------------------------------------------------------

_setup_lock = threading.Lock()
_setup_done: dict[int, Any] = {}  # id(args) -> InstallReport


def enabled() -> bool:
    """Whether DynaPipe's schedule is installed and on (after :func:`setup` with ``--dynapipe``)."""
    from megatron_dynapipe.runtime.provider import is_enabled

    return is_enabled()


def setup(args: Optional[argparse.Namespace] = None):
    """Validate DynaPipe's arguments and install its schedule, once per ``args`` (idempotent).

    Runs after Megatron's ``validate_args`` (``args``: Megatron's global arguments by default).
    With ``--dynapipe``: :func:`~.arguments.validate_dynapipe_args`, :func:`~.arguments.check_data_pipeline_args`,
    ``args.dataloader_type = "external"``, then :func:`~.provider.install`. Without it, installs
    nothing (Megatron's own schedule and data path stay). Returns the install report.
    """
    from megatron_dynapipe.runtime.provider import install

    if args is None:
        args = _get_args()
    with _setup_lock:
        if id(args) in _setup_done:
            return _setup_done[id(args)]
        if getattr(args, "dynapipe", False):
            validate_dynapipe_args(args)
            check_data_pipeline_args(args)
            if getattr(args, "dataloader_type", None) not in (None, "single", "external"):
                warnings.warn(f"--dataloader-type {args.dataloader_type} is replaced by DynaPipe's loaders", stacklevel=2)
            args.dataloader_type = "external"  # Megatron passes the loaders through as they are
        report = install(args)
        if getattr(args, "rank", 0) == 0:
            print(f"> megatron-dynapipe: {report.message}", flush=True)
        _setup_done[id(args)] = report
        return report


def model_provider(original: Callable) -> Callable:
    """Wrap the script's model provider so that :func:`setup` runs first (after Megatron's
    argument validation, before the model's config is built from the arguments)."""
    def dynapipe_model_provider(*args, **kwargs):
        setup()
        return original(*args, **kwargs)

    dynapipe_model_provider.__wrapped__ = original  # type: ignore[attr-defined]
    dynapipe_model_provider.__dynapipe_hook__ = True  # type: ignore[attr-defined]
    return dynapipe_model_provider


# --------------------------------------------------------------------------------------------
# get_batch
# --------------------------------------------------------------------------------------------


def get_batch(data_iterator, vp_stage: Optional[int] = None):
    """pretrain_gpt's ``get_batch`` under DynaPipe: ``(tokens, labels, loss_mask, attention_mask,
    position_ids, packed_seq_params)`` of the one micro-batch dict ``data_iterator`` yields.

    The tensors are ``[micro-batch size, padded length]`` as the plan says; padding sits at the
    right of each sample with ``loss_mask`` 0, so causal attention needs no mask
    (``attention_mask`` is None). No tensor-parallel broadcast: every TP rank has the same dict.
    """
    if data_iterator is None:
        raise ValueError("DynaPipe's get_batch got data_iterator=None: every rank needs its PlannedBatch "
                         "micro-batches (is the planned schedule installed? see megatron_dynapipe.megatron.install)")
    microbatch = next(data_iterator)
    if not isinstance(microbatch, Mapping) or any(k not in microbatch for k in _MICROBATCH_TENSORS):
        got = sorted(microbatch) if isinstance(microbatch, Mapping) else type(microbatch).__name__
        raise TypeError(f"DynaPipe's get_batch expects one micro-batch dict with {', '.join(_MICROBATCH_TENSORS)}, "
                        f"got {got}: the data iterator must be DynaPipe's loader run by the planned schedule")
    import torch

    on_gpu = torch.cuda.is_available()
    tensors = [microbatch[k] for k in _MICROBATCH_TENSORS]
    if on_gpu:
        tensors = [t.cuda(non_blocking=True) for t in tensors]
    tokens, labels, loss_mask, position_ids = tensors
    return tokens, labels, loss_mask, None, position_ids, None


def make_get_batch(original: Callable) -> Callable:
    """``get_batch`` that is DynaPipe's while the planned schedule is on, ``original`` otherwise."""
    def dynapipe_get_batch(data_iterator, vp_stage: Optional[int] = None):
        if enabled():
            return get_batch(data_iterator, vp_stage)
        return original(data_iterator, vp_stage)

    dynapipe_get_batch.__wrapped__ = original  # type: ignore[attr-defined]
    dynapipe_get_batch.__dynapipe_hook__ = True  # type: ignore[attr-defined]
    return dynapipe_get_batch


# --------------------------------------------------------------------------------------------
# Datasets and loaders
# --------------------------------------------------------------------------------------------


class SplitDataset:
    """Samples ``begin .. end - 1`` of a variable-length dataset (a train/valid/test split by
    sample index, as Megatron's ``--split`` cuts documents). Pickles with its parent."""
    def __init__(self, parent, begin: int, end: int):
        if not 0 <= begin <= end <= len(parent):
            raise ValueError(f"split [{begin}, {end}) is outside a dataset of {len(parent)} samples")
        self.parent, self.begin, self.end = parent, int(begin), int(end)
        self.max_seq_len = parent.max_seq_len

    def __len__(self) -> int:
        return self.end - self.begin

    def __getitem__(self, index: int) -> np.ndarray:
        i = int(index)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {index} is out of range for a split of {len(self)} samples")
        return self.parent[self.begin + i]

    @property
    def lengths(self) -> np.ndarray:
        return self.parent.lengths[self.begin:self.end]

    def warm_up(self) -> None:
        warm = getattr(self.parent, "warm_up", None)
        if warm is not None:
            warm()

    def __repr__(self) -> str:
        return f"SplitDataset({self.parent!r}, {self.begin}, {self.end})"


def split_dataset(dataset, split: "str | None") -> list:
    """Megatron's ``--split`` ("969,30,1", weights normalised) as three contiguous
    :class:`SplitDataset` ranges (train, valid, test)."""
    weights = [float(w) for w in (split or "1,0,0").replace("/", ",").split(",") if w.strip()]
    weights = (weights + [0.0, 0.0, 0.0])[:3]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DynapipeArgumentError(f"--split {split!r} needs three non-negative weights, e.g. 969,30,1")
    total, n = sum(weights), len(dataset)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * n)))
    bounds[-1] = n
    bounds = [min(b, n) for b in bounds]
    return [SplitDataset(dataset, bounds[i], max(bounds[i], bounds[i + 1])) for i in range(3)]


def mock_dataset(num_samples: int, max_seq_len: int, vocab_size: int, seed: int = 0):
    """``--mock-data`` for DynaPipe: ``num_samples`` samples of random length in
    ``[max(2, max_seq_len // 8), max_seq_len]``; sample ``k`` counts up from a random start,
    modulo ``vocab_size``, so a model can learn it and the loss falls."""
    rng = np.random.default_rng([int(seed), 0x6D6F636B])
    low = max(2, max_seq_len // 8)
    lengths = rng.integers(low, max_seq_len + 1, size=int(num_samples))
    starts = rng.integers(0, vocab_size, size=int(num_samples))
    samples = [(start + np.arange(length)) % vocab_size for start, length in zip(starts, lengths)]
    return TokenListDataset(samples, max_seq_len)


def _open_data(args):
    """(train, valid, test) variable-length datasets from Megatron's data flags: ``--data-path``
    cut by ``--split``, or for ``--mock-data`` one mock dataset per split (distinct seeds)."""
    if getattr(args, "mock_data", False):
        n = args.dynapipe_mock_samples if getattr(args, "dynapipe_mock_samples", None) else max(
            256, 8 * args.global_batch_size)
        vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or 128
        return [mock_dataset(n, args.seq_length, vocab, seed=args.seed + k) for k in range(3)]
    dataset = open_dataset(data_prefix(args.data_path), args.seq_length,
                           truncate=bool(getattr(args, "dynapipe_truncate_samples", False)))
    return split_dataset(dataset, getattr(args, "split", None))


def _cost_model(args):
    dtype = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
    return load_job_cost_model(getattr(args, "dynapipe_cost_model", None), model_from_megatron_args(args).to_json(),
                               tp=args.tensor_model_parallel_size, dtype=dtype, flag="--dynapipe-cost-model")


def describe_plan(batch) -> str:
    """One line about a PlannedBatch: its micro-batches (size x padded length), schedule and
    recompute choices."""
    plan = batch.plan
    shapes = " ".join(f"{mb.size}x{mb.seq_len}" for mb in plan.microbatches)
    recompute = "".join(str(r.name)[0].lower() for r in plan.recompute)
    return (f"iteration {batch.iteration}: {len(plan.microbatches)} micro-batches [{shapes}], "
            f"schedule {plan.schedule}, recompute [{recompute}] (n/s/f), stage {plan.stage} of {plan.num_stages}")


class LoggedLoader:
    """Iterates a loader; on the hosting rank prints :func:`describe_plan` every ``interval``
    iterations (Megatron's ``--log-interval``), so a run's log shows its planned micro-batches."""
    def __init__(self, loader, interval: int, label: str = "train", verbose: bool = True):
        self.loader, self.interval, self.label, self.verbose = loader, max(1, int(interval)), label, verbose

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.loader)
        if self.verbose and (batch.iteration + 1) % self.interval == 0:
            print(f"> megatron-dynapipe {self.label} {describe_plan(batch)}", flush=True)
        return batch

    def __len__(self) -> int:
        return len(self.loader)

    def close(self) -> None:
        self.loader.close()


_LOADERS: list = []
_atexit_registered = False


def close_loaders() -> None:
    """Close every loader :func:`build_data_loaders` made in this process (rank 0 also stops the
    planning pipeline, after the other ranks closed theirs). Safe to call twice; runs at exit."""
    while _LOADERS:
        loader = _LOADERS.pop()
        try:
            loader.close()
        except Exception as exc:  # shutting down: report, do not mask the run's own outcome
            logger.warning("closing a DynaPipe loader failed: %s", exc)


def build_data_loaders(args: Optional[argparse.Namespace] = None, *, is_host: Optional[bool] = None):
    """``(train, valid, None)``: this rank's :class:`~megatron_dynapipe.data.DynaPipeDataLoader`
    for training (iterations ``args.iteration .. args.train_iters - 1``, ``--global-batch-size``
    samples each) and, with ``--eval-iters`` > 0, for validation (on the ``--split`` valid range;
    its own KV store on ``--dynapipe-kv-port`` + 1). The test split is not evaluated.

    The hosting rank (global rank 0: DP 0, stage 0, TP 0) opens the data and plans; the others
    only connect. Every loader is closed at exit (:func:`close_loaders`).
    """
    from megatron_dynapipe.data import DynaPipeDataLoader, from_parallel_state  # torch: only when loaders are built

    global _atexit_registered
    if args is None:
        args = _get_args()
    layout = from_parallel_state()
    host = layout.is_first if is_host is None else is_host
    spec = training_spec_from_args(args)
    train_ds = valid_ds = cost_model = None
    if host:
        train_ds, valid_ds, _test = _open_data(args)
        cost_model = _cost_model(args)
    gbs = int(args.global_batch_size)
    common = dict(dp_rank=layout.dp_rank, stage=layout.stage, tp_rank=layout.tp_rank, host_pipeline=host,
                  master_addr=args.dynapipe_kv_host, pad_token_id=0, seed=int(args.seed),
                  num_workers=int(getattr(args, "dynapipe_preprocess_workers", 2) or 2))
    if not _atexit_registered:
        atexit.register(close_loaders)
        _atexit_registered = True

    start = int(getattr(args, "iteration", 0) or 0)
    train = DynaPipeDataLoader(train_ds, spec, cost_model, gbs, port=int(args.dynapipe_kv_port),
                               start_iteration=start, num_iterations=max(0, int(args.train_iters) - start),
                               **common)
    _LOADERS.append(train)
    interval = int(getattr(args, "log_interval", 1) or 1)
    train = LoggedLoader(train, interval, "train", verbose=host)
    valid = None
    eval_iters = int(getattr(args, "eval_iters", 0) or 0)
    if eval_iters > 0:
        if host and len(valid_ds) < gbs:
            raise DynapipeArgumentError(
                f"--eval-iters {eval_iters} needs a validation split of at least one global batch ({gbs} samples); "
                f"--split {getattr(args, 'split', None)} leaves {len(valid_ds)}: raise its valid share or pass "
                "--eval-iters 0")
        if getattr(args, "skip_train", False):
            total = eval_iters
        else:
            total = (int(args.train_iters) // int(args.eval_interval) + 1) * eval_iters
        valid_start = int(getattr(args, "consumed_valid_samples", 0) or 0) // gbs
        valid = DynaPipeDataLoader(valid_ds, spec, cost_model, gbs, port=int(args.dynapipe_kv_port) + 1,
                                   namespace=VALID_NAMESPACE, start_iteration=valid_start,
                                   num_iterations=max(0, total - valid_start), **common)
        _LOADERS.append(valid)
        valid = LoggedLoader(valid, 1, "valid", verbose=False)
    return train, valid, None


class _DatasetsProvider:
    """See :func:`datasets_provider`."""
    __dynapipe_hook__ = True

    def __init__(self, original: Optional[Callable]):
        self.original = original
        self.__wrapped__ = original
        self._takes_vp_stage = original is not None and "vp_stage" in inspect.signature(original).parameters

    @property
    def is_distributed(self) -> bool:
        """Megatron builds the data on every rank when this is true (else on TP rank 0 only):
        always under DynaPipe (each rank has its loader), else as the script's provider says."""
        try:
            on = bool(getattr(_get_args(), "dynapipe", False))
        except Exception:  # arguments not parsed yet
            on = False
        return on or bool(getattr(self.original, "is_distributed", False))

    def __call__(self, train_val_test_num_samples, vp_stage=None):
        args = _get_args()
        if getattr(args, "dynapipe", False):
            setup(args)
            if vp_stage not in (None, 0):
                raise DynapipeArgumentError("--dynapipe runs one model chunk per stage: drop virtual pipelining")
            return build_data_loaders(args)
        if self.original is None:
            raise RuntimeError("no datasets provider to fall back to without --dynapipe")
        if self._takes_vp_stage:
            return self.original(train_val_test_num_samples, vp_stage=vp_stage)
        return self.original(train_val_test_num_samples)


def datasets_provider(original: Optional[Callable] = None) -> Callable:
    """Wrap the script's ``train_valid_test_datasets_provider``: with ``--dynapipe`` it returns
    DynaPipe's loaders (:func:`build_data_loaders`, which Megatron passes through as
    ``--dataloader-type external``) on every rank; without, it is ``original``."""
    return _DatasetsProvider(original)
