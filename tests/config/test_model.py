"""The one GPT description: named sizes, their parameter counts, and a model as Megatron-LM's flags."""

from __future__ import annotations

import pytest

from megatron_dynapipe.config.accounting import stage_params, total_params, training_bytes
from megatron_dynapipe.config.model import MODELS, get_model
from megatron_dynapipe.config.model_flags import megatron_model_args

TINY = get_model("tiny")


# --------------------------------------------------------------------------------------------
# models


def test_model_table_matches_the_issue():
    table = {"tiny": (128, 8, 4), "6.7B": (4096, 32, 32), "13B": (5120, 32, 40), "30B": (7680, 48, 40),
             "40B": (9216, 72, 40), "70B": (8192, 64, 80), "175B": (12288, 96, 96),
             "485B": (20480, 160, 96), "1T": (25600, 160, 128), "2T": (25600, 160, 256)}
    assert {n: (m.hidden_size, m.num_attention_heads, m.num_layers) for n, m in MODELS.items()} == table
    assert all(m.ffn_hidden_size == 4 * m.hidden_size for m in MODELS.values())


@pytest.mark.parametrize("name", ["6.7", "6.7b", "6.7B", "gpt-6.7b", " GPT-6.7B "])
def test_model_aliases(name):
    assert get_model(name) is MODELS["6.7B"]


def test_unknown_model_lists_the_valid_names():
    with pytest.raises(ValueError) as e:
        get_model("7b")
    for name in MODELS:
        assert name in str(e.value)


def test_model_sizes_are_plausible():
    assert abs(total_params(get_model("6.7")) / 6.7e9 - 1) < 0.02
    assert abs(total_params(get_model("175")) / 175e9 - 1) < 0.02
    m = get_model("6.7")
    assert stage_params(m, pp=2, tp=2, stage=0) < total_params(m) / 3
    assert training_bytes(get_model("tiny"), 2, 2) < 2**30 < training_bytes(m, 2, 2)


def test_megatron_args_of_a_model():
    args = megatron_model_args(get_model("13"), 4096)
    assert args[args.index("--hidden-size") + 1] == "5120"
    assert args[args.index("--num-layers") + 1] == "40"
    assert args[args.index("--seq-length") + 1] == "4096"




def test_the_attention_core_is_checked_and_named_in_folders():
    import dataclasses

    from megatron_dynapipe.config.model import get_model

    tiny = get_model("tiny")
    assert tiny.attention == "local" and dataclasses.replace(tiny, attention="sdpa").label == tiny.label + "-sdpa"
    assert dataclasses.replace(tiny, attention="transformer_engine").label == tiny.label + "-te"
    with pytest.raises(ValueError, match="attention 'flash': use one of local, sdpa, transformer_engine"):
        dataclasses.replace(tiny, attention="flash")


@pytest.mark.parametrize("default", ["local", "transformer_engine"])
@pytest.mark.parametrize("flags,attention", [
    ([], None), (["--transformer-impl", "local"], "local"), (["--attention", "local"], "local"),
    (["--transformer-impl", "transformer_engine"], "transformer_engine"),
    (["--use-flash-attn"], "sdpa"), (["--attention", "sdpa"], "sdpa"),
    (["--attention", "sdpa", "--transformer-impl", "local"], "sdpa")])
def test_megatrons_flags_say_whether_the_attention_core_is_fused(flags, attention, default):
    """transformer-engine's layers run their own fused core, --use-flash-attn a flash kernel in the
    local layers, priced as torch's SDPA (no scores kept, the causal half computed); megatron-core's
    local layers the unfused one; no flag the command's default (None above), whatever the model's."""
    import argparse

    from megatron_dynapipe.config.model_flags import add_model_arguments, model_from_args
    from megatron_dynapipe.hardware import load_hardware

    parser = argparse.ArgumentParser()
    add_model_arguments(parser, attention=default)
    spec = model_from_args(parser.parse_args(["--model", "6.7", *flags]))
    attention = attention or default
    assert spec.attention == attention and spec.name == "6.7B"  # the core alone keeps the model's name
    assert load_hardware("h100").cost_model(spec, 1, "bfloat16").fused_attention == (attention != "local")


def test_a_fused_implementation_with_the_unfused_core_is_refused_in_one_line():
    import argparse

    from megatron_dynapipe.config.model_flags import add_model_arguments, model_from_args

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    with pytest.raises(ValueError, match=r"^--attention local is megatron-core's unfused core, which --use-flash-attn "
                                         r"replaces by a fused one: drop one of them$"):
        model_from_args(parser.parse_args(["--model", "6.7", "--use-flash-attn", "--attention", "local"]))
    for core in (["--attention", "sdpa"], ["--use-flash-attn"]):
        with pytest.raises(ValueError, match=r"^--attention and --use-flash-attn choose the core of megatron-core's "
                                             r"local layers, and --transformer-impl transformer_engine builds "
                                             r"transformer-engine's: drop one of them$"):
            model_from_args(parser.parse_args(["--model", "6.7", *core, "--transformer-impl", "transformer_engine"]))
