"""What a `kvstore` command gives back to its caller: lines on stdout (tables for people, one JSON
object per line for scripts), one-line errors on stderr, and an exit status.

Shared by the CLI (`kvstore.cli`) and the pipeline's commands (`kvstore.pipeline.commands`), so that
neither has to import the other for it; standard library only, because the base install prints
with it too.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

# Exit statuses, the same for every command (the CLI's docstring and docs/cli.md say which error
# gets which): a script tells "nothing happened" (1, 4) from "may have happened" (3) by the status.
EXIT_OK = 0
EXIT_ERROR = 1  # a definite failure: the store refused, or did nothing
EXIT_USAGE = 2  # invalid arguments, or a request the server refused as invalid
EXIT_UNKNOWN = 3  # a write's outcome is unknown: retry with the request id it names
EXIT_UNREACHABLE = 4  # no attempt reached any node: nothing was sent, nothing happened
EXIT_INTERRUPTED = 130


class Printer:
    """Writes a command's results in the chosen format. Every line is flushed at once: a watch or
    a long job is read through a pipe while it runs."""

    def __init__(self, output: str, out: TextIO) -> None:
        self.json = output == "json"
        self.out = out

    def line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def record(self, record: dict[str, Any]) -> None:
        # Compact and unescaped: one object per line whatever the keys hold, readable as UTF-8.
        self.line(json.dumps(record, ensure_ascii=False, separators=(",", ":")))


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Columns as wide as their widest cell, so that a table reads without a terminal library."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def bytes_field(name: str, data: bytes) -> dict[str, Any]:
    """JSON for bytes: the UTF-8 text when it decodes, else base64 plus a `<name>_base64` flag
    (keys and values are any bytes; JSON strings are text)."""
    try:
        return {name: data.decode("utf-8")}
    except UnicodeDecodeError:
        return {name: base64.b64encode(data).decode("ascii"), f"{name}_base64": True}


def display(data: bytes | None) -> str:
    """Bytes for a table cell: text when printable, escapes otherwise, so that one cell stays one
    line and a control character cannot rewrite the terminal."""
    if data is None:
        return ""
    text = data.decode("utf-8", "surrogateescape")
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if "\udc80" <= ch <= "\udcff":  # a byte that is not UTF-8
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1])  # \n, \x00, \u200b
    return "".join(out)


def one_line(text: str) -> str:
    """An error message as one line: stderr gets one line per error, never a traceback."""
    return " ".join(text.split())
