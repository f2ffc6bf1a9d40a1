"""A decoder daemon's engine: ``itif.generation.engine.GenEngine`` behind the part of the
encoder ``Engine``'s interface the :class:`itif.daemon.Daemon` uses for weights and tenants.

The daemon's upload path (verify, validate, budget check, durable commit, swap), its restore on
start, DeleteWeights and live reloads are written against ``Daemon.engine``. With a decoder
backbone (``backbone.config`` a generation preset or a GPT-2 / BART / Marian config) that engine
is a :class:`DecoderBackend`: the same calls reach the GenEngine's weight store, so decoder
tenants upload, restore and delete exactly as encoder tenants do. What only an encoder does
(Infer, KServe inference) raises :class:`~itif.errors.Unimplemented` naming Generate instead;
generation itself goes to ``gen`` (``Daemon.submit_generate``).

LoRA tenants (``base:`` in tenants.yaml, ``itif upload --adapter``) go through the GenEngine's
own adapter path: :meth:`DecoderBackend.load_lora` reads and checks the adapter with
``GenEngine.load_lora`` (InvalidWeights naming the field) and wraps it as a
:class:`DecoderLora`, weights without tensors of their own (the daemon's budget check and store
see nothing to add: the tenant shares its base's slots); ``add_tenant(base=)`` hands the adapter
to ``GenEngine.add_tenant(base=)``, which checks it once more against the base it finds then.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from itif.backbones.hf import CanonicalWeights
from itif.errors import Unimplemented
from itif.generation.chat_template import read_chat_config

__all__ = ["DecoderBackend", "DecoderLora", "DecoderTenantInfo", "build_generator"]


@dataclass(frozen=True)
class DecoderLora(CanonicalWeights):
    """A checked LoRA adapter (``itif.generation.decoder_lora.LoraAdapter``) as the daemon's upload,
    restore and tier paths carry weights: no tensors (its base's are shared, so the budget
    check charges nothing), no head; ``adapter`` is what ``GenEngine.add_tenant`` installs."""

    adapter: Any = None


@dataclass(frozen=True)
class DecoderTenantInfo:
    """What ``Engine.tenant_info`` reports, for a decoder tenant (no classification head)."""

    tenant: str
    num_labels: int
    has_pooler: bool
    bytes: int
    exclusive_bytes: int


def build_generator(source: str, device: str, dtype: str, kv_cache_bytes: int | None,
                    max_new_tokens: int) -> Any:
    """The GenEngine for ``backbone.config`` (``"auto"`` device and dtype resolved as the
    encoder engine resolves them: CUDA when there is one; float32)."""
    from itif.generation.engine import GenEngine  # noqa: PLC0415 - decoder daemons only

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "float32"
    kw = {} if kv_cache_bytes is None else {"kv_cache_bytes": kv_cache_bytes}
    return GenEngine(source, device=device, dtype=dtype, max_new_tokens_limit=max_new_tokens, **kw)


class _SpecView:
    """The DecoderSpec as the encoder paths read ``engine.spec``: every attribute forwarded,
    but ``is_text`` (what KServe's metadata and inference ask first) refuses, naming Generate,
    so KServe on a decoder daemon answers UNIMPLEMENTED rather than failing inside."""

    def __init__(self, spec: Any) -> None:
        self._spec = spec

    def __getattr__(self, name: str) -> Any:
        return getattr(self._spec, name)

    @property
    def is_text(self) -> bool:
        raise Unimplemented(
            f"backbone {self._spec.name!r} is a decoder: call the itif.v1 Generate RPC (itif "
            "generate); KServe inference serves encoder backbones")


def _dir_tokenizer(source_dir: Any) -> Any:
    """The ``tokenizers.Tokenizer`` of ``source_dir/tokenizer.json``, or None."""
    if source_dir is None:
        return None
    path = Path(source_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer  # noqa: PLC0415 - only for checkpoints that ship one

    return Tokenizer.from_file(str(path))


class DecoderBackend:
    """``gen`` (a GenEngine) seen as the daemon's engine. ``tokenizer`` is None here: decoder
    tenants each have their own (:meth:`tokenizer_of`)."""

    tokenizer = None

    def __init__(self, gen: Any) -> None:
        self.gen = gen
        self.strategy = None  # a reload sets it (scheduler.strategy); nothing reads it here
        self._backbone_tokenizer = _dir_tokenizer(getattr(gen.spec, "source_dir", None))
        self._chat: tuple[str | None, dict[str, str]] | None = None  # read on first use
        self._adapters: dict[str, DecoderLora] = {}  # LoRA tenant -> its adapter, last added

    def tokenizer_of(self, tenant: str) -> Any:
        """The tenant's tokenizer: its own checkpoint's (``gen.tokenizer``), else the one the
        backbone's checkpoint directory ships (a tenant uploads weights only), else None."""
        return self.gen.tokenizer(tenant) or self._backbone_tokenizer

    def chat_template_of(self, tenant: str) -> tuple[str | None, dict[str, str]]:
        """(chat template, named special tokens) ``tenant``'s chat messages are rendered with
        (``itif.generation.chat_template``): those of the backbone's checkpoint directory
        (tokenizer_config.json, chat_template.jinja), as its tokenizer is the directory's (a
        tenant uploads weights, a LoRA tenant an adapter: neither carries a tokenizer). Read
        once; (None, {}) for a preset backbone."""
        if self._chat is None:
            self._chat = read_chat_config(getattr(self.gen.spec, "source_dir", None))
        return self._chat

    # ---- what the daemon reads ------------------------------------------------------------
    @property
    def spec(self) -> Any:
        return _SpecView(self.gen.spec)

    @property
    def store(self) -> Any:
        return self.gen.store

    @property
    def device(self) -> torch.device:
        return torch.device(getattr(self.gen, "device", "cpu"))

    @property
    def dtype(self) -> Any:
        return getattr(self.gen, "dtype", torch.float32)

    @property
    def weight_bytes(self) -> int:
        return self.gen.store.weight_bytes

    def tenants(self) -> list[str]:
        return list(self.gen.tenants())

    def tenant_info(self, tenant: str, sizes: bool = True) -> DecoderTenantInfo:
        """As ``Engine.tenant_info`` (``sizes=False``: both byte counts 0)."""
        if tenant not in self.gen.store:
            from itif.errors import TenantNotFound, shown  # noqa: PLC0415

            raise TenantNotFound(f"tenant {shown(tenant)} not found")
        total, exclusive = self.gen.store.tenant_bytes(tenant) if sizes else (0, 0)
        return DecoderTenantInfo(tenant, 0, False, total, exclusive)

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, source: Any) -> Any:
        return self.gen.load_weights(source)

    def load_lora(self, source: Any, base: str) -> DecoderLora:
        """A PEFT adapter (directory, packed file) for stored tenant ``base``, checked as the
        GenEngine checks it (InvalidWeights naming the field); nothing is added."""
        return DecoderLora({}, None, False, self.gen.load_lora(source, base))

    def probe(self, weights: Any, base: str | None = None, digests: Any = None) -> None:
        """The GenEngine validates what it loads (names, shapes, finite values); a forward
        probe of every upload is the encoder engine's (its outputs are checked once more)."""

    def add_tenant(self, tenant: str, weights: Any, base: str | None = None, tag: str = "") -> None:
        """``tag`` is not kept: a generation running when its tenant's weights are replaced
        fails (``GenEngine.add_tenant``), so a Generate result's sha, read as it is sent, is
        another's only if the replacement lands between its last token and its reply."""
        if base is None:
            self.gen.add_tenant(tenant, weights)
            return
        if isinstance(weights, DecoderLora):
            self._adapters[tenant] = weights
        elif isinstance(weights, CanonicalWeights) and not weights.tensors:
            # the weight tiers' host copy of a LoRA tenant: its own tensors, none; the
            # adapter is the one it had (kept here while it is evicted: a few MiB at most)
            weights = self._adapters.get(tenant, weights)
        adapter = weights.adapter if isinstance(weights, DecoderLora) else weights
        self.gen.add_tenant(tenant, adapter, base=base)

    def remove_tenant(self, tenant: str) -> None:
        self.gen.remove_tenant(tenant)

    # ---- what only an encoder serves --------------------------------------------------------
    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise Unimplemented(
            f"backbone {self.gen.spec.name!r} is a decoder: call Generate (itif generate); "
            "Infer serves encoder backbones")

    infer = check = request_tokens = _refuse
