"""Subcommands of `elmo`, one module each; `elmokit.cli` lists them here, in help order."""

from elmokit.commands import convert, embed, info, prepare, vocab

COMMAND_MODULES = [prepare, vocab, embed, info, convert]
