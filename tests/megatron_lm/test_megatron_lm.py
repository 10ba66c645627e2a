"""Getting into Megatron-LM: the launcher, the pretrain hooks and the pretrain_gpt.py patch.

Without a checkout (always run): the launcher's argument handling, its ``pretrain`` wrapper and a
whole ``launch`` of a stand-in script against a stand-in ``megatron.training`` (in a subprocess),
and the narrowness of its CPU redirection.

With ``MEGATRON_LM_DIR`` pointing at a Megatron-LM checkout of tag core_v0.16.1 through core_v0.19.x:
exactly one of the patches applies (``git apply --check``), the CPU spots against the checkout's source, and CPU smoke
runs of the real ``pretrain_gpt.py`` under torchrun (2 processes, PP=2, a tiny GPT): through the
launcher on mock data and on a Megatron ``.bin/.idx`` dataset, and the patched script; the
patched script must reproduce the launcher's losses exactly. Megatron-LM's training package needs
more than megatron-core (six, regex, pyyaml, pydantic, triton, and pybind11 to build its dataset
helpers): put them on ``PYTHONPATH``, e.g. ``pip install --target /tmp/mlm-deps six regex pyyaml
pydantic triton pybind11`` then ``PYTHONPATH=/tmp/mlm-deps MEGATRON_LM_DIR=/tmp/Megatron-LM pytest
tests/megatron_lm/test_megatron_lm.py``; a smoke test whose prerequisites are missing skips and says which.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

from megatron_dynapipe.megatron_lm import launcher, pretrain_hooks
from megatron_dynapipe.megatron_lm.arguments import DynapipeArgumentError, check_data_pipeline_args

from project import MEGATRON_LM_DIR, NO_CHECKOUT, ROOT, free_ports, patch_for


# --------------------------------------------------------------------------------------------
# Argument handling (no checkout)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "pretrain_gpt.py"
    path.write_text("# stand-in\n")
    return path


def test_script_arguments_pass_through_verbatim(script):
    options = launcher.parse_launch_args(
        ["--cpu", str(script), "--num-layers", "2", "--cpu", "--", "--dynapipe", "-h"])
    assert options.cpu is True
    assert options.script == script.resolve()
    assert options.script_args == ("--num-layers", "2", "--cpu", "--", "--dynapipe", "-h")
    assert options.megatron_lm_dir == script.parent.resolve()


def test_launcher_options_come_before_the_script(script):
    options = launcher.parse_launch_args([str(script), "--cpu"])
    assert options.cpu is False and options.script_args == ("--cpu",)
    assert launcher.parse_launch_args(["--cpu", str(script)]).script_args == ()
    assert launcher.parse_launch_args([str(script), "--", "--x"]).script_args == ("--x",)


@pytest.mark.parametrize("flag", ["--bf16", "--fp16"])
def test_cpu_runs_refuse_half_precision_in_one_line(script, flag, capsys):
    with pytest.raises(launcher.LaunchError, match=f"--cpu runs in fp32 only: with {flag} .* drop {flag}"):
        launcher.parse_launch_args(["--cpu", str(script), "--num-layers", "2", flag])
    assert launcher.parse_launch_args([str(script), flag]).script_args == (flag,)  # on GPU: passed through
    assert launcher.main(["--cpu", str(script), flag]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_missing_or_wrong_script_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(launcher.LaunchError, match="no such script.*pretrain_gpt.py"):
        launcher.parse_launch_args([str(tmp_path / "nope.py")])
    other = tmp_path / "run.sh"
    other.write_text("")
    with pytest.raises(launcher.LaunchError, match="not a Python script"):
        launcher.parse_launch_args([str(other)])
    assert launcher.main([str(tmp_path / "nope.py"), "--x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-dynapipe launch: error:") and len(err.strip().splitlines()) == 1


def test_launch_subcommand_wires_into_a_cli(script, monkeypatch):
    parser = argparse.ArgumentParser(prog="megatron-dynapipe")
    sub = parser.add_subparsers(dest="command", required=True)
    launch_parser = launcher.add_launch_parser(sub)
    assert "--cpu" in launch_parser.format_help()
    ns = parser.parse_args(["launch", "--cpu", str(script), "--micro-batch-size", "1", "--cpu"])
    assert ns.func is launcher.run_from_namespace
    seen = []
    monkeypatch.setattr(launcher, "launch", lambda options: seen.append(options) or 0)
    assert ns.func(ns) == 0
    assert seen[0].cpu and seen[0].script_args == ("--micro-batch-size", "1", "--cpu")


# --------------------------------------------------------------------------------------------
# The pretrain wrapper and the hooks (no checkout)
# --------------------------------------------------------------------------------------------


def _original_get_batch(data_iterator, vp_stage=None):
    return ("original", next(data_iterator))


def _script_namespace():
    """A module namespace like pretrain_gpt.py's: forward_step looks get_batch up in it."""
    namespace = {"__name__": "__main__", "get_batch": _original_get_batch}
    exec(compile("def forward_step(data_iterator, model):\n    return get_batch(data_iterator)\n",
                 "<script>", "exec"), namespace)
    return namespace


def test_wrapper_hooks_the_script_and_falls_through_without_dynapipe(monkeypatch):
    namespace = _script_namespace()
    calls = {}

    def provider(num_samples):
        return ("datasets", num_samples)

    def fake_pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                      process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, store=None):
        # core_v0.16.1's parameters
        calls.update(datasets=train_valid_test_dataset_provider, model=model_provider, extra=extra_args_provider,
                     defaults=args_defaults, store=store, forward=forward_step_func)

    installed = launcher._Installed()
    wrapped = launcher.wrap_pretrain(fake_pretrain, installed)
    wrapped(provider, lambda **kw: "model", "encoder_or_decoder", namespace["forward_step"],
            extra_args_provider=None, args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, store="s")
    assert installed.called and "get_batch" in installed.patched
    assert calls["defaults"] == {"tokenizer_type": "GPT2BPETokenizer"} and calls["store"] == "s"
    for hook in (calls["datasets"], calls["model"], calls["extra"], namespace["get_batch"]):
        assert pretrain_hooks.is_hook(hook)

    # DynaPipe's flags join the script's parser; without --dynapipe everything falls through.
    args = calls["extra"](argparse.ArgumentParser()).parse_args(["--dynapipe-long-samples", "truncate"])
    assert args.dynapipe is False and args.dynapipe_long_samples == "truncate"
    monkeypatch.setattr(pretrain_hooks, "_get_args", lambda: args)
    assert calls["datasets"]([8, 0, 0]) == ("datasets", [8, 0, 0])
    assert calls["datasets"].is_distributed is False  # as the script's provider says, when off
    assert calls["model"](pre_process=True) == "model"
    assert calls["forward"](iter([7]), None) == ("original", 7)

    # Once installed and on, get_batch takes the micro-batch dict as it is (no TP broadcast).
    import torch

    monkeypatch.setattr(pretrain_hooks, "enabled", lambda: True)
    mb = {k: torch.ones(2, 8, dtype=torch.long) for k in ("tokens", "labels", "position_ids")}
    mb["loss_mask"] = torch.ones(2, 8)
    tokens, labels, loss_mask, attention_mask, position_ids, packed = calls["forward"](iter([mb]), None)
    assert tokens is mb["tokens"] and labels is mb["labels"] and position_ids is mb["position_ids"]
    assert attention_mask is None and packed is None
    with pytest.raises(TypeError, match="one micro-batch dict"):
        calls["forward"](iter([("tokens",)]), None)


def test_wrapper_binds_a_config_container_pretrain_by_parameter_name(monkeypatch):
    """core_v0.19's pretrain takes a config container first and no model provider, and its script's
    get_batch returns the values of its BATCH_KEYS: the hooks go in by name, get_batch answers in
    the script's order."""
    import torch

    namespace = _script_namespace()
    namespace["BATCH_KEYS"] = ["attention_mask", "cu_seqlens", "labels", "local_cp_size", "loss_mask",
                               "max_seqlen", "position_ids", "tokens"]
    calls = {}

    def fake_pretrain(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,
                      model_provider=None, store=None, get_embedding_ranks=None):
        calls.update(container=cfg_container, datasets=train_valid_test_dataset_provider, model=model_provider,
                     forward=forward_step_func, ranks=get_embedding_ranks)

    container = argparse.Namespace(model=argparse.Namespace(transformer_layer_spec=None))
    args = argparse.Namespace(dynapipe=True, dynapipe_attention="local", transformer_impl="local")
    monkeypatch.setattr(pretrain_hooks, "_get_args", lambda: args)
    installed = launcher._Installed()
    launcher.wrap_pretrain(fake_pretrain, installed)(container, lambda n: ("datasets", n), "encoder_or_decoder",
                                                     namespace["forward_step"], get_embedding_ranks="ranks")
    assert installed.patched == ["get_batch", "train_valid_test_datasets_provider", "the model config's layers"]
    assert calls["container"] is container and calls["model"] is None and calls["ranks"] == "ranks"
    assert pretrain_hooks.is_hook(calls["datasets"]) and pretrain_hooks.is_hook(namespace["get_batch"])
    assert container.model.transformer_layer_spec is None  # the local core: Megatron's own choice stands

    monkeypatch.setattr(pretrain_hooks, "enabled", lambda: True)
    mb = {k: torch.arange(6).view(1, 6) for k in ("tokens", "labels", "position_ids")}
    mb.update(loss_mask=torch.ones(1, 6), cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32),
              max_seqlen=torch.tensor([4], dtype=torch.int32))
    values = dict(zip(namespace["BATCH_KEYS"], calls["forward"](iter([mb]), None)))
    for key in ("tokens", "labels", "position_ids", "loss_mask", "cu_seqlens", "max_seqlen"):
        assert torch.equal(values[key], mb[key]), key
    assert values["attention_mask"] is None and values["local_cp_size"] is None


def test_wrapper_leaves_a_patched_script_alone_and_refuses_scripts_without_get_batch():
    seen = []

    def fake_pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                      extra_args_provider=None):
        seen.append(((train_valid_test_dataset_provider, model_provider), {"extra_args_provider": extra_args_provider}))

    datasets = pretrain_hooks.datasets_provider(lambda n: None)
    model = pretrain_hooks.model_provider(lambda **kw: None)
    extra = pretrain_hooks.extra_args_provider(None)
    installed = launcher._Installed()
    launcher.wrap_pretrain(fake_pretrain, installed)(datasets, model, "t", _script_namespace()["forward_step"],
                                                     extra_args_provider=extra)
    assert seen[0][0][:2] == (datasets, model) and seen[0][1]["extra_args_provider"] is extra
    assert installed.called and installed.patched == []

    namespace = {"__name__": "__main__"}
    exec("def forward_step(data_iterator, model):\n    return None\n", namespace)
    with pytest.raises(launcher.LaunchError, match="get_batch"):
        launcher.wrap_pretrain(fake_pretrain)(lambda n: None, lambda: None, "t", namespace["forward_step"])


def test_megatron_lm_settings_dynapipe_cannot_honour_are_refused():
    def args(**kw):
        base = dict(train_iters=10, mock_data=True, eval_iters=0, eval_interval=100)
        base.update(kw)
        return argparse.Namespace(**base)

    check_data_pipeline_args(args())
    for bad, pattern in ((dict(hybrid_context_parallel=True), "--hybrid-context-parallel"),
                         (dict(eod_mask_loss=True), "--eod-mask-loss"),
                         (dict(iterations_to_skip=[3]), "--iterations-to-skip"),
                         (dict(dataloader_inter_document_masking=True), "--dataloader-inter-document-masking"),
                         (dict(step_batch_size_schedule="0:8 1K:16"), "--step-batch-size-schedule"),
                         (dict(train_iters=None), "--train-iters"),
                         (dict(full_validation=True), "--full-validation"),
                         (dict(mock_data=False, data_path=None), "--data-path"),
                         (dict(eval_iters=2, eval_interval=None), "--eval-interval")):
        with pytest.raises(DynapipeArgumentError, match=re.escape(pattern)):
            check_data_pipeline_args(args(**bad))
    # what Megatron users mix tasks and grow batches with is taken as it is
    for fine in (dict(mock_data=False, data_path=["1.0", "prefix"]),
                 dict(mock_data=False, data_path=["0.5", "a", "0.3", "b", "0.2", "c"]),
                 dict(mock_data=False, train_data_path=["t"], valid_data_path=["v"]),
                 dict(mock_data=False, data_args_path="blend.txt"),
                 dict(mock_data=False, data_path=["chat.jsonl"], sft=True),
                 dict(rampup_batch_size=["4", "4", "100"]),
                 dict(context_parallel_size=2),
                 dict(train_iters=None, train_samples=640)):  # iterations derived later
        check_data_pipeline_args(args(**fine))


def test_mock_splits_differ_and_follow_the_seed():
    from megatron_dynapipe.megatron_lm.datasets import open_splits

    args = argparse.Namespace(mock_data=True, global_batch_size=16, seq_length=32, vocab_size=50, seed=3)
    train, valid, test = open_splits(args, [64, 16, 0])
    assert len(train) == len(valid) == len(test) == 256  # at least 256, 8 global batches
    assert train.lengths.max() <= 32 and not np.array_equal(train.lengths, valid.lengths)
    sample = train[0]
    assert ((sample[1:] - sample[:-1]) % 50 == 1).all()  # counts up: learnable
    again = open_splits(args, [64, 16, 0])[0]
    assert all(np.array_equal(train[i], again[i]) for i in range(len(train)))


# --------------------------------------------------------------------------------------------
# A whole launch against a stand-in megatron.training (subprocess, no checkout)
# --------------------------------------------------------------------------------------------

# Two stand-ins, one per way Megatron-LM's script gets its arguments: core_v0.16.1's pretrain parses
# them (through initialize_megatron); from core_v0.18 the script calls parse_and_validate_args and
# passes pretrain a config container (core_v0.19: no model provider, the model's layers from the
# container's GPTModelConfig). Each reports what the launcher made of it.

REPORT = """
def report(args, datasets_provider, forward_step_func, **extra):
    hooks = [bool(getattr(f, "__dynapipe_hook__", False))
             for f in (datasets_provider, forward_step_func.__globals__["get_batch"])]
    print("FAKE-PRETRAIN " + json.dumps(dict(hooks=hooks, datasets=datasets_provider([8, 0, 0]),
                                             forward=forward_step_func(iter([5]), None), dynapipe=args.dynapipe,
                                             **extra)), flush=True)
"""

STAND_INS = {
    "core_v0.16.1": {
        "training/initialize.py": """
import argparse

def initialize_megatron(extra_args_provider=None, args_defaults={}):
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--hybrid-context-parallel", action="store_true")
    parser.add_argument("--eod-mask-loss", action="store_true")
    return parse_args(extra_args_provider, parser)

def parse_args(extra_args_provider, parser):
    return (extra_args_provider(parser) if extra_args_provider else parser).parse_args()
""",
        "training/__init__.py": '"""Stand-in for megatron.training of core_v0.16.1."""\nimport json\n' + REPORT + """
from megatron.training.initialize import initialize_megatron
_ARGS = None

def get_args():
    return _ARGS

def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, store=None):
    global _ARGS
    _ARGS = initialize_megatron(extra_args_provider, args_defaults)
    report(_ARGS, train_valid_test_dataset_provider, forward_step_func,
           model=[bool(getattr(model_provider, "__dynapipe_hook__", False)), model_provider(pre_process=True)],
           extra=bool(getattr(extra_args_provider, "__dynapipe_hook__", False)))
""",
        "pretrain_gpt.py": """
from megatron.training import pretrain

def get_batch(data_iterator, vp_stage=None):
    return ["original", next(data_iterator)]

def forward_step(data_iterator, model):
    return get_batch(data_iterator)

def train_valid_test_datasets_provider(num_samples):
    return ["datasets", num_samples]

def model_provider(pre_process=True, post_process=True):
    return "model"

if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, "encoder_or_decoder", forward_step,
             extra_args_provider=None)
""",
    },
    "core_v0.19.0": {
        "training/arguments.py": """
import argparse
_ARGS = None

def get_args():
    return _ARGS

def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--hybrid-context-parallel", action="store_true")
    parser.add_argument("--eod-mask-loss", action="store_true")
    return (extra_args_provider(parser) if extra_args_provider else parser).parse_args()

def validate_args(args, defaults={}):
    args.validated_by_megatron = True

def set_global_variables(args):
    global _ARGS
    _ARGS = args

def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):
    args = parse_args(extra_args_provider, ignore_unknown_args)
    validate_args(args, args_defaults)
    set_global_variables(args)
    return args
""",
        "training/__init__.py": '"""Stand-in for megatron.training of core_v0.19.0."""\nimport json\n' + REPORT + """
from megatron.training.arguments import get_args

def pretrain(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func, model_provider=None,
             store=None, get_embedding_ranks=None):
    report(get_args(), train_valid_test_dataset_provider, forward_step_func,
           layer_spec=cfg_container.model.transformer_layer_spec, model_provider=model_provider)
""",
        "pretrain_gpt.py": """
import types
from megatron.training import pretrain
from megatron.training.arguments import parse_and_validate_args

BATCH_KEYS = ["labels", "tokens"]

def get_batch(data_iterator, vp_stage=None):
    return ["original", next(data_iterator)]

def forward_step(data_iterator, model):
    return get_batch(data_iterator)

def train_valid_test_datasets_provider(num_samples, vp_stage=None):
    return ["datasets", num_samples]

if __name__ == "__main__":
    args = parse_and_validate_args(extra_args_provider=None, args_defaults={})
    print("PARSED", args.validated_by_megatron, flush=True)
    container = types.SimpleNamespace(model=types.SimpleNamespace(transformer_layer_spec=None))
    pretrain(container, train_valid_test_datasets_provider, "encoder_or_decoder", forward_step)
""",
    },
}


def _fake_checkout(tmp_path, tag: str) -> Path:
    for name, text in STAND_INS[tag].items():
        # megatron/training is a namespace portion beside megatron-core's
        path = tmp_path / name if name == "pretrain_gpt.py" else tmp_path / "megatron" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "pretrain_gpt.py"


def _launch_fake(tmp_path, tag, *args):
    script = _fake_checkout(tmp_path, tag)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "megatron_dynapipe.megatron_lm.launcher", str(script), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def _report(proc) -> dict:
    line = next(l for l in proc.stdout.splitlines() if l.startswith("FAKE-PRETRAIN "))
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.slow
def test_launch_runs_the_script_as_main_with_the_hooks_installed(tmp_path):
    proc = _launch_fake(tmp_path, "core_v0.16.1", "--num-layers", "2")
    assert proc.returncode == 0, proc.stderr
    assert _report(proc) == {"hooks": [True, True], "datasets": ["datasets", [8, 0, 0]], "forward": ["original", 5],
                             "dynapipe": False, "model": [True, "model"], "extra": True}
    assert "hooked the script's get_batch, train_valid_test_datasets_provider, model_provider, extra_args_provider" \
        in proc.stdout
    assert "DynaPipe is off" in proc.stdout


def test_launch_hooks_a_script_that_parses_its_own_arguments(tmp_path):
    """core_v0.18 and later: DynaPipe's flags join the script's parse_and_validate_args, its setup runs
    right after Megatron's validation (before pretrain), and pretrain's hooks go in by name."""
    proc = _launch_fake(tmp_path, "core_v0.19.0", "--num-layers", "2")
    assert proc.returncode == 0, proc.stderr
    assert _report(proc) == {"hooks": [True, True], "datasets": ["datasets", [8, 0, 0]], "forward": ["original", 5],
                             "dynapipe": False, "layer_spec": None, "model_provider": None}
    lines = proc.stdout.splitlines()
    setup = next(i for i, line in enumerate(lines) if line.startswith("> megatron-dynapipe: DynaPipe is off"))
    parsed = next(i for i, line in enumerate(lines) if line == "PARSED True")
    assert setup < parsed, proc.stdout  # DynaPipe's setup ran inside parse_and_validate_args
    assert "hooked the script's get_batch, train_valid_test_datasets_provider, the model config's layers" in proc.stdout


@pytest.mark.parametrize("tag", sorted(STAND_INS))
@pytest.mark.slow
def test_launch_reports_a_dynapipe_argument_error_with_its_fix(tmp_path, tag):
    proc = _launch_fake(tmp_path, tag, "--dynapipe")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--dynapipe needs --dynapipe-memory-limit MB" in proc.stderr
    assert "FAKE-PRETRAIN" not in proc.stdout and "PARSED" not in proc.stdout  # refused before any work


@pytest.mark.parametrize("tag", sorted(STAND_INS))
@pytest.mark.slow
def test_every_refused_flag_is_named_in_one_line(tmp_path, tag):
    proc = _launch_fake(tmp_path, tag, "--dynapipe", "--dynapipe-memory-limit", "100", "--context-parallel-size", "2",
                        "--hybrid-context-parallel", "--eod-mask-loss")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if "error" in line]
    assert line.startswith("megatron-dynapipe: error: --hybrid-context-parallel chooses each sample's CP group")
    assert "--eod-mask-loss is a feature of Megatron's packed GPT datasets" in line


# --------------------------------------------------------------------------------------------
# With a Megatron-LM checkout (MEGATRON_LM_DIR)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkout() -> Path:
    if not MEGATRON_LM_DIR:
        pytest.skip(NO_CHECKOUT)
    path = Path(MEGATRON_LM_DIR).expanduser().resolve()
    if not (path / "pretrain_gpt.py").is_file():
        pytest.fail(f"MEGATRON_LM_DIR={MEGATRON_LM_DIR} has no pretrain_gpt.py: point it at a Megatron-LM checkout")
    return path


def _env(**extra) -> dict:
    """The children's environment: this venv's python first on PATH (Megatron builds its dataset
    helpers with `python3 -m pybind11`), one thread per process on these small models."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), *extra.pop("pythonpath", []),
                                                     os.environ.get("PYTHONPATH", "")] if p)
    env.update(extra)
    return env


def test_exactly_one_patch_applies_to_the_checkout(checkout):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    patch_for(checkout)


@pytest.fixture(scope="module")
def training_ready(checkout) -> Path:
    """Skip (saying why) unless Megatron-LM's training package imports and its C++ dataset
    helpers build here; also checks every CPU spot against the checkout's source."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(checkout)!r})
        try:
            import megatron.training.training, megatron.training.initialize
        except ModuleNotFoundError as exc:
            print("MISSING", exc.name); raise SystemExit(3)
        from megatron_dynapipe.compat.patching import check_spots
        from megatron_dynapipe.compat.megatron_lm_cpu import LM_CPU_SPOTS, REVIEW
        check_spots(LM_CPU_SPOTS, REVIEW)
        print("SPOTS-OK", len(LM_CPU_SPOTS))
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode == 3:
        missing = proc.stdout.split("MISSING", 1)[1].strip()
        pytest.skip(f"Megatron-LM's training package cannot be imported here (no module {missing!r}); it needs "
                    "six, regex, pyyaml, pydantic, triton and pybind11 beyond megatron-core: pip install --target "
                    "DIR them and put DIR on PYTHONPATH")
    assert proc.returncode == 0 and "SPOTS-OK" in proc.stdout, proc.stdout + proc.stderr
    # built for this interpreter (the Makefile asks python3-config, which may answer for another python)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    make = subprocess.run(["make", "-C", str(checkout / "megatron" / "core" / "datasets"), f"LIBEXT={suffix}"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    if make.returncode != 0:
        pytest.skip("Megatron-LM's C++ dataset helpers (compiled at start-up by initialize_megatron) do not build "
                    f"here: {make.stderr.strip().splitlines()[-1:]}; pip install pybind11 where PATH's python3 "
                    "sees it")
    return checkout


TINY_GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--position-embedding-type", "learned_absolute",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "127", "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "4",
            "--lr", "1e-3", "--lr-decay-style", "constant", "--pipeline-model-parallel-size", "2",
            "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "2"]
# 2 MB of planned memory on this tiny model forces several variable-length micro-batches per batch.
DYNAPIPE = ["--dynapipe", "--dynapipe-memory-limit", "2", "--dynapipe-preprocess-workers", "1",
            "--calculate-per-token-loss"]
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.eE+-]+)")
PLAN = re.compile(r"> megatron-dynapipe train iteration (\d+): (\d+) micro-batches \[([^\]]*)\].*, stage (\d+) of 2")


def _smoke(script: Path, data_args: list[str], *, pythonpath=(), fast=True, timeout=240, ranks_per_stage=1):
    """Train the tiny GPT for four iterations on ``2 x ranks_per_stage`` ranks (PP 2; ``data_args``
    may add context parallelism over the extra ranks); its log, losses and stage 0's plans."""
    master, kv, _kv_valid = free_ports(3)
    with tempfile.TemporaryDirectory() as logs:
        # Each rank's stdout goes to a file of its own: two ranks writing one pipe may cut each
        # other's lines, and every stage's plan line is checked.
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(2 * ranks_per_stage),
                   "--master-addr", "127.0.0.1", "--master-port", str(master), "--log-dir", logs, "--redirects", "1",
                   "-m", "megatron_dynapipe.megatron_lm.launcher", "--cpu", str(script),
                   *TINY_GPT, *DYNAPIPE, *data_args, "--dynapipe-kv-port", str(kv),  # data_args override
                   "--dynapipe-fast-mode", "true" if fast else "false"]
        proc = subprocess.run(command, env=_env(pythonpath=list(pythonpath)), capture_output=True, text=True,
                              timeout=timeout, cwd=script.parent)
        ranks = sorted(Path(logs).glob("*/attempt_0/*/stdout.log"), key=lambda path: int(path.parent.name))
        stdout = proc.stdout + "".join(path.read_text() for path in ranks)
    assert proc.returncode == 0, (stdout + proc.stderr)[-6000:]
    assert len(ranks) == 2 * ranks_per_stage, f"torchrun wrote no per-rank stdout files under its --log-dir: {ranks}"
    losses = [float(loss) for _, loss in ITERATION.findall(stdout)]
    stages = [(int(i), int(stage)) for i, _, _, stage in PLAN.findall(stdout)]
    # every rank's plan of every iteration
    assert sorted(stages) == [(i, stage) for i in range(4) for stage in (0, 1) for _ in range(ranks_per_stage)], stages
    plans = [(int(n), shapes.split()) for _, n, shapes, stage in PLAN.findall(stdout) if stage == "0"]
    if ranks_per_stage > 1:  # a stage's ranks (their logs one after another) hold one plan
        each = len(plans) // ranks_per_stage
        assert all(plans[k * each:(k + 1) * each] == plans[:each] for k in range(ranks_per_stage)), plans
        plans = plans[:each]
    return stdout, losses, plans


def _check_training(stdout, losses, plans, *, priced_by=("the analytical model of a GPT on an A100",
                                                            "the analytical A100 model, not this machine")):
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), stdout[-4000:]
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
    # Planned micro-batches: several per batch, of different padded lengths, and not Megatron's
    # fixed global_batch / micro_batch_size = 8 micro-batches of 2 x 64.
    assert len(plans) == 4, stdout[-4000:]
    for count, shapes in plans:
        assert count == len(shapes) >= 2
        assert len({s.split("x")[1] for s in shapes}) >= 2
        assert sum(int(s.split("x")[0]) for s in shapes) <= 16
    assert any(count != 8 for count, _ in plans)
    assert "validation loss at iteration 2" in stdout and "validation loss at iteration 4" in stdout
    assert "megatron-dynapipe launch --cpu: redirected" in stdout
    assert "runs the planned schedule in train_step and evaluate" in stdout
    assert "> megatron-dynapipe: attention: megatron-core's unfused local core" in stdout
    # no profile of this machine: the log says its predictions are another device's
    device, per_batch = priced_by
    assert f"no --dynapipe-cost-model: plans are priced by {device}, so" in stdout
    assert all(f"ms ({per_batch}), planned in" in line for line in stdout.splitlines() if "global batch of" in line)


@pytest.fixture(scope="module")
def launcher_run(training_ready):
    return _smoke(training_ready / "pretrain_gpt.py", ["--mock-data"])


@pytest.mark.slow
def test_cpu_smoke_run_through_the_launcher(launcher_run):
    stdout, losses, plans = launcher_run
    _check_training(stdout, losses, plans)
    assert "hooked the script's get_batch, train_valid_test_datasets_provider" in stdout


@pytest.mark.slow
def test_cpu_smoke_run_of_the_patched_script_matches_the_launcher(training_ready, launcher_run, tmp_path):
    # the patched copy sits outside the checkout: the checkout's modules come from PYTHONPATH
    stdout, losses, plans = _smoke(_patched(training_ready, tmp_path), ["--mock-data"],
                                   pythonpath=[str(training_ready)])
    _check_training(stdout, losses, plans)
    assert "calls megatron_dynapipe's pretrain hooks itself (patched)" in stdout
    assert losses == launcher_run[1] and plans == launcher_run[2]


@pytest.mark.slow
def test_packed_micro_batches_on_the_sdpa_core_train_as_padded_ones_on_the_unfused_core(training_ready,
                                                                                        launcher_run):
    """--dynapipe-packing varlen runs in a CPU job once --dynapipe-attention sdpa gives megatron's
    local layers an attention core that takes packed rows; every sample attends to itself alone, so
    each iteration's per-token loss is the padded run's (same samples, same weights) to float error."""
    stdout, losses, plans = _smoke(training_ready / "pretrain_gpt.py",
                                   ["--mock-data", "--dynapipe-packing", "varlen", "--dynapipe-attention", "sdpa"])
    assert len(losses) == 4 and len(plans) == 4, stdout[-4000:]
    for count, labels in plans:  # one packed row a micro-batch: "<samples>in<tokens>"
        assert count == len(labels) and all(re.fullmatch(r"\d+in\d+", label) for label in labels), labels
        assert sum(int(label.split("in")[0]) for label in labels) <= 16
    np.testing.assert_allclose(losses, launcher_run[1], rtol=1e-5)
    assert "validation loss at iteration 4" in stdout


def _counting_documents(prefix: Path, count: int, seed: int, longest: int = 90):
    """A Megatron .bin/.idx dataset of documents that count up (some longer than --seq-length)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for _ in range(count):
        n, start = int(rng.integers(6, longest)), int(rng.integers(0, 127))
        builder.add_document(torch.tensor((start + np.arange(n)) % 127, dtype=torch.int32), [n])
    builder.finalize(f"{prefix}.idx")
    return prefix


@pytest.mark.slow
def test_cpu_smoke_run_on_a_megatron_indexed_dataset(training_ready, tmp_path):
    docs = _counting_documents(tmp_path / "docs", 200, seed=0)
    stdout, losses, plans = _smoke(training_ready / "pretrain_gpt.py",
                                   ["--data-path", str(docs), "--split", "90,10,0"])
    _check_training(stdout, losses, plans)


@pytest.mark.slow
def test_uneven_pipeline_stages_train_with_plans_priced_as_megatron_builds_them(training_ready):
    """--decoder-first-pipeline-num-layers: megatron-core builds 1 + 2 layers on the two stages and
    the planner prices the stages so, where it once assumed an even split (the last stage's two
    layers and the head need 3 MB where an even split's one layer and head fit 2)."""
    stdout, losses, plans = _smoke(training_ready / "pretrain_gpt.py",
                                   ["--mock-data", "--num-layers", "3", "--decoder-first-pipeline-num-layers", "1",
                                    "--dynapipe-memory-limit", "3"])
    _check_training(stdout, losses, plans)
    assert "pipeline stages of 1 + 2 transformer layers (Megatron-LM's pipeline split)" in stdout


@pytest.mark.slow
def test_an_interleaved_pipeline_of_uneven_stages_trains_with_plans_of_two_model_chunks_a_rank(training_ready):
    """--num-virtual-stages-per-pipeline-rank 2 with --decoder-first-pipeline-num-layers 2 of 6:
    Megatron-LM builds two model chunks a rank (one data iterator, the first chunk's), of 1 and 2
    layers on the two ranks; the planner plans interleaved-1f1b over four virtual stages priced
    so, and the executor runs each plan's chunks. At 4 MB micro-batches sized for 1F1B fit no
    interleaved schedule; those sized for its warm-up do."""
    stdout, losses, plans = _smoke(training_ready / "pretrain_gpt.py",
                                   ["--mock-data", "--num-layers", "6", "--num-virtual-stages-per-pipeline-rank", "2",
                                    "--decoder-first-pipeline-num-layers", "2", "--dynapipe-memory-limit", "4"])
    _check_training(stdout, losses, plans)
    assert "schedule interleaved-1f1b" in stdout, stdout[-4000:]
    assert "virtual pipeline stages of 1 + 2 + 1 + 2 transformer layers (Megatron-LM's pipeline split)" in stdout
    for count, line in re.findall(r"train iteration \d+: (\d+) micro-batches .*recompute \[([nsf/]+)\]", stdout):
        assert [len(run) for run in line.split("/")] == [int(count)] * 2  # a choice per chunk and micro-batch


@pytest.mark.slow
def test_context_parallel_training_matches_the_whole_sequences_run(training_ready, launcher_run):
    """--context-parallel-size 2 on four ranks (PP 2 x CP 2): each stage's two ranks hold two of
    every micro-batch's four chunks and pass keys and values round their ring (megatron-core's
    local core has none); the planner prices a rank's half, on --dynapipe-hardware's links and
    roofline. Same samples and weights as the PP 2 run, so each iteration's per-token loss is its
    loss to float error."""
    stdout, losses, plans = _smoke(training_ready / "pretrain_gpt.py", ["--mock-data", "--context-parallel-size", "2",
                                                                        "--dynapipe-hardware", "h100"],
                                   ranks_per_stage=2, timeout=420)
    _check_training(stdout, losses, plans, priced_by=("the roofline of H100-80GB-SXM",
                                                      "H100-80GB-SXM's roofline, not a profile"))
    assert "keys and values passed round the context-parallel ring (--context-parallel-size 2)" in stdout
    np.testing.assert_allclose(losses, launcher_run[1], rtol=1e-5)
    assert plans != launcher_run[2]  # half the activations a rank: fewer, longer micro-batches fit 2 MB


def _patched(checkout: Path, tmp_path: Path) -> Path:
    patched = tmp_path / "patched" / "pretrain_gpt.py"
    patched.parent.mkdir()
    shutil.copy(checkout / "pretrain_gpt.py", patched)
    proc = subprocess.run(["git", "apply", str(patch_for(checkout))], cwd=patched.parent, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return patched


@pytest.mark.slow
def test_a_three_way_blend_trains_alike_through_the_launcher_and_the_patch(training_ready, tmp_path):
    tasks = [_counting_documents(tmp_path / name, 120, seed=k, longest=longest)
             for k, (name, longest) in enumerate([("short", 20), ("medium", 60), ("long", 150)])]
    blend = ["--data-path", "0.5", str(tasks[0]), "0.3", str(tasks[1]), "0.2", str(tasks[2]), "--split", "90,10,0"]
    stdout, losses, plans = _smoke(training_ready / "pretrain_gpt.py", blend)
    _check_training(stdout, losses, plans)
    patched = _smoke(_patched(training_ready, tmp_path), blend, pythonpath=[str(training_ready)])
    assert patched[1] == losses and patched[2] == plans


# A character-level Hugging Face tokenizer with the special tokens of Megatron's
# "nemotron-h-aligned" SFT prompt format (made here: no download).
SFT_SPECIALS = ["<unk>", "<pad>", "</s>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_233>"]


def _sft_tokenizer_dir(path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers", reason="SFT runs need Hugging Face tokenizers and transformers<5 "
                                                          "(Megatron's SFTTokenizer): pip install them")
    transformers = pytest.importorskip("transformers", reason="SFT runs need transformers<5: pip install it")
    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip("Megatron-LM core_v0.16.1's SFTTokenizer reads apply_chat_template as transformers 4 returns it: "
                    "pip install 'transformers<5'")
    import string

    vocab = {t: i for i, t in enumerate(SFT_SPECIALS + sorted(set(string.printable)))}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", pad_token="<pad>",
                                         eos_token="</s>", additional_special_tokens=SFT_SPECIALS[3:]
                                         ).save_pretrained(path)
    return path


def _legacy_sft_tokenizer(checkout: Path) -> bool:
    """Whether the checkout's SFT jobs take Megatron-LM's own tokenizer (``--legacy-tokenizer``,
    before core_v0.17) rather than megatron-core's ``sft`` tokenizer library."""
    return (checkout / "megatron" / "training" / "tokenizer" / "sft_tokenizer.py").is_file()


def _conversations(path: Path, count: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "pipe", "stage", "token", "plan"]
    with open(path, "w") as f:
        for _ in range(count):
            messages = [{"role": "system", "content": "be brief"}]
            for _ in range(int(rng.integers(1, 3))):
                messages += [{"role": "user", "content": " ".join(rng.choice(words, int(rng.integers(1, 5))))},
                             {"role": "assistant", "content": " ".join(rng.choice(words, int(rng.integers(1, 9))))}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.mark.slow
def test_sft_samples_are_the_conversations_megatron_sft_dataset_packs(training_ready, tmp_path):
    """Megatron's own SFTDataset and tokenizer, independently: each conversation's tokens and
    loss mask are what DynaPipe trains as one sample."""
    code = textwrap.dedent(f"""
        import json, numpy as np
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
        from megatron.core.datasets.utils import Split
        from megatron.training.datasets.sft_dataset import SFTDataset
        from megatron_dynapipe.compat.megatron_lm_script import sft_appends_eod
        from megatron_dynapipe.data.sft import sft_dataset

        path, prompt_format = {str(_sft_tokenizer_dir(tmp_path / "tok"))!r}, "nemotron-h-aligned"
        if {_legacy_sft_tokenizer(training_ready)!r}:
            from megatron.training.tokenizer.sft_tokenizer import SFTTokenizer
            tokenizer = SFTTokenizer(path, prompt_format)
        else:
            from megatron.core.tokenizers import MegatronTokenizer
            tokenizer = MegatronTokenizer.from_pretrained(tokenizer_path=path, metadata_path={{"library": "sft"}},
                                                          prompt_format=prompt_format)
        path = {str(_conversations(tmp_path / "chat.jsonl", 24, seed=0))!r}
        lines = [json.loads(line)["messages"] for line in open(path)]
        config = GPTDatasetConfig(random_seed=1, sequence_length=256, blend=None, blend_per_split=[None] * 3,
                                  split="1,0,0", tokenizer=tokenizer, reset_position_ids=False,
                                  reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
                                  mid_level_dataset_surplus=0.005, context_parallel_size=1)
        theirs = SFTDataset(lines, None, np.arange(len(lines)), len(lines), Split.train, config)
        ours = sft_dataset(path, tokenizer, 256, cache_dir={str(tmp_path / "cache")!r}, append_eod=sft_appends_eod())
        assert len(ours) == len(lines)
        for i in range(len(lines)):
            n, packed = len(ours[i]), theirs[i]  # one conversation per line, padded to 256
            assert np.array_equal(packed["tokens"][:n - 1].numpy(), ours[i][:-1]), i
            assert np.array_equal(packed["loss_mask"][:n - 1].numpy() > 0, ours.target_mask(i)[1:]), i
            assert not packed["loss_mask"][n - 1:].any(), i
        print("SAME", len(lines))
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=_env(pythonpath=[str(training_ready)]),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "SAME 24" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_sft_trains_alike_through_the_launcher_and_the_patch_in_normal_and_fast_mode(training_ready, tmp_path):
    sft = ["--sft", *(["--legacy-tokenizer"] if _legacy_sft_tokenizer(training_ready) else []), "--tokenizer-type", "SFTTokenizer",
           "--tokenizer-model", str(_sft_tokenizer_dir(tmp_path / "tok")),
           "--sft-tokenizer-prompt-format", "nemotron-h-aligned",
           "--data-path", str(_conversations(tmp_path / "chat.jsonl", 300, seed=1)), "--split", "90,10,0"]
    stdout, losses, plans = _smoke(training_ready / "pretrain_gpt.py", sft)
    _check_training(stdout, losses, plans)
    patched = _smoke(_patched(training_ready, tmp_path), sft, pythonpath=[str(training_ready)])
    assert patched[1] == losses and patched[2] == plans
    # normal mode plans other micro-batches of the same samples: the same per-token loss
    normal = _smoke(training_ready / "pretrain_gpt.py", sft, fast=False)
    assert normal[1] == pytest.approx(losses, rel=1e-4)
