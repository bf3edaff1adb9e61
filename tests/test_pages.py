"""The README quotes tables that programs write (bench/results/*.md, docs/results.md) through
scripts/sync_pages.py: the quoted copies must equal their sources, so no figure is typed by hand."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _script_module(name: str):
    """scripts/NAME.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sync_module():
    return _script_module("sync_pages")


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


def test_model_table_rows_from_a_directory_and_from_a_record(tmp_path):
    """A model block lists the shipped model (read from its directory) and a replaced one (its JSON
    record): a row each, the record's figures as recorded."""
    sync = _sync_module()
    record = tmp_path / "old.json"
    facts = sync.model_facts(REPO / "src/elmokit/models/gutenberg-en", "`old` v0")
    facts["test_ppl"] = {**facts["test_ppl"], "ppl": 999.25}
    record.write_text(json.dumps(facts), encoding="utf-8")
    table = sync.model_table(f"src/elmokit/models/gutenberg-en {record}")
    header, rule, shipped, old = table.splitlines()
    assert header.startswith("| model |") and shipped.startswith("| `gutenberg-en`") and old.startswith("| `old` v0 |")
    assert "**999.2**" in old and "**999.2**" not in shipped


def test_record_keeps_a_models_row(tmp_path):
    """--record writes the facts of a model directory; the row from the record is the directory's row."""
    record = tmp_path / "models" / "v1.json"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "sync_pages.py"), "--record",
                             str(REPO / "src/elmokit/models/gutenberg-en"), str(record), "`kept`"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    sync = _sync_module()
    version = json.loads((REPO / "src/elmokit/models/gutenberg-en/provenance.json").read_text())["version"]
    shipped = sync.model_table("src/elmokit/models/gutenberg-en")
    assert f"| `gutenberg-en` {version} |" in shipped
    assert sync.model_table(str(record)) == shipped.replace(f"`gutenberg-en` {version}", "`kept`")
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "sync_pages.py"), "--record", str(record)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr


def test_the_results_pages_say_which_builtin_model_made_them():
    """docs/results.md (quoted in the README) comes from task runs with one biLM; a new version of
    the built-in model keeps its path, so results.json records the weights' fingerprint and the
    card's version (pages written before the record existed were all made with v1). Either the
    results were made with the model that ships, or both pages say, in bold, that they were not."""
    import json

    from elmokit.model.builtin import builtin_model_dir
    from elmokit.sources.loading import load_model
    from elmokit.model.weights import model_fingerprint

    results = json.loads((REPO / "docs" / "results.json").read_text(encoding="utf-8"))
    shipped = json.loads((builtin_model_dir() / "provenance.json").read_text(encoding="utf-8")).get("version", "v1")
    record = results.get("bilm") or {"builtin": True, "version": "v1", "fingerprint": None}
    pages = [(REPO / name).read_text(encoding="utf-8") for name in ("README.md", "docs/results.md")]
    assert record["builtin"], "docs/results.md must be made with the built-in model (scripts/task_results.py)"
    if record["version"] != shipped:
        for page in pages:
            assert (f"**These results were made with `gutenberg-en` {record['version']}, the built-in model "
                    f"before {shipped} replaced it") in page
        return
    for page in pages:
        assert f"made with the built-in model that ships (`gutenberg-en` {shipped})" in page
    if record["fingerprint"] is not None:
        assert record["fingerprint"] == model_fingerprint(load_model(builtin_model_dir()))[:16], (
            "docs/results.md was made with other weights than the built-in model's: rerun scripts/task_results.py")
        assert f"weights fingerprint `{record['fingerprint']}`" in pages[1]


def _demo_page_module():
    return _script_module("demo_page")


def test_the_demo_record_is_what_elmo_demo_prints_now():
    """docs/results/demo.txt (quoted in the README with its reading) is the output of `elmo demo`
    with the model that ships: the same ranking at every layer, cosines within 1e-3."""
    demo_page = _demo_page_module()
    recorded = demo_page.ranked(demo_page.RECORD.read_text(encoding="utf-8"))
    fresh = demo_page.ranked(demo_page.run_demo())
    assert sorted(recorded) == sorted(fresh) == [0, 1, 2]
    for layer in fresh:
        assert [line for line, _ in recorded[layer]] == [line for line, _ in fresh[layer]], layer
        for (_, old), (_, new) in zip(recorded[layer], fresh[layer]):
            assert abs(old - new) < 1e-3, (layer, old, new)


def test_the_demo_reading_follows_the_ranking():
    """The README's sentence is computed from the ranks: another ranking gives another sentence."""
    demo_page = _demo_page_module()
    output = demo_page.RECORD.read_text(encoding="utf-8")
    assert "sport or game, sport or game" in demo_page.reading(output)
    theatre_first = output.replace("line 1: The children", "line 9: The children")  # every layer
    assert demo_page.reading(theatre_first) != demo_page.reading(output)
    assert "not always a sport sense" in demo_page.reading(theatre_first)
    sync = _sync_module()
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert sync.synced(text.replace("sport or game, sport or game, theatre", "sport or game, sport, theatre", 1)) == text
