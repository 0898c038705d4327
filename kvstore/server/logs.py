"""A node's log: one JSON object per line by default (`--log-format json`), for the collectors
a deployment reads them with, or plain lines for a person at a terminal (`text`).

Fields passed with `extra=` (an event name, an address, a shard) become the object's own keys,
so that a log line is queried by field rather than parsed from its message.
"""

from __future__ import annotations

import json
import logging
import sys


class JsonFormatter(logging.Formatter):
    """Structured logs: one JSON object per line."""

    _standard = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        entry.update({k: v for k, v in record.__dict__.items() if k not in self._standard})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


LEVELS = ("debug", "info", "warning", "error")


def configure(log_format: str, level: str = "info") -> None:
    """Send the process's logs to stderr as `log_format` ("json" or "text") says, from `level` up
    (debug shows every retry, redirect and placement step; warning only what needs a look)."""
    assert level in LEVELS, f"log level {level!r} is not one of {LEVELS}"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
