"""`elmokit.model.cell`'s docstring names every driver of the LSTM cell: each module that calls the
cell's functions (found by reading the package's source) is listed there, with why it exists."""

from __future__ import annotations

import re

import elmokit.model.cell
from tests.conftest import REPO

PACKAGE = REPO / "src" / "elmokit"


def cell_drivers() -> set[str]:
    """Dotted names of the modules that import the cell module and call one of its step functions."""
    drivers = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if path.name == "cell.py" or not re.search(r"from elmokit\.model import cell|elmokit\.model\.cell import", text):
            continue
        if re.search(r"\b\w+\.(cell_step|run_layers|activate_gates|activate_doubled_gates_)\(", text):
            drivers.add(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    return drivers


def test_every_driver_of_the_cell_is_named_in_its_docstring():
    drivers = cell_drivers()
    assert {"elmokit.model.lstm", "elmokit.inference.engine", "elmokit.training.recurrence",
            "elmokit.serve.recurrence", "elmokit.inference.onnx_export"} <= drivers  # the search finds them
    doc = elmokit.model.cell.__doc__
    missing = sorted(name for name in drivers if name not in doc)
    assert not missing, f"drivers of the cell not named in model/cell.py's docstring: {missing}"
    for graphs in ("elmokit.inference.cuda_graphs", "elmokit.training.cuda_graphs"):  # replay drivers' code
        assert graphs in doc
