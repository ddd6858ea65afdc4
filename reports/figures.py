"""Figures: training curves."""
from pathlib import Path


def training_curves(curves: dict[str, list[dict]], path: Path) -> None:
    """curves: {stage: [{"step", "loss", ...}]} -> one PNG, a panel per stage (their losses differ in scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.2), dpi=120, squeeze=False)
    for ax, (name, log) in zip(axes[0], curves.items()):
        ax.plot([r["step"] for r in log], [r["loss"] for r in log], marker=".", label=f"{name} training loss")
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
