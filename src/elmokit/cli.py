"""The `elmo` command line: each subcommand is a plain function in `elmokit.commands`.

Every command module exposes `register(subcommands)`, which adds its parser and sets
`func` to the typed function that does the work. Errors are printed as one line; nothing is
half-written. Exit status: 0 done; 2 what was asked is wrong (an option, a file named or its
content: fix the command or the data); 1 the machine failed the run (a full disk or quota, an
I/O error, out of memory: the same command may succeed once that is fixed, with --resume where
the command has it); 130 interrupted.

Output: what a command computes (scores, JSON, tables) goes to stdout; what it does (files
written, counts, warnings, progress) goes to stderr through `logging` (`elmokit.progress`):
-q/--quiet leaves errors only, -v/--verbose adds detail. Both are accepted before or after the
subcommand (`elmo -q embed ...`, `elmo embed -q ...`).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import signal
import sys
import threading

from elmokit import __version__
from elmokit.commands import COMMAND_MODULES
from elmokit.extras import MissingExtraError
from elmokit.progress import configure_logging

VERBOSITY_HELP = {"verbose": "more detail on stderr (debugging messages)",
                  "quiet": "print nothing but errors on stderr: no progress, no messages (results still "
                           "go to stdout)"}


def add_verbosity_arguments(parser: argparse.ArgumentParser, top: bool) -> None:
    """-v/--verbose and -q/--quiet, on `elmo` itself (`top`) and on every subcommand; a
    subcommand's copy sets nothing when absent, so `elmo -q embed` keeps the -q."""
    group = parser.add_argument_group("output")
    default = {} if top else {"default": argparse.SUPPRESS}
    group.add_argument("-v", "--verbose", action="store_true", help=VERBOSITY_HELP["verbose"],
                       **({"default": False} if top else default))
    group.add_argument("-q", "--quiet", action="store_true", help=VERBOSITY_HELP["quiet"],
                       **({"default": False} if top else default))


def _every_parser(parser: argparse.ArgumentParser):
    """The subcommands' parsers, nested ones (`elmo task train`) included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield sub
                yield from _every_parser(sub)


def torch_version() -> str:
    import torch

    return torch.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elmo",
        description="Train ELMo biLMs on your own corpus and embed text with them.",
    )
    parser.add_argument("--version", action="version", version=f"elmokit {__version__}")
    add_verbosity_arguments(parser, top=True)
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        module.register(subcommands)
    for sub in _every_parser(parser):
        add_verbosity_arguments(sub, top=False)
    return parser


# The library's errors name an option as its Python argument (elmokit.inference.files:
# "continue it with resume=True"); the command line says its flag instead.
PYTHON_SPELLINGS = {"resume=True": "--resume", "overwrite=True": "--overwrite", "mix_parameters:": "--mix-weights:",
                    "skip_bad_lines=True": "--skip-bad-lines", "file_format='hdf5'": "--format hdf5",
                    "use_sentence_keys=False": "no --use-sentence-keys"}
# Arguments named at the start of a check ("min_count must be at least 1") or as `name=value`.
PYTHON_ARGUMENTS = re.compile(r"\b(position|word)=|\b(max_length|min_count|max_size|shard_size)(?= must)")


def as_flags(message: str) -> str:
    """`message` with the Python spellings of options (`PYTHON_SPELLINGS`, `PYTHON_ARGUMENTS`)
    written as flags."""
    for spelling, flag in PYTHON_SPELLINGS.items():
        message = message.replace(spelling, flag)
    return PYTHON_ARGUMENTS.sub(lambda m: "--" + (m.group(1) or m.group(2)).replace("_", "-")
                                + (" " if m.group(1) else ""), message)


EXIT_USAGE = 2  # what was asked is wrong: the command line, a file it names, the data
EXIT_FAILED = 1  # the machine failed the run: disk, quota, I/O, memory
# A failing write or read, not a wrong request.
MACHINE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.ENOMEM}


class UserError(Exception):
    """An error in what the user asked for; printed without a traceback."""


def one_line(error: BaseException) -> str:
    """The error's message on one line (a library's message may span several)."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


def out_of_memory(error: BaseException) -> bool:
    """An allocation that failed: Python's MemoryError, or torch's CPU or CUDA allocator."""
    return isinstance(error, MemoryError) or any(text in str(error) for text in ("can't allocate memory",
                                                                               "out of memory"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose and args.quiet:
        print(f"elmo {args.command}: error: give -v/--verbose or -q/--quiet, not both", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(-1 if args.quiet else 1 if args.verbose else 0, prefix=f"elmo {args.command}")
    logging.getLogger("elmokit.cli").debug(f"elmokit {__version__}, torch {torch_version()}, Python "
                                           f"{sys.version.split()[0]}; arguments "
                                           f"{ {name: value for name, value in vars(args).items() if name != 'func'} }")
    previous = _sigterm_as_interrupt()
    try:
        return args.func(args) or 0
    except BrokenPipeError:  # `elmo ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except (UserError, OSError, ValueError, MissingExtraError) as error:  # OSError: a missing file, an output in use, a full disk
        message = error.as_flags() if hasattr(error, "as_flags") else one_line(error)  # TaskOptionError
        print(f"elmo {args.command}: error: {as_flags(one_line(message))}", file=sys.stderr)
        return EXIT_FAILED if getattr(error, "errno", None) in MACHINE_ERRNOS else EXIT_USAGE
    except (MemoryError, RuntimeError) as error:
        if not out_of_memory(error):
            raise
        print(f"elmo {args.command}: error: out of memory, ask for less at once (a smaller --batch-size or "
              f"sizes): {one_line(error)[:300]}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as interrupt:
        detail = f": {interrupt}" if str(interrupt) else ""
        print(f"elmo {args.command}: interrupted{detail}", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _sigterm_as_interrupt():
    """SIGTERM (kill, a batch scheduler) stops every command as Ctrl-C does, so that what Ctrl-C
    cleans up (temporary files, locks, a half-made run) is cleaned up; commands that stop more
    gracefully install their own handler inside (elmo train, elmo embed, elmo serve). Returns the
    handler it replaced (None off the main thread, where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    return signal.signal(signal.SIGTERM, stop)


if __name__ == "__main__":
    sys.exit(main())
