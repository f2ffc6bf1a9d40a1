"""The scheduler's run-time estimate of a batch, learned online from the batches it ran (the
offline models are ``batching.layer_cost``, per layer, and ``calibration.batch_cost``, per
batch, with its timings in ``calibration.batch_timing``).

A fused forward costs a fixed part (launches, planning, the Python around them: milliseconds on
a CPU, whatever the batch holds), a part per request (heads, attention groups, results) and a
part per token (the GEMMs). A per-token rate alone, the estimate this replaces, charges a
one-request batch almost nothing and a large batch of short requests too little, so the
starvation guard fired late and latency sizing let batches grow past their members' targets.

:class:`BatchTimeEstimate` fits ``ms = fixed + per_request * n + per_token * tokens`` by
least squares with exponential forgetting (recent batches count most: the machine's load and
the tenants' mix drift) and a weak ridge pull toward the prior (so that collinear data, say
batches whose requests all have one length, still give a sane split), with every part
non-negative (a negative part would predict that adding work saves time): the decayed normal
equations are 3x3, and the non-negative solution is the best of the 7 subsets of parts. Before
the first run it answers with the prior. O(1) per update; not thread-safe (the scheduler
holds its lock).
"""

from __future__ import annotations

import numpy as np

__all__ = ["BatchTimeEstimate"]


class BatchTimeEstimate:
    #: Prior before any batch ran: 1 ms fixed, 0.01 ms per token.
    PRIOR = (1.0, 0.0, 0.01)
    #: Feature scales: a request and a thousand tokens weigh about as much as the fixed part.
    _SCALE = np.array((1.0, 1.0 / 16.0, 1.0 / 1000.0))

    def __init__(self, forget: float = 0.98, prior_weight: float = 1e-3) -> None:
        if not 0.5 < forget <= 1.0:
            raise ValueError(f"forget must lie in (0.5, 1], got {forget}")
        self.forget = forget
        self._ridge = prior_weight * np.eye(3)
        self._prior = np.array(self.PRIOR) / self._SCALE  # in scaled features
        self._a = np.zeros((3, 3))
        self._b = np.zeros(3)
        self._theta = self._prior.copy()
        self.observed = 0

    def _x(self, n: int, tokens: int) -> np.ndarray:
        return np.array((1.0, float(n), float(tokens))) * self._SCALE

    def __call__(self, n: int, tokens: int) -> float:
        """Predicted ms of a batch of ``n`` requests and ``tokens`` tokens."""
        return max(0.0, float(self._x(n, tokens) @ self._theta))

    def observe(self, n: int, tokens: int, ms: float) -> None:
        """Fold in one measured batch."""
        if n < 1 or tokens < 0 or not np.isfinite(ms) or ms < 0:
            return
        x = self._x(n, tokens)
        self._a = self.forget * self._a + np.outer(x, x)
        self._b = self.forget * self._b + x * ms
        self._theta = _nonneg_solve(self._a + self._ridge, self._b + self._ridge @ self._prior)
        self.observed += 1

    @property
    def parts(self) -> dict[str, float]:
        fixed, per_request, per_token = (float(v) for v in self._theta * self._SCALE)
        return {"fixed_ms": fixed, "per_request_ms": per_request, "per_token_ms": per_token}


def _nonneg_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin over theta >= 0 of theta' a theta - 2 b' theta (``a`` positive definite): the
    unconstrained solution when it is non-negative (then it is the constrained one too: the
    usual case, one solve a batch), else that of the best subset of free parts, the others
    held at zero."""
    full = np.linalg.solve(a, b)
    if (full >= 0).all():
        return full
    best, best_f = np.zeros(3), 0.0
    for idx in _SUBSETS:
        sub = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
        if (sub < 0).any():
            continue
        theta = np.zeros(3)
        theta[idx] = sub
        f = float(theta @ a @ theta - 2 * b @ theta)
        if f < best_f:
            best, best_f = theta, f
    return best


#: The proper subsets of the three parts (the full set is tried first).
_SUBSETS = [[i for i in range(3) if mask >> i & 1] for mask in range(1, 7)]


def split_for_latency(tokens: list[int], estimate, max_loss: float = 0.05) -> int | None:
    """Where to cut a batch whose long members would hold its short ones back.

    ``tokens``: the members' tokens, ascending; ``estimate(n, tokens)``: ms of a batch. Running
    the ``k`` shortest first and the rest right after finishes the short ones at
    ``est(short)`` instead of ``est(all)`` and the long ones ``est(short) + est(long) -
    est(all)`` later (one more forward's fixed cost). Returns the ``k`` that saves the most
    total member latency, if the split costs at most ``max_loss`` of the batch's time
    (throughput) and saves anything; else None. Only cuts where every long member holds at
    least twice the short part's mean tokens (equal members are never split)."""
    n = len(tokens)
    if n < 2:
        return None
    total = sum(tokens)
    whole = estimate(n, total)
    best_k, best_gain, prefix = None, 0.0, 0
    for k in range(1, n):
        prefix += tokens[k - 1]
        if tokens[k] < 2 * prefix / k:  # only where the rest are long next to the short part
            continue
        short, long_ = estimate(k, prefix), estimate(n - k, total - prefix)
        extra = short + long_ - whole
        if extra > max_loss * whole:
            continue
        gain = k * (whole - short) - (n - k) * max(extra, 0.0)
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k
