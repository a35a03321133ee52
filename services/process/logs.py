"""Logging, configured once by an entry point, never at import.

Only the ``services`` logger tree gets a handler (the root logger is left alone, so an
embedding application keeps its own logging).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_ROOT = "services"
_STD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys()) | {
    "message",
    "asctime",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any ``extra=`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


def configure_logging(fmt: str = "text", level: str = "INFO", service: str = "") -> None:
    """Attach one stderr handler to the ``services`` logger tree (idempotent)."""
    logger = logging.getLogger(_ROOT)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        prefix = f"{service} " if service else ""
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s")
        )
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
