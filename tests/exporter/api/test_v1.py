"""The status document's model (exporter.api.v1): the committed schema is what it generates, and the
page's script reads none of its fields (it swaps in the server's rendering)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

from exporter.api import v1

REPO = Path(__file__).resolve().parents[3]
SCHEMA = REPO / v1.SCHEMA_PATH
SCRIPT = REPO / "exporter" / "sidecar" / "http" / "static" / "status.js"
# What status.js reads: the language's and the DOM's own members, none of the document's.
JS_MEMBERS = {"body", "concat", "dataset", "from", "id", "location", "message", "ok", "pathname", "refreshes", "status",
              "text", "toggle"}  # Array.from, an element's id, response.text()


def schema_properties(node: Any) -> set[str]:
    """Every property name the schema defines, anywhere."""
    found: set[str] = set()
    if isinstance(node, dict):
        found.update(node.get("properties", {}))
        for value in node.values():
            found |= schema_properties(value)
    elif isinstance(node, list):
        for value in node:
            found |= schema_properties(value)
    return found


def script_fields(source: str) -> set[str]:
    """The snake_case members status.js reads (`doc.sidecar`, `r.tp_rank`, `{ pp_rank: pp }`), comments and
    quoted strings left out (template literals stay: their `${...}` read the document)."""
    code = re.sub(r"(^|\s)//.*$", "", source, flags=re.MULTILINE)
    code = re.sub(r'"[^"\n]*"', '""', code)
    members = set(re.findall(r"(?<=[\w)\]])\.([A-Za-z_][A-Za-z0-9_]*)", code))  # not a spread (`...build`)
    for pattern in re.findall(r"const \{([^}]*)\}", code):  # destructuring: `const { pp_rank: pp, ... } of rows`
        members.update(name.split(":")[0].strip() for name in pattern.split(","))
    return {name for name in members if re.fullmatch(r"[a-z][a-z0-9_]*", name)}


def test_the_committed_schema_is_what_the_model_generates() -> None:
    assert SCHEMA.read_text(encoding="utf-8") == v1.schema_text(), (
        f"{v1.SCHEMA_PATH} is stale: run `{v1.WRITE_COMMAND}` and commit it")


def test_the_check_command_names_the_fix(tmp_path: Path) -> None:
    stale = tmp_path / "v1.schema.json"
    stale.write_text("{}\n")
    said = subprocess.run([sys.executable, "-m", "exporter.api.v1", "--check", str(stale)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert said.returncode == 1 and v1.WRITE_COMMAND in said.stderr
    written = subprocess.run([sys.executable, "-m", "exporter.api.v1", "--write-schema", str(stale)], timeout=60, cwd=REPO)
    assert written.returncode == 0 and stale.read_text() == v1.schema_text()


def test_status_js_reads_no_field_of_the_document() -> None:
    """The script only swaps in the sections page.py rendered: it reads no field of the document, so the
    model cannot drift from it (it once rebuilt every section from /api/v1/status; then this test checked
    that every field it read was the schema's)."""
    source = SCRIPT.read_text(encoding="utf-8")
    assert "api/v1/status" not in source and "json()" not in source
    fields = script_fields(source) - JS_MEMBERS
    assert not fields & schema_properties(json.loads(SCHEMA.read_text(encoding="utf-8"))), fields


def test_the_script_check_catches_a_document_field() -> None:
    """The extraction the test above relies on finds a document field the script would read."""
    read = SCRIPT.read_text(encoding="utf-8") + "\nconst since = r.seconds_since_push;\n"
    assert "seconds_since_push" in script_fields(read) & schema_properties(v1.json_schema())


def test_top_reads_past_fields_it_does_not_know_and_the_schema_refuses_them() -> None:
    decoded = msgspec.json.decode(b'{"pp_rank": 1, "attn_cp_rank": 0, "later": true}', type=v1.GridRow)
    assert decoded == v1.GridRow(pp_rank=1, attn_cp_rank=0)
    assert v1.json_schema()["$defs"]["grid_row"]["additionalProperties"] is False
