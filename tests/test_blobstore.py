"""BlobStore keeps per-tenant weight files atomic, verified, and leak-free."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from itif.errors import InvalidRequest, InvalidWeights, Overloaded
from itif.weights.blobstore import BlobStore, validate_tenant_id


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def upload(store: BlobStore, tenant: str, data: bytes, chunk: int = 7, **commit_kw) -> Path:
    with store.begin_upload(tenant, sha(data), len(data)) as up:
        for i in range(0, len(data), chunk):
            up.write(data[i : i + chunk])
        return up.commit(**commit_kw)


def tmp_files(store: BlobStore) -> list[str]:
    return sorted(os.listdir(store.data_dir / "tmp"))


def weights_files(store: BlobStore) -> list[str]:
    return sorted(os.listdir(store.data_dir / "weights"))


@pytest.fixture
def store(tmp_path) -> BlobStore:
    return BlobStore(tmp_path / "data", max_upload_bytes=1000)


OLD = b"old weights " * 5
NEW = b"brand new weights " * 3


def test_layout_created(tmp_path):
    BlobStore(tmp_path / "d")
    assert (tmp_path / "d" / "weights").is_dir() and (tmp_path / "d" / "tmp").is_dir()


def test_commit_round_trip(store):
    path = upload(store, "acme", OLD)
    assert path == store.path_for("acme") == store.data_dir / "weights" / "acme.safetensors"
    assert path.read_bytes() == OLD
    assert store.exists("acme") and not store.exists("other")
    assert store.stored_sha256("acme") == sha(OLD)
    assert store.verify("acme") == sha(OLD)
    assert store.tenants() == ["acme"]
    sidecar = (store.data_dir / "weights" / "acme.sha256").read_text()
    assert sidecar == f"{sha(OLD)}  acme.safetensors\n"  # sha256sum -c compatible
    assert tmp_files(store) == []


def test_recommit_replaces_pair(store):
    upload(store, "acme", OLD)
    upload(store, "acme", NEW, chunk=1000)
    assert store.path_for("acme").read_bytes() == NEW
    assert store.verify("acme") == sha(NEW) == store.stored_sha256("acme")
    assert weights_files(store) == ["acme.safetensors", "acme.sha256"]


def test_wrong_sha_refused_old_file_kept(store):
    upload(store, "acme", OLD)
    up = store.begin_upload("acme", sha(b"something else"), len(NEW))
    up.write(NEW)
    with pytest.raises(InvalidWeights, match="sha256 mismatch for tenant 'acme'"):
        up.commit()
    assert store.path_for("acme").read_bytes() == OLD
    assert store.verify("acme") == sha(OLD)
    assert tmp_files(store) == []
    upload(store, "acme", NEW)  # the tenant's upload slot was released


def test_short_upload_refused(store):
    up = store.begin_upload("acme", sha(OLD), len(OLD))
    up.write(OLD[:-1])
    with pytest.raises(InvalidWeights, match=f"got {len(OLD) - 1} of {len(OLD)} bytes"):
        up.commit()
    assert not store.exists("acme") and tmp_files(store) == []


def test_declared_size_over_cap(store):
    with pytest.raises(Overloaded, match="1001 bytes for tenant 'acme' exceeds the 1000 byte"):
        store.begin_upload("acme", sha(b"x"), 1001)
    assert tmp_files(store) == []


def test_writing_past_declared_size_aborts(store):
    up = store.begin_upload("acme", sha(OLD), 10)
    up.write(b"x" * 6)
    with pytest.raises(Overloaded, match="declared size of 10 bytes"):
        up.write(b"x" * 5)
    assert tmp_files(store) == []
    with pytest.raises(InvalidRequest, match="already closed"):
        up.commit()
    assert not store.exists("acme")


@pytest.mark.parametrize(
    "digest, size",
    [("A" * 64, 1), ("a" * 63, 1), ("g" * 64, 1), (None, 1), ("a" * 64, 0), ("a" * 64, -5),
     ("a" * 64, 1.5), ("a" * 64, True)],
)
def test_bad_upload_arguments(store, digest, size):
    with pytest.raises(InvalidRequest):
        store.begin_upload("acme", digest, size)
    assert tmp_files(store) == []
    store.begin_upload("acme", "a" * 64, 1).abort()  # nothing left holding the slot


def test_abort_and_exception_in_with_leave_nothing(store):
    up = store.begin_upload("acme", sha(OLD), len(OLD))
    up.write(OLD[:5])
    assert len(tmp_files(store)) == 1
    up.abort()
    up.abort()  # idempotent
    assert tmp_files(store) == []

    with pytest.raises(RuntimeError, match="client went away"):
        with store.begin_upload("acme", sha(OLD), len(OLD)) as up:
            up.write(OLD[:5])
            raise RuntimeError("client went away")
    assert tmp_files(store) == []

    with store.begin_upload("acme", sha(OLD), len(OLD)) as up:
        up.write(OLD)  # leaving the block without commit() aborts
    assert tmp_files(store) == [] and not store.exists("acme")


def test_validator_runs_on_complete_temp_file_and_can_veto(store):
    upload(store, "acme", OLD)
    seen = []

    def reject(path: Path) -> None:
        seen.append((path.parent.name, path.read_bytes()))
        raise InvalidWeights("tensor 'x' does not fit the backbone")

    with pytest.raises(InvalidWeights, match="does not fit"):
        upload(store, "acme", NEW, validate=reject)
    assert seen == [("tmp", NEW)]
    assert store.path_for("acme").read_bytes() == OLD and store.verify("acme") == sha(OLD)
    assert tmp_files(store) == []
    upload(store, "acme", NEW, validate=lambda p: None)
    assert store.verify("acme") == sha(NEW)


def test_stale_temp_and_pending_cleaned_on_init(tmp_path):
    store = BlobStore(tmp_path)
    upload(store, "acme", OLD)
    # What a process killed mid-upload leaves behind.
    (tmp_path / "tmp" / "acme-k2j4h1.upload").write_bytes(NEW[:3])
    (tmp_path / "tmp" / "junk").write_bytes(b"junk")
    (tmp_path / "weights" / "acme.sha256.pending").write_bytes(b"0123")  # torn intent record
    reopened = BlobStore(tmp_path)
    assert tmp_files(reopened) == []
    assert weights_files(reopened) == ["acme.safetensors", "acme.sha256"]
    assert reopened.verify("acme") == sha(OLD)


def test_crash_between_data_and_sidecar_rename_rolls_forward(tmp_path):
    """Simulate a crash after step 3: new data file, old sidecar, pending record."""
    store = BlobStore(tmp_path)
    upload(store, "acme", OLD)
    real_replace = os.replace
    calls = []

    def crash_on_sidecar(src, dst):
        calls.append(Path(dst).name)
        if Path(dst).name == "acme.sha256":
            raise OSError("simulated crash")
        real_replace(src, dst)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "replace", crash_on_sidecar)
        with pytest.raises(OSError, match="simulated crash"):
            upload(store, "acme", NEW)
    assert calls == ["acme.safetensors", "acme.sha256"]
    # In process the pair is inconsistent, and verify fails closed rather than trusting it.
    with pytest.raises(InvalidWeights, match="fail their sha256 check"):
        store.verify("acme")
    reopened = BlobStore(tmp_path)
    assert reopened.verify("acme") == sha(NEW) == reopened.stored_sha256("acme")
    assert weights_files(reopened) == ["acme.safetensors", "acme.sha256"]


def test_crash_before_data_rename_rolls_back(tmp_path):
    """Simulate a crash after step 2: pending record for the new digest, old pair intact."""
    store = BlobStore(tmp_path)
    upload(store, "acme", OLD)
    pending = tmp_path / "weights" / "acme.sha256.pending"
    pending.write_text(f"{sha(NEW)}  acme.safetensors\n")
    reopened = BlobStore(tmp_path)
    assert not pending.exists()
    assert reopened.verify("acme") == sha(OLD)


def test_failed_data_rename_withdraws_pending(store, monkeypatch):
    upload(store, "acme", OLD)

    def refuse(src, dst):
        raise OSError("EXDEV")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="EXDEV"):
        upload(store, "acme", NEW)
    monkeypatch.undo()
    assert weights_files(store) == ["acme.safetensors", "acme.sha256"]
    assert store.verify("acme") == sha(OLD) and tmp_files(store) == []


def test_interrupted_delete_finished_on_init(tmp_path):
    store = BlobStore(tmp_path)
    upload(store, "acme", OLD)
    (tmp_path / "weights" / "acme.sha256").unlink()  # delete removes the sidecar first
    assert not store.exists("acme") and store.tenants() == []
    BlobStore(tmp_path)
    assert weights_files(store) == []


@pytest.mark.parametrize(
    "tid",
    ["../b", "/abs", "a\x00", "", "Acme", "a/b", "a.b", ".", "..", "-a", "_a", "a\n", " a",
     "a" * 64, 5, None, b"acme"],
)
def test_bad_tenant_ids_refused(store, tid):
    with pytest.raises(InvalidRequest, match="invalid tenant id") as err:
        validate_tenant_id(tid)
    assert repr(tid) in str(err.value)
    for call in (
        lambda: store.path_for(tid),
        lambda: store.begin_upload(tid, "a" * 64, 1),
        lambda: store.exists(tid),
        lambda: store.verify(tid),
        lambda: store.delete(tid),
        lambda: store.stored_sha256(tid),
    ):
        with pytest.raises(InvalidRequest):
            call()
    assert tmp_files(store) == [] and weights_files(store) == []


@pytest.mark.parametrize("tid", ["a", "0", "acme-prod_2", "a" * 63])
def test_good_tenant_ids(tid):
    assert validate_tenant_id(tid) == tid


def test_concurrent_upload_same_tenant_refused(store):
    first = store.begin_upload("acme", sha(OLD), len(OLD))
    with pytest.raises(Overloaded, match="upload already in progress for tenant 'acme'"):
        store.begin_upload("acme", sha(OLD), len(OLD))
    upload(store, "other", NEW)  # other tenants are unaffected
    first.write(OLD)
    first.commit()
    upload(store, "acme", NEW)  # slot free again after commit
    assert store.tenants() == ["acme", "other"]


def test_concurrent_begin_from_threads_admits_exactly_one(store):
    barrier = threading.Barrier(8)
    won, lost = [], []

    def race():
        barrier.wait()
        try:
            won.append(store.begin_upload("acme", sha(OLD), len(OLD)))
        except Overloaded:
            lost.append(1)

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 7
    won[0].abort()


def test_verify_detects_flipped_byte(store):
    path = upload(store, "acme", OLD)
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0x01
    path.write_bytes(raw)
    assert store.stored_sha256("acme") == sha(OLD)  # the record is unchanged...
    with pytest.raises(InvalidWeights, match=f"tenant 'acme' fail their sha256 check.*{sha(OLD)}"):
        store.verify("acme")  # ...but the file no longer matches it


def test_verify_missing_and_corrupt_sidecar(store):
    with pytest.raises(InvalidWeights, match="missing"):
        store.verify("ghost")
    path = upload(store, "acme", OLD)
    sidecar = path.with_suffix(".sha256")
    sidecar.write_text("not a digest\n")
    with pytest.raises(InvalidWeights, match="corrupt"):
        store.verify("acme")
    with pytest.raises(InvalidWeights, match="corrupt"):
        store.stored_sha256("acme")
    sidecar.unlink()
    with pytest.raises(InvalidWeights, match="sidecar .* is missing"):
        store.verify("acme")


def test_delete(store):
    upload(store, "acme", OLD)
    upload(store, "other", NEW)
    assert store.delete("acme") is True
    assert store.delete("acme") is False
    assert not store.exists("acme") and store.stored_sha256("acme") is None
    assert store.tenants() == ["other"]
    assert weights_files(store) == ["other.safetensors", "other.sha256"]


def test_no_fd_leak(store):
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    upload(store, "warmup", OLD)
    before = fds()
    kept = []  # hold every Upload so garbage collection cannot hide a descriptor left open
    for i in range(200):
        up = store.begin_upload("acme", sha(OLD), len(OLD))
        kept.append(up)
        up.write(OLD[:5])
        if i % 4 == 0:
            up.abort()
        elif i % 4 == 1:
            with pytest.raises(InvalidWeights):
                up.commit()  # short
        elif i % 4 == 2:
            with pytest.raises(Overloaded):
                up.write(OLD)  # past the declared size
        else:
            with up:
                pass
        store.verify("warmup")
    upload(store, "acme", OLD)
    assert fds() == before
    assert tmp_files(store) == []


def test_an_unreadable_pending_record_does_not_stop_the_start(tmp_path):
    """A leftover ``.sha256.pending`` that cannot be read (here a directory) leaves that entry
    alone and the store opens: the other tenants' files are served (before: the start failed
    with IsADirectoryError for every tenant)."""
    store = BlobStore(tmp_path / "data", max_upload_bytes=1000)
    upload(store, "acme", OLD)
    (tmp_path / "data" / "weights" / "zz.sha256.pending").mkdir()
    again = BlobStore(tmp_path / "data", max_upload_bytes=1000)
    assert again.verify("acme") == sha(OLD)


def test_a_note_beside_the_committed_file(tmp_path):
    """A note staged before the commit and set after it records what the committed file is
    for; a discarded one leaves the note as it was; a delete removes it; a staged note left by
    a crash is removed at start; a file without a note has None."""
    store = BlobStore(tmp_path / "data", max_upload_bytes=1000)
    upload(store, "acme", OLD)
    assert store.note("acme") is None
    store.stage_note("acme", {"base": "b1", "compress": "none"})
    store.set_note("acme")
    store.stage_note("acme", {"base": "b2", "compress": "none"})
    store.discard_note("acme")
    assert store.note("acme") == {"base": "b1", "compress": "none"}
    (tmp_path / "data" / "weights" / "acme.note.json.tmp").write_text("{half")
    again = BlobStore(tmp_path / "data", max_upload_bytes=1000)
    assert again.note("acme") == {"base": "b1", "compress": "none"}
    assert "acme.note.json.tmp" not in weights_files(again)
    assert again.delete("acme") and again.note("acme") is None
    assert weights_files(again) == []


def test_a_full_disk_refuses_the_upload_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """ENOSPC while streaming or staging the note is RESOURCE_EXHAUSTED (Overloaded), not an
    internal error, and leaves no temp file (before: abort's close re-raised the flush's
    ENOSPC before the temp file was removed, which kept the space used until a restart)."""
    import errno  # noqa: PLC0415

    import itif.weights.blobstore as bs  # noqa: PLC0415

    store = BlobStore(tmp_path / "data", max_upload_bytes=1000)
    up = store.begin_upload("acme", sha(OLD), len(OLD))
    up.write(OLD[:7])

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, _):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.f.close()
            raise OSError(errno.ENOSPC, "No space left on device")

    up._file = Full(up._file)
    with pytest.raises(Overloaded, match="no space left"):
        up.write(OLD[7:])
    assert tmp_files(store) == []
    upload(store, "acme", OLD)  # the slot was given back
    monkeypatch.setattr(bs, "_write_durably", lambda path, data: (
        path.write_bytes(data[:1]), (_ for _ in ()).throw(OSError(errno.ENOSPC, "full"))))
    with pytest.raises(Overloaded, match="no space left"):
        store.stage_note("acme", {"base": None, "compress": "none"})
    assert weights_files(store) == ["acme.safetensors", "acme.sha256"]
