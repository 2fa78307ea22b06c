"""Adds and aborts from any thread, taken by the stepping thread once a step.

Both engines (the model's and the synthetic one) accept requests this way: `add`
validates at once (so the caller gets the ValidationError) and refuses an id that is
still running; `abort` of an unknown or finished id is ignored.
"""

from __future__ import annotations

import threading

from schemas.errors import ValidationError
from schemas.records import GenerateRequest
from schemas.validation import validate_request


class Inbox:
    def __init__(self):
        self._lock = threading.Lock()
        self._items: list[tuple] = []  # ("add", request, tier) | ("abort", request_id, reason)
        # accepted and not yet finished, by id: the request, so that the end of an attempt
        # aborted and added again while it stepped forgets only itself (`finished`)
        self._known: dict[str, GenerateRequest] = {}

    def add(self, request: GenerateRequest, *, validated: bool = False, tier: int = 0, **limits) -> None:
        """Validate against `limits` (validate_request's), unless the caller did (`validated`:
        a request is checked once on its way, not at every hop; a long prompt costs ~45 ns an
        id each time), and queue. `tier`: 0 interactive, 1 bulk (admission.py). Raises
        ValidationError, for a running id in any case."""
        if not validated:
            validate_request(request, **limits)
        with self._lock:
            if request.request_id in self._known:
                raise ValidationError(f"request_id {request.request_id!r} is already running", field="request_id")
            self._known[request.request_id] = request
            self._items.append(("add", request, tier))

    def abort(self, request_id: str, reason: str) -> None:
        with self._lock:
            if self._known.pop(request_id, None) is not None:  # the id may be added again right away
                self._items.append(("abort", request_id, reason))

    def take(self) -> list[tuple]:
        """Everything queued since the last call, in order."""
        with self._lock:
            items, self._items = self._items, []
        return items

    def finished(self, request: GenerateRequest) -> None:
        """The request ended on its own: its id may be used again. An attempt aborted and
        added again while this one stepped is not forgotten: its id was (its abort was then
        ignored, and a third copy accepted: two finals for one id)."""
        with self._lock:
            if self._known.get(request.request_id) is request:
                del self._known[request.request_id]

    def __bool__(self) -> bool:
        return bool(self._items)
