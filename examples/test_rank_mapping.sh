#!/usr/bin/env bash
# Check the fake-rank tracer's representative ranks against known answers.
#
#   examples/test_rank_mapping.sh                  # the built-in expectations below
#   examples/test_rank_mapping.sh EXPECTATIONS     # your own file, same format
#
# An expectation is one line, '#' starts a comment:
#
#   WORLD_SIZE PP TP [CP [EP]] [key=value ...] : RANK RANK ...     (the ranks traced, in order)
#   WORLD_SIZE PP TP ... : invalid                                  (the config must be rejected)
#
# The ranks come from the package (`trace --print-ranks`); this script only compares.  For a
# dense config it also checks each rank against Megatron's tp-cp-ep-dp-pp order by bash
# arithmetic: the rank of stage s with tp = cp = dp = 0 is s * TP * CP * DP.
# Prints PASS/FAIL per line; exits 1 if any line fails, 2 on a usage error.
#
# Environment: PYTHON (default: the checkout's .venv, else python3), MODEL_SIZE (default 175,
# whose 96 layers and 96 heads divide every PP and TP below).

set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
MODEL_SIZE="${MODEL_SIZE:-175}"

trace() { "$PYTHON" -m megatron_dynapipe.tracer.cli "$@"; }  # = megatron-dynapipe trace
errfile="$(mktemp)"
trap 'rm -f "$errfile"' EXIT

read -r -d '' BUILT_IN <<'EOF'
# W     PP  TP  [CP EP]          : ranks traced (one per stage; x EP for MoE)
8192    2   2                    : 0 4096
8192    16  8                    : 0 512 1024 1536 2048 2560 3072 3584 4096 4608 5120 5632 6144 6656 7168 7680
4096    16  4                    : 0 256 512 768 1024 1280 1536 1792 2048 2304 2560 2816 3072 3328 3584 3840
1024    8   8   2                : 0 128 256 384 512 640 768 896
16      4   1                    : 0 4 8 12
8       1   8                    : 0
# MoE: expert ranks are etp + ETP*(ep + EP*(edp + EDP*pp)), traced for every EP rank (at TP > 1
# Megatron trains MoE only with sequence parallelism and, with linear biases, expert TP 1)
64      2   1   1   4  experts=8 : 0 1 2 3 32 33 34 35
# rejected layouts
100     3   2                    : invalid
8       4   4                    : invalid
64      2   2   1   4            : invalid
EOF

if [[ $# -gt 1 ]]; then echo "usage: $0 [EXPECTATIONS_FILE]" >&2; exit 2; fi
if [[ $# -eq 1 ]]; then
    [[ -r "$1" ]] || { echo "cannot read expectations file $1" >&2; exit 2; }
    EXPECTATIONS="$(cat "$1")"
else
    EXPECTATIONS="$BUILT_IN"
fi

passed=0
failed=0
while IFS= read -r raw || [[ -n "$raw" ]]; do
    line="${raw%%#*}"
    [[ -z "${line//[[:space:]]/}" ]] && continue
    if [[ "$line" != *:* ]]; then
        echo "bad expectation (no ':'): $raw" >&2
        exit 2
    fi
    config="$(echo "${line%%:*}" | xargs)"
    expected="$(echo "${line#*:}" | xargs)"

    out="$(trace --config "$config" --model "$MODEL_SIZE" --print-ranks 2>"$errfile")"
    status=$?
    why="$(tr '\n' ' ' <"$errfile" | xargs -0)"

    if [[ "$expected" == invalid ]]; then
        if [[ $status -ne 0 && -z "$(grep -v '^#' <<<"$out")" ]]; then
            echo "PASS $config : rejected ($why)"
            passed=$((passed + 1))
        else
            echo "FAIL $config : expected it to be rejected, got exit $status and ranks: $(grep -v '^#' <<<"$out" | awk '{print $12}' | xargs)"
            failed=$((failed + 1))
        fi
        continue
    fi
    if [[ $status -ne 0 ]]; then
        echo "FAIL $config : trace --print-ranks exited $status: $why"
        failed=$((failed + 1))
        continue
    fi

    # columns: config world_size pp tp cp ep dp mbs nmb gbs seq rank stage ep_rank model experts expert_tp folder
    actual=""
    formula_errors=""
    while read -r _idx _w pp tp cp ep dp _mbs _nmb _gbs _seq rank stage ep_rank _model experts _etp _folder; do
        actual+="$rank "
        if [[ $ep -eq 1 && $experts -eq 0 ]]; then
            want=$((stage * tp * cp * dp))
            [[ $rank -eq $want ]] || formula_errors+="stage $stage is rank $rank, formula says $want; "
        fi
    done < <(grep -v '^#' <<<"$out")
    actual="$(echo "$actual" | xargs)"

    if [[ "$actual" != "$expected" ]]; then
        echo "FAIL $config : expected ranks [$expected], got [$actual]"
        failed=$((failed + 1))
    elif [[ -n "$formula_errors" ]]; then
        echo "FAIL $config : $formula_errors"
        failed=$((failed + 1))
    else
        echo "PASS $config : [$actual]"
        passed=$((passed + 1))
    fi
done <<<"$EXPECTATIONS"

if [[ $failed -ne 0 ]]; then
    echo "$failed of $((passed + failed)) rank-mapping checks failed"
    exit 1
fi
echo "all $passed rank-mapping checks passed"
