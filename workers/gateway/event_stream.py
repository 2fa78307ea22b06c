"""A streamed answer's server-sent events, and the watch that gives up a stream whose
HTTP client stopped reading (docs/design.md §9).

A client that keeps its socket open and reads nothing parks the stream's writer once the
socket's buffers are full. The request is cancelled when `--max-unread` records wait
(workers/mailbox.py), but the stream held its `--max-in-flight` slot until the client
closed: 1,024 such clients and every request got 429. A write that has waited
`--write-timeout` now ends the stream: its generator is closed (the slot back, anything
still running cancelled), and uvicorn logs "ASGI callable returned without completing
response" and closes the connection once its buffered bytes are gone: a client that
never reads keeps its socket, one file descriptor and at most ~64 KB buffered, until it
closes (ASGI offers no way to abort a connection).

One watch per gateway looks at the open streams a few times per timeout, rather than a
timer per write: a timer armed and cancelled per event cost the gateway ~8% more CPU per
token (BENCHMARKS.md, "HTTP gateway"); a write now costs a clock read and two stores.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from starlette.responses import StreamingResponse

log = logging.getLogger(__name__)


class EventStream(StreamingResponse):
    """`text/event-stream` from an async generator of event bytes, watched by `watch`."""

    def __init__(self, content, watch: "StallWatch", request_id: str):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.watch = watch
        self.request_id = request_id
        self.writing_since: float | None = None  # the loop's time a write began, while it waits
        self.stalled = False
        self.task: asyncio.Task | None = None
        self.began = False  # its body's generator ran (it counts the request itself then)
        self.on_unstarted: Callable[[], None] | None = None  # called if it never did

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # (a client gone while the response started: Starlette never ran the body)
            if not self.began and self.on_unstarted is not None:
                self.on_unstarted()

    async def stream_response(self, send) -> None:
        """Starlette's, with each write's start noted for the watch (inline: a wrapper
        around `send` cost a coroutine per event)."""
        time = asyncio.get_running_loop().time
        self.task = asyncio.current_task()
        self.watch.add(self)
        try:
            self.writing_since = time()
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            self.writing_since = None  # (waiting for the first event is not a stalled write)
            self.began = True
            async for chunk in self.body_iterator:  # (bytes: workers/gateway/app.py `_events`)
                self.writing_since = time()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self.writing_since = None
            self.writing_since = time()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self.stalled:
                raise
            self.task.uncancel()
            log.warning("request %s: the HTTP client read nothing for %.0f s; its stream is given up",
                        self.request_id, self.watch.timeout_s)
            await self.body_iterator.aclose()
        finally:
            self.writing_since = None
            self.watch.discard(self)


class StallWatch:
    """The open streams of a gateway; one task, while any is open, cancels those whose
    write has waited `timeout_s`."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.streams: set[EventStream] = set()
        self._task: asyncio.Task | None = None

    def add(self, stream: EventStream) -> None:
        self.streams.add(stream)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._watch())

    def discard(self, stream: EventStream) -> None:
        self.streams.discard(stream)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        every = max(0.05, self.timeout_s / 4)  # a stalled stream goes within 1.25 timeouts
        while self.streams:
            await asyncio.sleep(every)
            now = loop.time()
            for stream in list(self.streams):
                since = stream.writing_since
                if since is not None and now - since >= self.timeout_s and not stream.stalled:
                    stream.stalled = True
                    stream.task.cancel()
