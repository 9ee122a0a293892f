"""Redis as people run it, against real redis-servers: a password (requirepass, an ACL user, from a
file or the environment), TLS (certificates made here with openssl: CA, server, client) and
Sentinel with its own password and the master's. Each round-trips a chunk through RemoteTier; a
wrong password, an untrusted certificate or a missing client certificate is one warning naming the
setting to fix, and no password ever shows in a log line, an error or a repr."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvferry.common import secret
from kvferry.common.config import ConfigError, load_config
from kvferry.common.redact import redact_url
from kvferry.engine.remote import redis_settings
from kvferry.engine.remote.backends import parse_url
from kvferry.engine.remote.redis_backend import RedisSettings, client_kwargs, parse_redis_url
from kvferry.engine.remote.serde import ChunkShape, Serde
from kvferry.engine.tiers.remote import RemoteError, RemoteTier
from kvferry.launcher.services import Proc
from kvferry.testing.store_servers import start_redis, start_sentinel
from tests.tls_certs import Certs, make_certs

SHAPE = ChunkShape(torch.bfloat16, num_layers=2, num_kv_heads=2, head_size=16, layout_digest=b"L" * 16)
TOKENS = 64
NBYTES = 2 * 2 * TOKENS * 2 * 16 * 2
PW = "p@ss:w/rd?#%1"  # every character a URL must percent-encode
PW_URL = "p%40ss%3Aw%2Frd%3F%23%251"
ALICE_PW = "alice-s3cret"
SENTINEL_PW = "sentinel-s3cret"
_seed = iter(range(100, 10_000))


def chunk() -> torch.Tensor:
    g = torch.Generator().manual_seed(next(_seed))
    return torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=g)


def round_trip(url: str, settings: RedisSettings | None = None) -> None:
    """A chunk put by one RemoteTier is read back, byte for byte, by another (the store holds it)."""
    key, data = os.urandom(16), chunk()
    writer = RemoteTier(url, 2.0, Serde("naive", SHAPE), redis=settings)
    reader = RemoteTier(url, 2.0, Serde("naive", SHAPE), redis=settings)
    try:
        assert writer.put(key, data, TOKENS) and writer.flush(10)
        assert writer.stats()["stored_chunks|remote"] == 1, writer.stats()
        assert reader.exists([key, os.urandom(16)]) == [True, False]
        got = reader.get(key, TOKENS, NBYTES)
        assert got is not None and torch.equal(got, data)
        assert writer.stats()["remote_errors"] == reader.stats()["remote_errors"] == 0
    finally:
        writer.close()
        reader.close()


def refused(url: str, settings: RedisSettings | None, logs: pytest.LogCaptureFixture) -> str:
    """The one warning a RemoteTier logs when the store refuses it (a miss, counted)."""
    t = RemoteTier(url, 2.0, Serde("naive", SHAPE), redis=settings)
    try:
        logs.clear()
        assert t.get(os.urandom(16), TOKENS, NBYTES) is None
        assert t.stats()["remote_errors"] == 1
    finally:
        t.close()
    lines = [r.getMessage() for r in logs.records if "remote store" in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


@dataclass
class Stores:
    certs: Certs
    other: Certs  # a CA that did not sign the server's certificate
    pw: Proc  # requirepass PW and ACL user alice
    tls: Proc  # TLS only, client certificates checked, requirepass PW
    master: Proc
    sentinels: list[Proc]

    @property
    def sentinel_url(self) -> str:
        return "redis-sentinel://:" + PW_URL + "@" + ",".join(s.url_hostport for s in self.sentinels) + "/mymaster"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, certs: Certs, redis_available) -> Iterator[Stores]:
    work = tmp_path_factory.mktemp("redis-auth")
    other = make_certs(work / "other", "other")
    procs: list[Proc] = []
    try:
        procs.append(pw := start_redis(work, password=PW, users={"alice": ALICE_PW}))
        procs.append(tls := start_redis(work, password=PW, tls=certs.server(), plain=False))
        procs.append(master := start_redis(work, password=PW))
        for _ in range(2):
            procs.append(start_sentinel(work, master.port, password=SENTINEL_PW, master_password=PW))
        yield Stores(certs, other, pw, tls, master, procs[3:])
    finally:
        for p in procs:
            p.stop()


# ---- URLs and settings, no server ----

@pytest.mark.parametrize("url,shown", [
    ("redis://:pw@h:1", "redis://:***@h:1"), ("redis://alice:pw@h:1/2", "redis://alice:***@h:1/2"),
    ("redis://alice@h:1", "redis://alice@h:1"), ("redis://h:1", "redis://h:1"),
    (f"rediss://u:{PW}@h:1?ssl_ca_certs=/c@a", "rediss://u:***@h:1?ssl_ca_certs=/c@a"),
    ("redis-sentinel://:a@b@h:1,h:2/m", "redis-sentinel://:***@h:1,h:2/m")])
def test_urls_are_shown_without_their_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_url_credentials_database_and_tls_options_are_parsed() -> None:
    u = parse_redis_url(f"rediss://alice:{PW_URL}@127.0.0.1:6380/3?ssl_ca_certs=/ca.crt&ssl_cert_reqs=required")
    assert (u.scheme, u.nodes, u.username, u.password, u.db) == ("rediss", [("127.0.0.1", 6380)], "alice", PW, 3)
    assert u.query == {"ssl_ca_certs": "/ca.crt", "ssl_cert_reqs": "required"} and PW not in repr(u)
    s = parse_redis_url("redis-sentinel://:pw@a:1,b:2/mymaster")
    assert (s.nodes, s.password, s.service) == ([("a", 1), ("b", 2)], "pw", "mymaster")
    assert parse_url("redis://alice:pw@h:1") == ("redis", [("h", 1)], "")


@pytest.mark.parametrize("url,fix", [
    ("redis://:pw@h:1/x", "not a database number"), ("redis://:pw@h:1?ssl_ca_certs=/a", "need rediss://"),
    ("rediss://h:1?sslca=/a", "use one of ssl_ca_certs"), ("rediss://:pw@a:1,b:2", "takes one host:port"),
    ("memcache://:pw@h:1", "use redis://host:port, rediss://")])
def test_bad_redis_urls_name_the_fix_and_hide_the_password(url: str, fix: str) -> None:
    with pytest.raises(RemoteError, match=fix) as e:
        parse_url(url)
    assert ":pw@" not in str(e.value)


def test_config_keys_extra_config_and_password_file(tmp_path: Path, certs: Certs) -> None:
    pw_file = tmp_path / "pw"
    secret.write_file(str(pw_file), PW)  # 0600, the password and a newline
    cfg = load_config({"remote_url": "rediss://h:1", "remote_password_file": str(pw_file), "remote_username": "u",
                       "extra_config": {"ssl_ca_certs": str(certs.ca)}}, env={})
    s = redis_settings.from_config(cfg)
    assert (s.username, s.password, s.tls_ca_file) == ("u", PW, str(certs.ca))
    assert "remote_password_file" in s.password_from and PW not in repr(s)
    env = load_config({"remote_url": "redis://h:1"}, env={"KVFERRY_REMOTE_PASSWORD": PW})
    assert redis_settings.from_config(env).password == PW and PW not in repr(env)
    assert redis_settings.from_config(load_config({"remote_url": "lm://h:1"}, env={})) is None


def test_the_config_repr_hides_every_redis_password() -> None:
    cfg = load_config({"remote_url": f"redis-sentinel://:{PW_URL}@h:1,h:2", "remote_sentinel_password": "sentinel-pw",
                       "extra_config": {"remote_password": "extra-pw"}}, env={})
    shown = repr(cfg)
    assert PW_URL not in shown and "sentinel-pw" not in shown and "extra-pw" not in shown
    assert "redis-sentinel://:***@h:1,h:2" in shown and "<hidden>" in shown


@pytest.mark.parametrize("keys,fix", [
    ({"remote_url": "redis://h:1", "remote_tls_ca_file": "/etc/hostname"}, "remote_tls_ca_file is set but "
     "remote_url is redis://: TLS needs rediss://"),
    ({"remote_url": "redis://h:1", "remote_sentinel_password": "x"}, "are for redis-sentinel://"),
    ({"remote_url": "lm://h:1", "remote_password": "x"}, "not Redis: remove it"),
    ({"remote_url": "redis://h:1", "remote_password": "x", "remote_password_file": "/etc/hostname"},
     "are both set: keep one"),
    ({"remote_url": "redis://:y@h:1", "remote_password": "x"}, "has a password and config key remote_password is set"),
    ({"remote_url": "redis://h:1", "remote_password_file": "/nonexistent"}, "cannot read the password file"),
    ({"remote_url": "rediss://h:1", "remote_tls_ca_file": "/nonexistent"}, "remote_tls_ca_file '/nonexistent' "
     "cannot be read"),
    ({"remote_url": "rediss://h:1", "remote_tls_ca_file": "/etc/hostname"}, "holds no usable CA certificate"),
    ({"remote_url": "rediss://h:1", "remote_tls_key_file": "/etc/hostname"}, "without remote_tls_cert_file"),
    ({"remote_url": "rediss://h:1", "remote_tls_ca_file": "/a", "extra_config": {"ssl_ca_certs": "/b"}},
     "config key remote_tls_ca_file and extra_config ssl_ca_certs are set to different values")])
def test_contradictions_and_bad_files_are_config_errors_naming_the_key(keys: dict, fix: str) -> None:
    with pytest.raises(ConfigError, match=fix.replace("?", r"\?")) as e:
        redis_settings.from_config(load_config(keys, env={}))
    assert ":y@" not in str(e.value)  # a password in the URL stays hidden


def test_rediss_without_a_usable_ca_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No system CA bundle: OpenSSL reads its default locations from these variables.
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "none.pem"))
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="no system CA bundle: set remote_tls_ca_file"):
        redis_settings.from_config(load_config({"remote_url": "rediss://127.0.0.1:1"}, env={}))


@pytest.mark.parametrize("query,warned", [("ssl_check_hostname=false", "ssl_check_hostname=false"),
                                           ("ssl_cert_reqs=none", "ssl_cert_reqs=none"), ("", None)])
def test_each_relaxed_tls_check_is_a_warning_once(certs: Certs, kvf_logs: pytest.LogCaptureFixture, query: str,
                                                 warned: str | None) -> None:
    """docs/redis.md: each option that relaxes the server check is logged as a warning (once per URL)."""
    u = parse_redis_url(f"rediss://127.0.0.1:6380?{query}")
    settings = RedisSettings(tls_ca_file=str(certs.ca))
    for _ in range(2):
        kw = client_kwargs(u, settings, 1.0)
    assert kw["ssl_check_hostname"] is (warned is None)
    lines = [r.getMessage() for r in kvf_logs.records if r.levelname == "WARNING"]
    assert len(lines) == (warned is not None) and all(warned in line for line in lines), lines


# ---- a password ----

@pytest.mark.parametrize("form", ["url", "url_user", "settings", "settings_user"])
def test_a_password_protected_redis_round_trips_a_chunk(stores: Stores, form: str) -> None:
    hp = stores.pw.url_hostport
    url, settings = {
        "url": (f"redis://:{PW_URL}@{hp}", None),
        "url_user": (f"redis://alice:{ALICE_PW}@{hp}/0", None),
        "settings": (f"redis://{hp}", RedisSettings(password=PW, password_from="remote_password")),
        "settings_user": (f"redis://{hp}", RedisSettings(username="alice", password=ALICE_PW))}[form]
    round_trip(url, settings)


def test_a_password_from_a_file_round_trips_through_the_config(stores: Stores, tmp_path: Path) -> None:
    pw_file = tmp_path / "redis-password"
    secret.write_file(str(pw_file), PW)
    cfg = load_config({"remote_url": f"redis://{stores.pw.url_hostport}", "remote_password_file": str(pw_file)},
                      env={})
    round_trip(cfg.remote_url, redis_settings.from_config(cfg))


def test_a_wrong_or_missing_password_is_one_warning_naming_the_setting(stores: Stores, kvf_logs) -> None:
    hp = stores.pw.url_hostport
    line = refused(f"redis://:wrong-one@{hp}", None, kvf_logs)
    assert "refused our credentials" in line and "the password in use is from remote_url" in line
    assert "remote_password_file" in line and "wrong-one" not in line and "redis://:***@" in line
    line = refused(f"redis://{hp}", RedisSettings(password="wrong-two", password_from="config key remote_password"),
                   kvf_logs)
    assert "from config key remote_password" in line and "wrong-two" not in line
    line = refused(f"redis://{hp}", None, kvf_logs)
    assert "Redis wants a password" in line and "set remote_password" in line
    assert "\n" not in line


def test_no_password_reaches_a_log_line(stores: Stores, kvf_logs) -> None:
    url = f"redis://:{PW_URL}@{stores.pw.url_hostport}"
    t = RemoteTier(url, 2.0, Serde("naive", SHAPE))
    assert PW_URL not in t.url and PW_URL not in t._backoff.name
    t.close()
    stores.pw.proc.send_signal(19)  # SIGSTOP: every call times out and is logged with the URL
    try:
        refused(url, None, kvf_logs)
    finally:
        stores.pw.proc.send_signal(18)  # SIGCONT
    text = kvf_logs.text
    assert "redis://:***@" in text and PW_URL not in text and PW not in text


# ---- TLS ----

def test_tls_with_ca_and_client_certificate_round_trips_a_chunk(stores: Stores) -> None:
    c = stores.certs
    settings = RedisSettings(password=PW, tls_ca_file=str(c.ca), tls_cert_file=str(c.client_cert),
                             tls_key_file=str(c.client_key))
    round_trip(f"rediss://{stores.tls.url_hostport}", settings)


def test_tls_as_lmcache_writes_it_in_the_url_round_trips_a_chunk(stores: Stores) -> None:
    c = stores.certs
    round_trip(f"rediss://:{PW_URL}@localhost:{stores.tls.port}?ssl_ca_certs={c.ca}&ssl_certfile={c.client_cert}"
               f"&ssl_keyfile={c.client_key}")


def test_tls_from_config_keys_round_trips_a_chunk(stores: Stores) -> None:
    c = stores.certs
    cfg = load_config({"remote_url": f"rediss://{stores.tls.url_hostport}", "remote_password": PW,
                       "remote_tls_ca_file": str(c.ca), "extra_config": {
                           "remote_tls_cert_file": str(c.client_cert), "ssl_keyfile": str(c.client_key)}}, env={})
    round_trip(cfg.remote_url, redis_settings.from_config(cfg))


@pytest.mark.parametrize("case,fix", [
    ("untrusted", "the server's certificate is not trusted"), ("other_ca", "the server's certificate is not trusted"),
    ("no_client_cert", "set remote_tls_cert_file and remote_tls_key_file"),
    ("plain_port", "is the port a TLS port")])
def test_a_failed_tls_handshake_names_the_tls_settings(stores: Stores, kvf_logs, case: str, fix: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    c, hp = stores.certs, stores.tls.url_hostport
    settings = {
        "untrusted": RedisSettings(password=PW),  # the system's CAs never signed the test server
        "other_ca": RedisSettings(password=PW, tls_ca_file=str(stores.other.ca), tls_cert_file=str(c.client_cert),
                                  tls_key_file=str(c.client_key)),
        "no_client_cert": RedisSettings(password=PW, tls_ca_file=str(c.ca)),
        "plain_port": RedisSettings(password=PW, tls_ca_file=str(c.ca))}[case]
    if case == "plain_port":
        hp = stores.pw.url_hostport
    line = refused(f"rediss://{hp}", settings, kvf_logs)
    assert fix in line, line
    if case != "plain_port":
        assert "remote_tls_ca_file" in line


def test_a_url_that_turns_the_server_check_off_connects_and_is_warned_about(stores: Stores, kvf_logs) -> None:
    c = stores.certs
    round_trip(f"rediss://:{PW_URL}@{stores.tls.url_hostport}?ssl_cert_reqs=none&ssl_certfile={c.client_cert}"
               f"&ssl_keyfile={c.client_key}")
    assert "ssl_cert_reqs=none: the server's certificate is not checked" in kvf_logs.text


def test_plain_redis_url_to_a_tls_port_hints_at_rediss(stores: Stores, kvf_logs) -> None:
    line = refused(f"redis://:{PW_URL}@{stores.tls.url_hostport}", None, kvf_logs)
    assert "use rediss://" in line


# ---- Sentinel with auth ----

def test_sentinel_with_its_own_password_and_the_masters_round_trips_a_chunk(stores: Stores) -> None:
    round_trip(stores.sentinel_url, RedisSettings(sentinel_password=SENTINEL_PW))


def test_sentinel_from_config_with_the_master_named_by_the_sentinels(stores: Stores, tmp_path: Path) -> None:
    pw_file = tmp_path / "sentinel-password"
    secret.write_file(str(pw_file), SENTINEL_PW)
    url = "redis-sentinel://" + ",".join(s.url_hostport for s in stores.sentinels)  # no service: the one monitored
    cfg = load_config({"remote_url": url, "remote_password": PW, "remote_sentinel_password_file": str(pw_file)},
                      env={})
    round_trip(url, redis_settings.from_config(cfg))


@pytest.mark.parametrize("case,fix", [
    ("no_sentinel_password", "the Sentinels want a password"),
    ("wrong_sentinel_password", "a Sentinel refused our credentials"),
    ("wrong_master_password", "Redis refused our credentials")])
def test_sentinel_auth_failures_name_the_setting(stores: Stores, kvf_logs, case: str, fix: str) -> None:
    url = stores.sentinel_url
    settings = RedisSettings(sentinel_password=SENTINEL_PW)
    if case == "no_sentinel_password":
        settings = RedisSettings()
    elif case == "wrong_sentinel_password":
        settings = RedisSettings(sentinel_password="nope-nope")
    else:
        url = url.replace(PW_URL, "wrong-master")
    line = refused(url, settings, kvf_logs)
    assert fix in line, line
    want = "remote_password" if case == "wrong_master_password" else "remote_sentinel_password"
    assert want in line
    assert "nope-nope" not in line and "wrong-master" not in line and SENTINEL_PW not in line
