"""Watch a tenants.yaml and report each new valid config (:class:`ConfigWatcher`)."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from itif import threadnames
from itif.config.parse import decode, parse_config
from itif.config.schema import Config
from itif.errors import InvalidConfig

__all__ = ["ConfigWatcher"]

log = logging.getLogger("itif.config")

_MISSING = "<missing>"


class ConfigWatcher:
    """Polls a tenants.yaml and reports each new valid config.

    Every ``poll_s`` a daemon thread stats the path (following links), its ``realpath`` and the
    link itself; when any of that changed (or at least every ``max(1 s, 10*poll_s)``, for
    file systems with coarse mtimes) it reads the content and hashes it. That catches in-place
    rewrites, editors' write-temp-then-rename and Kubernetes' atomic ``..data`` symlink swap.

    New content is acted on only once it has been unchanged for ``debounce_s`` (so half-written
    files are never parsed), and only once per content change: it is parsed and validated in full
    (relative paths resolve against the directory of ``path`` as given, not of its realpath);
    then ``on_change(config)`` is called. If validation fails, or ``on_change`` raises (e.g. it
    ran :func:`diff_configs` and the change needs a restart), ``on_error(exc)`` is called and
    :attr:`last_good` keeps the previous config. A missing file is reported the same way.

    :meth:`start` reads the current file synchronously as the baseline: without ``initial`` it
    only sets :attr:`last_good` (or :attr:`last_error`, and calls ``on_error``); with ``initial``
    (the config the caller already loaded) it calls ``on_change`` if the file no longer matches
    it. Callbacks run on the watcher thread (the baseline ones on the caller's); exceptions from
    ``on_error`` are logged, never propagated.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_change: Callable[[Config], None],
        on_error: Callable[[Exception], None],
        poll_s: float = 0.5,
        debounce_s: float = 0.2,
        *,
        initial: Config | None = None,
    ) -> None:
        if not (poll_s > 0 and math.isfinite(poll_s)):
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        if not (debounce_s >= 0 and math.isfinite(debounce_s)):
            raise ValueError(f"debounce_s must be >= 0, got {debounce_s}")
        self._path = Path(path).absolute()
        self._source = str(path)
        self._on_change = on_change
        self._on_error = on_error
        self._poll_s = float(poll_s)
        self._debounce_s = float(debounce_s)
        self._rescan_s = max(1.0, 10 * self._poll_s)
        self._initial = initial
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_good: Config | None = initial
        self._last_error: Exception | None = None
        self._seen: str | None = None  # digest of the content last acted on
        self._pending: tuple[str, float] | None = None  # (digest, first seen, monotonic)
        self._sig: tuple[Any, ...] | None = None
        self._last_read = 0.0

    # -- public ------------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._path

    @property
    def last_good(self) -> Config | None:
        with self._lock:
            return self._last_good

    @property
    def last_error(self) -> Exception | None:
        """The error of the latest attempt; ``None`` once a later content applied cleanly."""
        with self._lock:
            return self._last_error

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def start(self) -> ConfigWatcher:
        if self._thread is not None:
            raise RuntimeError("ConfigWatcher already started")
        self._stop_event.clear()
        self._sig = self._signature()
        self._last_read = time.monotonic()
        digest, data = self._read()
        self._seen = digest
        self._apply(data, baseline=True)
        self._thread = threading.Thread(target=self._run, name="itif-config-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop polling and join the thread (a callback in progress finishes first)."""
        self._stop_event.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        self._thread = None

    def __enter__(self) -> ConfigWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------------------------

    def _run(self) -> None:
        threadnames.adopt()
        while not self._stop_event.wait(self._poll_s):
            try:
                self._poll_once()
            except Exception:  # never let the watcher die
                log.exception("config watcher: unexpected error while polling %s", self._source)

    def _poll_once(self) -> None:
        """One polling step; only the watcher thread calls this."""
        now = time.monotonic()
        sig = self._signature()
        if sig == self._sig and self._pending is None and now - self._last_read < self._rescan_s:
            return
        self._sig = sig
        self._last_read = now
        digest, data = self._read()
        if self._pending is None or self._pending[0] != digest:
            if digest == self._seen:
                self._pending = None  # changed back before it settled
                return
            self._pending = (digest, now)
        if now - self._pending[1] < self._debounce_s:
            return
        self._pending = None
        self._seen = digest
        if self._stop_event.is_set():
            return
        self._apply(data, baseline=False)

    @staticmethod
    def _stat(p: str | Path, follow: bool = True) -> tuple[Any, ...]:
        try:
            s = os.stat(p) if follow else os.lstat(p)
        except OSError as e:
            return ("error", e.errno)
        return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)

    def _signature(self) -> tuple[Any, ...]:
        real = os.path.realpath(self._path)
        return (
            self._stat(self._path),
            self._stat(self._path, follow=False),
            real,
            self._stat(real),
        )

    def _read(self) -> tuple[str, bytes | Exception | None]:
        try:
            data = self._path.read_bytes()
        except FileNotFoundError:
            return _MISSING, None
        except OSError as e:
            return f"<error {e.errno}>", e
        return hashlib.sha256(data).hexdigest(), data

    def _apply(self, data: bytes | Exception | None, *, baseline: bool) -> None:
        try:
            if data is None:
                raise InvalidConfig(f"{self._source}: config file not found")
            if isinstance(data, Exception):
                raise InvalidConfig(f"{self._source}: cannot read config: {data}")
            cfg = parse_config(decode(data, self._source), self._path.parent, source=self._source)
        except Exception as e:
            self._report(e)
            return
        if baseline and (self._initial is None or cfg == self._initial):
            with self._lock:
                self._last_good = cfg
                self._last_error = None
            return
        try:
            self._on_change(cfg)
        except Exception as e:
            self._report(e)
            return
        with self._lock:
            self._last_good = cfg
            self._last_error = None

    def _report(self, exc: Exception) -> None:
        with self._lock:
            self._last_error = exc
        log.debug("config reload rejected: %s", exc)  # on_error reports it (the daemon: once)
        try:
            self._on_error(exc)
        except Exception:
            log.exception("config watcher: on_error callback failed")
