"""itif's forwards run torch's SDPA without cuDNN attention on CUDA (itif.platform
.attention_backends): cuDNN builds a plan per new shape, and a serving load's shapes are
ever-new. The switch is one process-wide torch flag: these tests check it is off inside, put
back after (also when threads overlap and when the body raises), untouched elsewhere, and that
a real forward on a GPU runs its attention with it off."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import itif
from itif import platform
from itif.backbones.random import random_weights
from itif.ops.launch import launch_policy
from tests.oracle import random_request

CUDA = torch.device("cuda")  # a device object only: the flag is host state, no GPU needed


@pytest.fixture(autouse=True)
def _flag_restored():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    platform.cudnn_attention_allowed.cache_clear()
    yield
    platform.cudnn_attention_allowed.cache_clear()
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_off_inside_and_put_back_after():
    torch.backends.cuda.enable_cudnn_sdp(True)
    with platform.attention_backends(CUDA):
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
    assert torch.backends.cuda.cudnn_sdp_enabled() is True


def test_an_operator_who_turned_it_off_keeps_it_off():
    torch.backends.cuda.enable_cudnn_sdp(False)
    with platform.attention_backends(CUDA):
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
    assert torch.backends.cuda.cudnn_sdp_enabled() is False


def test_put_back_when_the_forward_raises():
    torch.backends.cuda.enable_cudnn_sdp(True)
    with pytest.raises(RuntimeError, match="boom"):
        with platform.attention_backends(CUDA):
            raise RuntimeError("boom")
    assert torch.backends.cuda.cudnn_sdp_enabled() is True


def test_overlapping_threads_share_it_and_the_last_one_out_puts_it_back():
    torch.backends.cuda.enable_cudnn_sdp(True)
    inside, release = threading.Barrier(3), threading.Event()
    seen = []

    def forward(wait_for_release: bool):
        with platform.attention_backends(CUDA):
            inside.wait(5)
            if wait_for_release:
                release.wait(5)
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())

    slow = threading.Thread(target=forward, args=(True,))
    fast = threading.Thread(target=forward, args=(False,))
    slow.start()
    fast.start()
    inside.wait(5)
    fast.join(5)  # the first one out: the slow one is still inside, so it stays off
    assert torch.backends.cuda.cudnn_sdp_enabled() is False
    release.set()
    slow.join(5)
    assert seen == [False, False]
    assert torch.backends.cuda.cudnn_sdp_enabled() is True


def test_nothing_changes_on_the_cpu_or_when_the_operator_allows_cudnn(monkeypatch):
    torch.backends.cuda.enable_cudnn_sdp(True)
    with platform.attention_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() is True
    monkeypatch.setenv("ITIF_CUDNN_SDPA", "1")
    platform.cudnn_attention_allowed.cache_clear()
    with platform.attention_backends(CUDA):
        assert torch.backends.cuda.cudnn_sdp_enabled() is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_forward_runs_its_attention_without_cudnn(monkeypatch):
    from itif.ops import reference

    eng = itif.Engine("bert-tiny", device="cuda", dtype="float16", cuda_graphs="off")
    eng.add_tenant("t0", random_weights(eng.spec, num_labels=2, seed=0))
    real, flags = reference.F.scaled_dot_product_attention, []

    def spy(*a, **kw):
        flags.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*a, **kw)

    monkeypatch.setattr(reference.F, "scaled_dot_product_attention", spy)
    torch.backends.cuda.enable_cudnn_sdp(True)
    rng = np.random.default_rng(0)
    # per length group, through SDPA: by default ("auto") a batch of several lengths is one
    # variable-length flash call a layer, which is not SDPA and never cuDNN's
    with launch_policy(attention="sdpa"):
        eng.infer([random_request(eng.spec, "t0", rng, length=n) for n in (5, 9, 30)])
    assert flags and not any(flags)
    assert torch.backends.cuda.cudnn_sdp_enabled() is True
