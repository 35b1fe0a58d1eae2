"""fsm_cache.native: which modules run compiled, the switch to the sources, stale builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsm_cache import native


SUFFIX = ".cpython-311-x86_64-linux-gnu.so"
PROBE = (
    "import fsm_cache.cache.hicache as h; from fsm_cache import native; "
    "print(h.__file__.endswith('.py'), 'fsm_cache.cache.hicache' in native.compiled())"
)


def _probe(**env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != native.ENVIRONMENT} | env
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=environment, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_the_environment_variable_runs_the_sources() -> None:
    assert _probe(FSM_CACHE_PURE="1") == "True False"


@pytest.mark.parametrize("value", ["", "0"])
def test_an_empty_or_zero_variable_leaves_the_compiled_modules(value: str) -> None:
    compiled = any(Path(native.__file__).parent.rglob("hicache.*.so"))
    expected = "False True" if compiled else "True False"
    assert _probe(FSM_CACHE_PURE=value) == expected


def test_a_compiled_module_older_than_its_source_is_stale(tmp_path: Path) -> None:
    package = tmp_path / "fsm_cache"
    (package / "cache").mkdir(parents=True)
    for name, (source_time, built_time) in {"old": (200, 100), "new": (100, 200)}.items():
        source = package / "cache" / f"{name}.py"
        built = package / "cache" / f"{name}{SUFFIX}"
        source.write_text("")
        built.write_bytes(b"")
        os.utime(source, (source_time, source_time))
        os.utime(built, (built_time, built_time))
    (package / f"orphan{SUFFIX}").write_bytes(b"")  # no source beside it: nothing to compare
    assert native.stale(package) == (package / "cache" / f"old{SUFFIX}",)


def test_prefer_sources_installs_one_finder() -> None:
    before = list(sys.meta_path)
    try:
        native.prefer_sources()
        native.prefer_sources()
        added = [finder for finder in sys.meta_path if finder not in before]
        assert len(added) == (0 if native.wanted_pure() else 1)
    finally:
        sys.meta_path[:] = before


def test_built_names_each_module_with_a_build_beside_its_source(tmp_path: Path) -> None:
    package = tmp_path / "fsm_cache"
    (package / "cache").mkdir(parents=True)
    for path in ("cache/hicache.py", f"cache/hicache{SUFFIX}", "native.py", f"native{SUFFIX}"):
        (package / path).write_bytes(b"")
    (package / "cache" / "tree.py").write_text("")  # a source without a build
    (package / f"orphan{SUFFIX}").write_bytes(b"")  # a build without a source
    assert native.built(package) == ("fsm_cache.cache.hicache", "fsm_cache.native")


@pytest.mark.parametrize(
    ("ran", "available", "imported", "line"),
    [
        (
            ("fsm_cache.cache.core", "fsm_cache.cache.hicache"),
            (),
            False,
            "cache.core, cache.hicache",
        ),
        ((), (), False, "none (the sources ran; make compile)"),
        (
            (),
            ("fsm_cache.cache.hicache",),
            True,
            "none (the sources ran, as asked: FSM_CACHE_PURE or prefer_sources())",
        ),
        (
            (),
            ("fsm_cache.cache.hicache",),
            False,
            "none (this benchmark imports none of the compiled modules)",
        ),
    ],
)
def test_the_summary_says_what_ran_compiled_or_why_nothing_did(
    monkeypatch: pytest.MonkeyPatch,
    ran: tuple[str, ...],
    available: tuple[str, ...],
    imported: bool,
    line: str,
) -> None:
    monkeypatch.setattr(native, "compiled", lambda: ran)
    monkeypatch.setattr(native, "built", lambda: available)
    for name in available:
        if imported:
            monkeypatch.setitem(sys.modules, name, sys.modules[__name__])
        else:
            monkeypatch.delitem(sys.modules, name, raising=False)
    assert native.summary() == line
