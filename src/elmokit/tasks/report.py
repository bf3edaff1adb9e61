"""Plots for task results and probes, written atomically as PNG.

matplotlib (the `plot` extra) is imported at use, and only its object-oriented API
(`matplotlib.figure.Figure`): no pyplot, so no backend is chosen and none is changed.
"""

from __future__ import annotations

from pathlib import Path

from elmokit.extras import require
from elmokit.io import atomic_path


def _figure(**kwargs):
    """A new `matplotlib.figure.Figure`; MissingExtraError if matplotlib is not installed."""
    require("plot", "task and probe plots")
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def plot_layer_weights(weights: list[list[list[float]]], title: str, path: str | Path) -> None:
    """Bars of softmax(s) per layer: `weights[seed][mix][layer]`, the mean over seeds, one group a mix."""
    n_mixes, n_layers = len(weights[0]), len(weights[0][0])
    figure = _figure(figsize=(4 + n_layers, 3))
    axis = figure.subplots()
    width = 0.8 / n_mixes
    for mix in range(n_mixes):
        mean = [sum(run[mix][layer] for run in weights) / len(weights) for layer in range(n_layers)]
        axis.bar([layer + mix * width for layer in range(n_layers)], mean, width,
                 label=["input [x; ELMo]", "output [h; ELMo]"][mix] if n_mixes > 1 else None)
    axis.set_xticks([layer + (n_mixes - 1) * width / 2 for layer in range(n_layers)])
    axis.set_xticklabels([f"layer {layer}" for layer in range(n_layers)])
    axis.set_ylabel("softmax weight")
    axis.set_title(title)
    if n_mixes > 1:
        axis.legend()
    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=100)


def plot_probes(results: dict, path: str | Path) -> None:
    """Probe accuracy per layer: POS (dev, test) and WSD (1-NN on covered tokens)."""
    panels = [name for name in ("pos", "wsd") if name in results]
    figure = _figure(figsize=(4.5 * max(len(panels), 1), 3.2))
    axes = figure.subplots(1, max(len(panels), 1), squeeze=False)
    for axis, name in zip(axes[0], panels):
        layers = sorted(key for key in results[name] if key.startswith("layer_"))
        x = [int(key.split("_")[1]) for key in layers]
        if name == "pos":
            for split in ("dev", "test"):
                axis.plot(x, [results[name][key][split] for key in layers], marker="o", label=split)
            axis.set_title("linear POS probe (UD EWT)")
        else:
            axis.plot(x, [results[name][key]["accuracy_covered"] for key in layers], marker="o", label="1-NN, covered")
            axis.axhline(results[name]["mfs"]["accuracy_covered"], linestyle="--", color="gray", label="train MFS")
            axis.set_title("1-NN WSD (SemCor held-out docs)")
        axis.set_xticks(x)
        axis.set_xlabel("layer")
        axis.set_ylabel("accuracy (%)")
        axis.legend()
    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=100)


def probe_tables(probes: dict, quick: bool) -> list[str]:
    lines = ["## Probes: what each layer knows", "",
             "Plot: " + ("`probes.png`" if quick else "[probes](results/probes.png)"), ""]
    if "pos" in probes:
        lines += ["Linear UPOS probe (logistic regression on one layer's frozen vectors, UD EWT):", "",
                  "| layer | dev acc. | test acc. |", "| --- | --- | --- |"]
        lines += [f"| {key.split('_')[1]} | {v['dev']:.2f} | {v['test']:.2f} |" for key, v in probes["pos"].items()]
        lines.append("")
    if "wsd" in probes:
        wsd = probes["wsd"]
        lines += ["1-nearest-neighbour WSD on SemCor 3.0 (every 5th document held out; nearest training "
                  f"occurrence of the same lemma and POS by cosine). Backoff for unseen lemmas: {wsd['backoff']}.", "",
                  "| layer | acc. on covered tokens | coverage | acc. all (no backoff) | acc. all (with backoff) |",
                  "| --- | --- | --- | --- | --- |"]
        for key, v in wsd.items():
            if isinstance(v, dict):
                name = key.split("_")[1] if key.startswith("layer_") else "train MFS"
                lines.append(f"| {name} | {v['accuracy_covered']:.2f} | {v['coverage']:.2f} | "
                             f"{v['accuracy_all_no_backoff']:.2f} | {v['accuracy_all_with_backoff']:.2f} |")
        lines.append("")
    return lines


def probe_findings(probes: dict | None) -> list[str]:
    lines = []
    for name, key, paper in (("pos", "test", 1), ("wsd", "accuracy_covered", 2)):
        if probes and name in probes:
            layers = {k: v[key] for k, v in probes[name].items() if k.startswith("layer_")}
            best = max(layers, key=layers.get)
            lines.append(f"* {name.upper()} probe: best layer {best.split('_')[1]} ("
                         + ", ".join(f"layer {k.split('_')[1]} {v:.2f}" for k, v in layers.items())
                         + f"; the paper found layer {paper} best).")
    if probes and "wsd" in probes:
        mfs = probes["wsd"]["mfs"]["accuracy_covered"]
        best = max(v["accuracy_covered"] for k, v in probes["wsd"].items() if k.startswith("layer_"))
        lines.append(f"* WSD: the most frequent training sense of each lemma scores {mfs:.2f} on the same "
                     f"covered tokens; the best layer's 1-NN {'beats' if best > mfs else 'does not beat'} it ({best:.2f}).")
    return lines
