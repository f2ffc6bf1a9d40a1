"""The HTTP port's connections are bounded (``itif.server.http._GuardedH11``): past
``server.http_max_connections`` a new connection closes the oldest idle one (tests/
test_http_idle.py has the rules in detail), and one that has not sent its whole request line
and headers within ``server.http_header_timeout_s`` is closed, so idle or half-sent connections
cannot use up the daemon's file descriptors (before, 50 such connections were all still open
after 20 s, and ~20,000 took gRPC down with EMFILE).
Headers over 16 KiB are answered 431, and the client reads that answer (before: a reset).
"""

from __future__ import annotations

import socket
import time

import pytest

from tests.daemon_harness import Daemon, free_port
from tests.reliability_util import wait_until

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

CAP = 8


def _http_daemon(root, **server) -> Daemon:
    d = Daemon(root / "d", {"t1": "t1-tok"},
               server_extra={"http_listen": f"127.0.0.1:{free_port()}", **server}).start()
    d.http = d.server_extra["http_listen"]
    return d


def _connect(d: Daemon, data: bytes = b"") -> socket.socket:
    host, port = d.http.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    if data:
        s.sendall(data)
    return s


def _is_open(s: socket.socket) -> bool:
    """Whether the server has not closed ``s`` (nothing to read, no EOF, no reset)."""
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        s.setblocking(True)


def _read_to_close(s: socket.socket, timeout: float) -> bytes | None:
    """Everything the server sends before it closes ``s``; None: still open after ``timeout``."""
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(4096):
            out += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return out


def _sockets(d: Daemon) -> int:
    return sum(t.startswith("socket:") for t in d.fds())


def _settled_sockets(d: Daemon, quiet_s: float = 0.3) -> int:
    """The daemon's socket count once it has not changed for ``quiet_s``: the server side of a
    connection the client just closed (``_live``'s) is closed by the daemon a moment later, and
    a base counted before that made the count of new sockets come out one short (a CI run)."""
    n, since = _sockets(d), time.monotonic()
    end = since + 10
    while time.monotonic() - since < quiet_s and time.monotonic() < end:
        time.sleep(0.02)
        m = _sockets(d)
        if m != n:
            n, since = m, time.monotonic()
    return n


def _live(d: Daemon) -> int:
    return httpx.get(f"http://{d.http}/v2/health/live", timeout=5).status_code


def test_connections_past_the_cap_close_the_oldest_idle_ones(tmp_path):
    """Past the cap a new connection closes the oldest idle one, so the descriptors stay
    bounded (before tests/test_http_idle.py's change, the newcomer was answered 503 and closed,
    and idle sockets starved every other client; the refusal when every connection is busy, now
    429 with Retry-After, is shown there)."""
    d = _http_daemon(tmp_path, http_max_connections=CAP, http_header_timeout_s=60)
    held: list[socket.socket] = []
    extra: list[socket.socket] = []
    try:
        assert _live(d) == 200
        base = _settled_sockets(d)
        held = [_connect(d) for _ in range(CAP)]  # idle: they send nothing
        wait_until(lambda: _sockets(d) >= base + CAP, 10, what="the idle sockets accepted")
        for _ in range(3 * CAP):
            extra.append(_connect(d))
            time.sleep(0.05)  # taken in, in order
        for s in held + extra[:-CAP]:
            assert _read_to_close(s, 5) is not None, "an older idle connection was left open"
        assert all(_is_open(s) for s in extra[-CAP:])  # the newest CAP are kept
        assert _sockets(d) <= base + CAP  # the closed ones hold no descriptor
        for s in extra[-2:]:  # two clients go away: their slots serve a normal request
            s.close()
        wait_until(lambda: _sockets(d) <= base + CAP - 2, 10, what="the closed sockets freed")
        assert _live(d) == 200
        assert all(_is_open(s) for s in extra[-CAP:-2])  # with no idle one closed for it
    finally:
        for s in held + extra:
            s.close()
        d.stop()


def test_connections_without_whole_headers_are_closed_after_the_timeout(tmp_path):
    d = _http_daemon(tmp_path, http_header_timeout_s=1.5)
    socks: list[socket.socket] = []
    try:
        assert _live(d) == 200
        bare = _connect(d)
        half_line = _connect(d, b"POST /v2/models/t1/in")
        half_headers = _connect(d, b"POST /v2/models/t1/infer HTTP/1.1\r\nHost: x\r\n")
        # kept alive after a whole request, then half of the next one
        kept = _connect(d, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        kept.settimeout(5)
        assert kept.recv(4096).startswith(b"HTTP/1.1 200 ")
        kept.sendall(b"GET /v2/health/li")
        # slow but within the timeout: its request is answered
        slow = _connect(d, b"GET /v2/health/live HT")
        socks = [bare, half_line, half_headers, kept, slow]
        t0 = time.monotonic()
        time.sleep(0.5)
        slow.sendall(b"TP/1.1\r\nHost: x\r\n\r\n")
        slow.settimeout(5)
        assert slow.recv(4096).startswith(b"HTTP/1.1 200 ")
        for s in (bare, half_line, half_headers, kept):
            assert _read_to_close(s, 10) is not None, "a connection without headers stayed open"
        assert 1.0 < time.monotonic() - t0 < 8
        assert _live(d) == 200
    finally:
        for s in socks:
            s.close()
        d.stop()


def test_headers_over_the_limit_are_answered_431_not_reset(tmp_path):
    """A 1 MB authorization header: before, uvicorn answered 400 and closed with the rest of
    the header unread, so the client saw a connection reset and no answer at all. A 20 KB
    header passed when it came in one read (h11 judged only what it held unparsed)."""
    from itif.server.http import MAX_HEADER_BYTES  # noqa: PLC0415

    d = _http_daemon(tmp_path, http_header_timeout_s=5)
    try:
        url = f"http://{d.http}/v2/models/t1/infer"
        for size in (MAX_HEADER_BYTES + 1, 20_000, 1_000_000):
            r = httpx.post(url, json={}, timeout=10,
                           headers={"authorization": "Bearer " + "x" * size})
            assert r.status_code == 431 and "16384 bytes" in r.text, (size, r.status_code)
        r = httpx.post(url, json={}, timeout=10,  # within the limit: judged on its token
                       headers={"authorization": "Bearer " + "x" * (MAX_HEADER_BYTES // 2)})
        assert r.status_code == 401, r.status_code
        # ill-formed rather than long (its blank line is within the limit): still 400
        s = _connect(d, b"GET / HTTP/1.1\r\nHost x\r\n\r\n" + b"y" * (MAX_HEADER_BYTES * 2))
        got = _read_to_close(s, 10)
        s.close()
        assert got is not None and got.startswith(b"HTTP/1.1 400 "), got
        # a client that never stops sending after its 431 is closed within the header timeout
        s = _connect(d, b"GET / HTTP/1.1\r\nx-big: " + b"z" * (MAX_HEADER_BYTES * 2))
        t0 = time.monotonic()
        s.settimeout(1)
        answer = b""
        while time.monotonic() - t0 < 20:
            try:
                s.sendall(b"z" * 1024)
                answer += s.recv(4096)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.1)
        s.close()
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]
        assert time.monotonic() - t0 < 9  # the 5 s header timeout bounds the linger
        assert _live(d) == 200
    finally:
        d.stop()
