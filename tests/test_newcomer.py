"""What a newcomer tripped on (issue 39 point 6): the built-in model's name in `elmo export`, a
task run that ends predicting one class, `elmo embed`'s rate on small runs, docstrings citing a
spec that is not in the repository."""

from __future__ import annotations

import re

from tests.conftest import REPO


def test_no_docstring_cites_the_spec_by_section_number():
    """The spec (../shared/spec) is not part of a clone: "spec §9" means nothing to a reader."""
    cited = [f"{path.relative_to(REPO)}:{number}" for path in sorted((REPO / "src").rglob("*.py"))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"spec §|§\s*\d", line) and "Peters et al." not in line]
    assert not cited, f"say what is meant instead of the section number: {cited}"
