#!/usr/bin/env bash
# Trace a small batch of configurations with the tiny model and check what comes out.
#
#   examples/test_batch_config.sh                  # the built-in expectations below
#   examples/test_batch_config.sh EXPECTATIONS     # your own file, same format
#
# An expectation is one line, '#' starts a comment; the lines, in order, are the batch:
#
#   WORLD_SIZE PP TP [CP [EP]] [key=value ...] : ok FOLDER     (traced into FOLDER)
#   WORLD_SIZE PP TP ...                       : invalid       (skipped with a reason)
#   WORLD_SIZE PP TP ...                       : failed        (valid, but its trace fails)
#
# The whole batch runs as one `trace --configs FILE --json` call (real fake-rank tracing on
# this machine); then, per config, the status and folder name must match and an "ok" folder
# must hold summary.json (complete, status ok) plus fake_rank_<r>.log and rank_<r>.trace.jsonl
# for every rank the summary lists; an invalid one must have no folder and a reason.  The exit
# status of `trace` must be 1 if a config is expected to fail, else 0.  Prints PASS/FAIL per
# config; exits 1 on any mismatch.
#
# Environment: PYTHON (default: the checkout's .venv, else python3), WORK_DIR (default: a
# temporary folder, removed at the end), TRACE_ARGS (extra `trace` options).

set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

read -r -d '' BUILT_IN <<'EOF'
# tiny model: 4 layers, 8 heads, sequence 256
16  2  2             : ok SIM_GPT_tiny-te_Config0_WS16_PP2_TP2_DP4_nMICROB2_MICROB_SIZE1_GLOBAL_BATCH8
12  2  4             : invalid
8   2  1 mbs=2 nmb=3 : ok SIM_GPT_tiny-te_Config2_WS8_PP2_TP1_DP4_nMICROB3_MICROB_SIZE2_GLOBAL_BATCH24
64  1  16            : invalid
16  2  2 gbs=10      : invalid
24  3  1             : invalid
EOF

if [[ $# -gt 1 ]]; then echo "usage: $0 [EXPECTATIONS_FILE]" >&2; exit 2; fi
if [[ $# -eq 1 ]]; then
    [[ -r "$1" ]] || { echo "cannot read expectations file $1" >&2; exit 2; }
    EXPECTATIONS="$(cat "$1")"
else
    EXPECTATIONS="$BUILT_IN"
fi

if [[ -n "${WORK_DIR:-}" ]]; then
    mkdir -p "$WORK_DIR"
else
    WORK_DIR="$(mktemp -d)"
    trap 'rm -rf "$WORK_DIR"' EXIT
fi

configs="$WORK_DIR/configs.txt"
expected="$WORK_DIR/expected.txt"
: >"$configs"
: >"$expected"
while IFS= read -r raw || [[ -n "$raw" ]]; do
    line="${raw%%#*}"
    [[ -z "${line//[[:space:]]/}" ]] && continue
    if [[ "$line" != *:* ]]; then echo "bad expectation (no ':'): $raw" >&2; exit 2; fi
    echo "${line%%:*}" >>"$configs"
    echo "$(echo "${line#*:}" | xargs)" >>"$expected"
done <<<"$EXPECTATIONS"

# shellcheck disable=SC2086
"$PYTHON" -m megatron_dynapipe.tracer.cli --model tiny --configs "$configs" --output-dir "$WORK_DIR/traces" \
    --json --no-progress ${TRACE_ARGS:-} >"$WORK_DIR/summary.json" 2>"$WORK_DIR/trace.err"
trace_status=$?

# One line per config from the JSON summary: index status folder-basename ranks...; and per
# folder whether the files the summary promises are there.
report="$("$PYTHON" - "$WORK_DIR/summary.json" <<'PY'
import json, os, sys
try:
    summary = json.load(open(sys.argv[1]))
except ValueError as e:
    print(f"ERROR the summary is not JSON: {e}")
    sys.exit(0)
for c in summary["configs"]:
    folder = c["folder"]
    missing = []
    if c["status"] == "ok":
        doc = json.load(open(os.path.join(folder, "summary.json")))
        if not doc.get("complete") or doc.get("status") != "ok":
            missing.append("summary.json(incomplete)")
        for r in c["ranks"]:
            for name in (f"fake_rank_{r['rank']}.log", f"rank_{r['rank']}.trace.jsonl"):
                if not os.path.isfile(os.path.join(folder, name)) or not os.path.getsize(os.path.join(folder, name)):
                    missing.append(name)
    elif c["status"] == "invalid" and not c["reasons"]:
        missing.append("reason")
    name = os.path.basename(folder) if folder else "-"
    print(c["index"], c["status"], name, ",".join(missing) or "-", "; ".join(c["reasons"]) or c["error"] or "-")
PY
)"

passed=0
failed=0
want_trace_status=0
grep -q '^failed' "$expected" && want_trace_status=1
if [[ $trace_status -ne $want_trace_status ]]; then
    echo "FAIL trace exited $trace_status, expected $want_trace_status: $(tail -n 5 "$WORK_DIR/trace.err")"
    failed=$((failed + 1))
fi
if [[ "$report" == ERROR* ]]; then
    echo "FAIL $report"
    exit 1
fi

index=0
while IFS= read -r config <&3 && IFS= read -r want <&4; do
    config="$(echo "$config" | xargs)"
    got="$(awk -v i="$index" '$1 == i' <<<"$report")"
    read -r _i status folder missing why <<<"$got"
    want_status="${want%% *}"
    want_folder="$(echo "${want#"$want_status"}" | xargs)"
    problem=""
    if [[ -z "$got" ]]; then
        problem="not in the summary"
    elif [[ "$status" != "$want_status" ]]; then
        problem="status $status, expected $want_status ($why)"
    elif [[ "$want_status" == ok && "$folder" != "$want_folder" ]]; then
        problem="folder $folder, expected $want_folder"
    elif [[ "$want_status" == ok && ! -d "$WORK_DIR/traces/$folder" ]]; then
        problem="folder $folder was not written"
    elif [[ "$want_status" == invalid && -e "$WORK_DIR/traces/$folder" && "$folder" != "-" ]]; then
        problem="an invalid config got a folder"
    elif [[ "$missing" != "-" ]]; then
        problem="missing $missing"
    fi
    if [[ -n "$problem" ]]; then
        echo "FAIL $config : $problem"
        failed=$((failed + 1))
    else
        detail=""
        [[ "$folder" != - ]] && detail+=" $folder"
        [[ -n "$why" && "$why" != - ]] && detail+=" ($why)"
        echo "PASS $config : $status$detail"
        passed=$((passed + 1))
    fi
    index=$((index + 1))
done 3<"$configs" 4<"$expected"

if [[ $failed -ne 0 ]]; then
    echo "$failed batch-config checks failed ($passed passed); set WORK_DIR to keep the outputs"
    exit 1
fi
echo "all $passed batch-config checks passed"
