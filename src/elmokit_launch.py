"""The `elmo` command's start: OpenMP's wait policy first, then `elmokit.cli.main`.

torch runs its CPU products on an OpenMP thread pool (GNU OpenMP in the Linux wheels; Intel's in
some builds). By default a thread that has done its share of one product spins, waiting for the
next, before it sleeps. Alone on a machine that saves a wake-up; beside other processes the
spinning threads take cores from them, and they from the threads torch is waiting for
(bench/results/threads.md). The `elmo` command therefore asks OpenMP to sleep at once
(`WAIT_POLICY`), unless the user set any of those variables (theirs is kept, whole).

Why a module of its own, outside the elmokit package: OpenMP reads these variables once, when
torch loads it (GNU OpenMP) or starts its pool (Intel's), and importing anything in elmokit
imports torch. Only the command sets them, in its own process, before that import: importing
elmokit as a library changes no environment variable (tests/test_imports.py). `elmo serve`'s
model process inherits them. `python -m elmokit` starts without them; `python -m elmokit_launch`
is the command's start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

# GNU OpenMP: OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT=0 (no spinning); Intel OpenMP: KMP_BLOCKTIME=0.
WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}


def set_wait_policy(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Put `WAIT_POLICY` in `environ` unless any of its variables is there already (the user's
    choice). Returns whether it did."""
    if any(name in environ for name in WAIT_POLICY):
        return False
    environ.update(WAIT_POLICY)
    return True


def build_parser():
    """The command's parser (`elmokit.cli.build_parser`, imported only when asked: the docs read it)."""
    from elmokit.cli import build_parser as elmo_parser

    return elmo_parser()


def main() -> int:
    """The `elmo` console script: the wait policy, then the command line (torch is imported here)."""
    set_wait_policy()
    from elmokit.cli import main as elmo_main

    return elmo_main()


if __name__ == "__main__":
    sys.exit(main())
