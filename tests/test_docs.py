"""The documentation: its code runs, it explains every refusal, and its diagrams render in a browser."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import logging
import os
import pkgutil
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import griffe
import pytest
from mypy import api as mypy_api

import fsm_cache
from fsm_cache import errors
from fsm_cache.cli.main import main
from fsm_cache.contracts.generate import generate
from fsm_cache.contracts.runner import contracts
from fsm_cache.contracts.verify import POOL_CONTRACTS
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import MachineSpec, as_system
from fsm_cache.spec.shipped import load_shipped, shipped_spec_paths


if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
MERMAID_FENCE = re.compile(r"^``` ?mermaid\n", re.MULTILINE)
BROWSER = "chromium"
# reStructuredText a reader must never see: a role before its code span, or a `::` marker.
RST_LEFT = re.compile(r":(?:[a-z]+:)?[a-z]+:(?:<code>|`)|::</p>")


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


def test_concepts_types_example_runs_and_mypy_reports_its_two_mistakes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The typed-stub example: its spec, its command and what mypy says of its code."""
    page = (DOCS / "concepts.md").read_text(encoding="utf-8")
    section = page.split("## Types that mypy sees\n", 1)[1].split("\n## ", 1)[0]
    (spec,) = re.findall(r"^```toml\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    ((command, said),) = re.findall(r"^\$ fsm-cache (.*)\n(.*)\n```", section, re.MULTILINE)
    (code,) = PYTHON_BLOCK.findall(section)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "door.toml").write_text(spec, encoding="utf-8")
    assert main(shlex.split(command)) == 0
    assert capsys.readouterr().out == f"{said}\n"
    (tmp_path / "user.py").write_text(code, encoding="utf-8")
    # fsm_cache's own modules as Any: what is checked is the code against the stub
    (tmp_path / "mypy.ini").write_text("[mypy]\n[mypy-fsm_cache.*]\nfollow_imports = skip\n")
    options = ["--strict", "--no-incremental", "--config-file", "mypy.ini"]
    out, _, status = mypy_api.run([*options, "--cache-dir", str(tmp_path / ".mypy"), "user.py"])
    found = [line.split(": error: ") for line in out.splitlines() if ": error: " in line]
    promised = [  # (line, what its comment says mypy reports)
        (number, line.split("# mypy", 1)[1].split(": ", 1)[1].lower())
        for number, line in enumerate(code.splitlines(), 1)
        if "# mypy" in line
    ]
    assert status == 1
    assert [int(where.split(":")[1]) for where, _ in found] == [n for n, _ in promised]
    for (_, error), (_, said_by_comment) in zip(found, promised, strict=True):
        assert said_by_comment in error.lower()


def test_check_page_quotes_what_check_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """The check page's policy error and its example trace are what ``fsm-cache check`` prints."""
    page = (DOCS / "check.md").read_text(encoding="utf-8")
    (quoted,) = re.findall(r"`(error: host_residency: the write_through policy[^`]*)`", page)
    spec = str(ROOT / "specs" / "host_residency.toml")
    assert main(["check", spec, "--policy", "write_through"]) == 2
    assert capsys.readouterr().err == f"{quoted}\n"
    control = "specs/bugs_detected/evict_device_while_writing.toml"
    ((nodes, trace),) = re.findall(
        rf"`{control}`.*?`--nodes (\d+)`.*?\n```\n(.*?)```", page, re.DOTALL
    )
    assert main(["check", str(ROOT / control), "--nodes", nodes]) == 1
    assert capsys.readouterr().out.endswith(trace)


def test_check_page_lists_every_negative_control_and_what_finds_it() -> None:
    """The controls table of check.md has one row per control, found by the command its .expected names."""
    page = (DOCS / "check.md").read_text(encoding="utf-8")
    table = page.split("\n## Negative controls\n", 1)[1].split("\n## ", 1)[0]
    listed = dict(re.findall(r"^\| `(\w+)\.(?:toml|py)` \| [^|]* \| (\w+)", table, re.MULTILINE))
    expected = {
        path.stem: path.read_text(encoding="utf-8").split(":", 1)[0]
        for path in (ROOT / "specs" / "bugs_detected").glob("*.expected")
    }
    assert listed == expected


def test_concepts_page_quotes_what_types_write_says_of_a_current_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Writing the door example's stub again prints the line the concepts page quotes."""
    page = (DOCS / "concepts.md").read_text(encoding="utf-8")
    section = page.split("## Types that mypy sees\n", 1)[1].split("\n## ", 1)[0]
    (spec,) = re.findall(r"^```toml\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    ((command, _),) = re.findall(r"^\$ fsm-cache (.*)\n(.*)\n```", section, re.MULTILINE)
    (quoted,) = re.findall(r"\(`([\w.]+ matches [^`]*)`\)", section)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "door.toml").write_text(spec, encoding="utf-8")
    assert main(shlex.split(command)) == 0
    capsys.readouterr()
    assert main(shlex.split(command)) == 0
    assert capsys.readouterr().out == f"{quoted}\n"


def test_spec_format_page_names_the_shipped_pin_sources_in_their_order() -> None:
    """The example of transition order quotes the shipped host machine's pin sources as declared."""
    page = " ".join((DOCS / "spec-format.md").read_text(encoding="utf-8").split())
    ((first, second),) = re.findall(r"lists `pin` from `(\w+)`/`(\w+)` before `pin` from", page)
    machine = load_shipped("host_residency")
    assert isinstance(machine, MachineSpec)
    pins = [t.sources for t in machine.transitions if t.event == "pin"]
    assert (first, second) == pins[0]


def test_spec_format_page_names_where_a_wheel_puts_the_shipped_specs() -> None:
    """A user of the installed package finds the shipped specs where the wheel puts them."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    targets = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]
    page = (DOCS / "spec-format.md").read_text(encoding="utf-8")
    assert f"`{targets['force-include']['specs']}/`" in page


def test_ci_snippets_install_the_cpu_torch_before_fsm_cache() -> None:
    """Each CI job the docs give installs torch's CPU build first, never the CUDA one."""
    jobs = []
    for page in sorted(DOCS.glob("*.md")):
        for block in re.findall(
            r"^```yaml\n(.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S
        ):
            installs = [x for x in block.splitlines() if "pip install" in x]
            if any("fsm-cache" in x for x in installs):
                jobs.append(page.name)
                assert "download.pytorch.org/whl/cpu" in installs[0], page.name
                assert "torch" in installs[0].split("pip install")[1], page.name
    assert sorted(jobs) == ["check.md", "verify.md"]


def test_verify_page_installs_what_the_pytest_items_need() -> None:
    """The plugin's pytest instructions install pytest and the extra that brings CrossHair."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    extras = pyproject["project"]["optional-dependencies"]
    (extra,) = [
        x for x in extras if x not in {"all", "dev"} and any("crosshair" in d for d in extras[x])
    ]
    page = (DOCS / "verify.md").read_text(encoding="utf-8")
    assert f'`pip install "fsm-cache[{extra}]" pytest`' in page


def test_audit_page_quotes_what_audit_prints_of_its_corpus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The audit page's first console example is what ``fsm-cache audit`` prints, line for line."""
    page = (DOCS / "audit.md").read_text(encoding="utf-8")
    first = re.search(r"^```console\n\$ fsm-cache ([^\n]*)\n(.*?)^```", page, re.S | re.M)
    assert first is not None
    command, said = first.groups()
    monkeypatch.chdir(ROOT)
    assert main(shlex.split(command)) == 1
    assert capsys.readouterr().out == said


@pytest.mark.parametrize("code", ["FSM100", "FSM101", "FSM102", "FSM103", "FSM104", "FSM105"])
def test_audit_page_examples_give_the_findings_it_quotes(
    code: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each code's example, audited, gives the finding quoted under it (among others).

    The audit reads functions only, so an example written as a function body is
    audited inside one, and the line numbers its finding quotes count from the
    body's first line.
    """
    page = (DOCS / "audit.md").read_text(encoding="utf-8")
    section = page.split(f"\n### {code}\n", 1)[1].split("\n### ", 1)[0]
    (example,) = PYTHON_BLOCK.findall(section)
    quoted = re.findall(rf"^`({code} .*)`\.$", section, re.MULTILINE)[0]
    if code != "FSM100" and not example.startswith("def "):
        body = "".join(f"    {line}" if line.strip() else line for line in example.splitlines(True))
        example = f"def f(self, node, pin, work):\n{body}"
        quoted = re.sub(r"line (\d+)", lambda m: f"line {int(m.group(1)) + 1}", quoted)
    (tmp_path / "example.py").write_text(example, encoding="utf-8")
    assert main(["audit", str(tmp_path / "example.py")]) == 1
    out = capsys.readouterr().out
    found = re.findall(r"^\S+:\d+:\d+: (.*?)(?: \[[\w.]+\])?$", out, re.MULTILINE)
    assert quoted in found


def test_every_fsm_cache_name_the_docs_give_exists() -> None:
    """Each ``fsm_cache.`` name in the README and the docs is a module or an attribute of one."""
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    named = {
        name: page.name
        for page in pages
        for name in re.findall(
            r"`[^`\n]*?(?<![.\w])(fsm_cache(?:\.\w+)+)", page.read_text(encoding="utf-8")
        )
    }
    missing = {name: page for name, page in sorted(named.items()) if not resolves(name)}
    assert missing == {}


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute of the longest module it starts with."""
    parts = dotted.split(".")
    obj: object = importlib.import_module(parts[0])
    for k, part in enumerate(parts[1:], 2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            return False
    return True


def test_the_error_tree_names_every_error_class_fsm_cache_defines() -> None:
    """Each public FsmCacheError subclass of every module is in the tree docs/errors.md renders.

    The tree is ``fsm_cache.errors``' docstring (the page's "The tree"), which
    left out classes defined elsewhere (``NotCompositional``, compat.sglang's).
    Classes a spec names (:func:`~fsm_cache.errors.error_class`) are made at
    run time and covered by the tree's ``<classes a spec names>``.
    """
    for module in pkgutil.walk_packages(fsm_cache.__path__, "fsm_cache."):
        if not module.name.endswith("__main__"):  # the CLI, run on import
            importlib.import_module(module.name)  # none needs SGLang (or another extra) to import

    def below(cls: type[Exception]) -> Iterator[type[Exception]]:
        for sub in cls.__subclasses__():
            yield sub
            yield from below(sub)

    defined = {
        cls.__name__
        for cls in below(errors.FsmCacheError)
        if cls.__module__.startswith("fsm_cache.")  # not a test's own
        and not cls.__name__.startswith("_")
        and (cls.__module__ != errors.__name__ or getattr(errors, cls.__name__, None) is cls)
    }
    tree = errors.__doc__ or ""
    assert {"NotCompositional", "PatchError", "NotASlot"} <= defined
    assert sorted(name for name in defined if not re.search(rf"\b{name}\b", tree)) == []


def test_verify_page_counts_the_contracts_verify_runs(tmp_path: Path) -> None:
    """The count of contracts verify.md quotes is that of the shipped specs and the allocators."""
    page = (DOCS / "verify.md").read_text(encoding="utf-8")
    (quoted,) = re.findall(r"`(\d+) contracts: \d+ confirmed over all paths", page)
    modules = [generate(as_system(load_spec(p)), p).write(tmp_path) for p in shipped_spec_paths()]
    pools = importlib.import_module(POOL_CONTRACTS).__file__
    assert pools is not None
    assert int(quoted) == sum(len(contracts(m)) for m in [*modules, Path(pools)])


def test_residency_page_explains_every_refusal_class_the_specs_name() -> None:
    named = set()
    for path in shipped_spec_paths():
        system = as_system(load_spec(path))
        named |= {f.error for f in system.forbids}
        named |= {f.error for _, machine in system.regions for f in machine.forbids}
    page = (DOCS / "residency.md").read_text(encoding="utf-8")
    explained = set(re.findall(r"^### (\w+)$", page, re.MULTILINE))
    assert sorted(named - explained) == []


# -- Sphinx roles in docstrings become Markdown ----------------------------------

ROLES_PACKAGE = {
    "__init__.py": '"""Top: see :mod:`pkg.engine` and :class:`~pkg.engine.Engine`."""\n',
    "errors.py": 'class Boom(Exception):\n    """Boom."""\n',
    "engine.py": '''\
"""Engines: :meth:`Engine.fire`, :func:`helper`, :class:`Missing`, :ref:`intro`.

Run one at once::

    Engine().fire()

Or ::

    helper()
"""

from pkg.errors import Boom


class Engine:
    """Raises :exc:`Boom`."""

    def fire(self) -> None:
        """Fire; see :meth:`lease` and :py:meth:`~Engine.lease`.

        Titled: :meth:`the lease
        <Engine.lease>`, :class:`a boom <pkg.errors.Boom>`.
        """

    def lease(self) -> None:
        """Lease."""


def helper() -> None:
    """Help, as ``:func:`helper``` would say."""
''',
}


def rst_roles() -> ModuleType:
    """Import the docs hook module (it lives in docs/hooks, outside any package)."""
    spec = importlib.util.spec_from_file_location("rst_roles", DOCS / "hooks" / "rst_roles.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def autoref(path: str, shown: str) -> str:
    return f'<autoref identifier="{path}" optional>`{shown}`</autoref>'


def test_roles_become_links_resolved_from_the_docstrings_scope(tmp_path: Path) -> None:
    for name, text in ROLES_PACKAGE.items():
        (tmp_path / "pkg").mkdir(exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text, encoding="utf-8")
    extensions = griffe.load_extensions(rst_roles().RstRoles)
    pkg = griffe.load("pkg", search_paths=[tmp_path], extensions=extensions)
    objects = {"": pkg, "engine": pkg["engine"], "engine.Engine": pkg["engine.Engine"]}
    objects |= {"fire": pkg["engine.Engine.fire"], "helper": pkg["engine.helper"]}
    docs = {key: obj.docstring.value for key, obj in objects.items() if obj.docstring}
    assert docs == {
        "": f"Top: see {autoref('pkg.engine', 'pkg.engine')} and {autoref('pkg.engine.Engine', 'Engine')}.",
        "engine": (
            f"Engines: {autoref('pkg.engine.Engine.fire', 'Engine.fire')}, "
            f"{autoref('pkg.engine.helper', 'helper')}, `Missing`, `intro`.\n\n"
            "Run one at once:\n\n    Engine().fire()\n\nOr\n\n    helper()"
        ),
        "engine.Engine": f"Raises {autoref('pkg.errors.Boom', 'Boom')}.",
        "fire": (
            f"Fire; see {autoref('pkg.engine.Engine.lease', 'lease')} "
            f"and {autoref('pkg.engine.Engine.lease', 'lease')}.\n\n"
            f"Titled: {autoref('pkg.engine.Engine.lease', 'the lease')}, "
            f"{autoref('pkg.errors.Boom', 'a boom')}."
        ),
        "helper": "Help, as ``:func:`helper``` would say.",
    }


def test_markup_left_in_a_page_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    page = SimpleNamespace(file=SimpleNamespace(src_path="api.md"))
    html = "<p>Use :class:<code>X</code> like this::</p>"
    with caplog.at_level(logging.WARNING):
        assert rst_roles().on_page_content(html, page=page) == html
    assert [r.getMessage() for r in caplog.records] == [
        f"rst_roles: api.md: reStructuredText ':class:<code>' left in the page: {html}",
        f"rst_roles: api.md: reStructuredText '::</p>' left in the page: {html}",
    ]


# -- the built site, in a real browser ------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the site with strict warnings, as ``make docs`` does.

    ``make test`` names the site its ``docs`` stage built from this tree a
    few minutes before (``FSM_CACHE_BUILT_SITE``), which is read instead.
    """
    named = os.environ.get("FSM_CACHE_BUILT_SITE")
    if named and (Path(named) / "index.html").is_file():
        return Path(named)
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


def test_built_site_shows_no_restructuredtext_markup(site: Path) -> None:
    pages = sorted(site.rglob("*.html"))
    left = {
        str(p.relative_to(site)): RST_LEFT.findall(p.read_text(encoding="utf-8")) for p in pages
    }
    assert {page: found for page, found in left.items() if found} == {}
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert 'href="../errors/#fsm_cache.errors.' in api  # roles link across pages


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
    assert fences == 5  # host, device, the composition; storage and host with storage
    assert containers == fences
    assert drawn == ["stateDiagram"] * fences
