"""How every genpipe process logs: one line per event, whatever a client wrote.

A request id, a topic name or an error text in a log line comes from a client: a
newline in one forged whole log lines (a fake ERROR), and terminal escape sequences
reached the operator's terminal. The message part of every line is escaped here
(`\\n` → `\\\\n`, other control characters as `\\\\xNN`); a traceback, which the handler
adds after it, keeps its lines.
"""

from __future__ import annotations

import logging
import re

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_controls(text: str) -> str:
    if not _CONTROL.search(text):  # (the usual line: one scan, nothing copied)
        return text
    return _CONTROL.sub(lambda m: _NAMED.get(m.group(), f"\\x{ord(m.group()):02x}"), text)


class OneLineFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


def setup_logging(level: str | int) -> None:
    """The root logger at `level` (a name, any case, or a number), to stderr."""
    if isinstance(level, str):
        level = getattr(logging, level.upper(), logging.INFO)
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
