"""Tiers the planner asks rather than indexes: they are shared with other instances, so only they
know what they hold. A peer is found through the controller, the remote store answers itself;
both are asked (bounded) after the local tiers miss, and at most once per request and position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvferry.common.counters import Counters
from kvferry.common.wire import messages as m
from kvferry.engine.offload.ops import PLAIN, CacheLoad, PromptIdentity
from kvferry.engine.p2p.lookup import ControllerLookup
from kvferry.engine.tiers.remote import RemoteTier


@dataclass
class Lookup:
    """One request's chunk keys and what the tiers said about them."""

    keys: list[bytes]
    identity: PromptIdentity = PLAIN  # what the keys cover besides the tokens
    where: list[str] = field(default_factory=list)  # tier of each chunk of the cached prefix
    local: int = 0  # tokens vLLM's own prefix cache had at the last match
    asked: dict[str, Any] = field(default_factory=dict)  # a shared tier's answers, by its name
    sources: dict[str, int] = field(default_factory=dict)  # tokens of the planned load, by tier


@dataclass
class HitCounters(Counters):
    """Exported as ``hit_chunks|<tier>`` and ``hit_tokens|<tier>`` (kvferry:cache_hit_*{tier})."""

    hit_chunks: int = 0
    hit_tokens: int = 0


class SharedTier(Protocol):
    name: str
    counters: HitCounters

    def extend(self, look: Lookup) -> None:
        """Append this tier's name to `look.where` for each chunk it holds after the known prefix."""

    def plan_load(self, op: CacheLoad, look: Lookup) -> None:
        """Add what the worker needs to reach this tier's chunks of `op`."""

    def wants(self, look: Lookup | None, i: int, indexed: bool) -> bool:
        """Whether chunk `i` of a prompt being stored goes to this tier (`indexed`: a local tier has it)."""

    def forget(self, look: Lookup, keys: set[bytes]) -> None:
        """The worker found `keys` missing here: later matches of `look` miss them."""

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class PeerLookup:
    """The P2P tier seen from the scheduler: the controller names the instance holding a prefix."""

    name = "p2p"

    def __init__(self, controller: ControllerLookup, instance_id: str) -> None:
        self.controller, self.instance_id = controller, instance_id
        self.counters = HitCounters()

    def extend(self, look: Lookup) -> None:
        start = len(look.where)
        got: tuple[int, m.LookupResponse] | None = look.asked.get(self.name)  # (first chunk asked, answer)
        if got is None or got[0] != start:
            ans = self.controller.lookup(look.keys[start:])
            got = look.asked[self.name] = (start, ans if ans is not None else m.LookupResponse())
        ans = got[1]
        if ans.instance_id is not None and ans.instance_id != self.instance_id:
            look.where += [self.name] * min(ans.num_chunks, len(look.keys) - start)

    def plan_load(self, op: CacheLoad, look: Lookup) -> None:
        got = look.asked.get(self.name)
        if self.name in op.tiers and got is not None:
            op.peer_id, op.peers = got[1].instance_id, list(got[1].peers)

    def wants(self, look: Lookup | None, i: int, indexed: bool) -> bool:
        return False  # peers keep what they computed themselves

    def forget(self, look: Lookup, keys: set[bytes]) -> None:
        if any(k in keys for k in look.keys):  # the peer failed: ask the controller again next time
            look.asked.pop(self.name, None)

    def stats(self) -> dict[str, float]:
        return {**{f"{k}|p2p": v for k, v in self.counters.as_dict().items()},
                "p2p_lookup_errors": self.controller.errors}

    def close(self) -> None:
        self.controller.close()


class RemoteLookup:
    """The remote store seen from the scheduler: asked which chunks it holds, once per chunk."""

    name = "remote"

    def __init__(self, store: RemoteTier) -> None:
        self.store = store
        self.counters = HitCounters()

    def _known(self, look: Lookup) -> dict[int, bool]:
        return look.asked.setdefault(self.name, {})  # chunk -> the store has it (asked once)

    def extend(self, look: Lookup) -> None:
        known = self._known(look)
        ask = [i for i in range(len(look.where), len(look.keys)) if i not in known]
        known.update(zip(ask, self.store.exists([look.keys[i] for i in ask]), strict=True))
        for i in range(len(look.where), len(look.keys)):
            if not known[i]:
                break
            look.where.append(self.name)

    def plan_load(self, op: CacheLoad, look: Lookup) -> None:
        pass

    def wants(self, look: Lookup | None, i: int, indexed: bool) -> bool:
        # Chunks a local tier already had were sent to the remote store when first stored.
        return not indexed and not (look is not None and self._known(look).get(i))

    def forget(self, look: Lookup, keys: set[bytes]) -> None:
        # The store dropped them since it was asked: later matches miss.
        self._known(look).update((i, False) for i, k in enumerate(look.keys) if k in keys)

    def stats(self) -> dict[str, float]:
        return {**{f"{k}|remote": v for k, v in self.counters.as_dict().items()},
                "remote_errors": self.store.stats()["remote_errors"]}

    def close(self) -> None:
        self.store.close()
