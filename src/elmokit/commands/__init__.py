"""Subcommands of `elmo`, one module each; `elmokit.cli` lists them here, in help order."""

from elmokit.commands import convert, embed, info

COMMAND_MODULES = [embed, info, convert]
