"""scripts/mutation.py stays true (issue 38, point 6): every mutant still matches the code exactly
once (a changed line fails here, not silently on the page), a stale mutant fails the run, mutants
run in a copy whose own src/ is imported with nothing beside it (no ../shared), and
bench/results/mutation.md is the script's page for exactly these mutants, with no survivor that is
not argued equivalent."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("elmokit_mutation_script", REPO / "scripts" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


mutation = load_script()


def test_every_mutant_matches_the_code_exactly_once():
    assert mutation.stale_mutants(REPO / "src" / "elmokit", mutation.MUTANTS) == []


def test_a_mutant_whose_text_changed_fails_the_run(tmp_path):
    (tmp_path / "maths.py").write_text("def double(x):\n    return 2 * x  # twice\n\n# 2 * x\n")
    mutants = [mutation.Mutant("absent", "maths.py", "3 * x", "4 * x", ()),
               mutation.Mutant("twice", "maths.py", "2 * x", "3 * x", ()),
               mutation.Mutant("no change", "maths.py", "# twice", "# twice", ()),
               mutation.Mutant("fine", "maths.py", "return 2 * x", "return 3 * x", ()),
               mutation.Mutant("fine", "other.py", "a", "b", ())]
    problems = mutation.stale_mutants(tmp_path, mutants)
    assert [problem.split(":")[0] for problem in problems] == [
        "'absent'", "'twice'", "'no change'", "'fine'", "'fine'"], problems
    assert "occurs 0 times" in problems[0] and "occurs 2 times" in problems[1] and "used twice" in problems[3]
    assert "other.py does not exist" in problems[4]
    with pytest.raises(SystemExit, match="5 mutant\\(s\\) no longer match the code"):
        mutation.require_fresh(tmp_path, mutants)
    mutation.require_fresh(tmp_path, [mutants[3]])  # a mutant that matches once passes


def test_the_mutants_cover_the_new_code_each_with_existing_tests():
    mutants = mutation.MUTANTS
    assert len(mutants) >= 60
    files = {mutant.path for mutant in mutants}
    for covered in ("serve/recurrence.py", "serve/inputs.py", "serve/app.py", "inference/onnx_export.py", "hub.py",
                    "sources/download.py", "sources/cache.py", "sources/tfhub.py", "model/tf_bundle.py",
                    "model/manylangs.py", "model/manylangs_files.py", "tasks/confidence.py", "inference/engine.py",
                    "inference/layers.py", "model/cell.py", "integrations/keras.py", "integrations/texts.py",
                    "training/checkpoint.py", "training/loop.py"):
        assert covered in files, covered
    assert sum(mutant.name.startswith("engine reset") for mutant in mutants) >= 2
    for mutant in mutants:
        assert mutant.tests, mutant.name
        for test in mutant.tests:
            path, _, function = test.partition("::")
            source = (REPO / path).read_text(encoding="utf-8")
            assert not function or re.search(rf"^def {re.escape(function)}\(", source, re.M), (mutant.name, test)


FAKE_TEST = """from elmokit.maths import double


def test_double():
    assert double(3) == 6
"""


def test_a_mutant_runs_in_a_copy_that_imports_its_own_src_and_has_nothing_beside_it(tmp_path):
    """A small repository: the copy is made without git's help, imports its own `elmokit` (not the
    one installed for these tests), a mutant its test catches is killed, one it cannot see
    survives, the copy's file is restored after each, and the original is never touched."""
    original = tmp_path / "original"
    (original / "src" / "elmokit").mkdir(parents=True)
    (original / "tests").mkdir()
    (original / "src" / "elmokit" / "__init__.py").write_text("")
    maths = original / "src" / "elmokit" / "maths.py"
    maths.write_text("def double(x):\n    return 2 * x  # twice\n")
    (original / "tests" / "test_maths.py").write_text(FAKE_TEST)
    (original / "pyproject.toml").write_text("")
    (tmp_path / "shared").mkdir()  # ../shared beside the original: not beside the copy

    copy = mutation.copy_repository(original, tmp_path / "work")
    assert sorted(path.name for path in (tmp_path / "work").iterdir()) == ["repo"]
    mutation.require_copy_imported(copy)
    killed = mutation.Mutant("double triples", "maths.py", "return 2 * x", "return 3 * x", ("tests/test_maths.py",))
    unseen = mutation.Mutant("comment", "maths.py", "# twice", "# two times", ("tests/test_maths.py",))
    assert mutation.run_mutant(copy, killed, timeout=300)[0] == "killed"
    assert mutation.run_mutant(copy, unseen, timeout=300)[0] == "SURVIVED"
    assert (copy / "src" / "elmokit" / "maths.py").read_text() == maths.read_text()
    assert maths.read_text() == "def double(x):\n    return 2 * x  # twice\n"


def test_the_page_argues_each_survivor_and_counts_right():
    argued = mutation.Mutant("argued", "a.py", "x", "y", ("tests/t.py",), equivalent="only the speed differs")
    plain = mutation.Mutant("plain", "a.py", "x", "y", ("tests/t.py",))
    rows = [(plain, "killed", 1.0), (argued, "SURVIVED", 1.0), (plain, "SURVIVED", 1.0), (argued, "timeout", 9.0)]
    text = mutation.page(rows, ["- `python scripts/mutation.py` at abc1234: 4 mutants; unmutated, their tests: "
                                "3 passed; 2 min."])
    assert "4 mutants: 1 killed, 1 survived and argued equivalent below, 1 survived unargued, 1 not run, timed out or errored." in text
    assert "| argued | `a.py` | t.py | equivalent |" in text and "| plain | `a.py` | t.py | SURVIVED |" in text
    assert "- **argued** (`a.py`): only the speed differs" in text
    assert "- `python scripts/mutation.py` at abc1234: 4 mutants" in text


def test_an_update_keeps_the_rows_it_does_not_run(tmp_path):
    """`--update` reads an earlier page back: each mutant's result, and its lines of runs."""
    argued = mutation.Mutant("argued", "a.py", "x", "y", ("tests/t.py",), equivalent="only the speed differs")
    plain = mutation.Mutant("plain", "a.py", "x", "y", ("tests/t.py",))
    path = tmp_path / "mutation.md"
    runs = ["- `python scripts/mutation.py` at abc: 2 mutants."]
    path.write_text(mutation.page([(plain, "killed", 1.0), (argued, "SURVIVED", 1.0)], runs))
    assert mutation.read_page(path) == ({"plain": "killed", "argued": "equivalent"}, runs)


def test_a_merge_takes_the_newer_pages_rows_and_keeps_the_others(tmp_path, monkeypatch):
    first, second = (mutation.Mutant(name, "a.py", "x", "y", ("tests/t.py",)) for name in ("first", "second"))
    monkeypatch.setattr(mutation, "MUTANTS", [first, second])
    older, newer = tmp_path / "mutation.md", tmp_path / "newer.md"
    older.write_text(mutation.page([(first, "SURVIVED", 1.0), (second, "killed", 1.0)], ["- `python scripts/mutation.py` at a."]))
    newer.write_text(mutation.page([(first, "killed", 1.0)], ["- `python scripts/mutation.py --only first` at b."]))
    mutation.merge_pages(older, newer)
    assert mutation.read_page(older) == ({"first": "killed", "second": "killed"},
                                         ["- `python scripts/mutation.py` at a.", "- `python scripts/mutation.py --only first` at b."])
    assert "2 mutants: 2 killed, 0 survived and argued equivalent below, 0 survived unargued." in older.read_text()


def test_the_committed_page_is_the_scripts_for_these_mutants():
    """bench/results/mutation.md lists exactly the mutants of the script, in order, each killed or
    argued equivalent (with the argument the script holds), and its counts add up."""
    text = (REPO / "bench" / "results" / "mutation.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (.+?) \| `(.+?)` \| (.*?) \| (\S+) \|$", text, re.M)
    assert [name for name, *_ in rows] == [mutant.name for mutant in mutation.MUTANTS]
    results = [result for *_, result in rows]
    assert set(results) <= {"killed", "equivalent"}, [row for row in rows if row[3] not in ("killed", "equivalent")]
    for mutant, result in zip(mutation.MUTANTS, results):
        if result == "equivalent":
            assert mutant.equivalent and f"- **{mutant.name}** (`{mutant.path}`): {mutant.equivalent}" in text
    assert (f"{len(rows)} mutants: {results.count('killed')} killed, {results.count('equivalent')} survived and "
            f"argued equivalent below, 0 survived unargued.") in text
