"""Why a command cannot start, in one line (docs/design.md, "Operations").

A worker that cannot start should say what is wrong and what to do, not end in a
library's traceback (transformers answers a missing directory with "Repo id must use
alphanumeric chars"). `cli.main` prints a `StartupError` as one line and exits with its
code: 2 for what the user gave (a path, a device), 1 for what went wrong at run time.
"""

from __future__ import annotations

import os
from pathlib import Path


class StartupError(Exception):
    """A one-line reason a command cannot run; exit code 1."""

    exit_code = 1


class UsageError(StartupError):
    """What the user gave cannot work (a path, a device); exit code 2."""

    exit_code = 2


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _readable_dir(path: str | os.PathLike, what: str, option: str, needs: tuple[str, ...]) -> Path:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{option} {p}: the {what} directory does not exist")
    if not p.is_dir():
        raise UsageError(f"{option} {p}: not a directory (give the {what} directory)")
    if not any((p / name).is_file() for name in needs):
        raise UsageError(f"{option} {p}: no {' or '.join(needs)} in it: not a Hugging Face {what} directory")
    for name in needs:
        file = p / name
        if file.is_file() and not os.access(file, os.R_OK):
            raise UsageError(f"{option} {p}: {name} is not readable by this user")
    return p


def check_model_dir(path: str | os.PathLike, option: str = "--model") -> Path:
    return _readable_dir(path, "model", option, ("config.json",))


def check_tokenizer_dir(path: str | os.PathLike, option: str = "--tokenizer") -> Path:
    p = Path(path)
    if p.is_file():  # a tokenizer.json given directly
        if not os.access(p, os.R_OK):
            raise UsageError(f"{option} {p}: not readable by this user")
        return p
    return _readable_dir(path, "tokenizer", option, ("tokenizer.json", "tokenizer_config.json"))


def check_device(device: str) -> None:
    """A device torch can use here: `cpu`, or `cuda[:N]` with a GPU visible."""
    if device == "cpu":
        return  # nothing to check, and the worker process need not load torch for it
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"--device {device!r}: {one_line(exc)} (use cpu or cuda)") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA GPU is visible to torch on this machine "
                             f"(torch {torch.__version__}); use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type != "cpu":
        raise UsageError(f"--device {device}: only cpu and cuda are supported")
