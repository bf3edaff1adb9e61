"""No surprises on import: importing elmokit (every module of it) changes no global state, and
its plots use matplotlib's object-oriented API without choosing or changing a backend.

Each check runs in a fresh interpreter: this test process has long since imported everything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# The dependencies are imported first, the integrations' libraries too where installed: what they
# change on import (torch and numpy add warnings filters; transformers sets KMP_* variables) is
# theirs. Then every elmokit module is imported, and the state compared.
IMPORT_EVERYTHING = r"""
import json, logging, os, pkgutil, signal, sys, warnings
import h5py, numpy, safetensors, torch, tqdm
for library in ("huggingface_hub", "sentence_transformers", "flair", "spacy", "langchain_core", "llama_index.core",
                "ray.data.datasource"):  # elmokit.ray_corpus subclasses Ray's datasource: Ray's filters and variables are Ray's
    try:  # the integrations' libraries (elmokit.integrations imports them): what they change is theirs too
        __import__(library)
    except ImportError:
        pass

def state():
    root = logging.getLogger()
    return {
        "environ": dict(os.environ),
        "warnings_filters": [repr(f) for f in warnings.filters],
        "showwarning": repr(warnings.showwarning),
        "excepthook": repr(sys.excepthook),
        "signals": {name: repr(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGTERM")},
        "logging": [root.level, [repr(h) for h in root.handlers]],
        "torch": [torch.get_num_threads(), str(torch.get_default_dtype()), torch.is_grad_enabled(),
                  torch.are_deterministic_algorithms_enabled()],
    }

before = state()
import elmokit, elmokit.cli
# elmokit.integrations.keras needs KERAS_BACKEND=torch set by its user before keras is imported, and
# keras imports matplotlib itself: it is imported last, on its own, after keras
modules = [m.name for m in pkgutil.walk_packages(elmokit.__path__, "elmokit.")
           if m.name not in ("elmokit.__main__", "elmokit.integrations.keras")]
for name in modules:
    __import__(name)
after = state()
optional = sorted(m for m in sys.modules if m.split(".")[0] in ("matplotlib", "sacremoses", "sentencex"))
os.environ["KERAS_BACKEND"] = "torch"
import keras
with_keras = state()
import elmokit.integrations.keras
print(json.dumps({"before": before, "after": after, "modules": modules + ["elmokit.integrations.keras"],
                  "optional": optional, "with_keras": with_keras, "after_keras": state()}))
"""

# Every plot elmokit draws, then: was pyplot imported, was a backend chosen?
PLOT_EVERYTHING = r"""
import json, sys
from pathlib import Path
import numpy as np
import matplotlib
from matplotlib import rcsetup
from elmokit.training.metrics import plot_curves
from elmokit.inference.similar import plot_occurrences
from elmokit.tasks.report import plot_layer_weights, plot_probes

out = Path(sys.argv[1])
def forbidden(*args, **kwargs):
    raise AssertionError("matplotlib.use was called")
matplotlib.use = forbidden
(out / "metrics.jsonl").write_text('{"tokens": 10, "loss": 5.0}\n'
                                   '{"tokens": 20, "valid_forward_ppl": 9.0, "valid_backward_ppl": 8.0, "valid_ppl": 8.5}\n')
plot_curves(out / "metrics.jsonl", out / "curves.png")
plot_occurrences(out / "similar.png", np.array([[0.0, 1.0], [1.0, 0.0]]), ["a", "other"], np.zeros(2), "t")
plot_layer_weights([[[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]], "t", out / "weights.png")
layer = {"dev": 90.0, "test": 89.0, "accuracy_covered": 60.0}
plot_probes({"pos": {"layer_0": layer, "layer_1": layer},
             "wsd": {"layer_0": layer, "layer_1": layer, "mfs": {"accuracy_covered": 50.0}}}, out / "probes.png")
backend = dict.__getitem__(matplotlib.rcParams, "backend")
print(json.dumps({"pyplot": "matplotlib.pyplot" in sys.modules,
                  "backend_chosen": backend is not rcsetup._auto_backend_sentinel}))
"""


def run_python(code: str, *args: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_every_module_changes_no_global_state():
    report = run_python(IMPORT_EVERYTHING)
    assert len(report["modules"]) > 20 and "elmokit.cli" in report["modules"]
    before, after = report["before"], report["after"]
    changed = {key: value for key, value in after["environ"].items() if before["environ"].get(key) != value}
    removed = sorted(set(before["environ"]) - set(after["environ"]))
    assert not changed and not removed, f"os.environ changed on import: set {changed}, removed {removed}"
    assert after["warnings_filters"] == before["warnings_filters"], "warnings filters changed on import"
    assert after == before
    assert report["optional"] == [], f"optional packages imported on import: {report['optional']}"
    assert report["after_keras"] == report["with_keras"], "importing elmokit.integrations.keras changed global state"


def test_plots_need_no_pyplot_and_choose_no_backend(tmp_path):
    report = run_python(PLOT_EVERYTHING, str(tmp_path))
    assert report == {"pyplot": False, "backend_chosen": False}
    for name in ("curves.png", "similar.png", "weights.png", "probes.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
