"""A bare HTTP/1.1 + server-sent-events client on asyncio streams, for ops/bench/gateway.py.

Why not httpx: the concurrency part holds 1,000+ streams in one process on a 2-core box,
and what the bench costs must stay small next to what it measures. This reads a
chunked (or plain) response body and hands each `\\n\\n`-terminated event to a callback
with the time (ns) its bytes arrived; nothing else (no redirects, no keep-alive, no TLS).
The bench reports its own process's CPU per event so the client's cost is visible.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


class HTTPError(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status = status


async def sse_post(host: str, port: int, path: str, body: bytes, on_event: Callable[[bytes, int], None],
                   on_headers: Callable[[int], None] | None = None) -> None:
    """POST `body`; call `on_event(event_bytes, arrived_ns)` per SSE event until the end.

    `on_headers(arrived_ns)` is called when the response headers arrived (the stream is
    held open from then on). A status other than 200 raises HTTPError.
    """
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (path.encode(), host.encode(), port, len(body), body))
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        if status != 200:
            raise HTTPError(status, await reader.read())
        if on_headers is not None:
            on_headers(time.time_ns())
        chunked = headers.get(b"transfer-encoding") == b"chunked"
        buffer = b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                data = (await reader.readexactly(size + 2))[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
            now = time.time_ns()
            buffer += data
            while (end := buffer.find(b"\n\n")) >= 0:
                event, buffer = buffer[:end], buffer[end + 2:]
                on_event(event, now)
    finally:
        writer.close()
