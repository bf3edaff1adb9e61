#!/usr/bin/env bash
# Issue 41's CPU benchmarks on another machine's CPU, in about 8 minutes: a lent GPU machine's host
# is an Intel Xeon with AMX-BF16, AMX-INT8 and AVX512-VNNI, where this project's own machine is an
# AMD EPYC without AMX, so that is where the AMX targets can be measured. 2 threads, as the issue
# measures; each page's header names the CPU, its flags and the rooflines of the same run:
#     bench/results/cpu-check-embed.md   bench/embed.py: `original`, batch 32 and the engine's own 128 rows,
#                                        float32 / bfloat16 / int8, each dtype's fraction of its own ceiling
#                                        (issue 41, point 2)
#     bench/results/cpu-check-train.md   bench/train.py: gutenberg-cpu, batch 32, elmokit against
#                                        nn.LSTM(proj_size), with --lstm-bf16, --softmax-bf16, both, and
#                                        with torch's kernels instead of oneDNN's (point 3)
#     bench/results/cpu-check-profile.md bench/profile_embed.py: where the embedding time goes there, per
#                                        operation (what holds a dtype below its ceiling)
#     bench/results/cpu-check.md         this run: the CPU, torch, each part's exit status and seconds
#
#     bash scripts/cpu_check.sh                  (CPU_CHECK_BUDGET=SECONDS scales the parts' time limits)
#
# Data: UD English EWT dev and PTB's training text from ../shared/data, or from $ELMOKIT_BENCH_DATA
# (a folder holding ud-english-ewt/en_ewt-ud-dev.conllu and ptb/ptb.train.txt.gz). ../shared does
# not travel to a device machine: copy those two files into a folder of the checkout that
# .git/info/exclude ignores, name it in the call's `carry`, and set ELMOKIT_BENCH_DATA to it.
# Runs offline with the machine's own Python and torch (>= 2.11), installing nothing.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO/src:$REPO${PYTHONPATH:+:$PYTHONPATH}"  # the .venv's editable install may point elsewhere
export PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1 CUDA_VISIBLE_DEVICES=""
DATA="${ELMOKIT_BENCH_DATA:-$REPO/../shared/data}"
export UD_DEV="$DATA/ud-english-ewt/en_ewt-ud-dev.conllu" PTB_DATA="$DATA/ptb"
BUDGET="${CPU_CHECK_BUDGET:-460}"
RESULTS="$REPO/bench/results"
REPORT="$RESULTS/cpu-check.md"

for needed in "$UD_DEV" "$PTB_DATA/ptb.train.txt.gz"; do
    if [ ! -f "$needed" ]; then
        echo "cpu_check: $needed is absent (set ELMOKIT_BENCH_DATA to a folder holding ud-english-ewt/ and ptb/)" >&2
        exit 3
    fi
done
PY=""
for candidate in "$REPO/.venv/bin/python" python3 python; do
    if "$candidate" -c 'import torch, numpy, h5py, safetensors' 2>/dev/null; then PY="$candidate"; break; fi
done
if [ -z "$PY" ]; then
    echo "cpu_check: no Python here has torch, numpy, h5py and safetensors; nothing measured" >&2
    exit 3
fi
CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
FLAGS="$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx512f|avx512_bf16|avx512_vnni|amx_bf16|amx_int8|amx_tile)$' | tr '\n' ' ')"
VERSION="$("$PY" -c 'import torch; print(f"torch {torch.__version__}")')"
echo "cpu_check: $CPU ($(nproc) cores; $FLAGS); $VERSION; python $PY"

CHECK=cpu_check WANTED=""
source "$REPO/scripts/check_parts.sh"  # run_part, PARTS

NOTE="Run by scripts/cpu_check.sh."
STARTED="$(date -u '+%Y-%m-%d %H:%M UTC')"
run_part embed $((BUDGET * 35 / 100)) "$PY" bench/embed.py --shapes original --batch-sizes 32 128 --caches off \
    --limit 300 --sentences-per-row 3 --error-models --threads 2 --note "$NOTE" --output "$RESULTS/cpu-check-embed.md"
run_part profile $((BUDGET * 10 / 100)) "$PY" bench/profile_embed.py --limit 100 --threads 2 \
    --note "$NOTE" --output "$RESULTS/cpu-check-profile.md"
run_part train $((BUDGET * 55 / 100)) "$PY" bench/train.py --shapes gutenberg-cpu --batch-size 32 --threads 2 \
    --lstm-bf16 --torch-kernels --steps 6 --warmup 2 --profile-steps 0 --note "$NOTE" \
    --output "$RESULTS/cpu-check-train.md"

{
    echo "# scripts/cpu_check.sh"
    echo
    echo "Run of $STARTED on $CPU ($(nproc) cores; flags: $FLAGS); $VERSION; $PY."
    echo
    echo "| part | exit status | seconds |"
    echo "|---|---:|---:|"
    printf '%s\n' "${PARTS[@]}"
    echo
    echo "The figures: bench/results/cpu-check-embed.md, cpu-check-profile.md and cpu-check-train.md (each"
    echo "written only by a benchmark that finished)."
} > "$REPORT"
cat "$REPORT"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    cp "$REPORT" "$RESULTS/cpu-check-embed.md" "$RESULTS/cpu-check-profile.md" "$RESULTS/cpu-check-train.md" \
        /tmp/cpu_check_*.log "$OUT"/ 2>/dev/null || true
fi
grep -q '| embed | 0 |' "$REPORT" && grep -q '| train | 0 |' "$REPORT"
