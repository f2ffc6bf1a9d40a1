"""The commit's durable writes overlap the caller's validation (``itif.weights.blobstore``,
"Crash safety"): the seal starts step 2 (data fsync, intent record, fsync of ``weights/``) on a
sync thread; the commit waits for it, renames and fsyncs ``weights/`` once. What must still
hold: four fsyncs per commit, all of step 2 done before the rename, a refused upload leaves no
intent record, a crash during the validation keeps the old pair, and a record a failed commit
left behind is settled before the next upload's record replaces it."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from itif.errors import InvalidWeights
from itif.weights import blobstore
from itif.weights.blobstore import BlobStore

OLD = b"old weights " * 5
NEW = b"brand new weights " * 3
NEWER = b"newer still " * 4


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sealed(store: BlobStore, tenant: str, data: bytes):
    up = store.begin_upload(tenant, sha(data), len(data))
    up.write(data)
    up.seal()
    return up


def pending_of(store: BlobStore, tenant: str):
    return store.data_dir / "weights" / f"{tenant}.sha256.pending"


def test_four_fsyncs_per_commit_and_step_two_before_the_rename(tmp_path, monkeypatch):
    store = BlobStore(tmp_path)
    events: list[str] = []
    lock = threading.Lock()
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        with lock:
            events.append("fsync")
        return real_fsync(fd)

    def replace(src, dst):
        with lock:
            events.append(f"replace {os.path.basename(dst)}")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    up = sealed(store, "acme", NEW)
    up._staged.result()  # step 2 alone: the data file, the record, weights/
    assert events == ["fsync"] * 3 and pending_of(store, "acme").read_text().startswith(sha(NEW))
    up.publish()
    assert events == ["fsync"] * 3 + ["replace acme.safetensors", "fsync", "replace acme.sha256"]
    assert store.verify("acme") == sha(NEW) and not pending_of(store, "acme").exists()


def test_publish_waits_for_step_two(tmp_path, monkeypatch):
    """The rename never overtakes the record: publish blocks until the sync thread is done."""
    store = BlobStore(tmp_path)
    gate = threading.Event()
    real_stage = store.stage_upload

    def slow_stage(*a):
        gate.wait(5)
        return real_stage(*a)

    monkeypatch.setattr(store, "stage_upload", slow_stage)
    up = sealed(store, "acme", NEW)
    done = threading.Event()
    t = threading.Thread(target=lambda: (up.publish(), done.set()))
    t.start()
    assert not done.wait(0.2) and not store.exists("acme")
    gate.set()
    t.join(5)
    assert done.is_set() and store.verify("acme") == sha(NEW)


def test_refused_upload_withdraws_its_record(tmp_path):
    store = BlobStore(tmp_path)
    with store.begin_upload("acme", sha(OLD), len(OLD)) as up:
        up.write(OLD)
        up.commit()

    def reject(path):
        up2._staged.result()
        assert pending_of(store, "acme").exists()  # step 2 ran beside the validation
        raise InvalidWeights("non-finite logits on the probe input")

    up2 = store.begin_upload("acme", sha(NEW), len(NEW))
    up2.write(NEW)
    with pytest.raises(InvalidWeights, match="non-finite"):
        up2.commit(validate=reject)
    assert sorted(os.listdir(tmp_path / "weights")) == ["acme.safetensors", "acme.sha256"]
    assert os.listdir(tmp_path / "tmp") == [] and store.verify("acme") == sha(OLD)
    with store.begin_upload("acme", sha(NEW), len(NEW)) as up3:  # the tenant is free again
        up3.write(NEW)
        up3.commit()
    assert store.verify("acme") == sha(NEW)


def test_crash_during_validation_keeps_the_old_pair(tmp_path):
    """Step 2 is durable while the caller still validates; a start-up then (the new process
    sees the record, the old data file and the upload in tmp/) drops the record."""
    store = BlobStore(tmp_path)
    with store.begin_upload("acme", sha(OLD), len(OLD)) as up:
        up.write(OLD)
        up.commit()
    up = sealed(store, "acme", NEW)
    up._staged.result()
    assert pending_of(store, "acme").exists()
    reopened = BlobStore(tmp_path)  # what a restart after a crash here finds
    assert sorted(os.listdir(tmp_path / "weights")) == ["acme.safetensors", "acme.sha256"]
    assert reopened.verify("acme") == sha(OLD) and os.listdir(tmp_path / "tmp") == []


def test_record_left_by_a_failed_commit_is_settled_before_the_next(tmp_path, monkeypatch):
    """A commit that failed after its rename (the sidecar rename refused) leaves new data, the
    old sidecar and its record; the next upload's record must not replace that record before
    it is rolled forward, or a crash then would leave a pair that disagrees."""
    store = BlobStore(tmp_path)
    with store.begin_upload("acme", sha(OLD), len(OLD)) as up:
        up.write(OLD)
        up.commit()
    real_replace = os.replace

    def refuse_sidecar(src, dst):
        if os.path.basename(dst) == "acme.sha256":
            raise OSError("ENOSPC")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", refuse_sidecar)
    with pytest.raises(OSError, match="ENOSPC"):
        with store.begin_upload("acme", sha(NEW), len(NEW)) as up:
            up.write(NEW)
            up.commit()
    monkeypatch.undo()
    assert pending_of(store, "acme").read_text().startswith(sha(NEW))  # kept: it is the commit's
    up = sealed(store, "acme", NEWER)
    up._staged.result()
    # settled first (rolled forward to NEW), then NEWER's record written
    assert store.verify("acme") == sha(NEW)
    assert pending_of(store, "acme").read_text().startswith(sha(NEWER))
    assert BlobStore(tmp_path).verify("acme") == sha(NEW)  # a crash here: NEW, consistent


def test_delta_style_replace_content_records_the_new_digest(tmp_path):
    store = BlobStore(tmp_path)
    up = sealed(store, "acme", NEW)
    digest = up.replace_content(NEWER)
    assert digest == sha(NEWER)
    assert pending_of(store, "acme").read_text().startswith(sha(NEWER))
    up.publish()
    assert store.verify("acme") == sha(NEWER) and store.path_for("acme").read_bytes() == NEWER


def test_a_failing_step_two_fails_the_commit_and_leaves_the_old_pair(tmp_path, monkeypatch):
    store = BlobStore(tmp_path)
    with store.begin_upload("acme", sha(OLD), len(OLD)) as up:
        up.write(OLD)
        up.commit()

    def broken(*a):
        raise OSError("EIO")

    monkeypatch.setattr(blobstore, "_write_durably", broken)
    with pytest.raises(OSError, match="EIO"):
        with store.begin_upload("acme", sha(NEW), len(NEW)) as up:
            up.write(NEW)
            up.commit()
    assert sorted(os.listdir(tmp_path / "weights")) == ["acme.safetensors", "acme.sha256"]
    assert store.verify("acme") == sha(OLD) and os.listdir(tmp_path / "tmp") == []
