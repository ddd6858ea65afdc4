"""Statistics of the benchmark table: the standard error over seeds, and a paired bootstrap test over problems."""
import math
import statistics

import numpy as np


def standard_error(values: list[float]) -> float | None:
    """The standard error of the mean: sample std / sqrt(n); None for fewer than 2 values."""
    if len(values) < 2:
        return None
    return statistics.stdev(values) / math.sqrt(len(values))


def paired_bootstrap(scores_a: list[float], scores_b: list[float], resamples: int = 10_000, seed: int = 0) -> float:
    """Two-sided p-value that the means of a's and b's per-problem scores differ, by a paired bootstrap over problems
    (Efron & Tibshirani 1993; for NLP Koehn 2004, Dror et al. 2018).

    scores_a[i] and scores_b[i] are the same problem's scores. Each of `resamples` draws takes len(scores_a) problem
    indices uniformly with replacement, the same indices for a and b (the pairing), and the difference of the two
    means over them. p = min(1, 2 * min(share of differences <= 0, share of differences >= 0)): twice the smaller
    tail of that bootstrap distribution at 0 (1.0 for identical scores; its resolution is 1 / resamples, so 0.0
    reads as p < 1 / resamples). Deterministic: numpy's default_rng(seed) draws the indices.
    """
    if len(scores_a) != len(scores_b):
        raise ValueError(f"paired bootstrap: {len(scores_a)} scores against {len(scores_b)}; a paired test needs the "
                         "same problems, in the same order, for both")
    if not len(scores_a):
        raise ValueError("paired bootstrap: no problems to compare")
    diff = np.asarray(scores_a, dtype=float) - np.asarray(scores_b, dtype=float)  # mean(a) - mean(b) = mean(a - b)
    rng = np.random.default_rng(seed)
    block = max(1, 2**22 // len(diff))  # resamples drawn at once: about 32 MiB of indices, whatever the problems
    means = np.concatenate([diff[rng.integers(0, len(diff), size=(min(block, resamples - start), len(diff)))]
                            .mean(axis=1) for start in range(0, resamples, block)])
    return min(1.0, 2 * min(float(np.mean(means <= 0)), float(np.mean(means >= 0))))
