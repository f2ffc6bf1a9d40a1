"""``itif bench --suites decoder`` (itif/bench/decoder_peer.py) at CI size, without vLLM.

CI has no vLLM: its row must come back ``skipped`` with the reason and never count in a ratio.
The itif and HF + PEFT rows are measured for real on a small random Llama with PEFT adapters
and a full fine-tune: every itif sequence must equal HF + PEFT's, every request must get
exactly its new tokens, and the tokens/s and ratio fields must follow from the measured times.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from itif.bench import decoder_peer as dp  # noqa: E402

SMALL = dp.DecoderSettings(adapters=3, full=1, prompts=8, new_tokens=5, repeats=2)


@pytest.fixture
def no_vllm(monkeypatch):
    """``import vllm`` raises ImportError (a None entry in sys.modules), vLLM installed or not."""
    for name in ("vllm", "vllm.inputs", "vllm.lora", "vllm.lora.request"):
        monkeypatch.setitem(sys.modules, name, None)


def _check_measured(row: dict, cfg: dp.DecoderSettings) -> None:
    """tokens/s is the generated tokens over the median of the recorded times."""
    assert row["status"] == "ok", row
    assert row["repeats"] == cfg.repeats == len(row["times_ms"])
    assert row["generated_tokens"] == cfg.prompts * cfg.new_tokens
    assert row["exact_new_tokens"] is True
    med = float(np.median(row["times_ms"]))
    assert row["latency_ms"] == pytest.approx(med, abs=1e-3)
    assert row["tokens_per_s"] == pytest.approx(row["generated_tokens"] / med * 1e3, abs=0.1)
    best = min(row["times_ms"])
    assert row["tokens_per_s_best"] == pytest.approx(row["generated_tokens"] / best * 1e3,
                                                     abs=0.1)


def test_decoder_rows_without_vllm(no_vllm):
    rows = dp.run_suite(SMALL)
    by = {r["system"]: r for r in rows}
    assert set(by) == {"itif", "hf", "vllm"}
    v = by["vllm"]
    assert v["status"] == "skipped" and "vllm is not importable" in v["reason"]
    assert v["tokens_per_s"] is None
    for s in ("itif", "hf"):
        _check_measured(by[s], SMALL)
        assert by[s]["tenants"] == 4 and by[s]["model"].startswith("llama-h128")
    me = by["itif"]
    assert me["compared"] == SMALL.prompts and me["equal_to_hf"] == SMALL.prompts, me["differs"]
    assert me["vs_hf"] == pytest.approx(me["tokens_per_s"] / by["hf"]["tokens_per_s"], abs=1e-3)
    assert me["vs_hf_best"] == pytest.approx(
        me["tokens_per_s_best"] / by["hf"]["tokens_per_s_best"], abs=1e-3)
    assert "vs_vllm" not in me and "vs_vllm_best" not in me  # a skipped row is never a ratio's
    assert "vs_hf" not in by["hf"]


def test_adapters_change_what_the_base_generates():
    """The comparison means something: each adapter's prompts generate otherwise than its base
    would, and the full fine-tune otherwise than the base too."""
    cfg = dp.DecoderSettings(adapters=3, full=1, prompts=4, new_tokens=6)
    t = dp.build_tenants(cfg)
    try:
        reqs = dp.dec_requests(cfg, t.names)
        assert [r.tenant for r in reqs] == ["l0", "l1", "l2", "f0"]
        assert all(16 <= len(r.input_ids) <= 64 and min(r.input_ids) >= 2 for r in reqs)
        hf = dp.HFPeft(t, cfg.new_tokens)
        hf.load(reqs)
        hf.run()
        with t.peft.disable_adapter():
            plain = [dp._hf_generate(t.peft, [r.input_ids], cfg.new_tokens)[0] for r in reqs]
        assert all(a != b for a, b in zip(hf.out, plain)), (hf.out, plain)
        assert t.kinds["l1"] == dict(targets=dp.ADAPTER_KINDS[1][0], rank=16, alpha=32)
    finally:
        t.close()


class _FakeHF:
    """HF + PEFT's unbatched answers, for :func:`decoder_peer._measured`."""

    def __init__(self, alone):
        self._alone = alone

    def alone(self, i):
        return self._alone[i]


def test_differing_sequences_are_counted_and_checked_alone():
    from itif.generation.api import GenerateRequest  # noqa: PLC0415

    reqs = [GenerateRequest("l0", [5, 6], max_new_tokens=3) for _ in range(3)]
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    out = [[1, 2, 3], [4, 9, 9], [7, 8, 1]]
    alone = {1: [4, 9, 9], 2: [7, 8, 9]}  # row 1: batched HF was the odd one out
    row = dp._measured({}, [10.0, 30.0, 20.0], out, ref, _FakeHF(alone), reqs)
    assert row["equal_to_hf"] == 1 and row["compared"] == 3
    assert row["latency_ms"] == 20.0 and row["tokens_per_s"] == pytest.approx(450.0)
    d = {x["prompt"]: x for x in row["differs"]}
    assert d[1]["first_diff"] == 1 and d[1]["equals_hf_alone"] and not d[1][
        "hf_batched_equals_alone"]
    assert d[2]["first_diff"] == 2 and not d[2]["equals_hf_alone"]
    assert d[2]["hf_batched_equals_alone"]


def test_cli_decoder_quick_writes_json_with_skipped_vllm(tmp_path):
    """The command line end to end in a fresh process where vllm cannot be imported."""
    out = tmp_path / "dec.json"
    code = ("import sys; sys.modules['vllm'] = None; from itif.cli import main; "
            "sys.exit(main(['bench', '--suites', 'decoder', '--quick', '--repeats', '1', "
            f"'--no-plots', '--out', {str(out)!r}]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "vLLM rows skipped" in p.stderr
    doc = json.loads(out.read_text())
    by = {r["system"]: r for r in doc["rows"]}
    assert by["vllm"]["status"] == "skipped"
    assert by["itif"]["equal_to_hf"] == by["itif"]["compared"] == 6
    assert by["itif"]["vs_hf"] == pytest.approx(
        by["itif"]["tokens_per_s"] / by["hf"]["tokens_per_s"], abs=1e-3)
    dec = doc["meta"]["settings"]["decoder"]
    assert (dec["adapters"], dec["full"], dec["prompts"], dec["new_tokens"]) == (2, 1, 6, 4)
    assert dec["shape"]["hidden_size"] == 128 and set(dec["adapter_kinds"]) == {"l0", "l1"}
    assert "vllm_env" in dec


@pytest.mark.parametrize("flags, says", [
    (["--dec-prompts", "0"], "--dec-prompts"),
    (["--dec-new-tokens", "100"], "--dec-new-tokens 100"),
    (["--dec-adapters", "0", "--dec-full", "0"], "--dec-adapters"),
])
def test_cli_decoder_rejects_bad_flags(tmp_path, capsys, flags, says):
    from itif.cli import main  # noqa: PLC0415

    out = tmp_path / "x.json"
    assert main(["bench", "--suites", "decoder", *flags, "--no-plots", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and says in err
    assert not out.exists()


def test_dec_shape_device_and_dtype_flags_parse():
    """``--dec-shape``, ``--device`` and ``--dtype`` reach the suite's settings (the GPU run of
    issue 66 is one command: a typo there costs device minutes)."""
    import argparse  # noqa: PLC0415

    from itif.bench.cli import add_arguments  # noqa: PLC0415

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--suites", "decoder", "--dec-shape", "llama3-8b-l2",
                         "--device", "cuda", "--dtype", "bfloat16"])
    cfg = dp.settings_from_args(args, False, "cuda", "bfloat16")
    assert (cfg.device, cfg.dtype) == ("cuda", "bfloat16")
    s = cfg.shape
    assert (s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"]) == (4096, 32, 8)
    assert (s["head_dim"], s["intermediate_size"], s["vocab_size"]) == (128, 14336, 128256)
    assert s["rope_theta"] == 500000.0 and s["rope_scaling"]["rope_type"] == "llama3"
    assert s["num_hidden_layers"] == 2
    cfg.check()
    tiny = dp.settings_from_args(p.parse_args(["--suites", "decoder"]), True)
    assert tiny.shape == dp.DEC_SHAPE and (tiny.device, tiny.dtype) == ("cpu", "float32")
    with pytest.raises(SystemExit):
        p.parse_args(["--dec-shape", "llama3-8b"])


def test_bfloat16_quick_run_reports_agreement_and_time_per_token(no_vllm):
    """bf16 on the CPU: the rows are measured, every weight is bf16, and agreement with
    HF + PEFT is reported as a fraction with the first divergence (near-ties may flip in
    bf16, so it is not asserted to be 1)."""
    cfg = dp.DecoderSettings(adapters=2, full=1, prompts=4, new_tokens=4, repeats=1,
                             dtype="bfloat16")
    rows = dp.run_suite(cfg)
    by = {r["system"]: r for r in rows}
    for s in ("itif", "hf"):
        _check_measured(by[s], cfg)
        assert by[s]["dtype"] == "bfloat16"
        assert by[s]["ms_per_output_token"] == pytest.approx(
            by[s]["latency_ms"] / cfg.new_tokens, abs=1e-3)
    me = by["itif"]
    assert 0.0 <= me["equal_fraction"] <= 1.0
    assert me["equal_fraction"] == pytest.approx(me["equal_to_hf"] / me["compared"], abs=1e-4)
    if me["equal_fraction"] < 1.0:
        assert isinstance(me["first_divergence"], int)
    else:
        assert me["first_divergence"] is None
    t = dp.build_tenants(cfg)
    try:
        assert {p.dtype for p in t.full["f0"].parameters()} == {torch.bfloat16}
    finally:
        t.close()
