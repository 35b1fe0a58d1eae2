"""The wording of each finding; tests compare these messages verbatim.

Messages name the call, the resource as written (``nodes[*]`` for every
element of ``nodes``), and the other line involved, so a reader can follow
the path without rerunning the tool.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import NamedTuple

from fsm_cache.audit.events import Sink
from fsm_cache.audit.model import Pair
from fsm_cache.audit.state import ResourceKey


_ROOT = re.compile(r"[A-Za-z_]\w*")


class Rendered(NamedTuple):
    """One finding before it is placed in a function: site, code, message, resource."""

    line: int
    col: int
    code: str
    message: str
    key: ResourceKey


def root_of(key: ResourceKey) -> str:
    """Return the variable a resource text starts from (``nodes`` for ``nodes[*].parent``)."""
    match = _ROOT.match(key[1])
    return match.group(0) if match else ""


def render_events(sink: Sink, pairs: tuple[Pair, ...]) -> Iterator[Rendered]:
    """Yield the findings of one function's events.

    An acquire that leaks on a normal path is reported once, as FSM101; its
    exception-path leak (FSM104) is reported only when the normal paths are clean.
    """
    for (line, col, key), (exit_line, how) in sink.leaks.items():
        acquire = pairs[key[0]].acquire
        text = f"{acquire}() on '{key[1]}' is not released or handed on when the function"
        yield Rendered(line, col, "FSM101", f"{text} {how} at line {exit_line}", key)
    for (line, col, key), raise_line in sink.raises.items():
        if (line, col, key) not in sink.leaks:
            acquire = pairs[key[0]].acquire
            text = (
                f"{acquire}() on '{key[1]}' leaks if line {raise_line} raises;"
                " release it in try/finally or hold it with a lease"
            )
            yield Rendered(line, col, "FSM104", text, key)
    for (line, col, key), earlier in sink.doubles.items():
        release = pairs[key[0]].release
        again = (
            "it runs again on a later loop iteration"
            if earlier == line
            else f"already released at line {earlier}"
        )
        yield Rendered(
            line, col, "FSM102", f"{release}() on '{key[1]}' can run twice: {again}", key
        )
    for line, col, key in sorted(sink.unmatched - sink.doubles.keys()):
        rendered = _unmatched(line, col, key, sink, pairs[key[0]])
        if rendered is not None:
            yield rendered


def _unmatched(line: int, col: int, key: ResourceKey, sink: Sink, pair: Pair) -> Rendered | None:
    """Render a release that found nothing held on some path.

    It is FSM105 when it released an acquisition on another path, else FSM103:
    an acquire that only comes after the release is not in reach. A release of each element of a local container filled alongside the acquires
    is not reported when the container is empty: releasing nothing is harmless.
    """
    acquired = sink.first_acquire(key)
    if acquired is not None and key[1] in sink.aliases:
        return None
    if acquired is None or (line, col, key) not in sink.matched:
        text = f"{pair.release}() on '{key[1]}' has no {pair.acquire}() in reach"
        return Rendered(line, col, "FSM103", f"{text} and no documented hand-off", key)
    text = f"{pair.release}() on '{key[1]}' also runs on a path that skipped {pair.acquire}()"
    return Rendered(line, col, "FSM105", f"{text} at line {acquired[0]}", key)
