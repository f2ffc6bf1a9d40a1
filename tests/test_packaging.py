"""The CUDA kernel sources ship with a normal (non-editable) install, and the loader finds them.

``kernels/*.cu`` at the repository root is the single source; ``itif/kernels`` is a symlink to it
that setuptools follows, so a wheel holds the files as ``itif/kernels/*.cu`` package data. The
test builds a wheel from a copy of the source (no network: ``--no-build-isolation``,
``--no-deps``, ``--no-index``), installs it into a fresh virtual environment, and asks the
installed copy's loader where its kernels are.

Also here: the loader's search for the CUDA headers NVRTC needs (CPU, with a stand-in CuPy).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from itif.ops import cuda_loader

ROOT = Path(__file__).resolve().parents[1]
KERNELS = sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))
CPU_KERNELS = sorted(p.name for p in (ROOT / "kernels").glob("*.cpp"))


def _copy_source(dst: Path) -> Path:
    """What a build reads: pyproject, README, the package and the kernel sources (the symlink
    itif/kernels -> ../kernels kept a symlink, as in a checkout)."""
    src = dst / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "MANIFEST.in"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "kernels", src / "kernels", ignore=ignore)
    shutil.copytree(ROOT / "itif", src / "itif", symlinks=True, ignore=ignore)
    return src


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    src = _copy_source(tmp)
    out = tmp / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
           "--no-index", "-q", "-w", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    (whl,) = out.glob("itif-*.whl")
    return whl


def test_kernels_are_package_data_of_the_wheel(wheel):
    assert KERNELS, "no kernels/*.cu in the repository"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        shipped = sorted(n.removeprefix("itif/kernels/") for n in names
                         if n.startswith("itif/kernels/") and n.endswith(".cu"))
        assert shipped == KERNELS, f"wheel {wheel.name} holds {shipped}, expected {KERNELS}"
        for name in KERNELS:  # the files themselves, not links
            assert z.read(f"itif/kernels/{name}") == (ROOT / "kernels" / name).read_bytes()
        assert "itif/ops/cuda_loader.py" in names
        for name in CPU_KERNELS:  # the CPU GEMM's source (itif.runtime.cpu_gemm builds it)
            assert z.read(f"itif/kernels/{name}") == (ROOT / "kernels" / name).read_bytes()


def test_installed_copy_finds_its_kernels(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = Path(subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--target", str(purelib), str(wheel)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # itif's dependencies (torch, ...) come from this interpreter's site-packages, added after
    # the fresh environment's own: a .pth path is searched, its .pth files (the editable
    # install's finder of this checkout) are not run, so `import itif` is the installed copy.
    here = sysconfig.get_paths()["purelib"]
    (purelib / "zz_outer_site.pth").write_text(here + "\n")
    code = (
        "import itif, itif.ops.cuda_loader as L\n"
        "print(itif.__file__)\n"
        "print(L.kernel_dir())\n"
        "print(','.join(p.name for p in L.kernel_files()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pkg, kdir, files = proc.stdout.strip().splitlines()[-3:]
    assert Path(pkg).resolve().is_relative_to(purelib.resolve()), pkg
    assert Path(kdir) == (purelib / "itif" / "kernels").resolve(), kdir
    assert files.split(",") == KERNELS


def test_kernel_dir_prefers_the_package_copy():
    pkg, repo = cuda_loader.kernel_dir_candidates()
    assert pkg.parent.name == "itif" and repo.parent == pkg.parent.parent
    assert cuda_loader.kernel_dir() == (ROOT / "kernels").resolve()
    assert [p.name for p in cuda_loader.kernel_files()] == KERNELS


def test_kernel_dir_error_lists_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_loader, "kernel_dir_candidates",
                        lambda: (tmp_path / "a", tmp_path / "b"))
    with pytest.raises(cuda_loader.KernelBuildError, match=r"looked in .*a, .*b"):
        cuda_loader.kernel_dir()


# ---------------------------------------------------------------------------------------------
# CUDA headers for NVRTC (a stand-in CuPy: no GPU needed)


class _FakeCupy:
    """Just what ``_Module`` uses. NVRTC "finds" cuda_fp16.h only through a ``-I`` folder that
    holds it, unless ``builtin_headers``."""

    def __init__(self, builtin_headers: bool = False, fail_with: str | None = None):
        self.builtin_headers = builtin_headers
        self.fail_with = fail_with
        self.compiles: list[tuple[str, ...]] = []
        fake = self

        class RawModule:
            def __init__(self, code, options=()):
                self.code, self.options = code, tuple(options)

            def compile(self):
                fake.compiles.append(self.options)
                if fake.fail_with:
                    raise RuntimeError(fake.fail_with)
                inc = [o[2:] for o in self.options if o.startswith("-I")]
                if not fake.builtin_headers and not any(
                        (Path(d) / "cuda_fp16.h").is_file() for d in inc):
                    raise RuntimeError('rotation.cu(27): catastrophic error: cannot open '
                                       'source file "cuda_fp16.h"')

            def get_function(self, name):
                return name

        class _Runtime:
            @staticmethod
            def getDeviceProperties(i):
                return {"multiProcessorCount": 2, "maxThreadsPerMultiProcessor": 2048}

            @staticmethod
            def getDevice():
                return 0

        class _Cuda:
            runtime = _Runtime

            @staticmethod
            def Device(i):
                return contextlib.nullcontext()

        self.RawModule = RawModule
        self.cuda = _Cuda


@pytest.fixture
def no_header_options(monkeypatch):
    monkeypatch.setattr(cuda_loader, "_extra_options", ())


def test_build_without_extra_headers_passes_no_include(no_header_options):
    cp = _FakeCupy(builtin_headers=True)
    mod = cuda_loader._Module(cp, 0, "__half", ())
    assert "bias_act" in mod.functions
    assert all(not any(o.startswith("-I") for o in opts) for opts in cp.compiles)


def test_missing_headers_are_searched_and_passed(no_header_options, monkeypatch, tmp_path):
    inc = tmp_path / "cuda" / "include"
    inc.mkdir(parents=True)
    for h in cuda_loader.CUDA_HEADERS:
        (inc / h).write_text("// stand-in\n")
    monkeypatch.setattr(cuda_loader, "cuda_include_candidates",
                        lambda: [tmp_path / "nowhere", inc])
    cp = _FakeCupy()
    mod = cuda_loader._Module(cp, 0, "__nv_bfloat16", ())
    assert "bias_residual_layernorm" in mod.functions
    assert cp.compiles[0] == cuda_loader.COMPILE_OPTIONS  # first as CuPy would
    assert cp.compiles[1] == cuda_loader.COMPILE_OPTIONS + (f"-I{inc}",)
    # later builds (another dtype) pass the folder from the start
    cuda_loader._Module(cp, 0, "float", ())
    assert cp.compiles[2] == cuda_loader.COMPILE_OPTIONS + (f"-I{inc}",)


def test_missing_headers_error_lists_where_it_looked(no_header_options, monkeypatch, tmp_path):
    places = [tmp_path / "x" / "include", tmp_path / "y" / "include"]
    monkeypatch.setattr(cuda_loader, "cuda_include_candidates", lambda: places)
    with pytest.raises(cuda_loader.KernelBuildError) as e:
        cuda_loader._Module(_FakeCupy(), 0, "__half", ())
    msg = str(e.value)
    assert "cuda_fp16.h" in msg and str(places[0]) in msg and str(places[1]) in msg
    assert "nvidia-cuda-runtime" in msg and "CUDA_PATH" in msg


def test_other_build_errors_are_not_retried(no_header_options):
    cp = _FakeCupy(fail_with="rotation.cu(99): error: identifier \"oops\" is undefined")
    with pytest.raises(cuda_loader.KernelBuildError, match="oops"):
        cuda_loader._Module(cp, 0, "float", ())
    assert len(cp.compiles) == 1


def test_include_candidates_cover_the_usual_places(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "toolkit"))
    cands = [str(p) for p in cuda_loader.cuda_include_candidates()]
    assert str(tmp_path / "toolkit" / "include") in cands
    assert "/usr/local/cuda/include" in cands
    assert len(cands) == len(set(cands))
