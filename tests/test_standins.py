"""The stand-in importer: an install that fails changes nothing."""

from __future__ import annotations

import sys

import pytest

from fsm_cache.testing.standins import HollowPackage, StandInFinder, install


def _finders() -> list[StandInFinder]:
    return [f for f in sys.meta_path if isinstance(f, StandInFinder)]


def test_an_install_whose_hollow_package_is_missing_takes_everything_back() -> None:
    """A second try met the finder the first left behind and failed with another error."""
    before = _finders()
    for _ in range(2):  # the same error both times
        with pytest.raises(
            ModuleNotFoundError, match=r"^fsm_no_such_pkg is not an installed package$"
        ):
            install(["fsm_standin_probe"], [], hollows=["xmlrpc", "fsm_no_such_pkg"])
        assert _finders() == before
        assert not isinstance(sys.modules.get("xmlrpc"), HollowPackage)
        assert "fsm_standin_probe" not in sys.modules
    import xmlrpc.client  # the real package, not a hollow one

    assert hasattr(xmlrpc.client, "ServerProxy")


def test_an_install_that_fails_gives_a_parent_its_attribute_back() -> None:
    """``hollow`` hangs a dotted package on its parent; a failed install left it there."""
    import email

    had = vars(email).get("mime")
    with pytest.raises(ModuleNotFoundError, match=r"^fsm_no_such_pkg is not an installed package$"):
        install([], [], hollows=["email.mime", "fsm_no_such_pkg"])
    assert vars(email).get("mime") is had
    assert not isinstance(sys.modules.get("email.mime"), HollowPackage)
