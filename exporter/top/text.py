"""What `top` puts on screen from the document, as text: `literal` for what is shown as written (control
characters escaped, so a label cannot move the cursor, retitle the window or recolour the terminal), and
`count`, `integer`, `duration`, `size` for numbers, which refuse anything that is not a finite number in
range (exporter.top.render's accessors; no value of the document reaches a `Text` but through these)."""

from __future__ import annotations

from collections.abc import Mapping

from rich.text import Text


def literal(value: object, style: str = "") -> Text:
    """`value` as plain text: no markup, control characters shown as escapes (\\x1b), never sent to the terminal."""
    text = str(value)
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return Text(text, style=style)


def labels_text(labels: Mapping[str, str]) -> Text:
    """`name=value, ...` with every name and value literal."""
    out = Text()
    for i, (name, value) in enumerate(labels.items()):
        if i:
            out.append(", ")
        out.append_text(literal(name))
        out.append("=")
        out.append_text(literal(value))
    return out


LARGEST = 1e24  # past any real count, byte total or duration; its digits still fit on a line


class Unshowable(ValueError):
    """A document value that cannot be shown where the schema puts a number: wrong type, not finite, out of range."""


def number(value: object) -> float:
    """`value` if it is a finite number within ±LARGEST (not a bool); else Unshowable, quoting it escaped."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Unshowable(f"{glimpse(value)} where a number belongs")
    if not -LARGEST <= value <= LARGEST:  # an int compares exactly, NaN compares False: both land here
        raise Unshowable(f"{glimpse(value)} is out of range")
    return value


def integer(value: object) -> int:
    """`value` if it is an integer within ±LARGEST (a rank, a size); else Unshowable."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise Unshowable(f"{glimpse(value)} where an integer belongs")
    number(value)
    return value


def shows_as_number(value: object) -> bool:
    """Whether `number(value)` would take it."""
    try:
        number(value)
    except Unshowable:
        return False
    return True


def glimpse(value: object) -> str:
    """A short, escaped quotation of a value for a one-line complaint."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > LARGEST:
        return f"an integer of {len(str(abs(value)))} digits"
    text = literal(repr(value)).plain
    return text if len(text) <= 40 else text[:37] + "..."


def count(value: object) -> str:
    """12,080; a fraction keeps two places."""
    shown = number(value)
    return f"{shown:,}" if isinstance(shown, int) else f"{int(shown):,}" if shown.is_integer() else f"{shown:,.2f}"


def size(value: object) -> str:
    """Bytes in binary units: 118.0 MiB."""
    shown = number(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(shown) < 1024 or unit == "TiB":
            return f"{shown:.0f} B" if unit == "B" else f"{shown:.1f} {unit}"
        shown /= 1024
    raise AssertionError("unreachable")


def speed(bytes_per_second: object) -> str:
    """An active bandwidth, or `idle` when the window saw no transfer."""
    return "idle" if bytes_per_second is None else size(bytes_per_second) + "/s"


def duration(value: object) -> str:
    """45s, 3m12s, 2h05m, 1d02h."""
    seconds = number(value)
    whole = int(seconds)
    if seconds < 10 and not float(seconds).is_integer():
        return f"{seconds:.1f}s"
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"
