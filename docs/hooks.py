"""MkDocs hooks: pages generated at build time, so that they cannot drift from their source.

* `cli.md`: the command-line reference, the `--help` text of `elmo` and of every subcommand
  (sub-subcommands included), read from the argparse parsers of `elmokit.cli.build_parser()`.
* `index.md` and `quickstart.md`: sections of README.md, named in `README_PAGES`; a section that
  is no longer in the README stops the build.

Run as a script (`python docs/hooks.py`) to print the CLI reference.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
HELP_WIDTH = 100  # columns of the --help texts (argparse would take the terminal's)

# page -> (title, the README sections it shows, by the start of their "## " heading; "" = the
# text before the first section)
README_PAGES = {
    "index.md": ("elmokit", ["", "The built-in model"]),
    "quickstart.md": ("Quick start", ["Set up and run", "Python API", "Command line", "Training on your own corpus"]),
}
SITE_MAP = """## This site

* [Quick start](quickstart.md): set up, embed from Python and from the command line, train.
* [Loading published models](loading.md): names, URLs, mirrors, the cache, TF-Hub, [ELMoForManyLangs](manylangs.md).
* [Python API](api.md): every public class and function, from the docstrings.
* [Command line](cli.md): the `--help` of every `elmo` command.
* [File formats](formats.md): the native and the original model files, and how bilm-tf and AllenNLP read every key.
* [Migrating](migrating.md) from AllenNLP, bilm-tf and TF-Hub.
* [Tasks](tasks.md): train, evaluate and use task models; [Serving](serve.md): `elmo serve`, ELMo over HTTP;
  [Deployment](deployment.md): ELMo outside Python, one ONNX graph for onnxruntime.
* [Training](training.md) a biLM on your own corpus, and [task results](results.md).
"""


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(one-line help, parser) of each subcommand of `parser`, in the order `--help` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # an alias maps to the same parser
                    seen.add(id(sub))
                    yield helps.get(name) or "", sub


def help_text(parser: argparse.ArgumentParser) -> str:
    """`parser.format_help()` at `HELP_WIDTH` columns, whatever the terminal."""
    formatter_class = parser.formatter_class
    parser.formatter_class = functools.partial(formatter_class, width=HELP_WIDTH)
    try:
        return parser.format_help().rstrip()
    finally:
        parser.formatter_class = formatter_class


def cli_parser() -> argparse.ArgumentParser:
    """The `elmo` parser: `build_parser()` of the module that pyproject.toml's `elmo` script names."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the docs extra brings tomli
        import tomli as tomllib

    pyproject = tomllib.loads((README.parent / "pyproject.toml").read_text(encoding="utf-8"))
    module_name = pyproject["project"]["scripts"]["elmo"].split(":")[0]
    return importlib.import_module(module_name).build_parser()


def cli_reference() -> str:
    """The Markdown of the CLI reference page."""
    root = cli_parser()
    pages, index = [], []

    def visit(parser: argparse.ArgumentParser, summary: str, depth: int) -> None:
        anchor = parser.prog.replace(" ", "-")
        index.append(f"{'    ' * max(depth - 1, 0)}* [`{parser.prog}`](#{anchor})"
                     + (f": {summary}" if summary else ""))
        pages.append(f"{'#' * (2 + max(depth - 1, 0))} `{parser.prog}` {{#{anchor}}}\n\n```text\n{help_text(parser)}\n```\n")
        for sub_summary, sub in subcommands(parser):
            visit(sub, sub_summary, depth + 1)

    visit(root, "", 0)
    return ("# Command line\n\n"
            "Generated at build time from elmokit's argparse parsers: the text `--help` prints.\n\n"
            + "\n".join(index[1:]) + "\n\n" + "\n".join(pages))


def readme_sections(text: str) -> dict[str, str]:
    """README's "## " sections by heading ("" for the text before the first), headings kept."""
    parts = re.split(r"^(?=## )", text, flags=re.MULTILINE)
    sections = {"": re.sub(r"\A# .*\n", "", parts[0]).strip() + "\n"}
    for part in parts[1:]:
        sections[part.splitlines()[0][3:].strip()] = part.strip() + "\n"
    return sections


def readme_page(title: str, wanted: list[str]) -> str:
    sections = readme_sections(README.read_text(encoding="utf-8"))
    chosen = []
    for start in wanted:
        found = [heading for heading in sections if heading.startswith(start) and (start or heading == "")]
        if len(found) != 1:
            raise ValueError(f"README.md has {len(found)} sections whose heading starts with {start!r} "
                             f"(docs/hooks.py README_PAGES wants one): {list(sections)}")
        chosen.append(sections[found[0]])
    return (f"# {title}\n\n<!-- generated from README.md by docs/hooks.py -->\n\n" + "\n".join(chosen))


def on_files(files, config):
    """Add the generated pages to the site (MkDocs hook)."""
    from mkdocs.structure.files import File

    generated = {"cli.md": cli_reference()}
    generated.update({page: readme_page(title, wanted) for page, (title, wanted) in README_PAGES.items()})
    generated["index.md"] += "\n" + SITE_MAP
    for src_uri, content in generated.items():
        if files.get_file_from_path(src_uri) is not None:
            raise ValueError(f"docs/{src_uri} exists, but docs/hooks.py generates that page")
        files.append(File.generated(config, src_uri, content=content))
    return files


if __name__ == "__main__":
    print(cli_reference())
