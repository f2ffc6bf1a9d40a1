"""The kernel self-test, fallback records, and where they show (metric, health List).

CPU tests simulate a failing kernel with a stand-in backend (the reference ops, one of them
broken); the gpu-marked tests run the real kernels: the self-test passes with no fallback for
every dtype, and the cached launch path (signature-cached validation, memoised launch configs,
cached CuPy streams) gives bit-identical results to the fully validated path.
"""

from __future__ import annotations

import asyncio
import time
import types
import warnings

import pytest
import torch
from grpc_health.v1 import health_pb2
from prometheus_client import generate_latest

from itif.ops import cuda, dispatch, launch, reference, selftest, validate
from itif.ops.reference import AttnGroup, RotParam
from itif.platform import cupy_module


@pytest.fixture(autouse=True)
def clean_states():
    dispatch.clear_kernel_states()
    yield
    dispatch.clear_kernel_states()


def _masked_softmax(s, rows_per_seq, lengths, key_mask, scale):
    s.copy_(selftest.softmax_oracle(s, rows_per_seq, lengths, key_mask, scale).to(s.dtype))
    return s


def _fake_backend(**broken):
    """A stand-in for itif.ops.cuda made of the reference ops; ``broken`` replaces some."""
    ops = dict(
        bias_act=reference.bias_act,
        bias_residual=reference.bias_residual,
        bias_residual_layernorm=reference.bias_residual_layernorm,
        embed_text=reference.embed_text,
        masked_softmax=_masked_softmax,
        attention=reference.attention,
        KernelBuildError=cuda.KernelBuildError,
        SUPPORTED_DTYPES=cuda.SUPPORTED_DTYPES,
    )
    ops.update(broken)
    return types.SimpleNamespace(**ops)


def _off_by_one(x, bias, act="none"):
    return reference.bias_act(x, bias, act).add_(1.0)


def _no_build(*args, **kwargs):
    raise cuda.KernelBuildError("building rotation.cu for float on cuda:0 failed: nvrtc said no")


# ---------------------------------------------------------------------------------------------
# reporting


def test_cpu_reports_reference_for_every_op_quickly():
    t0 = time.perf_counter()
    res = selftest.self_test("cpu", torch.float32)
    assert time.perf_counter() - t0 < 1.0
    assert [r.op for r in res] == list(dispatch.OPS)
    assert all(r.ok and r.backend == "reference" and r.detail == selftest.NO_CUDA for r in res)
    assert dispatch.kernel_states() == []  # not a fallback: nothing recorded
    assert "no CUDA" in selftest.summary(res)
    assert len(selftest.self_test("cpu")) == len(dispatch.OPS) * 3  # every supported dtype


def test_passing_backend_is_recorded_ok():
    res = selftest.self_test("cpu", torch.float32, backend=_fake_backend())
    assert all(r.ok and r.backend == "cuda" and r.max_error is not None for r in res), res
    states = dispatch.kernel_states()
    assert {s.op for s in states} == set(dispatch.OPS)
    assert not any(s.fallback for s in states) and dispatch.fallbacks() == []
    assert selftest.summary(res).startswith("5/5 CUDA kernels match")


def test_mismatch_and_build_failure_disable_those_ops():
    be = _fake_backend(bias_act=_off_by_one, embed_text=_no_build)
    res = {r.op: r for r in selftest.self_test("cpu", torch.float32, backend=be)}
    assert not res["bias_act"].ok and res["bias_act"].detail.startswith("mismatch: act=none")
    assert "max |error| 1" in res["bias_act"].detail
    assert not res["embed_text"].ok and res["embed_text"].detail.startswith("build failed")
    assert all(res[op].ok for op in ("bias_residual", "bias_residual_layernorm", "attention"))
    fb = {s.op: s for s in dispatch.fallbacks()}
    assert set(fb) == {"bias_act", "embed_text"}
    assert fb["bias_act"].device == "cpu" and fb["bias_act"].dtype == "float32"
    assert fb["bias_act"].source == "self-test" and "mismatch" in fb["bias_act"].reason
    line = selftest.summary(list(res.values()))
    assert line.startswith("3/5") and "bias_act (float32): mismatch" in line


def test_raising_kernel_is_reported_not_raised():
    def boom(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    res = {r.op: r for r in selftest.self_test("cpu", torch.float32,
                                               backend=_fake_backend(bias_residual=boom))}
    assert res["bias_residual"].detail.startswith("error: RuntimeError: CUDA error")
    assert [s.op for s in dispatch.fallbacks()] == ["bias_residual"]


def test_record_false_records_nothing():
    selftest.self_test("cpu", torch.float32, backend=_fake_backend(bias_act=_off_by_one),
                       record=False)
    assert dispatch.kernel_states() == []


def test_cuda_device_without_kernels_is_a_fallback(monkeypatch):
    monkeypatch.setattr(dispatch, "_cuda_backend", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    res = selftest.self_test("cuda", torch.float16)
    assert all(not r.ok and r.detail.startswith("CUDA kernels unavailable") for r in res)
    assert {(s.op, s.device, s.dtype) for s in dispatch.fallbacks()} == {
        (op, "cuda:0", "float16") for op in dispatch.OPS}


# ---------------------------------------------------------------------------------------------
# dispatch honours the records


def test_disabled_op_runs_the_reference(monkeypatch):
    calls = []

    def spy(x, bias, act="none"):
        calls.append("bias_act")
        return reference.bias_act(x, bias, act)

    be = _fake_backend(bias_act=spy,
                       bias_residual=lambda x, b, r: calls.append("bias_residual") or x)
    monkeypatch.setattr(dispatch, "_backend_for", lambda t: be)
    x = torch.randn(4, 8)
    b = RotParam(torch.randn(2, 8), torch.zeros(4, dtype=torch.int64))
    dispatch.bias_act(x.clone(), b, "relu")
    assert calls == ["bias_act"]
    assert dispatch.disable("bias_act", "cpu", torch.float32, "mismatch: test")
    assert not dispatch.disable("bias_act", "cpu", torch.float32, "again")  # recorded once
    y = dispatch.bias_act(x.clone(), b, "relu")
    torch.testing.assert_close(y, reference.bias_act(x.clone(), b, "relu"))
    dispatch.bias_residual(x.clone(), b, x)
    assert calls == ["bias_act", "bias_residual"]  # only the disabled op left the backend
    with pytest.raises(ValueError, match="op 'nope'"):
        dispatch.disable("nope", "cpu", torch.float32, "x")


def test_runtime_build_failure_is_recorded_for_every_op(monkeypatch):
    class Be:
        KernelBuildError = cuda.KernelBuildError

    monkeypatch.setattr(dispatch, "_backend_for", lambda t: Be)
    fake = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0),
                                 dtype=torch.float16)
    assert dispatch._run("bias_act", fake, _no_build, lambda: "reference") == "reference"
    fb = dispatch.fallbacks()
    assert {s.op for s in fb} == set(dispatch.OPS)
    assert all(s.source == "runtime" and s.device == "cuda:0" and s.dtype == "float16"
               and "nvrtc said no" in s.reason for s in fb)


# ---------------------------------------------------------------------------------------------
# metric and health detail


def _metric_lines():
    from itif.metrics import Metrics

    body = generate_latest(Metrics(None, nvml=None).registry).decode()
    return [line for line in body.splitlines() if line.startswith("itif_kernel_fallback{")]


def test_fallback_metric():
    assert _metric_lines() == []  # nothing checked, nothing exported
    selftest.self_test("cpu", torch.float32, backend=_fake_backend(bias_act=_off_by_one))
    lines = _metric_lines()
    assert 'itif_kernel_fallback{device="cpu",dtype="float32",op="bias_act"} 1.0' in lines
    assert 'itif_kernel_fallback{device="cpu",dtype="float32",op="embed_text"} 0.0' in lines
    assert len(lines) == len(dispatch.OPS)
    from itif.metrics import METRIC_NAMES

    assert "itif_kernel_fallback" in METRIC_NAMES


def test_health_list_names_degraded_kernels():
    from itif.daemon import Daemon
    from itif.server.service import SERVICE, HealthService

    daemon = types.SimpleNamespace(ready=True)
    daemon.degraded_kernels = lambda: Daemon.degraded_kernels(daemon)
    health = HealthService(daemon)
    S = health_pb2.HealthCheckResponse

    def listed():
        resp = asyncio.run(health.List(health_pb2.HealthListRequest(), None))
        return {k: v.status for k, v in resp.statuses.items()}

    assert listed() == {"": S.SERVING, SERVICE: S.SERVING}
    dispatch.disable("bias_residual_layernorm", torch.device("cuda", 0), torch.bfloat16,
                     "mismatch: test")
    assert listed() == {"": S.SERVING, SERVICE: S.SERVING,
                        "itif.kernel/bias_residual_layernorm/cuda:0/bfloat16": S.NOT_SERVING}


def test_daemon_runs_the_self_test_only_on_cuda(monkeypatch, tmp_path):
    import itif
    import itif.daemon as daemon_mod
    from itif.config import hash_token, parse_config

    seen = []
    monkeypatch.setattr(daemon_mod, "_kernel_self_test",
                        lambda device, dtype: seen.append((device, dtype)) or ["checked"])
    text = ("server:\n  listen: 127.0.0.1:1\n  data_dir: ./data\n"
            f"  admin_token_sha256: {hash_token('admin')}\n"
            "backbone:\n  config: bert-tiny\n  device: cpu\n"
            "tenants:\n  - id: acme\n"
            f"    token_sha256: {hash_token('acme-tok')}\n")
    cfg = parse_config(text, tmp_path)
    engine = itif.Engine("bert-tiny")
    d = daemon_mod.Daemon(cfg, engine)
    d.start()
    d.stop(0)
    assert seen == [] and d.kernel_checks == []
    engine.device = torch.device("cuda", 0)  # what the daemon reads; nothing runs on it here
    d2 = daemon_mod.Daemon(cfg, engine)
    d2.start()
    d2.stop(0)
    assert seen == [(torch.device("cuda", 0), engine.dtype)] and d2.kernel_checks == ["checked"]


def test_daemon_self_test_failure_does_not_stop_the_start(monkeypatch, caplog):
    import itif.daemon as daemon_mod

    def broken(*a, **k):
        raise RuntimeError("self-test exploded")

    monkeypatch.setattr(selftest, "self_test", broken)
    assert daemon_mod._kernel_self_test(torch.device("cuda", 0), torch.float16) == []
    assert "kernel self-test failed to run" in caplog.text


# ---------------------------------------------------------------------------------------------
# validation modes (CPU: the validators with require_cuda=False)


def test_validation_once_caches_per_signature(monkeypatch):
    calls = []

    def counting(x, bias, act):
        calls.append(act)
        validate.validate_bias_act(x, bias, act, require_cuda=False)

    validate.forget_signatures()
    x = torch.randn(4, 8)
    b = RotParam(torch.randn(2, 8), torch.zeros(4, dtype=torch.int64))
    check = lambda *a: validate.check(counting, validate.sig_bias_act, *a)  # noqa: E731
    with validate.validate_launches("once"):
        check(x, b, "gelu")
        check(torch.randn(4, 8), b, "gelu")  # same signature: not validated again
        assert calls == ["gelu"]
        check(x, b, "relu")  # another activation
        check(torch.randn(5, 8), RotParam(b.buf, torch.zeros(5, dtype=torch.int64)), "relu")
        assert calls == ["gelu", "relu", "relu"]
        with pytest.raises(ValueError, match="contiguous"):  # a new signature: checked
            check(torch.randn(8, 4).t(), b, "gelu")
        with pytest.raises(ValueError, match="act 'swish'"):
            check(x, b, "swish")
        with pytest.raises(ValueError, match="act 'swish'"):  # a failure is never cached
            check(x, b, "swish")
        with pytest.raises(ValueError, match="RotParam"):
            check(x, [b.buf, b.slot], "gelu")  # a list, not a RotParam: not the cached one
    with validate.validate_launches("always"):
        n = len(calls)
        check(x, b, "gelu")
        check(x, b, "gelu")
        assert len(calls) == n + 2
    with validate.validate_launches("off"):
        check(x, b, "swish")  # nothing checked
    assert validate.validation_mode() == "once"
    with pytest.raises(ValueError, match="validation mode"):
        validate.set_validation_mode("sometimes")


def test_validation_once_keeps_bool_and_number_types_apart():
    x = torch.randn(5, 8)
    g = RotParam(torch.randn(3, 8), torch.zeros(5, dtype=torch.int64))
    v = lambda *a: validate.validate_bias_residual_layernorm(*a, require_cuda=False)  # noqa
    check = lambda *a: validate.check(v, validate.sig_bias_residual_layernorm, *a)  # noqa: E731
    validate.forget_signatures()
    check(x, None, None, g, g, 1e-5, True)
    with pytest.raises(ValueError, match="keep_sum 1"):
        check(x, None, None, g, g, 1e-5, 1)  # 1 == True, but not a bool


def test_config_cache_matches_the_formulas():
    info = launch.DeviceInfo(sms=132, max_threads_per_sm=2048, max_blocks_per_sm=32,
                             smem_per_sm=228 * 1024)
    class Mod:  # what cached_config reads of a module (hashable by identity, like _Module)
        def occupancy(self, name):
            return lambda threads, smem: None

    mod = Mod()
    mod.info = info
    launch.clear_config_cache()
    first = launch.cached_config(mod, "k", "rows", 512, 96)
    assert first == launch.rows_config(96, 512, info) == (512, 96)
    assert launch.cached_config(mod, "k", "flat", 7, 96) == launch.flat_config(7 * 96, info)
    assert launch.cached_config(mod, "k", "warp", 1000, 0, 4096, 4) == launch.warp_config(
        1000, info, 4, 4096)
    mod.info = None  # served from the cache from now on
    assert launch.cached_config(mod, "k", "rows", 512, 96) == first
    with pytest.raises(ValueError, match="launch form"):
        launch.cached_config(mod, "k", "diag", 1, 1)


# ---------------------------------------------------------------------------------------------
# GPU: the real kernels

requires_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and cupy_module() is not None), reason="needs CUDA and CuPy")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_self_test_passes_without_fallback(dtype):
    res = selftest.self_test("cuda", dtype)
    assert [r.op for r in res] == list(dispatch.OPS)
    assert all(r.ok and r.backend == "cuda" for r in res), selftest.summary(res)
    assert dispatch.fallbacks() == []
    assert all(dispatch.backend_name(torch.empty(1, device="cuda", dtype=dtype), op) == "cuda"
               for op in dispatch.OPS)


def _gpu_case(h, rows, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + h + rows)
    slot = torch.randint(0, 3, (rows,), generator=g).cuda()

    def t(*s):
        return torch.randn(*s, generator=g).to(dtype).cuda()

    return t, slot


def _run_all(dtype, h, rows):
    """Every wrapper once on fixed inputs; returns their outputs (cloned)."""
    t, slot = _gpu_case(h, rows, dtype)
    x, res = t(rows, h), t(rows, h)
    bias, gamma, beta = (RotParam(t(3, h), slot) for _ in range(3))
    out = [cuda.bias_act(x.clone(), bias, "gelu"), cuda.bias_residual(x.clone(), bias, res)]
    xs = x.clone()
    out += [cuda.bias_residual_layernorm(xs, bias, res, gamma, beta, 1e-5, True), xs]
    word, pos, typ = RotParam(t(3, 20, h), slot), RotParam(t(3, 9, h), slot), RotParam(
        t(3, 2, h), slot)
    ids = torch.randint(0, 9, (rows,), generator=torch.Generator().manual_seed(rows)).cuda()
    out.append(cuda.embed_text(word, pos, typ, ids, ids % 9, ids % 2))
    L, heads, n = 5, 2, 2
    s = t(n * heads * L, L)
    mask = (torch.arange(L) < 3).expand(n, L).reshape(n, 1, 1, L).contiguous().cuda()
    out.append(cuda.masked_softmax(s.clone(), heads * L, None, mask, 0.5))
    qkv = t(n * L, 3 * 6)
    with cuda.launch_policy(attention="softmax_bmm"):
        out.append(cuda.attention(qkv, [AttnGroup(n=n, L=L, key_mask=mask)], 2))
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("h,rows", [(64, 7), (1030, 65)])
def test_gpu_cached_launch_path_is_identical(dtype, h, rows):
    launch.clear_config_cache()
    validate.forget_signatures()
    with validate.validate_launches("always"):
        want = _run_all(dtype, h, rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # no ExternalStream warning
        for mode in ("once", "once", "off"):  # validate, then the cached signature; then none
            with validate.validate_launches(mode):
                got = _run_all(dtype, h, rows)
            for a, b in zip(got, want):
                assert torch.equal(a, b)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a second cached CuPy stream, for the side stream
            got = _run_all(dtype, h, rows)
        torch.cuda.current_stream().wait_stream(side)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.gpu
@requires_cuda
def test_gpu_stream_objects_are_cached():
    x = torch.randn(4, 64, device="cuda")
    b = RotParam(torch.randn(2, 64, device="cuda"), torch.zeros(4, dtype=torch.int64,
                                                                device="cuda"))
    cuda.bias_act(x, b)
    mod = cuda.module_for(x.device, x.dtype)
    s1 = mod.stream()
    cuda.bias_act(x, b)
    assert mod.stream() is s1
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert mod.stream() is not s1
        assert mod.stream().ptr == side.cuda_stream
    torch.cuda.synchronize()
