"""Log lines stay one line each, whatever a client wrote into them (no broker)."""

from __future__ import annotations

import io
import logging

from workers.logs import FORMAT, OneLineFormatter, escape_controls


def _logged(*args, exc_info=None) -> str:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter(FORMAT))
    logger = logging.getLogger("genpipe-test-logs")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning(*args, exc_info=exc_info)
    finally:
        logger.removeHandler(handler)
    return out.getvalue()


def test_a_request_id_cannot_forge_a_log_line_or_reach_the_terminal():
    """A request_id is any 1..256 characters: one with a newline wrote a second, forged
    line into the worker's log (a fake ERROR), and escape sequences reached the terminal."""
    rid = "x\n2099-01-01 00:00:00,000 ERROR workers.kafka.loop: \x1b[31mFAKE\r\x00"
    line = _logged("request %s: refused", rid)
    assert line.count("\n") == 1 and line.endswith(": refused\n")
    assert "x\\n2099-01-01 00:00:00,000 ERROR workers.kafka.loop: \\x1b[31mFAKE\\r\\x00" in line
    assert "\x1b" not in line and "\r" not in line


def test_a_traceback_keeps_its_lines_and_plain_text_is_left_as_it_is():
    try:
        raise ValueError("bad\nvalue")
    except ValueError as exc:
        text = _logged("failed: %s", exc, exc_info=exc)
    first, *rest = text.splitlines()
    assert first.endswith("failed: bad\\nvalue") and rest[0] == "Traceback (most recent call last):"
    assert escape_controls("café 中文 🙂 tab-free") == "café 中文 🙂 tab-free"
    assert escape_controls("a\tb\x85") == "a\\tb\\x85"
