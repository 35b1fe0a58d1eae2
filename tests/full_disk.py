"""Running the CLI in a child process that cannot write files past a few bytes: a full disk.

``RLIMIT_FSIZE`` makes a write past the limit fail with ``EFBIG`` (``File too
large``), as a full disk fails one with ``ENOSPC``: the file is created, the
first bytes land, and the write that crosses the limit raises. It is set only
in the child, with ``SIGXFSZ`` ignored so the child sees the error instead of
being killed.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


_MAIN = "import sys; from fsm_cache.cli.main import main; sys.exit(main(sys.argv[1:]))"


def run_cli_on_a_full_disk(argv: Sequence[str], cwd: Path, limit: int = 64) -> tuple[int, str, str]:
    """Run ``fsm-cache ARGV`` where no file can grow past ``limit`` bytes; return (status, out, err)."""

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))

    done = subprocess.run(
        [sys.executable, "-c", _MAIN, *argv],
        cwd=cwd,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        preexec_fn=limit_file_size,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr
