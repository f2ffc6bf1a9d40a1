"""What a result file records about where and how it was measured."""

from __future__ import annotations

import datetime
import os
import platform
import re
import sys
from importlib import metadata

import torch

from itif.platform import device_name, host_malloc


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cupy_version() -> str | None:
    """CuPy's version under whichever wheel name it was installed (the H100 image has
    cupy-cuda13x; pyproject's ``gpu`` extra names cupy-cuda12x)."""
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        v = _version(dist)
        if v is not None:
            return v
    return None


def collect_meta(device: torch.device, dtype: torch.dtype, peak, args, settings: dict) -> dict:
    import itif  # noqa: PLC0415

    meta = dict(
        device=device_name(device), device_type=device.type,
        dtype=str(dtype).removeprefix("torch."),
        cpu=_cpu_model(), cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
        load_average=[round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="itif bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else
                                         sys.argv[1:]),
        versions=dict(itif=itif.__version__, python=platform.python_version(),
                      torch=torch.__version__, cuda=torch.version.cuda,
                      transformers=_version("transformers"), numpy=_version("numpy"),
                      grpcio=_version("grpcio"), cupy=_cupy_version()),
        platform=platform.platform(), peak=peak.as_dict(), settings=settings,
        host_malloc=host_malloc())
    if device.type == "cuda":
        meta["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return meta


def result_name(device: torch.device, date: str) -> str:
    """``<device>-<yyyy-mm-dd>``, e.g. ``nvidia-h100-80gb-hbm3-2025-01-31``."""
    name = device_name(device) if device.type == "cuda" else f"cpu-{os.cpu_count()}cores"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"{slug}-{date[:10]}"
