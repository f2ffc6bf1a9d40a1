"""Shared fixtures: tiny random Hugging Face models as tenants, and the per-request oracle."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded, ever
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if "ITIF_CACHE_DIR" not in os.environ:  # profiled cost models go to a throwaway dir, not ~
    import tempfile

    os.environ["ITIF_CACHE_DIR"] = tempfile.mkdtemp(prefix="itif-test-cache-")

if "TRITON_INTERPRET" not in os.environ:  # itif's Triton kernel runs interpreted without a GPU;
    import torch  # Triton reads the setting when it is imported, so it is set before anything

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tests.oracle import make_hf_model  # noqa: E402
from tests.reliability_util import rel  # noqa: E402 - the reliability suite's fixture

__all__ = ["rel"]  # the fixture is used by name, never read here


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the item (``item.rep_call``): the reliability suite's ``rel``
    fixture records whether its test passed."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture(scope="session")
def hf_factory():
    """make(family_preset, num_labels, seed) -> a random HF model, cached per arguments."""
    cache = {}

    def make(preset: str, num_labels: int | None = 3, seed: int = 0):
        key = (preset, num_labels, seed)
        if key not in cache:
            cache[key] = make_hf_model(preset, num_labels, seed)
        return cache[key]

    return make


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module of tiny models (waking a thread pool for
    microsecond ops costs more than it saves, and on a busy shared CPU two threads made them
    many times slower); the count is restored after the module."""
    import torch  # noqa: PLC0415 - conftest stays importable without torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
