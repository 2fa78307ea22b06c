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
from dataclasses import dataclass
from pathlib import Path

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from schemas.openai import ErrorResponse
from workers.client import (GenpipeClient, GenpipeError, GenpipeTimeout, Restart, make_request, render_chat,
                            render_prompt)
from workers.gateway.params import BadParameter, parse
from workers.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()


@dataclass
class GatewayConfig:
    tokenizer: str  # a Hugging Face tokenizer directory (chat template, prompt text)
    model_name: str = "genpipe-tiny"
    gateway_id: str = "gw"
    max_in_flight: int = 1024  # open requests at most; more get 429
    max_logprobs: int = 20
    timeout_s: float = 120.0  # no result for this long: 504


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
        self.client = GenpipeClient(settings=settings, reply_topic=self.reply_topic, timeout_s=config.timeout_s)
        self.in_flight = 0
        self._background: set[asyncio.Task] = set()
        self.max_model_len = _max_model_len(config.tokenizer)

    async def start(self) -> None:
        from workers.broker.topics import ensure_topic

        await ensure_topic(self.settings, self.reply_topic, like=self.settings.topic("results"))
        await self.client.start()

    async def close(self) -> None:
        await self.client.close()

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        await self.start()
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
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            return error_response(400, f"the request body is not valid JSON: {exc}", param="body")
        try:
            parsed = parse(body, kind, self.config.model_name, self.config.max_logprobs)
            prompt_ids = await asyncio.to_thread(self._prompt_ids, parsed)
        except BadParameter as exc:
            return error_response(exc.status, str(exc), exc.kind, exc.param)
        if self.in_flight >= self.config.max_in_flight:
            return error_response(429, f"this gateway has {self.in_flight} requests open, its limit "
                                       f"(--max-in-flight); retry later", "rate_limit_error")
        generate_request = make_request(prompt_ids, kind=kind, **parsed.options)
        if parsed.stream:
            return StreamingResponse(self._events(generate_request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._complete(request, generate_request)

    def _prompt_ids(self, parsed) -> list[int]:
        try:
            if parsed.kind == "chat":
                return render_chat(self.config.tokenizer, parsed.messages)
            if isinstance(parsed.prompt, str):
                return render_prompt(self.config.tokenizer, parsed.prompt)
        except ValueError as exc:  # no chat template, a template that refuses the messages
            raise BadParameter("messages" if parsed.kind == "chat" else "prompt", str(exc)) from None
        return parsed.prompt

    async def _complete(self, request: Request, generate_request) -> Response:
        """A non-streamed request: one JSON answer. A client that goes away cancels it."""
        self.in_flight += 1
        done = asyncio.ensure_future(self.client.complete(generate_request))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([done, gone], return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                done.cancel()
                self._cancel(generate_request.request_id, "the HTTP client went away")
                return Response(status_code=499)  # nobody reads it
            try:
                return Response(_json.encode(done.result()), media_type="application/json")
            except GenpipeTimeout as exc:
                return error_response(504, str(exc), "timeout")
            except GenpipeError as exc:
                status = exc.code if isinstance(exc.code, int) and 400 <= exc.code < 600 else 500
                return error_response(status, exc.message, exc.type, exc.param)
            except Exception as exc:  # Kafka unreachable, the client stopped
                log.error("request %s failed: %r", generate_request.request_id, exc)
                return error_response(503, f"genpipe is unavailable: {exc}", "service_unavailable")
        finally:
            gone.cancel()
            self.in_flight -= 1

    async def _events(self, generate_request):
        """Server-sent events: `data: {json}` per result record, `data: [DONE]` at the end.
        After the first byte an error can only be an event; a request that restarted on
        another generate worker after bytes were sent cannot take them back, so the
        stream ends with an error event saying so (the request is cancelled)."""
        self.in_flight += 1
        finished, sent = False, False
        try:
            stream = self.client.stream(generate_request, raise_errors=False)
            async with contextlib.aclosing(stream) as items:
                async for item in items:
                    if isinstance(item, Restart):
                        if sent:
                            yield _event(error_body("the request was restarted by the pipeline after part of "
                                                    "its output was sent; the output so far is void: "
                                                    "send the request again", "server_error", code=500))
                            return
                        continue
                    yield _event(_json.encode(item))
                    sent = True
                    if isinstance(item, ErrorResponse):
                        finished = True
                        return
            finished = True
            yield b"data: [DONE]\n\n"
        except GenpipeTimeout as exc:
            yield _event(error_body(str(exc), "timeout", code=504))
        except GenpipeError as exc:
            yield _event(error_body(exc.message, exc.type, exc.param, exc.code))
        finally:
            self.in_flight -= 1
            if not finished:  # the HTTP client went away, or the stream ended early
                self._cancel(generate_request.request_id, "the HTTP stream ended before the request")

    def _cancel(self, request_id: str, reason: str) -> None:
        # Not awaited here: this runs while the response's task is being cancelled.
        task = asyncio.ensure_future(self.client.cancel(request_id, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- the rest ------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return Response(_json.encode({"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": int(time.time()), "owned_by": "genpipe",
            "max_model_len": self.max_model_len}]}), media_type="application/json")

    async def health(self, request: Request) -> Response:
        from workers.kafka.groups import missing_workers

        try:
            missing = await asyncio.wait_for(missing_workers(self.settings), 10)
        except Exception as exc:
            return Response(_json.encode({"status": "unavailable", "reason": f"Kafka: {exc}"}), status_code=503,
                            media_type="application/json")
        if missing:
            return Response(_json.encode({"status": "unavailable", "reason": "; ".join(missing)}), status_code=503,
                            media_type="application/json")
        return Response(_json.encode({"status": "ok"}), media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


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
