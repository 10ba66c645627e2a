"""Megatron's SFT conversations as samples: one conversation each, prompts not predicted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_dynapipe.data.sft import IGNORE_INDEX, conversations_of, sft_dataset

ROLE = {"system": 2, "user": 3, "assistant": 4}


class CharTokenizer:
    """The tokenizer interface Megatron's SFT dataset uses (tokenize_conversation, eod, pad),
    over characters: a role token, then one token per character of the content. System and user
    turns are not targets (IGNORE_INDEX), assistant turns are."""

    eod, pad, vocab_size = 1, 0, 300

    def __init__(self):
        self.calls = 0

    def tokenize_conversation(self, conversation, return_target, add_generation_prompt):
        assert return_target and not add_generation_prompt
        self.calls += 1
        tokens, targets = [], []
        for turn in conversation:
            turn_tokens = [ROLE[turn["role"]]] + [ord(c) for c in turn["content"]]
            tokens += turn_tokens
            targets += turn_tokens if turn["role"] == "assistant" else [IGNORE_INDEX] * len(turn_tokens)
        return np.array(tokens), np.array(targets)


def _line(*turns):
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]})


def test_a_system_message_starts_a_new_conversation():
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
                {"role": "system", "content": "c"}, {"role": "user", "content": "d"}]
    assert [[m["content"] for m in c] for c in conversations_of(messages)] == [["a", "b"], ["c", "d"]]


def test_conversations_become_samples_with_their_answers_as_targets(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join([_line(("system", "s"), ("user", "hi"), ("assistant", "yo"),
                                     ("system", "t"), ("user", "q"), ("assistant", "a")),
                               _line(("user", "x"), ("assistant", "zz"))]) + "\n")
    tokenizer = CharTokenizer()
    ds = sft_dataset(path, tokenizer, max_seq_len=64, cache_dir=tmp_path / "cache")
    assert len(ds) == 3 and tokenizer.calls == 3
    s, hi, yo = [2, ord("s")], [3, ord("h"), ord("i")], [4, ord("y"), ord("o")]
    assert ds[0].tolist() == s + hi + yo + [CharTokenizer.eod]  # EOD appended, a target too
    assert ds.target_mask(0).tolist() == [False] * 5 + [True] * 4
    assert ds.target_mask(2).tolist() == [False, False, True, True, True, True]
    # tokenized once: the cache is reused, and made again when the file changes
    assert len(sft_dataset(path, tokenizer, 64, cache_dir=tmp_path / "cache")) == 3 and tokenizer.calls == 3
    path.write_text(_line(("user", "x"), ("assistant", "z")) + "\n")
    assert len(sft_dataset(path, tokenizer, 64, cache_dir=tmp_path / "cache")) == 1 and tokenizer.calls == 4


def test_without_an_appended_eod_a_conversation_ends_where_its_tokens_end(tmp_path):
    """Megatron-LM's SFT dataset appends no EOD from core_v0.19; a cache made the other way is not reused."""
    path = tmp_path / "chat.jsonl"
    path.write_text(_line(("user", "x"), ("assistant", "zz")) + "\n")
    tokenizer = CharTokenizer()
    with_eod = sft_dataset(path, tokenizer, 64, cache_dir=tmp_path / "cache")
    without = sft_dataset(path, tokenizer, 64, cache_dir=tmp_path / "cache", append_eod=False)
    assert tokenizer.calls == 2
    assert with_eod[0].tolist() == without[0].tolist() + [CharTokenizer.eod]
    assert without[0].tolist() == [3, ord("x"), 4, ord("z"), ord("z")]
    assert without.target_mask(0).tolist() == [False, False, True, True, True]


def test_pad_tokens_are_not_targets_and_bad_lines_are_named(tmp_path):
    class PadIsEod(CharTokenizer):
        pad = 1  # as Megatron masks labels equal to the pad id, an EOD equal to it is not a target

    path = tmp_path / "chat.jsonl"
    path.write_text(_line(("user", "x"), ("assistant", "z")) + "\n")
    ds = sft_dataset(path, PadIsEod(), 64, cache_dir=tmp_path / "c1")
    assert ds.target_mask(0).tolist() == [False, False, True, True, False]
    path.write_text('{"text": "no messages"}\n')
    with pytest.raises(ValueError, match=r"chat.jsonl, line 1: expected an object with \"messages\""):
        sft_dataset(path, CharTokenizer(), 64, cache_dir=tmp_path / "c2")
