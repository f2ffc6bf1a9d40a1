"""CPU checks of the CUDA backends (run in CI, no GPU needed).

* every ``kernels/*.cu`` compiles with ``nvcc --ptx -arch=sm_90`` for each storage dtype, from
  the exact text the loader hands to NVRTC (skipped only when nvcc is absent);
* the host logic of ``itif.ops.cuda``: entry-point discovery, launch configurations (Eq.
  4.3-4.4), argument validation;
* ``itif.ops.dispatch`` falls back to the reference on the CPU, and after a failed build.

The GEMM plans are tested in tests/test_gemm.py.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from itif.ops import cuda, dispatch, reference
from itif.ops.reference import AttnGroup, RotParam

NVCC = shutil.which("nvcc")
STORAGE = ["float", "__half", "__nv_bfloat16"]
KERNEL_FILES = cuda.kernel_files()
EXPECTED_KERNELS = {"bias_act", "bias_residual_layernorm", "embed_text", "masked_softmax"}


# ---------------------------------------------------------------------------------------------
# compilation


def test_kernel_sources_found():
    assert KERNEL_FILES, "no kernels/*.cu"
    names = set()
    for f in KERNEL_FILES:
        names.update(cuda.kernel_names(f.read_text()))
    assert EXPECTED_KERNELS <= names


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_nvcc_compiles(path, storage, tmp_path):
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    src = tmp_path / path.name
    src.write_text(cuda.kernel_source(path, storage))
    cmd = [NVCC, "--ptx", "-arch=sm_90", *cuda.COMPILE_OPTIONS, "-Werror", "all-warnings",
           "-o", str(tmp_path / "out.ptx"), str(src)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    ptx = (tmp_path / "out.ptx").read_text()
    for name in cuda.kernel_names(src.read_text()):
        assert f".entry {name}(" in ptx, f"{name} missing from the PTX"


def test_kernel_source_defines(tmp_path):
    path = KERNEL_FILES[0]
    text = cuda.kernel_source(path, "__half", {"ITIF_FOO": 3})
    assert text.startswith("#define T_STORE __half\n#define ITIF_FOO 3\n#line 1 ")
    with pytest.raises(ValueError, match="not an identifier"):
        cuda.kernel_source(path, "float", {"bad name": 1})


# ---------------------------------------------------------------------------------------------
# launch configurations

H100ISH = cuda.DeviceInfo(sms=132, max_threads_per_sm=2048, max_blocks_per_sm=32,
                          smem_per_sm=228 * 1024)


@pytest.mark.parametrize("units,rows,expect", [
    (768, 512, (min(2 * 132, 512), 768)),  # Eq. 4.3: T = H; R = 2048 // 768 = 2
    (96, 512, (min(21 * 132, 512), 96)),  # 16-byte packs of a 768-wide fp16 row
    (8, 3, (3, 32)),  # rounded up to a warp; B = rows when fewer
    (1030, 10_000, (2 * 132, 1024)),  # T capped at 1024, R = 2048 // 1024
    (769, 1, (1, 800)),
])
def test_rows_config_eq43(units, rows, expect):
    assert cuda.rows_config(units, rows, H100ISH) == expect


def test_rows_config_counts_shared_memory():
    blocks, threads = cuda.rows_config(256, 100_000, H100ISH, smem=100 * 1024)
    assert threads == 256 and blocks == 2 * 132


def test_configs_prefer_the_drivers_occupancy():
    seen = []

    def occupancy(threads, smem):
        seen.append((threads, smem))
        return 1  # e.g. register-limited

    assert cuda.rows_config(768, 10_000, H100ISH, 0, occupancy) == (132, 768)
    assert cuda.warp_config(10_000, H100ISH, 4, 4096, occupancy) == (132, 128)
    assert seen == [(768, 0), (128, 4096)]
    assert cuda.rows_config(768, 10_000, H100ISH, 0, lambda t, s: None) == (264, 768)


def test_flat_and_warp_configs():
    assert cuda.flat_config(1000, H100ISH) == (4, 256)
    assert cuda.flat_config(10**9, H100ISH) == (8 * 132, 256)
    assert cuda.warp_config(7, H100ISH, 4) == (2, 128)
    assert cuda.warp_config(10**6, H100ISH, 4) == (16 * 132, 128)


def test_launch_policy_switch_and_checks():
    assert cuda.get_policy().elementwise == "rows"
    with cuda.launch_policy(elementwise="flat", layernorm="warp") as p:
        assert p.elementwise == "flat" and cuda.get_policy() is p
    assert cuda.get_policy().elementwise == "rows"
    with pytest.raises(ValueError, match="elementwise 'diag'"):
        cuda.LaunchPolicy(elementwise="diag")
    with pytest.raises(ValueError, match="warps_per_block 0"):
        cuda.LaunchPolicy(warps_per_block=0)


# ---------------------------------------------------------------------------------------------
# validation (require_cuda=False: everything but the device check runs on the CPU)


def _rot(cap, *shape, rows, dtype=torch.float32):
    return RotParam(torch.randn(cap, *shape, dtype=dtype), torch.zeros(rows, dtype=torch.int64))


def test_validate_requires_cuda():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="x is on cpu"):
        cuda.bias_act(x, _rot(2, 8, rows=4))


@pytest.mark.parametrize("mutate,match", [
    (lambda x, b: (x.double(), b), "dtype torch.float64"),
    (lambda x, b: (x.t(), b), "shape|contiguous"),
    (lambda x, b: (x, RotParam(b.buf[:, :7].contiguous(), b.slot)), r"\(2, 7\).*\[capacity, 8\]"),
    (lambda x, b: (x, RotParam(b.buf.half(), b.slot)), "bias.buf has dtype torch.float16"),
    (lambda x, b: (x, RotParam(b.buf, b.slot.int())), "slot has dtype torch.int32"),
    (lambda x, b: (x, RotParam(b.buf, b.slot[:3])), "3 entries but x has 4 rows"),
    (lambda x, b: (x, RotParam(b.buf[:0], b.slot)), "capacity 0"),
    (lambda x, b: (x, (b.buf,)), "RotParam"),
])
def test_validate_bias_act(mutate, match):
    x, b = mutate(torch.randn(4, 8), _rot(2, 8, rows=4))
    with pytest.raises(ValueError, match=match):
        cuda.validate_bias_act(x, b, "gelu", require_cuda=False)


def test_validate_bias_act_names_bad_activation():
    with pytest.raises(ValueError, match="act 'swish'"):
        cuda.validate_bias_act(torch.randn(4, 8), _rot(2, 8, rows=4), "swish", require_cuda=False)


def test_validate_layernorm_and_residual():
    x = torch.randn(5, 8)
    g, b = _rot(3, 8, rows=5), _rot(3, 8, rows=5)
    cuda.validate_bias_residual_layernorm(x, None, None, g, b, 1e-5, False, require_cuda=False)
    with pytest.raises(ValueError, match=r"residual has shape \(5, 9\)"):
        cuda.validate_bias_residual_layernorm(x, None, torch.randn(5, 9), g, b, 1e-5, False,
                                              require_cuda=False)
    with pytest.raises(ValueError, match="eps nan"):
        cuda.validate_bias_residual_layernorm(x, None, None, g, b, float("nan"), False,
                                              require_cuda=False)
    with pytest.raises(ValueError, match="keep_sum 1"):
        cuda.validate_bias_residual_layernorm(x, None, None, g, b, 1e-5, 1, require_cuda=False)
    with pytest.raises(ValueError, match="gamma.slot has 4 entries but x has 5"):
        cuda.validate_bias_residual_layernorm(x, None, None, _rot(3, 8, rows=4), b, 1e-5, False,
                                              require_cuda=False)
    with pytest.raises(ValueError, match="residual has dtype torch.float16"):
        cuda.validate_bias_residual(x, _rot(2, 8, rows=5), torch.randn(5, 8).half(),
                                    require_cuda=False)


def test_validate_embed_text():
    T = 6
    word, pos, typ = _rot(2, 30, 8, rows=T), _rot(2, 16, 8, rows=T), _rot(2, 2, 8, rows=T)
    ids = torch.zeros(T, dtype=torch.int64)
    cuda.validate_embed_text(word, pos, typ, ids, ids, ids, require_cuda=False)
    with pytest.raises(ValueError, match="pos.buf has shape .* width 8"):
        cuda.validate_embed_text(word, _rot(2, 16, 4, rows=T), typ, ids, ids, ids,
                                 require_cuda=False)
    with pytest.raises(ValueError, match="positions has 5 entries but ids has 6"):
        cuda.validate_embed_text(word, pos, typ, ids, ids[:5], ids, require_cuda=False)
    with pytest.raises(ValueError, match="types has dtype torch.int32"):
        cuda.validate_embed_text(word, pos, typ, ids, ids, ids.int(), require_cuda=False)


def test_validate_masked_softmax_and_attention():
    s = torch.randn(2 * 3 * 4, 4)
    cuda.validate_masked_softmax(s, 12, None, torch.ones(2, 1, 1, 4, dtype=torch.bool), 1.0,
                                 require_cuda=False)
    with pytest.raises(ValueError, match="not a multiple of rows_per_seq 5"):
        cuda.validate_masked_softmax(s, 5, None, None, 1.0, require_cuda=False)
    with pytest.raises(ValueError, match="lengths has 3 entries"):
        cuda.validate_masked_softmax(s, 12, torch.ones(3, dtype=torch.int64), None, 1.0,
                                     require_cuda=False)
    qkv = torch.randn(8, 3 * 8)
    cuda.validate_attention(qkv, [AttnGroup(n=2, L=4)], 2, None, require_cuda=False)
    with pytest.raises(ValueError, match="rows 4:12 exceed qkv's 8"):
        cuda.validate_attention(qkv, [AttnGroup(n=2, L=4, start=4)], 2, None, require_cuda=False)
    with pytest.raises(ValueError, match="heads 3"):
        cuda.validate_attention(qkv, [], 3, None, require_cuda=False)
    with pytest.raises(ValueError, match="key_mask must be a bool"):
        cuda.validate_attention(qkv, [AttnGroup(n=2, L=4, key_mask=torch.ones(2, 4))], 2, None,
                                require_cuda=False)


# ---------------------------------------------------------------------------------------------
# dispatch on the CPU


def _tenant_params(T, H, cap=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    slot = torch.randint(0, cap, (T,), generator=g)
    return (RotParam(torch.randn(cap, H, generator=g), slot),
            RotParam(torch.randn(cap, H, generator=g), slot.flip(0).contiguous()))


def test_dispatch_cpu_is_reference():
    T, H = 7, 16
    x = torch.randn(T, H)
    assert dispatch.backend_name(x) == "reference"
    b, g = _tenant_params(T, H)
    res = torch.randn(T, H)
    torch.testing.assert_close(dispatch.bias_act(x.clone(), b, "gelu"),
                               reference.bias_act(x.clone(), b, "gelu"))
    torch.testing.assert_close(dispatch.bias_residual(x.clone(), b, res),
                               reference.bias_residual(x.clone(), b, res))
    torch.testing.assert_close(
        dispatch.bias_residual_layernorm(x, b, res, g, b, 1e-5),
        reference.bias_residual_layernorm(x, b, res, g, b, 1e-5))
    qkv = torch.randn(8, 3 * H)
    groups = [AttnGroup(n=2, L=4)]
    torch.testing.assert_close(dispatch.attention(qkv, groups, 2),
                               reference.attention(qkv, groups, 2))
    ids = torch.randint(0, 5, (T,))
    word = RotParam(torch.randn(3, 5, H), b.slot)
    torch.testing.assert_close(dispatch.embed_text(word, word, word, ids, ids, ids),
                               reference.embed_text(word, word, word, ids, ids, ids))


class _FailingBackend:
    """Stands in for itif.ops.cuda whose kernels fail to build."""

    KernelBuildError = cuda.KernelBuildError
    SUPPORTED_DTYPES = cuda.SUPPORTED_DTYPES

    def __init__(self):
        self.calls = 0

    def bias_act(self, x, bias, act):
        self.calls += 1
        raise cuda.KernelBuildError("nvrtc said no")


def test_dispatch_falls_back_after_build_failure(monkeypatch, caplog):
    fake = _FailingBackend()
    monkeypatch.setattr(dispatch, "_broken", set())
    monkeypatch.setattr(dispatch, "_backend_for", lambda t: (
        None if (t.device.index, t.dtype) in dispatch._broken else fake))
    x, (b, _) = torch.randn(4, 8), _tenant_params(4, 8)
    with caplog.at_level(logging.WARNING, logger="itif.ops"):
        y = dispatch.bias_act(x.clone(), b, "relu")
        y2 = dispatch.bias_act(x.clone(), b, "relu")
    torch.testing.assert_close(y, reference.bias_act(x.clone(), b, "relu"))
    torch.testing.assert_close(y2, y)
    assert fake.calls == 1, "a failed build must not be retried"
    assert sum("failed to build" in r.message for r in caplog.records) == 1


def test_dispatch_validation_errors_propagate(monkeypatch):
    class Strict(_FailingBackend):
        def bias_act(self, x, bias, act):
            raise ValueError("bias_act: x is bad")

    monkeypatch.setattr(dispatch, "_backend_for", lambda t: Strict())
    with pytest.raises(ValueError, match="x is bad"):
        dispatch.bias_act(torch.randn(2, 4), _tenant_params(2, 4)[0])


# ---------------------------------------------------------------------------------------------
# the kernels executed on the CPU: an emulator of the CUDA subset they use
#
# Without a GPU the kernels still run: the source the loader builds is compiled as host C++
# with a small prelude (each CUDA thread of a block is an OS thread, blocks run one after
# another, __syncthreads is a block barrier, __shfl_xor_sync a warp barrier through a shared
# array, __shared__ is static storage) and launched through the real wrappers of itif.ops.cuda
# with its real launch configurations and argument packing (checked against the kernels'
# parameter sizes). It checks indexing, reductions, barrier placement and the host/kernel
# argument contract; not timing, not the hardware's memory model, not NVRTC.

EMU_PRELUDE = r"""
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

struct emu_dim3 { unsigned x = 1, y = 1, z = 1; };
static thread_local emu_dim3 threadIdx, blockIdx;
static emu_dim3 blockDim, gridDim;

// A reusable barrier that aborts instead of hanging when the threads' barrier counts differ.
struct EmuBarrier {
  explicit EmuBarrier(int n) : n(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    const long g = gen;
    if (++count == n) { count = 0; ++gen; cv.notify_all(); return; }
    if (!cv.wait_for(lock, std::chrono::seconds(120), [&] { return gen != g; })) {
      std::fprintf(stderr, "emulator: barrier deadlock\n");
      std::abort();
    }
  }
  std::mutex m;
  std::condition_variable cv;
  int n, count = 0;
  long gen = 0;
};
static EmuBarrier* emu_block_bar = nullptr;
static std::vector<std::unique_ptr<EmuBarrier>> emu_warp_bar;
static float emu_shfl[1024];
alignas(16) static unsigned char emu_dyn_smem[256 * 1024];

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static

static inline void __syncthreads() { emu_block_bar->wait(); }
static inline float __shfl_xor_sync(unsigned mask, float v, int o) {
  if (mask != 0xffffffffu) std::abort();
  const int t = threadIdx.x, w = t >> 5, lane = t & 31;
  emu_shfl[t] = v;
  emu_warp_bar[w]->wait();
  const float r = emu_shfl[(w << 5) | (lane ^ o)];
  emu_warp_bar[w]->wait();
  return r;
}
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }
"""

EMU_LAUNCH = r"""
template <class... A, std::size_t... I>
static void emu_call(void (*k)(A...), void** argv, std::index_sequence<I...>) {
  k(*reinterpret_cast<A*>(argv[I])...);
}
// blockDim.x OS threads run every block in turn, with a barrier between blocks.
template <class... A>
static int emu_launch(void (*k)(A...), int grid, int block, int smem, int nargs, void** argv,
                      const int* sizes) {
  if (nargs != (int)sizeof...(A)) return 1;
  const std::size_t want[] = {sizeof(A)...};
  for (int i = 0; i < nargs; ++i) if ((std::size_t)sizes[i] != want[i]) return 100 + i;
  if (block % 32 || block > 1024 || grid < 1) return 2;
  if (smem > (int)sizeof(emu_dyn_smem)) return 3;
  gridDim.x = grid;
  blockDim.x = block;
  EmuBarrier bb(block), done(block);
  emu_block_bar = &bb;
  emu_warp_bar.clear();
  for (int w = 0; w < block / 32; ++w) emu_warp_bar.emplace_back(new EmuBarrier(32));
  std::vector<std::thread> ts;
  for (int t = 0; t < block; ++t)
    ts.emplace_back([=, &done] {
      threadIdx.x = t;
      for (int b = 0; b < grid; ++b) {
        blockIdx.x = b;
        emu_call(k, argv, std::index_sequence_for<A...>{});
        done.wait();
      }
    });
  for (auto& th : ts) th.join();
  return 0;
}
"""


def _cuda_include() -> Path | None:
    import glob
    import os

    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    cands += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    if NVCC:
        cands.append(str(Path(NVCC).resolve().parents[1]))
    for c in cands:
        if c and (Path(c) / "include" / "cuda_bf16.h").is_file():
            return Path(c) / "include"
    return None


class _EmuModule:
    """Stands in for itif.ops.cuda._Module: same ``info`` and ``launch``, runs on the CPU."""

    def __init__(self, lib, info):
        self.lib, self.info = lib, info
        self.launches: list[tuple] = []

    def occupancy(self, name):
        return lambda threads, smem: None  # no occupancy calculator: the estimate is used

    def launch(self, name, grid, block, args, shared_mem=0):
        import ctypes

        import numpy as np

        assert shared_mem <= 48 * 1024, f"{name}: {shared_mem} B of dynamic shared memory"
        vals = []
        for a in args:
            if a is None:
                vals.append(ctypes.c_void_p(None))
            elif isinstance(a, np.int64):
                vals.append(ctypes.c_int64(int(a)))
            elif isinstance(a, np.int32):
                vals.append(ctypes.c_int32(int(a)))
            elif isinstance(a, np.float32):
                vals.append(ctypes.c_float(float(a)))
            elif type(a) is int:  # a pointer (CuPy passes Python ints as 8-byte scalars)
                vals.append(ctypes.c_void_p(a))
            else:
                raise TypeError(f"{name}: unexpected kernel argument {a!r} ({type(a).__name__})")
        n = len(vals)
        argv = (ctypes.c_void_p * n)(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
                                       for v in vals])
        sizes = (ctypes.c_int * n)(*[ctypes.sizeof(v) for v in vals])
        rc = getattr(self.lib, f"emu_{name}")(grid, block, shared_mem, n, argv, sizes)
        assert rc == 0, f"{name}: emulator refused the launch (code {rc})"
        self.launches.append((name, grid, block, shared_mem))


def _build_emulator(storage: str, workdir: Path):
    import ctypes
    import re

    gxx = shutil.which("g++") or shutil.which("c++")
    inc = _cuda_include()
    if gxx is None or inc is None:
        pytest.skip("needs a host C++ compiler and the CUDA headers")
    parts, names = [EMU_PRELUDE], []
    for f in KERNEL_FILES:
        src = cuda.kernel_source(f, storage)
        src = re.sub(r"extern\s+__shared__\s+(\w+)\s+(\w+)\[\];",
                     r"\1* \2 = reinterpret_cast<\1*>(emu_dyn_smem);", src)
        parts.append(src)
        names += cuda.kernel_names(src)
    parts.append(EMU_LAUNCH)
    for n in names:
        parts.append(f'extern "C" int emu_{n}(int g, int b, int s, int n, void** a, '
                     f"const int* z) {{ return emu_launch(&{n}, g, b, s, n, a, z); }}")
    cpp, so = workdir / f"emu_{storage}.cpp", workdir / f"emu_{storage}.so"
    cpp.write_text("\n".join(parts))
    cmd = [gxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-pthread", "-w", f"-I{inc}",
           "-o", str(so), str(cpp)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
    return ctypes.CDLL(str(so))


EMU_DEVICE = cuda.DeviceInfo(sms=1, max_threads_per_sm=2048, max_blocks_per_sm=32,
                             smem_per_sm=228 * 1024)  # one SM: grid-stride loops iterate
EMU_DTYPES = {"float": torch.float32, "__half": torch.float16, "__nv_bfloat16": torch.bfloat16}
EMU_TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3),
           torch.bfloat16: (1.6e-2, 1e-2)}


@pytest.fixture(scope="module", params=list(EMU_DTYPES))
def emulated(request, tmp_path_factory):
    """itif.ops.cuda wired to the CPU emulator for one storage dtype (CPU tensors accepted)."""
    import functools

    lib = _build_emulator(request.param, tmp_path_factory.mktemp("emu"))
    mod = _EmuModule(lib, EMU_DEVICE)
    mp = pytest.MonkeyPatch()
    mp.setattr(cuda, "module_for", lambda device, dtype, defines=None: mod)
    for name in ("validate_bias_act", "validate_bias_residual",
                 "validate_bias_residual_layernorm", "validate_embed_text",
                 "validate_masked_softmax", "validate_attention"):
        mp.setattr(cuda, name, functools.partial(getattr(cuda, name), require_cuda=False))
    yield EMU_DTYPES[request.param], mod
    mp.undo()


def _emu_close(got, want_f32, dtype):
    atol, rtol = EMU_TOL[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want_f32.to(dtype).float(), atol=atol, rtol=rtol)


def _f32(p):
    if p is None:
        return None
    if isinstance(p, RotParam):
        return RotParam(p.buf.float(), p.slot)
    return p.to(torch.float32, copy=True)


def _emu_case(h, rows, dtype, seed=0, cap=5):
    g = torch.Generator().manual_seed(seed + h)
    slot = torch.randint(0, cap, (rows,), generator=g)
    slot[torch.rand(rows, generator=g) < 0.6] = 2  # skewed
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731 (a one-line local helper)
    return (rnd(rows, h), rnd(rows, h), RotParam(rnd(cap, h), slot),
            RotParam(rnd(cap, h), slot.flip(0).contiguous()), RotParam(rnd(cap, h),
                                                                      torch.roll(slot, 1)))


@pytest.mark.parametrize("h", [40, 72])
@pytest.mark.parametrize("policy", [{}, {"elementwise": "flat"}, {"vectorize": False}],
                         ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "default")
def test_emulated_elementwise(emulated, h, policy):
    dtype, _ = emulated
    x, res, bias, _, _ = _emu_case(h, 7, dtype)
    with cuda.launch_policy(**policy):
        for act in cuda.ACT_CODES:
            _emu_close(cuda.bias_act(x.clone(), bias, act),
                       reference.bias_act(_f32(x), _f32(bias), act), dtype)
        _emu_close(cuda.bias_residual(x.clone(), bias, res),
                   reference.bias_residual(_f32(x), _f32(bias), _f32(res)), dtype)


@pytest.mark.parametrize("h", [40, 72])
@pytest.mark.parametrize("policy", [
    {}, {"layernorm": "block"}, {"layernorm": "block", "ln_smem_cache": False},
    {"layernorm": "warp", "ln_smem_cache": False}, {"layernorm": "warp", "warps_per_block": 3},
], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "default")
def test_emulated_layernorm(emulated, h, policy):
    dtype, _ = emulated
    x0, res, bias, gamma, beta = _emu_case(h, 7, dtype)
    with cuda.launch_policy(**policy):
        for b, r, keep in ((bias, res, False), (bias, res, True), (None, None, False),
                           (None, res, True)):
            x, x_ref = x0.clone(), _f32(x0)
            y = cuda.bias_residual_layernorm(x, b, r, gamma, beta, 1e-5, keep)
            want = reference.bias_residual_layernorm(x_ref, _f32(b), _f32(r), _f32(gamma),
                                                     _f32(beta), 1e-5, keep)
            _emu_close(y, want, dtype)
            _emu_close(x, x_ref, dtype)


def test_emulated_layernorm_wide_row(emulated):
    """H > 1024: a block of 1024 threads strides over the row; bad slots poison their row."""
    dtype, mod = emulated
    if dtype != torch.float32:
        pytest.skip("one dtype is enough for the wide-row path")
    x0, res, bias, gamma, beta = _emu_case(1030, 2, dtype)
    with cuda.launch_policy(vectorize=False):
        x, x_ref = x0.clone(), _f32(x0)
        y = cuda.bias_residual_layernorm(x, bias, res, gamma, beta, 1e-5, True)
    assert mod.launches[-1][1:3] == (2, 1024)
    _emu_close(y, reference.bias_residual_layernorm(x_ref, bias, res, gamma, beta, 1e-5, True),
               dtype)
    _emu_close(x, x_ref, dtype)
    bad = RotParam(bias.buf, torch.tensor([0, 9]))
    y = cuda.bias_act(x0.clone(), bad, "gelu")
    assert torch.isnan(y).all(1).tolist() == [False, True]


@pytest.mark.parametrize("policy", [{}, {"elementwise": "flat"}, {"vectorize": False}],
                         ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "default")
def test_emulated_embed_text(emulated, policy):
    dtype, _ = emulated
    g = torch.Generator().manual_seed(3)
    rows, e, cap = 6, 24, 3
    slot = torch.tensor([0, 2, 2, 1, 2, 0])
    word = RotParam(torch.randn(cap, 30, e, generator=g).to(dtype), slot)
    pos = RotParam(torch.randn(cap, 9, e, generator=g).to(dtype), slot.flip(0).contiguous())
    typ = RotParam(torch.randn(cap, 2, e, generator=g).to(dtype), slot)
    ids = torch.randint(0, 30, (rows,), generator=g)
    positions, types = torch.randint(0, 9, (rows,), generator=g), torch.tensor([0, 1] * 3)
    with cuda.launch_policy(**policy):
        got = cuda.embed_text(word, pos, typ, ids, positions, types)
    _emu_close(got, reference.embed_text(_f32(word), _f32(pos), _f32(typ), ids, positions,
                                         types), dtype)


@pytest.mark.parametrize("L", [1, 5, 33])
def test_emulated_masked_softmax(emulated, L):
    dtype, _ = emulated
    n, heads = 3, 2
    g = torch.Generator().manual_seed(L)
    s = (torch.randn(n * heads * L, L, generator=g) * 3).to(dtype)
    lengths = torch.tensor([L, max(L - 2, 1), 0])
    mask = torch.rand(n, 1, 1, L, generator=g) < 0.7
    for lm, km in ((None, None), (lengths, mask)):
        got = cuda.masked_softmax(s.clone(), heads * L, lm, km, 0.5)
        live = torch.ones(n, L, dtype=torch.bool)
        if lm is not None:
            live &= torch.arange(L)[None] < lm[:, None]
            live &= km.reshape(n, L)
        z = (s.float() * 0.5).masked_fill(~live.repeat_interleave(heads * L, 0), float("-inf"))
        _emu_close(got, torch.softmax(z, -1).nan_to_num(0.0), dtype)


def test_emulated_attention_softmax_path(emulated):
    dtype, _ = emulated
    g = torch.Generator().manual_seed(5)
    n, L, heads, H = 2, 5, 3, 30
    qkv = torch.randn(n * L + 1, 3 * H, generator=g).to(dtype)
    km = torch.tensor([[True] * L, [True, True, True, False, False]])
    rows = torch.where(km, torch.arange(n * L).view(n, L) + 1, 0)
    valid = torch.nonzero(km.reshape(-1)).squeeze(1)
    group = AttnGroup(n=n, L=L, rows=rows, valid=valid, dest=rows.reshape(-1)[valid],
                      key_mask=km.view(n, 1, 1, L))
    for groups in ([AttnGroup(n=n, L=L, start=1)], [group]):
        with cuda.launch_policy(attention="softmax_bmm"):
            got = cuda.attention(qkv, groups, heads)
        want = reference.attention(qkv.float(), groups, heads)
        atol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)
