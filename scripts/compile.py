"""Compile the cache's hot modules with mypyc, in place, beside their sources.

Usage (from the repository root): ``python scripts/compile.py [--force | --clean]``.
``make compile`` runs it; ``make test`` and ``make bench`` depend on that.

The modules are listed under ``[tool.fsm-cache.mypyc]`` in pyproject.toml. Each
becomes an extension module (``hicache.cpython-311-*.so``) that Python imports in
place of the ``.py`` beside it, and one shared library at the repository root,
``fsm_cache__mypyc*.so``, holds their code. The sources stay the reference: a
plain ``pip install`` gets them, and ``FSM_CACHE_PURE=1`` runs them in a tree
that has both (:mod:`fsm_cache.native`). A compiled module older than its
source is stale, and the test suite refuses to run on one.

Without options it builds only when something changed: a listed module newer
than its compiled one or without one, or a compiled module no longer listed.
``--force`` builds anyway; ``--clean`` removes every compiled module.
"""

from __future__ import annotations

import fcntl
import importlib.machinery
import os
import sys
from pathlib import Path


if sys.version_info >= (3, 11):
    import tomllib
else:  # the project's dependency on 3.10
    import tomli as tomllib


ROOT = Path(__file__).resolve().parent.parent
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # ".cpython-311-x86_64-linux-gnu.so"


THIRD_PARTY_AS_ANY = [
    "--no-site-packages",
    "--ignore-missing-imports",
    "--no-warn-return-any",
    "--no-warn-unused-ignores",
    "--allow-subclassing-any",
    "--allow-untyped-calls",
]
"""mypy options of the build: installed packages are read as Any, fsm_cache's own code typed.

mypyc needs the types of the code it compiles and of fsm_cache's classes it
calls; a torch tensor is a Python object to it either way, reached through
the C API. Following torch's imports made the build type-check about 1,700
torch modules: 70 of its 100 seconds, before the C compiler started, on the
critical path of ``make test``. The options after the first two keep
``strict``'s warnings about Any (pyproject's mypy settings) from failing the
build; ``make typecheck`` checks the code against the real packages.
"""


def modules() -> list[Path]:
    """The source files to compile, as pyproject.toml lists them."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        listed: list[str] = tomllib.load(f)["tool"]["fsm-cache"]["mypyc"]["modules"]
    return [ROOT / name for name in listed]


def built() -> list[Path]:
    """Every compiled file a build leaves in the tree."""
    found = sorted((ROOT / "fsm_cache").rglob("*.so"))
    return found + sorted(ROOT.glob("fsm_cache__mypyc*.so"))


def up_to_date(sources: list[Path]) -> bool:
    """Whether every listed module has a compiled one at least as new, and nothing else does."""
    wanted = {source.with_suffix(SUFFIX) for source in sources}
    present = {path for path in built() if path.parent != ROOT}
    if wanted != present or not list(ROOT.glob(f"fsm_cache__mypyc{SUFFIX}")):
        return False
    from fsm_cache import native  # the rule the test suite refuses a stale tree by

    return not native.stale(ROOT / "fsm_cache")


def main(argv: list[str]) -> int:
    """Build, or clean with ``--clean``, one run at a time; return the exit status."""
    if argv not in ([], ["--force"], ["--clean"]):
        print(f"usage: {sys.argv[0]} [--force | --clean]", file=sys.stderr)
        return 2
    (ROOT / "build").mkdir(exist_ok=True)
    with (ROOT / "build" / "mypyc.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second run waits, then finds the modules built
        return _build(argv)


def _build(argv: list[str]) -> int:
    sources = modules()
    if not argv and up_to_date(sources):
        print("compiled modules up to date")
        return 0
    for path in built():
        path.unlink()
    if argv == ["--clean"]:
        return 0
    from mypyc.build import mypycify  # the `compile` extra: mypy ships mypyc
    from setuptools import setup  # type: ignore[import-untyped]

    os.chdir(ROOT)  # mypyc names the modules by their paths from here
    names = [str(source.relative_to(ROOT)) for source in sources]
    print(f"compiling with mypyc: {', '.join(names)}")
    setup(
        name="fsm-cache-compiled",
        packages=[],
        py_modules=[],
        ext_modules=mypycify([*THIRD_PARTY_AS_ANY, *names], opt_level="3", group_name="fsm_cache"),
        script_args=["-q", "build_ext", "--inplace", "--build-temp", "build/mypyc"],
    )
    for path in built():  # setuptools keeps an unchanged module's old file, and its time
        path.touch()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
