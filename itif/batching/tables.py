"""Cost tables of the whole-batch cost model (``itif.calibration.batch_cost``): interpolation over
the calibration grids, the repair of measured tables, and the small non-negative least squares
of its overhead fit."""

from __future__ import annotations

import numpy as np

from itif.batching.layer_cost import interp_grid, place_on_grid


def lin1(grid: np.ndarray, table: np.ndarray, x: float) -> float:
    """Piecewise linear in raw x, clamped below, proportional above the grid."""
    ax = place_on_grid(grid, np.asarray([x], np.float64))
    return float(interp_grid(np.asarray(table), [ax])[0])


def lin2(g0: np.ndarray, g1: np.ndarray, table: np.ndarray, x0: float, x1: float) -> float:
    axes = [place_on_grid(g0, np.asarray([x0], np.float64)),
            place_on_grid(g1, np.asarray([x1], np.float64))]
    return float(interp_grid(np.asarray(table), axes)[0])


def segs2(g0: np.ndarray, g1: np.ndarray, table: np.ndarray, segs: float, rows: float) -> float:
    """Like ``lin2`` over (segments, rows), but linear (not proportional) beyond the last
    segment count: more segments over the same rows add per-segment work, not more rows."""
    top = float(g0[-1])
    if segs <= top:
        return lin2(g0, g1, table, segs, rows)
    a, b = (lin1(g1, np.asarray(table)[i], rows) for i in (-2, -1))
    return b + (b - a) * (segs - top) / (top - float(g0[-2]))


def elementwise_min(a, b):
    if isinstance(a, dict):
        return {k: elementwise_min(a[k], b[k]) for k in a}
    return np.minimum(np.asarray(a, np.float64), np.asarray(b, np.float64)).tolist()


def _suffix_min(table, axes=None) -> list:
    """Each point becomes the cheapest of itself and every larger point, along ``axes`` (all
    by default): stalls only add time, and along those axes a bigger shape never costs less
    (``layer_cost``'s repair)."""
    a = np.asarray(table, np.float64)
    for axis in range(a.ndim) if axes is None else axes:
        a = np.flip(np.minimum.accumulate(np.flip(a, axis), axis=axis), axis)
    return a.tolist()


def repair(t: dict) -> dict:
    out = dict(t)
    for name in ("mm", "bmm", "grouped", "loop", "kernel", "mem", "emb"):
        if name in t:
            out[name] = {k: _suffix_min(v) for k, v in t[name].items()}
    if "attn" in t:  # over sequences only: see _ATT_LENS in batch_cost (a longer L can be cheaper)
        out["attn"] = {k: _suffix_min(v, axes=(1,)) for k, v in t["attn"].items()}
    return out


def nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (tiny problems: active-set by enumeration)."""
    best, best_err = np.zeros(X.shape[1]), float(np.sum(y ** 2))
    for mask in range(1, 1 << X.shape[1]):
        cols = [j for j in range(X.shape[1]) if mask >> j & 1]
        c, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
        if np.any(c < 0):
            continue
        full = np.zeros(X.shape[1])
        full[cols] = c
        err = float(np.sum((X @ full - y) ** 2))
        if err < best_err:
            best, best_err = full, err
    return best
