"""Subcommands of `elmo`, one module each; `elmokit.cli` lists them here, in help order."""

from elmokit.commands import (convert, demo, download, embed, export, info, perplexity, prepare, serve,
                              similar, task, train, vocab)

COMMAND_MODULES = [demo, prepare, vocab, train, perplexity, export, embed, similar, info, convert, download, serve, task]
