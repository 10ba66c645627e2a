"""The supported upstream range and how a megatron-core outside it is refused; the megatron-core
calls whose form differs between versions (compat/upstream.py). What those calls do in a whole
pipeline is checked by tests/runtime/test_executor.py against megatron-core's own schedule."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from megatron_dynapipe.compat import upstream

from project import ROOT


@pytest.mark.parametrize("version,supported", [
    ("0.15.2", False), ("0.16.0", False), ("0.16.1", True), ("0.17.0rc1", True), ("0.18.2", True),
    ("0.19.2", True), ("0.19.10", True), ("0.20.0", False), ("1.0.0", False), ("unknown", None), ("", None)])
def test_the_supported_range_is_read_from_the_release_number(version, supported):
    assert upstream.is_supported(version) is supported


def test_the_installed_megatron_core_is_found_without_importing_it_and_is_supported():
    code = ("import sys; from megatron_dynapipe.compat import upstream; print(upstream.check_supported()); "
            "print('megatron.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=_before_pythonpath(ROOT)))
    assert out.returncode == 0, out.stderr
    version, imported = out.stdout.split()
    from megatron.core import package_info  # megatron-core's own answer

    assert version == _release(package_info) and imported == "False"


_IMPORTS_THAT_NOTIFY = textwrap.dedent("""
    import sys, warnings
    from megatron_dynapipe.compat import upstream
    if sys.argv[1] == "silenced":
        upstream.silence_upstream_notices()
    warnings.warn("a notice of the job's own", UserWarning)
    import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs
    from megatron.core.transformer import TransformerConfig
    TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, recompute_granularity="selective",
                      recompute_modules=["core_attn"])  # selective recompute's advice for transformer-engine
""")


@pytest.mark.slow
def test_megatron_cores_notices_are_silenced_and_nothing_else():
    import importlib.util

    def stderr(mode: str) -> str:
        out = subprocess.run([sys.executable, "-c", _IMPORTS_THAT_NOTIFY, mode], capture_output=True, text=True,
                             timeout=300, env=dict(os.environ, PYTHONPATH=_before_pythonpath(ROOT)))
        assert out.returncode == 0, out.stderr
        return out.stderr

    silenced = stderr("silenced")
    assert "a notice of the job's own" in silenced
    assert not any(notice in silenced for notice in upstream.UPSTREAM_NOTICES), silenced
    assert "'core_attn' to recompute" not in silenced
    as_imported = stderr("as imported")
    assert "'core_attn' to recompute" in as_imported
    if importlib.util.find_spec("transformer_engine") is None:  # where megatron-core says it falls back
        assert "not installed" in as_imported


def _release(package_info) -> str:
    """The release megatron-core's package_info names: its ``__version__`` without the ``+commit`` that
    megatron-core 0.19 appends from whatever git repository holds the install (CI's venv sits in this one)."""
    return package_info.__version__.split("+")[0]


def _before_pythonpath(folder) -> str:
    """``folder`` first, then this process's PYTHONPATH (which may name the megatron-core it runs)."""
    return os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))


def _fake_megatron_core(root, version: str):
    major, minor, patch = version.split(".")
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("raise ImportError('a stand-in: must not be imported')\n")
    (core / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n")
    return root


def test_an_unsupported_megatron_core_is_refused_in_one_line_before_any_work(tmp_path):
    """``trace`` on a megatron-core the package was not tested with stops before tracing, naming the range."""
    fake = _fake_megatron_core(tmp_path / "site", "0.21.0")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), str(ROOT)]))
    out = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "trace", "--config", "16 2 2",
                          "--output-dir", str(tmp_path / "traces")], capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "megatron-core 0.21.0" in out.stderr
    assert "is not supported: megatron-dynapipe runs megatron-core >=0.16.1,<0.20" in out.stderr
    assert not (tmp_path / "traces").exists()
    version = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "--version"], capture_output=True,
                             text=True, timeout=120, env=env, cwd=tmp_path)
    assert version.returncode == 0 and "megatron-core 0.21.0" in version.stdout
    assert "NOT supported (supported: >=0.16.1,<0.20)" in version.stdout


def test_the_launcher_refuses_a_checkout_whose_megatron_core_is_unsupported(tmp_path):
    """The launcher checks the megatron-core the script will import: the checkout's own."""
    checkout = _fake_megatron_core(tmp_path / "Megatron-LM", "0.15.0")
    (checkout / "pretrain_gpt.py").write_text("raise SystemExit('must not run')\n")
    out = subprocess.run([sys.executable, "-m", "megatron_dynapipe.megatron_lm.launcher",
                          str(checkout / "pretrain_gpt.py"), "--dynapipe"], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "megatron-core 0.15.0" in out.stderr and ">=0.16.1,<0.20" in out.stderr


def test_version_names_this_package_and_the_upstream_it_would_run(tmp_path):
    """From a copy of the source tree that pip never installed, as from a ``git archive``."""
    import shutil

    import megatron_dynapipe
    from megatron.core import package_info

    shutil.copytree(ROOT / "megatron_dynapipe", tmp_path / "megatron_dynapipe",
                    ignore=shutil.ignore_patterns("__pycache__"))
    checkout = _fake_megatron_core(tmp_path / "Megatron-LM", "0.19.0")
    out = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "--version"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=_before_pythonpath(tmp_path), MEGATRON_LM_DIR=str(checkout)))
    assert out.returncode == 0, out.stderr
    first, core, lm = out.stdout.splitlines()
    assert first.startswith(f"megatron-dynapipe {megatron_dynapipe.__version__} (Python ")
    assert core.startswith(f"megatron-core {_release(package_info)} (") and core.endswith(
        "): supported (>=0.16.1,<0.20)")
    assert lm == (f"Megatron-LM checkout {checkout} (megatron-core 0.19.0 inside, no pretrain_gpt.py): "
                  "supported (>=0.16.1,<0.20)")


@pytest.mark.slow
def test_activation_shapes_are_megatron_cores_fixed_length_ones_whatever_variable_seq_lengths_says():
    """The plan knows each micro-batch's shape: megatron-core's rule for a fixed length gives it, even
    where variable_seq_lengths (which DynaPipe turns on) makes megatron-core 0.17+ answer ``[()]``."""
    code = textwrap.dedent("""
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.transformer import TransformerConfig
        from megatron_dynapipe.compat import upstream

        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        group = dist.new_group([0])
        for variable in (False, True):
            config = TransformerConfig(num_layers=2, hidden_size=96, num_attention_heads=4,
                                       variable_seq_lengths=variable, moe_token_dispatcher_type="alltoall")
            shapes = upstream.activation_shape(schedules, seq_length=40, micro_batch_size=3, config=config,
                                               tp_group=group, cp_group=group)
            print(variable, [tuple(shape) for shape in shapes])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    # (sequence, batch, hidden): the activation layout megatron-core sends between stages
    assert out.stdout.split("\n")[:2] == ["False [(40, 3, 96)]", "True [(40, 3, 96)]"]


def test_megatron_core_cannot_interleave_first_and_last_stages_with_none_between():
    """Why PipelineSplit refuses --decoder-first and --decoder-last together at PP 2 with model
    chunks: megatron-core accepts the config, then its layer offset divides by the (zero) middle
    stages. If an upstream release places these layers, the refusal can go."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_dynapipe.config.pipeline_split import PipelineSplit

    config = TransformerConfig(num_layers=6, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=2,
                               virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                               num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=4)
    with pytest.raises(ZeroDivisionError):
        get_transformer_layer_offset(config, vp_stage=0, pp_rank=1)
    assert "give only" in PipelineSplit(2, 4).chunks_problem(6, 2, 2)
    # the first stage's layers alone, the last taking the rest: offsets 0, 1 | 3, 4
    config = TransformerConfig(num_layers=6, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=2,
                               virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                               num_layers_in_first_pipeline_stage=2)
    assert [get_transformer_layer_offset(config, vp_stage=v, pp_rank=s) for v in (0, 1) for s in (0, 1)] == [0, 1, 3, 4]
    assert PipelineSplit(2).chunks_problem(6, 2, 2) is None
