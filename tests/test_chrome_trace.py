"""The one Chrome-trace builder: processes, rows numbered in the order they are first used, spans
in microseconds, written atomically as JSON that a viewer reads."""

import json

from megatron_dynapipe.chrome_trace import ChromeTrace


def test_a_document_of_processes_rows_and_spans(tmp_path):
    trace = ChromeTrace(name="test")
    trace.process(7, "stage 0")
    assert trace.row(7, "compute") == 0 and trace.row(7, "send") == 1 and trace.row(7, "compute") == 0
    trace.span(7, "send", "F 3", cat="F", start_us=10.0, dur_us=2.5, args={"microbatch": 3})
    trace.span(8, "compute", "B 1", cat="B", start_us=0.0, dur_us=1.0)  # a process named by its first span
    doc = json.loads(trace.write(tmp_path / "t.json").read_text())
    assert doc["otherData"] == {"name": "test"} and doc["displayTimeUnit"] == "ms"
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "stage 0"}} in meta
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert names == {(7, 0): "compute", (7, 1): "send", (8, 0): "compute"}
    assert spans == [
        {"name": "F 3", "cat": "F", "ph": "X", "pid": 7, "tid": 1, "ts": 10.0, "dur": 2.5, "args": {"microbatch": 3}},
        {"name": "B 1", "cat": "B", "ph": "X", "pid": 8, "tid": 0, "ts": 0.0, "dur": 1.0, "args": {}},
    ]
    assert doc["traceEvents"].index(meta[-1]) < doc["traceEvents"].index(spans[0])  # names before events
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary left
