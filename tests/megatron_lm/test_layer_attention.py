"""``--dynapipe-attention sdpa`` in a Megatron-LM job: while the model is built, megatron-core's
local layer spec has the SDPA core wherever it is called from (a builder module outside the
megatron package, as pretrain_gpt's is, and megatron-core's MoE layer specs), with every other
part unchanged, and nothing is left changed after; the flags it cannot reach are refused.
(The checkout's end-to-end run: tests/megatron_lm/test_megatron_lm.py.)"""

import argparse
import dataclasses
import functools
import sys
import types

import pytest

from megatron_dynapipe.config.model_flags import model_from_megatron_args
from megatron_dynapipe.megatron_lm.arguments import DynapipeArgumentError, add_arguments
from megatron_dynapipe.megatron_lm.attention import layer_attention


def _args(*argv: str, **megatron) -> argparse.Namespace:
    args = add_arguments(argparse.ArgumentParser()).parse_args(list(argv))
    args.transformer_impl = "local"
    for name, value in megatron.items():  # what Megatron's own parser sets
        setattr(args, name, value)
    return args


def _core(layer_spec):
    return layer_spec.submodules.self_attention.submodules.core_attention


def _structure(obj):
    """What a spec is made of, comparable: megatron-core 0.19 gives a spec's MLP as a
    ``functools.partial``, which compares by identity, so two calls' specs never compare equal."""
    if isinstance(obj, functools.partial):
        return ("partial", obj.func, _structure(obj.args), _structure(obj.keywords))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj), tuple((f.name, _structure(getattr(obj, f.name))) for f in dataclasses.fields(obj)))
    if isinstance(obj, dict):
        return tuple(sorted((key, _structure(value)) for key, value in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(_structure(item) for item in obj)
    return obj


def _with_core(layer_spec, core):
    attention = layer_spec.submodules.self_attention
    submodules = dataclasses.replace(attention.submodules, core_attention=core)
    layer = dataclasses.replace(layer_spec.submodules, self_attention=dataclasses.replace(attention,
                                                                                          submodules=submodules))
    return dataclasses.replace(layer_spec, submodules=layer)


@pytest.fixture
def builder(monkeypatch):
    """A module that bound the spec function by name, as pretrain_gpt's gpt_builders does."""
    from megatron.core.models.gpt import gpt_layer_specs

    module = types.ModuleType("gpt_builders")
    module.get_gpt_layer_local_spec = gpt_layer_specs.get_gpt_layer_local_spec
    monkeypatch.setitem(sys.modules, "gpt_builders", module)
    return module


def test_the_local_spec_has_the_sdpa_core_while_the_model_is_built(builder):
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_dynapipe.gpt.attention import SDPAttention

    plain = {norm: builder.get_gpt_layer_local_spec(normalization=norm) for norm in ("LayerNorm", "RMSNorm")}
    assert all(_core(spec) is DotProductAttention for spec in plain.values())
    with layer_attention(_args("--dynapipe-attention", "sdpa")):
        for norm, spec in plain.items():
            built = builder.get_gpt_layer_local_spec(normalization=norm)
            assert _core(built) is SDPAttention
            assert _structure(_with_core(built, DotProductAttention)) == _structure(spec)  # nothing else changed
        assert _core(gpt_layer_specs.get_gpt_layer_local_spec(num_experts=2)) is SDPAttention
    assert builder.get_gpt_layer_local_spec is gpt_layer_specs.get_gpt_layer_local_spec
    assert _core(builder.get_gpt_layer_local_spec()) is DotProductAttention


def test_moe_layer_specs_get_the_sdpa_core():
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dynapipe.gpt.attention import SDPAttention

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=2,
                               moe_router_topk=2, use_cpu_initialization=True)
    with layer_attention(_args("--dynapipe-attention", "sdpa")):
        specs = gpt_layer_specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=False)
    assert len(specs) == 2 and all(_core(spec) is SDPAttention for spec in specs)


def test_the_default_changes_nothing(builder):
    from megatron.core.models.gpt import gpt_layer_specs

    original = gpt_layer_specs.get_gpt_layer_local_spec
    with layer_attention(_args(transformer_impl="transformer_engine", spec=["my.module", "my_spec"])):
        assert gpt_layer_specs.get_gpt_layer_local_spec is original and builder.get_gpt_layer_local_spec is original


@pytest.mark.parametrize("megatron, fix", [
    ({"transformer_impl": "transformer_engine"}, "pass --transformer-impl local, or drop --dynapipe-attention"),
    ({"spec": ["my.module", "my_spec"]}, "--spec builds layers without megatron-core's local spec"),
    ({"use_legacy_models": True}, "--use-legacy-models builds layers without"),
    ({"experimental_attention_variant": "gated_delta_net"}, "--experimental-attention-variant builds"),
    ({"heterogeneous_layers_config_path": "layers.json"}, "--heterogeneous-layers-config-path builds"),
])
def test_builders_the_sdpa_core_cannot_reach_are_refused_before_the_model_is_built(builder, megatron, fix):
    from megatron.core.models.gpt import gpt_layer_specs

    original = gpt_layer_specs.get_gpt_layer_local_spec
    with pytest.raises(DynapipeArgumentError) as info:
        with layer_attention(_args("--dynapipe-attention", "sdpa", **megatron)):
            pytest.fail("the model was built")
    assert fix in str(info.value) and "\n" not in str(info.value)
    assert builder.get_gpt_layer_local_spec is original


def test_context_parallel_local_layers_with_attention_dropout_are_refused_before_the_model_is_built(builder):
    """The ring's core draws no attention dropout: Megatron's default 0.1 is refused in one line
    naming the fix, instead of failing at the first forward on every rank; with 0 the model builds."""
    from megatron.core.models.gpt import gpt_layer_specs

    original = gpt_layer_specs.get_gpt_layer_local_spec
    with pytest.raises(DynapipeArgumentError) as info:
        with layer_attention(_args(transformer_impl="local", context_parallel_size=2, attention_dropout=0.1)):
            pytest.fail("the model was built")
    assert "pass --attention-dropout 0, or use --transformer-impl transformer_engine" in str(info.value)
    assert "\n" not in str(info.value) and builder.get_gpt_layer_local_spec is original
    with layer_attention(_args(transformer_impl="local", context_parallel_size=2, attention_dropout=0.0)):
        assert builder.get_gpt_layer_local_spec is not original  # the ring's core


def test_the_job_model_carries_the_attention_core():
    """What the job's cost model must have been profiled with, and what scaling mode traces."""
    model = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=128)
    assert model_from_megatron_args(_args("--dynapipe-attention", "sdpa", **model)).attention == "sdpa"
    assert model_from_megatron_args(_args(**model)).attention == "local"
    # Megatron-LM's default layers are transformer-engine's, whose core is its own: a profile made
    # with --transformer-impl transformer_engine is the one such a job's plans are priced by
    for attention in ("local", "sdpa"):
        job = _args("--dynapipe-attention", attention, transformer_impl="transformer_engine", **model)
        assert model_from_megatron_args(job).attention == "transformer_engine"
