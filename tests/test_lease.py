"""Leases: release once, name the first release on a second, release on exceptions, warn on leaks."""

from __future__ import annotations

import gc
import inspect
import os
from typing import Any

import pytest

from fsm_cache.engine import Engine
from fsm_cache.errors import LeaseError, ReleaseAtZero
from fsm_cache.shipped import host_machine, residency_system


HERE = os.path.basename(__file__)


def here() -> int:
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno


@pytest.fixture
def engine() -> Engine:
    return Engine(host_machine(), audit=False)


def backed(engine: Engine) -> Any:
    rec = engine.new(7)
    rec.state = "backed"
    return rec


def test_a_lease_pins_and_releases_once(engine: Engine) -> None:
    rec = backed(engine)
    taken = here() + 1
    lease = engine.lease(rec)
    assert (rec.state, rec.pins) == ("pinned", 1)
    assert (lease.held, lease.event, lease.record) == (True, "pin", rec)
    assert str(lease.taken_at) == f"{HERE}:{taken} in test_a_lease_pins_and_releases_once"
    assert engine.leases.outstanding() == [lease]
    released = here() + 1
    lease.release()
    assert (rec.state, rec.pins) == ("backed", 0)
    assert not lease.held
    assert engine.leases.outstanding() == []
    with pytest.raises(LeaseError) as info:
        lease.release()
    where = "test_a_lease_pins_and_releases_once"
    assert str(info.value) == (
        f"node 7: lease (pin taken at {HERE}:{taken} in {where}) "
        f"already released at {HERE}:{released} in {where}"
    )
    assert (rec.state, rec.pins) == ("backed", 0)


def test_a_with_block_releases_on_exceptions(engine: Engine) -> None:
    rec = backed(engine)
    seen: list[int] = []

    def abort_request() -> None:
        with engine.lease(rec):
            seen.append(rec.pins)
            raise KeyError("request aborted")

    with pytest.raises(KeyError):
        abort_request()
    assert seen == [1]
    assert engine.leases.outstanding() == []
    assert rec.pins == 0


def test_a_with_block_after_an_explicit_release_does_not_release_again(engine: Engine) -> None:
    rec = backed(engine)
    with engine.lease(rec) as lease:
        lease.release()
    assert (rec.state, rec.pins) == ("backed", 0)


def test_a_refused_acquire_gives_no_lease(engine: Engine) -> None:
    rec = engine.new(7)
    with pytest.raises(Exception, match="pin refused in unbacked"):
        engine.lease(rec)
    assert engine.leases.outstanding() == []


def test_a_release_refused_by_the_machine_keeps_the_lease_held(engine: Engine) -> None:
    rec = backed(engine)
    lease = engine.lease(rec)
    engine.fire(rec, "release")  # someone else released the pin behind the lease's back
    with pytest.raises(ReleaseAtZero):
        lease.release()
    assert lease.held
    assert engine.leases.outstanding() == [lease]
    rec.state, rec.pins = "pinned", 1
    lease.release()


def test_an_unreleased_lease_warns_when_collected(engine: Engine) -> None:
    rec = backed(engine)
    taken = here() + 1
    held = [engine.lease(rec)]
    site = f"{HERE}:{taken} in test_an_unreleased_lease_warns_when_collected"
    assert repr(held[0]) == f"<Lease pin on node 7, taken at {site}, held>"
    gc.collect()
    with pytest.warns(ResourceWarning) as record:
        held.clear()  # drops the last reference: collected at once (no cycle)
    assert [str(w.message) for w in record] == [
        f"node 7: lease (pin taken at {site}) was never released"
    ]
    assert engine.leases.outstanding() == []
    assert rec.pins == 1


def test_a_released_lease_is_collected_silently(engine: Engine) -> None:
    lease = engine.lease(backed(engine))
    lease.release()
    del lease
    gc.collect()  # filterwarnings = error: a warning here would fail the test


def test_locks_can_be_leased_too() -> None:
    engine = Engine(residency_system(), audit=False)
    rec = engine.new(3)
    lease = engine.lease(rec, "lock", "unlock")
    assert rec.locks == 1
    lease.release()
    assert rec.locks == 0
    assert repr(lease).endswith(f"released at {lease.released_at}>")


def test_outstanding_lists_leases_oldest_site_first(engine: Engine) -> None:
    first = engine.lease(backed(engine))
    second = engine.lease(backed(engine))
    assert engine.leases.outstanding() == [first, second]
    second.release()
    first.release()
