"""A small Python client for the itif.v1 API (used by the CLI, the demo and the tests)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from itif.errors import InvalidRequest, shown
from itif.server._proto.itif.v1 import itif_pb2, itif_pb2_grpc

CHUNK = 1 << 20  # bytes read at a time while hashing
#: Bytes of file per upload message: well under any sensible ``server.max_message_bytes``
#: (a message also carries a few bytes of framing, so a chunk of exactly the limit fails).
UPLOAD_CHUNK = 256 << 10


#: gRPC retries these calls when they fail UNAVAILABLE: a daemon that is stopping or
#: restarting (a connection's calls over the server's ``max_streams_per_connection`` wait in
#: gRPC's client: the server counts streams as HTTP/2 does, ``itif.server.ingress.
#: STREAM_LIMIT_OPTIONS``; before, it reset some of them and they failed UNAVAILABLE).
#: Up to 5 attempts, with a random wait under 20, 60, 180 and 540 ms before each retry. Only
#: calls that change nothing on the server are retried (not uploads or deletes); a streamed
#: Generate only before its first token arrives. Other clients can use the same service config
#: (docs/ecosystem.md).
RETRIED_METHODS = (("itif.v1.Itif", "Infer"), ("itif.v1.Itif", "InferBatch"),
                   ("itif.v1.Itif", "Generate"), ("itif.v1.Itif", "GetTenant"),
                   ("itif.v1.Itif", "ListTenants"), ("grpc.health.v1.Health", "Check"))
SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": [{"service": s, "method": m} for s, m in RETRIED_METHODS],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.02s", "maxBackoff": "1s",
                    "backoffMultiplier": 3, "retryableStatusCodes": ["UNAVAILABLE"]}}]})


def check_token(token: str) -> None:
    """A bearer token travels as gRPC metadata, which carries printable ASCII only (gRPC would
    otherwise fail the call with INTERNAL "Invalid metadata"). The token is never echoed."""
    if not isinstance(token, str):
        raise InvalidRequest(f"the token must be a str, not {type(token).__name__}")
    for i, ch in enumerate(token):
        if not " " <= ch <= "~":
            raise InvalidRequest(f"the token's character {i + 1} of {len(token)} is not "
                                 "printable ASCII (gRPC metadata carries ' ' to '~' only)")


class Client:
    def __init__(self, address: str, token: str, *, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None,
                 max_message_bytes: int = 64 * 2**20) -> None:
        check_token(token)
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.enable_retries", 1), ("grpc.service_config", SERVICE_CONFIG)]
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = itif_pb2_grpc.ItifStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- uploads ---------------------------------------------------------------------------
    def upload(self, tenant: str, path: str | os.PathLike, progress: bool = False,
               timeout: float | None = None,
               chunk_bytes: int = UPLOAD_CHUNK) -> itif_pb2.UploadWeightsResponse:
        """Stream a safetensors file in messages of ``chunk_bytes``; with ``progress`` a tqdm
        bar on stderr."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        try:  # checked before the call: inside the request stream gRPC hides the error
            itif_pb2.UploadHeader(tenant=tenant)
        except (TypeError, ValueError) as e:
            raise InvalidRequest(f"tenant {shown(tenant)} is not valid UTF-8 text: {e}") from None
        path = Path(path)
        size = path.stat().st_size
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(CHUNK), b""):
                digest.update(block)
        first = itif_pb2.UploadWeightsRequest(header=itif_pb2.UploadHeader(
            tenant=tenant, sha256=digest.hexdigest(), total_size=size))
        bar = None
        if progress:
            from tqdm import tqdm  # noqa: PLC0415

            bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"upload {tenant}")

        def messages() -> Iterator[itif_pb2.UploadWeightsRequest]:
            yield first
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(chunk_bytes), b""):
                    if bar is not None:
                        bar.update(len(block))
                    yield itif_pb2.UploadWeightsRequest(chunk=block)

        try:
            return self.stub.UploadWeights(messages(), metadata=self.metadata, timeout=timeout)
        finally:
            if bar is not None:
                bar.close()

    # ---- inference -------------------------------------------------------------------------
    @staticmethod
    def make_input(ids: Sequence[int] | None = None, text: str | None = None,
                   pixel_values: np.ndarray | None = None,
                   token_type_ids: Sequence[int] | None = None) -> itif_pb2.InferInput:
        if text is not None:
            return itif_pb2.InferInput(text=text)
        if pixel_values is not None:
            a = np.ascontiguousarray(pixel_values, dtype="<f4")
            return itif_pb2.InferInput(pixel_values=itif_pb2.Tensor(shape=a.shape,
                                                                    data=a.tobytes()))
        return itif_pb2.InferInput(input_ids=itif_pb2.TokenIds(
            ids=[int(i) for i in ids], token_type_ids=[int(t) for t in token_type_ids or ()]))

    @staticmethod
    def outputs_of(resp: itif_pb2.InferResponse) -> dict[str, np.ndarray]:
        return {t.name: np.frombuffer(t.data, "<f4").reshape(tuple(t.shape)) for t in resp.outputs}

    def infer(self, tenant: str, ids=None, *, text=None, pixel_values=None, token_type_ids=None,
              outputs: Sequence[str] = (), timeout: float | None = None,
              priority: int | None = None) -> dict[str, np.ndarray]:
        req = itif_pb2.InferRequest(
            tenant=tenant, input=self.make_input(ids, text, pixel_values, token_type_ids),
            outputs=list(outputs), priority=priority)
        return self.outputs_of(self.stub.Infer(req, metadata=self.metadata, timeout=timeout))

    def infer_batch(self, tenant: str, inputs: Sequence[itif_pb2.InferInput],
                    outputs: Sequence[str] = (), timeout: float | None = None) -> list[dict]:
        req = itif_pb2.InferBatchRequest(tenant=tenant, inputs=list(inputs), outputs=list(outputs))
        resp = self.stub.InferBatch(req, metadata=self.metadata, timeout=timeout)
        return [self.outputs_of(r) for r in resp.results]

    # ---- generation (a decoder daemon) -----------------------------------------------------
    #: Parameters of :meth:`generate_stream` that travel as the proto's optional fields.
    GENERATE_FIELDS = ("max_new_tokens", "num_beams", "length_penalty", "no_repeat_ngram_size",
                       "num_return_sequences", "temperature", "top_k", "top_p", "seed",
                       "eos_token_id")

    @classmethod
    def generate_request(cls, tenant: str, ids: Sequence[int] | None = None, *,
                         text: str | None = None, early_stopping: bool | str | None = None,
                         do_sample: bool = False, **params) -> itif_pb2.GenerateRequest:
        """A Generate message: ``ids`` or ``text``; ``params`` any of :attr:`GENERATE_FIELDS`
        (left out or None: the server's default, as in Hugging Face ``generate()``);
        ``early_stopping`` True, False or "never"."""
        unknown = set(params) - set(cls.GENERATE_FIELDS)
        if unknown:
            raise TypeError(f"unknown generation parameters {sorted(unknown)}")
        early = {None: itif_pb2.EARLY_STOPPING_UNSPECIFIED, False: itif_pb2.EARLY_STOPPING_FALSE,
                 True: itif_pb2.EARLY_STOPPING_TRUE, "never": itif_pb2.EARLY_STOPPING_NEVER}
        if early_stopping not in early:
            raise ValueError("early_stopping must be True, False or 'never', "
                             f"got {early_stopping!r}")
        req = itif_pb2.GenerateRequest(
            tenant=tenant, early_stopping=early[early_stopping], do_sample=do_sample,
            **{k: v for k, v in params.items() if v is not None})
        if text is not None:
            req.text = text
        else:
            req.input_ids.ids.extend(int(i) for i in ids)
        return req

    def generate_stream(self, tenant: str, ids: Sequence[int] | None = None, *,
                        text: str | None = None, timeout: float | None = None, **params):
        """The Generate call's messages as they arrive (``tokens`` ..., then ``result``); the
        call object itself, so ``.cancel()`` ends it early. ``params``: :meth:`generate_request`."""
        req = self.generate_request(tenant, ids, text=text, **params)
        return self.stub.Generate(req, metadata=self.metadata, timeout=timeout)

    def generate(self, tenant: str, ids: Sequence[int] | None = None, *,
                 text: str | None = None, timeout: float | None = None, **params
                 ) -> itif_pb2.GenerateResult:
        """The final result of a Generate call (token messages read and dropped)."""
        for msg in self.generate_stream(tenant, ids, text=text, timeout=timeout, **params):
            if msg.WhichOneof("event") == "result":
                return msg.result
        raise RuntimeError("the Generate stream ended without a result")

    # ---- tenants and health ----------------------------------------------------------------
    def get_tenant(self, tenant: str) -> itif_pb2.TenantInfo:
        return self.stub.GetTenant(itif_pb2.GetTenantRequest(tenant=tenant), metadata=self.metadata)

    def tenants(self, timeout: float | None = None) -> list[itif_pb2.TenantInfo]:
        return list(self.stub.ListTenants(itif_pb2.ListTenantsRequest(),
                                          metadata=self.metadata, timeout=timeout).tenants)

    def delete_weights(self, tenant: str) -> itif_pb2.DeleteWeightsResponse:
        return self.stub.DeleteWeights(itif_pb2.DeleteWeightsRequest(tenant=tenant),
                                       metadata=self.metadata)

    def health_status(self, service: str = "", timeout: float = 2.0) -> str:
        resp = self.health.Check(health_pb2.HealthCheckRequest(service=service),
                                 metadata=self.metadata, timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the daemon's health is SERVING."""
        import time  # noqa: PLC0415

        end = time.monotonic() + timeout
        while True:
            try:
                if self.health_status() == "SERVING":
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"daemon not SERVING after {timeout:.0f}s")
            time.sleep(0.1)
