"""Dtypes by either spelling (profiles: fp32/bf16/fp16; traces: float32/bfloat16/float16) and the
--device choice."""

import argparse

import pytest
import torch

from megatron_dynapipe.gpt.device import add_device_arguments, resolve_device, torch_dtype


@pytest.mark.parametrize("names, dtype", [(("fp32", "float32"), torch.float32), (("bf16", "bfloat16"), torch.bfloat16),
                                          (("fp16", "float16"), torch.float16)])
def test_both_spellings_name_one_dtype(names, dtype):
    assert [torch_dtype(n) for n in names] == [dtype, dtype]


def test_an_unknown_dtype_lists_the_names():
    with pytest.raises(ValueError, match="dtype 'fp8': use one of fp32, bf16, fp16, float32"):
        torch_dtype("fp8")


def test_device_flags():
    parser = argparse.ArgumentParser()
    add_device_arguments(parser, "measure")
    assert parser.parse_args([]).dtype == "fp32" and parser.parse_args(["--bf16"]).dtype == "bf16"
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda: this torch sees no CUDA device; use --device cpu"):
            resolve_device("cuda")
