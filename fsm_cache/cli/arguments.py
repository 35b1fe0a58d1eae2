"""The SPEC argument of the CLI's commands: a spec file's path, or ``fsm_cache:NAME``."""

from __future__ import annotations

from fsm_cache.shell import path_text
from fsm_cache.spec.shipped import spec_argument


def spec_path(text: str) -> str:
    """Return a SPEC argument as the path of the spec file it names (an argparse ``type``).

    Refused as any path to read when empty or ``-``
    (:func:`~fsm_cache.shell.path_text`); ``fsm_cache:NAME`` is the shipped
    spec's file (:func:`~fsm_cache.spec.shipped.spec_argument`). Any other
    path is kept as it was given, as text: a :class:`~pathlib.Path` drops a
    leading ``./``, and a spec file named ``-`` was then named ``-`` in
    what the command said, the name that means stdin.

    Raises:
        argparse.ArgumentTypeError: ``text`` is empty or ``-``, or names no
            shipped spec; argparse reports it and exits 2.
    """
    return spec_argument(path_text(text))
