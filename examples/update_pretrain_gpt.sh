#!/usr/bin/env bash
# GPT pre-training at full scale, traced with fake ranks: a batch of parallel layouts, one run.
#
#   examples/update_pretrain_gpt.sh                          # BATCH_CONFIGS below, GPT-6.7B, this CPU machine
#   examples/update_pretrain_gpt.sh "8192 16 8" "4096 16 4"  # these configs instead
#   MODEL_SIZE=175 examples/update_pretrain_gpt.sh "8192 16 8"
#   MEGATRON_LM_DIR=~/Megatron-LM examples/update_pretrain_gpt.sh
#
# Configs are "WORLD_SIZE PP TP [CP [EP]] [key=value ...]" (keys: cp ep etp mbs nmb gbs seq experts
# model); with none, the one default config is 8192 ranks, PP 2, TP 2.  MODEL_SIZE names a row
# of the package's model table (hidden/heads/layers):
#   tiny 128/8/4, 6.7 4096/32/32, 13 5120/32/40, 30 7680/48/40, 40 9216/72/40, 70 8192/64/80,
#   175 12288/96/96, 485 20480/160/96, 1T 25600/160/128, 2T 25600/160/256
# (`python -m megatron_dynapipe.tracer.cli --list-models` prints it from the package).
#
# Two ways to run
# ---------------
# * Default (MEGATRON_LM_DIR unset): `megatron-dynapipe trace` on this machine.  Each
#   representative rank (one per pipeline stage; x EP for MoE) is traced in a forked process
#   pretending to be that rank of the full job; models too big for this machine's memory are
#   traced shapes-only.  The default (GPT-6.7B, 8192/2/2: shapes-only, since one rank would need
#   about 55 GiB) traces its 2 ranks in about 2 s on 2 CPU cores (plus imports); MODEL_SIZE=tiny computes every op for real
#   (about 20 s).
# * MEGATRON_LM_DIR set: Megatron-LM's own pretrain_gpt.py is run once per representative rank
#   through `megatron-dynapipe launch` (python -m megatron_dynapipe.megatron.launcher), with the
#   fake-rank flags
#       --is-scaling-mode --fake-world-size W --fake-pp P --fake-tp T --fake-current-rank-id R
#       --trace-dir <OUTPUT_DIR>/<folder> --trace-start WARMUP_ITERS --trace-iters TRACE_ITERS
#   The launcher sees --is-scaling-mode and, instead of training, traces that fake rank in one
#   plain process (no torchrun: Megatron's distributed start-up never runs; the checkout's
#   megatron-core builds the model) and writes <folder>/rank_<R>.trace.jsonl -- shapes-only
#   unless the model fits this machine, by the same rule as the default way
#   (megatron_dynapipe/megatron_lm/scaling_mode.py).  CP, EP and expert TP go through Megatron's
#   --context-parallel-size / --expert-model-parallel-size / --expert-tensor-parallel-size.  The
#   ranks, the folder names and the model and training flags come from the package (`trace
#   --print-ranks` with TRACE_ARGS), never from arithmetic in this script.  Each rank's output
#   goes to <OUTPUT_DIR>/<folder>/fake_rank_<R>.log (moved into place when the rank ends).  Then
#   `trace --collect` reads the ranks' traces back and writes each folder's summary.json and
#   timeline.json, so both ways leave the same files.
#   DRY_RUN=1 prints the commands instead of running them.
#
# Environment
#   MODEL_SIZE        model name (default 6.7)
#   OUTPUT_DIR        where the per-config folders go (default ./traces)
#   MICRO_BATCH_SIZE  default 1
#   GLOBAL_BATCH_SIZE default: micro-batch size x PP x DP (one micro-batch per stage)
#   SEQ_LENGTH        default: the model's (tiny 256, others 2048)
#   WARMUP_ITERS, TRACE_ITERS   default 1 and 1
#   PRECISION         bf16 (default), fp16 or fp32: the training precision both ways trace
#   PYTHON            default: the checkout's .venv, else python3
#   TRACE_ARGS        extra `trace` options: model and training flags, both ways (e.g. "--bf16
#                     --sequence-parallel --num-layers-per-virtual-pipeline-stage 2"); the default
#                     way also takes how to trace ("--shapes-only --json")
#   MEGATRON_LM_DIR   a Megatron-LM checkout: run its pretrain_gpt.py (see above)
#   MEGATRON_ARGS     extra pretrain_gpt.py flags
#   DRY_RUN=1         with MEGATRON_LM_DIR: print the commands only
# Exit status: 0 when every valid config traced, 1 when one failed (or none was valid).

set -euo pipefail

# "WORLD_SIZE PP TP [CP [EP]]"; leave empty for the default config (8192 2 2).
BATCH_CONFIGS=(
    # "8192 16 8"
    # "4096 16 4"
    # "1024 4 2 2"
)

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

MODEL_SIZE="${MODEL_SIZE:-6.7}"
OUTPUT_DIR="${OUTPUT_DIR:-$PWD/traces}"
MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE:-1}"
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-}"
SEQ_LENGTH="${SEQ_LENGTH:-}"
WARMUP_ITERS="${WARMUP_ITERS:-1}"
TRACE_ITERS="${TRACE_ITERS:-1}"

if [[ $# -gt 0 ]]; then BATCH_CONFIGS=("$@"); fi
if [[ ${#BATCH_CONFIGS[@]} -eq 0 ]]; then BATCH_CONFIGS=("8192 2 2"); fi

trace() { "$PYTHON" -m megatron_dynapipe.tracer.cli "$@"; }  # = megatron-dynapipe trace

args=(--model "$MODEL_SIZE" --micro-batch-size "$MICRO_BATCH_SIZE")
case "${PRECISION:-bf16}" in  # explicit, so pretrain_gpt.py (fp32 unless told) traces what `trace` does
    bf16) args+=(--bf16) ;;
    fp16) args+=(--fp16) ;;
    fp32) args+=(--fp32) ;;
    *) echo "PRECISION=$PRECISION: use bf16, fp16 or fp32" >&2; exit 2 ;;
esac
[[ -n "$GLOBAL_BATCH_SIZE" ]] && args+=(--global-batch-size "$GLOBAL_BATCH_SIZE")
[[ -n "$SEQ_LENGTH" ]] && args+=(--seq-length "$SEQ_LENGTH")
for config in "${BATCH_CONFIGS[@]}"; do args+=(--config "$config"); done

# ---------------------------------------------------------------------------------------------
if [[ -z "${MEGATRON_LM_DIR:-}" ]]; then
    # shellcheck disable=SC2086
    exec "$PYTHON" -m megatron_dynapipe.tracer.cli "${args[@]}" --output-dir "$OUTPUT_DIR" \
        --warmup-iters "$WARMUP_ITERS" --trace-iters "$TRACE_ITERS" ${TRACE_ARGS:-}
fi

# ---------------------------------------------------------------------------------------------
# Megatron-LM: one pretrain_gpt.py run per representative rank.
if [[ "${DRY_RUN:-0}" != 1 && ! -f "$MEGATRON_LM_DIR/pretrain_gpt.py" ]]; then
    echo "MEGATRON_LM_DIR=$MEGATRON_LM_DIR has no pretrain_gpt.py" >&2
    exit 2
fi

# shellcheck disable=SC2086
ranks="$(trace "${args[@]}" ${TRACE_ARGS:-} --print-ranks)" || {
    status=$?
    [[ -z "$(grep -v '^#' <<<"$ranks")" ]] && exit "$status"  # nothing valid (reasons on stderr)
}

failed=0
total=0
# the last column, the rest of each line, holds the config's model and training flags
while read -r _config world pp tp cp ep _dp mbs _nmb gbs _seq rank _stage _ep_rank _model _experts etp folder \
        megatron_args; do
    read -r -a model_args <<<"$megatron_args"

    cmd=("$PYTHON" -m megatron_dynapipe.megatron.launcher  # = megatron-dynapipe launch
        "$MEGATRON_LM_DIR/pretrain_gpt.py" "${model_args[@]}"
        --micro-batch-size "$mbs" --global-batch-size "$gbs"
        --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp")
    [[ "$cp" -gt 1 ]] && cmd+=(--context-parallel-size "$cp")
    [[ "$ep" -gt 1 ]] && cmd+=(--expert-model-parallel-size "$ep")
    [[ "$etp" -ne "$tp" ]] && cmd+=(--expert-tensor-parallel-size "$etp")
    cmd+=(--train-iters $((WARMUP_ITERS + TRACE_ITERS)) --lr 1.5e-4 --eval-iters 0 --log-interval 1
        --mock-data --tokenizer-type NullTokenizer
        --is-scaling-mode --fake-world-size "$world" --fake-pp "$pp" --fake-tp "$tp"
        --fake-current-rank-id "$rank"
        --trace-dir "$OUTPUT_DIR/$folder" --trace-start "$WARMUP_ITERS" --trace-iters "$TRACE_ITERS")
    # shellcheck disable=SC2206
    cmd+=(${MEGATRON_ARGS:-})

    total=$((total + 1))
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%q ' "${cmd[@]}"
        printf '\n'
        continue
    fi
    mkdir -p "$OUTPUT_DIR/$folder"
    log="$OUTPUT_DIR/$folder/fake_rank_$rank.log"
    echo "[$total] $folder rank $rank" >&2
    if "${cmd[@]}" >"$log.partial" 2>&1; then
        mv -f "$log.partial" "$log"
    else
        status=$?
        echo "# exit status $status" >>"$log.partial"
        mv -f "$log.partial" "$log"
        echo "    failed with exit status $status; see $log" >&2
        failed=$((failed + 1))
    fi
done < <(grep -v '^#' <<<"$ranks")

[[ "${DRY_RUN:-0}" == 1 ]] && exit 0
echo "$((total - failed)) of $total ranks ran; outputs under $OUTPUT_DIR" >&2
# Each folder's summary.json and timeline.json, as the default way writes them; exit 1 if a rank failed.
# shellcheck disable=SC2086
trace "${args[@]}" ${TRACE_ARGS:-} --output-dir "$OUTPUT_DIR" --collect --no-progress
