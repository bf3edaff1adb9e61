"""Plots for task results and probes (matplotlib, Agg backend, written atomically as PNG)."""

from __future__ import annotations

from pathlib import Path

from elmokit.io import atomic_path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_layer_weights(weights: list[list[list[float]]], title: str, path: str | Path) -> None:
    """Bars of softmax(s) per layer: `weights[seed][mix][layer]`, the mean over seeds, one group a mix."""
    plt = _pyplot()
    n_mixes, n_layers = len(weights[0]), len(weights[0][0])
    figure, axis = plt.subplots(figsize=(4 + n_layers, 3))
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
    plt.close(figure)


def plot_probes(results: dict, path: str | Path) -> None:
    """Probe accuracy per layer: POS (dev, test) and WSD (1-NN on covered tokens)."""
    plt = _pyplot()
    panels = [name for name in ("pos", "wsd") if name in results]
    figure, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.5 * max(len(panels), 1), 3.2), squeeze=False)
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
    plt.close(figure)
