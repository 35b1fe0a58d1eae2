"""``check --ops``: a user's module that raises, exits or answers wrongly is exit 2, never a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fsm_cache.cli.main import main
from fsm_cache.errors import ConfigError
from fsm_cache.modelcheck import check, treeops
from fsm_cache.spec.shipped import shipped_names, spec_dir


RESIDENCY = spec_dir() / "residency.toml"


def _ops(tmp_path: Path, body: str, name: str = "ops.py") -> Path:
    path = tmp_path / name
    path.write_text(f"import sys\nSPEC = {str(RESIDENCY)!r}\n{body}")
    return path


def _check(capsys: pytest.CaptureFixture[str], ops: Path, *more: str) -> tuple[int, str]:
    status = main(["check", "--nodes", "2", "--ops", str(ops), *more, str(RESIDENCY)])
    captured = capsys.readouterr()
    return status, captured.err.strip()


@pytest.mark.parametrize(
    ("body", "more", "error"),
    [
        ("def split(*a):\n    raise KeyError('x')\n", (), "split raised KeyError('x')"),
        ("def insert(*a):\n    raise KeyError('x')\n", (), "insert raised KeyError('x')"),
        ("def prune(*a):\n    sys.exit(0)\n", (), "prune raised SystemExit(0)"),
        ("def match_prefix(*a):\n    return 42\n", (), "match_prefix returned 42, not a Match"),
        (
            "def match_prefix(*a):\n    raise ValueError('bad')\n",
            (),
            "match_prefix raised ValueError('bad')",
        ),
        (
            "def split(layout, nodes, index, slot):\n    return [1]\n",
            (),
            "split returned [1], not a tree of 2 slots or None",
        ),
        (
            "def insert(layout, nodes, parent, slot):\n    return nodes[:1]\n",
            (),
            "insert returned ((-1, 'unbacked', 'resident', 0, 0, 0, ...),), "
            "not a tree of 2 slots or None",
        ),
        (
            "def wants_backup(*a):\n    raise ValueError('bad')\n",
            ("--policy", "write_through"),
            "wants_backup raised ValueError('bad')",
        ),
        (
            "def wants_backup(*a):\n    return 1\n",
            ("--policy", "write_through"),
            "wants_backup returned 1, not a bool",
        ),
        ("split = 3\n", (), "split is not a function (3)"),
    ],
    ids=[
        "split-raises",
        "insert-raises",
        "prune-exits",
        "match-returns-int",
        "match-raises",
        "split-returns-list",
        "insert-loses-a-slot",
        "wants-raises",
        "wants-returns-int",
        "not-callable",
    ],
)
def test_a_faulty_hook_is_a_config_error_naming_module_and_hook(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    body: str,
    more: tuple[str, ...],
    error: str,
) -> None:
    ops = _ops(tmp_path, body)
    assert _check(capsys, ops, *more) == (2, f"error: {ops}: {error}")


def test_an_exit_at_import_is_a_config_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ops = _ops(tmp_path, "sys.exit(0)\n")
    assert _check(capsys, ops) == (2, f"error: {ops}: cannot import: SystemExit: 0")
    with pytest.raises(ConfigError, match=r": cannot import: SystemExit: 0$"):
        check.load_ops(ops)


def test_an_ops_path_that_is_no_regular_file_is_refused_without_waiting(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A named pipe would make the import wait for a writer for ever."""
    fifo = tmp_path / "ops.py"
    os.mkfifo(fifo)
    assert _check(capsys, fifo) == (
        2,
        f"error: {fifo}: cannot import: not a regular file (a named pipe)",
    )
    assert _check(capsys, tmp_path) == (2, f"error: {tmp_path}: cannot import: Is a directory")
    missing = tmp_path / "missing.py"
    assert _check(capsys, missing) == (
        2,
        f"error: {missing}: cannot import: No such file or directory",
    )


def test_hooks_call_each_other_unguarded_and_defaults_keep_their_identity(
    tmp_path: Path,
) -> None:
    """Only the checker's calls are guarded: one hook's fault inside another names the outer."""
    ops = _ops(
        tmp_path,
        "def prune(layout, nodes):\n    raise KeyError('inner')\n"
        "def split(layout, nodes, index, slot):\n    return prune(layout, nodes)\n",
    )
    _, view = check.load_ops(ops)
    assert view.insert is treeops.insert
    assert view.born is treeops.born
    assert not hasattr(view, "match_prefix")
    with pytest.raises(ConfigError) as info:
        view.split(None, (None,), 0, 0)
    assert str(info.value) == f"{ops}: split raised KeyError('inner')"


_TREEOPS = "from fsm_cache.modelcheck import treeops\n"
_MATCH = "from fsm_cache.modelcheck.lookup import Match\n"
_START = "((-1, 'unbacked', 'resident', 0, 0, 0, ...), "
_STATUSES = (
    "failed from device, failed from host, failed from storage, "
    "filling from device, filling from host, filling from storage, free, valid"
)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            "def split(layout, nodes, index, slot):\n"
            "    return tuple(('junk',) if n is not None else None for n in nodes)\n",
            "split returned (('junk',), None), not a tree of 2 slots or None: "
            "node 0 has 1 field, not 11",
        ),
        (
            "def split(layout, nodes, index, slot):\n"
            "    return tuple(() if n is not None else None for n in nodes)\n",
            "split returned ((), None), not a tree of 2 slots or None: node 0 has 0 fields, not 11",
        ),
        (
            "def split(layout, nodes, index, slot):\n"
            "    return tuple(list(n) if n is not None else None for n in nodes)\n",
            "split returned ([-1, 'unbacked', 'resident', 0, 0, 0, ...], None), not a tree of 2 "
            "slots or None: slot 0 holds [-1, 'unbacked', 'resident', 0, 0, 0, ...], "
            "not a node entry (a tuple) or None",
        ),
        (
            _TREEOPS + "def insert(layout, nodes, parent, slot):\n"
            "    out = treeops.insert(layout, nodes, parent, slot)\n"
            "    return out and (*out[:slot], (out[slot][0], 'nowhere', *out[slot][2:]))\n",
            f"insert returned {_START}(-1, 'nowhere', 'resident', 0, 0, 0, ...)), not a tree of "
            "2 slots or None: node 1's host state is 'nowhere', "
            "not one of backed, evicted, pinned, unbacked, writing",
        ),
        (
            _TREEOPS + "def insert(layout, nodes, parent, slot):\n"
            "    out = treeops.insert(layout, nodes, parent, slot)\n"
            "    return out and (*out[:slot], (*out[slot][:3], True, *out[slot][4:]))\n",
            f"insert returned {_START}(-1, 'unbacked', 'resident', True, 0, 0, ...)), not a tree "
            "of 2 slots or None: node 1's counter pins is True, not an int",
        ),
        (
            _TREEOPS + "def split(layout, nodes, index, slot):\n"
            "    out = treeops.split(layout, nodes, index, slot)\n"
            "    return out and tuple(e and (1 - i, *e[1:]) for i, e in enumerate(out))\n",
            "split returned ((1, 'unbacked', 'resident', 0, 0, 0, ...), "
            "(0, 'unbacked', 'resident', 0, 0, 0, ...)), not a tree of 2 slots or None: "
            "node 0 is not under the root: its parents go round in a cycle",
        ),
        (
            "def prune(layout, nodes):\n"
            "    return (None, (0, *nodes[1][1:])) if all(nodes) else nodes\n",
            "prune returned (None, (0, 'evicted', 'absent', 0, 0, 0, ...)), not a tree of 2 "
            "slots: node 1's parent is slot 0, which holds no node",
        ),
        (
            "def prune(layout, nodes):\n"
            "    return tuple(e and (*e[:-3], 'full', *e[-2:]) for e in nodes)\n",
            f"prune returned {_START}(0, 'evicted', 'absent', 0, 0, 0, ...)), not a tree of "
            f"2 slots: node 0's host memory is 'full', not one of {_STATUSES}",
        ),
        (
            "class Weird:\n    def __repr__(self):\n        sys.exit(0)\n"
            "def split(layout, nodes, index, slot):\n    return Weird()\n",
            "split returned a Weird that cannot be shown, not a tree of 2 slots or None",
        ),
        (
            _MATCH + "def match_prefix(layout, path):\n    return Match.__new__(Match)\n",
            "match_prefix returned a Match that cannot be shown, "
            "not a Match whose device is a tuple of positions on the path (ints)",
        ),
        (
            _MATCH + "def match_prefix(layout, path):\n    return Match((), [0])\n",
            "match_prefix returned Match(device=(), host=[0]), "
            "not a Match whose host is a tuple of positions on the path (ints)",
        ),
        (
            "class Stop(BaseException):\n    pass\ndef insert(*a):\n    raise Stop('x')\n",
            "insert raised Stop('x')",
        ),
        (
            "class Stop(BaseException):\n    pass\nraise Stop('x')\n",
            "cannot import: Stop: x",
        ),
    ],
    ids=[
        "split-junk-entries",
        "split-empty-entries",
        "split-list-entries",
        "insert-unknown-state",
        "insert-bool-counter",
        "split-parent-cycle",
        "prune-orphan",
        "prune-unknown-pages",
        "split-unshowable",
        "match-without-fields",
        "match-host-list",
        "hook-raises-base-exception",
        "import-raises-base-exception",
    ],
)
def test_a_malformed_answer_is_a_config_error_saying_what_is_wrong(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, body: str, error: str
) -> None:
    """A well-sized answer the checker cannot read was a traceback and exit 1 (a "finding")."""
    ops = _ops(tmp_path, body)
    assert _check(capsys, ops) == (2, f"error: {ops}: {error}")


def test_a_lookup_off_the_path_is_a_finding_not_an_index_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ops = _ops(tmp_path, _MATCH + "def match_prefix(layout, path):\n    return Match((5,), ())\n")
    status = main(["check", "--nodes", "2", "--ops", str(ops), str(RESIDENCY)])
    out, err = capsys.readouterr()
    assert (status, err) == (1, "")
    assert (
        "  violation: lookup: node 0: match_prefix reports nodes [5] on the device and [] "
        "as a host hit, not the path [0]"
    ) in out.splitlines()


def test_a_keyboard_interrupt_in_a_hook_goes_through(tmp_path: Path) -> None:
    ops = _ops(tmp_path, "def split(layout, nodes, index, slot):\n    raise KeyboardInterrupt\n")
    _, view = check.load_ops(ops)
    with pytest.raises(KeyboardInterrupt):
        view.split(None, (None,), 0, 0)


@pytest.mark.parametrize(
    "body",
    [
        "raise KeyboardInterrupt\n",
        "def split(layout, nodes, index, slot):\n    raise KeyboardInterrupt\n",
    ],
    ids=["at import", "in a hook"],
)
def test_a_keyboard_interrupt_ends_the_command_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, body: str
) -> None:
    """Ctrl-C reaches the command line, which says so and exits 130, as a shell reports SIGINT."""
    assert _check(capsys, _ops(tmp_path, body)) == (130, "interrupted")


def test_what_an_ops_module_prints_leaves_the_json_whole(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Under ``--json`` stdout is the JSON alone: a module's prints go to stderr."""
    body = (
        "from fsm_cache.modelcheck import treeops\n"
        "print('loading my ops')\n"
        "def insert(*a):\n"
        "    print('inserting')\n"
        "    return treeops.insert(*a)\n"
    )
    ops = _ops(tmp_path, body)
    status = main(["check", "--nodes", "2", "--json", "--ops", str(ops), str(RESIDENCY)])
    captured = capsys.readouterr()
    assert status == 0
    assert json.loads(captured.out)["specs"][0]["violation"] is None
    assert "loading my ops" in captured.err
    assert "inserting" in captured.err


def test_an_ops_module_whose_getattr_raises_is_read_for_what_it_defines(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    body = "def __getattr__(name):\n    raise RuntimeError(f'no {name} here')\n"
    status, err = _check(capsys, _ops(tmp_path, body))
    assert (status, err) == (0, "")


BUGS = spec_dir() / "bugs_detected"


def test_an_ops_module_alone_is_checked_on_its_spec_under_its_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The module's SPEC and POLICY were ignored: every shipped spec ran, with no policy."""
    ops = BUGS / "backup_ignores_parent.py"
    status = main(["check", "--nodes", "2", "--json", "--ops", str(ops)])
    out = json.loads(capsys.readouterr().out)
    assert status == 1
    assert [(s["spec"], s["policy"]) for s in out["specs"]] == [
        (str(RESIDENCY.resolve()), "write_through")
    ]
    assert out["specs"][0]["violation"] == (
        "invariant 3: node 1 is writing on the host but its parent node 0 is unbacked"
    )
    assert out["controls"] == []


def test_the_spec_and_policy_an_ops_module_names_may_be_named_again(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ops = BUGS / "backup_ignores_parent.py"
    again = str(spec_dir() / ".." / spec_dir().name / "residency.toml")
    status = main(
        ["check", "--nodes", "2", "--json", "--ops", str(ops), "--policy", "write_through", again]
    )
    out = json.loads(capsys.readouterr().out)
    assert status == 1
    assert [(s["spec"], s["policy"]) for s in out["specs"]] == [(again, "write_through")]


def test_an_ops_module_names_a_shipped_spec_as_fsm_cache_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``SPEC = "fsm_cache:residency"`` read as a path beside the module: cannot read."""
    source = (BUGS / "backup_ignores_parent.py").read_text(encoding="utf-8")
    ops = tmp_path / "ops.py"
    ops.write_text(source.replace('"../residency.toml"', '"fsm_cache:residency"'), encoding="utf-8")
    status = main(["check", "--nodes", "2", "--json", "--ops", str(ops), "fsm_cache:residency"])
    out = json.loads(capsys.readouterr().out)
    assert status == 1
    assert [(s["spec"], s["policy"]) for s in out["specs"]] == [
        (str(RESIDENCY.resolve()), "write_through")
    ]
    ops.write_text('SPEC = "fsm_cache:resid"\n', encoding="utf-8")
    assert main(["check", "--nodes", "2", "--ops", str(ops)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: {ops}: SPEC: no shipped spec 'resid' (shipped: {', '.join(shipped_names())})"
    )


def test_another_spec_or_policy_than_the_ops_module_names_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A SPEC argument or --policy was checked in place of the module's, which went unsaid."""
    ops = BUGS / "backup_ignores_parent.py"
    host = spec_dir() / "host_residency.toml"
    status = main(["check", "--nodes", "2", "--ops", str(ops), "--policy", "none", str(host)])
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    assert captured.err.splitlines() == [
        f"error: check: {ops}: its SPEC is {RESIDENCY.resolve()}, not {host}; "
        "give that spec or none",
        f"error: check: {ops}: its POLICY is write_through, not --policy none; "
        "give that policy or none",
    ]


def test_an_ops_module_without_a_policy_runs_under_the_one_given(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ops = _ops(tmp_path, "")
    status = main(
        ["check", "--nodes", "2", "--json", "--ops", str(ops), "--policy", "write_through"]
    )
    out = json.loads(capsys.readouterr().out)
    assert status == 0
    assert [(s["spec"], s["policy"]) for s in out["specs"]] == [(str(RESIDENCY), "write_through")]


_PLAIN = """\
[machine]
name = "slot"
initial = "idle"

[counters]
borrows = 0

[states]
idle = { invariant = "borrows == 0" }
busy = { invariant = "borrows >= 1", counter = "borrows" }

[[transition]]
event = "borrow"
source = ["idle", "busy"]
dest = "busy"
guard = "borrows < 2"
update = "borrows += 1"

[[forbid]]
event = "borrow"
source = "busy"
guard = "borrows >= 2"
error = "Full"
reason = "two borrowers already"

[[transition]]
event = "give_back"
source = "busy"
dest = "busy"
guard = "borrows >= 2"
update = "borrows -= 1"

[[transition]]
event = "give_back"
source = "busy"
dest = "idle"
guard = "borrows == 1"
update = "borrows -= 1"

[[forbid]]
event = "give_back"
source = "idle"
error = "NotBorrowed"
reason = "nobody borrowed it"
"""

_NO_PAGES = (
    "its nodes keep no pages (it has no host and device regions), so no node is ever "
    "deleted and the tree keeps its starting shape"
)


@pytest.mark.parametrize(
    ("spec", "body", "error"),
    [
        (
            "plain",
            "def split(*a):\n    return None\ndef prune(layout, nodes):\n    return nodes\n",
            f"split, prune are never called in a check of {{spec}}: {_NO_PAGES}",
        ),
        (
            "plain",
            "def insert(*a):\n    return None\n",
            f"insert is never called in a check of {{spec}}: {_NO_PAGES}",
        ),
        (
            "plain",
            "def match_prefix(layout, path):\n    return None\n",
            "match_prefix is never called in a check of {spec}: its nodes have no device "
            "copy to look up (it has no host and device regions)",
        ),
        (
            "residency",
            "def born(*a):\n    return None\n",
            "born is never called in a check of {spec}: it declares no [composition.births]",
        ),
        (
            "residency",
            "def wants_backup(*a):\n    return True\n",
            "wants_backup is never called in a check of {spec}: it is checked under no write "
            "policy (give the module POLICY = 'write_through', or --policy write_through)",
        ),
    ],
    ids=["plain-split-prune", "plain-insert", "plain-lookup", "no-births", "no-policy"],
)
def test_a_hook_the_check_never_calls_is_refused(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    spec: str,
    body: str,
    error: str,
) -> None:
    """A hook the search never reaches was ignored, and the check passed as if it ran.

    On a spec without host and device regions no node is ever deleted, so the
    starting trees keep every slot full: no insert, birth or split can happen
    and nothing is pruned. A lookup needs a device tier, a backup decision a
    write policy, a birth hook a declared birth.
    """
    path = RESIDENCY
    if spec == "plain":
        path = tmp_path / "slot.toml"
        path.write_text(_PLAIN)
    ops = tmp_path / "ops.py"
    ops.write_text(f"SPEC = {str(path)!r}\n{body}")
    status = main(["check", "--nodes", "2", "--ops", str(ops)])
    captured = capsys.readouterr()
    assert (status, captured.out, captured.err.strip()) == (
        2,
        "",
        f"error: {ops}: {error.format(spec=path)}",
    )


def test_hooks_the_check_calls_are_taken(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """What the refusal leaves alone: a residency spec's split, its policy's wants_backup."""
    ops = _ops(
        tmp_path,
        "from fsm_cache import policy\nfrom fsm_cache.modelcheck import treeops\n"
        "def split(*a):\n    return treeops.split(*a)\n"
        "def wants_backup(*a):\n    return policy.wants_backup(*a)\n",
    )
    assert _check(capsys, ops, "--policy", "write_through") == (0, "")
