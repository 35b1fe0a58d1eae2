"""Where the shipped specs live, in a checkout and in an installed wheel."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fsm_cache.errors import SpecError
from fsm_cache.spec.machine import MachineSpec, Spec, System


_PACKAGE = Path(__file__).resolve().parent.parent


def spec_dir() -> Path:
    """Return the folder holding the shipped ``*.toml`` specs.

    A wheel carries them inside the package (``fsm_cache/specs``); a checkout
    keeps them at the top level (``specs/``) beside the package.
    """
    inside = _PACKAGE / "specs"
    return inside if inside.is_dir() else _PACKAGE.parent / "specs"


def shipped_spec_paths() -> list[Path]:
    """Return every shipped spec file (negative controls excluded), sorted."""
    return sorted(spec_dir().glob("*.toml"))


SHIPPED = "fsm_cache:"
"""How a spec file names a shipped spec, in ``extends`` or a region: ``fsm_cache:residency``.

The name reads the copy the installed fsm_cache carries (:func:`spec_dir`),
wherever it is installed, so a spec can build on one without a path into
site-packages, which would hold only on the machine it was written on.
"""


def shipped_names() -> list[str]:
    """Return the names of the shipped specs (``residency``, ...), sorted."""
    return [path.stem for path in shipped_spec_paths()]


_SHOWN = 60
"""The characters of an unknown name a message quotes: the start the user wrote, then ``...``."""


def shipped_file(ref: str) -> Path | None:
    """Return the file ``ref`` names if it is a shipped spec's name (:data:`SHIPPED`), else None.

    The one rule for ``fsm_cache:NAME``, wherever a spec is named: in
    ``extends``, a composition's region, or a command's SPEC argument.

    Raises:
        SpecError: ``ref`` is ``fsm_cache:NAME`` and no shipped spec is
            ``NAME``; the one problem lists the names there are
            (``no shipped spec 'resid' (shipped: device_residency, ...)``).
    """
    if not ref.startswith(SHIPPED):
        return None
    name, names = ref[len(SHIPPED) :], shipped_names()
    if name not in names:
        known = ", ".join(names) or "none here"
        shown = repr(name) if len(name) <= _SHOWN else f"{name[:_SHOWN]!r}..."  # a file's string
        raise SpecError([f"no shipped spec {shown} (shipped: {known})"])
    return spec_dir() / f"{name}.toml"


@cache
def load_shipped(name: str) -> Spec:
    """Load and validate the shipped spec ``name`` (``residency``, ``host_residency``, ...).

    Raises:
        SpecError: The shipped spec is corrupt; each problem begins
            ``shipped spec NAME:``, since the user named no such file (the
            library loaded it for them).
    """
    from fsm_cache.spec.loader import load_spec

    try:
        return load_spec(spec_dir() / f"{name}.toml")
    except SpecError as exc:
        raise SpecError([f"shipped spec {name}: {problem}" for problem in exc.problems]) from exc


def residency_system() -> System:
    """Return the composed residency system of a tree node (host and device regions)."""
    spec = load_shipped("residency")
    assert isinstance(spec, System)
    return spec


def host_machine() -> MachineSpec:
    """Return the host residency machine on its own."""
    return residency_system().machines["host"]


def device_machine() -> MachineSpec:
    """Return the device residency machine on its own."""
    return residency_system().machines["device"]
