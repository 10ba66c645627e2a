"""`megatron-dynapipe bench step`: real megatron-core steps of one global batch, seven ways.

The expected token counts are worked out by hand from the lengths below: padded to 128 each, the
8 samples take 8 x 128 tokens; packed first-fit decreasing into 128-token sequences they fill 3
(100+20+8, 90+30, 60+50+10), with or without attention between their samples; dp_balanced's
next-fit in arrival order makes 4 packs (100, 60+50, 30+20+10, 90+8), a multiple of DP 1 or 2 (and
of an interleaved pipeline's group of 2) as they stand.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # real steps of megatron-core models, several methods each

LENGTHS = [100, 60, 50, 30, 20, 10, 90, 8]
SEQ = 128
VOCAB = 1024  # the tiny model's


def bench(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "bench", "step", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("lengths") / "lengths.txt"
    path.write_text("\n".join(map(str, LENGTHS)))
    return path


@pytest.mark.parametrize("pp, chunks, cut", [(1, 1, False), (2, 1, True), (2, 2, False)])
def test_seven_methods_run_real_steps_and_agree_on_the_loss(tiny_sdpa_profile, lengths_file, pp, chunks, cut):
    """Every method on the same samples; with two model chunks a rank (PP 2 x 2 chunks, the tiny
    GPT's 4 layers one a chunk) the baselines run Megatron's interleaved 1F1B and DynaPipe its
    planned interleaved pipeline, and all agree on the loss. With --cut-documents, two more on the
    documents cut (:func:`check_the_cut_methods`)."""
    profile, _ = tiny_sdpa_profile
    run = bench("--model", "tiny", "--cost-model", str(profile), "--lengths", str(lengths_file),
                "--max-seq-length", str(SEQ), "--pp", str(pp), "--chunks", str(chunks), "--steps", "3", "--warmup", "0",
                "--json", *(["--cut-documents"] if cut else []))
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(run.stdout)
    if cut:
        check_the_cut_methods(row)
    methods = {name: m for name, m in row["methods"].items() if name not in CUT_METHODS}
    assert set(methods) == {"DynaPipe", "DynaPipe (fast)", "DynaPipe varlen", "pad-to-max", "packing",
                            "THD packing (whole)", "dp_balanced packing"}
    assert row["settings"]["real_tokens"] == sum(LENGTHS) and row["settings"]["pp"] == pp
    assert row["settings"]["chunks"] == chunks
    if chunks > 1:
        assert {m["schedule"] for m in methods.values()} == {"interleaved-1f1b"}
    assert row["settings"]["attention"] == "sdpa"
    assert methods["pad-to-max"]["padded_tokens"] == len(LENGTHS) * SEQ
    assert methods["packing"]["padded_tokens"] == methods["THD packing (whole)"]["padded_tokens"] == 3 * SEQ
    # each pack a row of its samples rounded up to whole 8s: 104 + 112 + 64 + 104
    assert methods["dp_balanced packing"]["padded_tokens"] == 384 and methods["dp_balanced packing"][
        "microbatches"] == 4
    for m in methods.values():
        assert m["median_ms"] > 0 and m["predicted_ms"] > 0 and m["activations_mb"] > 0 and m["peak_mb"] is None
        assert sum(LENGTHS) <= m["padded_tokens"]
        # an untrained GPT guesses about uniformly: its per-token loss is near ln(vocabulary)
        assert m["loss"] == pytest.approx(math.log(VOCAB), abs=0.2)
    # padding at the right changes nothing a causal model computes for the real tokens, and a
    # packed sample that attends to itself alone computes what it does padded
    assert set(row["loss_gaps"]) == {"DynaPipe", "DynaPipe (fast)", "DynaPipe varlen", "THD packing (whole)",
                                     "dp_balanced packing", *(["DynaPipe varlen (cut)"] if cut else [])}
    assert row["losses_agree"] and max(row["loss_gaps"].values()) < 1e-4
    assert methods["DynaPipe varlen"]["planning_s"] is not None and methods["THD packing (whole)"]["planning_s"] is None


CUT_METHODS = ("THD packing", "DynaPipe varlen (cut)")


def check_the_cut_methods(row):
    """--cut-documents: the samples back to back, a new 128-token window where the last ends: 100 +
    28 of the 60; its other 32 + 50 + 30 + 16 of the 20; its other 4 + 10 + 90 + 8 (112 tokens).
    THD packing runs those 3 windows, DynaPipe varlen plans the 10 pieces; both train the same
    tokens, each piece predicting all but its last, so their losses agree with each other."""
    windows, cut = (row["methods"][name] for name in CUT_METHODS)
    assert windows["padded_tokens"] == 3 * SEQ and windows["loss_tokens"] == cut["loss_tokens"] == sum(LENGTHS) - 10
    assert row["methods"]["THD packing (whole)"]["loss_tokens"] == sum(LENGTHS) - len(LENGTHS)
    assert row["loss_gaps"]["DynaPipe varlen (cut)"] < 1e-4  # against THD packing's windows
    assert cut["predicted_ms"] <= windows["predicted_ms"] * (1 + 1e-9)  # THD's windows are among its candidates
    assert "DynaPipe varlen (cut) over THD packing" in row["speedups"]


def test_uneven_stages_run_as_megatron_builds_them_and_agree_on_the_loss(tiny_sdpa_profile, lengths_file, tmp_path):
    """Six layers, the first stage two of them, two chunks a rank: chunks of 1 and 1 layer on the
    first stage and 2 and 2 on the last, built by megatron-core from Megatron-LM's flag and priced
    so by the planner (and the timeline's prices); every method without leakage keeps pad-to-max's
    loss."""
    profile, _ = tiny_sdpa_profile
    run = bench("--model", "tiny", "--num-layers", "6", "--cost-model", str(profile), "--lengths", str(lengths_file),
                "--max-seq-length", str(SEQ), "--pp", "2", "--chunks", "2", "--decoder-first-pipeline-num-layers", "2",
                "--steps", "3", "--warmup", "0", "--chrome-trace", str(tmp_path / "step.json"), "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(run.stdout)
    assert row["settings"]["first_stage_layers"] == 2 and row["settings"]["chunks"] == 2 and row["losses_agree"]
    # each rank timed the profile's layer on each point after each of the 3 timed rounds, in its own parallel state
    pace = row["pace"]
    assert pace["rows"][0] == 1 and len(pace["ratios"]) == 3 * 2 * len(pace["rows"]) and min(pace["ratios"]) > 0
    assert_pad_to_max_compute_priced(row["methods"]["pad-to-max"], profile, (1, 2, 1, 2))


def test_with_megatrons_unfused_attention_the_packed_methods_are_left_out(tiny_profile, lengths_file):
    profile, _ = tiny_profile
    run = bench("--model", "tiny", "--attention", "local", "--cost-model", str(profile), "--lengths",
                str(lengths_file), "--max-seq-length", str(SEQ), "--steps", "3", "--warmup", "0", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(run.stdout)
    assert set(row["methods"]) == {"DynaPipe", "DynaPipe (fast)", "pad-to-max", "packing"}
    assert row["settings"]["attention"] == "local" and row["losses_agree"]


def test_a_method_that_fails_is_reported_on_its_row_and_the_others_results_stand(tiny_sdpa_profile, lengths_file):
    """Packing's first micro-batch given a token the embedding has no row for: stage 0 raises in that
    method's step (as an out-of-memory would) while stage 1 waits on it; the other methods run again
    without it and report as usual."""
    import argparse

    from megatron_dynapipe.bench import step_bench, step_methods

    parser = argparse.ArgumentParser()
    step_bench.add_arguments(parser)
    args = parser.parse_args(["--cost-model", str(tiny_sdpa_profile[0]), "--lengths", str(lengths_file),
                              "--max-seq-length", str(SEQ), "--pp", "2", "--steps", "3", "--warmup", "0"])
    job = step_bench._checked(args)
    lengths = step_bench._lengths(args, job.max_seq_length)
    methods = step_methods.build_methods(lengths, job, args)
    methods[step_bench.PACK].microbatches[0][0]["tokens"][0, 0] = VOCAB + 5
    per_rank, failed = step_bench.run_methods(methods, job, warmup=0, steps=3, timeout=600)
    assert list(failed) == [step_bench.PACK] and failed[step_bench.PACK].startswith("IndexError: index out of range")
    ran = {name: m for name, m in methods.items() if name not in failed}
    row = step_bench.summarize(per_rank, ran, lengths, job, failed)
    assert set(row["methods"]) == set(ran) and row["losses_agree"]
    table = step_bench.format_table(row)
    assert "| packing | failed: IndexError: index out of range" in table and "samples attend to their neighbours" not in table


@pytest.mark.parametrize("flag", ["--dp", "--cp"])
def test_ranks_sharing_the_global_batch_keep_its_loss(tiny_sdpa_profile, lengths_file, flag):
    """Two data-parallel ranks each run their share of the same 8 samples, or two context-parallel
    ranks two chunks of every row (the ring over gloo): every method's loss over the global batch
    is the one a single rank computes on all of them, each token's counted once."""
    profile, _ = tiny_sdpa_profile
    rows = {}
    for size in (1, 2):
        run = bench("--model", "tiny", "--cost-model", str(profile), "--lengths", str(lengths_file),
                    "--max-seq-length", str(SEQ), flag, str(size), "--steps", "3", "--warmup", "0", "--json")
        assert run.returncode == 0, run.stderr[-3000:]
        rows[size] = json.loads(run.stdout)
    assert rows[2]["settings"][flag[2:]] == 2 and rows[2]["losses_agree"]
    for name, one_rank in rows[1]["methods"].items():
        assert rows[2]["methods"][name]["loss"] == pytest.approx(one_rank["loss"], rel=1e-5), name
        # by one rank, not by both; each sample's last token predicts nothing
        assert rows[2]["methods"][name]["loss_tokens"] == sum(LENGTHS) - len(LENGTHS), name
    assert rows[2]["methods"]["pad-to-max"]["padded_tokens"] == len(LENGTHS) * SEQ  # the same 8 rows, split
    # under CP 2 packed samples take whole chunks (multiples of 4): 100+20+8, 92+32, 60+52+12 still fill 3 rows
    packed = {rows[2]["methods"][name]["padded_tokens"] for name in ("packing", "THD packing (whole)")}
    assert packed == {3 * SEQ}
    if flag == "--cp":  # a profile without `--cp 2` prices the ring from the layer alone, and says so
        from megatron_dynapipe.bench.step_bench import format_table
        assert rows[2]["cp_group_timed"] is False and rows[1]["cp_group_timed"] is None
        assert "note: the profile timed no CP 2 group" in format_table(rows[2])
        assert "timed no CP" not in format_table(rows[1])


def test_the_table_reports_speed_ups_and_prediction_error(tiny_sdpa_profile, lengths_file):
    profile, _ = tiny_sdpa_profile
    run = bench("--model", "tiny", "--cost-model", str(profile), "--lengths", str(lengths_file),
                "--max-seq-length", str(SEQ), "--steps", "3", "--warmup", "0")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| method | micro-batches | padded tokens | median ms | real tokens/s | predicted ms | error |" in run.stdout
    assert "DynaPipe varlen over THD packing (whole) " in run.stdout and "DynaPipe over pad-to-max " in run.stdout
    assert "DynaPipe varlen over dp_balanced packing " in run.stdout
    assert "losses:" in run.stdout and " agree with it" in run.stdout
    # the profile's layer on rows of its longest length the steps reach, timed beside them
    assert "pace: the profile's layer on 1 " in run.stdout and f" x {SEQ} tokens took " in run.stdout


def test_the_chrome_trace_shows_every_ranks_instructions_on_one_clock(tiny_sdpa_profile, lengths_file, tmp_path):
    """PP 2 x 2 chunks, one more step of each method timed instruction by instruction: every
    micro-batch runs forward and backward once on every chunk of every stage, and the two ranks'
    times line up: stage 1's forward of a chunk can only start once stage 0's of the same chunk
    has ended (it needs that activation), and stage 0's backward once stage 1's has ended."""
    profile, _ = tiny_sdpa_profile
    out = tmp_path / "step.json"
    run = bench("--model", "tiny", "--cost-model", str(profile), "--lengths", str(lengths_file),
                "--max-seq-length", str(SEQ), "--pp", "2", "--chunks", "2", "--steps", "3", "--warmup", "0",
                "--chrome-trace", str(out), "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(run.stdout)
    assert row["chrome_trace"] == str(out)
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    assert sorted(names.values()) == sorted(f"{m}: stage {s}" for m in row["methods"] for s in (0, 1))
    for method, m in row["methods"].items():
        pids = {s: next(pid for pid, name in names.items() if name == f"{method}: stage {s}") for s in (0, 1)}
        ran = {}  # (stage, op, chunk, micro-batch) -> (start, end) in us
        for e in spans:
            stage = next((s for s, pid in pids.items() if pid == e["pid"]), None)
            if stage is not None and e["cat"] in ("FORWARD", "BACKWARD"):
                key = (stage, e["cat"], e["args"]["chunk"], e["args"]["microbatch"])
                assert key not in ran, (method, key)
                ran[key] = (e["ts"], e["ts"] + e["dur"])
        count = m["microbatches"]
        assert sorted(ran) == sorted((s, op, c, mb) for s in (0, 1) for op in ("FORWARD", "BACKWARD")
                                     for c in (0, 1) for mb in range(count)), method
        for c in (0, 1):
            for mb in range(count):
                assert ran[1, "FORWARD", c, mb][0] >= ran[0, "FORWARD", c, mb][1], (method, c, mb)
                assert ran[0, "BACKWARD", c, mb][0] >= ran[1, "BACKWARD", c, mb][1], (method, c, mb)
        for r in m["timeline"]:
            assert r["compute_ms"] > 0 and r["waiting_ms"] >= 0 and r["other_ms"] >= 0
            assert r["compute_ms"] + r["waiting_ms"] <= r["step_ms"]
    assert_pad_to_max_compute_priced(row["methods"]["pad-to-max"], profile, (1, 1, 1, 1))
    # each of pad-to-max's ops carries its price: its one shape's forward or backward on its virtual stage
    from megatron_dynapipe.planning.cost_model import StageCosts, load_cost_model

    pad = row["methods"]["pad-to-max"]
    rows, (rc,) = pad["padded_tokens"] // (SEQ * pad["microbatches"]), pad["recompute"]
    costs = StageCosts(load_cost_model(profile, tp=1), num_layers=4, pp=4)
    for s in (0, 1):
        pid = next(pid for pid, name in names.items() if name == f"pad-to-max: stage {s}")
        for e in (e for e in spans if e["pid"] == pid and e["cat"] in ("FORWARD", "BACKWARD")):
            priced = (costs.forward_ms if e["cat"] == "FORWARD" else costs.backward_ms)(
                e["args"]["chunk"] * 2 + s, rows, SEQ, rc)
            assert e["args"]["priced_ms"] == pytest.approx(float(priced), abs=1e-3), (s, e["name"])


def assert_pad_to_max_compute_priced(pad: dict, profile, chunk_layers: tuple[int, ...]):
    """pad-to-max's micro-batches are all one shape: each of the two stages' compute is priced at
    that shape's forward and backward on each of its two virtual stages (chunk c of stage s is
    c * 2 + s, holding ``chunk_layers[c * 2 + s]`` layers), once a micro-batch."""
    from megatron_dynapipe.planning.cost_model import StageCosts, load_cost_model

    rows = pad["padded_tokens"] // (SEQ * pad["microbatches"])
    costs = StageCosts(load_cost_model(profile, tp=1), num_layers=sum(chunk_layers), pp=4, layers=chunk_layers)
    (rc,) = pad["recompute"]  # the one the baseline found fastest on this machine's profile
    for s, r in enumerate(pad["timeline"]):
        priced = sum(float(costs.forward_ms(c * 2 + s, rows, SEQ, rc) + costs.backward_ms(c * 2 + s, rows, SEQ, rc))
                     for c in (0, 1))
        assert r["priced_compute_ms"] == pytest.approx(pad["microbatches"] * priced, rel=1e-9), s


def test_a_ranks_step_splits_into_compute_waiting_and_the_rest():
    from megatron_dynapipe.bench.step_timeline import breakdown
    from megatron_dynapipe.planning.plan import Instruction, Op
    from megatron_dynapipe.runtime.executor import TimedInstruction

    ran = [(Op.RECV_ACT_START, 1.000, 1.001), (Op.RECV_ACT_FINISH, 1.001, 1.011), (Op.FORWARD, 1.012, 1.032),
           (Op.SEND_GRAD_START, 1.032, 1.033), (Op.BACKWARD, 1.040, 1.080), (Op.SEND_GRAD_FINISH, 1.080, 1.085)]
    got = breakdown([TimedInstruction(Instruction(op, 0), start, end) for op, start, end in ran])
    assert got["step_ms"] == pytest.approx(85) and got["compute_ms"] == pytest.approx(60)
    assert got["waiting_ms"] == pytest.approx(15) and got["other_ms"] == pytest.approx(10)
    assert breakdown([]) == {"step_ms": 0.0, "compute_ms": 0.0, "waiting_ms": 0.0, "other_ms": 0.0}


def test_ranks_that_outnumber_the_cores_are_noted_beside_the_predictions():
    from megatron_dynapipe.bench.step_bench import _sharing_lines

    predicted, unpredicted = {"DynaPipe": {"predicted_ms": 100.0}}, {"DynaPipe": {"predicted_ms": None}}
    four = {"pp": 2, "dp": 1, "cp": 2}
    (line,) = _sharing_lines(four, 2, predicted)
    assert line.startswith("note: 4 ranks shared 2 cores") and "up to 2.0x them here" in line
    assert _sharing_lines(four, 4, predicted) == [] and _sharing_lines(four, None, predicted) == []
    assert _sharing_lines(four, 2, unpredicted) == []  # no prediction to qualify


def test_packed_rows_keep_each_samples_own_labels():
    from megatron_dynapipe.bench.step_methods import _packed

    a, b = np.array([5, 6, 7]), np.array([8, 9])
    out = _packed([[a, b]], 8)
    assert out["tokens"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert out["labels"][0, :5].tolist() == [6, 7, 0, 9, 0]  # never the next sample's first token
    assert out["loss_mask"].tolist() == [[1, 1, 0, 1, 0, 0, 0, 0]]
    assert out["position_ids"].tolist() == [list(range(8))]  # Megatron's default: through the row


@pytest.mark.parametrize("args, message", [
    (["--bf16"], "--bf16 on the CPU"),
    (["--max-seq-length", "100"], "--max-seq-length 100: pick a multiple of 8"),
    (["--pp", "3"], "4 layers do not split evenly into --pp = 3"),
    (["--pp", "2", "--chunks", "3"], "4 layers do not split evenly into --pp x --chunks = 6"),
    (["--chunks", "2"], "--chunks 2 with --pp 1: model chunks interleave a pipeline of at least 2 stages"),
    (["--pp", "2", "--chunks", "2", "--decoder-first-pipeline-num-layers", "1"],
     "the 1 layers of pipeline stage 0 do not split into 2 model chunks"),
    (["--pp", "2", "--decoder-first-pipeline-num-layers", "5"],
     "the first/last stages' 5 layers leave -1 of 4 for 1 middle stage(s)"),
    (["--steps", "2"], "--steps 2: a median needs at least 3"),
    (["--warmup", "-1"], "--warmup -1: give how many untimed steps to run first, 0 or more"),
    (["--timeout", "-1"], "--timeout -1: give the seconds to wait for the ranks, a positive number"),
    (["--samples", "1", "--dp", "2"], "--samples 1 cannot feed --dp 2 ranks"),
    (["--cp", "3"], "--cp 3: context parallelism splits each row into 2 x CP chunks of lengths padded to "
                    "multiples of 8, so give 1, 2 or 4"),
    (["--cp", "0"], "--cp 0: context parallelism splits"),
    (["--lengths", "LENGTHS", "--max-seq-length", "128", "--dp", "4"], "3 sequences of 128 tokens cannot feed --dp 4"),
    (["--hidden-size", "64", "--num-attention-heads", "4", "--cost-model", "PROFILE"],
     "was profiled with another model or dtype: hidden_size 128 (job: 64)"),
    (["--lengths", "LENGTHS", "--max-seq-length", "64"], "has a sample of 100 tokens, over --max-seq-length 64"),
    (["--hidden-dropout", "0.1"], "bench step runs without dropout"),
    (["--chrome-trace", "trace.txt"], "--chrome-trace trace.txt has no known suffix: end the name with one of .json"),
    (["--cost-model", "PROFILE"], "was profiled with another model or dtype: attention local (job: sdpa); profile "
     "this job's model (megatron-dynapipe profile with --attention sdpa and this job's other model flags)"),
    (["--cost-model", "PROFILE", "--transformer-impl", "transformer_engine"], "attention local (job: "
     "transformer_engine); profile this job's model (megatron-dynapipe profile with --transformer-impl "
     "transformer_engine and this job's other model flags)"),
    (["--cost-model", "DROPOUT_PROFILE"], "hidden_dropout 0.1 (job: 0.0); attention_dropout 0.1 (job: 0.0); "
     "attention local (job: sdpa); profile this job's model (megatron-dynapipe profile with --hidden-dropout 0 "
     "--attention-dropout 0 --attention sdpa and this job's other model flags)"),
])
def test_bad_input_is_one_line_before_any_work(tiny_profile, lengths_file, tmp_path, args, message):
    with_dropout = tmp_path / "dropout.json"  # the fixture's profile, as if made with Megatron's default dropout
    doc = json.loads(tiny_profile[0].read_text())
    doc["metadata"]["model"].update(hidden_dropout=0.1, attention_dropout=0.1)
    with_dropout.write_text(json.dumps(doc))
    given = {"PROFILE": tiny_profile[0], "LENGTHS": lengths_file, "DROPOUT_PROFILE": with_dropout}
    args = [str(given.get(a, a)) for a in args]
    run = bench("--model", "tiny", *args, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert message in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_without_a_cost_model_of_this_device_nothing_is_called_a_prediction(lengths_file):
    """The default analytical model prices an A100: on this CPU its times are no prediction
    (they read -100%), so the table leaves them out and says how to get one."""
    args = ("--model", "tiny", "--lengths", str(lengths_file), "--max-seq-length", str(SEQ), "--steps", "3",
            "--warmup", "0")
    row = json.loads(bench(*args, "--json").stdout)
    assert all(m["predicted_ms"] is None and m["prediction_error_pct"] is None for m in row["methods"].values())
    table = bench(*args)
    assert table.returncode == 0, table.stderr[-3000:]
    assert "no predictions: the default analytical model prices an A100, not this device" in table.stdout
    assert "%" not in "".join(line for line in table.stdout.splitlines() if line.startswith("| DynaPipe |"))


def test_help_names_every_method_it_runs():
    out = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "bench", "step", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for method in ("DynaPipe (fast)", "DynaPipe varlen", "pad-to-max", "packing", "THD packing (whole)", "dp_balanced",
                   "--dataloader-inter-document-masking"):
        assert method in out.stdout, method
