"""The ``fsm-cache`` command line: one console script, one module per subcommand."""

from __future__ import annotations

from fsm_cache.cli.main import main


__all__ = ["main"]
