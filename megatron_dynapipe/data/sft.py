"""Megatron's SFT data (``--sft``) as variable-length samples, one conversation each.

The input is what Megatron-LM's SFT dataset reads: a JSONL file whose lines hold ``"messages"``,
a list of system / user / assistant turns; a line may hold several conversations, each starting
with a system message. Each conversation is tokenized with the job's tokenizer, as Megatron's
``SFTDataset`` does: ``tokenize_conversation(conversation, return_target=True,
add_generation_prompt=False)`` (Megatron-LM's ``SFTTokenizer``), then, where the job's Megatron-LM
does so (before core_v0.19), an EOD token unless the conversation ends with one. A token is a prediction target when its target is neither
``IGNORE_INDEX`` (system and user turns) nor the pad id: the loss mask Megatron's SFT dataset
builds. Where Megatron packs a line's conversations into one fixed-length sequence, DynaPipe trains
each conversation as a sample of its own length (a conversation longer than the sequence length is
split, truncated or refused as any long sample).

The conversations are tokenized once, on rank 0, into a :class:`~.datasets.TokenFileDataset`
under a cache directory (named by the file's content and the tokenizer), which every rank opens.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from megatron_dynapipe.data.datasets import TokenFileDataset

__all__ = ["IGNORE_INDEX", "conversations_of", "sft_dataset", "tokenize_conversation_sample"]

IGNORE_INDEX = -100  # Megatron's target for tokens that are not predicted


def conversations_of(messages: list) -> list[list[dict]]:
    """The conversations of one line's messages: a system message starts a new one."""
    conversations: list[list[dict]] = []
    for message in messages:
        if message["role"] == "system" or not conversations:
            conversations.append([])
        conversations[-1].append(message)
    return conversations


def tokenize_conversation_sample(conversation: list, tokenizer, append_eod: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, target mask) of one conversation (module docstring)."""
    tokens, targets = tokenizer.tokenize_conversation(conversation, return_target=True, add_generation_prompt=False)
    tokens, targets = np.asarray(tokens, dtype=np.int64), np.asarray(targets, dtype=np.int64)
    if append_eod and (len(tokens) == 0 or tokens[-1] != tokenizer.eod):
        tokens, targets = np.append(tokens, tokenizer.eod), np.append(targets, tokenizer.eod)
    return tokens, (targets != IGNORE_INDEX) & (targets != tokenizer.pad)


def sft_dataset(path: "str | os.PathLike", tokenizer, max_seq_len: int, *, long_samples: str = "split",
                cache_dir: "str | os.PathLike | None" = None, append_eod: bool = True) -> TokenFileDataset:
    """The conversations of the JSONL file ``path`` as samples (module docstring; ``append_eod``:
    end each with an EOD token as Megatron-LM's SFT dataset did before core_v0.19), tokenized into
    ``cache_dir`` (default: ``<path>.dynapipe-sft/``) unless already there."""
    path = os.path.abspath(os.fspath(path))
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read())
    digest.update(_tokenizer_identity(tokenizer).encode())
    digest.update(b"\0eod" if append_eod else b"\0no-eod")
    root = os.fspath(cache_dir) if cache_dir is not None else path + ".dynapipe-sft"
    directory = os.path.join(root, digest.hexdigest()[:24])
    if not os.path.exists(os.path.join(directory, "offsets.npy")):
        samples, targets = [], []
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    for conversation in conversations_of(_messages(line, path, number)):
                        tokens, mask = tokenize_conversation_sample(conversation, tokenizer, append_eod)
                        samples.append(tokens)
                        targets.append(mask)
        try:
            os.makedirs(root, exist_ok=True)
            TokenFileDataset.write(directory, samples, targets)
        except OSError as error:
            raise OSError(f"cannot write the tokenized SFT conversations of {path} to {root} ({error.strerror}): "
                          "pass --data-cache-path with a writable directory") from None
    return TokenFileDataset(directory, max_seq_len, long_samples=long_samples)


def _messages(line: bytes, path: str, number: int) -> list:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise ValueError(f"{path}, line {number}: not valid JSON ({error})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages) or not messages:
        raise ValueError(f"{path}, line {number}: expected an object with \"messages\": a list of "
                         "{\"role\": ..., \"content\": ...} turns, as Megatron's SFT data")
    return messages


def _tokenizer_identity(tokenizer: Any) -> str:
    """What a cache of tokenized conversations depends on, as far as a tokenizer shows it."""
    parts = [type(tokenizer).__module__, type(tokenizer).__qualname__, str(getattr(tokenizer, "vocab_size", "")),
             str(tokenizer.eod), str(tokenizer.pad), str(getattr(tokenizer, "_prompt_format", "")),
             str(getattr(getattr(tokenizer, "_tokenizer", None), "name_or_path", ""))]
    return "\0".join(parts)
