"""``python -m fsm_cache``: the ``fsm-cache`` command line, where the console script is not on PATH."""

from __future__ import annotations

from fsm_cache.cli.main import main


raise SystemExit(main())
