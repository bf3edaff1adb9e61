"""What a training run reports: `metrics.jsonl` lines, on the progress bar (`elmokit.progress`)
and in `curves.png`.

metrics.jsonl holds one JSON object a line: every `log_every` steps
    {"step", "tokens", "epoch", "loss", "lr", "grad_norm", "tokens_per_s"}
(loss = mean training loss of the steps since the last line; sampled-softmax losses are not
perplexities), and at every evaluation
    {"step", "tokens", "epoch", "valid_forward_ppl", "valid_backward_ppl", "valid_ppl"} (full softmax).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from elmokit.extras import require
from elmokit.io import atomic_path, atomic_write_text


class MetricsWindow:
    """Training statistics since the last log line. Saved in the checkpoint (`state_dict`), so
    that a run stopped between two lines and resumed writes the next line over the same steps as
    an uninterrupted run (its time: the seconds before the stop plus those after the resume)."""

    def __init__(self) -> None:
        self.loss, self.grad_norm, self.steps, self.tokens = 0.0, 0.0, 0, 0
        self.start = time.perf_counter()

    def state_dict(self) -> dict[str, float | int]:
        return {"loss": self.loss, "grad_norm": self.grad_norm, "steps": self.steps, "tokens": self.tokens,
                "seconds": time.perf_counter() - self.start}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.loss, self.grad_norm = float(state["loss"]), float(state["grad_norm"])
        self.steps, self.tokens = int(state["steps"]), int(state["tokens"])
        self.start = time.perf_counter() - float(state["seconds"])

    def add(self, loss: float, grad_norm: float, n_tokens: int) -> None:
        self.loss += loss
        self.grad_norm += grad_norm
        self.steps += 1
        self.tokens += n_tokens

    @contextlib.contextmanager
    def left_out(self) -> Iterator[None]:
        """Leave the time of the block (a validation, a checkpoint) out of the window's, so that
        tokens_per_s is the training's speed."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - started

    def record(self, **counters: Any) -> dict[str, Any]:
        """The log line (with `counters`: step, tokens, epoch, lr); starts a new window."""
        seconds = time.perf_counter() - self.start
        record = {**counters, "loss": self.loss / max(self.steps, 1), "grad_norm": self.grad_norm / max(self.steps, 1),
                  "tokens_per_s": self.tokens / max(seconds, 1e-9)}
        self.__init__()
        return record


def append_metrics(path: Path, record: dict[str, Any], bar) -> None:
    """Append one line to metrics.jsonl and show it on the progress bar (if any)."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
    if bar is None or not ("valid_ppl" in record or "loss" in record):
        return
    if "valid_ppl" in record:
        bar.write(f"step {record['step']}: valid perplexity {record['valid_ppl']:.2f} "
                  f"(forward {record['valid_forward_ppl']:.2f}, backward {record['valid_backward_ppl']:.2f})")
    else:
        bar.set_postfix(step=f"{record['step']:,}", loss=f"{record['loss']:.3f}",
                        tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop the lines a killed run wrote after its last checkpoint (resuming recomputes them),
    and a last line cut short by the kill (a line is appended in one write, which a kill can still
    interrupt); a damaged line before the last is an error naming the file and the line."""
    if not path.exists():
        return
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except ValueError as error:
            if number == len(lines):  # the write a kill interrupted
                lines.pop()
                break
            raise ValueError(f"{path}, line {number}: not a JSON record ({error})") from None
    lines = [line for line, record in zip(lines, records) if record["step"] <= last_step]
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def plot_curves(metrics_path: Path, png_path: Path) -> None:
    """Training loss and validation perplexities against training tokens, as a PNG.

    Raises:
        MissingExtraError: matplotlib is not installed (the `plot` extra).
    """
    require("plot", "curves.png of elmo train")
    from matplotlib.figure import Figure  # no pyplot: no backend is chosen, none is changed

    records = read_metrics(metrics_path) if metrics_path.exists() else []
    train = [r for r in records if "loss" in r]
    valid = [r for r in records if "valid_ppl" in r]
    figure = Figure(figsize=(11, 4))
    left, right = figure.subplots(1, 2)
    left.plot([r["tokens"] for r in train], [r["loss"] for r in train], linewidth=0.8)
    left.set(xlabel="training tokens", ylabel="training loss (nats)", title="training")
    for key, label in (("valid_forward_ppl", "forward"), ("valid_backward_ppl", "backward"), ("valid_ppl", "average")):
        right.plot([r["tokens"] for r in valid], [r[key] for r in valid], marker="o", label=label)
    right.set(xlabel="training tokens", ylabel="perplexity (full softmax)", title="validation")
    if valid:
        right.set_yscale("log")
        right.legend()
    figure.tight_layout()
    with atomic_path(png_path) as tmp:
        figure.savefig(tmp, format="png", dpi=100)
