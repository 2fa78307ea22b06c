"""`genpipe schema export DIR`: the JSON Schema of each topic's record."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec

from schemas.openai import RESULT_TYPES
from schemas.records import Cancel, GenerateChunk, GenerateRequest

# topic role -> the record types its values may have
TOPIC_RECORDS: dict[str, tuple[type, ...]] = {
    "requests": (GenerateRequest,),
    "chunks": (GenerateChunk,),
    "results": RESULT_TYPES,
    "cancel": (Cancel,),
}


def topic_schema(role: str) -> dict:
    types = TOPIC_RECORDS[role]
    parts, components = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    top = parts[0] if len(parts) == 1 else {"anyOf": list(parts)}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"genpipe.{role}",
        "description": f"Value of a record on the <prefix>.{role} topic; the genpipe-schema "
                       f"header names which of {', '.join(t.__name__ for t in types)} it is.",
        **top,
        "$defs": components,
    }


def export_schemas(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for role in TOPIC_RECORDS:
        path = out_dir / f"{role}.schema.json"
        path.write_text(json.dumps(topic_schema(role), indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


def _run_export(args: argparse.Namespace) -> int:
    import sys

    try:
        written = export_schemas(Path(args.dir))
    except OSError as exc:  # (a file where the directory goes, no permission: a traceback)
        print(f"genpipe schema export: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def register(sub) -> None:
    schema = sub.add_parser("schema", help="the record contract (JSON Schema export)")
    schema_sub = schema.add_subparsers(dest="schema_command", metavar="ACTION", required=True)
    export = schema_sub.add_parser(
        "export", help="write the JSON Schema of each topic's record into DIR",
        description="Write requests/chunks/results/cancel .schema.json files into DIR so "
                    "services in other languages can validate and generate types. "
                    "The DLQ topic carries original bytes and has no schema.")
    export.add_argument("dir", help="output directory (created if missing)")
    export.set_defaults(func=_run_export)
