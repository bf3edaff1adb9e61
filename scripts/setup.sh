#!/usr/bin/env bash
# Set up elmokit on a fresh machine: a virtual environment in .venv with the CPU build of
# PyTorch installed first (so no dependency range can pull a multi-GB CUDA build), then elmokit.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]"
