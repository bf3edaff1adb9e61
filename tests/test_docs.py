"""The documentation site (mkdocs.yml, docs/) builds in strict mode, so a broken reference, a
docstring mkdocstrings cannot read or a page left out of the nav fails the test suite, and so CI.
The `docs` extra (in `test`) brings mkdocs and mkdocstrings."""

from __future__ import annotations

import html
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_builds_in_strict_mode(tmp_path):
    result = mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    site = tmp_path / "site"
    assert (site / "index.html").is_file()
    for page in ("quickstart", "api", "cli", "formats", "migrating", "training", "results"):
        assert (site / page / "index.html").is_file(), page

    # the CLI reference holds the --help text of every parser, sub-subcommands included
    hooks = load_hooks()
    cli_page = html.unescape((site / "cli" / "index.html").read_text(encoding="utf-8"))
    parsers, stack = [], [hooks.cli_parser()]
    while stack:
        parser = stack.pop()
        parsers.append(parser.prog)
        assert hooks.help_text(parser) in cli_page, parser.prog
        stack.extend(sub for _, sub in hooks.subcommands(parser))
    assert {"elmo", "elmo embed", "elmo prepare", "elmo task train", "elmo task probe"} <= set(parsers)

    # the API reference is rendered from the docstrings, through the top-level names
    api_page = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("Elmo", "ElmoEmbedder", "HubElmo", "batch_to_ids", "load_model", "ScalarMix"):
        assert f"elmokit.{name}" in api_page, name
    assert "All L+1 layers of every token" in api_page  # ElmoEmbedder's docstring


def test_a_broken_reference_fails_the_strict_build(tmp_path):
    """The check above can fail: a reference to a name elmokit does not have stops the build."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# API\n\n::: elmokit.NoSuchName\n", encoding="utf-8")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"site_name: t\ndocs_dir: {tmp_path / 'docs'}\nplugins:\n  - mkdocstrings:\n"
                      f"      handlers:\n        python:\n          paths: [{REPO / 'src'}]\n", encoding="utf-8")
    result = mkdocs_build(config, tmp_path / "site")
    assert result.returncode != 0
    assert "elmokit.NoSuchName" in result.stdout + result.stderr


def test_readme_pages_fail_on_a_missing_section():
    hooks = load_hooks()
    assert "## Set up and run" in hooks.readme_page("Quick start", ["Set up and run"])
    with pytest.raises(ValueError, match="No such section"):
        hooks.readme_page("x", ["No such section"])


def test_links_work_in_the_repository_too():
    """A relative link in README.md or docs/*.md points at a file of the repository, not only at a
    page the site's build writes (cli.md, index.md, quickstart.md exist only on the site)."""
    import re

    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code blocks
        text = re.sub(r"`[^`\n]*`", "", text)  # inline code
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z]+:", path) and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, "links to files that are not in the repository:\n" + "\n".join(broken)
