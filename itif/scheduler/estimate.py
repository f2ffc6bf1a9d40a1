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
equations are 3x3, and the non-negative solution is the best of the 7 subsets of parts (tried
first on the last solution's free parts, which nearly always holds). Before the first run it
answers with the prior. O(1) per update, in plain floats and closed-form solves (a few microseconds:
it runs on the engine's thread once a batch); not thread-safe (the scheduler holds its lock).
"""

from __future__ import annotations

import math

__all__ = ["BatchTimeEstimate"]


class BatchTimeEstimate:
    #: Prior before any batch ran: 1 ms fixed, 0.01 ms per token.
    PRIOR = (1.0, 0.0, 0.01)
    #: Feature scales: a request and a thousand tokens weigh about as much as the fixed part.
    _SCALE = (1.0, 1.0 / 16.0, 1.0 / 1000.0)

    def __init__(self, forget: float = 0.98, prior_weight: float = 1e-3) -> None:
        if not 0.5 < forget <= 1.0:
            raise ValueError(f"forget must lie in (0.5, 1], got {forget}")
        self.forget = forget
        self._ridge = prior_weight
        self._prior = [p / s for p, s in zip(self.PRIOR, self._SCALE)]  # in scaled features
        # plain floats, not numpy: a 3x3 update and solve a batch is ~100 numpy calls' worth
        # of overhead on the engine's thread, and a few microseconds as Python arithmetic
        self._a = [[0.0] * 3 for _ in range(3)]
        self._b = [0.0] * 3
        self._theta = list(self._prior)
        self._support = (0, 1, 2)  # the parts the last solution left free
        self.observed = 0

    def _x(self, n: int, tokens: int) -> tuple[float, float, float]:
        s = self._SCALE
        return s[0], n * s[1], tokens * s[2]

    def __call__(self, n: int, tokens: int) -> float:
        """Predicted ms of a batch of ``n`` requests and ``tokens`` tokens."""
        x, t = self._x(n, tokens), self._theta
        return max(0.0, x[0] * t[0] + x[1] * t[1] + x[2] * t[2])

    def observe(self, n: int, tokens: int, ms: float) -> None:
        """Fold in one measured batch."""
        if n < 1 or tokens < 0 or not math.isfinite(ms) or ms < 0:
            return
        x, f, r = self._x(n, tokens), self.forget, self._ridge
        a, b = self._a, self._b
        for i in range(3):
            row, xi = a[i], x[i]
            row[0] = f * row[0] + xi * x[0]
            row[1] = f * row[1] + xi * x[1]
            row[2] = f * row[2] + xi * x[2]
            b[i] = f * b[i] + xi * ms
        p = self._prior
        ar = [[a[0][0] + r, a[0][1], a[0][2]], [a[1][0], a[1][1] + r, a[1][2]],
              [a[2][0], a[2][1], a[2][2] + r]]
        self._theta = _nonneg_solve(ar, [b[0] + r * p[0], b[1] + r * p[1], b[2] + r * p[2]],
                                    self._support)
        self._support = tuple(i for i in range(3) if self._theta[i] > 0) or (0, 1, 2)
        self.observed += 1

    @property
    def parts(self) -> dict[str, float]:
        fixed, per_request, per_token = (t * s for t, s in zip(self._theta, self._SCALE))
        return {"fixed_ms": fixed, "per_request_ms": per_request, "per_token_ms": per_token}


def _nonneg_solve(a, b, support: tuple[int, ...] = (0, 1, 2)) -> list[float]:
    """argmin over theta >= 0 of theta' a theta - 2 b' theta (``a`` 3x3 positive definite,
    nested sequences or an array).

    First the parts of ``support`` free, the others held at zero (the last batch's solution's
    parts: it drifts slowly, so this is one solve a batch): that is the answer when it is
    non-negative and the held parts' gradients are too (the problem is convex, so these KKT
    conditions are enough). Else the best over every subset of free parts."""
    if not isinstance(b, list):  # an array (the tests): plain floats from here
        a = [[float(v) for v in row] for row in a]
        b = [float(v) for v in b]
    theta = _on(support, _solve(a, b, support)) if support else [0.0, 0.0, 0.0]
    if min(theta) >= 0 and all(
            sum(a[i][j] * theta[j] for j in range(3)) - b[i] >= -1e-12 * (1.0 + abs(b[i]))
            for i in range(3) if i not in support):
        return theta
    best, best_f = [0.0, 0.0, 0.0], 0.0
    for idx in _SUBSETS:
        sub = _solve(a, b, idx)
        if min(sub) < 0:
            continue
        theta = _on(idx, sub)
        f = sum(theta[i] * a[i][j] * theta[j] for i in range(3) for j in range(3)) \
            - 2 * sum(bi * ti for bi, ti in zip(b, theta))
        if f < best_f:
            best, best_f = theta, f
    return best


def _on(idx: tuple[int, ...], values: list[float]) -> list[float]:
    """The 3 parts with ``values`` at ``idx`` and zero elsewhere."""
    theta = [0.0, 0.0, 0.0]
    for i, v in zip(idx, values):
        theta[i] = v
    return theta


def _solve(a: list[list[float]], b: list[float], idx: tuple[int, ...]) -> list[float]:
    """The solution of ``a[idx, idx] x = b[idx]`` (``a`` symmetric positive definite, so every
    principal block is too), in closed form: straight-line float arithmetic, no loop."""
    if len(idx) == 1:
        i, = idx
        return [b[i] / a[i][i]]
    if len(idx) == 2:
        i, j = idx
        aii, aij, ajj = a[i][i], a[i][j], a[j][j]
        det = aii * ajj - aij * aij
        return [(b[i] * ajj - aij * b[j]) / det, (aii * b[j] - aij * b[i]) / det]
    i, j, k = idx
    a00, a01, a02, a11, a12, a22 = a[i][i], a[i][j], a[i][k], a[j][j], a[j][k], a[k][k]
    b0, b1, b2 = b[i], b[j], b[k]
    c00, c01, c02 = a11 * a22 - a12 * a12, a02 * a12 - a01 * a22, a01 * a12 - a02 * a11
    det = a00 * c00 + a01 * c01 + a02 * c02
    c11, c12, c22 = a00 * a22 - a02 * a02, a01 * a02 - a00 * a12, a00 * a11 - a01 * a01
    return [(c00 * b0 + c01 * b1 + c02 * b2) / det, (c01 * b0 + c11 * b1 + c12 * b2) / det,
            (c02 * b0 + c12 * b1 + c22 * b2) / det]


#: Every non-empty subset of the three parts.
_SUBSETS = [tuple(i for i in range(3) if mask >> i & 1) for mask in range(1, 8)]


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
