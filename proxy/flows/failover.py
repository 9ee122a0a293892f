"""The one failover every flow uses: a decode leg on one decoder after another (`DecodeLeg`), and
a request one instance serves whole (`serve_whole`: a one-token answer's prefiller, then its
decoder). The next instance is always the router's `elsewhere` (the prefill retry uses it too).

A leg that fails for the instance's reason (unreachable, a 5xx, a stall or timeout, a broken
stream: `migrate.MIGRATE_KINDS`) goes on another usable decoder, fewest active sequences first,
at most --max-migrations times; a failure that is the request's (a 4xx, a bad answer) is
answered as it is. What the next decoder is sent is the caller's to say (`next_leg`): the whole
request again while nothing reached the client, or a continuation after the tokens it got
(flows/migrate.py). The transfer the first decoder was sent is aborted exactly once: when the
leg moves or fails (its pages come back at once), or, when the client left, with CLIENT_LEFT so
that decoder drops the request rather than recompute it for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvferry.proxy.flows.context import Context
from kvferry.proxy.flows.migrate import Migration, client_left
from kvferry.proxy.flows.prefill import DECODER_CAN_SERVE
from kvferry.proxy.flows.upstream import Upstream
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.routing.instances import Instance
from kvferry.proxy.routing.router import Route

T = TypeVar("T")
NextLeg = Callable[[ProxyError], "dict | None"]


class DecodeLeg:
    """One request's decode leg: the decoder it is on, the body it sends there, the transfer it
    holds (`tid`, "" for none), and its moves (`mig`)."""

    __slots__ = ("ctx", "decoder", "leg", "tid", "mig", "holds")

    def __init__(self, ctx: Context, decoder: Instance, leg: dict, tid: str = "", mig: Migration | None = None
                 ) -> None:
        self.ctx, self.decoder, self.leg, self.tid = ctx, decoder, leg, tid
        self.mig = mig if mig is not None else Migration(ctx, ctx.opts.max_migrations)
        self.holds = bool(tid)  # the decoder holds pages for this request's transfer

    def drop_transfer(self, why: str) -> None:
        """Abort the transfer the first decoder holds (once)."""
        if self.holds:
            self.holds = False
            self.ctx.transfers.abort(self.decoder, self.tid, why)

    def client_left(self) -> None:
        """The client left while the leg was open: the decoder drops the request (CLIENT_LEFT)."""
        if self.holds:
            self.holds = False
            client_left(self.ctx, self.decoder, self.tid)

    def move(self, e: ProxyError, leg: dict | None) -> bool:
        """After the instance failure `e`, on to another decoder with `leg` (the transfer dropped);
        False, nothing changed, when `leg` is None, `e` is the request's or no decoder is left."""
        if leg is None or not self.mig.can_move(e):
            return False
        nd = self.mig.next_decoder(self.decoder, e)
        if nd is None:
            return False
        self.drop_transfer(f"decode leg failed: {e.kind}")
        self.decoder, self.leg = nd, leg
        return True

    async def run(self, call: Callable[[Upstream, dict], Awaitable[T]], next_leg: NextLeg,
                  prompt_tokens: int = 0, kind: str = "decode") -> T:
        """`call(upstream, leg)` on this decoder, then on the next one after each failure it may
        move on (`next_leg(e)`: the body for the next decoder, None where the request cannot
        move); the decoder that answers counts it served."""
        try:
            while True:
                try:
                    with Upstream(self.ctx.router, self.decoder, prompt_tokens, kind) as up:
                        out = await call(up, self.leg)
                    self.holds = False  # the decoder loaded the KV and answered: nothing to abort
                    self.decoder.served_one()
                    return out
                except ProxyError as e:
                    if not self.move(e, next_leg(e)):
                        self.drop_transfer(f"decode leg failed: {e.kind}")
                        raise
        except (asyncio.CancelledError, ConnectionResetError):
            self.client_left()
            raise
        except BaseException:
            self.drop_transfer("decode leg failed")
            raise


def whole_again(leg: dict) -> NextLeg:
    """next_leg for a leg nothing of which reached the client: the same body, without the
    transfer (the next decoder computes the prompt's KV itself)."""
    again = {k: v for k, v in leg.items() if k != "kv_transfer_params"}
    return lambda e: again


async def serve_whole(ctx: Context, route: Route, p: Instance, prompt_tokens: int,
                      call: Callable[[Upstream], Awaitable[T]], mig: Migration | None = None) -> T:
    """`call` on the one instance `p` that serves the request whole (a one-token answer's
    prefiller, or the route's decoder). A prefiller that fails it for a reason its decoder can
    serve (DECODER_CAN_SERVE) is replaced by that decoder; a decoder that fails it before its first
    chunk (nothing reached the client) is replaced by another when the route is local."""
    if p is not route.decoder:
        try:
            with Upstream(ctx.router, p, prompt_tokens, "single") as up:
                out = await call(up)
            p.served_one()
            return out
        except ProxyError as e:
            if e.kind not in DECODER_CAN_SERVE:
                raise
    dl = DecodeLeg(ctx, route.decoder, {}, "", mig)
    movable = route.local
    return await dl.run(lambda up, leg: call(up), lambda e: {} if movable else None, prompt_tokens, "single")
