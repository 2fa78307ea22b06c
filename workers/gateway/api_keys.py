"""`serve --api-key`: who may call the gateway (docs/design.md §9).

Without keys, whoever reaches the port may generate. With keys, every route but the
probes' (`/health`, `/metrics`: load balancers and scrapers send no key) needs
`Authorization: Bearer <key>`, the header the OpenAI SDKs send from their `api_key`;
any other call gets 401 in OpenAI's error shape and reaches no route. Several keys
may be valid at once, so a key can be rotated without a window where clients fail. A
browser's CORS preflight carries no credentials: the CORS middleware, outside this one,
answers it first (`Gateway.app`).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac

import msgspec

OPEN_PATHS = frozenset({"/health", "/metrics"})
_json = msgspec.json.Encoder()


def api_keys(text: str) -> tuple[str, ...]:
    """`--api-key` / GENPIPE_API_KEY: keys separated by commas (none: no check). A key is
    printable ASCII without spaces or commas, as a header carries it."""
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    for key in keys:
        if not all("!" <= c <= "~" for c in key):
            raise argparse.ArgumentTypeError("an API key is printable ASCII without spaces (keys are separated "
                                             "by commas)")
    return keys


def bearer_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key of the request's `Authorization: Bearer <key>` header (the first such
    header; the scheme in any case), or None."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, key = value.strip().partition(b" ")
            return key.strip() if scheme.lower() == b"bearer" and key.strip() else None
    return None


def key_digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def key_matches(key: bytes | None, digests: tuple[bytes, ...]) -> bool:
    """Whether `key` is one of the keys whose `key_digest`s are `digests`, each compared
    in constant time: a timing difference would tell a caller how much of a guess was
    right, and `compare_digest` of the keys themselves returns early on a length
    mismatch (their digests are all 32 bytes)."""
    if key is None:
        return False
    digest = key_digest(key)
    matched = False
    for candidate in digests:
        matched |= hmac.compare_digest(digest, candidate)
    return matched


class RequireApiKey:
    """ASGI middleware: a call without one of `keys` gets 401; `on_refused(path)` counts it.
    (No websocket route exists; one would be checked too. "lifespan" passes.)"""

    def __init__(self, app, keys: tuple[str, ...], on_refused=None):
        self.app = app
        self.digests = tuple(key_digest(k.encode()) for k in keys)
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS
                or key_matches(bearer_key(scope.get("headers") or []), self.digests)):
            await self.app(scope, receive, send)
            return
        if self.on_refused is not None:
            self.on_refused(scope["path"])
        body = _json.encode({"error": {
            "message": "this gateway needs an API key: send it as the header `Authorization: Bearer <key>` "
                       "(an OpenAI SDK's api_key)", "type": "invalid_request_error", "param": None,
            "code": "invalid_api_key"}})
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
