"""Run the audit standalone: ``python -m fsm_cache.audit PATH...``."""

from __future__ import annotations

from fsm_cache.audit.command import main


if __name__ == "__main__":
    raise SystemExit(main())
