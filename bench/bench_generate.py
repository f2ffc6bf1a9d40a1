"""The thesis' Decoding row on this machine: many tenants' fine-tuned decoders, beam search.

    python bench/bench_generate.py --preset marian-decoding --tenants 8 --requests 4 --beams 4 \
        --src-len 128 --new-tokens 32 --name cpu-generate-marian

Three systems over the same tenants and requests, in one run:

* ``hf``: Hugging Face ``generate()`` of each tenant's own model, tenant after tenant (each
  tenant's requests batched in one call: equal source lengths, no padding);
* ``seq``: the same GenEngine, tenant after tenant (one ``generate`` call per tenant);
* ``itif``: one ``generate`` call with every tenant's requests (one running batch).

Tenants are random-initialised Marian-shaped models with distinct weights (nothing shared: the
worst case for itif). Tokens/s counts the tokens of the returned best sequences; each system's
sequences are compared with ``hf``'s. Results go to ``bench/results/<name>.json`` (or ``--out``).

``--device cuda`` runs all three systems on the GPU (HF's models moved there, the GenEngine built
there; ``bench/gpu_suite.sh --steps generate`` calls it so); the dtype stays float32 unless
``--dtype`` says otherwise, so the token-for-token comparison with HF keeps its meaning.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from itif.generation.api import GenerateRequest  # noqa: E402
from itif.generation.engine import GenEngine  # noqa: E402
from itif.generation.spec import PRESETS, defaults_from_config  # noqa: E402


def hf_model(spec, seed: int):
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        GPT2Config,
        GPT2LMHeadModel,
        MarianConfig,
        MarianMTModel,
    )
    torch.manual_seed(seed)
    cfg = spec.hf_config()
    if spec.family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(**cfg, bos_token_id=0, eos_token_id=0)).eval()
    if spec.family == "bart":
        return BartForConditionalGeneration(BartConfig(**cfg, bos_token_id=0, eos_token_id=2,
                                                       decoder_start_token_id=2)).eval()
    return MarianMTModel(
        MarianConfig(**cfg, eos_token_id=0, decoder_start_token_id=spec.pad_token_id)
    ).eval()


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    spec = PRESETS[args.preset]
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    names = [f"t{i}" for i in range(args.tenants)]
    models = {n: hf_model(spec, i + 1) for i, n in enumerate(names)}
    eng = GenEngine(args.preset, device=dev, dtype=args.dtype, kv_cache_bytes=args.kv_mib << 20)
    for n, m in models.items():  # each tenant's generation settings as its checkpoint has them
        eng.add_tenant(n, m.state_dict(), defaults_from_config(m.config.to_dict(),
                                                               m.generation_config.to_dict()))
        models[n] = m.to(device=dev, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    reqs = {
        n: [
            GenerateRequest(
                n,
                torch.randint(5, spec.vocab_size - 1, (args.src_len,), generator=g).tolist(),
                max_new_tokens=args.new_tokens,
                num_beams=args.beams,
            )
            for _ in range(args.requests)
        ]
        for n in names
    }
    flat = [r for n in names for r in reqs[n]]

    def hf_all():
        out = []
        for n in names:
            ids = torch.tensor([r.input_ids for r in reqs[n]], device=dev)
            with torch.no_grad():
                seqs = models[n].generate(ids, max_new_tokens=args.new_tokens, num_beams=args.beams,
                                          do_sample=False)
            for s in seqs.tolist():
                s = s[1:] if spec.encoder_decoder else s[args.src_len:]
                while s and s[-1] == (spec.pad_token_id if spec.pad_token_id is not None else -1):
                    s.pop()
                out.append(s)
        return out

    def seq_all():
        return [g.sequences[0] for n in names for g in eng.generate(reqs[n])]

    def itif_all():
        return [g.sequences[0] for g in eng.generate(flat)]

    systems = {"hf": hf_all, "seq": seq_all, "itif": itif_all}
    eng.generate(flat[:2])  # warm-up (allocations, first plans), both systems
    with torch.no_grad():
        models[names[0]].generate(torch.tensor([flat[0].input_ids], device=dev), max_new_tokens=2,
                                  num_beams=args.beams)
    rows, outs = [], {}
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.repeats):  # interleaved: a noisy moment costs every system alike
        for name, fn in systems.items():
            t0 = time.perf_counter()
            outs[name] = fn()  # token lists on the host: the device work is done
            times[name].append(time.perf_counter() - t0)
    for name in systems:
        tokens = sum(len(s) for s in outs[name])
        best = min(times[name])
        rows.append(
            dict(
                system=name,
                seconds=round(best, 4),
                seconds_all=[round(t, 4) for t in times[name]],
                tokens=tokens,
                tokens_per_s=round(tokens / best, 2),
                latency_per_request_ms=round(1000 * best / len(flat), 2),
            )
        )
    hf_tps = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_hf"] = round(r["tokens_per_s"] / hf_tps, 3)
        r["sequences_equal_hf"] = sum(a == b for a, b in zip(outs[r["system"]], outs["hf"]))
        r["sequences"] = len(flat)
    return dict(
        meta=dict(
            device=(
                torch.cuda.get_device_name(dev)
                if dev.type == "cuda"
                else f"cpu-{platform.machine()}-{torch.get_num_threads()}threads"
            ),
            dtype=args.dtype,
            cpu_count=os.cpu_count(),
            torch_threads=torch.get_num_threads(),
            load_average=list(os.getloadavg()),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command="python " + " ".join(sys.argv),
            torch=torch.__version__,
            settings=dict(
                preset=args.preset,
                tenants=args.tenants,
                requests_per_tenant=args.requests,
                beams=args.beams,
                src_len=args.src_len,
                new_tokens=args.new_tokens,
                repeats=args.repeats,
                kv_cache_mib=args.kv_mib,
                shared_weights="none",
            ),
        ),
        rows=rows,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="marian-decoding", choices=sorted(PRESETS))
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--src-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--kv-mib", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--name", default=None, help="write bench/results/<name>.json")
    p.add_argument("--out", default=None, help="write the JSON here instead")
    args = p.parse_args(argv)
    res = run(args)
    text = json.dumps(res, indent=1)
    print(text)
    out = (Path(args.out) if args.out else
           Path(__file__).resolve().parent / "results" / f"{args.name}.json" if args.name else None)
    if out is not None:
        out.write_text(text + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
