"""Records of JSON and JSONL data files (instruction sets, preference pairs), checked field by field."""

from __future__ import annotations

import json
from pathlib import Path

from nanoeuler_core.errors import unreadable


def read_records(path: Path) -> list[tuple[str, dict]]:
    """The JSON objects of a JSON list or JSONL file, each with where it came from ("FILE line N")."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"data file {path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(unreadable("data file", path, exc)) from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        records = [(f"{path} example {i}", item) for i, item in enumerate(items)]
    else:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append((f"{path} line {n}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {n}: not valid JSON ({exc.msg}); expected one JSON object a line") from None
    if not records:
        raise ValueError(f"{path} holds no examples")
    for where, item in records:
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(item).__name__}")
    return records


def text_fields(item: dict, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, str]:
    """The named string fields of a record: `required` ones non-empty, `optional` ones default ""."""
    fields = {}
    for name in required + optional:
        value = item.get(name, "" if name in optional else None)
        if value is None:
            raise ValueError(f"{where}: missing field '{name}' (each example needs {', '.join(required)})")
        if not isinstance(value, str):
            raise ValueError(f"{where}: field '{name}' must be a string, got {type(value).__name__}")
        if name in required and not value.strip():
            raise ValueError(f"{where}: field '{name}' is empty")
        fields[name] = value
    return fields
