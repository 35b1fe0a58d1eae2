"""The documentation: its code runs, it explains every refusal, and its diagrams render in a browser."""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_cache.loader import load_spec
from fsm_cache.shipped import shipped_spec_paths
from fsm_cache.spec import as_system


ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
MERMAID_FENCE = re.compile(r"^``` ?mermaid\n", re.MULTILINE)
BROWSER = "chromium"


@pytest.mark.parametrize("page", ["index.md", "leases.md", "errors.md", "sglang.md", "hicache.md"])
def test_code_blocks_run(page: str) -> None:
    """The quick start and the other examples run as written, in order, in one namespace."""
    blocks = PYTHON_BLOCK.findall((DOCS / page).read_text(encoding="utf-8"))
    assert blocks, f"{page} has no python code blocks"
    namespace: dict[str, object] = {"__name__": f"docs.{page}"}
    for number, block in enumerate(blocks, 1):
        exec(compile(block, f"{page} block {number}", "exec"), namespace)


def test_quick_start_shows_the_release_at_zero_message() -> None:
    namespace: dict[str, object] = {}
    for block in PYTHON_BLOCK.findall((DOCS / "index.md").read_text(encoding="utf-8")):
        exec(compile(block, "index.md", "exec"), namespace)
    assert namespace["message"] == (
        "node 17: release refused in backed (pins=0): release without a matching pin"
    )


def test_residency_page_explains_every_refusal_class_the_specs_name() -> None:
    named = set()
    for path in shipped_spec_paths():
        system = as_system(load_spec(path))
        named |= {f.error for f in system.forbids}
        named |= {f.error for _, machine in system.regions for f in machine.forbids}
    page = (DOCS / "residency.md").read_text(encoding="utf-8")
    explained = set(re.findall(r"^### (\w+)$", page, re.MULTILINE))
    assert sorted(named - explained) == []


# -- the built site, in a real browser ------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the site with strict warnings, as ``make docs`` does."""
    folder = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr
    return folder


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """Serve the built site on 127.0.0.1 and yield its base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            del format, args

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def rendered_dom(url: str, profile: Path) -> str:
    """Load ``url`` in headless Chromium, with every host but 127.0.0.1 unreachable."""
    done = subprocess.run(
        [
            BROWSER,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            # NOTE: no network but the local server: proves Mermaid is vendored, not fetched.
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which(BROWSER) is None,
    reason="chromium is not installed (Debian: apt-get install chromium; make test's system-deps installs it)",
)
def test_residency_diagrams_render_in_a_browser(served: str, tmp_path: Path) -> None:
    fences = len(MERMAID_FENCE.findall((DOCS / "residency.md").read_text(encoding="utf-8")))
    dom = rendered_dom(f"{served}/residency/", tmp_path / "profile")
    containers = dom.count('<div class="fsm-diagram"')
    drawn = re.findall(r'<svg id="mermaid-[^"]*"[^>]*aria-roledescription="([^"]*)"', dom)
    assert "Syntax error" not in dom
    assert fences == 3
    assert containers == fences
    assert drawn == ["stateDiagram"] * fences
