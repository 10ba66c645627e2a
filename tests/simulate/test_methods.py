"""A search on the user's data: batches drawn to an exact token budget, Megatron's windows, and
each method's step put together from the planner and the trace -- checked against identities
that hold whatever the cost model says, and end to end on fake-rank traces of the tiny GPT."""

import json

import numpy as np
import pytest

from megatron_dynapipe.cli import main
from megatron_dynapipe.planning.baselines import megatron_windows
from megatron_dynapipe.planning.samples import LengthSource
from megatron_dynapipe.simulate.methods import METHODS, parse_methods

# -- drawing batches --------------------------------------------------------------------------


@pytest.mark.parametrize("source", [LengthSource.from_mix("multitask"), LengthSource("pool", pool=[5, 900, 37])])
def test_each_drawn_batch_holds_exactly_the_token_budget_of_samples_no_longer_than_the_cap(source):
    batches = source.batches(tokens=10_000, cap=512, count=5, seed=3)
    assert len(batches) == 5
    for batch in batches:
        assert sum(batch) == 10_000 and min(batch) >= 1 and max(batch) <= 512
    assert batches == source.batches(tokens=10_000, cap=512, count=5, seed=3)  # the seed alone decides
    assert batches[0] != batches[1] and batches != source.batches(tokens=10_000, cap=512, count=5, seed=4)


def test_a_pool_is_drawn_from_its_own_lengths_clipped_to_the_cap():
    batch = LengthSource("pool", pool=[5, 900, 37]).batches(tokens=100_000, cap=512, count=1)[0]
    assert set(batch[:-1]) == {5, 512, 37}  # the last sample is cut to the budget
    shares = np.bincount([{5: 0, 512: 1, 37: 2}[n] for n in batch[:-1]]) / (len(batch) - 1)
    assert shares == pytest.approx([1 / 3] * 3, abs=0.05)  # with replacement, each as likely


def test_a_lengths_file_and_a_mix_are_checked_before_anything_runs(tmp_path):
    bad = tmp_path / "lengths.txt"
    bad.write_text("12\n0\n")
    with pytest.raises(ValueError, match="integer lengths"):
        LengthSource.from_file(bad)
    with pytest.raises(ValueError, match="unknown length mix 'zipf'"):
        LengthSource.from_mix("zipf")


def test_samples_are_cut_into_windows_back_to_back_as_megatrons_gpt_data_path_cuts_documents():
    pieces, rows = megatron_windows([300, 50, 700, 10], 256)
    assert [sum(pieces[i] for i in row) for row in rows] == [256, 256, 256, 256, 36]
    assert pieces == [256, 44, 50, 162, 256, 256, 26, 10]  # a document continues where the last window ended
    assert [i for row in rows for i in row] == list(range(len(pieces)))
    # under CP 2 each piece is then padded to a multiple of 4 tokens: a window's row may grow past 256
    pieces, rows = megatron_windows([300, 50, 700, 10], 256, multiple=4)
    assert pieces == [256, 44, 52, 164, 256, 256, 28, 12]
    assert [sum(pieces[i] for i in row) for row in rows] == [256, 260, 256, 256, 40]
    assert megatron_windows([255, 1], 256, multiple=4) == ([256, 4], [[0, 1]])
    with pytest.raises(ValueError, match="--seq-length 250 is not a multiple of 4"):
        megatron_windows([300], 250, multiple=4)


# -- choosing what to trace and price ----------------------------------------------------------


def test_methods_are_named_or_all():
    assert parse_methods(["all"]) == tuple(METHODS)
    assert parse_methods(["thd", "dynapipe", "thd"]) == ("thd", "dynapipe")
    with pytest.raises(ValueError, match="--method padded: choose from megatron, thd"):
        parse_methods(["padded"])


# -- end to end on the tiny GPT ------------------------------------------------------------------


def _search(tmp_path, capsys, *extra):
    argv = ["search", "--model", "tiny", "--output-dir", str(tmp_path / "out"), "--no-progress", "--json", *extra]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_where_every_sample_fills_a_window_alone_every_method_takes_the_traced_step(tmp_path, capsys):
    # One sample of the full 256 tokens per data-parallel rank: Megatron's window, THD's row of one
    # window, and the planner's one micro-batch are the same micro-batch, priced the same (a packed
    # row of one sample costs what that sample padded costs), so whatever the cost model says,
    # each method's step is the traced one -- if the planner's pipeline and what the trace holds
    # besides it are put together right.
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("256\n" * 10)
    document = _search(tmp_path, capsys, "--world-size", "4", "--global-batch-size", "2", "--tp", "1", "--pp", "2",
                       "--micro-batch-size", "1", "--recompute", "none", "--no-distributed-optimizer",
                       "--num-virtual-stages-per-pipeline-rank", "1", "--max-traced", "1", "--lengths", str(lengths),
                       "--batches", "2")
    data = document["on_data"]
    assert data["tokens_per_batch"] == 2 * 256 and data["samples_per_batch"] == [2, 2]
    traced = document["best"]["iteration_s"]
    for method in METHODS:
        best = data["best"][method]
        assert best["step_s"] == pytest.approx([traced, traced], rel=1e-9), method
        assert best["real_tokens_per_s"] == pytest.approx(512 / traced, rel=1e-9)
        assert (best["tp"], best["pp"], best["dp"]) == (1, 2, 2)


def test_a_search_on_a_mix_prices_every_method_at_layouts_a_planner_runs(tmp_path, capsys):
    document = _search(tmp_path, capsys, "--world-size", "8", "--global-batch-size", "16", "--max-traced", "4",
                       "--recompute", "none", "--mix", "multitask", "--batches", "3", "--method-layouts", "2")
    data = document["on_data"]
    assert data["methods"] == list(METHODS) and len(data["samples_per_batch"]) == 3
    assert data["tokens_per_batch"] == 16 * 256
    priced = [s for s in data["steps"] if s["method"] != "megatron"]
    layouts = {(s["tp"], s["pp"], s["virtual_stages"], s["cp"], s["dp"], s["distributed_optimizer"]) for s in priced}
    assert len(layouts) == 2
    # Megatron's fixed shapes at their best are the search's best, interleaved or not
    assert data["best"]["megatron"]["mean_step_s"] == pytest.approx(document["best"]["iteration_s"])
    for step in data["steps"]:
        if step["method"] == "dp_balanced" and step["error"]:  # ~1.4 samples a row: Megatron-LM refuses too
            assert "cannot make a multiple of" in step["error"], step["error"]
            continue
        assert step["error"] is None and len(step["step_s"]) == 3
        assert step["mean_step_s"] == pytest.approx(np.mean(step["step_s"]))
        assert step["real_tokens_per_s"] == pytest.approx(16 * 256 / step["mean_step_s"])
    for method, best in data["best"].items():  # each method's best is its fastest layout
        if best is not None:
            assert best["mean_step_s"] == min(s["mean_step_s"] for s in data["steps"]
                                              if s["method"] == method and s["error"] is None)
    ideal = {}  # every method's step taken apart: parts that add up, one ideal a layout, never beaten
    for step in (s for s in data["steps"] if s["error"] is None):
        why, layout = step["why"], (step["tp"], step["pp"], step["virtual_stages"], step["cp"], step["dp"])
        assert why["pipeline_ms"] + why["rest_ms"] == pytest.approx(1e3 * step["mean_step_s"])
        assert why["busy_ms"] + why["bubble_ms"] == pytest.approx(why["pipeline_ms"])
        assert 0 <= why["padding_ms"] + why["recompute_ms"] <= why["busy_ms"]
        assert 0 < why["of_ideal"] <= 1
        assert why["ideal_ms"] == pytest.approx(ideal.setdefault(layout, why["ideal_ms"]))
        if step["method"] == "megatron":  # windows back to back: every token real, every rank alike
            assert why["padding_share"] == 0 and why["above_mean"] == 0
    simulated = {c["iteration_s"] for c in document["candidates"] if c["status"] == "simulated"}
    for step in data["steps"]:  # Megatron's step at a layout is its traced, simulated one, every batch
        if step["method"] == "megatron":
            assert min(abs(step["step_s"][0] - t) for t in simulated) <= 1e-9 * step["step_s"][0]
            assert max(step["step_s"]) - min(step["step_s"]) <= 1e-9 * step["step_s"][0]
    assert (tmp_path / "out" / "methods.png").stat().st_size > 0 and data["plot"].endswith("methods.png")


def test_methods_without_data_are_refused_before_the_search(tmp_path, capsys):
    argv = ["search", "--model", "tiny", "--world-size", "4", "--global-batch-size", "4", "--method", "thd",
            "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    assert "--method prices methods on your data: give --lengths FILE, --mix NAME or --data-path" in capsys.readouterr().err
    assert not (tmp_path / "traces").exists()


# -- Megatron datasets as the data ---------------------------------------------------------------


def _indexed(prefix, documents):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    for length in documents:
        builder.add_item(torch.arange(length, dtype=torch.int64))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def test_a_blend_of_megatron_datasets_is_drawn_by_its_weights_with_long_documents_split(tmp_path):
    from megatron_dynapipe.data.blend import blend_lengths

    short = _indexed(tmp_path / "short_text_document", [100] * 5)
    long = _indexed(tmp_path / "long_text_document", [300, 40])
    pools, weights = blend_lengths(["0.25", short, "0.75", long], 256)
    # 300 tokens in windows of 256 overlapping by one: 256 and 45 (every token after the first a target once)
    assert [sorted(p.tolist()) for p in pools] == [[100] * 5, [40, 45, 256]] and weights == [0.25, 0.75]
    batch = LengthSource("blend", pools=pools, weights=weights).batches(tokens=400_000, cap=256, count=1)[0]
    assert set(batch[:-1]) == {100, 256, 45, 40}
    assert batch[:-1].count(100) / (len(batch) - 1) == pytest.approx(0.25, abs=0.02)
    assert blend_lengths([short, long], 256)[1] == [5.0, 3.0]  # unweighted: each dataset by its size, as Megatron


def test_a_search_draws_from_megatrons_data_path_and_refuses_a_missing_one_before_tracing(tmp_path, capsys):
    prefix = _indexed(tmp_path / "corpus_text_document", [180, 256, 20, 64])
    document = _search(tmp_path, capsys, "--world-size", "2", "--global-batch-size", "2", "--tp", "1", "--pp", "2",
                       "--micro-batch-size", "1", "--recompute", "none", "--no-distributed-optimizer",
                       "--num-virtual-stages-per-pipeline-rank", "1", "--max-traced", "1", "--data-path", prefix,
                       "--method", "dynapipe", "--batches", "2")
    data = document["on_data"]
    assert data["source"] == prefix and data["methods"] == ["dynapipe"] and data["tokens_per_batch"] == 512
    assert data["best"]["dynapipe"]["error"] is None
    argv = ["search", "--model", "tiny", "--world-size", "2", "--global-batch-size", "2", "--output-dir",
            str(tmp_path / "missing"), "--data-path", str(tmp_path / "nothing_text_document")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing_text_document" in err[0] and not (tmp_path / "missing" / "traces").exists()


def test_a_blend_with_a_dataset_missing_is_refused_before_megatron_core_is_imported(tmp_path):
    """megatron-core reads the blend (seconds to import, and its warnings on a machine without
    transformer-engine); a path missing is refused before it, naming the file."""
    import subprocess
    import sys

    prefix = _indexed(tmp_path / "corpus_text_document", [180, 256])
    code = ("import sys\nfrom megatron_dynapipe.data.blend import blend_lengths\n"
            f"try:\n    blend_lengths(['0.5', {prefix!r}, '0.5', {str(tmp_path / 'gone')!r}], 256)\n"
            "except FileNotFoundError as error:\n    print(error)\n"
            "print('megatron.core imported:', 'megatron.core' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.splitlines() == [f"no Megatron indexed dataset at {str(tmp_path / 'gone')!r}: "
                                       f"{tmp_path / 'gone'}.bin is missing (give the path prefix, without .bin/.idx)",
                                       "megatron.core imported: False"], run.stderr[-2000:]


def test_simulate_prices_the_methods_on_a_traced_layout_as_the_search_did(tmp_path, capsys):
    # the search's on-data prices at its traced layout, and `simulate` of that layout's folder on
    # the same draws: the same layout read back from the trace, so the same steps
    common = ["--mix", "multitask", "--batches", "2", "--seed", "3"]
    document = _search(tmp_path, capsys, "--world-size", "4", "--global-batch-size", "8", "--tp", "1", "--pp", "2",
                       "--micro-batch-size", "1", "--recompute", "none", "--no-distributed-optimizer",
                       "--num-virtual-stages-per-pipeline-rank", "1", "--max-traced", "1", *common)
    (folder,) = [p.parent for p in (tmp_path / "out" / "traces").rglob("rank_0.trace.jsonl")]
    assert main(["simulate", str(folder), "--json", "--no-timeline", *common]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["iteration_s"] == pytest.approx(document["best"]["iteration_s"])
    for method in METHODS:
        ours, searched = simulated["on_data"]["best"][method], document["on_data"]["best"][method]
        assert (ours["tp"], ours["pp"], ours["dp"]) == (1, 2, 2)
        assert ours["step_s"] == pytest.approx(searched["step_s"], rel=1e-9), method
        assert ours["setting"] == searched["setting"]


def test_simulate_refuses_methods_it_cannot_price_before_simulating(tmp_path, capsys, tiny_traces):
    from megatron_dynapipe.tracer.batch_config import parse_configs
    from megatron_dynapipe.tracer.batch_run import run_batch

    (with_cp,) = run_batch(parse_configs(["8 2 1 cp=2 nmb=2"], model="tiny"), tmp_path, shapes_only=True,
                           progress=False, timeline=False)
    cases = [([str(tiny_traces["4 4 1"]), "--mix", "multitask", "--cost-model", "gpt-6.7b-a100"],
              "priced by a hardware file"),
             ([str(tiny_traces["4 4 1"]), "--cost-model", "gpt-6.7b-a100"], "give --lengths FILE, --mix NAME")]
    for argv, says in cases:
        assert main(["simulate", *argv, "--no-timeline"]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    # every method is priced at a context-parallel layout too
    assert main(["simulate", str(with_cp.folder), "--mix", "multitask", "--method", "all", "--batches", "1",
                 "--no-timeline", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["on_data"]["best"]
    assert all(best[method]["cp"] == 2 and best[method]["error"] is None for method in METHODS), best
    assert "CP 2" in best["megatron"]["setting"]


@pytest.mark.parametrize("chunks, cp", [(2, 1), (1, 2)], ids=["interleaved", "context-parallel"])
def test_at_an_interleaved_or_cp_layout_thd_rows_of_one_whole_window_take_megatrons_traced_step(
        tmp_path, capsys, monkeypatch, chunks, cp):
    """Two model chunks a rank (or two context-parallel ranks a sample), every sample a whole
    window: THD packing held to rows of one window runs Megatron's own micro-batches on its
    schedule, so its step is the traced one -- if the layout's costs, its fixed-shape schedule and
    THD's are all interleaved (or split) alike. DynaPipe plans the same layout and is not slower
    than THD's run it could choose."""
    from megatron_dynapipe.planning import baselines

    monkeypatch.setattr(baselines, "PACKING_MICROBATCH_SIZES", (1,))  # the pricing workers are forked
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("256\n" * 10)
    document = _search(tmp_path, capsys, "--world-size", "4", "--global-batch-size", "4", "--tp", "1", "--pp", "2",
                       "--micro-batch-size", "1", "--recompute", "none", "--no-distributed-optimizer",
                       "--num-virtual-stages-per-pipeline-rank", str(chunks), "--cp", str(cp), "--max-traced", "1", "--lengths", str(lengths), "--batches", "2", "--method", "all")
    data, traced = document["on_data"], document["best"]["iteration_s"]
    shape = {"virtual_stages": chunks, "cp": cp}
    assert {key: document["best"][key] for key in shape} == shape
    for method in METHODS:
        assert {key: data["best"][method][key] for key in shape} == shape and data["best"][method]["error"] is None
    assert data["best"]["megatron"]["step_s"] == pytest.approx([traced, traced], rel=1e-9)
    assert data["best"]["thd"]["step_s"] == pytest.approx([traced, traced], rel=1e-9)
    assert data["best"]["thd"]["setting"] == "rows of 1 window, recompute none"
    assert all(step <= traced * (1 + 1e-9) for step in data["best"]["dynapipe"]["step_s"])


def test_the_methods_cross_the_hardwares_link_between_stages_not_the_one_a_profile_measured(tmp_path):
    # a profile made on a CPU box records gloo between two local ranks; a job of thousands of GPUs
    # crosses its hardware's links, as the trace's replay prices them
    from types import SimpleNamespace

    from megatron_dynapipe.config.model import get_model
    from megatron_dynapipe.hardware import load_hardware
    from megatron_dynapipe.planning.cost_model.loading import resolve_cost_model_path
    from megatron_dynapipe.simulate.methods import _Layout
    from megatron_dynapipe.simulate.search import Candidate, SearchSpace

    doc = json.loads(resolve_cost_model_path("gpt-6.7b-a100").read_text())
    doc["metadata"] = dict(doc.get("metadata") or {}, link={"bandwidth_GBps": 0.001, "latency_us": 50_000.0})
    slow = tmp_path / "slow-link.json"
    slow.write_text(json.dumps(doc))
    a100 = load_hardware("a100")
    for dp, across in ((1, False), (8, True)):  # stage neighbours 1 x 1 x dp ranks apart, 8 GPUs a node
        space = SearchSpace(model=get_model("6.7B"), world_size=2 * dp, global_batch_size=8 * dp, seq_length=2048,
                            hardware=a100, cost_model=str(slow))
        c = Candidate(tp=1, pp=2, cp=1, dp=dp, micro_batch_size=1, num_microbatches=8, recompute="none",
                      distributed_optimizer=False)
        layout = _Layout(space, SimpleNamespace(candidate=c, report=SimpleNamespace(iteration_s=10.0)))
        assert layout.costs.p2p_link == a100.link("p2p", across)
        assert layout.costs.p2p_link != a100.link("p2p", not across)


def test_the_planner_and_the_replay_price_a_slow_context_parallel_ring_alike(tmp_path, capsys):
    """CP 4 on a point-to-point link slow enough for the ring to dominate the step (collectives
    keep a fast one): each ring step runs beside one block of attention in the planner's cost model
    and in the trace's replay alike, so the step's rest (the traced step less the planner's
    simulation of its pipeline: the gradient reduction and the optimizer's) is what it is on a
    link that hides the ring."""
    from megatron_dynapipe.hardware import load_hardware

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("256\n" * 10)
    priced = {}
    for name, p2p_gbps in (("fast", 1e4), ("slow", 0.1)):
        hardware = load_hardware("h100").to_json()
        hardware["intra_node"] = {"bandwidth_GBps": 1e4, "latency_us": 0.0}
        hardware["collectives"] = {"p2p": {"bandwidth_GBps": p2p_gbps, "latency_us": 0.0}}  # the planner's ring has none
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(hardware))
        document = _search(tmp_path / name, capsys, "--world-size", "4", "--global-batch-size", "4", "--tp", "1",
                           "--pp", "1", "--cp", "4", "--hardware", str(path),
                           "--micro-batch-size", "1", "--recompute", "none", "--no-distributed-optimizer",
                           "--max-traced", "1", "--lengths", str(lengths), "--batches", "1", "--method", "thd")
        (step,) = [s for s in document["on_data"]["steps"] if s["method"] == "thd"]
        priced[name] = (step["why"]["rest_ms"], 1e3 * step["mean_step_s"])
    (fast_rest, fast_step), (slow_rest, slow_step) = priced["fast"], priced["slow"]
    assert slow_step > 5 * fast_step  # the ring dominates the slow step
    assert abs(slow_rest - fast_rest) <= 0.03 * slow_step, priced


def test_the_planner_and_the_replay_price_tp_communication_overlap_alike(tmp_path, capsys):
    """TP 2 with sequence parallelism on a link slow enough for its all-gathers and reduce-scatters
    to matter: --tp-comm-overlap hides part of them under the GEMMs beside them in the trace's
    replay, and the planner that prices the methods must hide the same part, so the step's rest
    (the traced step less the planner's simulation of its pipeline) does not move with the flag."""
    from megatron_dynapipe.hardware import load_hardware

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("256\n" * 10)
    hardware = load_hardware("h100").to_json()
    hardware["intra_node"] = {"bandwidth_GBps": 25.0, "latency_us": 0.0}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(hardware))
    priced = {}
    for overlap in (False, True):
        document = _search(tmp_path / str(overlap), capsys, "--world-size", "2", "--global-batch-size", "2",
                           "--hidden-size", "4096", "--num-attention-heads", "32", "--tp", "2", "--pp", "1",
                           "--sequence-parallel", "--hardware", str(path), "--micro-batch-size", "1",
                           "--recompute", "none", "--no-distributed-optimizer", "--max-traced", "1",
                           "--lengths", str(lengths), "--batches", "1", "--method", "thd",
                           *(["--tp-comm-overlap"] if overlap else []))
        assert document["tp_comm_overlap"] is overlap
        (step,) = [s for s in document["on_data"]["steps"] if s["method"] == "thd"]
        priced[overlap] = (document["best"]["iteration_s"], step["why"]["rest_ms"], 1e3 * step["mean_step_s"])
    (plain_traced, plain_rest, _), (overlap_traced, overlap_rest, overlap_step) = priced[False], priced[True]
    assert overlap_traced < 0.98 * plain_traced, priced  # the overlap is traced and replayed
    assert abs(overlap_rest - plain_rest) <= 0.005 * overlap_step, priced


def test_one_registry_names_every_method_for_every_command():
    """search/simulate price the windows' and whole-sample methods Megatron-LM runs and DynaPipe's;
    plan's yardsticks and bench step's rows are the registry's too, each label naming one method."""
    from megatron_dynapipe.bench import step_methods
    from megatron_dynapipe.planning.methods import METHODS as REGISTRY, yardstick

    labels = [m.label for m in REGISTRY.values()]
    assert len(set(labels)) == len(labels) and step_methods.FAST not in labels
    assert set(METHODS) == {"megatron", "thd", "dp_balanced", "dynapipe", "dynapipe-varlen", "dynapipe-cut"}
    assert (yardstick("pad").name, yardstick("varlen").name) == ("packing", "thd-whole")
    assert yardstick("varlen").documents == "whole" and REGISTRY["thd"].documents == "cut"
    assert set(step_methods.RUNS) <= set(REGISTRY) and "megatron" not in step_methods.RUNS
    # losses: leaky packing differs by design; the two cut methods train the same pieces
    assert step_methods.LEAKY == ("packing",)
    assert step_methods.CUT_PIECES == ("THD packing", "DynaPipe varlen (cut)")
