"""Mutation testing of the core semantics: change one line of the library at a time and run the
tests that cover it; a mutant the tests do not fail on "survived" (issue 32, point 3).

    .venv/bin/python scripts/mutation.py                      # every mutant -> bench/results/mutation.md
    .venv/bin/python scripts/mutation.py --only cell --output /tmp/mutation.md

Each mutant is one exact text replacement in one file of src/elmokit (it must occur once: a
mutant whose line has changed is reported as stale, not skipped silently). The mutants run in a
copy of the repository (src/ and tests/, made in a temporary folder beside a link to ../shared),
never in the working tree, so that other work in the tree never sees a mutated file. A mutant is
killed when its tests fail (pytest's exit status 1); any other status is reported as it is.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str  # what the mutant changes, in words
    path: str  # under src/elmokit
    old: str
    new: str
    tests: tuple[str, ...]  # test files (or node ids) that cover the line


CELL_TESTS = ("tests/test_cell.py", "tests/test_fixture.py")
MUTANTS = [
    # the cell (model/cell.py): every driver runs these lines
    Mutant("cell: forget and input gates swapped", "model/cell.py",
           "torch.mul(forget_gate, cell_prev, out=cell_next).addcmul_(input_gate, candidate)",
           "torch.mul(input_gate, cell_prev, out=cell_next).addcmul_(forget_gate, candidate)", CELL_TESTS),
    Mutant("cell: cell clip removed", "model/cell.py", "    clip_(cell, cell_clip)\n", "\n", CELL_TESTS),
    Mutant("cell: every clip twice as wide", "model/cell.py", "values.clamp_(-limit, limit) if limit",
           "values.clamp_(-2 * limit, 2 * limit) if limit", CELL_TESTS),
    Mutant("cell: forget-gate offset 0", "model/cell.py", "FORGET_BIAS = 1.0", "FORGET_BIAS = 0.0", CELL_TESTS),
    Mutant("cell: m = o * c (no tanh)", "model/cell.py",
           "tanh_of_cell = tanh(cell, out=tanh_cell if tanh_cell is not None else cell_output)",
           "tanh_of_cell = cell", CELL_TESTS),
    Mutant("cell: the doubled candidate's tanh off by a half", "model/cell.py",
           ".mul_(2).sub_(1)  # the candidate's slot", ".mul_(2).sub_(0.5)  # the candidate's slot", CELL_TESTS),
    Mutant("stack: residual adds the undropped input", "model/cell.py",
           "output = output + dropped  # residual", "output = output + layer_input  # residual", CELL_TESTS),
    Mutant("stack: no residual on layer 2", "model/cell.py", "        if index > 0:\n", "        if index > 1:\n",
           CELL_TESTS),
    Mutant("stack: dropout on layer 0 only", "model/cell.py",
           "if dropout and training else layer_input", "if dropout and training and index == 0 else layer_input",
           CELL_TESTS),
    # the drivers: what each passes to the cell
    Mutant("engine: projection clip removed", "inference/engine.py",
           "hidden = lstm_cell.clip_(outputs[:, step], proj_clip)", "hidden = outputs[:, step]", CELL_TESTS),
    Mutant("engine: cell clip removed", "inference/engine.py",
           "cell[d], cell_clip, cell_next=cell[d]", "cell[d], 0.0, cell_next=cell[d]", CELL_TESTS),
    Mutant("engine: the candidate's bias not doubled", "inference/engine.py",
           "bias = (layer.gate_bias().to(inputs.dtype) * candidate_doubled(layer).to(inputs.dtype)",
           "bias = (layer.gate_bias().to(inputs.dtype)", CELL_TESTS),
    Mutant("engine, bfloat16: the gates not widened to float32", "inference/engine.py",
           "                if mixed:\n                    gates = wide_gates.copy_(gates)\n", "",
           ("tests/test_cell.py", "tests/test_precision.py")),
    Mutant("step loop: projection clip removed", "model/lstm.py",
           "hidden = lstm_cell.clip_(torch.bmm(cell_output, projection), proj_clip)",
           "hidden = torch.bmm(cell_output, projection)", CELL_TESTS),
    Mutant("step loop: the cell clip is the projection's", "model/lstm.py",
           "self.cell_clip, self.proj_clip)\n            return output, (hidden, cell)",
           "self.proj_clip, self.proj_clip)\n            return output, (hidden, cell)", CELL_TESTS),
    Mutant("recurrence: the projection clipped with the cell clip", "training/recurrence.py",
           "out=step_hiddens[step + 1]), proj_clip)", "out=step_hiddens[step + 1]), cell_clip)",
           ("tests/test_cell.py", "tests/test_lm.py")),
    Mutant("recurrence: no forget-gate offset", "training/recurrence.py",
           "layer.recurrent_weight, layer.gate_bias(),", "layer.recurrent_weight, layer.bias,",
           ("tests/test_cell.py", "tests/test_lm.py")),
    Mutant("recurrence backward: the forget gate's factor without c_{t-1}", "training/recurrence.py",
           "cells[:, :-1] * forget_gate * (1 - forget_gate)", "forget_gate * (1 - forget_gate)", ("tests/test_lm.py",)),
    # the language model and its recipe
    Mutant("LM: no dropout before the softmax", "training/lm.py",
           "hidden = F.dropout(hidden, self.dropout, self.training)  # (D, B, U, P)", "pass",
           ("tests/test_cell.py",)),
    Mutant("sampler: n_tries off by one", "training/lm.py", "return draws[first], int(first[-1]) + 1",
           "return draws[first], int(first[-1])", ("tests/test_lm.py",)),
    Mutant("sampler: TF's P(k) K branch removed", "training/lm.py", "        if n_tries == n_samples:\n",
           "        if False:\n", ("tests/test_lm.py",)),
    Mutant("softmax: the target's gradient -0.5 instead of -1", "training/softmax.py",
           "probabilities[row_index, targets[rows]] -= 1", "probabilities[row_index, targets[rows]] -= 0.5",
           ("tests/test_softmax.py",)),
    Mutant("optimizer: Adagrad's initial accumulator dropped", "training/build.py",
           "lr=config.lr, initial_accumulator_value=config.initial_accumulator,", "lr=config.lr,",
           ("tests/test_recipe.py",)),
    Mutant("optimizer: gradient clip loosened 10x", "training/loop.py",
           "clip_grad_norm_(parameters, config.grad_clip)", "clip_grad_norm_(parameters, 10 * config.grad_clip)",
           ("tests/test_recipe.py",)),
    Mutant("perplexity: the mean of the two perplexities", "training/loop.py",
           '"ppl": math.exp(0.5 * (forward + backward))', '"ppl": 0.5 * (math.exp(forward) + math.exp(backward))',
           ("tests/test_recipe.py",)),
    Mutant("init: relu filters normal", "model/bilm.py", 'if cnn.activation == "relu":', 'if cnn.activation == "x":',
           ("tests/test_recipe.py",)),
    Mutant("devices: torch.device('mps') accepted", "devices.py",
           'device.type not in ("cpu", "cuda")', 'device.type not in ("cpu", "cuda", "mps")',
           ("tests/test_recipe.py",)),
    Mutant("seeds: NumPy's generator not seeded", "training/processes.py", "    np.random.seed(seed)\n", "\n",
           ("tests/test_recipe.py",)),
    # what surrounds the LSTM
    Mutant("Elmo: no dropout", "inference/elmo.py", "representations.append(self.dropout(mixed)",
           "representations.append((mixed)", ("tests/test_cell.py",)),
    Mutant("chars: end-of-word written as begin-of-word", "model/chars.py",
           "ids[np.arange(n), kept + 1] = END_OF_WORD", "ids[np.arange(n), kept + 1] = BEGIN_OF_WORD",
           ("tests/test_chars.py", "tests/test_fixture.py")),
    Mutant("layer norm: unbiased variance", "model/mix.py", "variance = (((masked - mean) * mask) ** 2).sum() / count",
           "variance = (((masked - mean) * mask) ** 2).sum() / (count - 1)", ("tests/test_elmo.py", "tests/test_model.py")),
    Mutant("mix: weights not normalised", "model/mix.py", "torch.softmax(", "torch.sigmoid(",
           ("tests/test_model.py", "tests/test_elmo.py")),
]


def _copy_repository(root: Path) -> Path:
    """src/ and tests/ of the working tree under root/repo, with root/shared -> ../shared."""
    repo = root / "repo"
    for part in ("src", "tests"):
        shutil.copytree(REPO / part, repo / part, ignore=shutil.ignore_patterns("__pycache__"))
    shared = REPO.parent / "shared"
    if shared.exists():
        (root / "shared").symlink_to(shared)
    return repo


def run_mutant(repo: Path, mutant: Mutant, timeout: int) -> tuple[str, float]:
    """'killed', 'SURVIVED', 'stale' (the line is not there once), 'timeout' or 'error (rc N)'."""
    path = repo / "src" / "elmokit" / mutant.path
    source = path.read_text(encoding="utf-8")
    if source.count(mutant.old) != 1:
        return "stale", 0.0
    path.write_text(source.replace(mutant.old, mutant.new), encoding="utf-8")
    start = time.perf_counter()
    try:
        returncode = _pytest(repo, mutant.tests, timeout)
        status = {0: "SURVIVED", 1: "killed"}.get(returncode, f"error (rc {returncode})")
    except subprocess.TimeoutExpired:
        status = "timeout"
    finally:
        path.write_text(source, encoding="utf-8")
    return status, time.perf_counter() - start


def _pytest(repo: Path, tests, timeout: int) -> int:
    """pytest's exit status on `tests`, run in the copy `repo` with its own src/ first on the path."""
    env = {**os.environ, "PYTHONPATH": str(repo / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                          cwd=repo, env=env, capture_output=True, timeout=timeout).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run the mutants whose name contains this")
    parser.add_argument("--timeout", type=int, default=300, help="seconds a mutant's tests may run")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "mutation.md")
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if not args.only or args.only in m.name]
    rows = []
    with tempfile.TemporaryDirectory(prefix="elmokit-mutation-") as folder:
        repo = _copy_repository(Path(folder))
        tests = sorted({test for mutant in mutants for test in mutant.tests})
        if _pytest(repo, tests, 4 * args.timeout) != 0:  # unmutated, the tests must pass
            sys.exit(f"the covering tests fail without any mutant: {' '.join(tests)}")
        for mutant in mutants:
            status, seconds = run_mutant(repo, mutant, args.timeout)
            rows.append((mutant, status, seconds))
            print(f"{status:>10}  {seconds:6.1f} s  {mutant.name}", flush=True)
    killed = sum(status == "killed" for _, status, _ in rows)
    lines = ["# Mutation testing (`scripts/mutation.py`)", "",
             f"{killed} of {len(rows)} mutants killed. Each mutant is one line of the library changed in a copy of "
             "the repository; its covering tests ran with `pytest -x` (killed = they failed).", "",
             "| mutant | file | tests | result |", "|---|---|---|---|"]
    lines += [f"| {m.name} | `{m.path}` | {', '.join(t.removeprefix('tests/') for t in m.tests)} | {status} |"
              for m, status, _ in rows]
    args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{killed}/{len(rows)} killed; wrote {args.output}")


if __name__ == "__main__":
    main()
