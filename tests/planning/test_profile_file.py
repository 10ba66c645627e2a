"""The cost-model file, written and read by the one module that knows its format."""

import json

import pytest

from megatron_dynapipe.planning.cost_model import AnalyticalCostModel, CostModelError, load_cost_model
from megatron_dynapipe.planning.cost_model.profile_file import (
    CALIBRATED,
    ProfileRecords,
    calibrated_document,
    calibrated_settings,
    read_document,
    to_text,
)
from megatron_dynapipe.planning.types import RecomputeType


def _records() -> ProfileRecords:
    records = ProfileRecords()
    for rc, scale in (("none", 1.0), ("full", 1.5)):
        for s in (64, 128):
            for m in (1, 2):
                for layer, ms in (("encoder", 1.0), ("postprocess", 0.5), ("preprocess", 0.25)):
                    for phase, factor in (("forward", 1.0), ("backward", 2.0)):
                        records.times[(1, rc, layer, phase, s, m)] = ms * factor * scale * s * m / 64
                        records.spread[(1, rc, layer, phase, s, m)] = 0.0625
                records.memory[(1, rc, "stored", s, m)] = 3.0 * s * m / 64 / scale
                records.memory[(1, rc, "peak", s, m)] = 1.0 * s * m / 64
        records.params[(1, rc, "encoder")] = 2.0
        records.params[(1, rc, "embedding")] = 8.0
    records.infeasible.add((1, "none", 128, 4))
    records.overhead[1] = {(per, phase): (0.5, 0.001) for per in ("stage", "layer") for phase in ("forward", "backward")}
    records.overhead_points[1] = 4
    return records


def _with_context_parallel_rows(records: ProfileRecords) -> ProfileRecords:
    """``records`` with the encoder measured on one rank of a context-parallel group of 2."""
    for layout in ("padded", "thd"):
        for phase, ms in (("forward", 0.75), ("backward", 1.5)):
            records.cp_times[(1, 2, "none", layout, phase, 128, 1)] = ms
            records.cp_spread[(1, 2, "none", layout, phase, 128, 1)] = 0.125
        for kind, mb in (("stored", 2.5), ("peak", 0.5)):
            records.cp_memory[(1, 2, "none", layout, kind, 128, 1)] = mb
    return records


def test_records_survive_the_file(tmp_path):
    records = _with_context_parallel_rows(_records())
    path = tmp_path / "p.json"
    path.write_text(to_text({"name": "test", "hidden_size": 64, **records.records()}))
    back = ProfileRecords.from_document(read_document(path), str(path))
    assert back == records
    model = load_cost_model(path, tp=1)
    assert model.layer_ms("encoder", "backward", RecomputeType.FULL, 2, 128) == pytest.approx(1.0 * 2.0 * 1.5 * 4)
    assert model.microbatch_overhead_ms("forward", 1, 100, 3) == pytest.approx(0.5 + 0.1 + 3 * (0.5 + 0.1))


def test_context_parallel_records_come_back_by_group_layout_and_phase(tmp_path):
    records = _with_context_parallel_rows(_records())
    records.cp_times[(1, 2, "full", "padded", "forward", 128, 1)] = 9.0  # its backward was not measured
    records.cp_memory[(1, 2, "full", "padded", "stored", 128, 1)] = 1.0  # nor its peak
    path = tmp_path / "p.json"
    path.write_text(to_text({"name": "test", **records.records()}))
    back = ProfileRecords.from_document(read_document(path), str(path))
    assert back.cp_tables(1) == {(2, layout, what, RecomputeType.NONE): {(128, 1): value}
                                 for layout in ("padded", "thd")
                                 for what, value in (("forward", 0.75), ("backward", 1.5), ("stored", 2.5),
                                                     ("peak", 0.5))}
    assert back.cp_tables(2) == {} and back.times == records.times  # CP 1's records are not disturbed


@pytest.mark.parametrize("table, change", [("layer_time", dict(cp=0)), ("layer_time", dict(cp=2, layer="postprocess")),
                                           ("layer_time", dict(cp="2")), ("activation_memory", dict(cp=1.5)),
                                           ("model_state_memory", dict(cp=2))])
def test_a_bad_context_parallel_size_is_refused_in_one_line(tmp_path, table, change):
    doc = {"name": "test", **_records().records()}
    doc[table][0].update(change)  # a padded CP 1 record (the encoder's, where the table has layers)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CostModelError, match=rf"bad\.json has a {table} record with cp .*: use a positive integer, "
                                             r"above 1 for the encoder's layer_time and activation_memory only"):
        load_cost_model(path, tp=1)


def test_a_broken_record_is_named_with_its_table_and_number(tmp_path):
    doc = {"name": "test", **_records().records()}
    doc["layer_time"][3]["mbs"] = 0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CostModelError, match=r"bad\.json has a layer_time record 3 whose 'mbs' is not a positive "
                                             r"integer: see docs/cost_model\.md"):
        load_cost_model(path, tp=1)


def test_a_calibrated_file_round_trips_to_the_analytical_model(tmp_path):
    settings = dict(hidden_size=128, num_heads=8, ffn_hidden_size=512, vocab_size=1024, peak_tflops=2.0, mfu=1.0,
                    attention_mfu=0.5, overhead_ms=0.1, saturation_tokens=256, device_memory_mb=8192.0)
    doc = calibrated_document(name="c", source="test", hidden_size=128, metadata={"dtype": "fp32"}, settings=settings,
                              overhead=_records().overhead_records())
    assert list(doc["analytical"]) == list(CALIBRATED) and calibrated_settings(doc, "c") == settings
    path = tmp_path / "c.json"
    path.write_text(to_text(doc))
    model = load_cost_model(path, tp=2)  # a calibrated model prices any TP size
    assert isinstance(model, AnalyticalCostModel) and model.tp == 2 and model.peak_tflops == 2.0
    assert load_cost_model(path, tp=1).microbatch_overhead[("layer", "backward")] == (0.5, 0.001)  # measured at TP 1
    del doc["analytical"]["mfu"]
    path.write_text(to_text(doc))
    with pytest.raises(CostModelError, match="has an 'analytical' object without 'mfu'"):
        load_cost_model(path, tp=1)


@pytest.mark.parametrize("version", [999, 5, "1", None])
def test_a_file_of_another_format_version_is_refused_in_one_line(tmp_path, version):
    """What a later (or broken) megatron-dynapipe wrote is not read as this version's format."""
    doc = {"name": "test", "metadata": {"format_version": version}, **_records().records()}
    path = tmp_path / "future.json"
    path.write_text(to_text(doc))
    with pytest.raises(CostModelError, match=rf"future\.json has format_version {version!r}; this megatron-dynapipe "
                                             r"reads versions 1, 2, 3 and 4: re-profile"):
        load_cost_model(path, tp=1)
    for readable in (1, 2, 3, 4):
        doc["metadata"]["format_version"] = readable
        path.write_text(to_text(doc))
        assert load_cost_model(path, tp=1).layer_ms("encoder", "forward", RecomputeType.NONE, 1, 64) == pytest.approx(1.0)


def test_a_file_that_is_not_a_json_object_is_refused_in_one_line(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(CostModelError, match=r"list\.json holds a JSON list, not an object: see docs/cost_model\.md"):
        load_cost_model(path, tp=1)


def test_an_interrupted_profile_is_refused_by_whoever_would_price_with_it(tmp_path):
    """A profile written with "complete": false (an interrupted `profile`, which --resume goes on
    with) lacks lengths or recompute types: it prices nothing until finished."""
    from megatron_dynapipe.planning.cost_model import ProfiledCostModel

    doc = {"name": "test", "metadata": {"format_version": 3, "complete": False}, **_records().records()}
    path = tmp_path / "partial.json"
    path.write_text(to_text(doc))
    for load in (lambda: load_cost_model(path, tp=1), lambda: ProfiledCostModel.from_json(path, tp=1)):
        with pytest.raises(CostModelError, match=r"partial\.json is an interrupted profile .* --resume"):
            load()
    doc["metadata"]["complete"] = True
    path.write_text(to_text(doc))
    assert load_cost_model(path, tp=1).layer_ms("encoder", "forward", RecomputeType.NONE, 1, 64) == pytest.approx(1.0)


def _with_packed_rows(records: ProfileRecords, factor: float) -> ProfileRecords:
    """``records`` with the encoder measured on packed rows too, of recompute none only, each
    ``factor`` times its padded twin."""
    for (tp, rc, layer, phase, s, m), ms in list(records.times.items()):
        if layer == "encoder" and rc == "none":
            records.packed_times[(tp, rc, layer, phase, s, m)] = ms * factor
            records.packed_spread[(tp, rc, layer, phase, s, m)] = 0.125
    for (tp, rc, kind, s, m), mb in list(records.memory.items()):
        if rc == "none":
            records.packed_memory[(tp, rc, kind, s, m)] = mb * factor
    return records


def test_packed_rows_survive_the_file_and_price_packed_microbatches_alone(tmp_path):
    records = _with_packed_rows(_records(), factor=1.25)
    path = tmp_path / "p.json"
    path.write_text(to_text({"name": "test", "hidden_size": 64, **records.records()}))
    assert ProfileRecords.from_document(read_document(path), str(path)) == records
    thd = [r for r in json.loads(path.read_text())["layer_time"] if r.get("layout") == "thd"]
    assert len(thd) == 2 * 2 * 2 and {r["layer"] for r in thd} == {"encoder"}  # 2 lengths x 2 sizes x 2 phases
    padded = load_cost_model(path, tp=1)
    packed = padded.packed()
    for phase in ("forward", "backward"):
        assert packed.layer_ms("encoder", phase, "none", 2, 96) == pytest.approx(
            1.25 * padded.layer_ms("encoder", phase, "none", 2, 96))
        # measured for none alone: full, the head and the embedding stay as measured padded
        assert packed.layer_ms("encoder", phase, "full", 2, 96) == padded.layer_ms("encoder", phase, "full", 2, 96)
        assert packed.layer_ms("postprocess", phase, "none", 2, 96) == padded.layer_ms("postprocess", phase, "none", 2, 96)
    assert packed.activation_mb("stored", "none", 1, 128) == pytest.approx(1.25 * 3.0 * 2)
    assert packed.packed() is packed and load_cost_model(tmp_path / "p.json", tp=1).packed() is not padded


def test_a_profile_without_packed_rows_prices_packed_microbatches_as_padded_ones(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(to_text({"name": "test", "hidden_size": 64, **_records().records()}))
    model = load_cost_model(path, tp=1)
    assert model.packed() is model


def test_a_packed_record_of_another_layer_than_the_encoder_is_refused(tmp_path):
    doc = {"name": "test", **_records().records()}
    head = next(n for n, r in enumerate(doc["layer_time"]) if r["layer"] == "postprocess")
    doc["layer_time"][head]["layout"] = "thd"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CostModelError, match=r"bad\.json has a layer_time record of layout 'thd': use padded, or thd "
                                             r"for the encoder"):
        load_cost_model(path, tp=1)


def _with_attention_core(records: ProfileRecords) -> ProfileRecords:
    """The core alone, without a mask, at every padded point: a fifth of the encoder forward, a
    quarter of its backward."""
    for (tp, rc, layer, phase, s, m), ms in list(records.times.items()):
        if rc == "none" and layer == "encoder":
            records.core_times[(tp, phase, s, m)] = ms * (0.2 if phase == "forward" else 0.25)
    return records


def test_the_attention_core_survives_the_file_and_is_priced_as_measured(tmp_path):
    records = _with_attention_core(_records())
    path = tmp_path / "p.json"
    path.write_text(to_text({"name": "test", "hidden_size": 64, **records.records()}))
    assert ProfileRecords.from_document(read_document(path), str(path)) == records
    model = load_cost_model(path, tp=1)
    assert model.prices_attention_core
    # a causal core's worth of unmasked blocks: half the unmasked core. The encoder's forward at
    # (64, 1) is 1 ms, at (128, 1) 2 ms: the core a fifth of it, linear between
    assert model.attention_core_ms("forward", "none", 1, 64) == pytest.approx(0.5 * 0.2)
    assert model.attention_core_ms("forward", "none", 1, 96) == pytest.approx(0.5 * 0.3)
    # backward: a quarter of 2 ms x 2 x 2 rows at 128; a recompute reruns the core's forward too
    assert model.attention_core_ms("backward", "none", 2, 128) == pytest.approx(0.5 * 2.0)
    assert model.attention_core_ms("backward", "full", 2, 128) == pytest.approx(0.5 * (2.0 + 0.8))
    assert model.packed().attention_core_ms("forward", "full", 2, 64) == pytest.approx(0.5 * 0.4)


def test_a_profile_without_the_attention_core_reads_and_says_so(tmp_path):
    doc = {"name": "test", **_records().records()}
    del doc["attention_core_time"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    model = load_cost_model(path, tp=1)
    assert not model.prices_attention_core
    with pytest.raises(CostModelError, match="did not measure the attention core alone"):
        model.attention_core_ms("forward", "none", 1, 64)


def test_an_attention_core_record_of_an_unknown_phase_is_refused(tmp_path):
    doc = {"name": "test", **_with_attention_core(_records()).records()}
    doc["attention_core_time"][0]["phase"] = "sideways"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CostModelError, match=r"attention_core_time record 0 with phase 'sideways'"):
        load_cost_model(path, tp=1)
