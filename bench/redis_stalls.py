"""What held the stack's Redis during a bench: its SLOWLOG, split by time windows.

Redis runs one command at a time, so a command that takes long (a big Lua script, a big
range read) makes every other client wait: the gateway's document fetches and writes, the
shards' log reads. ``SLOWLOG`` keeps every command over a threshold with its start (unix
seconds, whole) and its duration. It counts a command's wall time: a command whose Redis
was waiting for a CPU reads long too, so many short commands over the threshold say the
machine, not the commands (docs/generations.md, "The builder's appends held Redis").
"""

from __future__ import annotations

from collections import Counter
from typing import Any

THRESHOLD_US = 1000
KEEP = 100_000  # entries kept (SLOWLOG's ring): far more than a bench's minutes produce


def start(client: Any, threshold_us: int = THRESHOLD_US) -> dict[str, str]:
    """Record every command over ``threshold_us`` from now; the settings it replaced."""
    old = {
        key: str(client.config_get(key)[key])
        for key in ("slowlog-log-slower-than", "slowlog-max-len")
    }
    client.config_set("slowlog-log-slower-than", threshold_us)
    client.config_set("slowlog-max-len", KEEP)
    client.slowlog_reset()
    return old


def collect(client: Any, old: dict[str, str]) -> list[dict[str, Any]]:
    """The commands recorded since :func:`start` (oldest first); the settings restored."""
    entries = client.slowlog_get(KEEP)
    for key, value in old.items():
        client.config_set(key, value)
    out = []
    for entry in reversed(entries):
        words = entry["command"]
        words = words.decode(errors="replace") if isinstance(words, bytes) else str(words)
        name, _, rest = words.partition(" ")
        if name.upper() == "EVALSHA":  # which script: its digest's first characters
            name = f"EVALSHA {rest[:8]}"
        out.append({"t": float(entry["start_time"]), "us": int(entry["duration"]), "cmd": name})
    return out


def summary(
    entries: list[dict[str, Any]], windows: list[tuple[float, float]]
) -> dict[str, dict[str, Any]]:
    """The entries inside ``windows`` (unix seconds; a second's slack each side, SLOWLOG's
    resolution) and outside them: how many, their total and longest in ms, the commands
    that took most of it."""

    def inside(t: float) -> bool:
        return any(a - 1.0 <= t <= b + 1.0 for a, b in windows)

    parts: dict[str, list[dict[str, Any]]] = {"during": [], "outside": []}
    for entry in entries:
        parts["during" if inside(entry["t"]) else "outside"].append(entry)
    out: dict[str, dict[str, Any]] = {}
    for name, part in parts.items():
        by: Counter[str] = Counter()
        for entry in part:
            by[entry["cmd"]] += entry["us"]
        out[name] = {
            "commands": len(part),
            "total_ms": round(sum(e["us"] for e in part) / 1e3, 1),
            "longest_ms": round(max((e["us"] for e in part), default=0) / 1e3, 1),
            "by_command_ms": {k: round(v / 1e3, 1) for k, v in by.most_common(5)},
        }
    return out
