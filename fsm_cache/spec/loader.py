"""Load specs from TOML files or plain dicts, reporting every fault with its location.

A file holds either one ``[machine]`` or one ``[composition]`` whose
``[composition.regions]`` table maps region names to machine files (paths
relative to the composition file). Either may name, with ``extends``, a file
of its own kind that it adds to: the states, events, transitions and refusals
of an extending machine follow its base's, and an extending composition
replaces or adds regions and follows its base's refusals and births. A rule
therefore lives once, in the base, however many specs build on it. Loading
validates the result (:mod:`fsm_cache.spec.validate`): a spec that loads is
one the engine can run.

Whatever the input, a fault is a :class:`SpecError`, never another exception:
only regular files are opened (a named pipe would wait for a writer forever),
files are read up to :data:`MAX_BYTES`, data is refused past :data:`MAX_DEPTH`
levels of nesting before anything walks it recursively, and values quoted in
messages are shortened (:func:`shown`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import reprlib
import stat
import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from fsm_cache.errors import BadArgument, SpecError
from fsm_cache.numeric import whole
from fsm_cache.spec.guards import (
    MAX_DIGITS,
    GrammarError,
    parse_condition,
    parse_guard,
    parse_update,
)
from fsm_cache.spec.machine import (
    NOT_A_NAME,
    NOT_A_TITLE,
    Birth,
    EventSpec,
    Forbid,
    MachineSpec,
    Spec,
    StateSpec,
    System,
    Transition,
    bad_name,
    bad_title,
)
from fsm_cache.spec.shipped import shipped_file


if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_Table = Mapping[str, Any]

MAX_BYTES = 16 * 2**20
"""The largest spec file read; a real one is a few kilobytes."""

MAX_EXTENDS = 8
"""The longest chain of ``extends`` followed; a longer one is refused.

A chain that comes back to a file already in it is refused as a cycle, once,
at the file that closes it, and so is one that comes back through a
composition's region (``c.toml, whose region r is m.toml extends c.toml``).
A base or a region of the wrong kind (a machine that extends a composition)
is refused before it is built, so a load nests at most two such chains: a
composition's and, through one of its regions, a machine's."""

MAX_DEPTH = 64
"""The deepest nesting of tables and arrays accepted; a real spec nests four levels.

Deeper data is refused before it is built into a spec, because quoting or
walking it recursively would exceed Python's recursion limit (``RecursionError``).
"""

_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxtuple = 3, 6, 6, 6
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 80, 80, 80


def shown(value: object) -> str:
    """Return ``repr(value)`` shortened for a message: three levels, a few items, 80 characters.

    A value quoted back to the user may be anything the file holds: an array
    of a million items or one nested hundreds of levels deep, whose full
    ``repr`` would flood the terminal or raise ``RecursionError``.
    """
    try:
        return _SHOWN.repr(value)
    except ValueError:  # an int past Python's int-to-str digit limit, from a Python caller
        return "a value too large to show"


class _Problems:
    """Collects located problems so one load reports all of them at once."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines: list[str] = []
        self.failed = False
        """Whether a file this one needs failed, its faults reported where it was first reached."""

    def add(self, where: str, message: str) -> None:
        self.lines.append(f"{self.source}: {where}: {message}")

    def add_file(self, message: str) -> None:
        """Add a fault of the file as a whole, at no key."""
        self.lines.append(f"{self.source}: {message}")

    def include(self, error: SpecError) -> None:
        """Take the faults of a file this one needs, which therefore fails too."""
        self.lines += error.problems
        self.failed = True

    def check(self) -> None:
        """Raise the faults collected, each once, if there are any or a file needed failed."""
        if self.lines or self.failed:
            raise SpecError(list(dict.fromkeys(self.lines)))


@dataclass(frozen=True)
class _Link:
    """One step of the path that led a load to the file it is reading.

    Attributes:
        source: The file that leads on, as named (for messages).
        resolved: ``source`` resolved, to compare files however named (None:
            it cannot be resolved, a symlink loop that reading reports).
        how: How it leads to the next file: ``" extends "``, or
            ``", whose region R is "`` for a composition's region ``R``.
    """

    source: str
    resolved: Path | None
    how: str


_EXTENDS = " extends "


class _Files:
    """What one top-level load has read and built, shared by every file it reaches.

    A file reached more than once (ten regions naming one machine, a base two
    specs extend) is read and built once, and its own faults are reported
    once, where it is first reached. Without it, regions whose machines lead
    to files with regions of their own read files a number of times
    exponential in the depth, and repeat each of their faults as often.
    """

    def __init__(self, given: Mapping[str, bytes] | None = None) -> None:
        self.given = given
        """The bytes of every file to read, by resolved path (:func:`load_snapshot`); None: the disk's."""
        self.read: dict[str, bytes] = {}
        """The bytes of every file read, by resolved path: what the spec was built from."""
        self.reached: dict[str, str] = {}
        """Every file the load went to read, as first named, by real path: read or not
        (:func:`spec_files`). A file reached again is named so again (:meth:`name`)."""
        self.tables: dict[Path, _Table | None] = {}
        """A file's table by its resolved path; None when the file itself is at fault."""
        self.specs: dict[tuple[Path, int], Spec | None] = {}
        """A file's spec by its resolved path and the files extending it above it
        (:data:`MAX_EXTENDS` counts them); None when it did not build."""
        self.bases: dict[str, tuple[Spec, ...]] = {}
        """The specs each spec built builds on, its own base first, by its file as named:
        a fault is told by the file that declares what it names, and how that file is reached."""

    def table(self, path: Path, target: Path | None, name: str | None = None) -> _Table | None:
        """Return the table of the file ``path`` (``target`` resolved), read once.

        Its faults name it ``name`` (by default, ``path``): a top-level
        file as its caller spelled it (:func:`_path`), another as the file
        reaching it names it (:func:`_named_file`), first reached
        (:meth:`name`).

        Returns:
            Its table, or None when an earlier read found it is no spec file.

        Raises:
            OSError: It cannot be read (each reference reports that at its key).
            ValueError: Its name cannot name a file.
            SpecError: It is no spec file (too large, not TOML, nested too
                deeply): its own fault, reported where it is first read.
        """
        self.reached.setdefault(os.path.realpath(path), str(path) if name is None else name)
        if target is not None and target in self.tables:
            return self.tables[target]
        name = str(path) if name is None else name
        try:
            data = _toml(self._bytes(path, target, name), name)
            _check_shape(data, name)
        except SpecError:
            if target is not None:
                self.tables[target] = None
            raise
        if target is not None:
            self.tables[target] = data
        return data

    def name(self, path: str) -> str:
        """Return what the file ``path`` is named in this load: as it was first reached, if it was.

        A file reached by two spellings (``lamp.toml`` a region,
        ``./lamp.toml`` a base) is one file, whose faults are named once.
        """
        return self.reached.get(os.path.realpath(path), path)

    def _bytes(self, path: Path, target: Path | None, name: str) -> bytes:
        """Return the bytes of the file ``path`` (``target`` resolved, ``name`` as named): from disk, or as given.

        Raises:
            OSError: It cannot be read, or, from given bytes, none are given for it.
            ValueError: Its name cannot name a file.
            SpecError: It is larger than :data:`MAX_BYTES`.
        """
        given = None if self.given is None or target is None else self.given.get(str(target))
        if self.given is None:
            raw = read_bytes(path, name)
        elif given is None:
            raise FileNotFoundError(errno.ENOENT, NOT_IN_SNAPSHOT)
        else:
            raw = given
        if target is not None:
            self.read[str(target)] = raw
        return raw

    def spec(self, data: _Table, name: str, route: _Route, key: tuple[Path, int] | None) -> Spec:
        """Return the unvalidated spec of ``data``, the file ``name`` reached by ``route``, built once per ``key``.

        Raises:
            SpecError: It does not build; with no faults when it did not
                before, as they were reported then.
        """
        if key is not None and key in self.specs:
            found = self.specs[key]
            if found is None:
                raise SpecError([])
            return found
        try:
            built = _built(data, name, os.path.dirname(name), route)
        except SpecError:
            if key is not None:
                self.specs[key] = None
            raise
        if key is not None:
            self.specs[key] = built
        return built

    def chains(self) -> dict[str, tuple[str, ...]]:
        """Return the files each spec built builds on, its own base first, by its file as named."""
        return {source: tuple(b.source for b in bases) for source, bases in self.bases.items()}


@dataclass(frozen=True)
class _Route:
    """How a load reached the file it is reading: the files that led there, and what it has read."""

    links: tuple[_Link, ...]
    files: _Files

    def then(self, source: str, how: str) -> _Route:
        """Return this route on from ``source``, which leads to the next file as ``how`` says."""
        return _Route((*self.links, _Link(source, _resolved(Path(source)), how)), self.files)

    @classmethod
    def start(cls, chain: tuple[str, ...] = ()) -> _Route:
        """Return the route of a new top-level load, the files of ``chain`` extending one another."""
        route = cls((), _Files())
        for source in chain:
            route = route.then(source, _EXTENDS)
        return route


def _resolved(path: Path) -> Path | None:
    """Return ``path`` resolved, or None if it cannot be (a symlink loop: reading it reports that)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return None


NO_SPEC = "holds no [machine] or [composition] table; a spec file is one of them"
"""Why a TOML file with neither table (an empty one) is no spec, said once rather than key by key."""

NOT_IN_SNAPSHOT = "not among the files the spec was first read from"
"""Why a load from a snapshot (:func:`load_spec` given ``files``) cannot read a file."""


def load_spec(path: str | Path, files: Mapping[str, bytes] | None = None) -> Spec:
    """Read, parse and validate one spec file.

    Args:
        path: A ``.toml`` file holding a ``[machine]`` or a ``[composition]``.
        files: The bytes of the spec's files by resolved path, as
            :func:`load_snapshot` returns them: the spec is built from them
            and no file is read, so it is the spec they were read as, whatever
            the files hold now. None (the default) reads the files.

    Returns:
        The validated :class:`MachineSpec` or :class:`System`.

    Raises:
        SpecError: The file is unreadable, not TOML, or the spec is invalid;
            one problem per fault, each naming the file and key.
        BadArgument: ``path`` names no file: it is no ``str`` or
            :class:`os.PathLike` (``None``, bytes).
    """
    return _load(*_path(path, "load_spec"), _Files(files))


def _path(path: object, caller: str) -> tuple[Path, str]:
    """Return the spec path ``path`` a caller of ``caller`` gave, as a :class:`Path`, and its name.

    The name is the path as given, which the spec's problems name: a
    :class:`Path` drops a leading ``./``, and ``./-`` (a file named ``-``)
    was named ``-``, the name that means stdin.

    Raises:
        BadArgument: ``path`` is no ``str`` or :class:`os.PathLike` of one.
    """
    try:
        parsed = Path(path)  # type: ignore[arg-type]  # checked here: the caller may not be typed
    except TypeError:
        msg = f"{caller}: path must be a spec file's path (str or os.PathLike), got {type(path).__name__}"
        raise BadArgument(msg) from None
    return parsed, os.fspath(path)  # type: ignore[call-overload]  # a path, as Path() found


def load_snapshot(path: str | Path) -> tuple[Spec, dict[str, bytes]]:
    """Load one spec file as :func:`load_spec` does; return it and the bytes it was built from.

    The bytes are those of every file the load read (the spec, what it
    extends, its regions' files), by resolved path, read once each: given
    back to :func:`load_spec`, in this process or another, they build this
    spec again, though a file was saved over meanwhile. A run that builds
    a spec more than once (``verify``: the contracts here, the spec they
    are proved against in CrossHair's process) builds one version of it.

    Raises:
        SpecError, BadArgument: As :func:`load_spec`.
    """
    files = _Files()
    return _load(*_path(path, "load_snapshot"), files), files.read


def _load(path: Path, name: str, files: _Files) -> Spec:
    """Load the spec file ``path``, named ``name``, reading its files through ``files``.

    Raises:
        SpecError: As :func:`load_spec`.
    """
    from fsm_cache.spec.validate import validate

    spec = _unvalidated(path, files, name)
    validate(spec, files.chains())
    return spec


def _unvalidated(path: Path, files: _Files, name: str | None = None) -> Spec:
    """Build the spec of the file ``path``, reading its files through ``files``; do not validate it.

    Its problems name the file ``name`` (by default, ``path``).

    Raises:
        SpecError: A file cannot be read, or the spec does not build.
    """
    name = str(path) if name is None else name
    try:
        data = files.table(path, _resolved(path), name)
    except (OSError, ValueError) as exc:
        raise SpecError([f"{name}: cannot read: {_why(exc)}"]) from exc
    if data is None:  # pragma: no cover - a first read is never one already refused
        raise SpecError([])
    return _built(data, name, os.path.dirname(name), _Route((), files))


def read_toml(path: Path) -> _Table:
    """Return the TOML table of ``path``; a failure to open or read it is left to the caller.

    The one way fsm_cache reads TOML (specs, and the ``pyproject.toml`` settings of
    ``verify`` and ``audit``): bounded in size, depth and integer length.

    The caller names the fault: the file itself for :func:`load_spec`, the
    composition's key for a region file.

    Raises:
        OSError: The file cannot be opened or read (missing, a directory, ...),
            or is not a regular file (:func:`_regular`).
        ValueError: The path cannot name a file (it holds a NUL character).
        SpecError: Larger than :data:`MAX_BYTES`, not UTF-8, or not TOML
            (including integers too long to convert and nesting too deep for
            the parser).
    """
    return _toml(read_bytes(path), path)


def read_bytes(path: Path, name: str | None = None) -> bytes:
    """Return the bytes of ``path``, a regular file of at most :data:`MAX_BYTES`.

    The one way a spec file is read (:func:`read_toml`, and every file a
    load reaches), so what a load read is what it built. A file too large
    is named ``name`` (by default, ``path``): the path as the user gave it,
    which a :class:`Path` does not keep (``./x.toml`` is ``x.toml`` to it).

    Raises:
        OSError, ValueError: As :func:`read_toml`.
        SpecError: It is larger than :data:`MAX_BYTES`.
    """
    _regular(os.stat(path).st_mode)  # before opening: a FIFO's open waits for a writer
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # nor waits for one put there since
    try:
        _regular(os.fstat(fd).st_mode)
        with os.fdopen(fd, "rb", closefd=False) as file:
            raw = file.read(MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        shown_as = path if name is None else name
        raise SpecError([f"{shown_as}: larger than {MAX_BYTES // 2**20} MiB; not a spec file"])
    return raw


def _toml(raw: bytes, path: str | Path) -> _Table:
    """Return the TOML table of ``raw``, the bytes of the file ``path`` names.

    Raises:
        SpecError: Not UTF-8, or not TOML (as :func:`read_toml`).
    """
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except ValueError as exc:  # TOMLDecodeError, UnicodeDecodeError, int digit limit
        raise SpecError([f"{path}: invalid TOML: {exc}"]) from exc
    except RecursionError as exc:  # tomllib parses nested arrays and tables recursively
        raise SpecError([f"{path}: invalid TOML: nested too deeply"]) from exc


_SPECIAL = (
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _regular(mode: int) -> None:
    """Return if ``mode`` is a regular file's, else raise the OSError that names what it is.

    Reading a named pipe waits for a writer forever, and a device may never
    end (``/dev/zero``) or act on being opened: a spec is a regular file.

    Raises:
        IsADirectoryError: A directory, in the OS's words (``Is a directory``).
        OSError: Anything else that is not a regular file
            (``not a regular file (a named pipe)``).
    """
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
    what = next((name for test, name in _SPECIAL if test(mode)), "of an unknown type")
    raise OSError(errno.EINVAL, f"not a regular file ({what})")


def unreadable(path: Path) -> str | None:
    """Return why ``path`` is not a regular file one can read, in the OS's words; None if it is.

    For a file read by other means than :func:`read_toml` (an ``--ops``
    module imported by Python): a named pipe would make the import wait for a
    writer forever.
    """
    try:
        _regular(os.stat(path).st_mode)
    except (OSError, ValueError) as exc:
        return _why(exc)
    return None


def _why(exc: OSError | ValueError) -> str:
    """Return why a file could not be read: the OS's words (``No such file or directory``)."""
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def _check_shape(data: object, source: str) -> None:
    """Refuse data that is not a table, nests deeper than :data:`MAX_DEPTH` or has odd keys.

    Walks ``data`` without recursion, so it is safe on any depth, and a table
    that contains itself counts as too deep. TOML always gives a table with
    string keys; a Python caller of :func:`spec_from_dict` may not.

    Raises:
        SpecError: The first such fault, naming the key (its first levels) at fault.
    """
    if not isinstance(data, Mapping):
        raise SpecError([f"{source}: the top level must be a table, got {shown(data)}"])
    stack: list[tuple[object, int, tuple[str, ...]]] = [(data, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        where = "".join(path)[1:] if path and path[0].startswith(".") else "".join(path)
        if depth > MAX_DEPTH:
            raise SpecError([f"{source}: {where}: nested deeper than {MAX_DEPTH} levels"])
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    at = f"{where}: " if where else ""
                    raise SpecError([f"{source}: {at}keys must be strings, got {shown(key)}"])
                stack.append((item, depth + 1, path if len(path) >= 3 else (*path, f".{key}")))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                stack.append((item, depth + 1, path if len(path) >= 3 else (*path, f"[{i}]")))


def spec_from_dict(data: _Table, source: str = "<python>", base: Path | None = None) -> Spec:
    """Build and validate a spec from the TOML-shaped ``data``.

    Raises:
        SpecError: As for :func:`load_spec`.
    """
    from fsm_cache.spec.validate import validate

    _check_shape(data, source)
    route = _Route.start()
    spec = _built(data, source, _folder(base), route)
    validate(spec, route.files.chains())
    return spec


def _folder(base: Path | None) -> str:
    """Return the folder ``base`` of a Python caller as the text the files it holds are named from."""
    return "" if base is None else os.fspath(base)


def _built(data: _Table, source: str, base: str, route: _Route) -> Spec:
    """Return the unvalidated spec of ``data``, a composition's or a machine's, reached by ``route``.

    ``base`` is the folder of the file ``source``, as named (empty: the
    working directory): the files it names are named from it.

    Raises:
        SpecError: It does not build, or holds both kinds (:func:`_kind`).
    """
    if _kind(data, source) == "composition":
        return _composition(data, source, base, route)
    return _machine(data, source, base, route)


def _kind(data: _Table, source: str) -> str:
    """Return which spec the file ``source``'s table ``data`` holds: ``machine`` or ``composition``.

    A table with neither is a machine's, whose build reports it.

    Raises:
        SpecError: It holds both, which one file cannot be.
    """
    if "composition" not in data:
        return "machine"
    if "machine" in data:
        msg = f"{source}: holds both a [machine] and a [composition] table; a spec file is one of them"
        raise SpecError([msg])
    return "composition"


def machine_from_dict(
    data: _Table,
    source: str = "<python>",
    base: Path | None = None,
    chain: tuple[str, ...] = (),
) -> MachineSpec:
    """Build a :class:`MachineSpec` from TOML-shaped data, without validating it.

    A machine that ``extends`` another takes what it does not set from its
    base, so nothing is reported missing from it: a base that cannot be read
    or built is reported once, not followed by what its absence leaves unset.

    Args:
        data: The TOML-shaped table.
        source: Where the data came from, for error locations.
        base: The folder ``machine.extends`` is relative to (default: the
            working directory).
        chain: The files whose ``extends`` led here, outermost first: a cycle
            through them, or more than :data:`MAX_EXTENDS`, is refused.

    Raises:
        SpecError: A table or key is missing, mistyped or does not parse, the
            data is not a table or nests too deeply (:data:`MAX_DEPTH`), or the
            machine it extends cannot be read.
    """
    return _machine(data, source, _folder(base), _Route.start(chain))


def _machine(data: _Table, source: str, base: str, route: _Route) -> MachineSpec:
    """:func:`machine_from_dict`, reached by ``route``."""
    _check_shape(data, source)
    problems = _Problems(source)
    _known_keys(
        data, {"machine", "counters", "states", "transition", "forbid", "events"}, "", problems
    )
    if "machine" not in data:  # an empty file, or another TOML file: not a spec missing keys
        problems.add_file(NO_SPEC)
        problems.check()
    head = _table(data, "machine", problems)
    _known_keys(head, {"name", "initial", "doc", "label", "extends"}, "machine", problems)
    extending = "extends" in head
    parent = _extended("machine", head, base, route.then(source, _EXTENDS), problems)
    basis = parent if isinstance(parent, MachineSpec) else None
    counters = _counters(data.get("counters", {}), problems)
    states = _states(data.get("states", {}), problems, required=not extending)
    if basis is not None:
        redeclared = _Redeclared(basis, route.files, problems)
        redeclared.refuse("counter", [name for name, _ in counters], basis.counter_names)
        redeclared.refuse("state", [state.name for state in states], basis.state_names)
    transitions = _transitions(data.get("transition", []), problems)
    forbids = _forbids(data.get("forbid", []), "forbid", problems)
    events = _events(data.get("events", {}), problems)
    if basis is not None:  # a second doc would be ignored: event_doc reads the first
        documented = [event.name for event in basis.events]
        redeclared.refuse("event", [event.name for event in events], documented)
    for key in ("name", "initial"):
        value = head.get(key, getattr(basis, key, None))
        if not isinstance(value, str) and (key in head or not extending):
            problems.add(f"machine.{key}", "missing or not a string")
    if isinstance(head.get("name"), str) and (bad := bad_title(head["name"])) is not None:
        problems.add("machine.name", f"{bad}: {shown(head['name'])}")
    doc, label = _text(head, "doc", "machine", problems), _line(head, "label", "machine", problems)
    problems.check()
    route.files.bases[source] = _lineage(basis, route.files)
    return MachineSpec(
        name=head.get("name", getattr(basis, "name", "")),
        initial=head.get("initial", getattr(basis, "initial", "")),
        counters=(*(basis.counters if basis else ()), *counters),
        states=(*(basis.states if basis else ()), *states),
        transitions=(*(basis.transitions if basis else ()), *transitions),
        forbids=(*(basis.forbids if basis else ()), *forbids),
        events=(*(basis.events if basis else ()), *events),
        doc=doc or (basis.doc if basis else ""),
        label=label or (basis.label if basis else "instance"),
        source=source,
        origins=_origins(basis, "initial" in head),
    )


def _origins(basis: MachineSpec | None, initial: bool) -> tuple[tuple[str, str], ...]:
    """Return the :attr:`~MachineSpec.origins` of a machine extending ``basis``.

    Each counter of the base, and its ``machine.initial`` unless the machine
    sets its own (``initial``), is declared in the file the base names for it,
    or else the base's own.
    """
    if basis is None:
        return ()
    keys = [f"counters.{name}" for name in basis.counter_names]
    keys += [] if initial else ["machine.initial"]
    return tuple((key, basis.origin(key) or basis.source) for key in keys)


def _extended(
    kind: str, head: _Table, base: str, route: _Route, problems: _Problems
) -> Spec | None:
    """Return the unvalidated spec ``head.extends`` names (:func:`_named_file`), if any.

    ``route`` holds the files that led here, this one last; a base among them
    closes a cycle, reported here and nowhere else. A base of another kind
    than ``kind`` is reported here too, and not built.
    """
    rel = head.get("extends")
    if rel is None:
        return None
    where = f"{kind}.extends"
    if not isinstance(rel, str) or not rel or "\0" in rel:
        problems.add(where, f"must be the file name of a spec, got {shown(rel)}")
        return None
    return _follow(where, rel, kind, base, route, problems)


def _follow(  # noqa: PLR0917 (one reference: its key, its file, its kind, from where, how)
    where: str, rel: str, kind: str, base: str, route: _Route, problems: _Problems
) -> Spec | None:
    """Return the unvalidated ``kind`` spec the file ``rel`` names (:func:`_named_file`), or None.

    ``where`` is the key that names it; ``route`` the files that led here,
    the one holding ``where`` last. Each fault of the reference itself (a
    cycle, a chain of more than :data:`MAX_EXTENDS`, a file that cannot be
    read, no shipped spec of the name, or one of another kind) is reported at ``where``; the file's own
    faults name that file, once in a load however often it is reached
    (:class:`_Files`).
    """
    named, links = _named_file(where, rel, base, problems), route.links
    if named is None:
        return None
    name = route.files.name(named)
    path = Path(name)
    cycle = _cycle(path, links)
    extending = len(links) - next(
        (i + 1 for i in reversed(range(len(links))) if links[i].how != _EXTENDS), 0
    )  # this file and those that extend it, up to the composition whose region it is
    if cycle:
        problems.add(where, f"a cycle: {''.join(f'{c.source}{c.how}' for c in cycle)}{name}")
        return None
    if extending > MAX_EXTENDS:
        problems.add(where, f"more than {MAX_EXTENDS} specs extend one another")
        return None
    target = _resolved(path)
    try:
        data = route.files.table(path, target, name)
        if data is None:  # no spec file, reported where it was first read
            problems.failed = True
        elif _kind(data, name) != kind:
            problems.add(where, f"{rel} is not a [{kind}] file")
        else:
            key = None if target is None else (target, extending)
            return route.files.spec(data, name, route, key)
    except (OSError, ValueError) as exc:
        problems.add(where, f"cannot read {name}: {_why(exc)}")
    except SpecError as exc:
        problems.include(exc)
    return None


def _named_file(where: str, rel: str, base: str, problems: _Problems) -> str | None:
    """Return the path of the file ``rel`` names: relative to the folder ``base``, or a shipped spec's.

    ``fsm_cache:NAME`` (:data:`~fsm_cache.spec.shipped.SHIPPED`) names the
    shipped spec ``NAME`` in the installed package; a name that is none is
    reported at ``where``, with the names there are, and gives None.

    The path is what the file's faults name it: ``rel`` as written, joined
    to the folder of the file that names it as that file is named, with
    nothing normalised. That is a path the user can open from where the
    command ran, spelled as the two files they wrote spell it:
    ``./sub/a.toml`` extending ``b.toml`` names ``./sub/b.toml``, where a
    :class:`Path` said ``sub/b.toml``. ``rel`` alone (``b.toml``) would be
    relative to a folder the message does not name.
    """
    try:
        shipped = shipped_file(rel)
    except SpecError as exc:
        problems.add(where, exc.problems[0])
        return None
    return os.path.join(base, rel) if shipped is None else str(shipped)


def _cycle(path: Path, links: tuple[_Link, ...]) -> tuple[_Link, ...]:
    """Return the links from the first file that is ``path`` on: the cycle it closes.

    Files are compared resolved, so ``./a.toml`` is ``a.toml``; empty when ``path``
    is not among them.
    """
    target = _resolved(path)
    if target is None:  # a symlink loop; reading the file reports it
        return ()
    first = next((i for i, link in enumerate(links) if link.resolved == target), None)
    return () if first is None else links[first:]


def _composition(data: _Table, source: str, base: str, route: _Route) -> System:
    """Build a :class:`System` from TOML-shaped data, reached by ``route``, without validating it."""
    problems = _Problems(source)
    _known_keys(data, {"composition", "forbid"}, "", problems)
    head = _table(data, "composition", problems)
    _known_keys(
        head, {"name", "regions", "doc", "label", "extends", "births"}, "composition", problems
    )
    extending = "extends" in head
    parent = _extended("composition", head, base, route.then(source, _EXTENDS), problems)
    basis = parent if isinstance(parent, System) else None
    regions = dict(basis.regions) if basis else {}
    regions_table = head.get("regions", {} if extending else None)
    if not isinstance(regions_table, Mapping) or not (regions_table or regions or extending):
        problems.add("composition.regions", "missing: a table of REGION = 'machine.toml'")
        problems.check()
    own = cast("_Table", regions_table)
    for region, rel in own.items():
        on = route.then(source, f", whose region {region} is ")
        machine = _region(f"composition.regions.{region}", rel, base, on, problems)
        if machine is not None:
            regions[region] = machine
    forbids = _forbids(data.get("forbid", []), "forbid", problems)
    births = _births(head.get("births", {}), source, problems)
    for birth in births:
        if basis is not None and birth.name in (b.name for b in basis.births):
            why = _redeclared("birth", birth.name, basis, route.files)
            problems.add(f"composition.births.{birth.name}", why)
    if not isinstance(head.get("name"), str):
        problems.add("composition.name", "missing or not a string")
    elif (bad := bad_title(head["name"])) is not None:
        problems.add("composition.name", f"{bad}: {shown(head['name'])}")
    doc = _text(head, "doc", "composition", problems)
    label = _line(head, "label", "composition", problems)
    problems.check()
    route.files.bases[source] = _lineage(basis, route.files)
    return System(
        name=head["name"],
        regions=tuple(regions.items()),
        forbids=(*(basis.forbids if basis else ()), *forbids),
        doc=doc or (basis.doc if basis else ""),
        label=label or (basis.label if basis else "instance"),
        source=source,
        births=(*(basis.births if basis else ()), *births),
        origins=tuple(
            (key, basis.origin(key) or basis.source)
            for key in (f"composition.regions.{r}" for r, _ in basis.regions if r not in own)
        )
        if basis
        else (),
    )


def _lineage(basis: Spec | None, files: _Files) -> tuple[Spec, ...]:
    """Return the specs a spec whose base is ``basis`` builds on, ``basis`` first (none without one)."""
    return () if basis is None else (basis, *files.bases.get(basis.source, ()))


def _declares(spec: Spec, kind: str, name: str) -> bool:
    """Return whether ``spec`` has the ``kind`` (``counter``, ``state``, ``event``, ``birth``) called ``name``."""
    if isinstance(spec, System):
        return name in (b.name for b in spec.births)
    if kind == "event":
        return name in (event.name for event in spec.events)
    return name in (spec.counter_names if kind == "counter" else spec.state_names)


@dataclass(frozen=True)
class _Redeclared:
    """Files a problem for each name a spec extending ``basis`` redeclares."""

    basis: Spec
    files: _Files
    problems: _Problems

    def refuse(self, kind: str, names: Iterable[str], known: Collection[str]) -> None:
        """File each of ``names`` that ``known`` (the basis's ``kind`` names) already holds."""
        for name in (n for n in names if n in known):
            self.problems.add(f"{kind}s.{name}", _redeclared(kind, name, self.basis, self.files))


def _redeclared(kind: str, name: str, basis: Spec, files: _Files) -> str:
    """Return why a spec extending ``basis`` may not redeclare its ``kind`` called ``name``.

    The file named is the one that declares it, which a chain of ``extends``
    may reach only through others (named too): the base's own file would not
    hold it.
    """
    lineage = _lineage(basis, files)
    depth = max((i for i, spec in enumerate(lineage) if _declares(spec, kind, name)), default=0)
    rule = f"(a spec that extends another may not redeclare its {kind}s)"
    article = "an" if kind[0] in "aeiou" else "a"
    if depth == 0:
        return f"already {article} {kind} of the base {basis.source} {rule}"
    through = ", ".join(spec.source for spec in lineage[:depth])
    return f"already {article} {kind} of {lineage[depth].source}, which this spec builds on through {through} {rule}"


def _births(table: object, source: str, problems: _Problems) -> tuple[Birth, ...]:
    """Parse ``[composition.births]``: ``NAME = { doc = ..., states = { REGION = STATE } }``.

    Each birth keeps ``source``, its file: one a spec inherits through ``extends``
    is reported, if the regions that spec replaces no longer have its states, as
    declared in the base.
    """
    if not isinstance(table, Mapping):
        problems.add("composition.births", "must be a table of NAME = { doc, states }")
        return ()
    result = []
    for name, body in table.items():
        where = f"composition.births.{name}"
        if (bad := bad_name(name)) is not None:
            problems.add(where, bad)
        if not isinstance(body, Mapping):
            problems.add(where, "must be a table")
            continue
        _known_keys(body, {"doc", "states"}, where, problems)
        states = body.get("states")
        if (
            not isinstance(states, Mapping)
            or not states
            or not all(isinstance(v, str) for v in states.values())
        ):
            problems.add(
                f"{where}.states", f"must be a table of REGION = 'state', got {shown(states)}"
            )
            continue
        doc = _text(body, "doc", where, problems)
        pairs = tuple((str(r), str(st)) for r, st in states.items())
        result.append(Birth(name, pairs, doc, source))
    return tuple(result)


def _region(
    where: str, rel: object, base: str, route: _Route, problems: _Problems
) -> MachineSpec | None:
    """Read one region's machine file (relative to the composition), not yet validated.

    Faults of the region's own content name the region's file; a file that is
    missing or unreadable, or one that leads back to a file of ``route`` (the
    composition's own, last), names the composition's key that points at it.
    """
    if not isinstance(rel, str) or not rel or "\0" in rel:  # no file name holds a NUL
        problems.add(where, f"must be the file name of a machine, got {shown(rel)}")
        return None
    machine = _follow(where, rel, "machine", base, route, problems)
    return machine if isinstance(machine, MachineSpec) else None


def _table(data: _Table, key: str, problems: _Problems) -> _Table:
    value = data.get(key)
    if not isinstance(value, Mapping):
        problems.add(key, "missing table")
        return {}
    return value


def _counters(table: object, problems: _Problems) -> tuple[tuple[str, int], ...]:
    if not isinstance(table, Mapping):
        problems.add("counters", "must be a table of NAME = INT")
        return ()
    result = []
    for name, value in table.items():
        if (bad := bad_name(name)) is not None:
            problems.add(f"counters.{name}", bad)
        elif not whole(value):
            problems.add(
                f"counters.{name}", f"initial value must be an integer >= 0, got {shown(value)}"
            )
        elif value >= 10**MAX_DIGITS:  # as for guards' constants: derived values must print
            problems.add(f"counters.{name}", f"initial value has more than {MAX_DIGITS} digits")
        else:
            result.append((name, value))
    return tuple(result)


def _states(table: object, problems: _Problems, required: bool = True) -> tuple[StateSpec, ...]:
    if not isinstance(table, Mapping) or (required and not table):
        problems.add("states", "missing: a table of NAME = { doc = ... }")
        return ()
    result = []
    for name, body in table.items():
        where = f"states.{name}"
        if (bad := bad_name(name)) is not None:
            problems.add(where, bad)
        if not isinstance(body, Mapping):
            problems.add(where, "must be a table")
            continue
        _known_keys(body, {"doc", "final", "invariant", "counter"}, where, problems)
        invariant = _parse(parse_guard, body.get("invariant", ""), f"{where}.invariant", problems)
        final, counter = body.get("final", False), body.get("counter")
        if not isinstance(final, bool):
            problems.add(f"{where}.final", f"must be true or false, got {shown(final)}")
        if counter is not None and not isinstance(counter, str):
            problems.add(f"{where}.counter", f"must be a counter name, got {shown(counter)}")
        doc = _text(body, "doc", where, problems)
        result.append(
            StateSpec(
                name, doc, final is True, invariant or parse_guard(""), counter, problems.source
            )
        )
    return tuple(result)


def _transitions(items: object, problems: _Problems) -> tuple[Transition, ...]:
    result = []
    for i, body in enumerate(_array(items, "transition", problems)):
        where = f"transition[{i}]"
        _known_keys(
            body,
            {"event", "source", "dest", "guard", "update", "effect", "propagate", "doc"},
            where,
            problems,
        )
        guard = _parse(parse_guard, body.get("guard", ""), f"{where}.guard", problems)
        update = _parse(parse_update, body.get("update", ""), f"{where}.update", problems)
        event, dest = _name(body, "event", where, problems), _name(body, "dest", where, problems)
        sources = _names(body.get("source"), f"{where}.source", problems)
        effect, propagate = body.get("effect"), body.get("propagate")
        listed = _listed(effect, f"{where}.effect", problems)
        if not listed and effect is not None and (bad := bad_name(effect)) is not None:
            problems.add(f"{where}.effect", f"{bad}: {shown(effect)}")
        if propagate not in (None, "ancestors"):
            problems.add(f"{where}.propagate", f"must be 'ancestors', got {shown(propagate)}")
        doc = _text(body, "doc", where, problems)
        if guard is None or update is None:
            continue
        result.append(
            Transition(event, sources, dest, guard, update, effect, propagate, doc, problems.source)
        )
    return tuple(result)


def _forbids(items: object, key: str, problems: _Problems) -> tuple[Forbid, ...]:
    result = []
    for i, body in enumerate(_array(items, key, problems)):
        where = f"{key}[{i}]"
        _known_keys(body, {"event", "source", "error", "reason", "guard", "when"}, where, problems)
        guard = _parse(parse_guard, body.get("guard", ""), f"{where}.guard", problems)
        when_raw = body.get("when", [])
        when_list = [when_raw] if isinstance(when_raw, str) else when_raw
        if not isinstance(when_list, list):
            problems.add(
                f"{where}.when", f"must be a condition or a list of them, got {shown(when_raw)}"
            )
            when_list = []
        when = [_parse(parse_condition, c, f"{where}.when", problems) for c in when_list]
        sources = _names(body["source"], f"{where}.source", problems) if "source" in body else ()
        event, error = _name(body, "event", where, problems), _name(body, "error", where, problems)
        if not isinstance(body.get("reason"), str):
            problems.add(f"{where}.reason", "missing or not a string")
        else:
            _line(body, "reason", where, problems)
        if guard is None or None in when:
            continue
        conditions = tuple(c for c in when if c is not None)
        reason = str(body.get("reason"))
        result.append(Forbid(event, sources, error, reason, guard, conditions, problems.source))
    return tuple(result)


def _events(table: object, problems: _Problems) -> tuple[EventSpec, ...]:
    if not isinstance(table, Mapping):
        problems.add("events", "must be a table of EVENT = { doc = ..., past = ... }")
        return ()
    result = []
    for name, body in table.items():
        where = f"events.{name}"
        if (bad := bad_name(name)) is not None:
            problems.add(where, bad)
        if not isinstance(body, Mapping):
            problems.add(where, "must be a table")
            continue
        _known_keys(body, {"doc", "past"}, where, problems)
        doc, past = _text(body, "doc", where, problems), _line(body, "past", where, problems)
        result.append(EventSpec(name, doc, past, problems.source))
    return tuple(result)


def _array(items: object, key: str, problems: _Problems) -> list[_Table]:
    if not isinstance(items, list) or not all(isinstance(x, Mapping) for x in items):
        problems.add(key, f"must be an array of tables ([[{key}]])")
        return []
    return items


def _known_keys(body: _Table, allowed: set[str], where: str, problems: _Problems) -> None:
    for key in body:
        if key not in allowed:
            at = f"{where}.{key}" if where else key
            problems.add(at, f"unknown key (allowed: {', '.join(sorted(allowed))})")


def _name(body: _Table, key: str, where: str, problems: _Problems) -> str:
    value = body.get(key)
    bad = bad_name(value)
    if _listed(value, f"{where}.{key}", problems):
        return ""
    if bad is not None:
        shown_bad = f"missing or {bad}: {shown(value)}" if bad == NOT_A_NAME else bad
        problems.add(f"{where}.{key}", shown_bad)
        return ""
    return str(value)


def _listed(value: object, at: str, problems: _Problems) -> bool:
    """Report ``value`` at ``at`` if it is a list where one name goes; return whether it was.

    A transition's or a refusal's ``source`` takes a list, its ``event`` (or
    ``effect``) one name: a list there is an easy slip, and read as no name at
    all it was reported as ``missing or not an identifier``.
    """
    if not isinstance(value, list):
        return False
    problems.add(at, f"one name, not a list: {shown(value)}")
    return True


def _line(body: _Table, key: str, where: str, problems: _Problems) -> str:
    """Return the optional ``body[key]`` ("" if absent), one line of printable text.

    For what a refusal's message or a diagram shows inline (a label, a past
    tense, a reason): a line break or an escape code there would forge a line
    of its own (``error: ...``) or colour the terminal.
    """
    value = _text(body, key, where, problems)
    if value and not value.isprintable():
        problems.add(f"{where}.{key}", f"{NOT_A_TITLE}: {shown(value)}")
        return ""
    return value


def _text(body: _Table, key: str, where: str, problems: _Problems) -> str:
    """Return the optional text ``body[key]`` ("" if absent), reporting a non-string."""
    value = body.get(key, "")
    if not isinstance(value, str):
        problems.add(f"{where}.{key}", f"must be a string, got {shown(value)}")
        return ""
    return value


def _names(value: object, where: str, problems: _Problems) -> tuple[str, ...]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        problems.add(where, f"must be a state name or a list of them, got {shown(value)}")
        return ()
    return tuple(names)


def _parse(parser: Any, text: object, where: str, problems: _Problems) -> Any:
    if not isinstance(text, str):
        problems.add(where, f"must be a string, got {shown(text)}")
        return None
    try:
        return parser(text)
    except GrammarError as exc:
        problems.add(where, str(exc))
        return None


def spec_files(path: Path) -> list[Path]:
    """Return the files a spec is read from: ``path``, what it extends, its regions' files.

    What a command must never write over, and what the pytest plugin watches
    for edits. They are the files a load of ``path`` goes to read, in the
    order it does, each once (compared by real path): the loader's own walk,
    so there is one rule of which keys name files. A file that cannot be
    read is among them; where the spec does not load, so are the files the
    load reached before it stopped following (a file of the wrong kind, a
    cycle), which are those it depends on.
    """
    files = _Files()
    with contextlib.suppress(SpecError):
        _unvalidated(path, files)
    return [Path(name) for name in files.reached.values()]
