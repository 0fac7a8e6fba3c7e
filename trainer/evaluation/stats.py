"""The gate's statistics (numpy only): the AUC of scores against binary labels, and paired-bootstrap
lower confidence bounds of a mean difference and of an AUC difference.

Sources: Efron & Tibshirani 1993, "An Introduction to the Bootstrap" (percentile interval); AUC as the
Mann-Whitney statistic: Hanley & McNeil 1982.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def auc(scores_N: Sequence[float], labels_N: Sequence[bool]) -> float:
    """Probability that a random positive row outscores a random negative one (ties count 1/2).

    NaN when a class is missing or a score is NaN.
    """
    scores, labels = np.asarray(scores_N, dtype=np.float64), np.asarray(labels_N, dtype=bool)
    if scores.size == 0 or np.isnan(scores).any() or labels.all() or not labels.any():
        return float("nan")
    pos, neg = scores[labels], scores[~labels]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (pos.size * neg.size))


def paired_bootstrap_lower_bound(diffs_N: Sequence[float], confidence: float, resamples: int, seed: int = 0) -> float:
    """Lower ``confidence`` percentile bound of mean(diffs) by the paired bootstrap.

    ``diffs_N[i]`` = candidate reward - champion reward on prompt ``i``.
    NaN when any difference is NaN or there are none.
    """
    diffs = np.asarray(diffs_N, dtype=np.float64)
    if diffs.size == 0 or np.isnan(diffs).any():
        return float("nan")
    rng = np.random.default_rng(seed)
    means = diffs[rng.integers(0, diffs.size, size=(resamples, diffs.size))].mean(axis=1)
    return float(np.quantile(means, 1.0 - confidence))


def _pairwise_wins(scores: np.ndarray) -> np.ndarray:
    """``W[i, j]`` = 1 if score i > score j, 1/2 if equal, 0 otherwise (``[N, N]``)."""
    return (scores[:, None] > scores[None, :]) + 0.5 * (scores[:, None] == scores[None, :])


def paired_auc_lower_bound(
    candidate_N: Sequence[float],
    champion_N: Sequence[float],
    labels_N: Sequence[bool],
    confidence: float,
    resamples: int,
    seed: int = 0,
) -> float:
    """Lower ``confidence`` percentile bound of AUC(candidate) - AUC(champion) by the paired bootstrap.

    Each resample draws the held-out rows with replacement (the same rows for
    both policies); resamples without both classes are skipped. NaN when a
    score is NaN, a class is missing, or no resample has both classes.
    """
    cand, champ = np.asarray(candidate_N, dtype=np.float64), np.asarray(champion_N, dtype=np.float64)
    labels = np.asarray(labels_N, dtype=bool)
    if cand.size == 0 or np.isnan(cand).any() or np.isnan(champ).any() or labels.all() or not labels.any():
        return float("nan")
    n = cand.size
    rng = np.random.default_rng(seed)
    counts_RN = np.zeros((resamples, n))
    np.add.at(counts_RN, (np.repeat(np.arange(resamples), n), rng.integers(0, n, size=resamples * n)), 1.0)
    pos_RN, neg_RN = counts_RN * labels, counts_RN * ~labels
    diff_NN = _pairwise_wins(cand) - _pairwise_wins(champ)
    pairs_R = pos_RN.sum(1) * neg_RN.sum(1)
    ok = pairs_R > 0
    if not ok.any():
        return float("nan")
    diffs_R = ((pos_RN @ diff_NN) * neg_RN).sum(1)[ok] / pairs_R[ok]
    return float(np.quantile(diffs_R, 1.0 - confidence))
