"""Random tenant weights in canonical form, for benchmarks, `itif plan` and the demo's fallback.

Timing does not depend on the values; scaled normal noise keeps activations finite and
LayerNorm gains near one, so outputs stay well-conditioned at any depth.
"""

from __future__ import annotations

import torch

from itif.backbones.hf import CanonicalWeights
from itif.backbones.spec import BackboneSpec


def random_weights(spec: BackboneSpec, num_labels: int | None = None, seed: int = 0,
                   pooler: bool = True) -> CanonicalWeights:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for p in spec.params(num_labels=num_labels, pooler=pooler):
        t = torch.randn(p.shape, generator=gen) * 0.02
        if p.name.endswith(("ln.weight", "ln1.weight", "ln2.weight")):
            t += 1.0
        tensors[p.name] = t
    return CanonicalWeights(tensors, num_labels, pooler)
