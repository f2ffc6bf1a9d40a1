"""The safetensors reader accepts well-formed files and refuses hostile ones with InvalidWeights."""

from __future__ import annotations

import hashlib
import json
import pickle
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from itif.errors import InvalidWeights
from itif.safetensors_io import (
    MAX_RANK,
    Limits,
    TensorInfo,
    load_safetensors,
    read_header,
    save_safetensors,
    sha256_file,
)


def build(header: dict | str | bytes, data: bytes = b"", *, header_len: int | None = None) -> bytes:
    """Hand-assemble a safetensors file; ``header`` may be raw text/bytes to express bad JSON."""
    if isinstance(header, dict):
        header = json.dumps(header)
    raw = header.encode() if isinstance(header, str) else header
    n = len(raw) if header_len is None else header_len
    return struct.pack("<Q", n) + raw + data


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def one_f32(values: list[float]) -> bytes:
    """A valid file holding one F32 tensor 'w'."""
    data = struct.pack(f"<{len(values)}f", *values)
    return build({"w": entry("F32", [len(values)], 0, len(data))}, data)


def refused(blob: bytes, match: str, **kw) -> None:
    with pytest.raises(InvalidWeights, match=match):
        load_safetensors(blob, **kw)


# -- accepted files ------------------------------------------------------------------------------


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(4, generator=g).half(),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "f64": torch.randn(2, 2, 2, generator=g).double(),
        "i64": torch.arange(-3, 4),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "i16": torch.tensor([-32768, 0, 32767], dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }


@pytest.mark.parametrize("as_path", [True, False])
def test_round_trip_all_dtypes(tmp_path, as_path):
    tensors = sample_tensors()
    path = tmp_path / "w.safetensors"
    save_safetensors(tensors, path, metadata={"format": "pt"})
    out = load_safetensors(path if as_path else path.read_bytes())
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype, name
        assert out[name].shape == t.shape, name
        assert torch.equal(out[name], t), name
        assert out[name].is_contiguous() and out[name].device.type == "cpu"


def test_header_matches_reference_layout(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "w.safetensors"
    save_safetensors(tensors, path)
    infos = read_header(path)
    assert read_header(path.read_bytes()) == infos
    begin = infos["i32"].begin
    assert infos["i32"] == TensorInfo("i32", "I32", (2, 3), begin, begin + 24)
    assert infos["scalar"].shape == () and infos["scalar"].nbytes == 4
    spans = sorted((i.begin, i.end) for i in infos.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_tensors_are_independent_and_writable():
    blob = build(
        {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 8, 16)},
        struct.pack("<4f", 1, 2, 3, 4),
    )
    src = bytearray(blob)
    out = load_safetensors(src)
    out["a"][0] = 100.0  # would raise or warn on a read-only buffer
    src[-4:] = struct.pack("<f", 9.0)
    assert out["a"].tolist() == [100.0, 2.0]
    assert out["b"].tolist() == [3.0, 4.0]


def test_header_only_with_metadata_and_no_tensors():
    assert load_safetensors(build({"__metadata__": {"k": "v"}})) == {}


def test_reference_library_can_read_what_we_accept():
    blob = one_f32([1.0, -2.0])
    assert torch.equal(safetensors.torch.load(blob)["w"], load_safetensors(blob)["w"])


def test_sha256_file(tmp_path):
    path = tmp_path / "x"
    path.write_bytes(b"abc" * 1000)
    assert sha256_file(path, chunk=7) == hashlib.sha256(b"abc" * 1000).hexdigest()


# -- refused files -------------------------------------------------------------------------------


@pytest.mark.parametrize("blob", [b"", b"\x01", b"1234567"])
def test_shorter_than_8_bytes(blob):
    refused(blob, "too short")


@pytest.mark.parametrize("n", [0, 2**64 - 1, 17 * 2**20, 10**6])
def test_absurd_header_length(n):
    blob = build({"w": entry("U8", [1], 0, 1)}, b"\x00", header_len=n)
    refused(blob, f"absurd header length {n}")


def test_header_length_limit_is_configurable():
    blob = one_f32([1.0])
    refused(blob, "absurd header length", limits=Limits(max_header_bytes=8))


def test_file_size_limit():
    blob = one_f32([1.0] * 64)
    refused(blob, f"{len(blob)} bytes, above the 100 byte limit", limits=Limits(max_file_bytes=100))


@pytest.mark.parametrize(
    "header, match",
    [
        (b"{\xff}", "not valid UTF-8"),
        ('{"w": ', "not valid JSON"),
        ("[1, 2]", "start with"),
        (" {}", "start with"),
        ('{"a": NaN}', "NaN"),
        ('{"__metadata__": {"k": 1}}', "__metadata__ must map str to str"),
        ('{"__metadata__": ["k"]}', "__metadata__ must map str to str"),
        ('{"__metadata__": {"k": "\\ud800"}}', "not valid Unicode"),
        ('{"\\udfff": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}', "not valid Unicode"),
        ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "100001 JSON objects/arrays"),
        ('{"w": {"dtype": "U8", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 0]}}', "JSON"),
    ],
)
def test_bad_json(header, match):
    refused(build(header), match)


def test_deep_nesting_within_container_budget():
    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    refused(build(deep), "not valid JSON", limits=Limits(max_tensors=10**6))


def test_duplicate_tensor_keys():
    e = json.dumps(entry("U8", [1], 0, 1))
    refused(build(f'{{"w": {e}, "w": {e}}}', b"\x00"), "repeats key 'w'")


def test_duplicate_nested_keys():
    refused(
        build('{"w": {"dtype": "U8", "dtype": "F32", "shape": [1], "data_offsets": [0, 1]}}', b"1"),
        "repeats key 'dtype'",
    )


def test_100k_tiny_tensors_refused():
    n = 100_000
    header = {f"t{i}": entry("U8", [1], i, i + 1) for i in range(n)}
    refused(build(header, bytes(n)), f"{3 * n + 1} JSON objects/arrays.*max_tensors=4096")


def test_many_scalar_entries_refused_by_count():
    header = {f"t{i}": i for i in range(5000)}
    refused(build(header), "header lists 5000 tensors, above max_tensors=4096")


def test_container_count_ignores_brackets_in_strings():
    meta = {"config": "[{" * 10_000}
    blob = build({"__metadata__": meta, "[{": entry("U8", [0], 0, 0)})
    assert list(load_safetensors(blob, Limits(max_tensors=1))) == ["[{"]
    hidden = '{"__metadata__": {"x": "\\"}, "a": ' + "[" * 20 + "]" * 20 + "}"
    refused(build(hidden), "22 JSON objects/arrays", limits=Limits(max_tensors=1))


def test_max_tensors_boundary():
    header = {f"t{i}": entry("U8", [1], i, i + 1) for i in range(3)}
    assert len(load_safetensors(build(header, bytes(3)), Limits(max_tensors=3))) == 3
    refused(build(header, bytes(3)), "max_tensors=2", limits=Limits(max_tensors=2))


@pytest.mark.parametrize("dtype", ["F8_E4M3", "U16", "C64", "f32", "", 7, None])
def test_bad_dtype(dtype):
    header = {"w": {"dtype": dtype, "shape": [1], "data_offsets": [0, 1]}}
    refused(build(header, b"\0"), f"unsupported dtype {dtype!r}")


@pytest.mark.parametrize(
    "shape", [[-1], [1.0], [True], "4", None, [[1]], [1] * (MAX_RANK + 1)]
)
def test_bad_shape(shape):
    header = {"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, 1]}}
    refused(build(header, b"\0"), "shape must be a list")


@pytest.mark.parametrize("offsets", [[1, 0], [0], [0, 1, 2], [-1, 0], [0, 1.0], "0,1", [0, None]])
def test_bad_offsets(offsets):
    header = {"w": {"dtype": "U8", "shape": [1], "data_offsets": offsets}}
    refused(build(header, b"\0"), "data_offsets must be")


@pytest.mark.parametrize("shape", [[0, 2**40, 2**40], [0, 2**63], [2**64, 0]])
def test_empty_shape_with_huge_dims(shape):
    refused(build({"w": entry("F32", shape, 0, 0)}), "overflows int64 strides")


def test_messages_clip_attacker_sized_values():
    name = "n" * 1_000_000
    with pytest.raises(InvalidWeights, match="unsupported dtype 'Q'") as err:
        load_safetensors(build({name: entry("Q", [1], 0, 1)}, b"\0"))
    assert "nnnn..." in str(err.value) and len(str(err.value)) < 300


def test_offsets_must_match_shape():
    refused(build({"w": entry("F32", [2], 0, 4)}, bytes(4)), "span 4 bytes but F32 \\[2\\] needs 8")


@pytest.mark.parametrize(
    "e, match",
    [
        ({"dtype": "U8", "shape": [1]}, "missing \\['data_offsets'\\]"),
        ({**entry("U8", [1], 0, 1), "extra": 1}, "unexpected \\['extra'\\]"),
        ([1], "must be a JSON object"),
    ],
)
def test_bad_entry_keys(e, match):
    refused(build({"w": e}, b"\0"), match)


def test_truncated_file():
    blob = one_f32([1.0, 2.0, 3.0])
    refused(blob[:-5], "truncated: expected 12 data bytes, file has 7")


def test_truncated_file_on_disk(tmp_path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(one_f32([1.0, 2.0])[:-1])
    with pytest.raises(InvalidWeights, match="truncated"):
        read_header(path)


def test_overlapping_offsets():
    blob = build(
        {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12)
    )
    refused(blob, "'b' \\[4, 12\\) overlaps tensor 'a' \\[0, 8\\)")


def test_aliasing_offsets():
    blob = build({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 0, 4)}, bytes(4))
    refused(blob, "overlaps")


def test_hole_between_tensors():
    blob = build({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 4, 6)}, bytes(6))
    refused(blob, "hole in data section: bytes \\[2, 4\\)")


def test_trailing_bytes_after_last_tensor():
    refused(one_f32([1.0]) + b"junk", "tensors cover only 4")


def test_bool_must_be_0_or_1():
    refused(build({"m": entry("BOOL", [3], 0, 3)}, b"\x00\x01\x02"), "'m' \\(BOOL\\) has 1 bytes")


DTYPE = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64"])
def test_non_finite_refused(tmp_path, dtype, bad):
    t = torch.tensor([1.0, bad, 2.0, bad]).to(DTYPE[dtype])
    path = tmp_path / "nf.safetensors"
    save_safetensors({"layer.0.w": t}, path)
    with pytest.raises(InvalidWeights, match="tensor 'layer.0.w' has 2 non-finite values"):
        load_safetensors(path)
    unchecked = load_safetensors(path, check_finite=False)["layer.0.w"]
    assert int((~torch.isfinite(unchecked)).sum()) == 2


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64"])
def test_huge_finite_values_accepted(tmp_path, dtype):
    # Except for F16 (summed in F32) the sum overflows, so the exact count must find nothing.
    t = torch.full((64,), torch.finfo(DTYPE[dtype]).max, dtype=DTYPE[dtype])
    path = tmp_path / "big.safetensors"
    save_safetensors({"w": t}, path)
    assert torch.equal(load_safetensors(path)["w"], t)


def test_not_a_regular_file(tmp_path):
    with pytest.raises(InvalidWeights, match="not a regular file"):
        load_safetensors(tmp_path)


class Payload:
    """Unpickling this creates ``marker``: a stand-in for arbitrary code execution."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_files_are_refused_without_being_executed(tmp_path):
    # Prove the payload is live: plain unpickling does create its marker.
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Payload(str(probe)))).close()
    assert probe.exists()

    marker = tmp_path / "pwned"
    raw_pickle = tmp_path / "raw.pkl"
    raw_pickle.write_bytes(pickle.dumps({"w": Payload(str(marker))}, protocol=5))
    torch_zip = tmp_path / "torch.bin"
    torch.save({"w": Payload(str(marker))}, torch_zip)  # what a *.bin / *.pt checkpoint holds
    for path in (raw_pickle, torch_zip, raw_pickle.read_bytes(), torch_zip.read_bytes()):
        with pytest.raises(InvalidWeights):
            load_safetensors(path)
        with pytest.raises(InvalidWeights):
            read_header(path)
    assert not marker.exists()


# -- fuzzing -------------------------------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALID = build(
    {
        "__metadata__": {"format": "pt"},
        "a": entry("F32", [2, 2], 0, 16),
        "b": entry("I64", [1], 16, 24),
        "c": entry("BOOL", [2], 24, 26),
        "d": entry("BF16", [1], 26, 28),
    },
    struct.pack("<4f", 1, 2, 3, 4) + struct.pack("<q", 7) + b"\x01\x00" + b"\x80\x3f",
)


def _only_invalid_weights(blob: bytes) -> None:
    try:
        out = load_safetensors(blob)
    except InvalidWeights:
        return
    # Whatever we accept, the reference implementation reads the same way.
    ref = safetensors.torch.load(blob)
    assert set(ref) == set(out)
    for name in out:
        assert torch.equal(ref[name], out[name])


def test_fuzz_seed_is_valid():
    assert load_safetensors(VALID)["d"].item() == 1.0


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(blob):
    _only_invalid_weights(blob)


@FUZZ
@given(st.binary(max_size=256))
def test_fuzz_random_header_with_plausible_length(body):
    _only_invalid_weights(struct.pack("<Q", len(body)) + body)


@FUZZ
@given(
    st.lists(
        st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8
    ),
    st.none() | st.integers(0, len(VALID)),
)
def test_fuzz_mutations_of_valid_file(flips, cut):
    blob = bytearray(VALID)
    for pos, value in flips:
        blob[pos] = value
    _only_invalid_weights(bytes(blob if cut is None else blob[:cut]))


_json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
_json = st.recursive(
    _json_scalar,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


_entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "U8", "BOOL", "I16", "X"]),
        "shape": st.lists(st.sampled_from([0, 1, 3, -1, 2**40, 2**63, 2**64]), max_size=4),
        "data_offsets": st.just([0, 0]) | st.lists(st.integers(-1, 24), min_size=2, max_size=2),
    }
)


_metadata = st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2) | _json


@FUZZ
@given(
    st.dictionaries(st.sampled_from(["a", "b"]), _entry | _json, max_size=2),
    st.none() | st.tuples(_metadata),  # None: no __metadata__ key at all
    st.just(b"") | st.binary(max_size=24),
)
def test_fuzz_structured_headers(tensors, metadata, data):
    header = tensors if metadata is None else {"__metadata__": metadata[0], **tensors}
    _only_invalid_weights(build(header, data))
