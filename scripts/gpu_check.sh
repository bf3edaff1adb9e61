#!/usr/bin/env bash
# One command measures a CUDA GPU (issue 34): the CUDA tests, then the training and the embedding
# benchmarks, in under 8 minutes on one card; writes
#     bench/results/train-cuda.md   bench/train.py --device cuda  (elmokit vs nn.LSTM(proj_size), cuDNN)
#     bench/results/embed-cuda.md   bench/embed.py --device cuda  (rows up to 4,096, streams that fill them)
#     bench/results/gpu-check.md    this run: the device, torch/CUDA versions, the tests' summary,
#                                   each part's exit status and seconds, what else used the GPU
# rewrites docs/gpu.md's hours for 1B tokens from train-cuda.md (bench/gpu_time.py), and copies
# them to $OUT when that is set. Runs cold on a fresh machine with the repository and its
# .venv: it installs nothing and downloads nothing (the built-in model ships in the package; PTB and
# UD EWT are read from ../shared/data when present, else the benchmarks use synthetic text and say so).
#
#     bash scripts/gpu_check.sh            (GPU_CHECK_BUDGET=SECONDS scales the three parts' time limits)
#     GPU_CHECK_PARTS="tests embed" bash scripts/gpu_check.sh    (only those parts: a rerun of what failed,
#                                           the other pages left as their own run wrote them)
#
# It needs a Python whose torch is a CUDA build: this project's own .venv holds a CPU-only one, so a
# GPU machine needs a .venv made there (scripts/setup.sh with PyPI's torch) or a system torch with CUDA.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO/src:$REPO${PYTHONPATH:+:$PYTHONPATH}"  # the .venv's editable install may point elsewhere
export PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
unset ELMOKIT_DEVICE ELMOKIT_CUDA_GRAPHS
BUDGET="${GPU_CHECK_BUDGET:-480}"  # the three parts together (overhead aside); on an H200: tests 31-46 s, train 102, embed 184
RESULTS="$REPO/bench/results"
REPORT="$RESULTS/gpu-check.md"

# The first Python whose torch sees a CUDA GPU and that has elmokit's core dependencies (the .venv
# made on a CPU machine may hold a CPU-only torch: then a system Python with a CUDA build is used).
PY=""
TRIED=""
for candidate in "$REPO/.venv/bin/python" python3 python; do
    found="$("$candidate" -c 'import torch, numpy, h5py, safetensors; print(f"torch {torch.__version__} (CUDA build {torch.version.cuda}), GPU seen: {torch.cuda.is_available()}")' 2>/dev/null)" \
        || found="no torch/numpy/h5py/safetensors"
    TRIED="$TRIED; $candidate: $found"
    if [[ "$found" == *"GPU seen: True" ]]; then PY="$candidate"; break; fi
done
if [ -z "$PY" ]; then
    echo "gpu_check: torch sees no CUDA GPU here with any Python (${TRIED#; }); nothing measured" >&2
    exit 3
fi

# Every core dependency of pyproject.toml, before any GPU time is spent: a machine's own image may
# lack one (the H200's lacked platformdirs: 6 CUDA tests failed on its import). A pure-Python one can
# travel as a wheel downloaded here, unpacked there into a folder put on PYTHONPATH.
MISSING="$("$PY" - "$REPO/pyproject.toml" <<'PYTHON'
import importlib.util, re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    specs = tomllib.load(f)["project"]["dependencies"]
names = [re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0] for spec in specs]
print(" ".join(name for name in names if importlib.util.find_spec(name.replace("-", "_")) is None))
PYTHON
)"
if [ -n "$MISSING" ]; then
    echo "gpu_check: $PY lacks elmokit's core dependencies: $MISSING (pyproject.toml); nothing measured" >&2
    exit 3
fi

DEVICE="$("$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB")')"
VERSIONS="$("$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")')"
DRIVER="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || true)"
others() { nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null | tr '\n' ';' || true; }
echo "gpu_check: $DEVICE; $VERSIONS; driver ${DRIVER:-?}; python $PY"

CHECK=gpu_check WANTED=" ${GPU_CHECK_PARTS:-tests train embed} "
source "$REPO/scripts/check_parts.sh"  # run_part, PARTS

BEFORE="load average $(cut -d' ' -f1 /proc/loadavg); GPU processes: $(others)"
STARTED="$(date -u '+%Y-%m-%d %H:%M UTC')"
run_part tests $((BUDGET * 15 / 100)) "$PY" -m pytest -q -p no:cacheprovider -k cuda \
    tests/test_devices.py tests/test_gpu_paths.py
TESTS="$(grep -E '[0-9]+ (passed|failed|error)' /tmp/gpu_check_tests.log | tail -1)"
NOTE="Run by scripts/gpu_check.sh (CUDA tests first: ${TESTS:-no summary})."
run_part train $((BUDGET * 30 / 100)) "$PY" bench/train.py --device cuda --shapes original \
    --batch-sizes 128 512 --warmup 3 --steps 10 --note "$NOTE"
run_part embed $((BUDGET * 55 / 100)) "$PY" bench/embed.py --device cuda --note "$NOTE"
AFTER="load average $(cut -d' ' -f1 /proc/loadavg); GPU processes: $(others)"

{
    echo "# scripts/gpu_check.sh"
    echo
    echo "Run of $STARTED on $DEVICE; $VERSIONS; NVIDIA driver ${DRIVER:-unknown}; $(nproc) CPU cores; $PY."
    echo "Before: $BEFORE. After: $AFTER."
    echo
    echo "CUDA tests (\`pytest -k cuda tests/test_devices.py tests/test_gpu_paths.py\`): ${TESTS:-no summary line}."
    echo
    echo "| part | exit status | seconds |"
    echo "|---|---:|---:|"
    printf '%s\n' "${PARTS[@]}"
    echo
    echo "The figures: bench/results/train-cuda.md and bench/results/embed-cuda.md (each written only by a"
    echo "benchmark that finished; a part not run here keeps the page of the run that wrote it, its own date on it)."
} > "$REPORT"
cat "$REPORT"
"$PY" bench/gpu_time.py >/dev/null || echo "gpu_check: bench/gpu_time.py could not rewrite docs/gpu.md" >&2
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    cp "$REPORT" "$RESULTS/train-cuda.md" "$RESULTS/embed-cuda.md" docs/gpu.md /tmp/gpu_check_*.log "$OUT"/ \
        2>/dev/null || true
fi
for part in $WANTED; do grep -q "| $part | 0 |" "$REPORT" || exit 1; done
