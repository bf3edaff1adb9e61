"""Subcommands of `elmo`, one module each; `elmokit.cli` lists them here, in help order."""

from elmokit.commands import convert, embed, info, prepare, similar, task, train, vocab

COMMAND_MODULES = [prepare, vocab, train, embed, similar, info, convert, task]
