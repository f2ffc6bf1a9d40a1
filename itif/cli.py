"""The ``itif`` command line: serve, upload, infer, generate, tenants, demo, plan, bench.

On failure every command exits non-zero with one stderr line ``error: <STATUS_CODE_NAME>: <msg>``;
a malformed command line (a bad flag value, FILE and --adapter both or neither) is an argparse
usage error naming the flag (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import tempfile

import grpc

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # the proto's int64 fields
#: Longest --timeout, seconds (~11.6 days): gRPC overflows far larger deadlines and fails the
#: call at once with DEADLINE_EXCEEDED.
MAX_TIMEOUT_S = 1e6
PEM_MARK = b"-----BEGIN CERTIFICATE-----"


# ---- argparse types: a bad value is a usage error naming the flag (exit 2) --------------------
def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def int64(text: str) -> int:
    """An integer that fits the proto's int64 fields."""
    v = _integer(text)
    if not INT64_MIN <= v <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"{text.strip()} is outside the int64 range")
    return v


def positive_int(text: str) -> int:
    v = _integer(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return v


def non_negative_int(text: str) -> int:
    v = _integer(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return v


def token_ids(text: str) -> list[int]:
    """Comma-separated int64 token ids (empty items skipped)."""
    out = []
    for i, item in enumerate(text.split(",")):
        if item.strip():
            try:
                out.append(int64(item))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"token id #{i + 1}: {e}") from None
    return out


def timeout_s(text: str) -> float:
    """A deadline in seconds: finite, > 0 and at most :data:`MAX_TIMEOUT_S`."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(v) and 0 < v <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(
            f"seconds must be finite, > 0 and at most {MAX_TIMEOUT_S:.0f}, got {text!r}")
    return v


def utf8_text(text: str) -> str:
    """A string that encodes as UTF-8 (a non-UTF-8 argv byte arrives as a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 text: {ascii(text)[:80]}") from None
    return text


# ---- files the user names ---------------------------------------------------------------------
def _read(path: str, limit: int = -1) -> bytes:
    """A file's bytes (all, or the first ``limit``); INVALID_ARGUMENT naming it if unreadable."""
    from itif.errors import InvalidRequest  # noqa: PLC0415

    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError as e:
        raise InvalidRequest(f"cannot read {path}: {e.strerror or e}") from None


def _client(args):
    from itif.client import Client, check_token  # noqa: PLC0415 - keep `itif --help` fast
    from itif.errors import InvalidRequest  # noqa: PLC0415

    try:
        check_token(args.token)
    except InvalidRequest as e:
        raise InvalidRequest(f"--token: {e}") from None
    ca = None
    if getattr(args, "ca", None):
        ca = _read(args.ca)
        if PEM_MARK not in ca:
            raise InvalidRequest(f"--ca {args.ca}: not a PEM certificate (no "
                                 f"{PEM_MARK.decode()} line)")
    return Client(args.server, args.token, root_certificates=ca)


@contextlib.contextmanager
def _upload_source(args):
    """The file to upload: FILE as given, or a PEFT adapter directory packed into one
    safetensors file (``itif.backbones.lora_tenants.pack_adapter``) for a LoRA tenant."""
    if args.adapter is None:
        yield args.file
        return
    from itif.backbones.lora_tenants import pack_adapter  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="itif-adapter-") as d:
        yield pack_adapter(args.adapter, os.path.join(d, "adapter.safetensors"))


def cmd_serve(args) -> int:
    from itif.server.app import main  # noqa: PLC0415

    return main(args.config)


def _check_upload(parser: argparse.ArgumentParser, args) -> None:
    if args.file is None and args.adapter is None:
        parser.error("give a weights FILE or --adapter DIR")
    if args.file is not None and args.adapter is not None:
        parser.error("give a weights FILE or --adapter DIR, not both")


def cmd_upload(args) -> int:
    if args.file is not None:
        _read(args.file, 0)  # a missing file or a directory: one clear line, before connecting
    with _client(args) as c, _upload_source(args) as path:
        kw = {} if args.chunk_bytes is None else {"chunk_bytes": args.chunk_bytes}
        r = c.upload(args.tenant, path, progress=not args.quiet, timeout=args.timeout, **kw)
    print(json.dumps({"tenant": r.tenant, "sha256": r.sha256, "bytes": r.bytes,
                      "weight_bytes": r.weight_bytes, "shared_bytes": r.shared_bytes}))
    return 0


def cmd_infer(args) -> int:
    with _client(args) as c:
        out = c.infer(args.tenant, args.ids, text=args.text, outputs=args.outputs or (),
                      timeout=args.timeout)
    if args.json:
        print(json.dumps({k: v.tolist() for k, v in out.items()}))
    else:
        for k, v in out.items():
            r = v.astype("float64").round(5)  # in float64: a rounded float32 widens unrounded
            print(f"{k} {list(v.shape)}: "
                  f"{r.tolist() if v.size <= 16 else r.ravel()[:8].tolist() + ['...']}")
    return 0


def _early_stopping(value: str):
    return {"true": True, "false": False, "never": "never"}[value]


def cmd_generate(args) -> int:
    """Stream one Generate call: each token message as it arrives (its text when the tenant
    ships a tokenizer, else its ids), then the final sequences; ``--json``: one JSON object per
    message instead."""
    ids = args.ids
    params = {k: getattr(args, k) for k in ("max_new_tokens", "num_beams", "length_penalty",
                                             "no_repeat_ngram_size", "num_return_sequences",
                                             "temperature", "top_k", "top_p", "seed",
                                             "eos_token_id")}
    early = None if args.early_stopping is None else _early_stopping(args.early_stopping)
    with _client(args) as c:
        for msg in c.generate_stream(args.tenant, ids, text=args.text, timeout=args.timeout,
                                     early_stopping=early, do_sample=args.do_sample, **params):
            if msg.WhichOneof("event") == "tokens":
                t = msg.tokens
                if args.json:
                    print(json.dumps({"sequence": t.sequence, "ids": list(t.ids),
                                      "text": t.text}), flush=True)
                else:
                    print(t.text if t.text else " ".join(map(str, t.ids)),
                          end="" if t.text else " ", flush=True)
                continue
            seqs = msg.result.sequences
            if args.json:
                print(json.dumps({"sequences": [
                    {"ids": list(s.ids), "text": s.text, "finish_reason": s.finish_reason,
                     **({"score": s.score} if s.HasField("score") else {})} for s in seqs],
                    "weights_sha256": msg.result.weights_sha256}), flush=True)
            else:
                print()
                for i, s in enumerate(seqs):
                    score = f" score {s.score:.5f}" if s.HasField("score") else ""
                    shown = repr(s.text) if s.text else ",".join(map(str, s.ids))
                    print(f"[{i}] {shown} ({s.finish_reason}{score})")
    return 0


def cmd_tenants(args) -> int:
    from itif.server._proto.itif.v1 import itif_pb2  # noqa: PLC0415

    with _client(args) as c:
        rows = c.tenants(timeout=args.timeout)
    for t in rows:
        state = itif_pb2.TenantInfo.State.Name(t.state)
        print(json.dumps({"id": t.id, "state": state, "sha256": t.sha256,
                          "weight_bytes": t.weight_bytes, "exclusive_bytes": t.exclusive_bytes,
                          "num_labels": t.num_labels, "queue_depth": t.queue_depth,
                          "tier": t.tier, "host_bytes": t.host_bytes,
                          **({"compress": t.compress, "stored_bytes": t.stored_bytes}
                             if t.compress else {}),
                          **({"delta_max_abs_error": t.delta_max_abs_error}
                             if t.HasField("delta_max_abs_error") else {}),
                          **({"error": t.error} if t.error else {})}))
    return 0


def cmd_demo(args) -> int:
    from itif.demo import run_demo  # noqa: PLC0415

    return run_demo(tenants=args.tenants, requests=args.requests, quick=args.quick)


def cmd_plan(args) -> int:
    from itif.calibration.plan_report import plan_report  # noqa: PLC0415

    report = plan_report(args.backbone, args.workload, args.tenants, args.requests,
                         skew=args.skew, seed=args.seed, threads=args.threads)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


def cmd_bench(args) -> int:
    from itif.bench.cli import run  # noqa: PLC0415

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="itif", description="multi-tenant shared-backbone inference")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", required=True, help="tenants.yaml")
    s.set_defaults(fn=cmd_serve)

    def remote(sp, tenant=True):
        sp.add_argument("--server", default="127.0.0.1:50051", help="host:port")
        sp.add_argument("--token", required=True, help="bearer token (tenant's or admin's)")
        sp.add_argument("--ca", help="PEM root certificate for TLS")
        if tenant:
            sp.add_argument("--tenant", required=True, type=utf8_text)

    s = sub.add_parser("upload", help="upload a tenant's safetensors weights")
    remote(s)
    s.add_argument("file", nargs="?", help="safetensors weights (a full tenant)")
    s.add_argument("--adapter", metavar="DIR",
                   help="a PEFT LoRA adapter directory (adapter_config.json + "
                        "adapter_model.safetensors), for a tenant with a base")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--chunk-bytes", type=positive_int, default=None,
                   help="file bytes per message; keep it below the server's max_message_bytes "
                        "(default: itif.client.UPLOAD_CHUNK, 256 KiB)")
    s.add_argument("--timeout", type=timeout_s, default=None,
                   help="deadline of the whole upload, seconds (default: none; a server that "
                        "stops answering mid-upload is waited for)")
    s.set_defaults(fn=cmd_upload, usage_check=functools.partial(_check_upload, s))

    s = sub.add_parser("infer", help="run one input")
    remote(s)
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--ids", type=token_ids, help="comma-separated token ids")
    g.add_argument("--text", type=utf8_text, help="text (backbones that ship a tokenizer)")
    s.add_argument("--outputs", nargs="*", help="logits pooled last_hidden_state")
    s.add_argument("--timeout", type=timeout_s, default=30.0, help="deadline, seconds")
    s.add_argument("--json", action="store_true", help="one JSON object on stdout")
    s.set_defaults(fn=cmd_infer)

    s = sub.add_parser("generate", help="generate with a tenant's decoder (a decoder daemon), "
                       "streaming tokens as they are decided")
    remote(s)
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--ids", type=token_ids,
                   help="comma-separated token ids (the prompt, or the source)")
    g.add_argument("--text", type=utf8_text, help="text (tenants that ship a tokenizer)")
    s.add_argument("--max-new-tokens", type=int64, help="default 20")
    s.add_argument("--num-beams", type=int64, help="beam search with N beams (default 1)")
    s.add_argument("--length-penalty", type=float, help="beam score length exponent (default 1)")
    s.add_argument("--early-stopping", choices=("true", "false", "never"),
                   help="when beam search stops (default false)")
    s.add_argument("--no-repeat-ngram-size", type=int64, help="ban repeated n-grams (default 0)")
    s.add_argument("--num-return-sequences", type=int64, help="sequences returned (default 1)")
    s.add_argument("--do-sample", action="store_true", help="sample instead of searching")
    s.add_argument("--temperature", type=float, help="sampling temperature (default 1)")
    s.add_argument(
        "--top-k",
        type=int64,
        help="sample among the k likeliest (default 50, as generate(); 0: off)",
    )
    s.add_argument("--top-p", type=float, help="nucleus sampling mass (default 1: off)")
    s.add_argument("--seed", type=int64, help="sampling seed")
    s.add_argument("--eos-token-id", type=int64, help="end token (default: the checkpoint's)")
    s.add_argument("--timeout", type=timeout_s, default=120.0, help="deadline, seconds")
    s.add_argument("--json", action="store_true", help="one JSON object per streamed message")
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("tenants", help="list tenants (admin token)")
    remote(s, tenant=False)
    s.add_argument("--timeout", type=timeout_s, default=30.0, help="deadline, seconds")
    s.set_defaults(fn=cmd_tenants)

    s = sub.add_parser("demo", help="daemon on loopback, demo tenants fine-tuned from the "
                       "packaged all-MiniLM-L6-v2 (itif[demo]), mixed load, speedup")
    s.add_argument("--tenants", type=positive_int, default=4)
    s.add_argument("--requests", type=positive_int, default=64, help="requests per tenant")
    s.add_argument("--quick", action="store_true",
                   help="at most 8 requests per tenant (same MiniLM backbone and tenants)")
    s.set_defaults(fn=cmd_demo)

    s = sub.add_parser("plan", help="plan one batch with every strategy and run it")
    s.add_argument("--backbone", default="bert-base")
    s.add_argument("--workload", default="uniform:2-100", help="uniform:LO-HI or normal:MEAN:VAR")
    s.add_argument("--tenants", type=positive_int, default=4)
    s.add_argument("--requests", type=positive_int, default=64)
    s.add_argument("--skew", default=None, help="tenant popularity, e.g. zipf:1.5")
    s.add_argument("--seed", type=non_negative_int, default=0)
    s.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads for the run (default: torch's); 1 is steadier on a "
                        "shared CPU")
    s.add_argument("--json", action="store_true", help="compact JSON")
    s.set_defaults(fn=cmd_plan)

    from itif.bench.cli import add_arguments as bench_arguments  # noqa: PLC0415 - argparse only

    s = sub.add_parser("bench", help="fused engine vs per-tenant baselines; serving sweep")
    bench_arguments(s)
    s.set_defaults(fn=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "usage_check", None) is not None:
        args.usage_check(args)  # checks across flags; exits 2 like argparse
    try:
        return args.fn(args) or 0
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a CLI reports, it does not trace back
        from itif.errors import ItifError  # noqa: PLC0415

        if isinstance(e, ItifError):
            msg = f"{e.code}: {e}"
        elif isinstance(e, OSError) and e.filename is not None:
            msg = f"INVALID_ARGUMENT: {e.filename}: {e.strerror or e}"
        elif isinstance(e, OSError):  # a port in use, a full disk: the machine's, not a bug
            msg = f"UNAVAILABLE: {e}"
        else:
            msg = f"UNKNOWN: {type(e).__name__}: {e}"
        print(f"error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
