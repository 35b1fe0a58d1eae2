"""pytest plugin: run fsm_cache's formal checks and leak accounting inside a test suite.

Installed with fsm_cache (a ``pytest11`` entry point), it adds:

* ``--fsm-trail``: trail mode for the whole run (``FSM_CACHE_TRAIL=1``, set
  before the initial conftests are imported, so their engines have it too), so
  every refusal names the call sites of the record's recent events
  (``--fsm-audit`` is its deprecated spelling and warns);
* ``--fsm-sglang``: the installed SGLang's radix caches run checked for the
  whole run (:func:`fsm_cache.compat.sglang.patch`, undone at the end), so an
  SGLang test suite finds residency misuse where it happens;
* the ini option ``fsm_specs`` (spec paths, relative to the rootdir, separated
  by spaces or line breaks and quoted like shell words, as ``testpaths``): each
  spec is collected as a file of two items, ``PATH::fsm-verify`` (the CrossHair
  contracts of ``fsm-cache verify``) and ``PATH::fsm-check`` (``fsm-cache
  check PATH --nodes N``'s own run, its ceilings and policy: a ``not
  explored`` line of its report is a :class:`SpecUnexplored` warning), by a
  run without arguments or one whose arguments name the spec or a directory
  above it (``docs/verify.md``); ``fsm_check_nodes`` sets the tree size;
* the marker ``@pytest.mark.fsm_spec("path.toml")``: before the marked test
  runs, the spec is model-checked and verified (``check=False`` or
  ``verify=False`` skips one), and the test errors on any finding; each spec
  is checked and verified once a run however many tests name it (again once a
  file it is read from changes: a composition's region files too);
* at the end of the run (after every fixture is torn down), a failure on
  leases still held, leases collected while held (``fsm_leases = false``
  turns both off) and live records still holding a counter a state carries,
  pins or locks taken with or without a lease (``fsm_holds = false``).
  ``@pytest.mark.fsm_allow_leaks`` excuses the leases a test drops on purpose:
  those taken since its setup began (its own, its function-scoped
  fixtures'), not those of a module or session fixture torn down after it.
  Recording is turned on as each phase of a test (setup, call, teardown)
  starts, and what the test dropped is taken out of the process-wide log at
  the end of its teardown into the run's own list, so a test that forgets
  entries or turns recording off hides no other's, nor what the fixtures
  torn down after it drop (reported as collected during "the teardown of"
  that test).
  Under pytest-xdist each worker accounts for the tests it ran and hands its
  report to the controller, which prints them all and fails the run.
"""

from __future__ import annotations

import gc
import os
import tempfile
import warnings
from collections.abc import Callable, Generator
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from fsm_cache.engine.lease import (
    Dropped,
    dropped_leases,
    forget_dropped,
    lease_mark,
    open_leases,
    record_dropped,
)
from fsm_cache.engine.trail import ENV_FLAG
from fsm_cache.errors import FsmCacheError


class Found(NamedTuple):
    """What a formal check of a spec found: the test's failure, and what it left unexplored."""

    problem: str
    """The failure's text, ``""`` if none."""
    unexplored: tuple[str, ...] = ()
    """``fsm-cache check``'s ``not explored`` lines: a passing check warns them
    (:class:`SpecUnexplored`); a failing one ends ``problem`` with them."""

    def warn(self, path: Path) -> None:
        """Warn what a passing check of the spec at ``path`` left unexplored, as the command says it.

        The warning is the spec's, not this module's: pytest's summary names
        the spec's file where it would name the line that warned.
        """
        if self.unexplored and not self.problem:
            warnings.warn_explicit("\n".join(self.unexplored), SpecUnexplored, str(path), 0)


class SpecUnexplored(UserWarning):
    """A model check passed under ceilings below where a comparison of the spec turns.

    What that comparison guards was never explored: ``fsm-cache check``'s
    report says so without failing, and so does this warning (``-W
    error::fsm_cache.pytest_plugin.SpecUnexplored`` fails the test on it).
    """


_RECORDING = pytest.StashKey[bool]()
"""Whether dropped leases were recorded before this run turned recording on."""
_TAKEN = pytest.StashKey[list[tuple[Dropped, str | None]]]()
"""The leases this run saw dropped while held, each with what it was collected during.

Taken out of the process-wide log (:func:`dropped_leases`) at the end of each
test's teardown (:class:`_Phases`), and kept here, so that a test that
forgets entries of the log or turns recording off cannot hide what other
tests, or fixtures torn down after it, dropped. What it was collected during:
a test's node id (its setup or call), ``the teardown of`` one, or None outside
any test (during collection, between tests, or after the last one).
"""
_START = pytest.StashKey[int]()
"""A test's :func:`lease_mark` as its setup began: the leases it took itself are above it."""
_SGLANG = pytest.StashKey[Any]()
"""The patch ``--fsm-sglang`` applied to the installed SGLang."""
_REPORT = pytest.StashKey[list[str]]()
"""The lines of the leak report, printed in the terminal summary."""
_UNREACHED = pytest.StashKey[list[str]]()
"""The ``fsm_specs`` entries the run's arguments did not reach, as the ini names them."""
_DEFAULT_NODES = "3"
"""``fsm_check_nodes`` when the ini does not set it."""
_WORKERS = pytest.StashKey[list[str]]()
"""The leak reports pytest-xdist workers handed the controller, in the order they finished."""
_HANDED = "fsm_cache_leaks"
"""The key of a worker's leak report in pytest-xdist's ``workeroutput``."""
_FOUND = pytest.StashKey[dict[tuple[object, ...], Found]]()
"""What each ``fsm_spec`` marker's check and verify found, by spec and its files (:func:`_once`)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register ``--fsm-trail`` (and ``--fsm-audit``), ``--fsm-sglang`` and the ini options."""
    group = parser.getgroup("fsm_cache")
    group.addoption(
        "--fsm-trail",
        action="store_true",
        default=False,
        help="run fsm_cache engines in trail mode (FSM_CACHE_TRAIL=1)",
    )
    group.addoption(
        "--fsm-audit",
        action="store_true",
        default=False,
        help="deprecated spelling of --fsm-trail",
    )
    group.addoption(
        "--fsm-sglang",
        action="store_true",
        default=False,
        help="check the residency of the installed SGLang's radix caches (fsm_cache.compat.sglang)",
    )
    parser.addini(
        "fsm_specs",
        "spec files to verify and model-check as tests (separated by spaces or lines)",
        type="args",
    )
    nodes = "tree size of the model checker (default 3)"
    if pytest.version_tuple >= (9, 2):  # type expressions: a TOML table's `= 2` is an int
        parser.addini("fsm_check_nodes", nodes, type=int | str, default=_DEFAULT_NODES)
    else:  # pytest 9.0 and 9.1 refuse an int in a [tool.pytest] table: quote it there
        parser.addini("fsm_check_nodes", nodes, default=_DEFAULT_NODES)
    for name, (flag, what) in _BOUNDS.items():
        said = f"ceiling of {what} in fsm-check, as fsm-cache check {flag} (default the command's)"
        if pytest.version_tuple >= (9, 2):
            parser.addini(name, said, type=int | str, default="")
        else:
            parser.addini(name, said, default="")
    parser.addini(
        "fsm_leases",
        "fail the run on leases never released or dropped while held (default true)",
        type="bool",
        default=True,
    )
    parser.addini(
        "fsm_holds",
        "fail the run on live records still holding pins or locks (default true)",
        type="bool",
        default=True,
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Turn on trail mode if asked, before the initial conftests are imported.

    An engine's trail mode is fixed when it is built: one a conftest builds
    as it is imported, before :func:`pytest_configure`, kept it off.
    """
    options = early_config.known_args_namespace
    _trail_if_asked(bool(options.fsm_trail or options.fsm_audit))


def _trail_if_asked(asked: bool) -> None:
    """Turn on trail mode for the process (``FSM_CACHE_TRAIL=1``) if ``asked``."""
    if asked:
        os.environ[ENV_FLAG] = "1"


def check_nodes(config: pytest.Config) -> int:
    """Return the ``fsm_check_nodes`` ini option: the model checker's tree size.

    Checked when the run starts, so a bad value stops it before anything runs
    instead of failing every ``fsm-check`` item. A TOML table's
    ``fsm_check_nodes = 2`` is an int, an ini file's a str: both are read.

    Raises:
        pytest.UsageError: It is not a whole number >= 1 (0 nodes would check
            nothing), or it is more than ``fsm-cache check`` takes.
    """
    value = str(config.getini("fsm_check_nodes")).strip()
    if not value.isdecimal() or int(value) < 1:
        raise pytest.UsageError(f"fsm_check_nodes must be a whole number >= 1, got {value!r}")
    nodes = int(value)
    if value != _DEFAULT_NODES:  # the checker's import costs pytest's start ~0.7 s: only if set
        from fsm_cache.modelcheck.check import MAX_NODES, TOO_MANY_NODES

        if nodes > MAX_NODES:
            raise pytest.UsageError(
                f"fsm_check_nodes must be at most {MAX_NODES}, got {nodes} ({TOO_MANY_NODES})"
            )
    return nodes


_BOUNDS = {
    "fsm_check_max_pins": ("--max-pins", "counters named pins"),
    "fsm_check_max_locks": ("--max-locks", "counters named locks"),
    "fsm_check_max_count": ("--max-count", "any other counter"),
}
"""The ini options that set ``fsm-check``'s ceilings, with the option of ``fsm-cache check`` each is."""


def check_bounds(config: pytest.Config) -> dict[str, int]:
    """Return the ceilings the ini sets for ``fsm-check``, by ``fsm-cache check`` option.

    What a ``not explored`` warning names (``--max-count 4 reaches it``)
    set as ``fsm_check_max_count = 4``. Each applies to the specs that have
    such a counter and is left out for the others, so one setting serves a
    project's specs.

    Raises:
        pytest.UsageError: A value is not a whole number >= 0, or is more
            than ``fsm-cache check`` takes.
    """
    found: dict[str, int] = {}
    for name, (flag, _) in _BOUNDS.items():
        value = str(config.getini(name)).strip()
        if not value:
            continue
        if not value.isdecimal():
            raise pytest.UsageError(f"{name} must be a whole number >= 0, got {value!r}")
        from fsm_cache.modelcheck.check import MAX_BOUND, TOO_HIGH_A_BOUND  # set: worth its import

        if int(value) > MAX_BOUND:
            raise pytest.UsageError(
                f"{name} must be at most {MAX_BOUND}, got {value} ({TOO_HIGH_A_BOUND})"
            )
        found[flag] = int(value)
    return found


def switched(config: pytest.Config, name: str) -> bool:
    """Return the bool ini option ``name`` (``fsm_leases``, ``fsm_holds``).

    Raises:
        pytest.UsageError: Its value is no bool (the message names the option).
    """
    try:
        return bool(config.getini(name))
    except pytest.UsageError as exc:
        raise pytest.UsageError(f"{name} must be true or false: {exc}") from None


def pytest_configure(config: pytest.Config) -> None:
    """Check the ini options, register the markers, turn on trail mode and record dropped leases.

    Every ini option is read here, so a bad value stops the run before any
    test runs rather than after all of them.

    Raises:
        pytest.UsageError: ``fsm_check_nodes`` is not a whole number >= 1,
            or ``fsm_leases`` or ``fsm_holds`` is no bool.
    """
    check_nodes(config)
    check_bounds(config)
    for switch in ("fsm_leases", "fsm_holds"):  # read only at the end of the run otherwise
        switched(config, switch)
    config.addinivalue_line(
        "markers",
        "fsm_spec(path, verify=True, check=True): verify and model-check this spec before the test",
    )
    config.addinivalue_line(
        "markers", "fsm_allow_leaks: leases this test drops while held are not reported"
    )
    if config.getoption("--fsm-audit"):
        config.issue_config_time_warning(
            DeprecationWarning("--fsm-audit is deprecated; pass --fsm-trail instead"), stacklevel=2
        )
    # again here: a plugin registered late (a conftest's pytest_plugins) missed the early hook
    _trail_if_asked(bool(config.getoption("--fsm-trail") or config.getoption("--fsm-audit")))
    if switched(config, "fsm_leases"):
        config.stash[_RECORDING] = record_dropped(True)
        config.stash[_TAKEN] = []
        config.pluginmanager.register(_Phases(config.stash[_TAKEN]), "fsm_cache-phases")
    if config.getoption("--fsm-sglang"):
        from fsm_cache.compat.sglang import patch

        try:
            config.stash[_SGLANG] = patch()
        except FsmCacheError as exc:
            raise pytest.UsageError(f"--fsm-sglang: {exc}") from None


def pytest_unconfigure(config: pytest.Config) -> None:
    """Put recording of dropped leases back as it was, and SGLang as it was installed."""
    if _RECORDING in config.stash:
        record_dropped(config.stash[_RECORDING])
    if _SGLANG in config.stash:
        config.stash[_SGLANG].undo()


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> SpecFile | None:
    """Collect a spec named by ``fsm_specs`` where it is itself an argument of the run.

    ``pytest specs/a.toml`` or ``pytest specs/a.toml::fsm-check`` reaches the file by
    pytest's own walk, which needs a collector for it; every other spec is added by
    :func:`pytest_make_collect_report`, so none is collected twice.
    """
    session = parent.session
    if session.isinitpath(file_path) and file_path in _specs(session.config):
        return SpecFile.from_parent(parent, path=file_path)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """Add the specs the run selects after the rest of the session's collectors.

    A spec is selected when the run is the whole session (no arguments, started
    from the rootdir) or an argument is a directory above it; one that is itself an
    argument is collected by :func:`pytest_collect_file` instead.
    """
    report = yield
    if isinstance(collector, pytest.Session) and report.passed:
        unreached = collector.config.stash[_UNREACHED] = []
        for path, name in _specs(collector.config).items():
            if _selected(collector, path):
                # named as fsm_specs names it, which is its node id outside the rootdir
                report.result.append(SpecFile.from_parent(collector, path=path, name=name))
            elif not collector.isinitpath(path):  # else pytest's walk collects it
                unreached.append(name)
    return report


def pytest_report_collectionfinish(config: pytest.Config) -> str | None:
    """Say which ``fsm_specs`` this run leaves out, so a CI that names paths sees it."""
    unreached = config.stash.get(_UNREACHED, [])
    if not unreached:
        return None
    return (
        f"fsm_specs not collected (no argument reaches them): {', '.join(unreached)}; "
        "run pytest without arguments, or name them, to check them"
    )


def _specs(config: pytest.Config) -> dict[Path, str]:
    """Return the specs named by ``fsm_specs``: each one's absolute path, and its name there.

    Paths are made absolute without resolving links, as pytest makes its arguments,
    so that a spec compares equal to the same file given on the command line.
    """
    found: dict[Path, str] = {}
    for name in config.getini("fsm_specs"):
        found.setdefault(Path(os.path.abspath(config.rootpath / name)), name)
    return found


def _selected(session: pytest.Session, path: Path) -> bool:
    """Whether the spec at ``path`` is collected at session level (see ``docs/verify.md``)."""
    if session.isinitpath(path):
        return False  # pytest's walk collects it: pytest_collect_file
    config = session.config
    whole = (
        config.args_source is not pytest.Config.ArgsSource.ARGS
        and config.invocation_params.dir == config.rootpath
    )
    return whole or any(session.isinitpath(x) for x in path.parents)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Model-check and verify the spec of each ``fsm_spec`` marker before the test runs."""
    for marker in item.iter_markers("fsm_spec"):
        unknown = sorted(set(marker.kwargs) - {"verify", "check"})
        if len(marker.args) != 1 or unknown:
            pytest.fail(
                f"fsm_spec takes one spec path, verify= and check=: {marker}", pytrace=False
            )
        path = (item.config.rootpath / str(marker.args[0])).resolve()
        known = item.config.stash.setdefault(_FOUND, {})
        found = []
        if marker.kwargs.get("check", True):
            nodes, bounds = check_nodes(item.config), check_bounds(item.config)
            what = ("check", nodes, *sorted(bounds.items()))
            found.append(_once(known, path, what, partial(_check, path, nodes, bounds)))
        if marker.kwargs.get("verify", True):
            found.append(_once(known, path, ("verify",), partial(_verify, path)))
        problems = [x.problem for x in found if x.problem]
        if problems:  # a spec that does not load fails both the same way: say it once
            pytest.fail("\n".join(dict.fromkeys(problems)), pytrace=False)
        for x in found:
            x.warn(path)


class _Phases:
    """Takes the leases each test dropped while held into the run's own list (or forgets them).

    A plugin of its own (registered when ``fsm_leases`` is on), as its hooks
    wrap each phase of a test: module- and session-scoped fixtures are torn
    down in the teardown of whichever test ends their scope, so what that
    test does (turn recording off, be marked ``fsm_allow_leaks``) must not
    reach what they drop. Each phase starts with recording on; the test's
    entries stay in the process-wide log until its teardown ends, so that
    its own fixtures may still forget what it dropped.
    """

    def __init__(self, taken: list[tuple[Dropped, str | None]]) -> None:
        self.taken = taken

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        """Start the test with recording on and the log empty, and mark its first lease.

        What was dropped since the last test is taken first, so a test that
        forgets the whole log (``forget_dropped(dropped_leases())``) forgets
        only what it dropped itself.
        """
        record_dropped(True)
        _take(self.taken, dropped_leases(), None)
        item.stash[_START] = lease_mark()
        return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self) -> Generator[None, None, None]:
        """Run the test with recording on (its setup may have turned it off)."""
        record_dropped(True)
        try:
            return (yield)
        finally:
            if open_leases():
                gc.collect()  # a held lease only a cycle keeps is dropped now, in its test

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        """Tear the fixtures down with recording on, then take the test's entries out of the log.

        What was dropped before the teardown is the test's; what was dropped
        during it is "the teardown of" the test's, whatever the fixture's
        scope. ``fsm_allow_leaks`` excuses only the leases taken since the
        test's setup began (its own and its function-scoped fixtures'), not
        those of a wider fixture it was handed and whose teardown it ends.
        """
        record_dropped(True)
        before = dropped_leases()  # kept alive, so that no lease dropped meanwhile reuses an id
        try:
            return (yield)
        finally:
            if open_leases():
                gc.collect()
            new = dropped_leases()
            forget_dropped(new)
            if item.get_closest_marker("fsm_allow_leaks") is not None:
                start = item.stash.get(_START, None)
                new = [x for x in new if start is None or x.order < start]
            known = {id(x) for x in before}
            during = {True: item.nodeid, False: f"the teardown of {item.nodeid}"}
            self.taken.extend((x, during[id(x) in known]) for x in new)


def _take(taken: list[tuple[Dropped, str | None]], new: list[Dropped], test: str | None) -> None:
    """Move ``new`` out of the process-wide log into ``taken``, as collected during ``test``."""
    forget_dropped(new)
    taken.extend((x, test) for x in new)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After fixture teardown, fail the run if it leaked leases or left records held.

    A pytest-xdist worker's exit status and terminal summary never reach the
    user, so a worker hands its report to the controller instead
    (:func:`pytest_testnodedown`), which fails the run on it.
    """
    config = session.config
    handed: dict[str, object] | None = getattr(config, "workeroutput", None)
    if handed is not None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "a worker")
        handed[_HANDED] = _leaks(config, f" (on {worker})")
        return
    lines = config.stash[_REPORT] = _leaks(config) + config.stash.get(_WORKERS, [])
    if lines and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any) -> None:
    """Keep the leak report a pytest-xdist worker handed over as it finished."""
    output: dict[str, object] = getattr(node, "workeroutput", None) or {}
    lines = output.get(_HANDED)
    if isinstance(lines, list):
        node.config.stash.setdefault(_WORKERS, []).extend(str(line) for line in lines)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print what the run leaked, if anything, in a section of its own."""
    lines = terminalreporter.config.stash.get(_REPORT, [])
    if lines:
        terminalreporter.write_sep("=", "fsm_cache leaks", red=True)
        for line in lines:
            terminalreporter.write_line(line)


def _leaks(config: pytest.Config, where: str = "") -> list[str]:
    """Return the report of what the run leaked, one heading per kind; [] if nothing.

    Args:
        config: The run's config.
        where: What each heading adds to say where it was found (a worker).
    """
    sections: list[tuple[str, list[str]]] = []
    if switched(config, "fsm_leases"):
        record_dropped(True)  # the last test may have turned it off
        gc.collect()  # a held lease only a reference cycle keeps is dropped, not open
        taken = config.stash.get(_TAKEN, [])
        _take(taken, dropped_leases(), None)  # dropped after the last test's teardown
        sections.append(("lease(s) never released", [repr(x) for x in open_leases()]))
        dropped = [_dropped(x, test) for x, test in taken]
        sections.append(("lease(s) dropped while held", dropped))
    if switched(config, "fsm_holds"):
        from fsm_cache.engine.holds import held_records  # late: pytest starts without the engine

        sections.append(("record(s) still held", [str(x) for x in held_records()]))
    lines = []
    for heading, found in sections:
        if found:
            lines += [f"fsm_cache: {len(found)} {heading}{where}:", *(f"  {x}" for x in found)]
    return lines


def _dropped(lease: Dropped, test: str | None) -> str:
    return f"{lease} (collected during {test})" if test else str(lease)


class SpecFile(pytest.File):
    """A spec named by ``fsm_specs``: its two formal checks are its items."""

    def collect(self) -> list[SpecItem]:
        """Return the verify item, then the check item; a missing file fails both when run."""
        return [SpecItem.from_parent(self, name=f"fsm-{x}", kind=x) for x in ("verify", "check")]


class SpecItem(pytest.Item):
    """One formal check of one spec, run as a test."""

    def __init__(self, *, kind: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kind = kind

    def runtest(self) -> None:
        """Run verify or check; fail with the first finding, else warn what went unexplored."""
        runner: Callable[[Path], Found] = _verify if self.kind == "verify" else self._check
        found = runner(self.path)
        if found.problem:
            raise SpecFinding(found.problem)
        found.warn(self.path)

    def _check(self, path: Path) -> Found:
        return _check(path, check_nodes(self.config), check_bounds(self.config))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        """Show the finding, not a traceback."""
        del style
        return str(excinfo.value)

    def reportinfo(self) -> tuple[Path, int, str]:
        """Head a failure with the item's name and the spec's, as ``fsm_specs`` names it."""
        return self.path, 0, f"{self.name}[{_specs(self.config).get(self.path, self.path)}]"


class SpecFinding(Exception):
    """A formal check found a problem in a spec."""


def _once(
    known: dict[tuple[object, ...], Found],
    path: Path,
    what: tuple[object, ...],
    run: Callable[[], Found],
) -> Found:
    """Return what ``run()`` found of ``what`` at ``path``, running it once a run.

    The key holds every file the spec is read from (the spec, what it
    extends, its regions' files: an edited region changes the composition)
    with its inode, size, and modification and change times (a copy that
    keeps the old modification time, ``cp -p``, still changes the change
    time), so a spec is checked again once any of them changes; one whose
    files cannot all be read is never remembered.
    """
    from fsm_cache.spec.loader import spec_files  # late: pytest starts without the loader

    try:
        stamps = tuple(_stamp(file) for file in spec_files(path))
    except OSError:
        return run()
    key = (path, *what, stamps)
    if key not in known:
        known[key] = run()
    return known[key]


def _stamp(file: Path) -> tuple[str, int, int, int, int]:
    """Return what says ``file`` is unchanged: its real path, inode, size and two times.

    Raises:
        OSError: The file cannot be read.
    """
    info = file.stat()
    return (os.path.realpath(file), info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _check(path: Path, nodes: int, bounds: dict[str, int]) -> Found:
    """Return what ``fsm-cache check PATH --nodes NODES`` finds: a violation and its trace, or none.

    The command's own run (:func:`~fsm_cache.modelcheck.check.as_command`):
    the same ceilings (those ``bounds`` sets: :func:`check_bounds`) and
    policy, and its ``not explored`` lines.
    """
    from fsm_cache.modelcheck.check import as_command, left_out

    try:
        entry = as_command(path, nodes, bounds)
    except FsmCacheError as exc:  # the spec does not load: its message names the file
        return Found(str(exc))
    unexplored = tuple(left_out(entry))
    if entry["violation"] is not None:
        problem = [f"{path}: violation: {entry['violation']}", *entry["trace"]]
    elif entry["stopped"] is not None:
        stopped = f"check stopped after {entry['states']} states, not exhaustive"
        problem = [f"{path}: {stopped}: {entry['stopped']}"]
    else:
        return Found("", unexplored)
    return Found("\n".join([*problem, *(f"{path}: {line}" for line in unexplored)]), unexplored)


def _verify(path: Path) -> Found:
    """Return one line per contract not proved (``fsm-cache verify``'s failing rows), if any."""
    from fsm_cache.contracts.verify import budget_note, options_for, verify_spec

    try:
        with tempfile.TemporaryDirectory(prefix="fsm-verify-") as tmp:
            rows = verify_spec(path, options_for(path), Path(tmp))
    except FsmCacheError as exc:
        return Found(str(exc))
    bad = [
        f"{path}: {r.target}.{r.function}: {r.contract}: {r.verdict()}" for r in rows if r.failed
    ]
    return Found("\n".join([*bad, *budget_note(rows)]))
