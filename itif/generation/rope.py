"""Rotary position embeddings (RoPE) of the llama family: each variant's inverse frequencies as
Hugging Face computes them (``transformers.modeling_rope_utils``), and each row's cos/sin.

Variants (``rope_type`` in the config's ``rope_parameters`` / ``rope_scaling``):

* ``default``: ``inv_freq[j] = 1 / theta ** (2j / d)``;
* ``linear``: the default divided by ``factor`` (positions stretched by ``factor``);
* ``llama3`` (Llama 3.1): long wavelengths (over ``original_max_position_embeddings /
  low_freq_factor``) divided by ``factor``, short ones (under ``... / high_freq_factor``) kept,
  the ones between interpolated;
* ``dynamic`` (NTK): the default until a sequence outgrows ``max_position_embeddings``, then
  ``theta`` raised with the sequence length ``s``: ``theta * (factor * s / P - (factor - 1))
  ** (d / (d - 2))``. Hugging Face recomputes it in the forward from the longest position of
  the call and keeps the keys already cached as they were rotated; a request alone in
  ``generate()`` therefore rotates its prompt with ``s`` = the prompt's length and each later
  token with ``s`` = its position + 1. Here every row carries its own ``s`` the same way, so a
  request's rotations do not depend on what else is in the batch (HF's module also remembers
  the longest ``s`` across calls: itif behaves as a freshly loaded model on every request).

The float32 arithmetic follows Hugging Face's operation for operation (the scalar ``theta``
where HF has a Python float, a tensor where it has one), so the frequencies are its bits.
Others (``yarn``, ``longrope``, partial rotary factors) are refused when the spec is built.
"""

from __future__ import annotations

import math

import torch

from itif.errors import InvalidConfig

SUPPORTED = ("default", "linear", "dynamic", "llama3")
_NEEDS = {"linear": ("factor",), "dynamic": ("factor",),
          "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")}


def check_rope(p: dict, max_position: int) -> None:
    """InvalidConfig naming the setting when ``p`` (a spec's ``rope_params``) is not served."""
    kind = p.get("rope_type")
    if kind not in SUPPORTED:
        raise InvalidConfig(f"config.json rope_type {kind!r} is not supported "
                            f"({', '.join(SUPPORTED)})")
    for key in _NEEDS.get(kind, ()):
        if not isinstance(p.get(key), (int, float)) or p[key] <= 0:
            raise InvalidConfig(f"config.json rope_scaling {key} must be a positive number for "
                                f"rope_type {kind!r}, got {p.get(key)!r}")
    if kind == "llama3" and p["high_freq_factor"] == p["low_freq_factor"]:
        raise InvalidConfig("config.json rope_scaling high_freq_factor equals low_freq_factor "
                            "(the llama3 interpolation divides by their difference)")
    if not isinstance(p.get("rope_theta"), (int, float)) or p["rope_theta"] <= 0:
        raise InvalidConfig(f"config.json rope_theta must be positive, got {p.get('rope_theta')!r}")
    if max_position < 1:
        raise InvalidConfig(f"max_position_embeddings {max_position} must be positive")


def _exponents(dim: int, device) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def inv_freq(p: dict, dim: int, max_position: int, device="cpu") -> torch.Tensor:
    """The inverse frequencies ``[dim / 2]`` (float32) of a sequence within ``max_position``
    (for ``dynamic``: its frequencies until a sequence outgrows that)."""
    kind, theta = p["rope_type"], p["rope_theta"]
    if kind == "dynamic":  # HF's initial value: seq_len = max_position, Python floats
        f = p["factor"]
        theta = theta * ((f * max_position / max_position) - (f - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (theta ** _exponents(dim, device))
    if kind == "linear":
        inv /= p["factor"]
    elif kind == "llama3":
        f, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > lo_wl, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mixed = (1 - smooth) * scaled / f + smooth * scaled
        medium = ~(wavelen < hi_wl) * ~(wavelen > lo_wl)
        inv = torch.where(medium, mixed, scaled)
    return inv


class Rope:
    """One spec's rotary tables on one device: ``cos_sin(pos, seq_len)`` per row."""

    def __init__(self, p: dict, dim: int, max_position: int, device) -> None:
        self.p, self.dim, self.max_position = p, dim, max_position
        self.inv = inv_freq(p, dim, max_position, device)
        self.dynamic = p["rope_type"] == "dynamic"
        self._exp = _exponents(dim, device)

    def _dynamic_inv(self, seq_len: torch.Tensor) -> torch.Tensor:
        """``[T, dim / 2]``: each row's frequencies for its sequence length (int64 ``[T]``);
        rows within ``max_position`` keep the initial ones (HF's reset)."""
        f, P, d = self.p["factor"], self.max_position, self.dim
        s = torch.clamp_min(seq_len, P)
        theta = self.p["rope_theta"] * ((f * s / P) - (f - 1)) ** (d / (d - 2))
        grown = 1.0 / (theta[:, None] ** self._exp[None, :])
        return torch.where((seq_len > P)[:, None], grown, self.inv[None, :])

    def cos_sin(self, pos: torch.Tensor, seq_len: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``[T, dim]`` cos and sin of rows at positions ``pos`` (int64 ``[T]``);
        ``seq_len [T]``: each row's sequence length for ``dynamic`` (ignored otherwise)."""
        inv = self.inv if not self.dynamic else self._dynamic_inv(seq_len)
        freqs = pos.float()[:, None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


__all__ = ["Rope", "SUPPORTED", "check_rope", "inv_freq"]
