"""`megatron-dynapipe plan` as a user runs it: a real subprocess of the installed entry point."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

import megatron_dynapipe

from project import GPT_6_7B_A100


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_plan_json_on_a_lengths_file(tmp_path):
    lengths = [12, 900, 33, 400, 2048, 77, 150, 600, 64, 1500]
    path = tmp_path / "lengths.txt"
    path.write_text("# one length a line\n" + "\n".join(map(str, lengths)) + "\n")
    out = run_cli("plan", "--lengths", str(path), "--cost-model", str(GPT_6_7B_A100), "--pp", "4", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    placed = sorted(i for m in summary["dp_ranks"][0]["microbatches"] for i in m["samples"])
    assert placed == list(range(len(lengths)))
    assert summary["num_samples"] == 10 and summary["tokens"] == sum(lengths)
    assert summary["planning_seconds"] > 0
    assert summary["makespan_ms"] >= summary["lower_bound_ms"] > 0
    assert summary["baseline"]["makespan_ms"] > 0
    assert max(summary["peak_memory_mb"]) <= 36_000


def test_plan_default_mix_with_pictures(tmp_path):
    trace, gantt = tmp_path / "plan.json", tmp_path / "plan.png"
    out = run_cli("plan", "--num-samples", "24", "--pp", "2", "--memory-limit", "70000", "--fast-mode",
                  "--chrome-trace", str(trace), "--gantt", str(gantt))
    assert out.returncode == 0, out.stderr
    assert "fast mode: on" in out.stdout and "predicted iteration" in out.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    computes = [e for e in events if e.get("ph") == "X" and e["cat"] in ("F", "B")]
    assert len(computes) == 2 * 2 * len({e["args"]["microbatch"] for e in computes})
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_of_one_micro_batch_shape_is_written_once_with_its_count(tmp_path):
    """400 samples of 1024 tokens and 40 of 16: the plan's line of shapes names each run once with
    its count, and the counts add up to the micro-batches it says it has."""
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(["1024"] * 400 + ["16"] * 40))
    out = run_cli("plan", "--lengths", str(path), "--pp", "2", "--num-layers", "4", "--fast-mode")
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("dp rank 0:")]
    total = int(re.search(r"(\d+) micro-batches", line).group(1))
    shapes = line.split("in pipeline order): ")[1].split(", ")
    counts = [int(m.group(1)) if (m := re.search(r"\(x(\d+)\)$", shape)) else 1 for shape in shapes]
    assert sum(counts) == total and len(shapes) < total and len(line) < 400
    assert all(a.split()[0] != b.split()[0] for a, b in zip(shapes, shapes[1:]))  # runs are whole


def test_dp_lengths_split_shows_every_rank():
    out = run_cli("plan", "--num-samples", "20", "--pp", "2", "--dp", "2", "--memory-limit", "70000", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert len(summary["dp_ranks"]) == 2
    placed = sorted(i for r in summary["dp_ranks"] for m in r["microbatches"] for i in m["samples"])
    assert placed == list(range(20))


def test_plan_interleaves_and_splits_sequences_over_context_parallel_ranks():
    """--chunks 2 plans interleaved-1f1b with a recompute choice per (virtual stage, micro-batch);
    --cp 2 prices a rank's half of every sequence, so the same batch plans faster."""
    base = ["plan", "--num-samples", "48", "--pp", "2", "--num-layers", "8", "--fast-mode", "--json"]
    plain, chunked, split = (json.loads(run_cli(*base, *extra).stdout) for extra in ([], ["--chunks", "2"], ["--cp", "2"]))
    assert (chunked["chunks"], split["cp"], plain["chunks"], plain["cp"]) == (2, 2, 1, 1)
    assert {r["schedule"] for r in chunked["dp_ranks"]} == {"interleaved-1f1b"}
    assert split["makespan_ms"] < plain["makespan_ms"]
    header = run_cli(*base[:-1], "--chunks", "2", "--cp", "2").stdout.splitlines()[0]
    assert "PP=2 x 2 chunks DP=1 TP=1 CP=2" in header


@pytest.mark.parametrize("args,message", [
    (["--lengths", "/nonexistent/lengths.txt"], "lengths file /nonexistent/lengths.txt not found"),
    (["--cost-model", "/nonexistent/cm.json"], "not found"),
    (["--memory-limit", "1000"], "model state alone needs"),
    (["--pack-length", "16"], "--pack-length 16 is shorter than the longest sample"),
    # absurd sizes are refused with the limit named, before a batch is drawn or read
    (["--num-samples", "1000000000"], "--num-samples 1,000,000,000 samples: a global batch holds at most 1,048,576"),
    (["--lengths", "/dev/zero"], "lengths file /dev/zero is not a regular file"),  # never ends
    (["--lengths", "/"], "lengths file / is not a regular file"),
])
def test_bad_input_is_one_line_naming_the_fix(args, message):
    out = run_cli("plan", *args) if args[0] == "--lengths" else run_cli("plan", "--num-samples", "8", *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_lengths_come_from_standard_input_too():
    """``--lengths -`` reads standard input as a file is read, with the same checks."""
    read = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "plan", "--lengths", "-", "--json"],
                          input="100\n200  # a comment\n\n300\n", capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr
    assert (json.loads(read.stdout)["num_samples"], json.loads(read.stdout)["tokens"]) == (3, 600)
    bad = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "plan", "--lengths", "-"],
                         input="100\nten\n", capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "standard input is not a list of integer lengths" in bad.stderr


def test_cost_model_without_the_requested_tp(tmp_path):
    out = run_cli("plan", "--num-samples", "8", "--tp", "3", "--cost-model", str(GPT_6_7B_A100))
    assert out.returncode == 2 and "tp=3" in out.stderr and "1, 2, 4, 8" in out.stderr


def test_malformed_lengths_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("[1, 2, \"x\"]")
    out = run_cli("plan", "--lengths", str(path))
    assert out.returncode == 2 and "not a list of integer lengths" in out.stderr


@pytest.mark.parametrize("flag,expected", [(["--fast-mode"], "on"), (["--fast-mode", "true"], "on"),
                                           (["--fast-mode", "false"], "off"), (["--fast-mode", "auto"], "on"),
                                           ([], "off")])
def test_fast_mode_flag_speaks_the_megatron_flags_vocabulary(flag, expected):
    # 24 samples: "auto" is fast above 16.
    env = {k: v for k, v in os.environ.items() if k != "DYNAPIPE_FAST_MODE"}
    out = run_cli("plan", "--num-samples", "24", "--pp", "2", "--memory-limit", "70000", *flag, env=env)
    assert out.returncode == 0, out.stderr
    assert f"fast mode: {expected}" in out.stdout


SEARCH = ("search", "--world-size", "8", "--global-batch-size", "8", "--model", "13", "--hardware", "h100")


@pytest.mark.parametrize("command,flag,value,says", [
    (SEARCH, "--seq-length", "0", "0 must be a positive integer"),
    (SEARCH, "--world-size", "0", "0 must be a positive integer"),
    (SEARCH, "--top", "0", "0 must be a positive integer"),
    (("bench", "step"), "--max-seq-length", "0", "0 must be a positive integer"),
    (("bench", "step"), "--memory-limit", "0", "0 must be a positive number"),
    (("calibrate",), "--max-bytes", "0", "0 must be a positive integer"),
    (("trace", "--shapes-only"), "--seq-length", "0", "0 must be a positive integer"),
])
def test_a_count_below_one_is_refused_instead_of_taking_its_default(command, flag, value, says):
    """``search --seq-length 0`` used to search at the model's length, ``bench step --memory-limit 0``
    to run with the default limit and ``calibrate --max-bytes 0`` to time its default sizes."""
    out = run_cli(*command, flag, value)
    name = " ".join(c for c in command if not c.startswith("-") and c not in SEARCH[1:])
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert f"megatron-dynapipe {name}: error: argument " in out.stderr and f"{flag}: {says}" in out.stderr, out.stderr


def test_fast_mode_flag_refuses_other_words():
    out = run_cli("plan", "--num-samples", "8", "--fast-mode", "maybe")
    assert out.returncode == 2 and "'maybe' is not a fast mode: use true, false or auto" in out.stderr


@pytest.mark.parametrize("args,message", [
    (["--gantt", "{tmp}"], "is a folder: give a file name"),
    (["--gantt", "{tmp}/g.txt"], "end the name with one of .png, .svg, .pdf"),
    (["--chrome-trace", "{tmp}/t.json", "--gantt", "{tmp}"], "is a folder"),  # nothing written first
    (["--memory-limit", "nan"], "--memory-limit must be a positive number of MB, got nan"),
    (["--memory-limit", "inf"], "--memory-limit must be a positive number of MB, got inf"),
    (["--pack-length", "0"], "--pack-length must be at least 1 token"),
    (["--pp", "3"], "32 layers do not split evenly into --pp = 3 pipeline stages: use --pp among 1, 2, 4, 8, 16, 32"),
    (["--num-samples", "0"], "--num-samples must be at least 1"),
    (["--chunks", "2", "--pp", "1"], "--chunks 2 with --pp 1: model chunks interleave a pipeline of at least 2 stages"),
    (["--chunks", "3"], "32 layers do not split evenly into --pp x --chunks = 12 pipeline stages"),
    (["--cp", "0"], "--cp must be at least 1, got 0"),
])
def test_bad_plan_arguments_are_refused_before_planning_and_leave_nothing(tmp_path, args, message):
    out = run_cli("plan", "--num-samples", "8", *[a.format(tmp=tmp_path) for a in args])
    assert out.returncode == 2, out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text", ["[100.5, 200]", "[true, 5]", "[1e309]", "[0, 4]", "{\"a\": 1}"])
def test_lengths_that_are_not_whole_positive_numbers_are_refused(tmp_path, text):
    path = tmp_path / "lengths.json"
    path.write_text(text)
    out = run_cli("plan", "--lengths", str(path))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "whole number of tokens >= 1" in lines[0], out.stderr


@pytest.mark.parametrize("suffix,magic", [(".svg", b"<?xml"), (".pdf", b"%PDF"), (".png", b"\x89PNG")])
def test_gantt_of_every_dp_rank_in_the_format_its_suffix_names(tmp_path, suffix, magic):
    gantt, trace = tmp_path / f"plan{suffix}", tmp_path / "plan.json"
    old = os.umask(0o022)
    try:
        out = run_cli("plan", "--num-samples", "24", "--pp", "2", "--dp", "2", "--memory-limit", "70000",
                      "--gantt", str(gantt), "--chrome-trace", str(trace))
    finally:
        os.umask(old)
    assert out.returncode == 0, out.stderr
    assert gantt.read_bytes().startswith(magic)
    assert f"wrote Gantt chart to {gantt}" in out.stdout and f"wrote Chrome trace to {trace}" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([gantt.name, trace.name])  # no temporaries
    for path in (gantt, trace):
        assert path.stat().st_mode & 0o777 == 0o644  # the mode of any new file under umask 022
    events = json.loads(trace.read_text())["traceEvents"]
    ranks = {e["args"]["dp_rank"] for e in events if e.get("ph") == "X"}
    assert ranks == {0, 1}


def test_a_plan_slower_than_packing_says_why():
    # The case users met: lognormal, 32 samples, analytical GPT-6.7B: packing 802 ms, plan 844 ms.
    out = run_cli("plan", "--num-samples", "32", "--mix", "lognormal")
    assert out.returncode == 0, out.stderr
    assert "-> speed-up 0.9" in out.stdout
    assert "packing concatenates several samples into one sequence, which a plan" in out.stdout


def test_a_packed_plan_is_measured_against_packed_sequences_without_leakage(tmp_path):
    # Eight 1024-token and eight 512-token samples pack into six sequences of 2048 (first-fit
    # decreasing: four of two 1024s, two of four 512s). THD packing attends within each sample,
    # so the same rows cost no more than leaky packing's: its yardstick can only be lower.
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([1024] * 8 + [512] * 8))
    common = ["plan", "--lengths", str(path), "--cost-model", str(GPT_6_7B_A100), "--pp", "4", "--pack-length", "2048"]
    packed, padded = (run_cli(*common, "--packing", packing, "--json") for packing in ("varlen", "pad"))
    assert packed.returncode == 0 and padded.returncode == 0, packed.stderr + padded.stderr
    thd, leaky = json.loads(packed.stdout), json.loads(padded.stdout)
    assert thd["baseline"]["method"] == "THD packing (whole) + 1f1b" and leaky["baseline"]["method"] == "packing + 1f1b"
    assert thd["baseline"]["num_sequences"] == leaky["baseline"]["num_sequences"] == 6
    assert thd["baseline"]["makespan_ms"] < leaky["baseline"]["makespan_ms"]
    assert thd["speedup_vs_packing"] == pytest.approx(thd["baseline"]["makespan_ms"] / thd["makespan_ms"])
    assert thd["ideal_gain_vs_packing"] is None and leaky["ideal_gain_vs_packing"] > 1
    text = run_cli(*common, "--packing", "varlen").stdout
    assert "THD packing (whole) to 2048 + 1F1B" in text
    assert "exact lengths alone" not in text and "cannot represent" not in text
    # two chunks a rank: the yardstick runs Megatron's interleaved 1F1B, faster than its 1F1B here
    interleaved = run_cli(*common, "--packing", "varlen", "--chunks", "2", "--json")
    assert interleaved.returncode == 0, interleaved.stderr
    interleaved = json.loads(interleaved.stdout)
    assert interleaved["baseline"]["method"] == "THD packing (whole) + interleaved-1f1b"
    assert (interleaved["baseline"]["schedule"], thd["baseline"]["schedule"]) == ("interleaved-1f1b", "1f1b")
    assert interleaved["baseline"]["makespan_ms"] < thd["baseline"]["makespan_ms"]
    interleaved_text = run_cli(*common, "--packing", "varlen", "--chunks", "2").stdout
    assert "THD packing (whole) to 2048 + interleaved 1F1B" in interleaved_text


def test_the_readme_plan_example_runs_as_written(tmp_path):
    from project import ROOT

    text = (ROOT / "README.md").read_text()
    start = text.index("megatron-dynapipe plan --lengths")
    command = text[start:text.index("```", start)].replace("\\\n", " ").split()
    assert command[:2] == ["megatron-dynapipe", "plan"]
    args = [str(tmp_path / a) if a in ("plan.json", "plan.png") else a for a in command[2:]]
    out = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "plan", *args],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "plan.json").is_file() and (tmp_path / "plan.png").is_file()
    # the gain of exact lengths alone is said for what it is: below the plan's, the baseline's
    # full recompute and bubbles make up the rest
    speedup, alone = (float(x) for x in re.search(r"speed-up ([0-9.]+)x \(exact lengths alone, compute only: "
                                                  r"([0-9.]+)x; the rest: recompute and pipeline bubbles\)",
                                                  out.stdout).groups())
    assert speedup > alone > 1


def _readme_command(text: str, start: str) -> list[str]:
    """The README's command that begins with ``start``: its continued lines joined, its comment dropped."""
    at = text.index(start)
    lines = []
    for line in text[at:].splitlines():
        lines.append(line.split("#")[0].rstrip().removesuffix("\\"))
        if not line.split("#")[0].rstrip().endswith("\\"):
            return shlex.split(" ".join(lines))
    raise AssertionError(f"{start}: no end")


@pytest.mark.slow
def test_the_readme_trace_walkthrough_simulates_a_job_that_fits_an_h100(tmp_path):
    from project import ROOT

    text = (ROOT / "README.md").read_text()
    trace = _readme_command(text, "megatron-dynapipe trace --model 175")
    trace[trace.index("--output-dir") + 1] = str(tmp_path / "traces")
    out = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", *trace[1:], "--no-progress"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    simulate = _readme_command(text, "megatron-dynapipe simulate traces")
    out = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", simulate[1], str(tmp_path / "traces"),
                          *simulate[3:], "--json", "--no-timeline"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    reports = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(reports) == 2 and {r["hardware"] for r in reports} == {"H100-80GB-SXM"}
    assert all(r["fits"] and r["peak_memory_gib"] < r["device_memory_gib"] == 80 for r in reports), \
        [(r["layout"], r["peak_memory_gib"]) for r in reports]


def test_version():
    import platform

    proc = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith(
        f"megatron-dynapipe {megatron_dynapipe.__version__} (Python {platform.python_version()}, torch ")


def test_a_reader_that_goes_away_ends_the_output_quietly():
    """``megatron-dynapipe plan --json | head -c 0``: the pipe is closed before anything is written."""
    proc = subprocess.Popen([sys.executable, "-m", "megatron_dynapipe.cli", "plan", "--num-samples", "32", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # long before the planner prints (it imports first)
    stderr = proc.stderr.read().decode()
    assert proc.wait() == 0, stderr
    assert "BrokenPipe" not in stderr and "Traceback" not in stderr and "Broken pipe" not in stderr


@pytest.mark.parametrize("args, line", [
    (("plan", "--mix", "nope"), "megatron-dynapipe plan: error: argument --mix: invalid choice: 'nope'"),
    (("plan", "--bogus"), "megatron-dynapipe plan: error: unrecognized arguments: --bogus"),
    (("bench", "planner", "--sizes", "x"), "megatron-dynapipe bench planner: error: argument --sizes"),
    (("nope",), "megatron-dynapipe: error: argument command: invalid choice: 'nope'"),
])
def test_a_command_line_mistake_is_one_line_pointing_at_that_commands_help(args, line):
    proc = run_cli(*args)
    assert proc.returncode == 2
    (only,) = proc.stderr.splitlines()
    assert only.startswith(line) and only.endswith(f"(see {line.split(':')[0]} --help)"), only


def test_plan_says_what_it_priced_the_layers_with(tiny_profile, tmp_path):
    path, _ = tiny_profile  # measured on the tiny GPT's 4 layers; planned here as 32 of them
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in (17, 90, 120, 33, 64, 8, 100, 75)))
    out = run_cli("plan", "--lengths", str(lengths), "--cost-model", str(path), "--pp", "4", "--memory-limit", "4000")
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("model: ")]
    assert line.startswith("model: 32 layers priced by profile ") and "layers measured on a 4-layer model" in line
    assert "cpu" in line.lower() and "tp 1" in line
    default = run_cli("plan", "--num-samples", "16", "--json")
    assert json.loads(default.stdout)["cost_model"].startswith("the analytical GPT model (hidden 4096, 32 heads")


def test_plan_prices_a_named_model_on_a_device_at_a_large_layout():
    # GPT-175B (96 layers, hidden 12288) on H100s, TP 8 x PP 16 x DP 64 = 8192 GPUs, 256 samples
    out = run_cli("plan", "--model", "175B", "--hardware", "h100", "--tp", "8", "--pp", "16", "--dp", "64",
                  "--num-samples", "256", "--fast-mode", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["num_layers"] == 96 and (summary["pp"], summary["tp"], summary["dp"]) == (16, 8, 64)
    assert summary["memory_limit_mb"] == 0.9 * 80 * 1024  # the H100's 80 GiB less the headroom
    assert summary["cost_model"].startswith("the roofline GPT model (hidden 12288, 96 heads")
    assert "989.4 TFLOP/s" in summary["cost_model"]
    # the TP group's collectives, as search prices them
    assert summary["cost_model"].endswith("tp 8, with TP 8's all-reduces (what outlasts the GEMMs beside them: "
                                          "megatron-core's)")
    assert len(summary["dp_ranks"]) == 64 and summary["makespan_ms"] >= summary["lower_bound_ms"] > 0
    # the same 256 samples on A100s (312 TFLOP/s, 2039 GB/s) take longer
    a100 = json.loads(run_cli("plan", "--model", "175B", "--hardware", "a100", "--tp", "8", "--pp", "16", "--dp", "64",
                              "--num-samples", "256", "--fast-mode", "--json").stdout)
    assert a100["makespan_ms"] > summary["makespan_ms"]


def test_plan_takes_the_attention_core_as_search_does():
    """The same model flags as search: a fused core (Megatron-LM's default transformer-engine
    layers, --attention sdpa, or flash attention, which run one) prices attention's causal half
    without the score square, so long samples plan faster than with megatron-core's unfused core;
    at its own kernel's rate: on the H100 transformer-engine's (cuDNN's) runs about twice torch's."""
    def plan(*flags):
        out = run_cli("plan", "--model", "13B", "--hardware", "h100", "--pp", "4", "--num-samples", "16", "--mix",
                      "long", "--json", *flags)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    unfused, fused = plan("--transformer-impl", "local"), plan("--attention", "sdpa")
    assert "unfused attention core" in unfused["cost_model"] and "fused attention core" in fused["cost_model"]
    assert fused["makespan_ms"] < unfused["makespan_ms"]
    assert plan("--use-flash-attn")["makespan_ms"] == fused["makespan_ms"]
    assert plan("--attention", "local")["makespan_ms"] == unfused["makespan_ms"]
    te = plan("--transformer-impl", "transformer_engine")  # Megatron-LM's default, and the command's
    assert plan()["makespan_ms"] == te["makespan_ms"] < fused["makespan_ms"]


@pytest.mark.parametrize("args,message", [
    (["--model", "175B", "--cost-model", "gpt-6.7b-a100"], "--cost-model and --model/--hardware both say how to price"),
    (["--attention", "sdpa", "--cost-model", "gpt-6.7b-a100"], "--cost-model's profile prices the core it measured"),
    (["--attention", "local", "--use-flash-attn"], "--attention local is megatron-core's unfused core"),
    (["--model", "176B"], "unknown model '176B'"),
    (["--model", "175B", "--pp", "5"], "96 layers do not split evenly into --pp = 5 pipeline stages"),
])
def test_a_named_model_that_cannot_be_priced_is_refused_in_one_line(args, message):
    out = run_cli("plan", "--num-samples", "8", *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_megatron_flag_names_and_either_list_spelling_are_taken_everywhere():
    from megatron_dynapipe.cli import build_parser

    parser = build_parser()

    def parsed(*argv):
        return parser.parse_args(list(argv))

    plan = parsed("plan", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "8")
    assert (plan.tp, plan.pp) == (2, 8)
    spaced, commas = parsed("plan", "--recompute", "none", "full"), parsed("plan", "--recompute", "none,full")
    assert spaced.recompute == commas.recompute
    search = ["search", "--world-size", "64", "--global-batch-size", "64"]
    for tp in (["1", "2", "4"], ["1,2,4"], ["1,2", "4"]):
        args = parsed(*search, "--tensor-model-parallel-size", *tp, "--pipeline-model-parallel-size", "2,4",
                      "--context-parallel-size", "1", "--micro-batch-size", "1", "2")
        assert (args.tp, args.pp, args.cp, args.micro_batch_size) == ((1, 2, 4), (2, 4), (1,), (1, 2))
    profile = ("profile", "-o", "p.json")
    megatron_name = parsed(*profile, "--tensor-model-parallel-size", "1", "2", "4")
    assert parsed(*profile, "--tp", "1,2", "4").tp == megatron_name.tp == (1, 2, 4)
    assert parsed("plan", "--use-distributed-optimizer").zero_stage == 1 == parsed("plan", "--zero-stage", "1").zero_stage
    assert parsed(*search, "--use-distributed-optimizer").distributed_optimizer == (True,)
    for bench in ("planner", "executor"):
        assert parsed("bench", bench, "--pipeline-model-parallel-size", "3").pp == 3
    step = parsed("bench", "step", "--pipeline-model-parallel-size", "2", "--seq-length", "512")
    assert (step.pp, step.max_seq_length) == (2, 512)
    # one fast-mode flag everywhere it is a flag: true, false or auto; bare, true; absent, the environment's
    for command in (["plan"], search, ["simulate", "traces"], ["trace"]):
        assert [parsed(*command, *flag).fast_mode for flag in ([], ["--fast-mode"], ["--fast-mode", "false"],
                                                                ["--fast-mode", "auto"])] == [None, True, False, "auto"]


def _options(parser, name="megatron-dynapipe"):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                yield from _options(sub, f"{name} {command}")
        elif action.option_strings and action.help != argparse.SUPPRESS and not isinstance(
                action, (argparse._HelpAction, argparse._VersionAction)):
            yield name, action


def test_every_flag_says_what_it_does_and_its_default():
    import argparse

    from megatron_dynapipe.cli import build_parser

    missing, no_default = [], []
    for command, action in _options(build_parser()):
        flag = f"{command} {action.option_strings[0]}"
        if not action.help:
            missing.append(flag)
        elif (action.default not in (None, False, [], ()) and not isinstance(action, argparse._StoreFalseAction)
              and "default" not in action.help.lower()):  # a --no-X switch's default is plain
            no_default.append(f"{flag} (default {action.default!r})")
    assert not missing, f"flags without help: {missing}"
    assert not no_default, f"flags whose help does not state their default: {no_default}"


def test_every_parallel_size_flag_also_takes_megatrons_name():
    from megatron_dynapipe.cli import build_parser

    megatron = {"--tp": "--tensor-model-parallel-size", "--pp": "--pipeline-model-parallel-size",
                "--cp": "--context-parallel-size"}
    found = [(command, action.option_strings) for command, action in _options(build_parser())
             if action.option_strings[0] in megatron]
    assert len(found) >= 8  # plan, search, profile and the benches
    assert all(megatron[names[0]] in names for _, names in found), found


def test_plan_pads_rows_for_context_parallelism_without_being_told():
    """--seqlen-round's default (8) is made a multiple of 2 x CP, as every row splits into that many chunks."""
    out = run_cli("plan", "--num-samples", "16", "--pp", "4", "--cp", "8", "--json")
    assert out.returncode == 0, out.stderr
    lengths = {m["seq_len"] for rank in json.loads(out.stdout)["dp_ranks"] for m in rank["microbatches"]}
    assert lengths and all(n % 16 == 0 for n in lengths)
    refused = run_cli("plan", "--num-samples", "16", "--pp", "4", "--cp", "8", "--seqlen-round", "8")
    assert refused.returncode == 2 and "make seqlen_round a multiple of 16" in refused.stderr
