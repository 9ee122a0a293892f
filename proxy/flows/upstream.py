"""`Upstream`: one leg to one instance (on proxy/upstream_client.py's connections), which maps
every failure to a client error and reports it to the router."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from kvferry.common.http.client import Broken, ClientResponse, Timeout, Unreachable
from kvferry.common.log import REQUEST_ID, RateLimitedLog, get_logger
from kvferry.proxy.http import json_codec
from kvferry.proxy.http.sse import events as sse_events
from kvferry.proxy.metrics import Value
from kvferry.proxy.openai import answers
from kvferry.proxy.openai.answers import BadAnswer
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.routing.instances import Instance
from kvferry.proxy.upstream_client import LegTracer, UpstreamClient

logger = get_logger(__name__)
_decode_refusals = RateLimitedLog(logger, 10.0)
_TIMEOUT_FLAGS = {"connect": "--connect-timeout", "wait": "--upstream-connections, waited up to --read-timeout",
                  "read": "--read-timeout"}  # "stall": Upstream._stalled names its flag


class LegWatcher(Protocol):
    """What a leg reports to (the router): its in-flight gauge, and each failure; and the
    connections it is sent on."""

    client: UpstreamClient

    def in_flight(self, inst: Instance) -> Value: ...

    def upstream_failed(self, inst: Instance, leg: str, kind: str, cause: str) -> None: ...


class Upstream:
    """One leg to one instance: counts its load, maps failures to client errors; every failure
    is logged, counted and makes the router probe the instance (`LegWatcher.upstream_failed`)."""

    def __init__(self, router: LegWatcher, inst: Instance, prompt_tokens: int = 0, leg: str = "decode") -> None:
        self.router, self.client, self.inst, self.tokens, self.leg = router, router.client, inst, prompt_tokens, leg
        self.done = False  # events(): the stream's [DONE] came (the batch just yielded is its last)
        self._stream: ClientResponse | None = None  # events()'s answer: released at the latest on __exit__
        self.traced: tuple[LegTracer, Any] | None = None  # with tracing on: the tracer and the leg's span

    def __enter__(self) -> Upstream:
        i = self.inst
        i.counted(i.active + 1, i.queued_tokens + self.tokens)
        self.router.in_flight(i).inc()
        tracer = self.client.tracer
        if tracer is not None:
            self.traced = (tracer, tracer.leg(i, self.leg))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.traced is not None:
            self.traced[1].end()
        if self._stream is not None:  # a stream left part way (its generator is closed later, by
            self._stream.release()   # the loop): its connection is closed now, the engine sees it
            self._stream = None
        i = self.inst
        i.counted(i.active - 1, i.queued_tokens - self.tokens)
        self.router.in_flight(i).dec()

    def fail(self, kind: str, status: int, message: str) -> ProxyError:
        self.router.upstream_failed(self.inst, self.leg, kind, message)
        if self.traced is not None:
            self.traced[0].failed(self.traced[1], kind, message)
        return ProxyError(status, message, kind)

    def _headers(self) -> bytes:
        """This leg's own headers: the request's X-Request-Id (checked by the guard) and, traced,
        the leg's trace context."""
        rid = REQUEST_ID.get()
        out = b"X-Request-Id: %s\r\n" % rid.encode() if rid else b""
        if self.traced is not None:
            out += self.traced[0].headers(self.traced[1])
        return out

    async def open(self, path: str, body: dict, stream: bool = False) -> ClientResponse:
        """POST and return the response once its status is 2xx; errors become ProxyError. `stream`:
        a decode stream, whose every wait --stall-timeout bounds (its failure: kind "stall")."""
        c = self.client
        if self.traced is not None:
            body = self.traced[0].into_params(self.traced[1], body)
        try:
            resp = await c.pool.request("POST", self.inst.url, path, json_codec.dumps(body), stream, self._headers())
        except (Unreachable, Broken) as e:
            raise self.fail("unreachable", 503, f"{self.inst.role} {self.inst.url} unreachable: {e}") from None
        except Timeout as e:
            if e.what == "stall":
                raise self._stalled() from None
            flag = _TIMEOUT_FLAGS[e.what]
            raise self.fail("timeout", 504, f"{self.inst.role} {self.inst.url}: {e} ({flag})") from None
        if resp.status >= 400:
            try:
                raw = await resp.read()
            except (Broken, TimeoutError) as e:
                raise self.fail("upstream_5xx" if resp.status >= 500 else "bad_upstream", 502,
                                f"{self.inst.role} {self.inst.url} answered {resp.status}, then: {e}") from None
            finally:
                resp.release()
            if resp.status < 500:
                self._refused(resp.status, raw.decode(errors="replace"))
                if self.traced is not None:  # a CLIENT span's 4xx is an error (OpenTelemetry's HTTP conventions)
                    self.traced[0].failed(self.traced[1], "upstream_4xx", raw.decode(errors="replace"))
                raise ProxyError(resp.status, raw.decode(errors="replace")[:500], "upstream_4xx", body=raw)
            raise self.fail("upstream_5xx", 502, f"{self.inst.role} {self.inst.url} answered {resp.status}: "
                                                 f"{raw.decode(errors='replace')[:300]}")
        self.inst.ok()
        return resp

    async def get(self, path: str) -> tuple[int, bytes]:
        """A GET relayed as it is (status and body); only a failure to get an answer is an error."""
        try:
            resp = await self.client.pool.request("GET", self.inst.url, path, headers=self._headers())
            try:
                body = await resp.read()
            finally:
                resp.release()
        except (Unreachable, Broken, TimeoutError) as e:
            raise self.fail("unreachable", 503, f"{self.inst.url}: {e}") from None
        return resp.status, body

    async def json(self, path: str, body: dict, kind: str | None = None, raw_ids: bool = False) -> dict:
        """A non-streamed answer; with `kind` ("completion" or "chat") its choices[0] is checked.
        `raw_ids`: a long prompt's token ids are kept as the engine wrote them (answers.loads_answer)."""
        resp = await self.open(path, body)
        try:
            raw = await resp.read()
            out = answers.loads_answer(raw) if raw_ids else json_codec.loads(raw)
            if kind is not None:
                answers.choice0(out, kind)
            return out
        except BadAnswer as e:
            raise self.bad(str(e)) from None
        except TimeoutError:
            raise self.fail("timeout", 504, f"{self.inst.role} {self.inst.url} did not answer within "
                                            f"{self.client.opts.read_timeout:.0f}s (--read-timeout)") from None
        except (Broken, ValueError) as e:
            raise self.fail("bad_upstream", 502, f"{self.inst.role} {self.inst.url}: unreadable answer ({e})") from None
        finally:
            resp.release()

    async def events(self, path: str, body: dict, direct: Callable[[bytes], bool] | None = None
                     ) -> AsyncGenerator[list[bytes], None]:
        """The `data:` payloads of an SSE stream (without `data: `), [DONE] excluded, in batches:
        whatever arrived in one read, so the proxy writes once per read, not once per event. A
        stream that sends nothing for --stall-timeout fails as a "stall" (the connection is then
        closed: a frozen engine cannot hold the client longer); only the waits for the engine
        count, not the time the caller spends writing to its client.

        `direct(sse)`: offered each read that comes while the caller waits for the next batch and
        no part of an earlier event is pending, as the engine wrote it, in the connection's
        callback; True: it relayed the read itself and it is not yielded. It must refuse (False)
        what is not whole events it knows (a cut event, [DONE], an error event), and must not
        raise nor change anything before returning True."""
        resp = self._stream = await self.open(path, body, stream=True)
        buf = b""
        if direct is not None:
            relay = direct
            resp.sink = lambda blob: not buf and relay(blob)

        try:
            async for blob in resp.pieces():
                buf += blob
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    continue
                whole, buf = buf[:cut], buf[cut + 2:]
                batch = sse_events(whole, self._stream_error)
                if b"[DONE]" in batch:
                    # Read to the end of the body: a released, fully read response keeps its
                    # connection for the next request.
                    batch = batch[:batch.index(b"[DONE]")]
                    resp.sink = None
                    await resp.read()
                    self.done = True
                    if batch:
                        yield batch
                    return
                if batch:
                    yield batch
        except Broken as e:
            raise self.fail("stream_broken", 502, f"{self.inst.role} {self.inst.url} broke its stream: {e}") from None
        except TimeoutError as e:
            if isinstance(e, Timeout) and e.what == "stall":
                raise self._stalled() from None
            raise self.fail("timeout", 504, f"{self.inst.role} {self.inst.url} stalled for "
                                            f"{self.client.opts.read_timeout:.0f}s (--read-timeout)") from None
        finally:
            resp.sink = None
            resp.release()
            self._stream = None

    def _stalled(self) -> ProxyError:
        return self.fail("stall", 504, f"{self.inst.role} {self.inst.url} sent nothing for "
                                       f"{self.client.opts.stall_timeout:g}s (--stall-timeout)")

    def bad(self, why: str) -> ProxyError:
        """An answer the proxy cannot use (openai/answers.py): a 502 naming the field, never a guess."""
        return self.fail("bad_answer", 502, f"{self.inst.role} {self.inst.url} answered {why}")

    def chunk(self, data: bytes) -> dict:
        """One streamed chunk, parsed and checked."""
        try:
            return answers.chunk(json_codec.loads(data))
        except (ValueError, BadAnswer) as e:
            raise self.bad(f"a bad stream chunk ({e})") from None

    def _refused(self, status: int, message: str) -> None:
        """A 4xx is the request's, not the instance's; but one on a decode leg (the prefiller took
        the same request) or after the stream began says something the client cannot see: logged."""
        if self.leg == "decode":  # rate-limited: a client can make the decoder refuse on purpose
            _decode_refusals.warning("%s %s refused a decode leg with %d: %s", self.inst.role, self.inst.url, status,
                                     " ".join(message.split())[:300])

    def _stream_error(self, data: bytes) -> None:
        """vLLM reports a failure after its 200 as an error event (then [DONE]); an EngineCore
        that died mid-stream says so this way. 5xx: the instance's failure; else the request's."""
        try:
            err = json_codec.loads(data).get("error") or {}
        except (ValueError, AttributeError):
            err = {}
        if not isinstance(err, dict):
            err = {"message": str(err)}
        code = err.get("code")
        message = str(err.get("message") or "error")[:300]
        if isinstance(code, int) and 400 <= code < 500:
            self._refused(code, message)
            raise ProxyError(code, message, "upstream_4xx")
        raise self.fail("stream_error", 502, f"{self.inst.role} {self.inst.url} failed mid-stream: {message}")
