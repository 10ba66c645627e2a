"""--is-scaling-mode: pretrain_gpt.py through the launcher traces one fake rank instead of training."""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dynapipe.megatron_lm import scaling_mode
from megatron_dynapipe.megatron_lm.arguments import DynapipeArgumentError, add_arguments

from project import MEGATRON_LM_DIR, NO_CHECKOUT, ROOT, patch_for

TINY = dict(num_layers=4, hidden_size=128, num_attention_heads=8, ffn_hidden_size=512, vocab_size=1024,
            seq_length=256, max_position_embeddings=256, micro_batch_size=1, global_batch_size=4096)
TINY_FLAGS = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "8", "--ffn-hidden-size",
              "512", "--seq-length", "256", "--max-position-embeddings", "256", "--vocab-size", "1024",
              "--micro-batch-size", "1", "--global-batch-size", "4096"]


def megatron_like_args(argv, **model):
    """Our arguments parsed by argparse, with Megatron's model arguments set by hand (as Megatron's
    parse_args would leave them)."""
    args = add_arguments(argparse.ArgumentParser()).parse_args(argv)
    for name, value in {**TINY, **model}.items():
        setattr(args, name, value)
    return args


def header(path):
    return json.loads(Path(path).read_text().splitlines()[0])


FAKE = ["--is-scaling-mode", "--fake-world-size", "8192", "--fake-pp", "2", "--fake-tp", "2"]


@pytest.mark.parametrize("rank, stage", [(0, 0), (4096, 1)])  # rank 0; the last stage's representative
def test_traces_the_fake_rank_into_the_trace_dir(tmp_path, capsys, rank, stage):
    args = megatron_like_args([*FAKE, "--fake-current-rank-id", str(rank), "--trace-dir", str(tmp_path)])
    result = scaling_mode.run(args, shapes_only=True)
    path = tmp_path / f"rank_{rank}.trace.jsonl"
    assert result.path == path and path.is_file()
    h = header(path)
    assert h["rank"] == rank and h["stage"] == stage and h["mode"] == "shapes_only"
    assert {k: h["layout"][k] for k in ("world_size", "pp", "tp", "cp", "dp")} == dict(
        world_size=8192, pp=2, tp=2, cp=1, dp=2048)
    assert h["iteration"]["num_microbatches"] == 4096 // (1 * 2048)
    assert h["model"]["hidden_size"] == 128 and h["model"]["num_layers"] == 4
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "scaling mode" in x]
    assert f"fake rank {rank} (stage {stage})" in line and "W=8192 TP=2 PP=2" in line and str(path) in line


def test_small_model_runs_real_compute_by_default(tmp_path):
    args = megatron_like_args([*FAKE, "--fake-current-rank-id", "4096", "--trace-dir", str(tmp_path)])
    result = scaling_mode.run(args, verbose=False)
    assert result.shapes_only is False and header(result.path)["mode"] == "real"


def test_a_job_that_names_no_layers_traces_megatron_lms_default_ones(tmp_path):
    """Megatron-LM builds transformer-engine's layers unless ``--transformer-impl local`` says
    otherwise (its TransformerConfig's default), so a job's own command line is traced with
    transformer-engine's fused attention core; ``--dynapipe-attention sdpa`` belongs to the local
    layers and is refused on the others, as the hooks refuse it in a real run."""
    flags = [*TINY_FLAGS, *FAKE, "--fake-current-rank-id", "0"]
    for extra, core in (([], "transformer_engine"), (["--transformer-impl", "local"], "local"),
                        (["--transformer-impl", "local", "--dynapipe-attention", "sdpa"], "sdpa")):
        args = scaling_mode.parse_args([*flags, *extra, "--trace-dir", str(tmp_path / core)])
        assert header(scaling_mode.run(args, shapes_only=True, verbose=False).path)["model"]["attention"] == core
    with pytest.raises(DynapipeArgumentError, match="pass --transformer-impl local, or drop --dynapipe-attention"):
        scaling_mode.run(scaling_mode.parse_args([*flags, "--dynapipe-attention", "sdpa"]), shapes_only=True)


@pytest.mark.parametrize("argv, model, message", [
    (["--fake-world-size", "8190", "--fake-pp", "2", "--fake-tp", "2"], {},
     "--fake-world-size 8190 is not divisible by --fake-tp·--fake-pp·--fake-cp = 2·2·1 = 4: make it a multiple of 4"),
    (["--fake-world-size", "8192", "--fake-pp", "2"], {}, "--is-scaling-mode needs --fake-tp N"),
    (["--fake-world-size", "8192", "--fake-pp", "2", "--fake-tp", "2", "--fake-current-rank-id", "8192"], {},
     "pass a rank in 0..8191"),
    (["--fake-world-size", "8192", "--fake-pp", "2", "--fake-tp", "2"], {"global_batch_size": 1000},
     "global batch 1000 is not divisible by micro-batch × DP"),
    (["--fake-world-size", "8192", "--fake-pp", "2", "--fake-tp", "2"], {"vocab_size": None},
     "needs --vocab-size N"),
])
def test_invalid_fake_layout_is_a_one_line_error(tmp_path, argv, model, message):
    args = megatron_like_args(["--is-scaling-mode", *argv, "--trace-dir", str(tmp_path)], **model)
    with pytest.raises(DynapipeArgumentError) as info:
        scaling_mode.run(args)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not list(tmp_path.iterdir())


def test_megatron_cp_and_ep_flags_stand_in_for_the_fake_ones():
    args = scaling_mode.parse_args([*FAKE, *TINY_FLAGS, "--context-parallel-size", "2",
                                    "--expert-model-parallel-size", "2", "--num-experts", "4", "--lr", "1"])
    scaling_mode._resolve_fake_sizes(args)
    assert (args.fake_cp, args.fake_ep, args.fake_num_experts) == (2, 2, 4)


def test_requested_only_with_the_flag():
    assert scaling_mode.requested(["--num-layers", "2", "--is-scaling-mode"])
    assert not scaling_mode.requested(["--num-layers", "2", "--dynapipe"])


def _with_checkout_on_path() -> dict:
    """This environment with the checkout first on PYTHONPATH, the caller's paths kept after it
    (megatron-core may live only there, e.g. installed with pip --target)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def _launch(tmp_path, *flags):
    script = tmp_path / "Megatron-LM" / "pretrain_gpt.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text("raise SystemExit('scaling mode must not run the script')\n")
    return subprocess.run([sys.executable, "-m", "megatron_dynapipe.megatron_lm.launcher", str(script), *flags],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env=_with_checkout_on_path())


@pytest.mark.slow
def test_launcher_traces_instead_of_running_the_script(tmp_path):
    out = _launch(tmp_path, *TINY_FLAGS, "--mock-data", "--lr", "1.5e-4", *FAKE, "--fake-current-rank-id", "4096",
                  "--trace-dir", "t")
    assert out.returncode == 0, out.stdout + out.stderr
    assert header(tmp_path / "t" / "rank_4096.trace.jsonl")["rank"] == 4096
    assert "> megatron-dynapipe scaling mode: fake rank 4096 (stage 1)" in out.stdout


def test_launcher_reports_an_invalid_layout_in_one_line(tmp_path):
    out = _launch(tmp_path, *TINY_FLAGS, "--is-scaling-mode", "--fake-world-size", "8190", "--fake-pp", "2",
                  "--fake-tp", "2")
    assert out.returncode == 2
    (line,) = [x for x in out.stderr.splitlines() if "error" in x]
    assert line.startswith("megatron-dynapipe launch: error: --fake-world-size 8190") and "multiple of 4" in line


@pytest.mark.slow
def test_update_pretrain_gpt_through_the_launcher(tmp_path):
    """The script's MEGATRON_LM_DIR way: a stand-in checkout is enough, scaling mode never runs the script."""
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("raise SystemExit('scaling mode must not run the script')\n")
    out = subprocess.run(["bash", str(ROOT / "examples" / "update_pretrain_gpt.sh"), "8192 2 2"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "PYTHON": sys.executable, "MODEL_SIZE": "tiny",
                              "MEGATRON_LM_DIR": str(checkout), "OUTPUT_DIR": str(tmp_path / "out")})
    assert out.returncode == 0, out.stdout + out.stderr
    (folder,) = (tmp_path / "out").iterdir()
    # the same files as the default way (test_batch_config: test_update_pretrain_gpt_default_run_on_cpu)
    assert {p.name for p in folder.iterdir()} == {"rank_0.trace.jsonl", "rank_4096.trace.jsonl", "fake_rank_0.log",
                                                   "fake_rank_4096.log", "summary.json", "timeline.json"}
    assert header(folder / "rank_4096.trace.jsonl")["layout"]["world_size"] == 8192
    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["status"], summary["complete"], summary["shapes_only"]) == ("ok", True, False)
    assert [(r["rank"], r["stage"], r["status"], r["log"]) for r in summary["ranks"]] == [
        (0, 0, "ok", "fake_rank_0.log"), (4096, 1, "ok", "fake_rank_4096.log")]
    timeline = json.loads((folder / "timeline.json").read_text())
    assert {e["pid"] for e in timeline["traceEvents"]} == {0, 4096}




@pytest.mark.slow
@pytest.mark.skipif(not (MEGATRON_LM_DIR and Path(MEGATRON_LM_DIR, "pretrain_gpt.py").is_file()), reason=NO_CHECKOUT)
def test_pretrain_gpt_of_a_checkout_end_to_end(tmp_path):
    script = Path(MEGATRON_LM_DIR) / "pretrain_gpt.py"
    out = subprocess.run([sys.executable, "-m", "megatron_dynapipe.megatron_lm.launcher", str(script), *TINY_FLAGS,
                          "--mock-data", "--tokenizer-type", "NullTokenizer", "--lr", "1.5e-4", "--train-iters", "2",
                          *FAKE, "--fake-current-rank-id", "0", "--trace-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=_with_checkout_on_path())
    assert out.returncode == 0, out.stdout + out.stderr
    assert header(tmp_path / "rank_0.trace.jsonl")["rank"] == 0


@pytest.mark.slow
@pytest.mark.skipif(not (MEGATRON_LM_DIR and Path(MEGATRON_LM_DIR, "pretrain_gpt.py").is_file()), reason=NO_CHECKOUT)
def test_the_patched_script_alone_traces_as_the_launcher_does_on_cpu(tmp_path):
    """No launcher, no CUDA: the patched pretrain_gpt.py traces the fake rank before pretrain()
    would ask for a GPU, in the same precision and with the same ops as the launcher."""
    patched = tmp_path / "patched" / "pretrain_gpt.py"
    patched.parent.mkdir()
    shutil.copy(Path(MEGATRON_LM_DIR) / "pretrain_gpt.py", patched)
    applied = subprocess.run(["git", "apply", str(patch_for(Path(MEGATRON_LM_DIR)))],
                             cwd=patched.parent, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    flags = [*TINY_FLAGS, "--mock-data", "--tokenizer-type", "NullTokenizer", "--lr", "1.5e-4", "--train-iters", "2",
             *FAKE, "--fake-current-rank-id", "0"]
    env = _with_checkout_on_path()
    env["PYTHONPATH"] = os.pathsep.join([MEGATRON_LM_DIR, env["PYTHONPATH"]])
    runs = {"patched": [str(patched)], "launcher": ["-m", "megatron_dynapipe.megatron_lm.launcher",
                                                    str(Path(MEGATRON_LM_DIR) / "pretrain_gpt.py")]}
    traces = {}
    for name, command in runs.items():
        out = subprocess.run([sys.executable, *command, *flags, "--trace-dir", str(tmp_path / name)],
                             capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        traces[name] = tmp_path / name / "rank_0.trace.jsonl"
    assert header(traces["patched"])["model"]["dtype"] == header(traces["launcher"])["model"]["dtype"] == "float32"
    ops = {name: [{k: v for k, v in json.loads(line).items() if k in ("kind", "name", "bytes", "phase")}
                  for line in path.read_text().splitlines()[1:]] for name, path in traces.items()}
    assert ops["patched"] == ops["launcher"] and ops["patched"]


LLAMA_FLAGS = ["--swiglu", "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", "2",
               "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def tp_forward_all_reduce_bytes(path) -> set:
    ops = [json.loads(line) for line in Path(path).read_text().splitlines()[1:]]
    return {op["bytes"] for op in ops if op.get("group_name") == "TENSOR_MODEL_PARALLEL_GROUP"
            and op.get("kind") == "all_reduce" and op.get("phase") == "forward"}


@pytest.mark.parametrize("precision, dtype, element_bytes", [([], "float32", 4), (["--fp16"], "float16", 2),
                                                             (["--bf16"], "bfloat16", 2)])
def test_model_and_precision_flags_reach_the_trace(tmp_path, precision, dtype, element_bytes):
    argv = [*FAKE, "--fake-current-rank-id", "0", "--trace-dir", str(tmp_path), *TINY_FLAGS, *LLAMA_FLAGS, *precision]
    result = scaling_mode.run(scaling_mode.parse_args(argv), shapes_only=True, verbose=False)
    model = header(result.path)["model"]
    assert (model["swiglu"], model["normalization"], model["num_query_groups"], model["position_embedding_type"],
            model["share_embeddings_and_output_weights"], model["add_bias_linear"]) == (
        True, "RMSNorm", 2, "rope", False, False)
    assert model["dtype"] == dtype
    assert tp_forward_all_reduce_bytes(result.path) == {256 * 1 * 128 * element_bytes}  # [seq, mbs, hidden]


@pytest.mark.parametrize("flag, dtype", [("--bf16", "bfloat16"), ("--fp16", "float16")])
def test_16_bit_training_traces_with_real_compute_on_cpu(tmp_path, flag, dtype):
    """Megatron's mixed-precision optimizer and fp16 loss scaler are built for CUDA tensors; on
    CPU a --bf16/--fp16 command line still traces for real, issuing the shapes-only trace's ops,
    with 16-bit pipeline activations [seq, mbs, hidden]."""
    traces = {}
    for mode in ("real", "shapes"):
        argv = [*FAKE, "--fake-current-rank-id", "0", "--trace-dir", str(tmp_path / mode), *TINY_FLAGS, flag]
        traces[mode] = scaling_mode.run(scaling_mode.parse_args(argv), shapes_only=mode == "shapes",
                                        verbose=False).trace
    real, shapes = traces["real"], traces["shapes"]
    assert (real.mode, real.model["dtype"]) == ("real", dtype)
    assert real.signatures() == shapes.signatures()
    p2p = {p["bytes"] for op in real.ops if op.parts for p in op.parts}
    assert p2p == {256 * 1 * 128 * 2}


@pytest.mark.parametrize("flag", ["--fp8-format=hybrid"])
def test_a_flag_the_tracer_cannot_represent_is_refused_not_ignored(tmp_path, flag):
    argv = [*FAKE, "--fake-current-rank-id", "0", "--trace-dir", str(tmp_path), *TINY_FLAGS, flag]
    with pytest.raises(DynapipeArgumentError) as info:
        scaling_mode.run(scaling_mode.parse_args(argv), shapes_only=True, verbose=False)
    assert f"does not trace {flag.split('=')[0]} yet" in str(info.value) and "\n" not in str(info.value)
    assert not list(tmp_path.iterdir())


def test_training_flags_reach_the_trace(tmp_path):
    """--use-distributed-optimizer, --sequence-parallel and full recompute, as Megatron-LM spells them."""
    argv = [*FAKE, "--fake-current-rank-id", "0", "--trace-dir", str(tmp_path), *TINY_FLAGS, "--bf16",
            "--use-distributed-optimizer", "--sequence-parallel", "--recompute-granularity", "full",
            "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    result = scaling_mode.run(scaling_mode.parse_args(argv), shapes_only=True, verbose=False)
    h = header(result.path)
    assert h["iteration"]["training"] == dict(
        distributed_optimizer=True, overlap_grad_reduce=False, overlap_param_gather=False, bucket_size=None,
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, sequence_parallel=True,
        tp_comm_overlap=False, layers_per_virtual_stage=None, virtual_stages=None, overlap_p2p_comm=True,
        first_stage_layers=None, last_stage_layers=None, account_for_embedding=False, account_for_loss=False,
        async_tp_backward=True)
    ops = [json.loads(line) for line in Path(result.path).read_text().splitlines()[1:]]
    kinds = {(op["kind"], op.get("group_name")) for op in ops if op["cat"] == "comm"}
    assert ("reduce_scatter", "DATA_PARALLEL_GROUP_WITH_CP") in kinds and ("all_gather", "TENSOR_MODEL_PARALLEL_GROUP") in kinds
    p2p = {p["bytes"] for op in ops if op.get("parts") for p in op["parts"]}
    assert p2p == {256 * 1 * 128 * 2 // 2}  # [seq / TP, mbs, hidden] bf16


def test_interleaving_flags_trace_megatron_lms_interleaved_schedule(tmp_path):
    """Two one-layer chunks per stage of PP=2: each of the 2 micro-batches runs forward through
    both chunks; stage 0 sends its activations out of both chunks (the second to stage 1's
    second chunk) and its gradients out of the second only: 2 x (2 + 1) = 6 separate isends
    (Megatron-LM overlaps interleaved p2p, so they are not batched) of [seq, mbs, hidden] fp32."""
    argv = [*FAKE, "--fake-current-rank-id", "0", "--trace-dir", str(tmp_path), *TINY_FLAGS,
            "--num-layers-per-virtual-pipeline-stage", "1"]
    result = scaling_mode.run(scaling_mode.parse_args(argv), shapes_only=True, verbose=False)
    h = header(result.path)
    assert h["iteration"]["schedule"] == "forward_backward_pipelining_with_interleaving"
    assert h["iteration"]["training"]["layers_per_virtual_stage"] == 1
    ops = [json.loads(line) for line in Path(result.path).read_text().splitlines()[1:]]
    assert sorted(op["chunk"] for op in ops if op["kind"] == "forward") == [0, 0, 1, 1]
    sends = [op for op in ops if op["kind"] == "isend"]
    assert len(sends) == 6 and {op["bytes"] for op in sends} == {256 * 1 * 128 * 4}
    assert not any(op["kind"] == "batch_isend_irecv" for op in ops)


@pytest.mark.parametrize("flags, message", [
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--recompute-granularity", "full"], "needs --recompute-method"),
    (["--num-virtual-stages-per-pipeline-rank", "3"], "the 2 layers of pipeline stage 0 do not split into 3 model chunks"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--no-overlap-p2p-communication"],
     r"needs PP > 1 \(PP > 2 with --no-overlap-p2p-communication\)"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "6144"],
     "use a multiple of 2 micro-batches, not 3"),
])
def test_training_flags_megatron_refuses_are_refused_before_tracing(tmp_path, flags, message):
    argv = [*FAKE, "--fake-current-rank-id", "0", "--trace-dir", str(tmp_path), *TINY_FLAGS, *flags]
    with pytest.raises(DynapipeArgumentError, match=message):
        scaling_mode.run(scaling_mode.parse_args(argv), shapes_only=True, verbose=False)
    assert not list(tmp_path.iterdir())
