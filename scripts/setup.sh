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
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
.venv/bin/python -m pip install --quiet -e ".[all,test]"
