"""pytest plugin: run fsm_cache's formal checks and lease accounting inside a test suite.

Installed with fsm_cache (a ``pytest11`` entry point), it adds:

* ``--fsm-audit``: audit mode for the whole run (``FSM_CACHE_AUDIT=1``), so
  every refusal names the call sites of the record's recent events;
* the ini option ``fsm_specs`` (spec paths, relative to the rootdir): each
  spec becomes two test items, ``fsm-verify[PATH]`` (the CrossHair
  contracts of ``fsm-cache verify``) and ``fsm-check[PATH]`` (the model
  checker of ``fsm-cache check``); ``fsm_check_nodes`` sets the tree size;
* the marker ``@pytest.mark.fsm_spec("path.toml")``: the marked test first
  model-checks that spec and fails on a violation;
* at the end of the run, a failure if any :class:`~fsm_cache.engine.Engine`
  still has leases (pins, locks) that were taken and never released
  (``fsm_leases = false`` turns that off).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fsm_cache.lease import open_leases


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register ``--fsm-audit`` and the ini options."""
    group = parser.getgroup("fsm_cache")
    group.addoption(
        "--fsm-audit",
        action="store_true",
        default=False,
        help="run fsm_cache engines in audit mode (FSM_CACHE_AUDIT=1)",
    )
    parser.addini("fsm_specs", "spec files to verify and model-check as tests", type="linelist")
    parser.addini("fsm_check_nodes", "tree size of the model checker (default 3)", default="3")
    parser.addini(
        "fsm_leases",
        "fail the run on leases never released (default true)",
        type="bool",
        default=True,
    )


def pytest_configure(config: pytest.Config) -> None:
    """Turn on audit mode if asked and register the marker."""
    config.addinivalue_line("markers", "fsm_spec(path): model-check this spec before the test")
    if config.getoption("--fsm-audit"):
        os.environ["FSM_CACHE_AUDIT"] = "1"


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Add a verify and a check item for every spec named by ``fsm_specs``."""
    for name in config.getini("fsm_specs"):
        path = (config.rootpath / name).resolve()
        for kind in ("verify", "check"):
            items.append(
                SpecItem.from_parent(session, name=f"fsm-{kind}[{name}]", path_=path, kind=kind)
            )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Model-check the spec of an ``fsm_spec`` marker before the test runs."""
    for marker in item.iter_markers("fsm_spec"):
        path = (item.config.rootpath / str(marker.args[0])).resolve()
        problem = _check(path, int(item.config.getini("fsm_check_nodes")))
        if problem:
            pytest.fail(problem, pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if an engine still holds leases nobody released."""
    if not session.config.getini("fsm_leases"):
        return
    leaked = open_leases()
    if not leaked:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"fsm_cache: {len(leaked)} lease(s) never released:"]
    lines += [f"  {lease!r}" for lease in leaked]
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True)
    if exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


class SpecItem(pytest.Item):
    """One formal check of one spec, run as a test."""

    def __init__(self, *, path_: Path, kind: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec_path = path_
        self.kind = kind

    def runtest(self) -> None:
        """Run verify or check; fail with the first finding."""
        runner: Callable[[Path], str] = _verify if self.kind == "verify" else self._check
        problem = runner(self.spec_path)
        if problem:
            raise SpecFinding(problem)

    def _check(self, path: Path) -> str:
        return _check(path, int(self.config.getini("fsm_check_nodes")))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        """Show the finding, not a traceback."""
        del style
        return str(excinfo.value)

    def reportinfo(self) -> tuple[Path, int, str]:
        """Name the spec file in reports."""
        return self.spec_path, 0, self.name


class SpecFinding(Exception):
    """A formal check found a problem in a spec."""


def _check(path: Path, nodes: int) -> str:
    from fsm_cache.check import check_spec
    from fsm_cache.explore import Bounds

    result = check_spec(path, nodes, Bounds({}))
    if result.violation is None:
        return ""
    return "\n".join([f"{path}: violation: {result.violation}", *result.trace])


def _verify(path: Path) -> str:
    from fsm_cache.verify import load_options, verify_spec

    with tempfile.TemporaryDirectory(prefix="fsm-verify-") as tmp:
        rows = verify_spec(path, load_options(path.parent), Path(tmp))
    bad = [f"{r.target}.{r.function}: {r.contract}: {r.verdict()}" for r in rows if r.failed]
    return "\n".join(bad)
