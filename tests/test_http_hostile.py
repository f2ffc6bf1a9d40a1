"""What a hostile HTTP client found (a review against real daemons), each fixed and kept here:
lone surrogates in JSON strings (500 before), clients that leave mid-body (logged as an internal
error and counted 500), bodies that stall (a call and its admission slot held for ever), gzip
bodies with data after their end (silently dropped), calls of more rows than the tenant's queue
(429 "retry later" though they can never be queued), and BYTES data of millions of elements
(split in Python on the event loop before being refused).

One real daemon (bert-tiny, CPU, HTTP on) with tenant ``acme`` (a 3-label head) and ``one``
(``max_inflight: 1``), through plain sockets and httpx.
"""

from __future__ import annotations

import gzip
import json
import socket
import struct
import time

import pytest

from tests.daemon_harness import http_daemon

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

TOKENS = {"acme": "acme-tok", "one": "one-tok"}
STALL_S = 1.5  # server.http_header_timeout_s of this daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = http_daemon(tmp_path_factory.mktemp("http-hostile"), TOKENS, seed=5,
                    tenant_extra={"one": {"max_inflight": 1}},
                    server_extra={"http_header_timeout_s": STALL_S})
    yield d
    d.stop()


def _post(d, path: str, body, token: str = TOKENS["acme"], headers=None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"http://{d.http}{path}", content=content, timeout=30,
                      headers={"authorization": f"Bearer {token}",
                               "content-type": "application/json", **(headers or {})})


def _ids(n: int = 3) -> dict:
    return {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, n],
                        "data": list(range(5, 5 + n))}]}


def _raw(d, head: bytes) -> socket.socket:
    host, port = d.http.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(head)
    return s


def _answer(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(4096):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    s.close()
    return out


def test_lone_surrogates_are_400_not_500(daemon):
    text = json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1],
                                   "data": ["\ud800"]}]}).encode()  # ensure_ascii: "\\ud800"
    r = _post(daemon, "/v2/models/acme/infer", text)
    assert r.status_code == 400 and "not valid Unicode" in r.text, r.text
    # a request id is echoed in the answer, which is written as ASCII JSON: escaped, not a 500
    r = _post(daemon, "/v2/models/acme/infer", {**_ids(), "id": "r\ud800\u00e9"})
    assert r.status_code == 200 and r.json()["id"] == "r\ud800\u00e9", r.text
    assert "Traceback" not in daemon.logs()


def test_a_client_gone_mid_body_is_not_an_internal_error(daemon):
    """Before: ``ERROR ... ClientDisconnect`` with a traceback, and a 500 counted."""
    head = (f"POST /v2/models/one/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            f"{TOKENS['one']}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    for _ in range(3):
        s = _raw(daemon, head.encode() + b'{"in')
        time.sleep(0.2)
        s.close()
    time.sleep(0.3)
    assert "ClientDisconnect" not in daemon.logs() and "failed" not in daemon.logs()
    assert _post(daemon, "/v2/models/one/infer", _ids(), TOKENS["one"]).status_code == 200


def test_a_stalled_body_is_answered_408_and_frees_its_slot(daemon):
    """Before: the call (and ``one``'s only admission slot) waited for the rest of the body
    for ever, and the tenant was refused 429 meanwhile."""
    head = (f"POST /v2/models/one/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            f"{TOKENS['one']}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    start = time.monotonic()
    s = _raw(daemon, head.encode() + b'{"in')
    time.sleep(0.3)
    assert _post(daemon, "/v2/models/one/infer", _ids(), TOKENS["one"]).status_code == 429
    got = _answer(s)
    assert got.startswith(b"HTTP/1.1 408 "), got[:100]
    assert STALL_S <= time.monotonic() - start < STALL_S + 8
    deadline = time.monotonic() + 10
    while (r := _post(daemon, "/v2/models/one/infer", _ids(), TOKENS["one"])).status_code == 429:
        assert time.monotonic() < deadline, "the stalled call's slot was never freed"
        time.sleep(0.05)
    assert r.status_code == 200, r.text


def test_a_gzip_body_must_be_one_whole_stream(daemon):
    whole = gzip.compress(json.dumps(_ids()).encode())
    gz = {"content-encoding": "gzip"}
    assert _post(daemon, "/v2/models/acme/infer", whole, headers=gz).status_code == 200
    for body, why in ((whole + b"junk", "data after its end"), (whole[:-9], "cut short"),
                      (whole + whole, "data after its end")):
        r = _post(daemon, "/v2/models/acme/infer", body, headers=gz)
        assert r.status_code == 400 and why in r.text, (why, r.status_code, r.text)


def test_more_rows_than_the_queue_holds_is_400_not_retry_later(daemon):
    """max_queue is 64: 65 rows in one call can never be queued (the openai client retried
    the 429 before giving up)."""
    r = _post(daemon, "/v1/embeddings", {"model": "acme", "input": [[5, 6]] * 65})
    assert r.status_code == 400 and "max_queue (64)" in r.text, r.text
    rows = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [65, 2],
                        "data": [5, 6] * 65}]}
    r = _post(daemon, "/v2/models/acme/infer", rows)
    assert r.status_code == 400 and "max_queue (64)" in r.text, r.text
    assert _post(daemon, "/v1/embeddings", {"model": "acme", "input": [[5, 6]] * 64}
                 ).status_code == 200


def test_bytes_data_with_more_elements_than_its_shape_is_refused_at_once(daemon):
    """2,000,000 empty BYTES elements for shape [1]: split one by one on the event loop before
    the count was compared (about a second per 2M; 6 s for the review's 60 MB)."""
    head = json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1],
                                   "parameters": {"binary_data_size": 8_000_000}}]}).encode()
    body = head + struct.pack("<I", 0) * 2_000_000
    r = _post(daemon, "/v2/models/acme/infer", body,
              headers={"inference-header-content-length": str(len(head)),
                       "content-type": "application/octet-stream"})
    assert r.status_code == 400 and "more than 1 BYTES elements" in r.text, r.text


def test_a_refused_upload_does_not_name_the_servers_paths(daemon):
    """The safetensors reader names the file it read: the upload's temporary file under the
    server's data directory, which a tenant has no business knowing."""
    import base64  # noqa: PLC0415

    body = {"parameters": {"file:model.safetensors": base64.b64encode(b"garbage").decode()}}
    r = _post(daemon, "/v2/repository/models/acme/load", body)
    assert r.status_code == 400 and "too short for safetensors" in r.text, r.text
    assert "the upload" in r.text and str(daemon.root) not in r.text and "/tmp" not in r.text


def test_an_upload_not_stored_is_logged_once(daemon, tmp_path):
    """Only successful uploads were logged: a refused file, a wrong sha256, an idle client
    left no line at all (found by an operator's review; gRPC's UploadWeights here)."""
    import grpc  # noqa: PLC0415

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    before = daemon.logs().count("not stored")
    with daemon.client(TOKENS["acme"]) as c, pytest.raises(grpc.RpcError):
        c.upload("acme", bad)
    logs = daemon.logs()
    assert logs.count("not stored") == before + 1
    line = logs[logs.rindex("upload of 7 bytes not stored"):].splitlines()[0]
    assert "INVALID_ARGUMENT" in line and "too short for safetensors" in line, line
