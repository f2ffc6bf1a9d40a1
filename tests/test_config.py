"""tenants.yaml parsing, validation, diffing and live-reload watching (CPU, fast)."""

from __future__ import annotations

import copy
import os
import threading
import time
from pathlib import Path

import pytest
import yaml

from itif.config import (
    BACKBONE_PRESETS,
    BackboneConfig,
    Config,
    ConfigDiff,
    ConfigWatcher,
    SchedulerConfig,
    ServerConfig,
    Tenant,
    backbone_presets,
    diff_configs,
    hash_token,
    load_config,
    parse_config,
)
from itif.errors import InvalidConfig

REPO = Path(__file__).resolve().parents[1]
ADMIN = hash_token("admin-token")
ACME = hash_token("acme-token")
BETA = hash_token("beta-token")
GAMMA = hash_token("gamma-token")

MINIMAL = f"""\
server:
  listen: 127.0.0.1:50051
  data_dir: ./var/itif
  admin_token_sha256: {ADMIN}
backbone:
  config: bert-tiny
tenants:
  - id: acme
    token_sha256: {ACME}
"""


def base_dict() -> dict:
    return yaml.safe_load(MINIMAL)


def dump(d: dict) -> str:
    return yaml.safe_dump(d, sort_keys=False)


def parse(d: dict | str, base: Path = Path("/cfg")) -> Config:
    return parse_config(d if isinstance(d, str) else dump(d), base)


def with_tenants(*tenants: dict, **sections) -> dict:
    d = base_dict()
    d["tenants"] = list(tenants)
    for k, v in sections.items():
        d[k] = v
    return d


# --------------------------------------------------------------------------------------------
# Parsing and defaults
# --------------------------------------------------------------------------------------------


def test_minimal_file_defaults(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(MINIMAL)
    cfg = load_config(path)
    assert cfg.server == ServerConfig(
        listen="127.0.0.1:50051",
        data_dir=tmp_path / "var" / "itif",
        admin_token_sha256=ADMIN,
        metrics_listen=None,
        max_message_bytes=64 << 20,
        max_upload_bytes=4 << 30,
        grace_s=10.0,
        tls=None,
    )
    assert cfg.backbone == BackboneConfig(config="bert-tiny", device="auto", dtype="auto")
    assert cfg.backbone.is_preset
    assert cfg.scheduler == SchedulerConfig()
    assert cfg.scheduler.max_batch_tokens == 8192 and cfg.scheduler.max_wait_ms == 5
    assert cfg.scheduler.strategy == "auto"
    assert cfg.tenants == (Tenant(id="acme", token_sha256=ACME),)
    t = cfg.tenants[0]
    assert (t.max_queue, t.weight, t.max_seq_len, t.latency_target_ms) == (64, 1.0, None, 100.0)
    assert cfg.tenant("acme") is t and cfg.tenant("nope") is None
    assert cfg.tenant_ids == ("acme",)


def test_frozen():
    cfg = parse(MINIMAL)
    with pytest.raises(AttributeError):
        cfg.tenants[0].max_queue = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.server = None  # type: ignore[misc]


def test_repo_example_is_valid_and_uses_demo_tokens():
    cfg = load_config(REPO / "tenants.yaml")
    assert cfg.backbone.config == "bert-tiny"
    assert cfg.server.admin_token_sha256 == ADMIN
    assert {t.id: t.token_sha256 for t in cfg.tenants} == {"acme": ACME, "beta": BETA}
    assert cfg.server.data_dir == REPO / "var" / "itif"


def test_hash_token():
    assert hash_token("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert len(hash_token("acme-token")) == 64
    with pytest.raises(TypeError):
        hash_token(b"x")  # type: ignore[arg-type]


def test_full_file_all_fields(tmp_path):
    (tmp_path / "ckpt").mkdir()
    d = base_dict()
    d["server"].update(
        metrics_listen="[::]:9090",
        max_message_bytes="16MiB",
        max_upload_bytes=1 << 30,
        grace_s=2.5,
        tls={"cert": "certs/s.pem", "key": "/abs/s.key", "client_ca": "certs/ca.pem"},
    )
    d["backbone"] = {"config": "ckpt", "device": "cpu", "dtype": "bfloat16", "max_seq_len": 256}
    d["scheduler"] = {
        "max_batch_tokens": 4096,
        "max_batch_size": 32,
        "max_wait_ms": 0,
        "strategy": "itif_two_stage",
    }
    d["tenants"].append(
        {"id": "beta_2", "token_sha256": BETA, "max_queue": 1, "weight": 0.25, "max_seq_len": 128,
         "latency_target_ms": 20}
    )
    cfg = parse(d, tmp_path)
    s = cfg.server
    assert s.metrics_listen == "[::]:9090" and s.max_message_bytes == 16 << 20
    assert s.grace_s == 2.5 and s.max_upload_bytes == 1 << 30
    assert s.tls is not None and s.tls.mutual
    assert s.tls.cert == tmp_path / "certs" / "s.pem"
    assert s.tls.key == Path("/abs/s.key")
    assert s.tls.client_ca == tmp_path / "certs" / "ca.pem"
    assert cfg.backbone == BackboneConfig(str(tmp_path / "ckpt"), "cpu", "bfloat16", 256)
    assert not cfg.backbone.is_preset
    assert cfg.scheduler == SchedulerConfig(4096, 32, 0.0, "itif_two_stage")
    assert cfg.tenants[1] == Tenant("beta_2", BETA, 1, 0.25, 128, 20.0)


def test_listen_forms():
    for listen in ("0.0.0.0:1", "[::]:50051", "[::1]:0", "localhost:65535", "my-host.local:80"):
        d = base_dict()
        d["server"]["listen"] = listen
        assert parse(d).server.listen == listen


def test_tls_without_client_ca_is_not_mutual():
    d = base_dict()
    d["server"]["tls"] = {"cert": "c.pem", "key": "k.pem"}
    tls = parse(d, Path("/etc/itif")).server.tls
    assert tls is not None and not tls.mutual and tls.cert == Path("/etc/itif/c.pem")


def test_data_dir_resolved_against_yaml_dir_not_cwd(tmp_path, monkeypatch):
    sub = tmp_path / "conf"
    sub.mkdir()
    (sub / "tenants.yaml").write_text(MINIMAL.replace("./var/itif", "../data/./x"))
    monkeypatch.chdir("/")
    cfg = load_config(sub / "tenants.yaml")
    assert cfg.server.data_dir == tmp_path / "data" / "x"
    # relative path to the YAML itself: still resolved against the file's directory
    monkeypatch.chdir(tmp_path)
    assert load_config(Path("conf/tenants.yaml")).server.data_dir == tmp_path / "data" / "x"
    d = base_dict()
    d["server"]["data_dir"] = "/srv/itif"
    assert parse(d, tmp_path).server.data_dir == Path("/srv/itif")


def test_empty_tenant_list_allowed():
    d = base_dict()
    d["tenants"] = []
    assert parse(d).tenants == ()
    del d["tenants"]
    assert parse(d).tenants == ()


# --------------------------------------------------------------------------------------------
# Rejections: every message names the key path
# --------------------------------------------------------------------------------------------


def _set(path: str, value):
    """Mutation that sets a dotted path (``tenants.0.id``) in the base dict."""

    def apply(d):
        parts = path.split(".")
        cur = d
        for p in parts[:-1]:
            cur = cur[int(p)] if isinstance(cur, list) else cur[p]
        last = parts[-1]
        if value is _DEL:
            del cur[last]
        elif isinstance(cur, list):
            cur[int(last)] = value
        else:
            cur[last] = value
        return d

    return apply


_DEL = object()

BAD_CASES = [
    ("unknown top key", _set("serverz", {}), "serverz: unknown key"),
    (
        "unknown server key",
        _set("server.listn", "x"),
        "server.listn: unknown key (did you mean 'listen'?",
    ),
    ("unknown tenant key", _set("tenants.0.quota", 3), "tenants[0].quota: unknown key"),
    ("unknown backbone key", _set("backbone.layers", 3), "backbone.layers: unknown key"),
    (
        "unknown scheduler key",
        _set("scheduler", {"max_wait": 1}),
        "scheduler.max_wait: unknown key",
    ),
    ("bad id upper", _set("tenants.0.id", "Acme"), "tenants[0].id: must match"),
    ("bad id space", _set("tenants.0.id", "a b"), "tenants[0].id: must match"),
    ("bad id too long", _set("tenants.0.id", "a" * 64), "tenants[0].id: must match"),
    ("bad id leading dash", _set("tenants.0.id", "-a"), "tenants[0].id: must match"),
    ("bad id trailing newline", _set("tenants.0.id", "acme\n"), "tenants[0].id: must match"),
    (
        "bad hash trailing newline",
        _set("tenants.0.token_sha256", ACME + "\n"),
        "tenants[0].token_sha256: must be 64 lowercase hex",
    ),
    ("id not string", _set("tenants.0.id", 12), "tenants[0].id: must be a string, got int 12"),
    ("missing id", _set("tenants.0.id", _DEL), "tenants[0].id: required key is missing"),
    (
        "bad hash short",
        _set("tenants.0.token_sha256", "abc"),
        "tenants[0].token_sha256: must be 64 lowercase hex",
    ),
    (
        "bad hash upper",
        _set("tenants.0.token_sha256", ACME.upper()),
        "tenants[0].token_sha256: must be 64 lowercase hex",
    ),
    (
        "bad hash nonhex",
        _set("tenants.0.token_sha256", "g" * 64),
        "tenants[0].token_sha256: must be 64 lowercase hex",
    ),
    (
        "bad admin hash",
        _set("server.admin_token_sha256", "admin-token"),
        "server.admin_token_sha256: must be 64",
    ),
    (
        "missing admin",
        _set("server.admin_token_sha256", _DEL),
        "server.admin_token_sha256: required key is missing",
    ),
    ("max_queue 0", _set("tenants.0.max_queue", 0), "tenants[0].max_queue: must be >= 1, got 0"),
    (
        "max_queue negative",
        _set("tenants.0.max_queue", -5),
        "tenants[0].max_queue: must be >= 1, got -5",
    ),
    (
        "max_queue float",
        _set("tenants.0.max_queue", 2.5),
        "tenants[0].max_queue: must be an integer",
    ),
    (
        "max_queue bool",
        _set("tenants.0.max_queue", True),
        "tenants[0].max_queue: must be an integer",
    ),
    ("weight 0", _set("tenants.0.weight", 0), "tenants[0].weight: must be > 0"),
    ("weight negative", _set("tenants.0.weight", -1.0), "tenants[0].weight: must be > 0"),
    ("weight nan", _set("tenants.0.weight", float("nan")), "tenants[0].weight: must be finite"),
    ("weight string", _set("tenants.0.weight", "heavy"), "tenants[0].weight: must be a number"),
    (
        "latency 0",
        _set("tenants.0.latency_target_ms", 0),
        "tenants[0].latency_target_ms: must be > 0",
    ),
    ("tenant seq len 0", _set("tenants.0.max_seq_len", 0), "tenants[0].max_seq_len: must be >= 1"),
    ("tenant not mapping", _set("tenants.0", "acme"), "tenants[0]: must be a mapping"),
    ("tenants not list", _set("tenants", {"id": "acme"}), "tenants: must be a list"),
    ("listen no port", _set("server.listen", "127.0.0.1"), "server.listen: expected host:port"),
    (
        "listen bad port",
        _set("server.listen", "127.0.0.1:99999"),
        "server.listen: port must be <= 65535",
    ),
    (
        "listen port text",
        _set("server.listen", "127.0.0.1:http"),
        "server.listen: port must be a number",
    ),
    (
        "listen ipv6 unbracketed",
        _set("server.listen", ":::50051"),
        "server.listen: IPv6 addresses must be bracketed",
    ),
    (
        "listen bad ipv6",
        _set("server.listen", "[zz]:1"),
        "server.listen: 'zz' inside [] is not an IPv6",
    ),
    (
        "metrics same as listen",
        _set("server.metrics_listen", "127.0.0.1:50051"),
        "server.metrics_listen: '127.0.0.1:50051' is the same address as server.listen",
    ),
    (
        "message bytes small",
        _set("server.max_message_bytes", 10),
        "server.max_message_bytes: must be >= 1024",
    ),
    (
        "message bytes huge",
        _set("server.max_message_bytes", "4GiB"),
        "server.max_message_bytes: must be <=",
    ),
    (
        "upload bytes bad unit",
        _set("server.max_upload_bytes", "4 parsecs"),
        "server.max_upload_bytes: must be a byte count",
    ),
    (
        "upload bytes negative",
        _set("server.max_upload_bytes", -1),
        "server.max_upload_bytes: must be >= 1",
    ),
    ("grace negative", _set("server.grace_s", -1), "server.grace_s: must be >= 0"),
    ("server missing", _set("server", _DEL), "server: required section is missing"),
    ("server not mapping", _set("server", [1]), "server: must be a mapping, got list"),
    ("backbone missing", _set("backbone", _DEL), "backbone: required section is missing"),
    (
        "backbone config missing",
        _set("backbone", {"device": "cpu"}),
        "backbone.config: required key is missing",
    ),
    (
        "device",
        _set("backbone.device", "tpu"),
        "backbone.device: must be one of 'cpu', 'cuda', 'auto', got string 'tpu'",
    ),
    ("dtype", _set("backbone.dtype", "int8"), "backbone.dtype: must be one of"),
    (
        "preset typo",
        _set("backbone.config", "bert_tiny"),
        "backbone.config: 'bert_tiny' is neither a preset nor an existing path; "
        "did you mean 'bert-tiny'?",
    ),
    (
        "batch tokens 0",
        _set("scheduler", {"max_batch_tokens": 0}),
        "scheduler.max_batch_tokens: must be >= 1, got 0",
    ),
    (
        "wait negative",
        _set("scheduler", {"max_wait_ms": -1}),
        "scheduler.max_wait_ms: must be >= 0",
    ),
    (
        "strategy",
        _set("scheduler", {"strategy": "Fast Please"}),
        "scheduler.strategy: must be 'auto' or one of",
    ),
    (
        "tls cert without key",
        _set("server.tls", {"cert": "c.pem"}),
        "server.tls.key: required when server.tls.cert is set ('/cfg/c.pem')",
    ),
    (
        "tls key without cert",
        _set("server.tls", {"key": "k.pem"}),
        "server.tls.cert: required when server.tls.key is set ('/cfg/k.pem')",
    ),
    (
        "tls ca only",
        _set("server.tls", {"client_ca": "ca.pem"}),
        "server.tls.cert: required (with server.tls.key) when server.tls.client_ca is set",
    ),
    ("tls empty", _set("server.tls", {}), "server.tls: must set cert and key"),
    (
        "tls unknown",
        _set("server.tls", {"cert": "c", "key": "k", "ca": "x"}),
        "server.tls.ca: unknown key",
    ),
    (
        "admin hash reused",
        _set("tenants.0.token_sha256", ADMIN),
        "tenants[0].token_sha256: equals server.admin_token_sha256",
    ),
]


@pytest.mark.parametrize("mutate,expected", [c[1:] for c in BAD_CASES],
                         ids=[c[0] for c in BAD_CASES])
def test_rejects_with_key_path(mutate, expected):
    d = mutate(copy.deepcopy(base_dict()))
    with pytest.raises(InvalidConfig) as ei:
        parse(d)
    assert expected in str(ei.value)
    assert ei.value.code == "INVALID_ARGUMENT"


def test_duplicate_ids_quote_both_indices():
    d = with_tenants(
        {"id": "acme", "token_sha256": ACME},
        {"id": "beta", "token_sha256": BETA},
        {"id": "acme", "token_sha256": GAMMA},
    )
    with pytest.raises(InvalidConfig, match=r"tenants\[2\]\.id: duplicate tenant id 'acme' "
                                            r"\(also tenants\[0\]\.id\)"):
        parse(d)


def test_duplicate_token_hashes_rejected():
    d = with_tenants({"id": "acme", "token_sha256": ACME}, {"id": "beta", "token_sha256": ACME})
    with pytest.raises(InvalidConfig,
                       match=r"tenants\[1\]\.token_sha256: same token hash as tenants\[0\]"):
        parse(d)


def test_cross_field_checks_quote_both_values():
    d = base_dict()
    d["backbone"]["max_seq_len"] = 128
    d["tenants"][0]["max_seq_len"] = 256
    with pytest.raises(InvalidConfig,
                       match=r"tenants\[0\]\.max_seq_len: 256 exceeds backbone\.max_seq_len 128"):
        parse(d)
    d = base_dict()
    d["backbone"]["max_seq_len"] = 512
    d["scheduler"] = {"max_batch_tokens": 256}
    with pytest.raises(InvalidConfig, match=r"scheduler\.max_batch_tokens: 256 is less than "
                                            r"backbone\.max_seq_len 512"):
        parse(d)


def test_all_problems_reported_together():
    d = base_dict()
    d["tenants"][0]["max_queue"] = 0
    d["server"]["grace_s"] = -1
    d["bogus"] = 1
    with pytest.raises(InvalidConfig) as ei:
        parse(d)
    msg = str(ei.value)
    assert msg.startswith("3 problems:")
    for part in ("bogus: unknown key", "server.grace_s: must be >= 0",
                 "tenants[0].max_queue: must be >= 1, got 0"):
        assert part in msg


def test_unquoted_numeric_hash_hint():
    text = MINIMAL.replace(ACME, "1" * 64)
    with pytest.raises(InvalidConfig, match=r"tenants\[0\]\.token_sha256: .*\(quote it in YAML\)"):
        parse(text)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("", "config is empty"),
        ("   \n# only a comment\n", "config is empty"),
        ("- a\n- b\n", "config must be a mapping"),
        ("just a string", "config must be a mapping"),
        ("server:\n  listen: [127.0.0.1\nbackbone: {}\n", "invalid YAML at line 3"),
        ("server:\n\tlisten: x\n", "invalid YAML at line 2"),
        ("a: 1\nb: 2\na: 3\n",
         "invalid YAML at line 3, column 1: duplicate key 'a' (first defined on line 1)"),
        ("--- {}\n--- {}\n", "invalid YAML"),
        ("a: !!python/object:os.system {}\n", "invalid YAML"),
    ],
    ids=["empty", "comment-only", "list", "scalar", "unclosed", "tab", "dup-key", "multi-doc",
         "python-tag"],
)
def test_bad_yaml(tmp_path, text, expected):
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(InvalidConfig) as ei:
        load_config(path)
    assert expected in str(ei.value)
    assert str(ei.value).startswith(str(path) + ": ")


def test_unreadable_files(tmp_path):
    with pytest.raises(InvalidConfig, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"server: \xff\xfe\n")
    with pytest.raises(InvalidConfig, match="not valid UTF-8"):
        load_config(p)


def test_no_env_vars_read(monkeypatch):
    monkeypatch.setenv("HOME", "/nonexistent-home")
    monkeypatch.setenv("ITIF_DATA_DIR", "/elsewhere")
    cfg = parse(MINIMAL, Path("/cfg"))
    assert cfg.server.data_dir == Path("/cfg/var/itif")


def test_presets_listed():
    required = {
        "bert-base",
        "bert-large",
        "albert-large",
        "vit-base",
        "bert-tiny",
        "albert-tiny",
        "vit-tiny",
    }
    assert set(BACKBONE_PRESETS) >= required
    assert backbone_presets() >= required
    for name in sorted(backbone_presets()):
        d = base_dict()
        d["backbone"]["config"] = name
        assert parse(d).backbone.config == name


# --------------------------------------------------------------------------------------------
# diff_configs
# --------------------------------------------------------------------------------------------


def test_diff_added_removed_changed():
    old = parse(
        with_tenants({"id": "acme", "token_sha256": ACME}, {"id": "beta", "token_sha256": BETA})
    )
    new = parse(
        with_tenants(
            {"id": "acme", "token_sha256": ACME, "max_queue": 8},
            {"id": "gamma", "token_sha256": GAMMA},
        )
    )
    diff = diff_configs(old, new)
    assert diff.added == (new.tenant("gamma"),)
    assert diff.removed == ("beta",)
    assert diff.changed == (new.tenant("acme"),)
    assert diff.changed[0].max_queue == 8
    assert not diff.scheduler_changed and diff.server_changed == ()
    assert not diff.empty
    assert diff_configs(old, old) == ConfigDiff()
    assert diff_configs(old, old).empty


def test_diff_live_keys():
    old = parse(MINIMAL)
    d = base_dict()
    d["scheduler"] = {"max_wait_ms": 1}
    d["server"]["grace_s"] = 3
    d["server"]["admin_token_sha256"] = GAMMA
    diff = diff_configs(old, parse(d))
    assert diff.scheduler_changed
    assert diff.server_changed == ("admin_token_sha256", "grace_s")
    assert diff.added == diff.removed == diff.changed == ()


@pytest.mark.parametrize(
    "mutate,key",
    [
        (_set("server.listen", "0.0.0.0:50051"),
         "server.listen: changed from '127.0.0.1:50051' to '0.0.0.0:50051'"),
        (_set("server.data_dir", "/other"),
         "server.data_dir: changed from '/cfg/var/itif' to '/other'"),
        (_set("backbone.config", "bert-base"),
         "backbone.config: changed from 'bert-tiny' to 'bert-base'"),
        (_set("backbone.dtype", "float16"), "backbone.dtype"),
        (_set("server.tls", {"cert": "c", "key": "k"}), "server.tls: changed from None"),
        (_set("server.max_message_bytes", 2048), "server.max_message_bytes"),
    ],
)
def test_diff_restart_needed(mutate, key):
    old = parse(MINIMAL)
    new = parse(mutate(base_dict()))
    with pytest.raises(InvalidConfig) as ei:
        diff_configs(old, new)
    assert key in str(ei.value)
    assert "restart" in str(ei.value)


# --------------------------------------------------------------------------------------------
# ConfigWatcher
# --------------------------------------------------------------------------------------------

POLL = 0.05
DEBOUNCE = 0.1


def config_text(*ids: str) -> str:
    hashes = {"acme": ACME, "beta": BETA, "gamma": GAMMA}
    d = with_tenants(*({"id": i, "token_sha256": hashes.get(i, hash_token(i))} for i in ids))
    return dump(d)


class Recorder:
    def __init__(self) -> None:
        self.changes: list[Config] = []
        self.errors: list[Exception] = []
        self.cond = threading.Condition()

    def on_change(self, cfg: Config) -> None:
        with self.cond:
            self.changes.append(cfg)
            self.cond.notify_all()

    def on_error(self, exc: Exception) -> None:
        with self.cond:
            self.errors.append(exc)
            self.cond.notify_all()

    def wait(self, pred, timeout: float = 5.0) -> None:
        with self.cond:
            assert self.cond.wait_for(pred, timeout), (self.changes, self.errors)

    def ids(self) -> list[tuple[str, ...]]:
        return [c.tenant_ids for c in self.changes]


@pytest.fixture
def watch(tmp_path):
    watchers: list[ConfigWatcher] = []

    def make(path: Path, debounce_s: float = DEBOUNCE, **kw) -> tuple[ConfigWatcher, Recorder]:
        rec = Recorder()
        w = ConfigWatcher(
            path, rec.on_change, rec.on_error, poll_s=POLL, debounce_s=debounce_s, **kw
        )
        watchers.append(w)
        w.start()
        return w, rec

    yield make
    for w in watchers:
        w.stop()


def settle() -> None:
    """Long enough for several polls plus the debounce: anything pending would have fired."""
    time.sleep(POLL * 4 + DEBOUNCE * 2)


def test_watcher_baseline_sets_last_good_without_callback(tmp_path, watch):
    path = tmp_path / "tenants.yaml"
    path.write_text(config_text("acme"))
    w, rec = watch(path)
    assert w.last_good is not None and w.last_good.tenant_ids == ("acme",)
    assert w.last_error is None and w.running
    settle()
    assert rec.changes == [] and rec.errors == []


def test_watcher_in_place_rewrite_applied_once(tmp_path, watch):
    path = tmp_path / "tenants.yaml"
    path.write_text(config_text("acme"))
    w, rec = watch(path)
    path.write_text(config_text("acme", "beta"))
    rec.wait(lambda: rec.changes)
    settle()
    assert rec.ids() == [("acme", "beta")]
    assert rec.errors == []
    assert w.last_good == rec.changes[0]
    # touching without changing the content is not a change
    os.utime(path)
    path.write_text(config_text("acme", "beta"))
    settle()
    assert len(rec.changes) == 1


def test_watcher_editor_rename_replace_applied_once(tmp_path, watch):
    path = tmp_path / "tenants.yaml"
    path.write_text(config_text("acme"))
    w, rec = watch(path)
    tmp = tmp_path / ".tenants.yaml.swp"
    tmp.write_text(config_text("acme", "gamma"))
    os.replace(tmp, path)
    rec.wait(lambda: rec.changes)
    settle()
    assert rec.ids() == [("acme", "gamma")]
    assert rec.errors == []


def test_watcher_kubernetes_symlink_swap_applied_once(tmp_path, watch):
    mount = tmp_path / "mount"
    mount.mkdir()
    v1 = mount / "..2024_01_01_00_00_00.1"
    v1.mkdir()
    (v1 / "tenants.yaml").write_text(config_text("acme"))
    (mount / "..data").symlink_to(v1.name)
    (mount / "tenants.yaml").symlink_to("..data/tenants.yaml")
    w, rec = watch(mount / "tenants.yaml")
    assert w.last_good.tenant_ids == ("acme",)
    # new version: written in full in a fresh directory, then ..data is swapped atomically
    v2 = mount / "..2024_01_01_00_05_00.2"
    v2.mkdir()
    (v2 / "tenants.yaml").write_text(config_text("acme", "beta"))
    (mount / "..data_tmp").symlink_to(v2.name)
    os.replace(mount / "..data_tmp", mount / "..data")
    import shutil

    shutil.rmtree(v1)
    rec.wait(lambda: rec.changes)
    settle()
    assert rec.ids() == [("acme", "beta")]
    assert rec.errors == []
    # relative paths resolve against the mount dir (the path as given), not the versioned dir
    assert rec.changes[0].server.data_dir == mount / "var" / "itif"


def test_watcher_bad_edit_keeps_last_good(tmp_path, watch):
    path = tmp_path / "tenants.yaml"
    path.write_text(config_text("acme"))
    w, rec = watch(path)
    good = w.last_good
    path.write_text(config_text("acme").replace("id: acme", "id: ACME"))
    rec.wait(lambda: rec.errors)
    settle()
    assert len(rec.errors) == 1 and rec.changes == []
    assert isinstance(rec.errors[0], InvalidConfig)
    assert "tenants[0].id" in str(rec.errors[0])
    assert w.last_good is good
    assert w.last_error is rec.errors[0]
    # fixing it applies the fix and clears the error
    path.write_text(config_text("beta"))
    rec.wait(lambda: rec.changes)
    assert rec.ids() == [("beta",)]
    assert w.last_error is None and w.last_good.tenant_ids == ("beta",)


def test_watcher_half_written_file_debounced(tmp_path, watch):
    path = tmp_path / "tenants.yaml"
    path.write_text(config_text("acme"))
    debounce = 1.0
    w, rec = watch(path, debounce_s=debounce)
    full = config_text("acme", "beta", "gamma")
    cut = full.index("- id: beta") + 5  # mid-entry: "- id:" with no value -> invalid
    with open(path, "w") as f:
        f.write(full[:cut])
        f.flush()
        time.sleep(0.3)  # several polls see the half-written file
        f.write(full[cut:])
    rec.wait(lambda: rec.changes, timeout=debounce + 5)
    time.sleep(debounce + 0.3)
    assert rec.errors == []
    assert rec.ids() == [("acme", "beta", "gamma")]


def test_watcher_on_change_failure_is_an_error(tmp_path, watch):
    path = tmp_path / "tenants.yaml"
    path.write_text(config_text("acme"))
    rec = Recorder()
    applied: list[Config] = []

    def on_change(cfg: Config) -> None:
        diff_configs(w.last_good, cfg)  # raises for restart-only changes
        applied.append(cfg)

    w = ConfigWatcher(path, on_change, rec.on_error, poll_s=POLL, debounce_s=DEBOUNCE).start()
    try:
        good = w.last_good
        path.write_text(config_text("acme").replace("127.0.0.1:50051", "0.0.0.0:50051"))
        rec.wait(lambda: rec.errors)
        assert "server.listen" in str(rec.errors[0])
        assert w.last_good is good and applied == []
        path.write_text(config_text("acme", "beta"))
        time.sleep(0.1)
        settle()
        assert [c.tenant_ids for c in applied] == [("acme", "beta")]
        assert len(rec.errors) == 1
    finally:
        w.stop()


def test_watcher_missing_file_reported_then_recovers(tmp_path, watch):
    path = tmp_path / "tenants.yaml"
    path.write_text(config_text("acme"))
    w, rec = watch(path)
    path.unlink()
    rec.wait(lambda: rec.errors)
    assert "not found" in str(rec.errors[0])
    assert w.last_good.tenant_ids == ("acme",)
    path.write_text(config_text("acme", "beta"))
    rec.wait(lambda: rec.changes)
    settle()
    assert rec.ids() == [("acme", "beta")] and len(rec.errors) == 1


def test_watcher_initial_mismatch_calls_on_change(tmp_path, watch):
    path = tmp_path / "tenants.yaml"
    path.write_text(config_text("acme"))
    initial = load_config(path)
    path.write_text(config_text("acme", "beta"))  # changed between load and start
    w, rec = watch(path, initial=initial)
    assert rec.ids() == [("acme", "beta")]
    w2, rec2 = watch(path, initial=load_config(path))
    assert rec2.changes == [] and w2.last_good.tenant_ids == ("acme", "beta")


def test_watcher_stop_joins_thread(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(config_text("acme"))
    rec = Recorder()
    with ConfigWatcher(path, rec.on_change, rec.on_error, poll_s=POLL, debounce_s=0) as w:
        thread = w._thread
        assert thread is not None and thread.is_alive()
    assert not thread.is_alive()
    assert not w.running
    path.write_text(config_text("beta"))
    time.sleep(POLL * 4)
    assert rec.changes == []
    with pytest.raises(ValueError):
        ConfigWatcher(path, rec.on_change, rec.on_error, poll_s=0)


def test_tenants_on_a_base_are_a_lookup_in_file_order():
    from itif.config.schema import BackboneConfig, Config, ServerConfig, Tenant

    h = "0" * 64
    ts = (Tenant("b", h), Tenant("l1", h, base="b"), Tenant("c", h), Tenant("l2", h, base="b"),
          Tenant("l3", h, base="c"))
    cfg = Config(ServerConfig("127.0.0.1:0", Path("/tmp"), h), BackboneConfig("bert-tiny"),
                 tenants=ts)
    assert [t.id for t in cfg.tenants_on("b")] == ["l1", "l2"]
    assert [t.id for t in cfg.tenants_on("c")] == ["l3"]
    assert cfg.tenants_on("l1") == () and cfg.tenants_on("nobody") == ()


@pytest.mark.parametrize("backbone, tenant, message", [
    ("  host_weight_bytes: 1MiB\n", "", r"backbone\.host_weight_bytes: only applies with "
                                      r"backbone\.device_weight_bytes"),
    ("", "    pinned: true\n", r"tenants\[0\]\.pinned: only applies with "
                                r"backbone\.device_weight_bytes"),
])
def test_tier_settings_without_tiers_are_refused(tmp_path, backbone, tenant, message):
    """Both were accepted and did nothing (a review found it): every tenant is resident
    without backbone.device_weight_bytes."""
    text = ("server:\n  listen: 127.0.0.1:0\n  data_dir: ./data\n"
            f"  admin_token_sha256: {hash_token('admin')}\n"
            f"backbone:\n  config: bert-tiny\n{backbone}tenants:\n"
            f"  - id: a\n    token_sha256: {hash_token('a')}\n{tenant}")
    with pytest.raises(InvalidConfig, match=message):
        parse_config(text, tmp_path)
    fixed = text.replace("backbone:\n", "backbone:\n  device_weight_bytes: 1GiB\n")
    parse_config(fixed, tmp_path)  # with tiers: accepted
