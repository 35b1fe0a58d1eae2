"""Findings as text (one per line, like a linter), JSON, or SARIF 2.1.0.

SARIF is what code-scanning services ingest (GitHub's ``upload-sarif``); paths
are written relative to the working directory so annotations land on the
right files of the checkout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path, PurePath
from typing import Any
from urllib.parse import quote

from fsm_cache.audit.model import RULES, RULES_BY_CODE, VERSION, Finding


REPORT_FORMATS = ("text", "json", "sarif")
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def render_report(findings: Sequence[Finding], fmt: str) -> str:
    """Return the report in ``fmt`` (one of :data:`REPORT_FORMATS`), ending with a newline if non-empty."""
    if fmt == "json":
        return to_json(findings)
    if fmt == "sarif":
        return to_sarif(findings)
    return "".join(f"{line}\n" for line in to_text(findings))


def to_text(findings: Sequence[Finding]) -> list[str]:
    """Return one ``path:line:col: CODE message [function]`` line per finding."""
    return [
        f"{f.path}:{f.line}:{f.col}: {f.code} {f.message}"
        + (f" [{f.function}]" if f.function else "")
        for f in findings
    ]


def to_json(findings: Sequence[Finding]) -> str:
    """Return ``{"version": ..., "findings": [...]}`` with one object per finding."""
    items = [
        {
            "path": f.path,
            "line": f.line,
            "column": f.col,
            "code": f.code,
            "message": f.message,
            "function": f.function,
        }
        for f in findings
    ]
    return json.dumps({"version": VERSION, "findings": items}, indent=2) + "\n"


def to_sarif(findings: Sequence[Finding]) -> str:
    """Return a SARIF 2.1.0 log with one run, every rule, and one result per finding."""
    index = {rule.code: position for position, rule in enumerate(RULES)}
    run = {
        "tool": {"driver": _driver()},
        "columnKind": "unicodeCodePoints",
        "originalUriBaseIds": {"%SRCROOT%": {"uri": Path.cwd().as_uri() + "/"}},
        "results": [_result(f, index[f.code]) for f in findings],
    }
    log = {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}
    return json.dumps(log, indent=2) + "\n"


def _driver() -> dict[str, Any]:
    rules = [
        {
            "id": rule.code,
            "name": rule.name,
            "shortDescription": {"text": rule.summary},
            "help": {"text": f"See docs/audit.md, section {rule.code}."},
            "defaultConfiguration": {"level": rule.level},
        }
        for rule in RULES
    ]
    return {
        "name": "fsm-cache-audit",
        "version": VERSION,
        "rules": rules,
    }


def _result(finding: Finding, rule_index: int) -> dict[str, Any]:
    uri = _uri(finding.path)
    artifact = {"uri": uri} if uri.startswith("file:") else {"uri": uri, "uriBaseId": "%SRCROOT%"}
    location: dict[str, Any] = {
        "physicalLocation": {
            "artifactLocation": artifact,
            "region": {"startLine": finding.line, "startColumn": finding.col},
        }
    }
    if finding.function:
        location["logicalLocations"] = [
            {"fullyQualifiedName": finding.function, "kind": "function"}
        ]
    return {
        "ruleId": finding.code,
        "ruleIndex": rule_index,
        "level": RULES_BY_CODE[finding.code].level,
        "message": {"text": finding.message},
        "locations": [location],
    }


def _uri(path: str) -> str:
    """Return ``path`` as a URI relative to the working directory, else an absolute ``file:`` URI.

    Only a relative URI is resolved against ``%SRCROOT%``.
    """
    absolute = Path(os.path.abspath(path))
    try:
        return quote(PurePath(absolute.relative_to(Path.cwd())).as_posix())
    except ValueError:
        return absolute.as_uri()
