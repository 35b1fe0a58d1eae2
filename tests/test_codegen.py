"""Generated code keeps its source: linecache, unique filenames, one set of runtime helpers."""

from __future__ import annotations

import _thread
import dataclasses
import gc
import inspect
import linecache
import traceback
import uuid
from pathlib import Path
from typing import Any

import pytest

from fsm_cache.contracts.generate import generate
from fsm_cache.engine import codegen, runtime, trail
from fsm_cache.engine.codegen import Compiled, Refusal, compile_system
from fsm_cache.engine.core import Engine
from fsm_cache.errors import IllegalTransition, NoHostCopy
from fsm_cache.spec.loader import spec_from_dict
from fsm_cache.spec.machine import as_system
from fsm_cache.spec.shipped import residency_system


GATE = {
    "machine": {"name": "gate", "initial": "shut"},
    "states": {"shut": {}, "open": {}},
    "transition": [
        {"event": "open", "source": "shut", "dest": "open"},
        {"event": "close", "source": "open", "dest": "shut"},
    ],
    "forbid": [
        {"event": "open", "source": "open", "error": "GateJammed", "reason": "already open"},
        {"event": "close", "source": "shut", "error": "GateJammed", "reason": "already shut"},
    ],
}
FIRE_OPEN = """\
def _fire_open(rec):
    s_state = rec.state
    if s_state == 'shut':
        rec.state = 'open'
        return
    elif s_state == 'open':
        _refuse(rec, 4)
    else:
        _refuse(rec, 5)
"""


def gate() -> Engine:
    return Engine(spec_from_dict(GATE), trail=False)


def number(filename: str, system: str) -> int:
    """Return N of ``<fsm_cache SYSTEM engine N>``, failing on any other shape."""
    prefix, suffix = f"<fsm_cache {system} engine ", ">"
    assert filename.startswith(prefix)
    assert filename.endswith(suffix)
    return int(filename[len(prefix) : -len(suffix)])


def refused(engine: Engine, rec: Any, event: str) -> IllegalTransition:
    with pytest.raises(IllegalTransition) as info:
        engine.fire(rec, event)
    return info.value


def test_a_refusal_traceback_shows_the_generated_line() -> None:
    engine = gate()
    rec = engine.new(1)
    engine.fire(rec, "open")
    text = "".join(traceback.format_exception(refused(engine, rec, "open")))
    assert f'  File "{engine.filename}", line 31, in _fire_open\n    _refuse(rec, 4)\n' in text


def test_a_refusal_on_the_plan_path_shows_the_generated_step_line() -> None:
    engine = Engine(residency_system(), trail=False)
    with pytest.raises(NoHostCopy) as info:  # the plan path: what model checkers ask
        engine.plan(engine.new(17), "evict_host")
    text = "".join(traceback.format_exception(info.value))
    lines = engine.source.splitlines()
    start = lines.index("def _step_evict_host(rec):")
    # The step's first refusal is the one for `unbacked`: no host copy to evict.
    number = next(i for i in range(start, len(lines)) if "_refuse(rec, " in lines[i]) + 1
    line = lines[number - 1].strip()
    assert f'  File "{engine.filename}", line {number}, in _step_evict_host\n    {line}\n' in text


def test_an_effectful_refusal_shows_its_generated_fire_line() -> None:
    engine = Engine(residency_system(), trail=False)
    exc = refused(engine, engine.new(17), "evict_host")  # has an effect: its own fast path
    assert isinstance(exc, NoHostCopy)
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-2]  # the generated line that called _refuse
    assert last.filename == engine.filename
    assert last.name == "_fire_evict_host"
    assert last.lineno is not None
    assert engine.source.splitlines()[last.lineno - 1].strip().startswith("_refuse(rec, ")


def test_two_engines_of_one_system_have_their_own_filenames() -> None:
    first, second = gate(), gate()
    assert first.filename != second.filename
    assert second.filename == f"<fsm_cache gate engine {number(first.filename, 'gate') + 1}>"
    rec = second.new(2)
    second.fire(rec, "open")
    text = "".join(traceback.format_exception(refused(second, rec, "open")))
    assert f'  File "{second.filename}", line 31, in _fire_open\n' in text
    assert first.filename not in text


def test_a_second_engine_of_one_system_reuses_the_compiled_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Generating and compiling the module was most of building a cache; once per system now."""
    first = gate()
    compiled: list[str] = []
    real = compile

    def counted(source: str, filename: str, mode: str) -> Any:
        compiled.append(filename)
        return real(source, filename, mode)

    monkeypatch.setattr(codegen, "compile", counted, raising=False)  # its global, not the builtin
    second = gate()
    assert compiled == []
    assert second.source == first.source
    assert second.filename != first.filename
    rec = second.new(2)
    second.fire(rec, "open")
    text = "".join(traceback.format_exception(refused(second, rec, "open")))
    assert f'  File "{second.filename}", line 31, in _fire_open\n' in text
    assert inspect.getsourcefile(second.verb("open")) == second.filename
    other = {**GATE, "machine": {"name": f"gate_{uuid.uuid4().hex}", "initial": "shut"}}
    Engine(spec_from_dict(other), trail=False)  # a system no engine had: generated and compiled
    assert compiled == ["<fsm_cache engine>"]


def test_the_source_survives_checkcache() -> None:
    engine = gate()
    linecache.checkcache()
    linecache.checkcache(engine.filename)
    assert linecache.getline(engine.filename, 31) == "        _refuse(rec, 4)\n"
    lines = engine.source.splitlines(keepends=True)  # no mtime: checkcache has no file to stat
    assert linecache.cache[engine.filename] == (len(engine.source), None, lines, engine.filename)


def test_inspect_finds_the_source_of_a_verb() -> None:
    engine = gate()
    assert inspect.getsource(engine.verb("open")) == FIRE_OPEN


def test_the_source_is_forgotten_with_the_last_function() -> None:
    engine = gate()
    filename, verb = engine.filename, engine.verb("open")
    del engine
    gc.collect()
    assert filename in linecache.cache
    assert trail.is_internal(filename)
    del verb
    gc.collect()
    assert filename not in linecache.cache
    assert not trail.is_internal(filename)


def test_the_compiler_returns_its_pieces() -> None:
    system = as_system(spec_from_dict(GATE))
    seen: list[tuple[Refusal, ...]] = []

    def refuser(refusals: Any) -> Any:
        seen.append(tuple(refusals))

        def refuse(rec: Any, index: int) -> None:
            raise LookupError(refusals[index].reason)

        return refuse

    compiled = compile_system(system, refuser)
    assert isinstance(compiled, Compiled)
    assert dataclasses.is_dataclass(compiled)
    with pytest.raises(dataclasses.FrozenInstanceError):
        compiled.source = ""  # type: ignore[misc]
    assert seen == [compiled.refusals]
    assert compiled.refusals[4] == Refusal("state", "open", "GateJammed", "already open")
    assert (list(compiled.steps), list(compiled.verbs)) == (["open", "close"], ["open", "close"])
    assert FIRE_OPEN in compiled.source
    rec = Engine(system, trail=False).new(1)
    assert compiled.steps["open"](rec) == ((("state", "open"),), [], False)
    assert rec.state == "shut"
    compiled.verbs["open"](rec)
    assert rec.state == "open"
    with pytest.raises(LookupError, match=r"^already open$"):
        compiled.verbs["open"](rec)


def test_trail_mode_compiles_a_copy_of_each_fast_event_that_notes_its_caller() -> None:
    system = as_system(spec_from_dict(GATE))

    def refuser(refusals: Any) -> Any:
        def refuse(rec: Any, index: int) -> None:
            raise LookupError(refusals[index].reason)

        return refuse

    assert dict(compile_system(system, refuser).direct) == {}
    compiled = compile_system(system, refuser, trail=True)
    assert list(compiled.direct) == list(compiled.verbs) == ["open", "close"]
    assert compiled.direct["open"].__name__ == "_direct_open"
    # Called from dispatch code, the copy names it; the walking verb names its caller.
    helper: dict[str, Any] = {}
    exec(compile("def dispatch(verb, rec):\n    verb(rec)\n", "<dispatch>", "exec"), helper)
    rec = Engine(system, trail=False).new(1)
    trail.internal("<dispatch>")
    try:
        helper["dispatch"](compiled.direct["open"], rec)
        line = inspect.stack()[0].lineno + 1
        helper["dispatch"](compiled.verbs["close"], rec)
    finally:
        trail.forget("<dispatch>")
    assert rec.state == "shut"
    assert trail.sites(rec.trail) == (
        ("open", trail.Site("<dispatch>", 2, "dispatch")),
        ("close", trail.Site(__file__, line, inspect.stack()[0].function)),
    )


def test_trail_mode_keeps_an_event_named_like_another_events_caller_copy_apart() -> None:
    """``open_at_caller`` once took the name of ``open``'s copy that notes its caller, and ran it."""
    spec = {
        "machine": {"name": "gate", "initial": "shut"},
        "states": {"shut": {}, "open": {}},
        "transition": [
            {"event": "open", "source": "shut", "dest": "open"},
            {"event": "open_at_caller", "source": "open", "dest": "shut"},
        ],
        "forbid": [
            {"event": "open", "source": "open", "error": "GateJammed", "reason": "already open"},
            {"event": "open_at_caller", "source": "shut", "error": "GateJammed", "reason": "shut"},
        ],
    }
    engine = Engine(spec_from_dict(spec), trail=True)
    rec = engine.new(1)
    assert str(refused(engine, rec, "open_at_caller")).startswith(
        "instance 1: open_at_caller refused in shut: shut"
    )
    assert rec.state == "shut"
    engine.fire(rec, "open")
    engine.fire(rec, "open_at_caller")
    assert rec.state == "shut"


def test_a_walking_verb_with_only_dispatch_frames_below_names_the_outermost() -> None:
    """A thread started on dispatch code: the walk stops at the thread's first frame."""
    engine = Engine(spec_from_dict(GATE), trail=True)
    rec = engine.new(1)
    helper: dict[str, Any] = {}
    source = (
        "def dispatch(engine, rec, done, box):\n"
        "    try:\n"
        "        engine.fire(rec, 'open')\n"
        "    except BaseException as exc:\n"
        "        box.append(exc)\n"
        "    finally:\n"
        "        done.release()\n"
    )
    exec(compile(source, "<dispatch>", "exec"), helper)
    done, box = _thread.allocate_lock(), list[BaseException]()
    done.acquire()
    trail.internal("<dispatch>")
    try:
        _thread.start_new_thread(helper["dispatch"], (engine, rec, done, box))
        assert done.acquire(timeout=30)
    finally:
        trail.forget("<dispatch>")
    assert box == []
    assert rec.state == "open"
    assert trail.sites(rec.trail) == (("open", trail.Site("<dispatch>", 3, "dispatch")),)


def test_the_contract_harness_imports_the_engines_helpers(tmp_path: Path) -> None:
    module = generate(residency_system(), tmp_path / "residency.toml")
    assert (
        "from fsm_cache.engine.runtime import child_in as _child_in, effect_failed as _effect_failed\n"
        "from fsm_cache.engine.runtime import parent_in as _parent_in\n"
    ) in module.source
    assert "def _parent_in" not in module.source
    assert "def _effect_failed" not in module.source
    assert "def _child_in" not in module.source
    assert "    if _parent_in(rec, 'device', ('absent',)):\n" in module.source


def test_the_tree_helpers() -> None:
    class Rec:
        def __init__(self, state: str, parent: Any = None, children: Any = ()) -> None:
            self.state, self.parent, self.children = state, parent, children

    root = Rec("a")
    assert runtime.parent_in(Rec("b", root), "state", ("a",)) is True
    assert runtime.parent_in(root, "state", ("a",)) is False
    assert runtime.parent_in(object(), "state", ("a",)) is False
    assert runtime.child_in(Rec("a", children=[Rec("b")]), "state", ("b",)) is True
    assert runtime.child_in(Rec("a", children={1: Rec("c")}), "state", ("b",)) is False
    assert runtime.child_in(object(), "state", ("b",)) is False
