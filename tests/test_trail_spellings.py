"""The deprecated spellings of trail mode (audit mode up to 0.1) still work, and warn.

``audit=`` (Engine, Residency, configure, CacheConfig), ``Engine.audit``,
``CacheConfig.audit`` and ``FSM_CACHE_AUDIT`` go in the next release, with this
file. pyproject turns warnings into errors, so every use here sits in
``pytest.warns``. The pytest option ``--fsm-audit`` is tested in test_plugin.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from fsm_cache.engine.core import Engine
from fsm_cache.errors import ConfigError
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.residency import Residency, configure, default_residency
from fsm_cache.spec.shipped import host_machine


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Neither trail variable set, whatever the shell running the tests exports."""
    monkeypatch.delenv("FSM_CACHE_TRAIL", raising=False)
    monkeypatch.delenv("FSM_CACHE_AUDIT", raising=False)
    return monkeypatch


def test_the_audit_keyword_still_works_and_warns() -> None:
    with pytest.warns(DeprecationWarning, match=r"^Engine\(audit=") as caught:
        engine = Engine(host_machine(), audit=True)
    assert [str(w.message) for w in caught] == [
        "Engine(audit=...) is deprecated; pass Engine(trail=True) instead"
    ]
    assert caught[0].filename == __file__
    assert engine.trail is True
    with pytest.warns(DeprecationWarning, match=r"^Engine\(audit=\.\.\.\) is deprecated"):
        assert Engine(host_machine(), audit=False).trail is False


def test_the_audit_attribute_reads_trail_and_warns() -> None:
    engine = Engine(host_machine(), trail=True)
    with pytest.warns(DeprecationWarning, match=r"^Engine\.audit ") as caught:
        assert engine.audit is True
    assert str(caught[0].message) == "Engine.audit is deprecated; read Engine.trail instead"


def test_both_keywords_agreeing_only_warn() -> None:
    with pytest.warns(DeprecationWarning, match=r"^Engine\(audit=\.\.\.\) is deprecated"):
        assert Engine(host_machine(), trail=True, audit=True).trail is True


def test_both_keywords_disagreeing_are_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        Engine(host_machine(), trail=True, audit=False)
    assert str(info.value) == (
        "Engine: trail=True and audit=False disagree; "
        "pass trail= only (audit= is its deprecated spelling)"
    )


def test_the_old_variable_still_works_and_warns(environ: pytest.MonkeyPatch) -> None:
    environ.setenv("FSM_CACHE_AUDIT", "1")
    with pytest.warns(DeprecationWarning, match="^FSM_CACHE_AUDIT ") as caught:
        engine = Engine(host_machine())
    assert [str(w.message) for w in caught] == [
        "FSM_CACHE_AUDIT is deprecated; set FSM_CACHE_TRAIL=1 instead"
    ]
    assert caught[0].filename == __file__
    assert engine.trail is True


def test_both_variables_agreeing_only_warn(environ: pytest.MonkeyPatch) -> None:
    environ.setenv("FSM_CACHE_TRAIL", "yes")
    environ.setenv("FSM_CACHE_AUDIT", "1")
    with pytest.warns(DeprecationWarning, match="^FSM_CACHE_AUDIT is deprecated"):
        assert Engine(host_machine()).trail is True


def test_both_variables_disagreeing_are_a_config_error(environ: pytest.MonkeyPatch) -> None:
    environ.setenv("FSM_CACHE_TRAIL", "0")
    environ.setenv("FSM_CACHE_AUDIT", "1")
    with pytest.raises(ConfigError) as info:
        Engine(host_machine())
    assert str(info.value) == (
        "FSM_CACHE_TRAIL=0 and FSM_CACHE_AUDIT=1 disagree; "
        "set FSM_CACHE_TRAIL only (FSM_CACHE_AUDIT is its deprecated name)"
    )


def test_an_explicit_argument_does_not_read_the_old_variable(environ: pytest.MonkeyPatch) -> None:
    environ.setenv("FSM_CACHE_AUDIT", "1")
    assert (
        Engine(host_machine(), trail=False).trail is False
    )  # no warning: pyproject makes it an error


def test_residency_takes_audit_and_warns() -> None:
    with pytest.warns(DeprecationWarning, match=r"^Residency\(audit=") as caught:
        residency = Residency(audit=True)
    assert [str(w.message) for w in caught] == [
        "Residency(audit=...) is deprecated; pass Residency(trail=True) instead"
    ]
    assert caught[0].filename == __file__
    assert residency.engine.trail is True
    assert Residency(trail=True).engine.trail is True
    assert Residency(None, True).engine.trail is True  # the second positional is trail now


def test_residency_refuses_two_spellings_that_disagree() -> None:
    with pytest.raises(ConfigError) as info:
        Residency(trail=False, audit=True)
    assert str(info.value) == (
        "Residency: trail=False and audit=True disagree; "
        "pass trail= only (audit= is its deprecated spelling)"
    )


def test_residency_passes_no_audit_on_quietly(environ: pytest.MonkeyPatch) -> None:
    assert Residency(audit=None).engine.trail is False  # what HiCache passes by default


def test_configure_takes_trail_and_audit(environ: pytest.MonkeyPatch) -> None:
    before = default_residency().engine.trail
    try:
        assert configure(trail=True) is default_residency()
        assert default_residency().engine.trail is True
        with pytest.warns(DeprecationWarning, match=r"^configure\(audit=") as caught:
            configure(audit=False)
        assert caught[0].filename == __file__
        assert default_residency().engine.trail is False
        with pytest.raises(ConfigError, match=r"^configure: trail=True and audit=False disagree"):
            configure(trail=True, audit=False)
        assert default_residency().engine.trail is False
    finally:
        configure(trail=before)


def test_cache_config_takes_audit_and_warns() -> None:
    with pytest.warns(DeprecationWarning, match=r"^CacheConfig\(audit=") as caught:
        config = CacheConfig(audit=True)
    assert [str(w.message) for w in caught] == [
        "CacheConfig(audit=...) is deprecated; pass CacheConfig(trail=True) instead"
    ]
    assert caught[0].filename == __file__
    assert config == CacheConfig(trail=True)
    assert config.trail is True
    assert config.audit is True  # read quietly: HiCache reads it until it reads trail


def test_cache_config_refuses_two_spellings_that_disagree() -> None:
    with pytest.raises(ConfigError) as info:
        CacheConfig(trail=True, audit=False)
    assert str(info.value) == (
        "CacheConfig: trail=True and audit=False disagree; "
        "pass trail= only (audit= is its deprecated spelling)"
    )


def test_cache_config_has_no_audit_field() -> None:
    config = CacheConfig(trail=True, debug=True)
    assert "audit" not in {f.name for f in dataclasses.fields(config)}
    assert "trail=True" in repr(config)
    assert dataclasses.replace(config, trail=False) == CacheConfig(trail=False, debug=True)
    assert (CacheConfig().trail, CacheConfig().audit) == (None, None)
