"""What the commands write: stored strings made safe for a terminal, the one
``--json`` document, notes, sizes and times."""

from __future__ import annotations

import re
import time

import click

# What a terminal acts on instead of showing: C0 controls, DEL, C1 controls,
# line and paragraph separators, and the bidirectional marks and overrides
# that reorder what is shown.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e"
                          "\u2066-\u2069]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match) -> str:
    char = match.group()
    code = ord(char)
    return _ESCAPES.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def printable(value) -> str:
    """``value`` as text to print for a human: every character a terminal
    would act on (a newline, an escape sequence) written as an escape
    (``\\n``, ``\\x1b``, ``\\u2028``), so that a stored message, name or meta
    value cannot clear the screen, retitle the window or fake lines of
    output. Used wherever human output shows stored strings; ``--json``
    output needs no escaping beyond JSON's own."""
    return _UNPRINTABLE.sub(_escape, "-" if value is None else str(value))


def echo_notes(notes) -> None:
    """The library's notes on what it did (a slower path taken), on stderr."""
    for note in notes:
        click.echo(f"blockdiff: note: {note}", err=True)


def _json_value(value):
    """What json cannot write itself: numpy numbers (counts from arrays)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def emit_json(value) -> None:
    """The one way a command writes its --json output: one JSON document on
    stdout and nothing else there (notes and errors go to stderr). The shape
    of each command's document is in docs/cli.md."""
    import json

    click.echo(json.dumps(value, indent=2, default=_json_value))


def as_dicts(records) -> list[dict]:
    """The library's records (dataclasses) as dicts for a JSON document."""
    import dataclasses

    return [dataclasses.asdict(r) for r in records]


def emit_records(records) -> None:
    """A list of the library's records as one JSON array."""
    emit_json(as_dicts(records))


def human_size(n: int) -> str:
    """A byte count in binary units, e.g. '4.0 KiB' (the engine's wording;
    imported here, not at the top, because the engine package loads numpy)."""
    from blockdiff.engine.units import human_size as engine_human_size

    return engine_human_size(n)


def when(t: float | None, *, seconds: bool = True) -> str:
    """A time (seconds since the epoch) as local date and time, '-' for none."""
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M", time.localtime(t))
