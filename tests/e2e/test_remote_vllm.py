"""Sharing KV between vLLM CPU instances through a remote store (LMCache's Redis example): a prompt served
by instance 1 is a remote hit on instance 2 through Redis as people run it (a password-protected
server, one instance on its plain port as an ACL user, the other on its TLS port with a client
certificate; Sentinels with their own password naming a password-protected master), and through
kvferry-server (lm://); a Redis master killed mid-stream is followed through Sentinel's failover; a
kvferry-server killed mid-run turns into misses, and hits come back after its restart; a
corrupted chunk, and (with the cluster secret's MAC) another prompt's chunk served under this
prompt's key, are counted misses and the prompt is recomputed to the same answer.

Float32 for the same reason as tests/e2e/test_offload_vllm.py: loaded and computed paths then agree
to 1e-4 in every logprob. All five servers start together (start-up dominates on 2 cores).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from kvferry.common import secret
from kvferry.common.hashing import chunk_keys
from kvferry.engine.offload.ops import offload_salt
from kvferry.engine.remote.redis_backend import RedisSettings
from kvferry.engine.tiers.remote import PREFIX, RemoteTier
from kvferry.launcher.services import Proc
from kvferry.testing.store_servers import start_lm_server, start_redis, start_sentinel
from kvferry.testing.vllm_servers import OffloadServer
from tests.pd_helpers import completion, prom, source_tokens, tier_value, tokens_and_logprobs
from tests.polling import until
from tests.tls_certs import make_certs

FP32 = ["--dtype", "float32", "--no-enable-prefix-caching"]
CHUNK = 256
_seed = iter(range(1000, 10_000))
PW, ALICE_PW, SENTINEL_PW = "redis-s3cret", "alice-s3cret", "sentinel-s3cret"  # every Redis here wants one


def prompt(n: int = 1000) -> list[int]:
    rng = random.Random(next(_seed))
    return [rng.randrange(10, 4000) for _ in range(n)]


@dataclass
class Setup:
    model: Path
    redis: Proc
    master: Proc
    replica: Proc
    sentinels: list[Proc]
    lm: Proc
    servers: dict[str, OffloadServer]
    urls: dict[str, str]
    procs: list[Proc]  # every store process, stopped by the fixture (a restart appends to it)
    settings: dict[str, RedisSettings]  # by URL: what a test-side RemoteTier needs beyond it

    @staticmethod
    def client(p: Proc) -> redis.Redis:
        """A test's own connection to one of the Redis servers (all want the password)."""
        return redis.Redis(port=p.port, password=PW, socket_timeout=5)

    def keys(self, p: list[int]) -> list[bytes]:
        salt = offload_salt(self.model.name, "float32", 8, 8, 64, 128, CHUNK, 1)
        return chunk_keys(p, CHUNK, salt, include_partial=True)  # save_unfull_chunk is on by default

    def stored(self, url: str, p: list[int], timeout: float = 30.0, by: OffloadServer | None = None,
               lost0: float | None = None, retry: bool = False) -> bool:
        """Until the store holds every chunk of `p` (puts are asynchronous), put there `by` a server.

        With `retry`, False as soon as `by` counts a failed store call or a dropped put past `lost0`
        (such puts are dropped by design, engine/tiers/remote.py): the caller asks again. A timeout
        fails with what the server and the store said."""
        t, keys = RemoteTier(url, 1.0, redis=self.settings.get(url)), self.keys(p)

        def lost() -> bool:
            return by is not None and lost0 is not None and put_losses(by) > lost0

        def held() -> str | bool:
            return all(t.exists(keys)) or (retry and lost() and "lost")

        def why() -> str:
            return f"{url} to get the prompt's {len(keys)} chunks" + ("" if by is None else (
                f" from {by.url} (a store failure {'was' if lost() else 'was not'} counted; Redis roles "
                f"{self.roles()}); its remote-store lines:\n"
                + "\n".join(ln for ln in log(by).splitlines() if "remote store" in ln)[-3000:]))
        try:
            return until(held, timeout, why, every=0.2) is True
        finally:
            t.close()

    def served(self, server: OffloadServer, url: str, p: list[int], n: int) -> tuple[list[int], list[float]]:
        """`server`'s answer to `p`, once the store holds every chunk of `p` (asked twice if its
        first puts were counted lost: the store did not answer for a moment)."""
        lost0 = put_losses(server)
        got = tokens_and_logprobs(completion(server, p, n))
        if not self.stored(url, p, by=server, lost0=lost0, retry=True):
            got = tokens_and_logprobs(completion(server, p, n))
            self.stored(url, p, by=server)  # fails naming the server's remote-store lines
        return got

    def roles(self) -> dict[int, str]:
        """The Sentinel set's Redis servers' roles now, by port (to tell a failover in a message)."""
        out = {}
        for p in (self.master, self.replica):
            try:
                out[p.port] = self.client(p).info("replication")["role"]
            except redis.RedisError as e:
                out[p.port] = type(e).__name__
        return out


def put_losses(server: OffloadServer) -> float:
    """Store calls the server counted as failed, puts it dropped, and its log's warnings of either.

    The log too: vLLM exports a worker's counters with its next engine step, and a put that fails
    after the request's last step waits for another request to be counted."""
    text = log(server)
    return (sum(prom(server, "kvferry:cache_remote_errors_total").values())
            + sum(prom(server, "kvferry:cache_remote_put_dropped_total").values())
            + text.count(": put failed (") + text.count(": put queue full ("))


@pytest.fixture(scope="module")
def setup(tiny_model_path: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory,
          redis_available) -> Iterator[Setup]:
    work = tmp_path_factory.mktemp("remote")
    certs = make_certs(work / "certs")
    for name, text in (("redis-password", PW), ("sentinel-password", SENTINEL_PW)):
        secret.write_file(str(work / name), text)
    procs: list[Proc] = []
    servers: dict[str, OffloadServer] = {}
    try:
        # requirepass, an ACL user, and a TLS port that wants client certificates.
        procs.append(rds := start_redis(work, password=PW, users={"alice": ALICE_PW}, tls=certs.server()))
        procs.append(master := start_redis(work, password=PW))
        procs.append(replica := start_redis(work, replicaof=master.port, password=PW))
        for _ in range(3):  # one at a time: a failed start still stops the ones before it
            procs.append(start_sentinel(work, master.port, down_after_ms=3000, password=SENTINEL_PW,
                                         master_password=PW))
        sentinels = procs[3:]
        procs.append(lm := start_lm_server(work))
        hosts = ",".join(s.url_hostport for s in sentinels)
        urls = {"redis": f"redis://alice:{ALICE_PW}@{rds.url_hostport}", "lm": f"lm://{lm.url_hostport}",
                "redis_tls": f"rediss://{rds.tls_hostport}", "sentinel": f"redis-sentinel://:{PW}@{hosts}",
                "sentinel_named": f"redis-sentinel://{hosts}/mymaster"}
        local = {"local_cpu": True, "max_local_cpu_size": 0.2}
        tls = {"remote_password_file": str(work / "redis-password"), "remote_tls_ca_file": str(certs.ca),
               "remote_tls_cert_file": str(certs.client_cert), "remote_tls_key_file": str(certs.client_key)}
        secret.write_file(str(work / "secret"), secret.generate())  # the sentinel instances MAC their chunks
        sentinel = {"local_cpu": False, "cluster_secret_file": str(work / "secret")}
        for name, cores, url, keys, env in [
                ("redis1", "0", "redis", local, {}), ("redis2", "1", "redis_tls", {**local, **tls}, {}),
                ("lm1", "0", "lm", local, {}), ("lm2", "1", "lm", local, {}),
                ("sentinel", "1", "sentinel",
                 {**sentinel, "remote_sentinel_password_file": str(work / "sentinel-password")}, {}),
                # The same Sentinels, the master's password from the environment, theirs from extra_config.
                ("sentinel2", "0", "sentinel_named",
                 {**sentinel, "extra_config": {"remote_sentinel_password": SENTINEL_PW}},
                 {"KVFERRY_REMOTE_PASSWORD": PW})]:
            servers[name] = OffloadServer(str(tiny_model_path), log_dir, cores, work,
                                          server={"extra_args": FP32, "env": env}, remote_url=urls[url], **keys).start()
        for s in servers.values():
            s.wait_ready()
        with_sentinel = RedisSettings(sentinel_password=SENTINEL_PW)
        settings = {urls["sentinel"]: with_sentinel, urls["sentinel_named"]: RedisSettings(
            password=PW, sentinel_password=SENTINEL_PW), urls["redis_tls"]: RedisSettings(
            password=PW, tls_ca_file=str(certs.ca), tls_cert_file=str(certs.client_cert),
            tls_key_file=str(certs.client_key))}
        yield Setup(tiny_model_path, rds, master, replica, sentinels, lm, servers, urls, procs, settings)
    finally:
        for s in servers.values():
            s.stop()
        for p in procs:
            p.stop()


def log(server: OffloadServer) -> str:
    return server.log_path.read_text(errors="replace")


def remote_hits(server: OffloadServer) -> int:
    """Loads that took chunks from the remote store (from the worker's log line)."""
    return log(server).count("from remote")


def share(s: Setup, first: str, second: str, url: str) -> None:
    one, two = s.servers[first], s.servers[second]
    p = prompt(1000)
    want = s.served(one, url, p, 8)
    src0 = source_tokens(two)
    got = tokens_and_logprobs(completion(two, p, 8))
    loaded = len(p) - 1  # all four chunks (the last one partial); vLLM computes the last token
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3
    assert f"total tokens {len(p)}, hit tokens {len(p)}, need to load {loaded}" in log(two)
    assert f"Retrieved {loaded} out of {loaded} required tokens (from {len(p)} total tokens)" in log(two)
    src = source_tokens(two)
    assert src["external_kv_transfer"] - src0.get("external_kv_transfer", 0) == loaded
    assert src["local_compute"] - src0.get("local_compute", 0) == len(p) - loaded
    until(lambda: tier_value(two, "kvferry:cache_hit_tokens_total", "remote") >= loaded, 10,
          "kvferry:cache_hit_tokens_total{tier=remote} to count the hit", every=0.2)


@pytest.mark.vllm
def test_a_prompt_served_by_one_instance_is_a_remote_hit_on_another_via_redis_with_a_password_then_tls(
        setup: Setup) -> None:
    share(setup, "redis1", "redis2", setup.urls["redis"])  # put as ACL user alice, read over TLS
    assert setup.client(setup.redis).dbsize() >= 2 * 3  # header and payload key per chunk
    assert PW not in log(setup.servers["redis2"]) and ALICE_PW not in log(setup.servers["redis1"])


@pytest.mark.vllm
def test_a_prompt_served_by_one_instance_is_a_remote_hit_on_another_via_redis_tls_then_a_password(
        setup: Setup) -> None:
    share(setup, "redis2", "redis1", setup.urls["redis_tls"])  # put over TLS, read as ACL user alice


@pytest.mark.vllm
def test_a_prompt_served_by_one_instance_is_a_remote_hit_on_another_via_sentinel_with_auth(setup: Setup) -> None:
    share(setup, "sentinel", "sentinel2", setup.urls["sentinel"])
    for name in ("sentinel", "sentinel2"):
        assert PW not in log(setup.servers[name]) and SENTINEL_PW not in log(setup.servers[name])


@pytest.mark.vllm
def test_a_prompt_served_by_one_instance_is_a_remote_hit_on_another_via_lm(setup: Setup) -> None:
    share(setup, "lm1", "lm2", setup.urls["lm"])


def counted(server: OffloadServer, name: str) -> float:
    return sum(prom(server, name).values())


def wait_counted(server: OffloadServer, name: str, above: float) -> None:
    """Until the counter (exported with vLLM's stats, a little after the request) passes `above`."""
    until(lambda: counted(server, name) > above, 60, f"{name} to count the rejected chunk", every=0.2)


def primary_and_standby(s: Setup) -> tuple[Proc, Proc]:
    """The Sentinel set's master and replica now: Sentinel may have failed over already (a master
    that missed its pings under load, or the kill test), so no test assumes the first roles."""
    for p, q in ((s.master, s.replica), (s.replica, s.master)):
        try:
            if s.client(p).info("replication")["role"] == "master":
                return p, q
        except redis.ConnectionError:
            continue
    raise AssertionError(f"no Redis master: {s.roles()}")


def redis_master(s: Setup) -> redis.Redis:
    return s.client(primary_and_standby(s)[0])


@pytest.mark.vllm
def test_a_corrupted_remote_chunk_is_a_counted_miss_and_the_prompt_recomputed(setup: Setup) -> None:
    s = setup
    one, two = s.servers["redis1"], s.servers["redis2"]
    p = prompt(1000)
    want = s.served(one, s.urls["redis"], p, 8)
    r = s.client(s.redis)
    k = PREFIX + s.keys(p)[1] + b":d"
    v = bytearray(r.get(k))
    v[len(v) // 2] ^= 0xFF
    r.set(k, bytes(v))
    bad0, hits0 = counted(two, "kvferry:cache_remote_corrupt_total"), remote_hits(two)
    got = tokens_and_logprobs(completion(two, p, 8))
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3
    wait_counted(two, "kvferry:cache_remote_corrupt_total", bad0)
    assert remote_hits(two) == hits0  # nothing loaded: recomputed
    assert "rejected (a miss, recomputed): checksum mismatch" in log(two)


@pytest.mark.vllm
def test_with_the_cluster_secret_another_prompts_chunk_under_this_key_is_a_counted_miss(setup: Setup) -> None:
    """The store answers prompt q's keys with prompt p's chunks (valid, tagged, same shape): the MAC
    binds the key, so they are refused and q is recomputed; q's own tagged chunks load."""
    s, c = setup, setup.servers["sentinel"]  # cluster secret, no local tier: repeats come from the store
    q, p = prompt(1000), prompt(1000)
    want = s.served(c, s.urls["sentinel"], q, 8)
    hits0 = remote_hits(c)
    assert tokens_and_logprobs(completion(c, q, 8))[0] == want[0]
    assert remote_hits(c) == hits0 + 1  # tagged chunks verify and load
    s.served(c, s.urls["sentinel"], p, 8)
    r = redis_master(s)
    for kq, kp in zip(s.keys(q), s.keys(p), strict=True):
        for part in (b":h", b":d"):
            r.set(PREFIX + kq + part, r.get(PREFIX + kp + part))
    forged0, hits0 = counted(c, "kvferry:cache_remote_forged_total"), remote_hits(c)
    got = tokens_and_logprobs(completion(c, q, 8))
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3
    wait_counted(c, "kvferry:cache_remote_forged_total", forged0)
    assert remote_hits(c) == hits0
    assert "MAC mismatch" in log(c)


@pytest.mark.vllm
def test_killing_the_redis_master_mid_stream_fails_no_request_and_hits_resume(setup: Setup) -> None:
    s, c = setup, setup.servers["sentinel"]  # no local tier: every repeat is a remote hit or computed
    p = prompt(600)
    want = s.served(c, s.urls["sentinel"], p, 4)[0]
    primary, standby = primary_and_standby(s)
    assert s.client(primary).wait(1, 5000) == 1  # replicated before the kill
    hits0 = remote_hits(c)
    for _ in range(2):
        assert tokens_and_logprobs(completion(c, p, 4))[0] == want
    assert remote_hits(c) == hits0 + 2
    primary.kill()
    answered, before = 0, remote_hits(c)

    def hit_after_failover() -> bool:  # a steady stream: every request must succeed, hit or computed
        nonlocal answered
        assert tokens_and_logprobs(completion(c, p, 4))[0] == want
        answered += 1
        promoted = s.client(standby).info("replication")["role"] == "master"
        return promoted and remote_hits(c) > before
    until(hit_after_failover, 90, lambda: f"a remote hit within 90 s of the kill ({answered} requests answered)",
          every=0.2)
    assert answered >= 2  # at least one request ran while the store was gone
    assert "treating it as empty" in log(c)


@pytest.mark.vllm
def test_a_killed_lm_server_is_misses_and_its_restart_brings_hits_back(setup: Setup) -> None:
    s = setup
    one, two, url = s.servers["lm1"], s.servers["lm2"], s.urls["lm"]
    port = s.lm.port
    s.lm.kill()
    for _ in range(2):  # both sides of the store gone: lookups and puts fail, requests do not
        p = prompt(600)
        a = tokens_and_logprobs(completion(one, p, 4))[0]
        assert tokens_and_logprobs(completion(two, p, 4))[0] == a
    assert "treating it as empty" in log(one) and "treating it as empty" in log(two)
    s.lm = start_lm_server(s.lm.log.parent, port)
    s.procs.append(s.lm)
    hits0 = remote_hits(two)

    def hit_again() -> bool:  # each instance retries after its back-off (at most 30 s)
        p = prompt(600)
        a = tokens_and_logprobs(completion(one, p, 4))[0]
        try:
            s.stored(url, p, timeout=5)
        except AssertionError:
            return False  # instance 1 was still backing off: its puts were dropped
        assert tokens_and_logprobs(completion(two, p, 4))[0] == a
        return remote_hits(two) != hits0
    until(hit_again, 90, "a remote hit within 90 s of the restart", every=0)
