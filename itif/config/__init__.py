"""Typed, validated ``tenants.yaml``.

The operator's file has four top-level sections::

    server:     listen, data_dir, admin_token_sha256, metrics_listen, http_listen,
                http_max_connections, http_max_connections_per_client,
                http_header_timeout_s, http_json_processes,
                max_message_bytes, max_upload_bytes, grace_s, upload_idle_s,
                max_inflight_calls, max_active_calls, max_pending_calls,
                max_pending_reply_bytes, max_new_tokens, ingress_processes,
                tls {cert, key, client_ca}
    backbone:   config (checkpoint dir / config.json / preset name; a decoder such as
                gpt2-tiny serves Generate), device, dtype, max_seq_len, max_weight_bytes,
                kv_cache_bytes
    scheduler:  max_batch_tokens, max_batch_size, max_wait_ms, strategy, isolate_tenants,
                latency_sizing
    tenants:    - {id, token_sha256, max_queue, weight, max_seq_len, latency_target_ms,
                   max_inflight}

Everything is parsed into frozen dataclasses. Validation is strict: unknown keys, wrong types,
out-of-range values and inconsistent combinations are all rejected with :class:`InvalidConfig`,
whose message quotes the key path (``tenants[2].max_queue: must be >= 1, got 0``). All problems
found in one file are reported together, one per line.

Relative paths (``server.data_dir``, ``server.tls.*``, a non-preset ``backbone.config``) are
resolved against the directory holding the YAML file, never against the working directory.
Nothing here reads environment variables.

The package, from the bottom up:

- ``fields``: one converter per kind of setting (integer, size, host:port, path, ...);
- ``schema``: the dataclasses; each field carries its default, converter and limits, once;
- ``parse``: YAML -> :class:`Config` (:func:`parse_config`, :func:`load_config`);
- ``diff``: :func:`diff_configs` tells a live reload which tenants were added, removed or
  changed and refuses (with ``InvalidConfig`` naming the key) changes that only a restart can
  apply;
- ``watch``: :class:`ConfigWatcher` polls the file and calls back with each new valid config.
"""

from itif.config.diff import ConfigDiff, diff_configs
from itif.config.fields import BACKBONE_PRESETS, DEVICES, DTYPES, backbone_presets
from itif.config.parse import load_config, parse_config
from itif.config.schema import (
    BackboneConfig,
    Config,
    SchedulerConfig,
    ServerConfig,
    Tenant,
    TLSConfig,
    TokenDigests,
    hash_token,
)
from itif.config.watch import ConfigWatcher

__all__ = [
    "BACKBONE_PRESETS",
    "BackboneConfig",
    "Config",
    "ConfigDiff",
    "ConfigWatcher",
    "DEVICES",
    "DTYPES",
    "ServerConfig",
    "SchedulerConfig",
    "TLSConfig",
    "Tenant",
    "backbone_presets",
    "diff_configs",
    "TokenDigests",
    "hash_token",
    "load_config",
    "parse_config",
]
