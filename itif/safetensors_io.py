"""A safetensors reader that treats every byte of its input as hostile.

Tenants upload weight files, so this module assumes an adversary wrote them. It never unpickles
anything and validates the whole layout itself before it builds a single tensor; the tensors it
returns are then constructed from exactly the offsets it checked, so no second parser (with its own
idea of what the file means) is ever involved.

File layout (https://github.com/huggingface/safetensors, little endian throughout)::

    [0, 8)          u64 N: length of the JSON header in bytes
    [8, 8 + N)      UTF-8 JSON object {name: {"dtype", "shape", "data_offsets"}, "__metadata__"?}
    [8 + N, EOF)    data section; data_offsets are [begin, end) relative to its start

What is refused (always with :class:`~itif.errors.InvalidWeights` naming the offending value):

* inputs larger than ``Limits.max_file_bytes``, shorter than 8 bytes, or not regular files;
* a header length of 0, above ``Limits.max_header_bytes``, or past the end of the file;
* a header that is not UTF-8, does not start with ``{``, is not a JSON object, repeats a key at any
  depth (serde would silently keep one copy, so two readers could disagree on the file), or uses
  the non-standard constants NaN/Infinity, or holds strings that are not valid Unicode (lone
  surrogate escapes such as ``"\\ud800"``);
* a ``__metadata__`` value that is not a str -> str object;
* more than ``Limits.max_tensors`` tensors, or more JSON objects/arrays than that many tensors
  can use (checked before parsing: json.loads would otherwise turn a 16 MiB header into ~400 MiB
  of Python objects);
* an entry whose keys are not exactly dtype/shape/data_offsets, whose dtype is outside
  :data:`DTYPES`, whose shape is not a list of at most :data:`MAX_RANK` non-negative ints (whose
  product, zeros skipped, must fit int64 so torch can compute strides), or whose ``data_offsets``
  are not ``[begin, end]`` ints with ``end - begin == numel * itemsize``;
* offsets that overlap, leave a hole, run past the data section, or do not reach its end: the
  tensors must tile the data section exactly, as the format specification requires;
* BOOL tensors holding bytes other than 0/1 (torch would otherwise expose an invalid bool);
* with ``check_finite``, floating tensors holding NaN or +/-Inf.

Tensors are decoded as little endian into native memory, so hosts must be little endian (x86-64,
AArch64), which is everything itif runs on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from typing import IO, Any, Union

import safetensors.torch
import torch

from itif.errors import InvalidWeights

__all__ = [
    "DTYPES",
    "MAX_RANK",
    "Limits",
    "TensorInfo",
    "load_safetensors",
    "read_metadata",
    "read_header",
    "save_safetensors",
    "sha256_file",
]

#: safetensors dtype name -> (torch dtype, bytes per element). Anything else is refused.
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})

#: Highest tensor rank accepted. Real weights are at most 5-D; the cap keeps absurd shapes such as
#: ``[0] * 10**6`` (valid JSON, zero bytes of data) from reaching torch.
MAX_RANK = 8

_INT64_MAX = 2**63 - 1
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_METADATA_KEY = "__metadata__"
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})

PathOrBytes = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]


@dataclass(frozen=True)
class Limits:
    """Caps applied before any allocation proportional to attacker-chosen sizes."""

    max_header_bytes: int = 16 * 2**20  # JSON header length cap
    max_tensors: int = 4096
    max_file_bytes: int = 8 * 2**30


@dataclass(frozen=True)
class TensorInfo:
    """One validated header entry.

    ``begin``/``end`` are byte offsets relative to the start of the data section (not the file),
    ``end - begin == prod(shape) * itemsize(dtype)``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class _Source:
    """Random access to the input, either an in-memory buffer or an open regular file.

    Files are read through one descriptor for both header and data, so a file swapped or truncated
    after validation cannot hand us bytes the header check never saw.
    """

    def __init__(self, path_or_bytes: PathOrBytes, limits: Limits) -> None:
        self._buf: memoryview | None = None
        self._file: IO[bytes] | None = None
        if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
            self._buf = memoryview(path_or_bytes).cast("B")
            self.size = self._buf.nbytes
            self.label = "<bytes>"
        elif isinstance(path_or_bytes, (str, os.PathLike)):
            self.label = os.fspath(path_or_bytes)
            # O_NONBLOCK: opening a FIFO planted at this path must not hang the daemon; it is then
            # refused as a non-regular file. The flag has no effect on reads of regular files.
            fd = os.open(path_or_bytes, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise InvalidWeights(f"{self.label!r} is not a regular file")
                self._file = os.fdopen(fd, "rb", buffering=0)
            except BaseException:
                os.close(fd)
                raise
            self.size = st.st_size
        else:
            raise TypeError(f"expected a path or bytes, got {type(path_or_bytes).__name__}")
        if self.size > limits.max_file_bytes:
            self.close()
            raise InvalidWeights(
                f"weights {self.label!r} are {self.size} bytes, above the {limits.max_file_bytes} "
                "byte limit"
            )

    def read(self, offset: int, length: int) -> bytearray:
        """Exactly ``length`` bytes at absolute ``offset`` in a fresh writable buffer."""
        if self._buf is not None:
            out = bytearray(self._buf[offset : offset + length])
            got = len(out)
        else:
            assert self._file is not None
            out = bytearray(length)
            view = memoryview(out)
            self._file.seek(offset)
            got = 0
            # A file shrunk by someone else after fstat() returns short reads, then b"" at EOF.
            while got < length and (n := self._file.readinto(view[got:])):
                got += n
        if got != length:
            raise InvalidWeights(
                f"truncated: {self.label!r} ended after {offset + got} bytes while reading "
                f"{length} bytes at offset {offset}"
            )
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._buf is not None:
            self._buf.release()  # a caller's bytearray stays locked against resizing until then
            self._buf = None

    def __enter__(self) -> _Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _show(value: object) -> str:
    """repr() clipped for messages: names and shapes come from the attacker and may be megabytes."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise InvalidWeights(f"header repeats key {_show(key)}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise InvalidWeights(f"header uses non-standard JSON constant {name}")


def _check_utf8(what: str, text: str) -> None:
    # json accepts "\ud800" escapes; such lone surrogates cannot be encoded back to UTF-8 and would
    # blow up later in logging or gRPC serialisation instead of here.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidWeights(f"{what} {_show(text)} is not valid Unicode") from None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true would pass isinstance(int)


def _parse_entry(name: str, entry: object) -> TensorInfo:
    _check_utf8("tensor name", name)
    if not isinstance(entry, dict):
        raise InvalidWeights(
            f"tensor {_show(name)}: entry must be a JSON object, got {_show(entry)}"
        )
    keys = set(entry)
    if keys != _ENTRY_KEYS:
        missing, extra = sorted(_ENTRY_KEYS - keys), sorted(keys - _ENTRY_KEYS)
        raise InvalidWeights(
            f"tensor {_show(name)}: keys must be {sorted(_ENTRY_KEYS)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {extra}" if extra else "")
        )
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidWeights(
            f"tensor {_show(name)}: unsupported dtype {_show(dtype)} (allowed: {', '.join(DTYPES)})"
        )
    shape = entry["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_RANK
        or not all(_is_int(d) and d >= 0 for d in shape)
    ):
        raise InvalidWeights(
            f"tensor {_show(name)}: shape must be a list of at most {MAX_RANK} non-negative ints, "
            f"got {_show(shape)}"
        )
    offsets = entry["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise InvalidWeights(
            f"tensor {_show(name)}: data_offsets must be [begin, end] non-negative ints with "
            f"begin <= end, got {_show(offsets)}"
        )
    numel = extent = 1
    for d in shape:
        numel *= d
        extent *= max(d, 1)
    # A zero-sized dim makes numel 0 whatever the others are, but torch still computes int64
    # strides from them: [0, 2**40, 2**40] would escape as a RuntimeError from torch.empty.
    if extent > _INT64_MAX:
        raise InvalidWeights(f"tensor {_show(name)}: shape {_show(shape)} overflows int64 strides")
    expected = numel * DTYPES[dtype][1]
    begin, end = offsets
    if end - begin != expected:
        raise InvalidWeights(
            f"tensor {_show(name)}: data_offsets {_show(offsets)} span {end - begin} bytes but "
            f"{dtype} {_show(shape)} needs {expected}"
        )
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _check_layout(infos: dict[str, TensorInfo], data_len: int) -> None:
    """The tensors must tile ``[0, data_len)`` exactly: no overlap, no hole, nothing past it."""
    cursor = 0
    prev = None
    for info in sorted(infos.values(), key=lambda i: (i.begin, i.end)):
        if info.begin < cursor:
            assert prev is not None
            raise InvalidWeights(
                f"tensor {_show(info.name)} [{info.begin}, {info.end}) overlaps "
                f"tensor {_show(prev.name)} "
                f"[{prev.begin}, {prev.end})"
            )
        if info.begin > cursor:
            raise InvalidWeights(
                f"hole in data section: bytes [{cursor}, {info.begin}) before tensor "
                f"{_show(info.name)} belong to no tensor"
            )
        cursor, prev = info.end, info
    if cursor > data_len:
        raise InvalidWeights(f"truncated: expected {cursor} data bytes, file has {data_len}")
    if cursor < data_len:
        raise InvalidWeights(
            f"data section has {data_len} bytes but tensors cover only {cursor}; "
            f"bytes [{cursor}, {data_len}) belong to no tensor"
        )


def _check_container_count(text: str, limits: Limits) -> None:
    """Refuse headers with more JSON objects/arrays than ``max_tensors`` tensors can use.

    json.loads builds objects far larger than their text ("{}," is 3 bytes, a dict 64), so a
    16 MiB header could cost ~400 MiB before any check ran. A valid header has exactly three
    containers per tensor (entry, shape, data_offsets) plus the top-level object and
    ``__metadata__``. Brackets inside strings do not count; the fast raw count settles the usual
    case, and only headers that fail it pay for stripping strings.
    """
    allowed = 3 * limits.max_tensors + 2
    if text.count("{") + text.count("[") <= allowed:
        return
    # Outside strings, valid JSON has no quotes, so the leftmost-match scan finds exactly the
    # string literals json.loads would (and agrees with it up to the point where it would fail).
    bare = _JSON_STRING.sub("", text)
    found = bare.count("{") + bare.count("[")
    if found > allowed:
        raise InvalidWeights(
            f"header holds {found} JSON objects/arrays, more than the {allowed} that "
            f"max_tensors={limits.max_tensors} tensors can use"
        )


def _read_header(src: _Source, limits: Limits,
                 meta_out: dict[str, str] | None = None) -> tuple[dict[str, TensorInfo], int]:
    """Validated entries and the absolute file offset where the data section starts."""
    if src.size < 8:
        raise InvalidWeights(f"{src.label!r} is {src.size} bytes, too short for safetensors")
    (header_len,) = struct.unpack("<Q", src.read(0, 8))
    if header_len == 0 or header_len > limits.max_header_bytes or header_len > src.size - 8:
        raise InvalidWeights(
            f"absurd header length {header_len} (file {src.size} bytes, "
            f"limit {limits.max_header_bytes})"
        )
    raw = src.read(8, header_len)
    if not raw.startswith(b"{"):
        raise InvalidWeights(f"header does not start with '{{': {bytes(raw[:16])!r}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidWeights(f"header is not valid UTF-8 at byte {e.start}") from None
    _check_container_count(text, limits)
    try:
        header = json.loads(
            text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant
        )
    except InvalidWeights:
        raise
    except (ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError and ints beyond sys.get_int_max_str_digits();
        # RecursionError covers deeply nested arrays.
        raise InvalidWeights(f"header is not valid JSON: {str(e):.200}") from None
    if not isinstance(header, dict):
        raise InvalidWeights(f"header must be a JSON object, got {type(header).__name__}")

    metadata = header.pop(_METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise InvalidWeights(f"{_METADATA_KEY} must map str to str, got {_show(metadata)}")
    for k, v in metadata.items():
        _check_utf8(f"{_METADATA_KEY} key", k)
        _check_utf8(f"{_METADATA_KEY}[{_show(k)}]", v)
    if meta_out is not None:
        meta_out.update(metadata)

    if len(header) > limits.max_tensors:
        raise InvalidWeights(
            f"header lists {len(header)} tensors, above max_tensors={limits.max_tensors}"
        )
    infos = {name: _parse_entry(name, entry) for name, entry in header.items()}
    data_start = 8 + header_len
    _check_layout(infos, src.size - data_start)
    return infos, data_start


def read_header(path_or_bytes: PathOrBytes, limits: Limits = Limits()) -> dict[str, TensorInfo]:
    """Parse and fully validate the header of a safetensors file without reading tensor data.

    Returns ``{name: TensorInfo}`` in header order (``__metadata__`` is validated, not returned).
    Raises :class:`InvalidWeights` for any malformed or hostile input; ``OSError`` only when a path
    cannot be opened at all.
    """
    with _Source(path_or_bytes, limits) as src:
        return _read_header(src, limits)[0]


def _build_tensor(info: TensorInfo, buf: bytearray) -> torch.Tensor:
    dtype = DTYPES[info.dtype][0]
    if not buf:  # torch.frombuffer refuses empty buffers
        return torch.empty(info.shape, dtype=dtype)
    if info.dtype == "BOOL":
        bad = int((torch.frombuffer(buf, dtype=torch.uint8) > 1).sum())
        if bad:
            raise InvalidWeights(f"tensor {_show(info.name)} (BOOL) has {bad} bytes other than 0/1")
    # The bytearray is private to this tensor, so the result is writable and shares nothing.
    return torch.frombuffer(buf, dtype=dtype).reshape(info.shape)


def _count_non_finite(t: torch.Tensor) -> int:
    # torch.isfinite is a slow scalar loop on CPU (~0.1 s per 10M values) while a sum is
    # vectorised. NaN and Inf propagate through addition, so a finite sum proves every element
    # finite; only a non-finite sum (a bad value, or finite values overflowing) needs the count.
    # Half types are summed in F32 so ordinary weights do not overflow F16's 65504.
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    if math.isfinite(t.sum(dtype=acc).item()):
        return 0
    return int((~torch.isfinite(t)).sum())


def read_metadata(path_or_bytes: PathOrBytes, limits: Limits = Limits()) -> dict[str, str]:
    """The file's ``__metadata__`` (str -> str), after the whole header is validated."""
    meta: dict[str, str] = {}
    with _Source(path_or_bytes, limits) as src:
        _read_header(src, limits, meta)
    return meta


def load_safetensors(
    path_or_bytes: PathOrBytes, limits: Limits = Limits(), *, check_finite: bool = True
) -> dict[str, torch.Tensor]:
    """Validate (see the module docstring) and load every tensor.

    Returns ``{name: tensor}`` in header order; each tensor is a contiguous, writable CPU tensor
    with the header's dtype and shape, owning its own memory. With ``check_finite`` any NaN/Inf in
    a floating tensor is refused. Raises :class:`InvalidWeights`; ``OSError`` only when a path
    cannot be opened or read.
    """
    with _Source(path_or_bytes, limits) as src:
        infos, data_start = _read_header(src, limits)
        out: dict[str, torch.Tensor] = {}
        for info in infos.values():
            t = _build_tensor(info, src.read(data_start + info.begin, info.nbytes))
            if check_finite and info.dtype in _FLOAT_DTYPES:
                bad = _count_non_finite(t)
                if bad:
                    raise InvalidWeights(
                        f"tensor {_show(info.name)} has {bad} non-finite values (NaN/Inf)"
                    )
            out[info.name] = t
    return out


def save_safetensors(
    tensors: dict[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``tensors`` with the reference implementation (for tests and tools)."""
    safetensors.torch.save_file(tensors, os.fspath(path), metadata=metadata)


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Lowercase hex SHA-256 of the file at ``path``, read ``chunk`` bytes at a time."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
