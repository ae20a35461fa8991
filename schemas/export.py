"""Write the JSON Schema files of the event contract: ``python -m schemas.export``."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

from schemas.events import EVENT_TYPES, json_schema

SCHEMA_DIR = Path(__file__).parent / "jsonschema"


def rendered() -> dict[str, bytes]:
    return {
        f"{name}.schema.json": orjson.dumps(json_schema(cls),
                                            option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
        + b"\n"
        for name, cls in EVENT_TYPES.items()
    }


def main() -> int:
    SCHEMA_DIR.mkdir(exist_ok=True)
    for name, body in rendered().items():
        (SCHEMA_DIR / name).write_bytes(body)
    print(f"wrote {len(EVENT_TYPES)} schemas to {SCHEMA_DIR}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
