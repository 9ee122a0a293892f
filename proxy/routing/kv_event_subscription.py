"""One vLLM instance's KV cache events (its `--kv-events-config` ZMQ publisher), applied to that
instance's PrefixIndex.

vLLM publishes (topic, 8-byte big-endian seq, msgpack EventBatch) on a PUB socket and answers a
start seq on its ROUTER replay socket with the batches it still holds, then an end marker
(seq -1). These types are vLLM's wire format (vllm/distributed/kv_events.py), not kvferry's, so
they live here and not in common/wire/messages.py; every frame is size-checked and decoded into
bounded types, and a bad one is counted and skipped.

The replay socket doubles as a heartbeat: every probe asks for the last seq seen. A live
publisher answers (with that batch); a restarted one (its seq began again) answers with another
batch or none, and the index is cleared; one that does not answer at all goes stale, and the
instance is routed by load only until it answers again.

With a cluster secret, a ``tcp://`` endpoint is kvferry's relay of vLLM's events
(common/kv_events_relay.py): the proxy speaks CurveZMQ to it, as to every other kvferry port, and
a publisher without the secret is never heard. An ``ipc://`` endpoint (vLLM's own publisher on
this machine, as ``kvferry up`` runs it) is plain: the file's permissions guard it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Annotated

import msgspec
import xxhash
import zmq
import zmq.asyncio

from kvferry.common import zsock
from kvferry.common.errors import BadDataError
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.proxy.routing.prefix_index import GPU, PrefixIndex

logger = get_logger(__name__)

MAX_FRAME_BYTES = 16 << 20
MAX_EVENTS = 100_000
MAX_TOKENS = 1 << 20
MAX_REPLAY_FRAMES = 20_000  # frames one replay answer may carry before the proxy gives up on it
END_SEQ = -1
RECENT = 256  # batches remembered (by digest) to tell a repeat from a restarted publisher

Hash = Annotated[bytes, msgspec.Meta(max_length=64)] | int
Hashes = Annotated[list[Hash], msgspec.Meta(max_length=MAX_EVENTS)]
Medium = Annotated[str, msgspec.Meta(max_length=32)]
# One block's extra keys, untagged as vLLM publishes them: a LoRA name or cache_salt (str), an
# (mm identifier, offset) pair, a prompt-embeds digest (bytes). Kept raw (one msgpack type may not
# be str or bytes in one union) and read by extra_keys_of: only whether each is a str matters.
BlockExtraKeys = Annotated[list[msgspec.Raw], msgspec.Meta(max_length=1024)]
MAX_SALT_CHARS = 1 << 16


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: Hashes
    parent_block_hash: Hash | None
    token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_TOKENS)]
    block_size: Annotated[int, msgspec.Meta(gt=0, le=1 << 16)]
    medium: Medium | None = None
    lora_name: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    extra_keys: Annotated[list[BlockExtraKeys | None], msgspec.Meta(max_length=MAX_EVENTS)] | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: Hashes
    medium: Medium | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: Annotated[list[BlockStored | BlockRemoved | AllBlocksCleared], msgspec.Meta(max_length=MAX_EVENTS)]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)
_str = msgspec.msgpack.Decoder(Annotated[str, msgspec.Meta(max_length=MAX_SALT_CHARS)])


def extra_keys_of(raw: list[BlockExtraKeys | None] | None) -> list[list[object] | None] | None:
    """Each block's extra keys with the strings decoded; any other key stays its raw bytes (the
    index reads it as an input it cannot predict)."""
    if raw is None:
        return None
    out: list[list[object] | None] = []
    for block in raw:
        if block is None:
            out.append(None)
            continue
        keys: list[object] = []
        for k in block:
            try:
                keys.append(_str.decode(k))
            except msgspec.MsgspecError:
                keys.append(bytes(k))
        out.append(keys)
    return out


class BadFrame(BadDataError, ValueError):
    """A frame that is not one of vLLM's event messages."""


def parse(frames: list[bytes]) -> tuple[int, bytes]:
    """(seq, payload) of a published or replayed frame (topic, seq, payload)."""
    if len(frames) != 3 or len(frames[1]) != 8 or len(frames[2]) > MAX_FRAME_BYTES:
        raise BadFrame(f"expected topic, 8-byte seq, payload <= {MAX_FRAME_BYTES} bytes; got {len(frames)} frames")
    return int.from_bytes(frames[1], "big", signed=True), frames[2]


class KVEventSubscription:
    """Subscribes to one instance's events and keeps its index; `fresh` says whether to trust it."""

    def __init__(self, name: str, endpoint: str, replay_endpoint: str | None, index: PrefixIndex,
                 stale_after: float, counter=None, trust: zsock.Trust = zsock.PLAIN) -> None:
        self.name, self.endpoint, self.replay_endpoint = name, endpoint, replay_endpoint
        self.trust = trust
        self.index, self.stale_after = index, stale_after
        # (result, n): kvferry_proxy_kv_events_total
        self.count = counter if counter is not None else (lambda result, n=1: None)
        self.last_seq: int | None = None
        self._recent: OrderedDict[int, bytes] = OrderedDict()  # seq -> payload digest, the last RECENT batches
        self.last_heard: float | None = None  # monotonic time of the last frame or replay answer
        self._was_fresh = True
        self._bad = RateLimitedLog(logger, 60.0)
        self._ctx = zmq.asyncio.Context()
        self.closed = False

    @property
    def fresh(self) -> bool:
        return self.last_heard is not None and time.monotonic() - self.last_heard < self.stale_after

    def describe(self) -> dict:
        age = None if self.last_heard is None else round(time.monotonic() - self.last_heard, 1)
        return {"endpoint": self.endpoint, "fresh": self.fresh, "last_heard_s_ago": age, "last_seq": self.last_seq,
                "blocks": len(self.index)}

    def check_fresh(self) -> bool:
        """`fresh`, with one warning when it changes."""
        fresh = self.fresh
        if fresh != self._was_fresh:
            self._was_fresh = fresh
            if fresh:
                logger.warning("KV events of %s (%s) are back: routing it by its cache again", self.name, self.endpoint)
            else:
                hint = ""
                if self.last_heard is None and self.trust.secret is not None and self.endpoint.startswith("tcp://"):
                    hint = (" (never heard: with a cluster secret a tcp:// endpoint must be kvferry's relay, "
                            "kv_events_relay_port, not vLLM's own publisher; docs/deploy.md \"Network\")")
                logger.warning("KV events of %s (%s) stopped (nothing for %gs): routing it by load only%s",
                               self.name, self.endpoint, self.stale_after, hint)
        return fresh

    def apply(self, seq: int, payload: bytes) -> None:
        """One batch, in order: a seq seen before is skipped (the live stream repeating a replay),
        a seq that went back to something new means the publisher restarted."""
        digest = xxhash.xxh3_64_digest(payload)
        if self.last_seq is not None and seq <= self.last_seq:
            if self._recent.get(seq) == digest:
                self.last_heard = time.monotonic()
                return
            self._recent.clear()
            logger.warning("KV events of %s restarted (seq %d after %d): its prefix index starts over",
                           self.name, seq, self.last_seq)
            self.index.clear()
            self.count("reset")
        try:
            batch = _decoder.decode(payload)
        except (msgspec.MsgspecError, RecursionError) as e:  # RecursionError: nesting in a raw extra key
            self.count("bad")
            self._bad.warning("bad KV event batch from %s (%s): %s", self.name, self.endpoint, e)
            batch = None
        self.last_seq = seq
        self._recent[seq] = digest
        if len(self._recent) > RECENT:
            self._recent.popitem(last=False)
        self.last_heard = time.monotonic()
        if batch is None:
            return
        for ev in batch.events:
            try:
                if isinstance(ev, BlockStored):
                    self.index.stored(ev.parent_block_hash, ev.block_hashes, ev.token_ids, ev.block_size, ev.medium,
                                      ev.lora_name, extra_keys_of(ev.extra_keys))
                elif isinstance(ev, BlockRemoved):
                    self.index.removed(ev.block_hashes, ev.medium)
                else:
                    self.index.clear(GPU)  # vLLM's prefix cache reset: kvferry's tiers keep theirs
                self.count("applied")
            except ValueError as e:
                self.count("bad")
                self._bad.warning("bad KV event from %s (%s): %s", self.name, self.endpoint, e)

    async def run(self, probe_interval: float) -> None:
        """Read the stream until cancelled or closed; probe (and fill gaps from) the replay socket."""
        try:
            await self._run(probe_interval)
        except (zmq.ZMQError, asyncio.CancelledError):
            # Closed (its instance was removed): destroying the context fails or cancels the
            # socket's pending wait, and the loop ends quietly instead of being restarted.
            if not self.closed:
                raise

    async def _run(self, probe_interval: float) -> None:
        sub = self._socket(zmq.SUB, self.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        try:
            await self.replay(0)  # what it published before the proxy started
            next_probe = time.monotonic() + probe_interval
            while True:
                wait = max(0.0, next_probe - time.monotonic())
                if await sub.poll(int(wait * 1000) + 1):
                    try:
                        seq, payload = parse(await sub.recv_multipart())
                    except BadFrame as e:
                        self.count("bad")
                        self._bad.warning("bad KV event frame from %s (%s): %s", self.name, self.endpoint, e)
                        continue
                    if self.last_seq is not None and seq > self.last_seq + 1:
                        self.count("gap")
                        await self.replay(self.last_seq + 1, until=seq)
                    self.apply(seq, payload)
                if time.monotonic() >= next_probe:
                    await self.probe()
                    self.check_fresh()
                    next_probe = time.monotonic() + probe_interval
        finally:
            sub.close(linger=0)

    async def probe(self) -> None:
        """Ask for the last seq seen: the answer proves the publisher alive and unchanged."""
        if self.replay_endpoint is None:
            return
        got = await self._request(self.last_seq if self.last_seq is not None else 0)
        if got is None:
            return
        if self.last_seq is not None and (not got or got[0][0] != self.last_seq
                                          or xxhash.xxh3_64_digest(got[0][1]) != self._recent.get(self.last_seq)):
            logger.warning("KV events of %s: the publisher no longer holds seq %d (restarted): its prefix index "
                           "starts over", self.name, self.last_seq)
            self.index.clear()
            self.count("reset")
            self.last_seq = None
            self._recent.clear()
        for seq, payload in got:
            if self.last_seq is None or seq > self.last_seq:
                self.apply(seq, payload)

    async def replay(self, start: int, until: int | None = None) -> None:
        """Batches from `start` (before `until`); a gap the publisher can no longer fill clears the index."""
        if self.replay_endpoint is None:
            if until is not None:
                self.index.clear()  # missed events and no way to get them: trust nothing it said
                self.count("reset")
            return
        got = await self._request(start)
        if got is None:
            return
        if until is not None and (not got or got[0][0] > start):
            self.index.clear()
            self.count("reset")
        for seq, payload in got:
            if until is not None and seq >= until:
                break
            if self.last_seq is None or seq > self.last_seq:
                self.apply(seq, payload)
                self.count("replayed")

    async def _request(self, start: int, timeout: float = 2.0) -> list[tuple[int, bytes]] | None:
        """The replay socket's answer to `start`, or None when it did not answer in time."""
        assert self.replay_endpoint is not None
        sock = self._socket(zmq.DEALER, self.replay_endpoint)
        sock.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + timeout
        try:
            await sock.send_multipart([b"", max(0, start).to_bytes(8, "big")])
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(int(left * 1000) + 1):
                    return None
                frames = await sock.recv_multipart()
                try:
                    seq, payload = parse(frames[1:])
                except BadFrame as e:
                    self.count("bad")
                    self._bad.warning("bad KV replay frame from %s: %s", self.name, e)
                    return None
                if seq == END_SEQ:
                    self.last_heard = time.monotonic()
                    return out
                out.append((seq, payload))
                if len(out) > MAX_REPLAY_FRAMES:
                    return None
        finally:
            sock.close(linger=0)

    def _socket(self, kind: int, endpoint: str) -> zmq.asyncio.Socket:
        """A socket toward `endpoint`: with the cluster secret (CurveZMQ client) for tcp://, plain for
        ipc://."""
        trust = self.trust if endpoint.startswith("tcp://") else zsock.PLAIN
        return zsock.socket(self._ctx, kind, trust, server=False, max_bytes=MAX_FRAME_BYTES + 1024)

    def close(self) -> None:
        self.closed = True
        self._ctx.destroy(linger=0)

