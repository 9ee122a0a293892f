"""The prefill leg: the prompt on a prefiller, its KV sent to the chosen decoder under a fresh
transfer id; retried once on another prefiller when it fails before anything reached the client,
and, when no prefiller can take it, left to the decoder (NoPrefiller: it serves the request whole)."""

from __future__ import annotations

import asyncio
import os
import time

from kvferry.common.errors import UnavailableError
from kvferry.common.log import get_logger
from kvferry.common.reasons import CLIENT_LEFT
from kvferry.common.wire.transfer_params import ParamsError, prefill_answer
from kvferry.proxy.flows.context import Context
from kvferry.proxy.flows.upstream import Upstream
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.openai.legs import prefill_leg
from kvferry.proxy.routing.cache import Route
from kvferry.proxy.routing.instances import Instance

logger = get_logger(__name__)

# Failures of the prefill leg after which its decoder can serve the request whole: the prefiller
# is gone or broken. Not a refusal to send the KV (kv_refused: the error names the fix), a 4xx
# (the decoder would refuse the same body), or a timeout (the decoder would take as long).
DECODER_CAN_SERVE = frozenset({"unreachable", "upstream_5xx", "stream_broken"})


class NoPrefiller(UnavailableError):
    """The prefill leg failed and no other prefiller could take it: the decoder serves the
    request alone (degraded) rather than the client getting an error."""


async def prefill(ctx: Context, path: str, body: dict, route: Route,
                  prompt_tokens: int, kind: str) -> tuple[dict, str, Instance]:
    """(the prefiller's answer, the transfer id, the prefiller). A transfer that will not be read
    (the leg failed, the client left) is aborted on the decoder at once."""
    decoder, p = route.decoder, route.prefiller
    assert p is not None, "a local route has no prefill leg"
    with decoder.claimed():  # the decoder counts this request from now: see Instance.claimed
        for attempt in (0, 1):
            tid = "kvf-" + os.urandom(16).hex()  # as random as uuid4().hex, and cheaper
            leg = prefill_leg(body, tid, decoder.disagg_spec)
            t0 = time.perf_counter()
            ctx.transfers.started(tid, decoder)  # its arrival notice may beat the prefiller's answer
            try:
                with Upstream(ctx.router, p, prompt_tokens, "prefill") as up:
                    out = await up.json(path, leg, kind, raw_ids=True)
                    _check_answer(up, out)
                p.served_one()
                ctx.router.observed(p, route, out)
                ctx.metrics.prefill.observe(time.perf_counter() - t0)
                ctx.transfers.prefilled(tid)
                return out, tid, p
            except asyncio.CancelledError:  # the client left: nobody will read this transfer
                ctx.transfers.abort(decoder, tid, CLIENT_LEFT)
                raise
            except ProxyError as e:
                ctx.transfers.abort(decoder, tid, f"prefill failed: {e.message}"[:200])
                if e.status < 500:
                    raise
                alone = e.kind in DECODER_CAN_SERVE
                if attempt:
                    if alone:
                        raise NoPrefiller(e.message) from e
                    raise
                t_retry = time.time_ns()
                failed = p
                try:
                    p = ctx.router.elsewhere("prefiller", [failed], "retry the prefill leg on")
                except ProxyError:
                    if alone:  # nobody to retry on: the decoder computes the prompt itself
                        raise NoPrefiller(e.message) from e
                    raise e from None  # the client hears what went wrong
                logger.info("retrying the prefill leg on %s %s", p.id, p.url)
                if ctx.router.client.tracer is not None:
                    ctx.router.client.tracer.record("retry", t_retry, {
                        "kvferry.retry.from": failed.id, "kvferry.retry.to": p.id, "error.type": e.kind})
    raise AssertionError("unreachable")


def _check_answer(up: Upstream, out: dict) -> None:
    """The prefiller's connector answers what it did with the transfer (none: an engine without
    kvferry's connector, whose decoder then computes the prompt): a refusal or another kvferry
    version fails the leg with its reason, rather than leave the decoder waiting for KV."""
    try:
        a = prefill_answer(out.get("kv_transfer_params") if isinstance(out, dict) else None)
    except ParamsError as e:
        raise up.fail("kv_refused", 502, f"{up.inst.role} {up.inst.url} answered {e}") from None
    if a is not None and a.error:
        raise up.fail("kv_refused", 502, f"{up.inst.role} {up.inst.url} did not send the KV: {a.error}")
