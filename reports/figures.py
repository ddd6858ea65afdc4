"""Figures of tracked runs (see reports/tables.py for what a run is), each saved as PNG and PDF with the
provenance JSON (MLflow run ids, git commits, config hashes) in the file's metadata."""
import statistics
from pathlib import Path

from reports.tables import by_method


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, paths: list[Path], metadata: str) -> None:
    for path in paths:
        # PNG takes any text key; PDF only its standard ones, of which Subject fits.
        info = {"Description": metadata} if path.suffix == ".png" else {"Subject": metadata}
        fig.savefig(path, metadata=info)
    _pyplot().close(fig)


def _finish(fig, ax, xlabel: str, ylabel: str, title: str, paths: list[Path], metadata: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, paths, metadata)


def reward_vs_step(runs: list[dict], paths: list[Path], metadata: str) -> None:
    """RL runs: training reward against step, one line per method (mean over seeds) with a ±std band."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    for method, group in by_method(runs).items():
        steps = sorted(set.intersection(*(set(dict(r["history"]["reward_mean"])) for r in group)))
        values = [[dict(r["history"]["reward_mean"])[s] for r in group] for s in steps]
        mean = [statistics.fmean(v) for v in values]
        line, = ax.plot(steps, mean, label=f"{method} (n={len(group)})")
        if len(group) > 1:
            std = [statistics.stdev(v) for v in values]
            ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color=line.get_color(), alpha=0.2, linewidth=0)
    _finish(fig, ax, "RL step", "training reward (mean of the step's samples)",
            "Reward during RL (mean ± std over seeds)", paths, metadata)


def kl_reward_frontier(runs: list[dict], paths: list[Path], metadata: str, reward: str = "reward") -> None:
    """Evaluations: held-out (main) reward against KL to the base model; a dot per seed, the mean ± std as a cross."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    for method, group in by_method(runs).items():
        kl = [r["metrics"]["kl_to_reference"] for r in group]
        reward = [r["metrics"]["reward_mean"] for r in group]
        points = ax.scatter(kl, reward, s=14, alpha=0.5)
        spread = (lambda v: statistics.stdev(v) if len(v) > 1 else 0.0)
        ax.errorbar(statistics.fmean(kl), statistics.fmean(reward), xerr=spread(kl), yerr=spread(reward), fmt="o",
                    color=points.get_facecolor()[0][:3], capsize=3, label=f"{method} (n={len(group)})")
    _finish(fig, ax, "KL to the base model (nats per response)", f"held-out {reward}",
            "Reward against KL: the frontier", paths, metadata)


def training_curves(runs: list[dict], paths: list[Path], metadata: str) -> None:
    """Trained stages: training loss against step, a panel per method (their losses differ in scale), a line
    per seed."""
    plt = _pyplot()
    grouped = by_method(runs)
    fig, axes = plt.subplots(1, len(grouped), figsize=(3.6 * len(grouped), 3.2), dpi=120, squeeze=False)
    for ax, (method, group) in zip(axes[0], grouped.items()):
        for run in group:
            history = run["history"].get("loss") or run["history"].get("policy_loss") or []
            label = f"seed {run['seed']}" if run["seed"] is not None else method
            ax.plot([s for s, _ in history], [v for _, v in history], marker=".", markersize=3, label=label)
        ax.set_title(method, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, paths, metadata)


def validation_curves(runs: list[dict], paths: list[Path], metadata: str) -> None:
    """RL runs: held-out validation reward (history `eval_reward`) against step, one line per method (mean over
    seeds) with a ±std band, and a star at each run's best step where it logged `best_step`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    starred = False
    for method, group in by_method(runs).items():
        steps = sorted(set.intersection(*(set(dict(r["history"]["eval_reward"])) for r in group)))
        values = [[dict(r["history"]["eval_reward"])[s] for r in group] for s in steps]
        mean = [statistics.fmean(v) for v in values]
        line, = ax.plot(steps, mean, marker=".", label=f"{method} (n={len(group)})")
        if len(group) > 1:
            std = [statistics.stdev(v) for v in values]
            ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color=line.get_color(), alpha=0.2, linewidth=0)
        for run in group:
            if "best_step" in run["metrics"]:  # its own best, which the seeds' mean need not pass through
                ax.scatter(run["metrics"]["best_step"], run["metrics"]["best_eval_reward"], marker="*", s=90,
                           color=line.get_color(), edgecolors="black", linewidths=0.5, zorder=3,
                           label=None if starred else "best step of a run")
                starred = True
    _finish(fig, ax, "RL step", "held-out validation reward", "Validation reward during RL", paths, metadata)
