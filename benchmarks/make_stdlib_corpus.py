"""A real corpus of varied document lengths, made on any machine: the Python source files of this
interpreter's standard library, one document each, tokenized by Megatron-LM's own
``tools/preprocess_data.py --append-eod`` with a byte-level BPE trained on them.

    python benchmarks/make_stdlib_corpus.py --checkout ~/Megatron-LM --out /tmp/corpus
    # -> /tmp/corpus/tokenizer (a Hugging Face tokenizer) and /tmp/corpus/stdlib_text_document.{bin,idx}

Needs Hugging Face ``tokenizers`` and ``transformers`` (Megatron's HuggingFaceTokenizer) and the
checkout's own requirements (patches/README.md). The files are read in sorted order and the BPE is
trained deterministically, so the same interpreter gives the same corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path


def documents(limit: int) -> list[Path]:
    """The standard library's .py files (no tests, no site-packages), sorted, at most ``limit``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts)
    return files[:limit]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", required=True, help="a Megatron-LM checkout (its tools/preprocess_data.py)")
    parser.add_argument("--out", required=True, help="folder for the tokenizer and the corpus")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--documents", type=int, default=1060, help="at most this many files (default 1060)")
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = documents(args.documents)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                            unk_token="<|endoftext|>").save_pretrained(out / "tokenizer")
    jsonl = out / "stdlib.jsonl"
    with open(jsonl, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    command = [sys.executable, os.path.join(args.checkout, "tools", "preprocess_data.py"), "--input", str(jsonl),
               "--output-prefix", str(out / "stdlib"), "--tokenizer-type", "HuggingFaceTokenizer",
               "--tokenizer-model", str(out / "tokenizer"), "--append-eod", "--workers", "1"]
    subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
        [args.checkout, os.environ.get("PYTHONPATH", "")])))
    print(f"{len(files)} documents -> {out / 'stdlib_text_document'} (tokenizer {out / 'tokenizer'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
