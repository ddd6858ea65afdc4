"""Figures: training curves."""
from pathlib import Path


def training_curves(curves: dict[str, list[dict]], path: Path) -> None:
    """curves: {model: [{"step", "train_loss", ...}]} -> one PNG with a line per model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    for name, log in curves.items():
        ax.plot([r["step"] for r in log], [r["train_loss"] for r in log], label=name, marker=".")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("Training curves")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
