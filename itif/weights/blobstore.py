"""Durable, atomic per-tenant weight files.

Layout under ``data_dir`` (one daemon process owns a ``data_dir``)::

    weights/<tenant>.safetensors      committed weights
    weights/<tenant>.sha256           sidecar, sha256sum format: "<hex>  <tenant>.safetensors\\n"
    weights/<tenant>.sha256.pending   intent record, present only while a commit is in flight
    weights/<tenant>.note.json        what the committed file is for (the caller's; set_note)
    tmp/<tenant>-*.upload             uploads being streamed (same filesystem as weights/)

Tenant ids match :data:`TENANT_ID_RE`, which has no ``.``, so these names never collide.

Crash safety
------------
Two files cannot be replaced in one atomic step, so a commit writes an intent record first and
makes the data-file rename the single commit point:

1. stream into ``tmp/``, then check size and sha256 (:meth:`Upload.seal`);
2. fsync the file, write ``<tenant>.sha256.pending`` (the new digest), fsync it, fsync
   ``weights/``: on a side thread started by the seal, so these fsyncs overlap the caller's
   validation of the sealed file (the daemon's read, checks and probe forward);
3. wait for step 2, ``os.replace`` the upload onto ``<tenant>.safetensors``, fsync ``weights/``
   <- commit point: once this returns the upload may be acknowledged;
4. ``os.replace`` the pending record onto ``<tenant>.sha256`` (no fsync of its own: until the
   next fsync of ``weights/`` makes it durable, a crash leaves the durable pending record of
   step 2 beside the renamed data file, which start-up rolls forward, so the committed upload
   survives either way).

Four fsyncs per commit, one per file written (data, pending record) and two of ``weights/``
(the pending record's name before the rename may happen, the rename before the answer), one of
them after the validation. A validation that refuses the upload withdraws the pending record
(a crash before that leaves a record whose digest names no file there: start-up drops it; or,
for an upload of the very bytes already stored, rolls it forward, which changes nothing).

A crash leaves one of these states, and :class:`BlobStore` settles it on start-up, before anything
reads the pair (``_recover``):

* pending record present (crash between 2 and 4, or during a validation that followed 2): hash
  the data file. If it matches the pending digest the rename in step 3 happened, so roll
  forward (finish step 4); otherwise step 3 did not happen and the old file is still paired
  with the old sidecar, so drop the record. Step 2 is
  durable before step 3 starts, so "new data file, old sidecar" can only exist together with an
  intact pending record naming the new digest; a torn record means step 3 never ran, and as it
  names no digest matching the data file it is dropped.
* data file without a sidecar and without a pending record: a delete was interrupted (delete removes
  the sidecar first), so finish it.
* files in ``tmp/``: uploads that never committed; removed.

Hence after start-up every tenant has either the old data file and old sidecar or the new ones,
never a committed-looking pair that disagrees. Within a running process the pair is only changed
under a lock, and :meth:`BlobStore.verify` snapshots it under the same lock. If a commit fails with
an ``OSError`` after step 3 (say ENOSPC while renaming the sidecar), :meth:`verify` fails closed
until the next start-up settles the pair.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import IO

from itif.errors import Busy, InvalidRequest, InvalidWeights, Overloaded, shown
from itif.safetensors_io import sha256_file
from itif.weights.durable_io import (  # private names: tests patch _write_durably here
    fsync_dir as _fsync_dir,
)
from itif.weights.durable_io import (
    fsync_path as _fsync_path,
)
from itif.weights.durable_io import (
    no_space as _no_space,
)
from itif.weights.durable_io import (
    syncer as _syncer,
)
from itif.weights.durable_io import (
    unlink_quietly as _unlink_quietly,
)
from itif.weights.durable_io import (
    write_durably as _write_durably,
)

log = logging.getLogger("itif.blobstore")

__all__ = ["TENANT_ID_RE", "BlobStore", "Upload", "validate_tenant_id"]

TENANT_ID_RE = r"^[a-z0-9][a-z0-9_-]{0,62}$"
_TENANT_ID = re.compile(TENANT_ID_RE)
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")

_DATA_SUFFIX = ".safetensors"
_SIDECAR_SUFFIX = ".sha256"
_PENDING_SUFFIX = ".sha256.pending"
_UPLOAD_SUFFIX = ".upload"
_NOTE_SUFFIX = ".note.json"
_NOTE_TMP_SUFFIX = ".note.json.tmp"
_CHUNK = 1 << 20

#: Test-only (``kill_at`` of itif.faults): called with the name of each step a commit reaches.
fault_point: Callable[[str], None] = lambda name: None  # noqa: E731 (a one-line local helper)


def validate_tenant_id(tid: object) -> str:
    """Return ``tid`` if it is a valid tenant id, else raise :class:`InvalidRequest` naming it.

    Ids are 1-63 characters of ``[a-z0-9_-]`` starting with a letter or digit, so they are safe as
    file names: no separators, dots, NUL, or upper case (case-insensitive filesystems).
    """
    # fullmatch, not match: "$" alone would accept a trailing "\n".
    if not isinstance(tid, str) or not _TENANT_ID.fullmatch(tid):
        raise InvalidRequest(f"invalid tenant id {shown(tid)}: must match {TENANT_ID_RE}")
    return tid


def _sidecar_line(tenant: str, digest: str) -> bytes:
    return f"{digest}  {tenant}{_DATA_SUFFIX}\n".encode("ascii")


def _parse_digest(raw: bytes) -> str | None:
    """The digest in a sidecar or pending record, or None if the content is torn or foreign."""
    fields = raw.split()
    if not fields:
        return None
    digest = fields[0].decode("ascii", "replace")
    return digest if _SHA256_HEX.fullmatch(digest) else None


class BlobStore:
    """Committed weight files for many tenants under one ``data_dir``.

    Thread-safe. At most one upload per tenant is open at a time (a second one fails fast with
    :class:`Overloaded`). Construction settles any state a crash left behind (module docstring).
    """

    def __init__(
        self, data_dir: str | os.PathLike[str], *, max_upload_bytes: int = 4 * 2**30
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.max_upload_bytes = max_upload_bytes
        self._weights = self.data_dir / "weights"
        self._tmp = self.data_dir / "tmp"
        self._weights.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        # Guards the pair (data file, sidecar) of every tenant and the set of open uploads. Held
        # only for renames, unlinks, opens and fsyncs, never while streaming or hashing.
        self._lock = threading.Lock()
        self._uploading: set[str] = set()
        self._recover()

    # -- paths -------------------------------------------------------------------------------

    def path_for(self, tenant: str) -> Path:
        """``data_dir/weights/<tenant>.safetensors`` (whether or not it exists)."""
        return self._path(tenant, _DATA_SUFFIX)

    def _path(self, tenant: str, suffix: str) -> Path:
        path = self._weights / f"{validate_tenant_id(tenant)}{suffix}"
        # Defence in depth: the id regex already rules out separators and "..".
        if path.parent != self._weights or not path.is_relative_to(self.data_dir):
            raise InvalidRequest(f"tenant id {tenant!r} escapes {self._weights}")
        return path

    # -- queries -----------------------------------------------------------------------------

    def exists(self, tenant: str) -> bool:
        """Whether ``tenant`` has committed weights (data file and sidecar both present)."""
        data, sidecar = self.path_for(tenant), self._path(tenant, _SIDECAR_SUFFIX)
        with self._lock:
            return data.is_file() and sidecar.is_file()

    def stored_sha256(self, tenant: str) -> str | None:
        """The digest recorded at commit, or None if ``tenant`` has no committed weights.

        Raises :class:`InvalidWeights` if the sidecar exists but does not hold a digest.
        """
        data, sidecar = self.path_for(tenant), self._path(tenant, _SIDECAR_SUFFIX)
        with self._lock:
            if not data.is_file():
                return None
            try:
                raw = sidecar.read_bytes()
            except FileNotFoundError:
                return None
        digest = _parse_digest(raw)
        if digest is None:
            raise InvalidWeights(f"sha256 sidecar {sidecar} of tenant {tenant!r} is corrupt")
        return digest

    def verify(self, tenant: str) -> str:
        """Re-hash the stored file and compare it with the sidecar; return the digest.

        Raises :class:`InvalidWeights` if either file is missing, the sidecar is corrupt, or the
        digests differ.
        """
        data, sidecar = self.path_for(tenant), self._path(tenant, _SIDECAR_SUFFIX)
        failed = f"stored weights for tenant {tenant!r} fail their sha256 check"
        # Open the data file and read the sidecar under the lock: the open descriptor pins the
        # inode, so a commit that renames a new file into place afterwards cannot mix the pair.
        with self._lock:
            try:
                f = open(data, "rb", buffering=0)
            except FileNotFoundError:
                raise InvalidWeights(f"{failed}: {data} is missing") from None
            try:
                raw = sidecar.read_bytes()
            except FileNotFoundError:
                f.close()
                raise InvalidWeights(f"{failed}: sidecar {sidecar} is missing") from None
        with f:
            actual = hashlib.file_digest(f, "sha256").hexdigest()
        recorded = _parse_digest(raw)
        if recorded is None:
            raise InvalidWeights(f"{failed}: sidecar {sidecar} is corrupt")
        if actual != recorded:
            raise InvalidWeights(f"{failed}: sidecar records {recorded}, file hashes to {actual}")
        return actual

    def tenants(self) -> list[str]:
        """Sorted ids of tenants with committed weights."""
        with self._lock:
            return sorted(
                p.name[: -len(_DATA_SUFFIX)]
                for p in self._weights.iterdir()
                if p.name.endswith(_DATA_SUFFIX)
                and _TENANT_ID.fullmatch(p.name[: -len(_DATA_SUFFIX)])
                and p.with_name(p.name[: -len(_DATA_SUFFIX)] + _SIDECAR_SUFFIX).is_file()
            )

    # -- mutations ---------------------------------------------------------------------------

    def begin_upload(self, tenant: str, expected_sha256: str, total_size: int) -> Upload:
        """Open an upload of exactly ``total_size`` bytes whose SHA-256 must be ``expected_sha256``.

        Raises :class:`InvalidRequest` for a bad id, digest (64 lowercase hex) or size <= 0,
        :class:`Overloaded` if ``total_size`` exceeds ``max_upload_bytes`` or an upload for this
        tenant is already open.
        """
        validate_tenant_id(tenant)
        if not isinstance(expected_sha256, str) or not _SHA256_HEX.fullmatch(expected_sha256):
            raise InvalidRequest(
                f"expected_sha256 {expected_sha256!r:.80} for tenant {tenant!r} is not "
                "64 lowercase hex digits"
            )
        if not isinstance(total_size, int) or isinstance(total_size, bool) or total_size <= 0:
            raise InvalidRequest(
                f"upload size {total_size!r} for tenant {tenant!r} must be a positive int"
            )
        if total_size > self.max_upload_bytes:
            raise Overloaded(
                f"upload of {total_size} bytes for tenant {tenant!r} exceeds the "
                f"{self.max_upload_bytes} byte limit"
            )
        with self._lock:
            if tenant in self._uploading:
                raise Busy(f"upload already in progress for tenant {tenant!r}")
            self._uploading.add(tenant)
        try:
            return Upload(self, tenant, expected_sha256, total_size)
        except BaseException:
            self.end_upload(tenant)
            raise

    def stage_note(self, tenant: str, note: dict) -> None:
        """Write, durably, the note of a file about to be committed (what it is for: the
        daemon's ``base`` and ``compress``), beside the current one; before the commit point,
        so a full disk fails the upload, not its note. :meth:`set_note` puts it in place."""
        tmp = self._path(tenant, _NOTE_TMP_SUFFIX)
        try:
            _write_durably(tmp, json.dumps(note, sort_keys=True).encode())
        except BaseException as e:
            _unlink_quietly(tmp)
            raise _no_space(e) from e

    def set_note(self, tenant: str) -> None:
        """After the commit point: the staged note (:meth:`stage_note`) replaces the current one
        (a rename: no space needed). Should even that fail, the old note goes, and the file is
        taken for what the configuration says. A crash before it leaves the previous note."""
        path, tmp = self._path(tenant, _NOTE_SUFFIX), self._path(tenant, _NOTE_TMP_SUFFIX)
        with self._lock:
            try:
                os.replace(tmp, path)
                _fsync_dir(self._weights)
            except OSError as e:
                log.error("weights store: the note of %s could not be put in place (%s); "
                          "dropped", tenant, e)
                _unlink_quietly(path)
                _unlink_quietly(tmp)

    def discard_note(self, tenant: str) -> None:
        """Drop a staged note whose upload did not commit."""
        _unlink_quietly(self._path(tenant, _NOTE_TMP_SUFFIX))

    def note(self, tenant: str) -> dict | None:
        """The note of the committed file (:meth:`set_note`); None when there is none, or it
        cannot be read."""
        try:
            note = json.loads(self._path(tenant, _NOTE_SUFFIX).read_bytes())
        except (OSError, ValueError):
            return None
        return note if isinstance(note, dict) else None

    def delete(self, tenant: str) -> bool:
        """Remove the tenant's weights (and their note) durably; return whether it had any."""
        data, sidecar = self.path_for(tenant), self._path(tenant, _SIDECAR_SUFFIX)
        with self._lock:
            _unlink_quietly(self._path(tenant, _NOTE_SUFFIX))
            # Sidecar first: once it is gone the tenant no longer counts as committed, and start-up
            # finishes a delete interrupted before the data file went.
            had_sidecar = _unlink_quietly(sidecar)
            _fsync_dir(self._weights)
            had_data = _unlink_quietly(data)
            _fsync_dir(self._weights)
        return had_sidecar or had_data

    # -- an Upload's steps (the commit protocol of the module docstring) ---------------------

    @property
    def tmp_dir(self) -> Path:
        """``data_dir/tmp``, where uploads stream (emptied at start-up)."""
        return self._tmp

    def end_upload(self, tenant: str) -> None:
        """The tenant's upload is over (published or aborted): another one may begin."""
        with self._lock:
            self._uploading.discard(tenant)

    def stage_upload(self, tenant: str, upload_path: Path, digest: str) -> None:
        """Step 2 of the commit protocol (module docstring): the upload's data and the intent
        record durable, the record's name too. Runs on a sync thread while the caller
        validates; without the store's lock (the record is this tenant's and only its one open
        upload writes it), except to settle a record a failed commit left behind."""
        pending = self._path(tenant, _PENDING_SUFFIX)
        if pending.exists():  # an earlier commit failed after its rename (verify fails closed)
            with self._lock:
                self._settle(tenant)
        _fsync_path(upload_path)
        _write_durably(pending, _sidecar_line(tenant, digest))
        _fsync_dir(self._weights)

    def publish_upload(self, upload: Upload) -> Path:
        """Steps 3-4 of the commit protocol (module docstring); step 2 is done."""
        tenant = upload.tenant
        data = self.path_for(tenant)
        sidecar = self._path(tenant, _SIDECAR_SUFFIX)
        pending = self._path(tenant, _PENDING_SUFFIX)
        with self._lock:
            try:
                fault_point("commit_pending")
                os.replace(upload.temp_path, data)
                upload.renamed = True  # the pending record is the commit's now (start-up)
                # One fsync suffices: journaling filesystems commit a rename as one transaction,
                # so making it durable in weights/ also removes the name from tmp/.
                _fsync_dir(self._weights)
                fault_point("commit_renamed")
                os.replace(pending, sidecar)
                fault_point("commit_done")
            except BaseException:
                if not upload.renamed:  # old pair untouched: just withdraw the intent record
                    _unlink_quietly(pending)
                raise
        return data

    def withdraw_upload(self, tenant: str) -> None:
        """Remove the tenant's intent record (step 2) of an upload aborted before step 3."""
        _unlink_quietly(self._path(tenant, _PENDING_SUFFIX))

    def _settle(self, tenant: str) -> None:
        """Settle ``tenant``'s pending record (caller holds the lock or owns the directory):
        roll forward if the data file hashes to its digest, else drop it."""
        pending = self._weights / f"{tenant}{_PENDING_SUFFIX}"
        data = self._weights / f"{tenant}{_DATA_SUFFIX}"
        try:
            digest = _parse_digest(pending.read_bytes())
        except FileNotFoundError:
            return
        if digest is not None and data.is_file() and sha256_file(data, _CHUNK) == digest:
            os.replace(pending, self._weights / f"{tenant}{_SIDECAR_SUFFIX}")
        else:
            pending.unlink()
        _fsync_dir(self._weights)

    def _recover(self) -> None:
        """Settle what a crash left behind (see "Crash safety" in the module docstring)."""
        for entry in self._tmp.iterdir():
            if entry.is_file() or entry.is_symlink():
                entry.unlink()
        for pending in self._weights.glob(f"*{_PENDING_SUFFIX}"):
            try:
                self._settle(pending.name[: -len(_PENDING_SUFFIX)])
            except OSError as e:  # one tenant's unreadable record: that tenant's, not the start's
                log.error("weights store: cannot settle %s, left as it is: %s", pending, e)
        for tmp in self._weights.glob(f"*{_NOTE_TMP_SUFFIX}"):  # a note never renamed in
            _unlink_quietly(tmp)
        for data in self._weights.glob(f"*{_DATA_SUFFIX}"):
            stem = data.name[: -len(_DATA_SUFFIX)]
            if data.is_file() and not (self._weights / f"{stem}{_SIDECAR_SUFFIX}").exists():
                data.unlink()
        _fsync_dir(self._weights)
        _fsync_dir(self._tmp)


class Upload:
    """One streaming upload: :meth:`write` chunks, then :meth:`commit` or :meth:`abort`.

    Also a context manager; leaving the ``with`` block without a successful :meth:`commit` aborts.
    Not meant to be shared between threads.
    """

    def __init__(self, store: BlobStore, tenant: str, expected_sha256: str, total_size: int):
        self.tenant = tenant
        self.expected_sha256 = expected_sha256
        self.total_size = total_size
        self.written = 0
        self._store = store
        self._hash = hashlib.sha256()
        self._digest: str | None = None  # set by seal()
        self._staged: Future | None = None  # step 2 of the commit, started by seal()
        #: Step 3 done (``BlobStore.publish_upload`` sets it): the pending record belongs to the
        #: commit, and an abort leaves it for start-up to settle.
        self.renamed = False
        fd, name = tempfile.mkstemp(prefix=f"{tenant}-", suffix=_UPLOAD_SUFFIX, dir=store.tmp_dir)
        self.temp_path = Path(name)
        try:
            self._file: IO[bytes] = os.fdopen(fd, "wb")
        except BaseException:
            os.close(fd)
            self.temp_path.unlink()
            raise
        self._open = True

    def _check_open(self) -> None:
        if not self._open:
            raise InvalidRequest(f"upload for tenant {self.tenant!r} is already closed")

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        """Append ``chunk``. Exceeding the declared size aborts and raises :class:`Overloaded`."""
        self._check_open()
        if self._digest is not None:
            raise InvalidRequest(f"upload for tenant {self.tenant!r} is sealed")
        n = memoryview(chunk).nbytes
        if self.written + n > self.total_size:
            self.abort()
            raise Overloaded(
                f"upload for tenant {self.tenant!r} exceeds its declared size of "
                f"{self.total_size} bytes (got at least {self.written + n})"
            )
        try:
            self._file.write(chunk)
        except BaseException as e:
            self.abort()
            raise _no_space(e) from e
        self._hash.update(chunk)
        self.written += n

    def commit(self, validate: Callable[[Path], object] | None = None) -> Path:
        """Check size and digest, run ``validate(temp_path)``, then publish atomically.

        Returns the final path. On any failure the upload is aborted (temp file removed, previous
        committed weights untouched) and the error re-raised: :class:`InvalidWeights` for a short
        upload or digest mismatch, whatever ``validate`` raised otherwise.
        """
        self.seal()
        if validate is not None:
            try:
                validate(self.temp_path)
            except BaseException:
                self.abort()
                raise
        return self.publish()

    def seal(self) -> str:
        """Check size and digest and start making the temp file and the intent record durable
        (step 2 of the commit, on a sync thread); return the digest. After this
        :attr:`temp_path` is complete and may be read (validated) before :meth:`publish`, which
        waits for step 2. On a failure the upload is aborted and :class:`InvalidWeights`
        raised."""
        self._check_open()
        if self._digest is not None:
            return self._digest
        try:
            if self.written != self.total_size:
                raise InvalidWeights(
                    f"upload for tenant {self.tenant!r} is incomplete: got {self.written} of "
                    f"{self.total_size} bytes"
                )
            digest = self._hash.hexdigest()
            if digest != self.expected_sha256:
                raise InvalidWeights(
                    f"sha256 mismatch for tenant {self.tenant!r}: expected "
                    f"{self.expected_sha256}, upload hashes to {digest}"
                )
            self._file.close()  # flushed; the sync thread fsyncs it
            self._staged = _syncer().submit(self._store.stage_upload, self.tenant, self.temp_path,
                                            digest)
        except BaseException as e:
            self.abort()
            raise _no_space(e) from e
        self._digest = digest
        return digest

    def _wait_staged(self) -> None:
        """Wait for step 2 (re-raising what it raised)."""
        if self._staged is not None:
            self._staged.result()

    def replace_content(self, data: bytes) -> str:
        """After :meth:`seal` (the upload as sent was checked): make the commit store ``data``
        instead, durably (a delta tenant stores its compressed form, not the checkpoint).
        Returns the digest :meth:`publish` records for it."""
        self.seal()
        try:
            self._wait_staged()
            digest = hashlib.sha256(data).hexdigest()
            with open(self.temp_path, "wb") as f:
                f.write(data)
            self._store.stage_upload(self.tenant, self.temp_path, digest)  # the record names it
        except BaseException:
            self.abort()
            raise
        self._digest = digest
        return digest

    def publish(self) -> Path:
        """Seal if not yet sealed, wait for step 2, then make the upload the tenant's
        committed weights (the commit point of the module docstring). Aborts on failure."""
        self.seal()
        try:
            self._wait_staged()
            path = self._store.publish_upload(self)
        except BaseException:
            self.abort()
            raise
        self._open = False
        self._store.end_upload(self.tenant)
        return path

    def abort(self) -> None:
        """Discard the upload. Idempotent; a no-op after a successful :meth:`commit`."""
        if not self._open:
            return
        self._open = False
        try:
            try:
                self._file.close()
            except OSError:  # a full disk fails the flush of buffered bytes: removed all the same
                pass
            if self._staged is not None:
                try:
                    self._staged.result()  # it may still be writing the record
                except BaseException:  # noqa: BLE001 - withdrawn below all the same
                    pass
                if not self.renamed:
                    self._store.withdraw_upload(self.tenant)
            _unlink_quietly(self.temp_path)
        finally:
            self._store.end_upload(self.tenant)

    def __enter__(self) -> Upload:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()
