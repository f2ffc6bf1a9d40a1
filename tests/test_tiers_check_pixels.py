"""``itif.daemon_tiers.check`` of image requests for a tenant that is not resident (issue 64).

With weight tiers, a request of a tenant whose weights are on the host tier or disk is checked
without them, through the Engine's public ``validate_pixels``. That call used to leave out the
``pin`` argument the private method required: every ViT request of an evicted tenant failed
with a TypeError (an internal error) instead of being checked. Bad pixels are still refused
naming the request and field.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from itif import daemon_tiers
from itif.errors import InvalidRequest
from itif.requests import Request
from itif.runtime.engine import Engine


def test_pixels_of_a_tenant_not_resident_are_checked_without_its_weights():
    eng = Engine("vit-tiny")
    d = SimpleNamespace(engine=eng)  # what check() reads of the daemon
    shape = (eng.spec.num_channels, eng.spec.image_size, eng.spec.image_size)
    good = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    assert "cold" not in eng.store
    daemon_tiers.check(d, "cold", [Request("cold", pixel_values=good)] * 2)  # no error
    bad = good.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(InvalidRequest, match=r"request 1: pixel_values contain NaN"):
        daemon_tiers.check(d, "cold", [Request("cold", pixel_values=good),
                                       Request("cold", pixel_values=bad)])
    with pytest.raises(InvalidRequest, match=r"request 0: pixel_values has shape"):
        daemon_tiers.check(d, "cold", [Request("cold", pixel_values=good[:1])])
