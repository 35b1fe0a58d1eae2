"""The files the CLI generates: reading them for ``--check``, writing them for ``--write``.

``fsm-cache types`` and ``fsm-cache diagram`` write through :func:`write_files`
alone, so both keep the same promise: a command that fails changes nothing.
Each new text goes to a staging file beside its target and is renamed over the
target only when every staging file is written; a failure before that removes
the staging files and any folder the command made, and the message names the
target (never a staging file) and says that nothing was changed. A target that
is one of the spec files the command reads is refused before anything is
written: ``fsm-cache types d.toml --write d.toml`` would otherwise replace the
spec with its own stub. So is any ``.toml`` target, read or not (another spec,
a ``pyproject.toml``): fsm_cache generates no TOML. Both commands' files carry
a mark (``types``: the stub's first line; ``diagram``: a comment in each
format's first or second line), and an existing target without it is refused,
so a module of the user's code or a README named by mistake is left whole.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from fsm_cache.errors import FsmCacheError
from fsm_cache.shell import STDIO, path_argument


_SPEC_SUFFIX = ".toml"
"""The suffix of specs and settings: input, never a file a command generates."""

_STAGING_TRIES = 16
"""How many random staging names to try before giving up (one is almost always enough)."""

_HEAD_BYTES = 64 * 1024
"""How much of an existing target a command's ``ours`` test is shown: a mark is at the top."""


class OutputError(FsmCacheError):
    """A generated file cannot be checked or written; on a write, nothing was changed."""


STDOUT = Path("-")
"""What :func:`output_argument` returns for ``-``: stdout, as in most tools.

Told by identity (``path is STDOUT``): a file named ``-`` (``./-``) comes
back absolute from :func:`file_argument`, so it never equals this either.
"""


def file_argument(text: str) -> Path:
    """Return ``text`` as the :class:`Path` of a file to write or check (an argparse ``type``).

    Refused like any path when empty or ``-``
    (:func:`~fsm_cache.shell.path_argument`: a file named ``-`` was written
    or read instead, and ``./-`` names one), and when it names a folder by
    its spelling: a trailing ``/``, or a last part ``.`` or ``..``.
    :class:`Path` drops a trailing ``/`` and a ``.`` part, so ``--write
    out/`` would otherwise write a file named ``out``. A file named ``-``
    comes back absolute, so that what the command prints (``wrote /work/-``)
    cannot be read as stdout.

    Raises:
        argparse.ArgumentTypeError: ``text`` is empty, ``-``, or names a folder.
    """
    path = path_argument(text)
    if os.path.basename(text) in ("", os.curdir, os.pardir):
        raise argparse.ArgumentTypeError(f"{text}: names a folder, not a file")
    return path.absolute() if str(path) == STDIO else path


def output_argument(text: str) -> Path:
    """Return ``text`` as the :class:`Path` of a file to write, or :data:`STDOUT` for ``-``.

    Otherwise as :func:`file_argument`.

    Raises:
        argparse.ArgumentTypeError: ``text`` is empty or names a folder.
    """
    return STDOUT if text == STDIO else file_argument(text)


def current_text(
    path: Path, kind: str = "", ours: Callable[[str], bool] | None = None
) -> str | None:
    """Return the text of a generated file: None when missing, ``""`` when not UTF-8.

    A ``.toml`` path is refused as :func:`write_files` refuses it: no command
    generates one, so ``--check`` would call it stale and advise a
    ``--write`` that refuses it. So is, with ``ours``, an existing file that
    is neither empty nor one ``ours`` recognises (``types``: a module of the
    user's code), for the same reason.

    A file that is not UTF-8 is not what fsm_cache generated either: it reads
    as an empty text, so ``--check`` calls it stale and ``--write`` rewrites it
    instead of failing on the decode (where ``ours`` takes it). A path that
    is there but no regular file (a folder, a FIFO, ``/dev/zero``) is an
    error rather than "missing": the user named the wrong thing, and reading
    a FIFO would block.

    Args:
        path: The generated file.
        kind: What the file is (``types``), for messages.
        ours: As :func:`write_files`'s: whether the beginning of an existing
            file's text is a file of ``kind`` the command wrote; None takes
            any regular file.

    Raises:
        OutputError: The path is a ``.toml`` file, is not a regular file, is
            not one ``ours`` recognises, or cannot be read.
    """
    toml = _toml(path)
    if toml:
        raise OutputError(toml)
    try:
        status = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OutputError(f"{path}: cannot read: {_why(exc)}") from None
    if not stat.S_ISREG(status.st_mode):
        raise OutputError(f"{path}: not a regular file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise OutputError(f"{path}: cannot read: {_why(exc)}") from None
    if not _recognised(data[:_HEAD_BYTES], ours):
        raise OutputError(_foreign(path, kind))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return ""


def write_files(
    texts: Mapping[Path, str],
    kind: str,
    protected: Iterable[Path] = (),
    ours: Callable[[str], bool] | None = None,
) -> list[Path]:
    """Write each file whose text changed, all or none; return the files written.

    Every target is checked first: it must not be one of ``protected`` (the
    spec files the command read) nor be named ``*.toml`` (through a link
    too), and it must be a regular file or not there yet, under a path whose
    first existing folder is a folder; with ``ours``, an existing target
    must be empty or pass it (a file the command wrote). Each new text
    is then written to a staging file beside its target (a short random name,
    so a target name of any legal length has one), flushed to disk, and only
    when all are written are they renamed over their targets. Missing folders
    of the path as named are made on the way (never those of a link's
    target); on a failure the staging files and those folders are removed. A
    target that is a symbolic link is written through: the file it points at
    is replaced, the link stays; a link into a folder that does not exist is
    refused.

    Args:
        texts: The new text of each target.
        kind: What the files are (``diagram``, ``types``), for messages:
            ``...; no diagram file was changed``.
        protected: Files that must not be written (the specs read).
        ours: Whether the beginning of an existing target's text is a file
            of ``kind`` the command wrote; None takes any regular file.

    Raises:
        OutputError: A target is a protected file, a ``.toml`` file, not a
            regular file, not one ``ours`` recognises, under a file, or
            cannot be read or written; the message names the target and says
            that nothing was changed. A rename that fails after others
            succeeded undoes them (each old file is hard-linked to a spare
            name first); only where that cannot be done (no hard links) are
            some files left new, and the message says how many.
    """
    unchanged = f"no {kind} file was changed"
    guarded = _identities(protected)
    for path in texts:
        _check_target(path, guarded, unchanged)
        _check_generated(path, kind, ours, unchanged)
    changed = [
        (path, Path(os.path.realpath(path)), text)
        for path, text in texts.items()
        if _differs(path, text)
    ]
    made: list[Path] = []
    staged: list[tuple[Path, Path]] = []
    failed_at = None
    try:
        for path, real, text in changed:
            failed_at = path
            _make_folders(path.parent, made)  # the named path's: never a link's target's
            if not real.parent.is_dir():  # a link whose target's folder is missing
                raise FileNotFoundError(
                    errno.ENOENT, f"it links to {real}, in a folder that does not exist"
                )
            staged.append((_stage(real, text), real))
    except BaseException as exc:
        _discard([temporary for temporary, _ in staged], made)
        if isinstance(exc, OSError):
            msg = f"{failed_at}: cannot write: {_why(exc)}; {unchanged}"
            raise OutputError(msg) from None
        raise
    kept = _keep_old([real for _, real in staged])
    for done, ((temporary, real), (path, _, _)) in enumerate(zip(staged, changed, strict=True)):
        try:
            temporary.replace(real)
        except BaseException as exc:  # a rename in a folder just written to: next to never
            undone = _undo([r for _, r in staged[:done]], kept)
            _discard([t for t, _ in staged[done:]] + [k for k in kept.values() if k], made)
            if not isinstance(exc, OSError):
                raise
            after = unchanged if undone else f"{done} of {len(staged)} {kind} files were written"
            raise OutputError(f"{path}: cannot write: {_why(exc)}; {after}") from None
    _discard([k for k in kept.values() if k], [])
    return [path for path, _, _ in changed]


def _keep_old(targets: list[Path]) -> dict[Path, Path | None]:
    """Hard-link each existing target to a spare name, so a failed set of renames can undo.

    Returns the spare name of each target that exists (None where the link
    could not be made: a filesystem without hard links); new targets are absent.
    """
    kept: dict[Path, Path | None] = {}
    for target in targets:
        if not target.exists():
            continue
        spare = target.with_name(f".fsm-cache-{secrets.token_hex(6)}.old")
        try:
            os.link(target, spare)
        except OSError:
            kept[target] = None
        else:
            kept[target] = spare
    return kept


def _undo(replaced: list[Path], kept: dict[Path, Path | None]) -> bool:
    """Put back what the renames before a failed one replaced; return whether all of it was."""
    whole = True
    for target in replaced:
        try:
            if target not in kept:
                target.unlink()  # it was new
                continue
            spare = kept.pop(target)
            if spare is None:
                whole = False  # no copy of the old file to put back
                continue
            os.replace(spare, target)
        except OSError:
            whole = False
    return whole


def _identities(paths: Iterable[Path]) -> dict[tuple[int, int], Path]:
    """Return each existing file of ``paths`` by its (device, inode): links and spellings agree."""
    found: dict[tuple[int, int], Path] = {}
    for path in paths:
        try:
            status = path.stat()
        except (OSError, ValueError):
            continue
        found.setdefault((status.st_dev, status.st_ino), path)
    return found


def _check_target(path: Path, protected: dict[tuple[int, int], Path], unchanged: str) -> None:
    """Refuse a target that is protected, not a regular file, or under something no folder.

    Raises:
        OutputError: Naming the target and why; nothing was changed.
    """
    try:
        status = path.stat()
    except (FileNotFoundError, NotADirectoryError):  # not there, or under a file: see below
        status = None
    except OSError as exc:  # too long a name, a symlink loop, no permission to look
        raise OutputError(f"{path}: cannot write: {_why(exc)}; {unchanged}") from None
    if status is not None:
        spec = protected.get((status.st_dev, status.st_ino))
        if spec is not None:
            same = os.path.abspath(spec) == os.path.abspath(path)
            which = "a spec file" if same else f"{spec}, a spec file"
            msg = f"{path}: is {which} this command reads; {unchanged}"
            raise OutputError(msg)
        if not stat.S_ISREG(status.st_mode):
            raise OutputError(f"{path}: not a regular file; {unchanged}")
        return
    parent = path.parent
    try:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        folder = parent.is_dir()
    except OSError as exc:
        raise OutputError(f"{path}: cannot write: {_why(exc)}; {unchanged}") from None
    if not folder:
        raise OutputError(f"{path}: {parent} is not a folder; {unchanged}")


def _check_generated(
    path: Path, kind: str, ours: Callable[[str], bool] | None, unchanged: str
) -> None:
    """Refuse a target (checked: a regular file or missing) that no command of ours generates.

    That is a ``.toml`` file, by its name or the name a link points to, and,
    with ``ours``, an existing file that is neither empty nor recognised.

    Raises:
        OutputError: Naming the target and why; nothing was changed.
    """
    toml = _toml(path)
    if toml:
        raise OutputError(f"{toml}; {unchanged}")
    if ours is None:
        return
    try:
        with path.open("rb") as stream:
            head = stream.read(_HEAD_BYTES)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OutputError(f"{path}: cannot read: {_why(exc)}; {unchanged}") from None
    if not _recognised(head, ours):
        raise OutputError(f"{_foreign(path, kind)}; {unchanged}")


def _recognised(head: bytes, ours: Callable[[str], bool] | None) -> bool:
    """Whether a file beginning with ``head`` may be checked or replaced: empty, or ``ours``."""
    return ours is None or not head or ours(head.decode("utf-8", errors="replace"))


def _foreign(path: Path, kind: str) -> str:
    """Return why ``path`` is neither checked nor replaced: no ``kind`` file of ours."""
    return f"{path}: is not a {kind} file fsm-cache wrote"


def _toml(path: Path) -> str:
    """Return why ``path`` is no file of ours when it is a ``.toml`` file (through a link too), else ``""``."""
    if _SPEC_SUFFIX in (path.suffix.lower(), Path(os.path.realpath(path)).suffix.lower()):
        return f"{path}: is a .toml file (a spec or settings), never one fsm-cache generates"
    return ""


def _differs(path: Path, text: str) -> bool:
    """Whether ``path`` (checked: a regular file or missing) holds other bytes than ``text``.

    A file that cannot be read (no read permission) counts as different: the
    write replaces it, or reports why it cannot.
    """
    try:
        return path.read_bytes() != text.encode("utf-8")
    except OSError:
        return True


def _make_folders(folder: Path, made: list[Path]) -> None:
    """Make ``folder`` and its missing parents, outermost first, adding each to ``made``.

    Each is added as soon as it is made, so a failure further in leaves the
    caller the list of what to remove.
    """
    missing: list[Path] = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for each in reversed(missing):
        try:
            each.mkdir()
        except FileExistsError:  # made meanwhile by someone else: not ours to remove
            continue
        made.append(each)


def _stage(target: Path, text: str) -> Path:
    """Write ``text`` to a new staging file beside ``target``, flushed to disk; return it.

    The staging file gets the target's permissions when the target exists
    (the rename must not change them), else the default ones (``0o666`` less
    the umask), as a new file written in place would.

    Raises:
        OSError: The staging file cannot be made or written; it is removed.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(_STAGING_TRIES):
        temporary = target.with_name(f".fsm-cache-{secrets.token_hex(6)}.tmp")
        try:
            descriptor = os.open(temporary, flags, 0o666)
        except FileExistsError:
            continue
        break
    else:
        raise FileExistsError(errno.EEXIST, "no free staging file name", str(target.parent))
    try:
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(text.encode("utf-8"))
            stream.flush()
            os.fsync(stream.fileno())
        if target.exists():
            os.chmod(temporary, stat.S_IMODE(target.stat().st_mode))
    except BaseException:
        _discard([temporary], [])
        raise
    return temporary


def _discard(temporaries: list[Path], folders: list[Path]) -> None:
    """Remove staging files, then the folders a failed write made (innermost first)."""
    # A file that cannot be removed, or a folder not empty (someone else wrote
    # into it meanwhile), is left: the error being reported matters more.
    for temporary in temporaries:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
    for folder in reversed(folders):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _why(exc: OSError) -> str:
    """Return the OS's words for ``exc`` (``No space left on device``), without the file name."""
    return exc.strerror or str(exc)
