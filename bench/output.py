"""Where a bench's result goes: its JSON file (``--out``) and one JSON line last on stdout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save(out: Path, result: dict[str, Any]) -> None:
    """Write ``result`` to ``out`` (its folder made) and print it as one JSON line."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
