"""YAML text with comments, for the generated files: written by ruamel.yaml, checked by round trip.

PyYAML writes no comments, and the generated manifests and rules are read by people, so their
explanations must survive generation. Comments ride on the data: a mapping key written as
`Key("name", "why ...")` is a `str` (it compares and hashes as the plain key) that carries the
comment printed above it; in a list of mappings the comment of an item's first key goes above
its `- `. `Folded` strings are prose written as a `>-` block; strings with a newline are `|`
blocks; lists of scalars that fit go on one line. ruamel.yaml lays out the blocks; this module
wraps comments and prose (ruamel.yaml wraps neither) and spells scalars as PyYAML would, so that
YAML 1.1 readers (PyYAML, Kubernetes, Prometheus) read what was meant. `dump_documents` loads
what it wrote and refuses to return text that does not load back to the same data, so a writer
bug can never reach a committed file.
"""

from __future__ import annotations

import io
import json
import re
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import CommentMark
from ruamel.yaml.representer import RoundTripRepresenter
from ruamel.yaml.scalarstring import (
    DoubleQuotedScalarString,
    FoldedScalarString,
    LiteralScalarString,
    SingleQuotedScalarString,
)
from ruamel.yaml.tokens import CommentToken

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
    """`text` as `#` lines at `indent`: paragraphs wrapped at WIDTH, lines starting with two spaces kept,
    lines starting with `| ` kept without it (commented-out YAML at the key's own indentation)."""
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
        elif line.startswith("| "):  # commented-out YAML: deleting the `# ` leaves it at the key's indentation
            flush()
            out.append(pad + "# " + line[2:])
        elif line.startswith("  "):  # preformatted (a command, a table row): kept as written
            flush()
            out.append(pad + "# " + line)
        else:
            paragraph.append(line.strip())
    flush()
    return out


def _comment_tokens(text: str, indent: int) -> list[CommentToken]:
    # ruamel.yaml's yaml_set_comment_before_after_key writes an empty comment line as a blank line;
    # the paragraphs here are separated by a bare `#`, so the tokens are made as it makes them.
    return [CommentToken(line[indent:] + "\n", CommentMark(indent)) for line in comment_lines(text, indent)]


def _plain_scalar(value: Any) -> str:
    """One scalar as PyYAML writes it on one line (quoted only where YAML 1.1 needs it)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").removesuffix("...").rstrip("\n")


def _string(value: str) -> str:
    """A one-line string, quoted where PyYAML quotes it (`'yes'`, `'0660'`: YAML 1.1 would read a
    bool or an octal number); ruamel.yaml, which follows YAML 1.2, quotes the rest it must."""
    spelled = _plain_scalar(value)
    if spelled.startswith("'"):
        return SingleQuotedScalarString(value)
    if spelled.startswith('"'):
        return DoubleQuotedScalarString(value)
    return str(value)


def _folded(value: str, indent: int) -> FoldedScalarString:
    """Prose as a `>-` block at `indent`, folded where textwrap breaks its lines at WIDTH."""
    if value != " ".join(value.split()):
        raise ValueError(f"folded prose must be one line with single spaces: {value!r}")
    # Alertmanager templates ({{ $labels.x }}) stay whole on one line: spaces inside them are
    # held by a stand-in character while wrapping.
    held = re.sub(r"\{\{.*?\}\}", lambda m: m.group(0).replace(" ", "\x00"), value)
    lines = textwrap.wrap(held, WIDTH - indent, break_long_words=False, break_on_hyphens=False)
    folded = FoldedScalarString(value)
    folded.fold_pos = []
    position = 0
    for line in lines[:-1]:
        position += len(line)
        folded.fold_pos.append(position)  # the space at which a line ends
        position += 1
    return folded


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _flow_list(value: Sequence[Any], indent: int) -> CommentedSeq | None:
    """A list of one-line scalars as one `[..]` line when it fits, its strings double-quoted (JSON's
    escapes are YAML's) so that every item is valid whatever it holds; None otherwise."""
    if not all(_is_scalar(v) and not (isinstance(v, str) and "\n" in v) for v in value):
        return None
    text = "[" + ", ".join(json.dumps(v, ensure_ascii=False) if isinstance(v, str) else _plain_scalar(v) for v in value) + "]"
    if indent + len(text) + 30 > FLOW_WIDTH:
        return None
    flow = CommentedSeq(DoubleQuotedScalarString(v) if isinstance(v, str) else v for v in value)
    flow.fa.set_flow_style()
    return flow


def _node(value: Any, indent: int) -> Any:
    """`value` as ruamel.yaml's data, for a value whose key (or `- `) is at column `indent`."""
    if isinstance(value, Folded):
        return _folded(value, indent + INDENT)
    if isinstance(value, str):
        return LiteralScalarString(value) if "\n" in value else _string(value)
    if _is_scalar(value):
        return value
    if isinstance(value, Mapping):
        node = CommentedMap()
        for key, item in value.items():
            node[_string(str(key))] = _node(item, indent + INDENT)
            if isinstance(key, Key) and key.comment:
                node.ca.items.setdefault(str(key), [None, [], None, None])[1] = _comment_tokens(key.comment, indent + INDENT)
        return node
    if isinstance(value, Sequence):
        # Sequences are indented under their key, as kubectl and most manifests write them.
        return _flow_list(value, indent) or CommentedSeq(_item(item, indent + INDENT) for item in value)
    raise TypeError(f"cannot write {type(value).__name__} as YAML")


def _item(item: Any, indent: int) -> Any:
    """A list item at column `indent`; a mapping's first-key comment goes above its `- `."""
    if isinstance(item, Mapping) and item:
        first = next(iter(item))
        if isinstance(first, Key) and first.comment:
            node = _node({str(k) if k is first else k: v for k, v in item.items()}, indent)
            node.ca.comment = [None, _comment_tokens(first.comment, indent)]
            return node
    if isinstance(item, Mapping) or _is_scalar(item):
        return _node(item, indent)
    raise TypeError(f"cannot write a list item of type {type(item).__name__}")


class _Representer(RoundTripRepresenter):
    """ruamel.yaml's representer, with floats and None spelled as PyYAML spells them (`1.0e-05`,
    which YAML 1.1 reads as a float, and `null`); a subclass, so that no other user of it changes."""


_Representer.add_representer(float, lambda r, value: r.represent_scalar("tag:yaml.org,2002:float", _plain_scalar(value)))
_Representer.add_representer(type(None), lambda r, value: r.represent_scalar("tag:yaml.org,2002:null", "null"))


def _text(data: Mapping[str, Any]) -> str:
    writer = YAML()
    writer.Representer = _Representer
    writer.indent(mapping=INDENT, sequence=2 * INDENT, offset=INDENT)
    writer.width = 1 << 30  # nothing wraps but comments and Folded prose, which come wrapped
    writer.allow_unicode = True
    out = io.StringIO()
    writer.dump(_node(data, -INDENT), out)
    return out.getvalue()


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
        lines.append(_text(document).removesuffix("\n"))
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
    lines.append(_text(data).removesuffix("\n"))
    text = "\n".join(lines) + "\n"
    if yaml.safe_load(text) != plain(data):
        raise AssertionError("the YAML writer produced text that does not load back to its data")
    return text
