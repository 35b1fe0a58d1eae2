"""Optional dependencies stay optional: without an extra, its feature says which extra to install.

The hard dependencies are what the runtime imports (torch); rich (``cli``),
prometheus-client (``metrics``), transitions (``reference``) and CrossHair with
icontract (``verify``) come with extras. Each probe runs in a fresh interpreter
where the packages of the missing extras cannot be imported.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from fsm_cache.modelcheck import progress


OPTIONAL = ("rich", "prometheus_client", "transitions", "crosshair", "icontract")


def without(packages: tuple[str, ...], code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter in which ``packages`` cannot be imported."""
    block = "import sys\n" + "".join(f"sys.modules[{p!r}] = None\n" for p in packages)
    return subprocess.run(
        [sys.executable, "-c", block + code], capture_output=True, text=True, check=False
    )


def test_every_package_imports_without_the_extras() -> None:
    """The library's packages import with none of the optional dependencies installed."""
    code = (
        "import fsm_cache, fsm_cache.cache, fsm_cache.memory, fsm_cache.distributed, "
        "fsm_cache.testing, fsm_cache.bench, fsm_cache.cli, fsm_cache.spec, fsm_cache.engine, "
        "fsm_cache.modelcheck, fsm_cache.diagram, fsm_cache.audit, fsm_cache.compat, "
        "fsm_cache.cache.hicache, fsm_cache.cache.metrics"
    )
    done = without(OPTIONAL, code)
    assert done.returncode == 0, done.stderr


def test_cli_starts_without_rich() -> None:
    """``fsm-cache --help`` needs no extra: the commands import their extras when run."""
    done = without(OPTIONAL, "from fsm_cache.cli.main import main\nmain(['--help'])")
    assert done.returncode == 0, done.stderr
    assert "demo" in done.stdout


def test_demo_without_rich_names_the_extra() -> None:
    """``fsm-cache demo`` without rich says which extra to install, with no traceback."""
    done = without(
        ("rich",), "from fsm_cache.cli.main import main\nraise SystemExit(main(['demo']))"
    )
    assert done.returncode == 2
    assert done.stderr == (
        "error: fsm-cache demo draws with rich, which comes with the cli extra: "
        "pip install 'fsm-cache[cli]'\n"
    )


def test_engine_bench_without_transitions_names_the_extra() -> None:
    """``fsm-cache bench engine`` without transitions says to install the ``reference`` extra."""
    done = without(("transitions",), "import fsm_cache.bench.engine")
    assert done.returncode == 1
    assert "ModuleNotFoundError" in done.stderr
    assert "pip install 'fsm-cache[reference]'" in done.stderr


def test_metrics_without_prometheus_client_names_the_extra() -> None:
    """Registering a cache's metrics without prometheus-client says to install ``metrics``."""
    code = "from fsm_cache.cache.metrics import register\nregister(None)"
    done = without(("prometheus_client",), code)
    assert done.returncode == 1
    assert "pip install 'fsm-cache[metrics]'" in done.stderr


def test_progress_on_a_terminal_without_rich_prints_plain_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without rich a terminal gets the plain progress lines instead of a failure."""
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)
    with progress.progress(None, "host_residency") as tick:
        assert tick is not None
        tick(42)
    assert capsys.readouterr().err.startswith("host_residency: 42 states, ")
