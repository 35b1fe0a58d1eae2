"""Progress of a long check on stderr, so the report on stdout stays clean.

On a terminal a rich progress display; elsewhere (CI logs), when asked, a
plain line every :data:`PLAIN_EVERY` seconds. Without rich (it comes with the
``cli`` extra) a terminal gets the plain lines too.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.util import find_spec


PLAIN_EVERY = 5.0
"""Seconds between plain progress lines (progress on a non-terminal, as in CI logs)."""


@contextmanager
def progress(
    wanted: bool | None, name: str, *, plain: bool = False
) -> Iterator[Callable[[int], None] | None]:
    """Yield the callback that shows progress on stderr (None: show none).

    On a terminal a rich progress display; elsewhere (CI logs), with
    ``--progress``, a plain line every :data:`PLAIN_EVERY` seconds. A
    terminal without rich installed gets the plain lines, and so does a
    ``plain`` caller: searches running side by side (``check --jobs``), whose
    bars would draw over each other.
    """
    terminal = sys.stderr.isatty()
    if not (wanted if wanted is not None else terminal):
        yield None
    elif terminal and not plain and find_spec("rich") is not None:
        with _bar(name) as tick:
            yield tick
    else:
        yield _plain(name)


@contextmanager
def _bar(name: str) -> Iterator[Callable[[int], None]]:
    """Yield the callback of a rich progress display of ``name``'s states."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}: {task.completed} states"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(name, total=None)
        yield lambda n: bar.update(task, completed=n)


def _plain(name: str) -> Callable[[int], None]:
    """Return a callback printing a line of ``name``'s states every :data:`PLAIN_EVERY` seconds."""
    started = last = time.perf_counter()

    def tick(states: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last >= PLAIN_EVERY:
            last = now
            rate = states / (now - started)
            print(f"{name}: {states} states, {rate:.0f} states/s", file=sys.stderr, flush=True)

    return tick
