"""YAML text with comments, for the generated files: a small block-style writer, checked by round trip.

PyYAML writes no comments, and the generated manifests and rules are read by people, so their
explanations must survive generation. Comments ride on the data: a mapping key written as
`Key("name", "why ...")` is a `str` (it compares and hashes as the plain key) that carries the
comment printed above it; in a list of mappings the comment of an item's first key goes above
its `- `. `Folded` strings are prose written as a `>-` block; strings with a newline are `|`
blocks; lists of scalars that fit go on one line. `dump_documents` loads what it wrote and
refuses to return text that does not load back to the same data, so a writer bug can never
reach a committed file.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

INDENT = 2
WIDTH = 100  # where prose (Folded) and comments wrap; PromQL and other scalars never wrap
FLOW_WIDTH = 100  # a list of scalars goes on one line when its line stays within this


class Key(str):
    """A mapping key with the comment written above it."""

    comment: str

    def __new__(cls, value: str, comment: str = "") -> Key:
        key = super().__new__(cls, value)
        key.comment = comment
        return key


class Folded(str):
    """Prose: written as a folded `>-` block, wrapped at WIDTH; loads back as one line."""


def comment_lines(text: str, indent: int) -> list[str]:
    """`text` as `#` lines at `indent`: paragraphs wrapped at WIDTH, lines starting with two spaces kept."""
    pad = " " * indent
    out: list[str] = []
    paragraph: list[str] = []

    def flush() -> None:
        # A paragraph is reflowed for its indentation, so the source may break its lines anywhere.
        if paragraph:
            wrapped = textwrap.wrap(" ".join(paragraph), WIDTH - indent - 2, break_long_words=False,
                                    break_on_hyphens=False)
            out.extend(pad + "# " + part for part in wrapped)
            paragraph.clear()

    for line in textwrap.dedent(text).strip("\n").splitlines():
        if not line.strip():
            flush()
            out.append(pad + "#")
        elif line.startswith("  "):  # preformatted (a command, a table row): kept as written
            flush()
            out.append(pad + "# " + line)
        else:
            paragraph.append(line.strip())
    flush()
    return out


def _plain_scalar(value: Any) -> str:
    """One scalar as PyYAML writes it on one line (quoted only where YAML needs it)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").removesuffix("...").rstrip("\n")


def _flow_item(value: Any) -> str:
    # Inside [..] a plain scalar may not hold `,` `[` `]` `{` `}`: strings are double-quoted
    # (JSON's escapes are YAML's) so every item is valid whatever it contains.
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else _plain_scalar(value)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _block_scalar(value: str, indent: int) -> list[str]:
    """A string as a `|` (has newlines) or `>-` (Folded) block, its lines at `indent`."""
    pad = " " * indent
    if isinstance(value, Folded):
        if value != " ".join(value.split()):
            raise ValueError(f"folded prose must be one line with single spaces: {value!r}")
        # Alertmanager templates ({{ $labels.x }}) stay whole on one line: spaces inside them are
        # held by a stand-in character while wrapping.
        held = re.sub(r"\{\{.*?\}\}", lambda m: m.group(0).replace(" ", "\x00"), value)
        wrapped = textwrap.wrap(held, WIDTH - indent, break_long_words=False, break_on_hyphens=False)
        return [">-"] + [pad + line.replace("\x00", " ") for line in wrapped]
    # Chomping: `|-` no final newline, `|` exactly one, `|+` keep them all.
    stripped = value.rstrip("\n")
    trailing = len(value) - len(stripped)
    header = {0: "|-", 1: "|"}.get(trailing, "|+")
    body = stripped.split("\n") + [""] * (trailing - 1 if trailing > 1 else 0)
    return [header] + [(pad + line) if line else "" for line in body]


def _value_lines(value: Any, indent: int) -> tuple[str, list[str]]:
    """(what follows `key:` on its line, the lines below it) for a mapping value at `indent`."""
    if isinstance(value, str) and ("\n" in value or isinstance(value, Folded)):
        first, *rest = _block_scalar(value, indent + INDENT)
        return " " + first, rest
    if _is_scalar(value):
        return " " + _plain_scalar(value), []
    if isinstance(value, Mapping):
        if not value:
            return " {}", []
        return "", _mapping(value, indent + INDENT)
    if isinstance(value, Sequence):
        if not value:
            return " []", []
        flow = _flow_list(value)
        if flow is not None and indent + len(flow) + 30 <= FLOW_WIDTH:
            return " " + flow, []
        # Sequences are indented under their key, as kubectl and most manifests write them.
        return "", _sequence(value, indent + INDENT)
    raise TypeError(f"cannot write {type(value).__name__} as YAML")


def _flow_list(value: Sequence[Any]) -> str | None:
    if all(_is_scalar(v) and not (isinstance(v, str) and "\n" in v) for v in value):
        return "[" + ", ".join(_flow_item(v) for v in value) + "]"
    return None


def _mapping(data: Mapping[Any, Any], indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    for key, value in data.items():
        if isinstance(key, Key) and key.comment:
            lines.extend(comment_lines(key.comment, indent))
        inline, below = _value_lines(value, indent)
        lines.append(f"{pad}{_plain_scalar(str(key))}:{inline}")
        lines.extend(below)
    return lines


def _sequence(items: Sequence[Any], indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    for item in items:
        if isinstance(item, Mapping) and item:
            first = next(iter(item))
            if isinstance(first, Key) and first.comment:
                lines.extend(comment_lines(first.comment, indent))
                item = {str(k) if k is first else k: v for k, v in item.items()}
            body = _mapping(item, indent + INDENT)
            lines.append(pad + "- " + body[0][indent + INDENT:])
            lines.extend(body[1:])
        elif isinstance(item, str) and ("\n" in item or isinstance(item, Folded)):
            first_line, *rest = _block_scalar(item, indent + INDENT)
            lines.append(pad + "- " + first_line)
            lines.extend(rest)
        elif _is_scalar(item):
            lines.append(pad + "- " + _plain_scalar(item))
        else:
            raise TypeError(f"cannot write a list item of type {type(item).__name__}")
    return lines


def plain(data: Any) -> Any:
    """`data` with Key, Folded and tuples turned into str and lists: what YAML loads back."""
    if isinstance(data, Mapping):
        return {str(k): plain(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [plain(v) for v in data]
    if isinstance(data, str):
        return str(data)
    return data


def dump_documents(documents: Sequence[Mapping[str, Any]], header: str = "",
                   document_comments: Sequence[str] | None = None) -> str:
    """The YAML text of `documents` (each after `---` and its comment), under a header comment."""
    lines = comment_lines(header, 0) if header else []
    for i, document in enumerate(documents):
        lines.append("---")
        if document_comments and document_comments[i]:
            lines.extend(comment_lines(document_comments[i], 0))
        lines.extend(_mapping(document, 0))
    text = "\n".join(lines) + "\n"
    loaded = [d for d in yaml.safe_load_all(text) if d is not None]
    if loaded != [plain(d) for d in documents]:
        raise AssertionError("the YAML writer produced text that does not load back to its data")
    return text


def dump_mapping(data: Mapping[str, Any], header: str = "") -> str:
    """The YAML text of one mapping (no `---`), under a header comment; checked by round trip."""
    lines = comment_lines(header, 0) if header else []
    if lines:
        lines.append("")
    lines.extend(_mapping(data, 0))
    text = "\n".join(lines) + "\n"
    if yaml.safe_load(text) != plain(data):
        raise AssertionError("the YAML writer produced text that does not load back to its data")
    return text
