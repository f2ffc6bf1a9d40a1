"""The CLI's error contract without a daemon (CPU, fast, in-process).

A bad flag value is an argparse usage error naming the flag (exit 2, nothing started); any other
local failure is one stderr line ``error: <STATUS>: <message>`` and exit 1 (itif/cli.py's
docstring, docs/tenant.md). Nothing here connects anywhere: the checks run before a call.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from itif.cli import main

REMOTE = ["--server", "127.0.0.1:1", "--token", "t", "--tenant", "acme"]


def usage_error(capsys, argv: list[str], flag: str, says: str = "") -> str:
    """Exit 2 with argparse's ``itif <cmd>: error: argument <flag>: ...`` as the last line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"itif {argv[0]}: error: argument {flag}: "), last
    assert says in last, last
    return last


def one_error_line(capsys, argv: list[str], prefix: str) -> str:
    """Exit 1 with exactly one stderr line, starting ``prefix``."""
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(prefix), err
    return err


@pytest.fixture
def no_demo_no_plan(monkeypatch):
    """Stand-ins for the demo and the planner: a value that got past argparse reaches them."""
    ran = []
    demo = types.ModuleType("itif.demo")
    demo.run_demo = lambda **kw: ran.append(("demo", kw)) or 0
    report = types.ModuleType("itif.calibration.plan_report")
    report.plan_report = lambda *a, **kw: ran.append(("plan", a, kw)) or {}
    monkeypatch.setitem(sys.modules, "itif.demo", demo)
    monkeypatch.setitem(sys.modules, "itif.calibration.plan_report", report)
    return ran


# ---- 1: malformed values are usage errors naming the flag ----------------------------------------
@pytest.mark.parametrize("cmd", ["infer", "generate"])
@pytest.mark.parametrize("ids, says", [("1,a", "not an integer: 'a'"),
                                        ("99999999999999999999", "int64"),
                                        ("5,-9223372036854775809", "int64")])
def test_bad_token_ids(capsys, cmd, ids, says):
    usage_error(capsys, [cmd, *REMOTE, "--ids", ids], "--ids", says)


def test_good_values_parse():
    from itif.cli import build_parser

    args = build_parser().parse_args(["infer", *REMOTE, "--ids", " 1, 2,,9223372036854775807",
                                      "--timeout", "0.5"])
    assert args.ids == [1, 2, 2**63 - 1] and args.timeout == 0.5


@pytest.mark.parametrize("flag", ["--seed", "--eos-token-id", "--max-new-tokens"])
def test_generate_int_flags_fit_int64(capsys, flag):
    usage_error(capsys, ["generate", *REMOTE, "--ids", "1", flag, str(2**63)], flag, "int64")


@pytest.mark.parametrize("value", ["0", "-5"])
def test_chunk_bytes_must_be_positive(capsys, tmp_path, value):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x")
    usage_error(capsys, ["upload", *REMOTE, "--chunk-bytes", value, str(f)], "--chunk-bytes")


@pytest.mark.parametrize("flag", ["--tenants", "--requests", "--threads"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_plan_counts_must_be_positive(capsys, no_demo_no_plan, flag, value):
    usage_error(capsys, ["plan", flag, value], flag, ">= 1")
    assert not no_demo_no_plan


def test_plan_seed_is_not_negative(capsys, no_demo_no_plan):
    usage_error(capsys, ["plan", "--seed", "-1"], "--seed", ">= 0")
    assert not no_demo_no_plan


# ---- 1, 6: files that cannot be read, and a --ca that is not PEM -------------------------------
@pytest.mark.parametrize("what", ["missing", "directory"])
def test_upload_file_unreadable(capsys, tmp_path, what):
    path = tmp_path / "nope.safetensors" if what == "missing" else tmp_path
    err = one_error_line(capsys, ["upload", *REMOTE, "--quiet", str(path)],
                         f"error: INVALID_ARGUMENT: cannot read {path}: ")
    assert ("No such file" if what == "missing" else "directory") in err


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_ca_unreadable(capsys, tmp_path, what):
    path = tmp_path / "ca.pem" if what == "missing" else tmp_path
    one_error_line(capsys, ["infer", *REMOTE, "--ids", "1", "--ca", str(path)],
                   f"error: INVALID_ARGUMENT: cannot read {path}: ")


def test_ca_not_pem(capsys, tmp_path):
    path = tmp_path / "ca.pem"
    path.write_bytes(b"not a certificate\n")
    err = one_error_line(capsys, ["tenants", "--server", "127.0.0.1:1", "--token", "t",
                                  "--ca", str(path)], "error: INVALID_ARGUMENT: ")
    assert str(path) in err and "-----BEGIN CERTIFICATE-----" in err


# ---- 2: demo counts are checked before a daemon starts ------------------------------------------
@pytest.mark.parametrize("argv", [["--tenants", "0"], ["--requests", "-1"]])
def test_demo_counts_checked_at_parse_time(capsys, no_demo_no_plan, argv):
    usage_error(capsys, ["demo", *argv], argv[0])
    assert not no_demo_no_plan  # the demo (its daemon, its uploads) never started


# ---- 3: upload's FILE / --adapter: neither and both say different things ---------------------
def test_upload_neither_file_nor_adapter(capsys):
    with pytest.raises(SystemExit) as e:
        main(["upload", *REMOTE])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "itif upload: error: give a weights FILE or --adapter DIR"


def test_upload_both_file_and_adapter(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["upload", *REMOTE, str(tmp_path / "w"), "--adapter", str(tmp_path)])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "itif upload: error: give a weights FILE or --adapter DIR, not both"


# ---- 4: --timeout is finite and > 0 -----------------------------------------------------------
@pytest.mark.parametrize("cmd", ["infer", "generate"])
@pytest.mark.parametrize("value", ["inf", "nan", "1e300", "0", "-1"])
def test_bad_timeout(capsys, cmd, value):
    usage_error(capsys, [cmd, *REMOTE, "--ids", "1", "--timeout", value], "--timeout",
                "finite, > 0")


# ---- 5: a tenant that is not UTF-8, a token that gRPC metadata cannot carry --------------------
def test_tenant_not_utf8(capsys, tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x")
    usage_error(capsys, ["upload", "--server", "127.0.0.1:1", "--token", "t",
                         "--tenant", "ac\udce9", str(f)], "--tenant", "UTF-8")


def test_client_upload_checks_the_tenant_before_the_call(tmp_path):
    from itif.client import Client
    from itif.errors import InvalidRequest

    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x")
    with Client("127.0.0.1:1", "t") as c, pytest.raises(InvalidRequest, match="UTF-8"):
        c.upload("ac\udce9", f, timeout=5)


@pytest.mark.parametrize("token", ["tökén", "a\nb", "tab\there"])
def test_token_must_be_printable_ascii(capsys, token):
    from itif.client import Client
    from itif.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="printable ASCII") as e:
        Client("127.0.0.1:1", token)
    assert token not in str(e.value)  # a secret is not echoed
    err = one_error_line(capsys, ["infer", "--server", "127.0.0.1:1", "--token", token,
                                  "--tenant", "acme", "--ids", "1"],
                         "error: INVALID_ARGUMENT: --token: ")
    assert "printable ASCII" in err


# ---- 7: bench --out is checked before anything runs -------------------------------------------
def test_bench_out_directory(capsys, tmp_path, monkeypatch):
    boom = types.ModuleType("itif.platform")  # the bench gets no further than --out

    def ran(*a, **kw):
        raise AssertionError("the bench started before checking --out")

    boom.resolve_device = boom.resolve_dtype = boom.tune_host_malloc = ran
    monkeypatch.setitem(sys.modules, "itif.platform", boom)
    out = tmp_path / "results"
    out.mkdir()
    err = one_error_line(capsys, ["bench", "--quick", "--out", str(out)],
                         f"error: INVALID_ARGUMENT: --out {out}: ")
    assert "directory" in err
    assert not (tmp_path / "results.tmp").exists()


def test_bench_out_checks(tmp_path):
    from itif.bench.cli import check_out
    from itif.errors import InvalidRequest

    check_out(str(tmp_path / "new" / "deeper" / "x.json"))  # missing directories are made
    (tmp_path / "x.json.tmp").mkdir()
    with pytest.raises(InvalidRequest, match="x.json.tmp is a directory"):
        check_out(str(tmp_path / "x.json"))
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidRequest, match="is not a directory"):
        check_out(str(tmp_path / "file" / "x.json"))


# ---- 8: infer's text output rounds -----------------------------------------------------------
def test_infer_text_output_is_rounded(capsys, monkeypatch):
    import itif.client

    class FakeClient:
        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def infer(self, *a, **kw):
            return {"logits": np.array([[0.2338, -1.1]], "<f4"),
                    "pooled": np.full(20, 0.1, "<f4")}

    monkeypatch.setattr(itif.client, "Client", FakeClient)
    assert main(["infer", *REMOTE, "--ids", "1,2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["logits [1, 2]: [[0.2338, -1.1]]",
                   "pooled [20]: [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, '...']"]


@pytest.mark.parametrize("cmd", ["tenants", "upload"])
def test_a_server_that_never_answers_ends_at_the_deadline(capsys, tmp_path, cmd):
    """A wedged server (accepted by the kernel, never answered): ``itif tenants`` and
    ``itif upload`` waited for ever; now ``tenants`` has a 30 s default deadline and both take
    ``--timeout``."""
    import socket  # noqa: PLC0415
    import time  # noqa: PLC0415

    with socket.socket() as wedged:
        wedged.bind(("127.0.0.1", 0))
        wedged.listen(8)  # connections complete in the backlog; nothing reads them
        server = ["--server", f"127.0.0.1:{wedged.getsockname()[1]}", "--token", "t"]
        argv = ["tenants", *server, "--timeout", "1"]
        if cmd == "upload":
            f = tmp_path / "w.safetensors"
            f.write_bytes(b"x" * 100)
            argv = ["upload", *server, "--tenant", "acme", "--quiet", "--timeout", "1", str(f)]
        start = time.monotonic()
        one_error_line(capsys, argv, "error: DEADLINE_EXCEEDED")
        assert time.monotonic() - start < 15
