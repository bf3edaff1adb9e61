#!/usr/bin/env bash
# Set up elmokit on a fresh machine: a virtual environment in .venv, PyTorch first, then elmokit
# with every extra and the test and documentation tools (`.[all,test]`).
#
# Which build of torch this installs is chosen by where pip looks, not by this script:
#   * plain `pip install torch==2.13.0` from PyPI on Linux x86_64 gives a CUDA build (several GB
#     of NVIDIA libraries; it runs on a CPU too);
#   * this project's machines have a pip configuration that points at a local CPU build, so there
#     the same command gives the CPU build;
#   * for a CPU-only build elsewhere, name PyTorch's CPU index:
#       TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
# torch goes first so that elmokit's torch range is already met and pip pulls no other build.
# Each step says what it installs; the two large ones show pip's own progress (what it collects and
# downloads), as the whole takes minutes on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
step() { printf '\n== setup.sh [%s/4] %s\n' "$1" "$2"; }
if [ -x .venv/bin/python ]; then
    step 1 "virtual environment: .venv is there already, kept"
else
    step 1 "virtual environment: creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv .venv
fi
step 2 "pip: upgrading it inside .venv"
.venv/bin/python -m pip install --quiet --upgrade pip
step 3 "PyTorch 2.13.0 from ${TORCH_INDEX_URL:-the index pip is configured with}: the largest download (a CUDA build is several GB)"
.venv/bin/python -m pip install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
step 4 "elmokit (editable) with every extra and the test and documentation tools: .[all,test]"
.venv/bin/python -m pip install -e ".[all,test]"
printf '\n== setup.sh done: .venv/bin/elmo is ready (try .venv/bin/elmo demo)\n'
