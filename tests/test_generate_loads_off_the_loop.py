"""gRPC Generate of a tenant the weight tiers evicted loads it off the event loop (issue 62).

With ``device_weight_bytes`` room for one full tenant, uploading ``full`` after ``base``
evicts ``base`` to the host tier. A Generate for it over the real gRPC servicer must read its
weights on a worker thread (``itif.server.generate.load_evicted``, as the HTTP APIs do), not on
the event loop's thread that serves every other call; its answer is unchanged. A caller that
may not see a tenant loads nothing: it gets NOT_FOUND, as for an unknown tenant.
tests/test_llama_lora_daemon.py's tiny Llama checkpoint and helpers.
"""

from __future__ import annotations

import threading

import grpc
import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("uvicorn")

from itif.config import parse_config
from itif.daemon import Daemon as InProcess
from itif.generation.api import GenerateRequest
from tests.daemon_harness import free_port
from tests.test_http_completions import servers
from tests.test_llama_lora_daemon import (
    PROMPTS,
    TOKENS,
    base_model,
    config_text,
    upload,
    weights_bytes,
    write_backbone,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_grpc_generate_loads_an_evicted_tenant_on_a_worker_thread(tmp_path):
    from itif.client import Client

    backbone = write_backbone(tmp_path / "backbone")
    models = {"base": base_model(1), "full": base_model(2)}
    per = len(weights_bytes(models["base"], tmp_path))
    extra = f"  device_weight_bytes: {int(per * 1.5)}\n  host_weight_bytes: {per * 3}\n"
    d = InProcess(parse_config(config_text(backbone, f"127.0.0.1:{free_port()}", extra),
                               tmp_path))
    d.start()
    with servers(d) as port:
        for t in ("base", "full"):
            upload(d, t, weights_bytes(models[t], tmp_path))
        assert "base" not in d.engine.store and "full" in d.engine.store  # base evicted
        threads: list[str] = []
        promote = d.tiers.promote

        def recording(tenant: str) -> None:
            threads.append(threading.current_thread().name)
            promote(tenant)

        d.tiers.promote = recording
        # a tenant full may not see: NOT_FOUND, nothing loaded
        with Client(f"127.0.0.1:{port}", TOKENS["full"]) as c, \
                pytest.raises(grpc.RpcError) as e:
            c.generate("base", PROMPTS[0], max_new_tokens=8, timeout=60)
        assert e.value.code() is grpc.StatusCode.NOT_FOUND
        assert threads == [] and "base" not in d.engine.store
        with Client(f"127.0.0.1:{port}", TOKENS["base"]) as c:
            got = c.generate("base", PROMPTS[0], max_new_tokens=8, timeout=60)
        assert "base" in d.engine.store
        want = d.generator.generate([GenerateRequest("base", PROMPTS[0], max_new_tokens=8)])
        assert list(got.sequences[0].ids) == want[0].sequences[0]
        # asyncio.to_thread's workers; the loop's own thread is servers()' "... (run_forever)"
        assert threads and all(n.startswith("asyncio_") for n in threads), threads
