"""The README quotes tables that programs write (bench/results/*.md, docs/results.md) through
scripts/sync_pages.py: the quoted copies must equal their sources, so no figure is typed by hand."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _sync_module():
    spec = importlib.util.spec_from_file_location("sync_pages", REPO / "scripts" / "sync_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_tables_equal_their_sources():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "sync_pages.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_hand_edited_figure_is_caught():
    sync = _sync_module()
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert "<!-- table: bench/results/train.md 1 -->" in text
    block_start = text.index("<!-- table: bench/results/train.md 1 -->")
    row = text.index("| gutenberg-cpu |", block_start)
    edited = text[:row] + text[row:].replace("| gutenberg-cpu |", "| gutenberg-cpu (edited) |", 1)
    assert sync.synced(edited) == text != edited
