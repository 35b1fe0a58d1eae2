"""Errors cross process boundaries whole: ``check --jobs`` workers, tensor-parallel ranks."""

from __future__ import annotations

import pickle

import pytest

from fsm_cache.errors import (
    BadArgument,
    ConfigError,
    FsmCacheError,
    IllegalTransition,
    PoolExhausted,
    ReleaseAtZero,
    SpecError,
    StoreFailed,
    error_class,
)


@pytest.mark.parametrize(
    "error",
    [
        SpecError(["a.toml: machine.states: missing", "a.toml: transition[0]: bad"]),
        ConfigError("check: --max-states must be >= 1, got 0"),
        BadArgument("check: nodes must be an int >= 1, got 0"),
        PoolExhausted("host", 3, 1),
        StoreFailed("redis", "put", acknowledged=1, total=3, cause="gone"),
        IllegalTransition(
            label="node",
            instance=7,
            state="backed",
            counters={"pins": 0},
            event="release",
            reason="no pin outstanding",
        ),
        ReleaseAtZero(
            label="node",
            instance=1,
            state="resident",
            counters={"pins": 0},
            event="release",
            reason="no pin",
        ),
    ],
    ids=lambda error: type(error).__name__,
)
def test_an_error_unpickles_as_the_same_class_message_and_attributes(
    error: FsmCacheError,
) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert back.args == error.args
    assert vars(back) == vars(error)


def test_a_refusal_of_a_class_a_spec_named_unpickles_as_that_class() -> None:
    """Such a class is made at run time: pickling it by reference raised ``PicklingError``."""
    made = error_class("GateJammedWhilePickled")
    error = made(
        label="gate",
        instance=3,
        state="shut",
        counters={"turns": 1},
        event="open",
        reason="jammed",
        others={"bolt": "locked"},
    )
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is made
    assert str(back) == "gate 3: open refused in shut (turns=1, bolt locked): jammed"
    assert vars(back) == vars(error)
