"""`genpipe serve`: an OpenAI-compatible HTTP front over the topics (docs/design.md §9).

Every HTTP request becomes a `GenerateRequest` on `<prefix>.requests`; every answer is
a result the derender workers published to this gateway's own reply topic
(`<prefix>.reply.<gateway-id>`), read by one consumer (the client library's
`GenpipeClient`) and handed to the waiting HTTP request. The topics stay the source of
truth: nothing here holds state a restart would lose but the open connections.

Starlette on uvicorn: a small ASGI toolkit with streaming responses and disconnect
handling, no second validation layer (the body is checked by `params.py`, the records by
`schemas/`); FastAPI would add pydantic models that repeat the schemas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from schemas.codec import encode
from schemas.openai import ErrorResponse
from workers.client import (AnswerBudget, GenpipeClient, GenpipeError, GenpipeOverflow, GenpipeTimeout, make_request,
                            render_chat, render_prompt)
from workers.gateway.api_keys import RequireApiKey
from workers.gateway.event_stream import EventStream, StallWatch
from workers.gateway.fanout import choice_records, merge_final, reindex, total_usage
from workers.gateway import tokenizing
from workers.gateway.params import BadParameter, check_context, nth_seed, parse, request_timeout
from workers.kafka.settings import MAX_RECORD_BYTES, KafkaSettings
from workers.log_digest import LogDigest
from workers.mailbox import KEEPALIVE
from workers.metrics import GATEWAY_RELAY, GATEWAY_REQUESTS, series, watch_gc_pauses
from workers.requests import TemplateError

log = logging.getLogger(__name__)
HEALTH_REUSE_S = 2.0  # a look at the worker groups answers /health this long
ROUTES = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}  # (the requests counter's label)
GENERATION_PATHS = frozenset(ROUTES.values())
READER_FAILED = "this gateway's reader of its reply topic failed (its log says why); restart it"
_json = msgspec.json.Encoder()


@dataclass
class GatewayConfig:
    tokenizer: str  # a Hugging Face tokenizer directory (chat template, prompt text)
    model_name: str = "genpipe-tiny"
    gateway_id: str = "gw"
    max_in_flight: int = 1024  # open requests at most; more get 429
    max_logprobs: int = 20
    timeout_s: float = 120.0  # no result for this long: 504
    # A non-streamed answer comes whole, in one record, when its request ends: no result
    # for this long (or for the request's own timeout, if longer): 504
    answer_timeout_s: float = 600.0
    send_timeout_s: float = 15.0  # Kafka took no request for this long: 503
    keepalive_s: float = 15.0  # an idle stream gets a comment line this often (proxies close silent ones)
    max_unread: int = 1024  # result records a request may have waiting for its HTTP client, at most
    max_body_bytes: int = 16 << 20  # a request body larger than this: 413, not kept
    write_timeout_s: float = 60.0  # a stream's client took no bytes for this long: given up
    # The workers' consumer groups (id -> role) /health looks at; None: <prefix>-generate
    # and <prefix>-derender, their default --group-id
    worker_groups: dict[str, str] | None = None
    max_record_bytes: int = MAX_RECORD_BYTES  # a request record larger: 413 (the workers' --max-record-bytes)
    # The result records of a non-streamed request's answers assembled from streamed ones
    # (GenpipeClient.complete: an AnswerBudget per HTTP request) may hold, all told: past it, a 400
    max_answer_bytes: int = 16 << 20
    # The deployment's context length (the generate workers' --max-model-len); None: the
    # tokenizer directory's config.json, if it says
    max_model_len: int | None = None
    # Web origins whose pages may read the gateway's answers in a browser (CORS); none: no
    # CORS headers, so browsers keep other sites' pages from reading them (who may
    # generate at all is `api_keys`')
    allowed_origins: tuple[str, ...] = ()
    # Keys a caller must send (Authorization: Bearer <key>), any one of them; none: no
    # check (api_keys.py)
    api_keys: tuple[str, ...] = field(default=(), repr=False)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = 400) -> bytes:
    return _json.encode({"error": {"message": message, "type": kind, "param": param, "code": code}})


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> Response:
    return Response(error_body(message, kind, param, status), status_code=status, media_type="application/json")


class Gateway:
    def __init__(self, settings: KafkaSettings, config: GatewayConfig):
        self.settings = settings
        self.config = config
        self.reply_topic = f"{settings.topic_prefix}.reply.{config.gateway_id}"
        # The gateway cancels what it abandons itself, saying why (the HTTP client went away,
        # another choice failed, a timeout): one cancel record per request, not two.
        self.client = GenpipeClient(settings=settings, reply_topic=self.reply_topic, timeout_s=config.timeout_s,
                                    send_timeout_s=config.send_timeout_s, cancel_on_abandon=False,
                                    max_unread=config.max_unread, max_record_bytes=config.max_record_bytes)
        self.in_flight = 0
        self._health: asyncio.Future | None = None  # the last look at the worker groups (health)
        self._health_at = 0.0
        self.stall_watch = StallWatch(config.write_timeout_s)  # streams whose client stopped reading
        self._errors_log = LogDigest(log, logging.WARNING, "requests answered 503/504")
        self.max_model_len = config.max_model_len or _max_model_len(config.tokenizer)
        if self.max_model_len is None:
            log.warning("the model's context length is unknown (%s/config.json does not say it): prompts are not "
                        "checked against it here, and /v1/models and /tokenize give null; pass --max-model-len",
                        config.tokenizer)

    async def start(self) -> None:
        from workers.broker.topics import ensure_topic

        await ensure_topic(self.settings, self.reply_topic, like=self.settings.topic("results"))
        await self.client.start()

    async def close(self) -> None:
        self.stall_watch.close()
        # Requests still open when the gateway stops (uvicorn ended them past
        # --shutdown-timeout): nobody reads their answers now, so they are cancelled, those
        # still waiting here and those whose streams were closed first (`cancel_soon`)
        await self.client.close(cancel_waiting=True)

    def app(self) -> Starlette:
        middleware = []
        if self.config.allowed_origins:
            # (the headers a browser may send: the OpenAI SDKs' own, Authorization, X-Request-Timeout)
            middleware.append(Middleware(CORSMiddleware, allow_origins=list(self.config.allowed_origins),
                                         allow_methods=["GET", "POST"], allow_headers=["*"], max_age=600))
        if self.config.api_keys:  # (inside CORS: a preflight, which carries no key, is answered first)
            middleware.append(Middleware(RequireApiKey, keys=self.config.api_keys, on_refused=_count_refused))
        return Starlette(middleware=middleware, routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        from workers.gc_tuning import tune_after_startup

        await self.start()
        tune_after_startup()  # as the workers do: start-up's objects out of the collector's way
        watch_gc_pauses()  # /metrics: genpipe_gc_pause_seconds_total
        try:
            yield
        finally:
            await self.close()

    # --- generation ----------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, "chat")

    async def generate(self, request: Request, kind: str) -> Response:
        route = ROUTES[kind]
        try:
            response = await self._generate(request, kind)
        except ClientDisconnect:  # (gone while sending its body)
            series(GATEWAY_REQUESTS, route, "499").inc()
            raise
        except Exception:  # (Starlette answers 500)
            series(GATEWAY_REQUESTS, route, "500").inc()
            raise
        if isinstance(response, EventStream):
            # A stream counts itself when it ends (`_events`), or here if its client went
            # before its body began (the generator never ran)
            response.on_unstarted = lambda: series(GATEWAY_REQUESTS, route, "499").inc()
        else:
            series(GATEWAY_REQUESTS, route, str(response.status_code)).inc()
        return response

    async def _generate(self, request: Request, kind: str) -> Response:
        try:
            body = await self._json_body(request)
        except BadParameter as exc:
            return error_response(exc.status, str(exc), exc.kind, exc.param)
        try:
            parsed = parse(body, kind, self.config.model_name, self.config.max_logprobs)
            if parsed.kind == "completion" and not any(isinstance(p, str) for p in parsed.prompts):
                # Token ids already (genpipe's own use): no tokenizer, so no hop to a thread,
                # which costs a GIL handoff (~0.3 ms idle, ~3 ms p50 with 16 streams running).
                prompts = parsed.prompts
            else:  # the tokenizer (a long prompt or a chat template takes a while): off the loop
                prompts = await asyncio.to_thread(self._prompt_ids, parsed)
            check_context(prompts, self.max_model_len, "messages" if parsed.kind == "chat" else "prompt")
        except BadParameter as exc:
            return error_response(exc.status, str(exc), exc.kind, exc.param)
        if (busy := self._busy()) is not None:
            return busy
        # Choice index = prompt index × n + sample index; a seeded request gives each
        # choice its own seed (seed + index), so n > 1 does not repeat one sample.
        try:
            timeout = request_timeout(request.headers.get("x-request-timeout"), body.get("timeout"))
        except BadParameter as exc:
            return error_response(exc.status, str(exc), exc.kind, exc.param)
        if timeout is not None:
            parsed.options["deadline_s"] = timeout  # a request not started by then ends as "abort"
        # Kafka takes a record of ~1 MB (--max-record-bytes): a request past that is the
        # client's to shorten (413), found on one copy of the longest prompt before the
        # fan-out copies it n times (a 15 MB body of token ids at n = 64 held the event
        # loop 13 s, every stream with it).
        longest = max(prompts, key=len)
        size = len(encode(make_request(longest, kind=kind, **parsed.options)))
        if size > self.config.max_record_bytes:
            return error_response(413, f"the request is {size} bytes as a Kafka record, over the "
                                       f"{self.config.max_record_bytes} one may take: send a shorter prompt",
                                  param="messages" if kind == "chat" else "prompt")
        seed = parsed.options.get("seed")
        choices = [make_request(ids, kind=kind,
                                **{**parsed.options, "seed": None if seed is None else nth_seed(seed, index)})
                   for index, ids in enumerate(ids for ids in prompts for _ in range(parsed.n))]
        prompt_of = [index // parsed.n for index in range(len(choices))]
        if parsed.stream:
            return EventStream(self._events(choices, prompt_of, parsed.options.get("include_usage", False),
                                            parsed.options.get("continuous_usage", False), ROUTES[kind]),
                               self.stall_watch, choices[0].request_id)
        return await self._complete(request, choices, prompt_of, max(self.config.answer_timeout_s, timeout or 0))

    def _busy(self) -> Response | None:
        """429 at --max-in-flight open requests."""
        if self.in_flight < self.config.max_in_flight:
            return None
        return error_response(429, f"this gateway has {self.in_flight} requests open, its limit "
                                   f"(--max-in-flight); retry later", "rate_limit_error")

    async def _json_body(self, request: Request):
        """The request's body as JSON, at most --max-body-mib; else BadParameter (400, 413)."""
        try:
            return msgspec.json.decode(await _read_body(request, self.config.max_body_bytes))
        except msgspec.DecodeError as exc:
            raise BadParameter("body", f"the request body is not valid JSON: {exc}") from None
        except RecursionError:  # msgspec gives up ~1,000 levels deep: a 500 before
            raise BadParameter("body", "the request body is nested too deeply") from None

    def _prompt_ids(self, parsed) -> list[list[int]]:
        try:
            if parsed.kind == "chat":
                return [render_chat(self.config.tokenizer, parsed.messages)]
            return [render_prompt(self.config.tokenizer, p) if isinstance(p, str) else p for p in parsed.prompts]
        except (ValueError, TemplateError) as exc:  # no chat template, a template that refuses the messages
            raise BadParameter("messages" if parsed.kind == "chat" else "prompt", str(exc)) from None

    async def _complete(self, request: Request, choices: list, prompt_of: list[int], timeout_s: float) -> Response:
        """A non-streamed request: one JSON answer. A client that goes away cancels it.
        Each choice's answer comes whole when it ends, in one result record or, where that
        may not fit, assembled from its streamed records (`GenpipeClient.complete`):
        waited for `timeout_s` all told (with --timeout, a stream's wait between two
        records, every answer longer than that got 504); the records of the answers
        assembled, at most --max-answer-mib for the request, all its choices counted (held
        to its end, an answer of any size took the gateway's memory): past it a 400, the
        choices cancelled."""
        self.in_flight += 1
        budget = AnswerBudget(self.config.max_answer_bytes)  # (the request's, all its choices)
        waits = [asyncio.ensure_future(self.client.complete(c, timeout_s=timeout_s, budget=budget)) for c in choices]
        done = asyncio.gather(*waits)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([done, gone], return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                done.cancel()
                for c in choices:
                    self.client.cancel_soon(c.request_id, "the HTTP client went away")
                return Response(status_code=499)  # nobody reads it
            try:
                results = self._results(done, choices)
            except GenpipeTimeout as exc:
                return error_response(504, f"{self._told(exc)} (a non-streamed answer comes whole when its request "
                                           f"ends: give a longer one a timeout, or raise --answer-timeout)", "timeout")
            except GenpipeError as exc:
                return error_response(_http_status(exc.code), self._told(exc), exc.type, exc.param)
            except Exception as exc:  # the client's reader failed, it stopped
                return error_response(503, self._unserved(exc, choices[0].request_id), "service_unavailable")
            return Response(_json.encode(merge_final(results, prompt_of)), media_type="application/json")
        except asyncio.CancelledError:  # (uvicorn ended it: the gateway stops, past --shutdown-timeout)
            for c in choices:
                self.client.cancel_soon(c.request_id, "the gateway stopped")
            raise
        finally:
            gone.cancel()
            for wait in waits:  # (a choice failed: the others' reading stops now, not at their end)
                wait.cancel()
            self.in_flight -= 1

    def _results(self, done: asyncio.Future, choices: list) -> list:
        try:
            return done.result()
        except BaseException:
            for c in choices:  # one choice failed: the others' answers would go unread
                self.client.cancel_soon(c.request_id, "another choice of the HTTP request failed")
            raise

    async def _events(self, choices: list, prompt_of: list[int], include_usage: bool, continuous_usage: bool,
                      route: str):
        """Server-sent events: `data: {json}` per result record, `data: [DONE]` at the end;
        with several choices their records interleave, each with its `index`, and one
        usage record (the sum) comes last (`continuous_usage`: every record also keeps its
        choice's usage so far). A quiet stream gets a `: keep-alive` comment every
        `keepalive_s`. After the first byte an error can only be an event; a request that
        restarted on another generate worker after bytes were sent cannot take them back,
        so the stream ends with an error event saying so (and the rest is cancelled).
        Counted at its end (`genpipe_gateway_requests_total`) with the status its error
        event carries, 200 for [DONE], 499 when its HTTP client went away first."""
        self.in_flight += 1
        status = 499
        response_id = f"{'chatcmpl' if choices[0].output.kind == 'chat' else 'cmpl'}-{choices[0].request_id}"
        finished, sent = set(), False
        usages: list = [None] * len(choices)
        last = None
        records = choice_records(self.client, choices, self.config.keepalive_s)
        loop, relay = asyncio.get_running_loop(), GATEWAY_RELAY

        def cancel_rest(reason: str, cancelled: str | None = None) -> None:
            for i, c in enumerate(choices):
                if i not in finished:
                    finished.add(i)
                    if c.request_id != cancelled:
                        self.client.cancel_soon(c.request_id, reason)

        try:
            async with contextlib.aclosing(records):
                async for index, record in records:
                    if record is KEEPALIVE:
                        yield b": keep-alive\n\n"  # an SSE comment: clients ignore it
                        continue
                    if record.restart and sent:
                        status = 500
                        yield _event(error_body("the request was restarted by the pipeline after part of its "
                                                "output was sent; the output so far is void: send the request "
                                                "again", "server_error", code=500))
                        return
                    if record.final:
                        finished.add(index)
                    item = record.value
                    if isinstance(item, ErrorResponse):
                        status = _http_status(item.error.code)
                        yield _event(_json.encode(item))
                        return
                    if item.usage is not None:
                        usages[index] = item.usage
                        if not item.choices:
                            continue  # the per-choice usage record: one summed record comes last
                        if not continuous_usage:
                            item = msgspec.structs.replace(item, usage=None)
                    last = reindex(item, index, response_id)
                    event = _event(_json.encode(last))
                    relay.observe(loop.time() - record.received_at)
                    yield event
                    sent = True
            if include_usage and last is not None:
                usage = total_usage(usages, prompt_of)
                yield _event(_json.encode(msgspec.structs.replace(last, choices=[], usage=usage)))
            yield b"data: [DONE]\n\n"
            status = 200  # (resumed here only once the server took it)
        except GenpipeError as exc:  # a timeout, or the HTTP client stopped reading (max_unread)
            # Cancel first: the error event may wait on a client that does not read.
            # (a choice whose reader fell behind was cancelled by the client already)
            cancel_rest(f"the HTTP stream failed: {exc.message[:200]}",
                        exc.request_id if isinstance(exc, GenpipeOverflow) else None)
            code = 504 if isinstance(exc, GenpipeTimeout) else exc.code
            # (a client that stopped reading went first, as one the stall watch gives up)
            status = 499 if isinstance(exc, GenpipeOverflow) else _http_status(code)
            yield _event(error_body(self._told(exc), exc.type, exc.param, code))
        except Exception as exc:  # the client's reader failed, it stopped: as a non-streamed 503
            cancel_rest(f"the HTTP stream failed: {str(exc)[:200]}")
            # (the stream was cut with no event before: the HTTP client saw a broken body)
            status = 503
            yield _event(error_body(self._unserved(exc, choices[0].request_id), "service_unavailable", code=503))
        finally:
            self.in_flight -= 1
            series(GATEWAY_REQUESTS, route, str(status)).inc()
            # the HTTP client went away, or the stream ended early
            cancel_rest("the HTTP stream ended before the request")

    def _told(self, exc: GenpipeError) -> str:
        """What the HTTP caller is told of an error: its public message. Where the full one
        says more (Kafka's address, the topic prefix, what an operator should check: the
        client's timeouts and unacknowledged sends), that goes to the log, a digest of it
        in a flood. A caller is not the deployment's operator."""
        if exc.public_message != exc.message:
            self._errors_log.log("request %s: %s", exc.request_id, exc.message)
        return exc.public_message

    def _unserved(self, exc: BaseException, request_id: str) -> str:
        """What the HTTP caller is told of a failure that is not the request's (the gateway's
        reader of its reply topic failed, its client stopped): the exception is logged."""
        log.error("request %s failed: %r", request_id, exc)
        if self.client.reader_error is not None:
            return f"genpipe is unavailable: {READER_FAILED}"
        return "genpipe is unavailable: the gateway could not serve the request (its log says why)"

    # --- the rest ------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return Response(_json.encode({"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": int(time.time()), "owned_by": "genpipe",
            # vLLM's model card's fields, which tools built on it read
            "root": self.config.model_name, "parent": None, "max_model_len": self.max_model_len,
            "permission": []}]}), media_type="application/json")

    # --- the tokenizer (vLLM's /tokenize and /detokenize: workers/gateway/tokenizing.py) ---

    async def tokenize(self, request: Request) -> Response:
        return await self._lend(request, self._tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._lend(request, self._detokenize)

    async def _lend(self, request: Request, work) -> Response:
        """The tokenizer's endpoints count as open requests (--max-in-flight: a flood of
        16 MiB prompts took the threads a generation request's text prompt waits for)."""
        if (busy := self._busy()) is not None:
            return busy
        self.in_flight += 1
        try:
            return await work(await self._json_body(request))
        except BadParameter as exc:
            return error_response(exc.status, str(exc), exc.kind, exc.param)
        finally:
            self.in_flight -= 1

    async def _tokenize(self, body) -> Response:
        ask = tokenizing.parse_tokenize(body, self.config.model_name)
        ids, token_strs = await asyncio.to_thread(tokenizing.tokenize, self.config.tokenizer, ask)
        answer = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if token_strs is not None:
            answer["token_strs"] = token_strs
        return Response(_json.encode(answer), media_type="application/json")

    async def _detokenize(self, body) -> Response:
        ids = tokenizing.parse_detokenize(body, self.config.model_name)
        text = await asyncio.to_thread(tokenizing.detokenize, self.config.tokenizer, ids)
        return Response(_json.encode({"prompt": text}), media_type="application/json")

    async def health(self, request: Request) -> Response:
        from workers.kafka.groups import missing_workers

        # Its body says what is wrong, the log where and why: a probe's body ends up in
        # load balancers' and dashboards' hands (it carried the bootstrap servers and the exception)
        if self.client.reader_error is not None:  # every request gets 503 until the gateway is restarted
            return _unavailable(READER_FAILED)
        loop = asyncio.get_running_loop()
        if self._health is None or (self._health.done() and loop.time() - self._health_at >= HEALTH_REUSE_S):
            # One look at the groups answers every call for a while: each call opened an
            # admin client (a connection, TLS and a login)
            self._health = asyncio.ensure_future(asyncio.wait_for(
                missing_workers(self.settings, self.config.worker_groups, raise_errors=True), 10))
            self._health.add_done_callback(self._looked)
        try:
            missing = await asyncio.shield(self._health)  # (a caller that goes away leaves it to the others)
        except Exception:  # Kafka unreachable: nothing can be served (logged once per look: `_looked`)
            return _unavailable("Kafka does not answer")
        if missing:
            return _unavailable("; ".join(missing))
        return Response(_json.encode({"status": "ok"}), media_type="application/json")

    def _looked(self, look: asyncio.Future) -> None:
        self._health_at = asyncio.get_running_loop().time()  # (reused from its answer on)
        if not look.cancelled() and look.exception() is not None:
            log.warning("/health: Kafka at %s does not answer: %r", self.settings.bootstrap_servers,
                        look.exception())

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def _count_refused(path: str) -> None:
    """A generation request without a valid API key, in the requests counter (401)."""
    if path in GENERATION_PATHS:
        series(GATEWAY_REQUESTS, path, "401").inc()


def _unavailable(reason: str) -> Response:
    return Response(_json.encode({"status": "unavailable", "reason": reason}), status_code=503,
                    media_type="application/json")


def _http_status(code) -> int:
    """The HTTP status an error's `code` names (a worker's error carries one), else 500."""
    return code if isinstance(code, int) and 400 <= code < 600 else 500


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes: a larger one is refused (413) as soon as
    its Content-Length says so, or once that much of a chunked one has come, and the rest
    is not kept (uvicorn reads it and drops it). Starlette's `request.body()` reads any
    size into memory: one client sending gigabytes took the gateway's memory, every other
    request's with it."""
    def too_large(declared: str | None) -> BadParameter:
        size = f" ({declared[:30]} bytes)" if declared is not None else ""
        return BadParameter("body", f"the request body{size} is larger than this gateway takes: {limit} bytes "
                                    f"(--max-body-mib)", status=413)

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(None)
        chunks.append(chunk)
    return b"".join(chunks)


def _event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the HTTP client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _max_model_len(tokenizer_dir: str) -> int | None:
    config = Path(tokenizer_dir) / "config.json"
    try:
        return int(msgspec.json.decode(config.read_bytes()).get("max_position_embeddings"))
    except (OSError, ValueError, TypeError, msgspec.DecodeError):
        return None
