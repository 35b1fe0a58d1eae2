"""``fsm-cache validate SPEC...``: load and validate spec files, one line per finding.

Each valid file gets an ``ok:`` line on stdout summarising what it declares;
each problem of an invalid one gets an ``error: FILE: KEY: ...`` line on
stderr. Every file is checked even after a failure, so one run reports all of
them; the exit status is 2 if any file failed, 0 otherwise. A file named twice,
in any spelling (``d.toml ./d.toml``, ``fsm_cache:NAME`` and its path), is
validated once, as every command reads it once. Whatever a file
holds (binary garbage, another encoding, values nested thousands of levels
deep, wrong types anywhere) is such a line, never a traceback: the loader turns
every fault into a :class:`~fsm_cache.errors.SpecError`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fsm_cache.errors import SpecError
from fsm_cache.shell import named_once, one_line, spec_path
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import MachineSpec, Spec


def register(subparsers: Any) -> None:
    """Add the ``validate`` subcommand to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "validate",
        help="check spec files: names, determinism, totality, safety, reachability",
        description="Load and validate each SPEC file; exit 2 if any has a problem.",
    )
    parser.add_argument(
        "specs",
        nargs="+",
        type=spec_path,
        metavar="SPEC",
        help="a .toml spec file, or fsm_cache:NAME for a shipped spec",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Validate every file named in ``args.specs``, each once; return 2 if any failed, else 0."""
    status = 0
    for path in named_once(args.specs):
        try:
            spec = load_spec(path)
        except SpecError as exc:
            for problem in exc.problems:
                print(one_line(f"error: {problem}"), file=sys.stderr)
            status = 2
            continue
        print(one_line(f"ok: {path} ({summary(spec)})"))
    return status


def summary(spec: Spec) -> str:
    """Return ``machine NAME: N states, M transitions, K refusals`` or its composition form."""
    if isinstance(spec, MachineSpec):
        counts = _counts([spec], 0)
        return f"machine {spec.name}: {counts}"
    machines = [machine for _, machine in spec.regions]
    regions = ", ".join(region for region, _ in spec.regions)
    return f"composition {spec.name} of {regions}: {_counts(machines, len(spec.forbids))}"


def _counts(machines: list[MachineSpec], extra_refusals: int) -> str:
    states = sum(len(m.states) for m in machines)
    transitions = sum(len(m.transitions) for m in machines)
    refusals = extra_refusals + sum(len(m.forbids) for m in machines)
    return f"{states} states, {transitions} transitions, {refusals} refusals"
