"""Where genpipe keeps what it builds or downloads: Kafka jars, broker data, tiny models."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`GENPIPE_CACHE_DIR`, else `~/.cache/genpipe`; absolute (the broker's pid check
    compares paths with its command line)."""
    root = os.environ.get("GENPIPE_CACHE_DIR") or Path.home() / ".cache" / "genpipe"
    return Path(root).expanduser().resolve()
