"""The embedded default store: one immutable file per page under a directory.

Pages are content-addressed: the file of a page is named by its key
(``<root>/<key[:2]>/<key>.page``), so a second writer of the same page finds it
present and writes nothing, once it has read it back whole (a page there of
the first format, torn or another key's is replaced instead). A page is written to a temporary file under
``<root>/.tmp`` and renamed into place with :func:`os.replace`, so a reader
never sees part of a page under its name; a crash leaves only a temporary file.
A temporary file is named by its writer's host and process: a store opened
on the directory deletes those of this host's processes that are gone, and
any other writer's once untouched for :data:`STALE_TEMPORARY_SECONDS` by the
folder's own clock (a network folder's server's, not this host's). A
writer creates its temporary file afresh (``O_EXCL``), so a link another user
of the folder planted at that name is removed, never written through; nor is a
link planted at a page's path followed when the page's times are set. Nor is
a link that replaced a shard (``<root>/<key[:2]>``) or ``.tmp``: every page
operation opens the directory without following a link and names the file in
it, so an operation that meets such a link fails (a
:class:`~fsm_cache.errors.StoreFailed` naming it), and opening skips the shard.
Every read checks the page's header (:mod:`fsm_cache.storage.codec`).

With a byte limit, a write reserves its bytes first (:mod:`fsm_cache.storage.budget`)
and makes room by deleting the least recently used pages that no read holds.
A read holds its pages from the moment it finds them until it has read them
(:meth:`LocalFileStore.reading` holds them across a longer fetch), so they can be
neither evicted nor dropped under it: SGLang's ``HiCacheFile`` lets its evictor
unlink a file between ``batch_exists`` and ``get``. Recency is refreshed from a
prefix's last page back to its first, so eviction takes a prefix's tail before
its head, and a chain is not cut at its root while its tail is kept uselessly.
The same order holds where the store learns of pages it did not use: the files'
modification times record it (set tail first on every use) for the next start,
and a prefix a lookup finds with pages it had not indexed is ranked tail first.

Other processes may share the directory: pages they write are found by
:meth:`LocalFileStore.exists_prefix`, and pages they delete read as missing.
The byte limit and the holds are this process's: another process may delete a
page held here (a read that has opened its file still reads it whole), and a
page it deleted counts here until a lookup here misses it.
Any other disk error is a :class:`~fsm_cache.errors.StoreFailed`, and a
directory or other non-file at a page's path a
:class:`~fsm_cache.errors.CorruptPage`. Thread-safe: the index, the holds and
the budget sit behind one lock; file I/O runs outside it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import string
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from fsm_cache.errors import BadArgument, CorruptPage, LaterFormatPage, PageInUse, StoreFailed
from fsm_cache.storage import codec
from fsm_cache.storage.base import Capacity, PutResult
from fsm_cache.storage.budget import Budget, Reservation
from fsm_cache.storage.keys import check_keys


SUFFIX = ".page"

STALE_TEMPORARY_SECONDS = 3600.0
"""How long a temporary file no writer touched makes it a dead writer's, whatever its name
says: a page takes well under a second to write, and a writer on another host cannot be
asked whether it lives."""


class LocalFileStore:
    """Pages as files under ``root``, with an optional byte limit.

    Args:
        root: The directory (created if missing). Pages already there are
            indexed, oldest first, and count against the limit; temporary
            files of crashed writers are deleted (this host's at once, the
            others' once untouched for :data:`STALE_TEMPORARY_SECONDS`).
        limit_bytes: The most the pages may take on disk (headers included),
            or None for no limit.
        durable: ``fsync`` each page before renaming it into place, and the
            directories that name it after, so a page survives a power loss
            once acknowledged (slower).

    Attributes:
        reaped: Temporary files of gone writers that opening deleted.

    Raises:
        BadArgument: ``root`` is not a path, or it (or a directory above it,
            or its ``.tmp``) is not a directory; ``limit_bytes`` is neither None
            nor an int >= 0; ``durable`` is not a bool. Checked before anything
            is created.
        StoreFailed: The directory, or a page or temporary file in it, could
            not be created or looked at (no permission, a disk error);
            ``operation`` is ``open``.
    """

    def __init__(
        self, root: str | os.PathLike[str], *, limit_bytes: int | None = None, durable: bool = False
    ) -> None:
        self.root = _root(root)
        self.where = f"local {self.root}"
        if not isinstance(durable, bool):  # "no" is truthy: it would fsync every page
            raise BadArgument(f"durable must be a bool, not {durable!r}")
        self.durable = durable
        self._budget = Budget(self.where, limit_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recent first
        self._readers: dict[str, int] = {}
        # keys this process is writing, by writer: their bytes are reserved, not yet indexed
        self._writing: dict[str, int] = {}
        self._rooted: set[str] = set()  # shards whose entry in root this process synced
        self._tmp = self.root / ".tmp"
        self._temporaries = str(self._tmp)
        self._make_directory()
        try:
            self.reaped = _reap(self._tmp)
            self._scan()
        except OSError as exc:
            raise self._failed("open", 0, 0, exc) from exc

    def path(self, key: str) -> Path:
        """Return the file that holds (or would hold) the page ``key``.

        Raises:
            BadArgument: ``key`` is not a page key (``../x`` would name a file
                outside the root).
        """
        check_keys([key])
        return Path(self._named(key))

    def exists_prefix(self, keys: Sequence[str]) -> int:
        """Return how many leading ``keys`` have a page file (found files are indexed)."""
        check_keys(keys)
        with self._lock:
            return self._leading(keys, "exists")

    def get(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """Return the leading pages of ``keys`` on disk, each verified; see :class:`Store`.

        Raises:
            CorruptPage: A page file is torn, foreign, or not a regular file.
            StoreFailed: A page file could not be read (a disk error, no
                permission); ``acknowledged`` pages were read before it.
        """
        with self.reading(keys) as held:
            pages: list[torch.Tensor] = []
            for key in keys[:held]:
                page = self._read(key, len(pages), len(keys))
                if page is None:  # the rest may be gone too (another process dropped them)
                    with self._lock:
                        self._forget_lost(keys[len(pages) :])
                    break
                pages.append(page)
        self._touch(keys[: len(pages)])
        return pages

    @contextlib.contextmanager
    def reading(self, keys: Sequence[str]) -> Iterator[int]:
        """Hold the leading pages of ``keys`` that are on disk, for a fetch; yield their count.

        While held, a page is neither evicted to make room nor dropped
        (:class:`~fsm_cache.errors.PageInUse`).
        """
        check_keys(keys)
        with self._lock:
            held = list(keys[: self._leading(keys, "get")])
            self._hold(held)
        try:
            yield len(held)
        finally:
            with self._lock:
                self._unhold(held)

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[PutResult]:
        """Write ``pages`` under ``keys`` in order; see :class:`Store`.

        A page that does not fit even after evicting every page nobody reads is
        ``FULL``, with nothing evicted for it, and the pages after it are
        ``SKIPPED``. The put holds the pages it has stored until it returns, so
        it never evicts its own prefix. A page already on disk is ``PRESENT``
        once read back whole; one that reads as corrupt is replaced.

        Raises:
            StoreFailed: A file could not be written, read, looked at or evicted (the
                disk failed or filled); that page's reservation and temporary
                file are gone, and the ``acknowledged`` pages before it stay stored.
        """
        codec.check_pages(keys, pages)
        results: list[PutResult] = []
        held: list[str] = []
        try:
            for index, (key, page) in enumerate(zip(keys, pages, strict=True)):
                if results and not results[-1].held:
                    results.append(PutResult.SKIPPED)
                    continue
                results.append(self._put_one(key, page, index, len(keys), held))
        finally:
            with self._lock:
                self._unhold(held)
        self._touch(held)
        return results

    def drop(self, keys: Sequence[str]) -> int:
        """Delete the pages of ``keys``; return how many were on disk.

        A page a put of this process is writing is left, and not counted: the
        drop comes before that put, which stores it. Deleted between its
        rename into place and its put's count, it would be counted stored with
        no file, until a lookup missed it.

        Raises:
            PageInUse: A read holds one of them; nothing was deleted.
            StoreFailed: A page's file could not be deleted (a directory is in
                its place, no permission); the ``acknowledged`` leading keys
                were dropped, and the failed page is no longer counted.
        """
        check_keys(keys)
        with self._lock:
            for key in keys:
                if self._readers.get(key, 0):
                    raise PageInUse(key, self._readers[key])
            dropped = 0
            for key in dict.fromkeys(keys):
                if key in self._writing:
                    continue
                try:
                    dropped += self._delete(key)
                except OSError as exc:
                    raise self._failed("drop", keys.index(key), len(keys), exc) from exc
            return dropped

    def capacity(self) -> Capacity:
        """Return the bytes on disk, reserved by writes, and the limit."""
        with self._lock:
            budget = self._budget
            return Capacity(
                budget.used_bytes, budget.reserved_bytes, budget.limit_bytes, len(self._index)
            )

    def close(self) -> None:
        """Nothing to release: files are opened per page; the pages stay on disk."""

    def _make_directory(self) -> None:
        """Create the root and its ``.tmp``, unless something that is not a directory is in the way.

        A ``.tmp`` that is a link (another user of the folder may replace the
        directory by one) is refused: opening deletes dead writers' files in
        ``.tmp``, and would delete files of that name wherever the link points.

        Raises:
            BadArgument: The root, a directory above it, or its ``.tmp`` is a
                file (or a link to nothing), or ``.tmp`` is a link; nothing
                was created.
            StoreFailed: The directories could not be looked at or created.
        """
        try:
            blocked = _not_a_directory(self._tmp)
            if blocked is None:
                self._tmp.mkdir(parents=True, exist_ok=True)
                linked = self._tmp.is_symlink()
        except OSError as exc:
            raise self._failed("open", 0, 0, exc) from exc
        if blocked is None:
            if linked:
                raise BadArgument(f"root {self.root}: {self._tmp} is a link, not a directory")
            return
        if blocked == self.root:
            raise BadArgument(f"root {self.root} is not a directory")
        raise BadArgument(f"root {self.root}: {blocked} is not a directory")

    def _put_one(
        self, key: str, page: torch.Tensor, index: int, total: int, held: list[str]
    ) -> PutResult:
        """Store one page of a put; a page it holds after is held (and added to ``held``) at once.

        A page file already under ``key`` is read back (held meanwhile, outside
        the lock) before it is called ``PRESENT``: one of the first format,
        torn or foreign would otherwise be acknowledged, and cost the first
        fetch of it. Such a page is replaced, as if it were not there.
        """
        flat = codec.dense(page)
        nbytes = codec.stored_bytes(key, flat)
        with self._lock:
            try:
                found = self._present(key)
            except OSError as exc:
                raise self._failed("put", index, total, exc) from exc
            if found:
                self._hold([key])
            else:
                reservation = self._reserve(key, nbytes, index, total)
        if found:
            try:
                sound = self._sound(key, index, total)
            except BaseException:
                with self._lock:
                    self._unhold([key])
                raise
            if sound:
                held.append(key)
                return PutResult.PRESENT
            with self._lock:
                self._unhold([key])
                reservation = self._reserve(key, nbytes, index, total)
        if reservation is None:
            return PutResult.FULL
        try:
            self._write(key, flat)
        except BaseException as exc:
            with self._lock:
                self._unhold([key], self._writing)
                self._budget.abort(reservation)
            if not isinstance(exc, OSError):
                raise  # a bug or an interrupt: not a store failure, but the bytes are back
            raise self._failed("put", index, total, exc) from exc
        with self._lock:
            self._unhold([key], self._writing)
            self._settle(key, reservation)
            self._hold([key])
            held.append(key)
        return PutResult.STORED

    def _reserve(self, key: str, nbytes: int, index: int, total: int) -> Reservation | None:
        """Under the lock: make room for ``key``'s write, reserve it, and mark the key written.

        A damaged page indexed under ``key``, which the write replaces, is
        forgotten (its bytes are room) once the room is certain: its
        replacement is counted when its write settles.

        None (``FULL``), with nothing evicted or forgotten, where even evicting
        every page nobody reads would not make room.

        Raises:
            StoreFailed: A victim's file could not be deleted.
        """
        try:
            if not self._make_room(nbytes, key):
                return None
        except OSError as exc:
            raise self._failed("put", index, total, exc) from exc
        reservation = self._budget.reserve(nbytes)
        self._hold([key], self._writing)
        return reservation

    def _sound(self, key: str, done: int, total: int) -> bool:
        """Whether the page file found under ``key`` (held) reads back as its page.

        A page of a later format counts: it is whole, for the servers that read
        it, and a cache leaves it stored (its read here ends before it).

        Raises:
            StoreFailed: The file could not be read (a disk error, no permission).
        """
        try:
            return self._read(key, done, total, "put") is not None
        except LaterFormatPage:
            return True
        except CorruptPage:
            return False

    def _read(self, key: str, done: int, total: int, operation: str = "get") -> torch.Tensor | None:
        """Read one held page (of a get, or a put's page found); None when another process deleted it."""
        try:
            with self._shard(key) as shard:
                return codec.read(self._named(key), key, folder=shard)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._failed(operation, done, total, exc) from exc

    def _failed(self, operation: str, done: int, total: int, exc: OSError) -> StoreFailed:
        """Return the error for a disk error in ``operation`` after ``done`` of ``total`` pages."""
        cause = f"{type(exc).__name__}: {exc}"
        return StoreFailed(self.where, operation, acknowledged=done, total=total, cause=cause)

    def _write(self, key: str, page: torch.Tensor) -> None:
        """Write ``page`` to a temporary file and rename it into place; clean up on failure.

        ``.tmp`` is opened without following a link, and the file made in it
        by name: another user of the folder may swap ``.tmp`` for a link after
        the open looked at it.
        """
        name = f"{key}.{_HOST}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp = _open_folder(self._temporaries)
        try:
            try:
                fd = _fresh_file(tmp, name, 0o644)
                try:
                    codec.write(fd, key, page)
                    if self.durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                self._place(tmp, name, key)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=tmp)
                raise
        except OSError as exc:
            _name_in(exc, name, os.path.join(self._temporaries, name))
            raise
        finally:
            os.close(tmp)

    def _place(self, tmp: int, name: str, key: str) -> None:
        """Rename the page written as ``name`` in the open ``tmp`` into place; sync it if durable.

        The shard is made if missing, and never followed if a link. The rename
        is durable once the shard directory is synced, and the shard itself
        once the root is: synced once per shard and process, so a shard
        another process made is covered too.
        """
        with self._shard(key, make=True) as shard:
            os.replace(name, _page_file(key), src_dir_fd=tmp, dst_dir_fd=shard)
            if not self.durable:
                return
            if key[:2] not in self._rooted:
                _sync_directory(self.root)
                self._rooted.add(key[:2])
            os.fsync(shard)

    def _settle(self, key: str, reservation: Reservation) -> None:
        """Count a written page once, even if another writer indexed it meanwhile."""
        if key in self._index:
            self._budget.abort(reservation)
            return
        self._budget.commit(reservation)
        self._index[key] = reservation.nbytes

    def _make_room(self, nbytes: int, replacing: str) -> bool:
        """Evict least recently used unheld pages until ``nbytes`` fit; False (changing nothing) if they cannot.

        The page indexed under ``replacing`` (a damaged one the write replaces;
        mostly none) is no victim: its bytes count as room, and it is
        forgotten once the room is certain.

        A page is held while a get reads it or a put of it in this process
        is writing it: another put of the same page may have settled and
        indexed it, but the first put's answer must still hold when it settles.
        The shortfall counts everything over the limit, not just ``nbytes``:
        pages found on disk (a restart, another process) may already exceed it.

        Raises:
            OSError: A victim's file could not be deleted (it is forgotten).
        """
        short = max(0, self._budget.shortfall(nbytes) - self._index.get(replacing, 0))
        victims, freed = [], 0
        for key, size in self._index.items():
            if freed >= short:
                break
            if not self._readers.get(key, 0) and key not in self._writing and key != replacing:
                victims.append(key)
                freed += size
        if freed < short:
            return False
        for key in victims:
            self._delete(key)
        self._forget(replacing)
        return self._budget.fits(nbytes)

    def _leading(self, keys: Sequence[str], operation: str) -> int:
        """Count leading keys with a page file, indexing found files and forgetting lost ones.

        Past the first missing key, the indexed keys whose files are gone are
        forgotten too.

        When the count includes pages the index lacked (written by another
        process), the counted prefix is ranked as just used, tail first, so
        eviction does not take its head before its tail.

        Raises:
            StoreFailed: A file could not be looked at (``operation`` failed).
        """
        count, found = 0, False
        for key in keys:
            known = key in self._index
            try:
                if not self._present(key):
                    self._forget_lost(keys[count + 1 :])
                    break
            except OSError as exc:
                raise self._failed(operation, count, len(keys), exc) from exc
            count, found = count + 1, found or not known
        if found:
            self._rank(keys[:count])
        return count

    def _present(self, key: str) -> bool:
        """Whether ``key`` has a page file; a found file is indexed, a lost one forgotten.

        A file this process's put has placed and not yet settled is not
        indexed here: its bytes are reserved already, and counted twice they
        would evict pages for room that is free. Nor could eviction then pick
        it before its put holds it, which would acknowledge a page deleted.

        Raises:
            OSError: The file could not be looked at (other than missing).
        """
        try:
            with self._shard(key) as shard:
                size = os.stat(_page_file(key), dir_fd=shard).st_size
        except FileNotFoundError:
            self._forget(key)
            return False
        if key not in self._index and key not in self._writing:
            self._index[key] = size
            self._budget.add(size)
        return True

    def _delete(self, key: str) -> bool:
        """Delete a page's file and forget it; return whether it was there.

        A file that cannot be deleted is forgotten all the same, so eviction
        does not pick it again and again.

        Raises:
            OSError: The file could not be deleted (other than missing).
        """
        try:
            with self._shard(key) as shard:
                os.unlink(_page_file(key), dir_fd=shard)
        except FileNotFoundError:
            return False
        finally:
            self._forget(key)
        return True

    def _forget_lost(self, keys: Sequence[str]) -> None:
        """Forget each indexed key of ``keys`` whose file is gone, so the budget follows the disk.

        Another process drops a whole prefix at once: past the first missing
        page the rest are likely gone too, and counting them would evict real
        pages for room that is free. A file that cannot be looked at is kept.
        """
        for key in keys:
            if key not in self._index:
                continue
            try:
                with self._shard(key) as shard:
                    os.stat(_page_file(key), dir_fd=shard)
            except FileNotFoundError:
                self._forget(key)
            except OSError:
                continue

    def _forget(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._budget.remove(size)

    def _hold(self, keys: Sequence[str], holds: dict[str, int] | None = None) -> None:
        """Under the lock: count one more hold of each of ``keys`` (reads', or ``holds``)."""
        holds = self._readers if holds is None else holds
        for key in keys:
            holds[key] = holds.get(key, 0) + 1

    def _unhold(self, keys: Sequence[str], holds: dict[str, int] | None = None) -> None:
        """Under the lock: count one hold fewer of each of ``keys`` (reads', or ``holds``)."""
        holds = self._readers if holds is None else holds
        for key in keys:
            left = holds[key] - 1
            if left:
                holds[key] = left
            else:
                del holds[key]

    def _touch(self, keys: Sequence[str]) -> None:
        """Mark ``keys`` used, the last first, so a prefix's head is the most recent.

        The files' modification times record the same order for the next start
        (:meth:`_scan`): one nanosecond apart, the last key's the oldest. A file
        gone, or another user's, keeps its time: the order on disk is a hint.
        A link another user of the folder planted at a page's path is not
        followed: touching through it would set the times of whatever file it
        names (one of this process's own), so the link's own times are set.
        Where links cannot be touched without following them, no file is.
        """
        with self._lock:
            self._rank(keys)
        if not _TOUCH_LINKS:
            return
        now = time.time_ns()
        for offset, key in enumerate(reversed(keys)):
            with contextlib.suppress(OSError), self._shard(key) as shard:
                times = (now + offset, now + offset)
                os.utime(_page_file(key), ns=times, dir_fd=shard, follow_symlinks=False)

    def _rank(self, keys: Sequence[str]) -> None:
        """Under the lock: make ``keys`` the most recently used, the last first."""
        for key in reversed(keys):
            if key in self._index:
                self._index.move_to_end(key)

    def _scan(self) -> None:
        """Index the pages already under ``root``, least recently used (modified) first.

        A shard that is a link (or a file), or that cannot be opened, is
        skipped: its pages would be another folder's, which eviction would
        then delete.

        Raises:
            OSError: The root could not be listed, or a page looked at.
        """
        found = []
        with os.scandir(self.root) as listing:
            shards = [entry.name for entry in listing if len(entry.name) == 2]
        for name in shards:
            where = os.path.join(self.root, name)
            try:
                shard = _open_folder(where)
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                continue
            try:
                found += _pages(shard, where)
            finally:
                os.close(shard)
        for _, key, size in sorted(found):
            self._index[key] = size
            self._budget.add(size)

    @contextlib.contextmanager
    def _shard(self, key: str, *, make: bool = False) -> Iterator[int]:
        """Open ``key``'s shard directory never through a link, to name its page file in.

        Another user of the folder may replace a shard by a link to a folder
        of this process's user: pages would be written, touched, and deleted
        there. An error names the page's whole path, as if it had been used.

        Args:
            key: A page key, already checked.
            make: Create the shard if missing.

        Raises:
            FileNotFoundError: The shard is missing (and not ``make``), or the page.
            NotADirectoryError: The shard is a link or a file.
            OSError: The shard, or the page in it, could not be used.
        """
        shard = _open_folder(os.path.join(self.root, key[:2]), make=make)
        try:
            yield shard
        except OSError as exc:
            _name_in(exc, _page_file(key), self._named(key))
            raise
        finally:
            os.close(shard)

    def _named(self, key: str) -> str:
        """Return the path of ``key``'s page file (a key already checked), as errors name it."""
        return os.path.join(self.root, key[:2], _page_file(key))


def _root(root: object) -> Path:
    """Return ``root`` as an absolute Path, if it is one that can name a directory.

    A relative root is taken from the working directory now, once: looked up
    afresh at each call, a ``chdir`` after the store was opened made its pages
    read as missing, and its writes go to another folder's ``.tmp``.

    Raises:
        BadArgument: ``root`` is not a str or a str-valued ``os.PathLike``, is
            empty (which ``Path`` would take as the working directory), or
            holds a NUL byte.
    """
    text = os.fspath(root) if isinstance(root, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise BadArgument(f"root must be a str or os.PathLike path, not {type(root).__name__}")
    if not text:
        raise BadArgument(f"root must name a directory, not {text!r}")
    if "\0" in text:
        raise BadArgument(f"root {text!r} is not a valid path: embedded null byte")
    try:
        return Path(text).absolute()
    except OSError as exc:  # a relative root, and the working directory was removed
        raise BadArgument(f"root {text!r} is relative, and {exc.strerror}") from None


def _not_a_directory(path: Path) -> Path | None:
    """Return the nearest of ``path`` and the directories above it that exists and is no directory.

    None when the nearest that exists is a directory, so creating ``path``
    (and whatever is missing above it) can succeed. A directory another
    process creates while this one looks (ranks opening stores side by side
    under one new folder) is a directory, not something in the way.

    Raises:
        OSError: A path could not be looked at (no permission).
    """
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            return None
        if candidate.is_symlink() or candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def _host() -> str:
    """This host and process-id namespace, as a name part: a pid means something only there.

    Containers may share a hostname and a directory, each with its own
    process ids; on Linux the pid namespace's inode tells them apart. That
    inode is unique only within one boot of one kernel (every machine's first
    namespace has the same), and machines cloned from one image share a
    hostname: the boot's id tells machines, and boots, apart.
    """
    name = socket.gethostname().replace(".", "_").replace("/", "_") or "host"
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux, or no /proc
        return name
    boot = "".join(c for c in boot if c in string.hexdigits)[:12]
    return f"{name}-{boot}-{namespace}"


_HOST = _host()
"""This host in temporary files' names (:func:`_host`)."""

_TOUCH_LINKS = os.utime in os.supports_follow_symlinks and os.utime in os.supports_dir_fd
"""Whether a link's own times can be set, by name in an open folder (``utimensat``): POSIX."""


def _page_file(key: str) -> str:
    """Return the name of ``key``'s page file in its shard."""
    return f"{key}{SUFFIX}"


_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
"""How a store's own directories are opened: never through a link another user swapped in."""


def _open_folder(path: str, *, make: bool = False) -> int:
    """Open the directory ``path`` (creating it first if ``make``), never through a link.

    Raises:
        FileNotFoundError: ``path`` is missing (and not ``make``).
        NotADirectoryError: ``path`` is a link (says so) or a file.
        OSError: ``path`` could not be opened or created.
    """
    try:
        return os.open(path, _FOLDER)
    except FileNotFoundError:
        if not make:
            raise
    except OSError as exc:  # a link: ENOTDIR on Linux, ELOOP elsewhere
        if exc.errno in (errno.ENOTDIR, errno.ELOOP) and os.path.islink(path):
            raise NotADirectoryError(errno.ENOTDIR, "a link, not a directory", path) from None
        raise
    with contextlib.suppress(FileExistsError):  # another writer made it meanwhile
        os.mkdir(path)
    return _open_folder(path)


def _fresh_file(folder: int, name: str, mode: int) -> int:
    """Create the file ``name`` in the open ``folder`` afresh and return it open for writing.

    Temporary names are predictable: whatever is already there (a link another
    user of the folder planted) is removed first, and ``O_EXCL`` never opens
    through a link.

    Raises:
        OSError: The file could not be removed or created.
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=folder)
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode, dir_fd=folder)


def _name_in(exc: OSError, name: str, path: str) -> None:
    """Make ``exc``, raised on ``name`` in an open folder, name the whole ``path`` instead."""
    if exc.filename == name:
        exc.filename = path
    if exc.filename2 == name:
        exc.filename2 = path


def _pages(shard: int, where: str) -> list[tuple[int, str, int]]:
    """Return the pages in the open ``shard`` (at ``where``): (modification time, key, bytes) each.

    A name that is not a page key's is not a page; a file gone meanwhile is skipped.

    Raises:
        OSError: The shard could not be listed, or a page looked at.
    """
    with os.scandir(shard) as listing:
        names = [entry.name for entry in listing if entry.name.endswith(SUFFIX)]
    found = []
    for name in names:
        key = name.removesuffix(SUFFIX)
        try:
            check_keys([key])
            info = os.stat(name, dir_fd=shard)
        except (BadArgument, FileNotFoundError):
            continue
        except OSError as exc:
            _name_in(exc, name, os.path.join(where, name))
            raise
        found.append((info.st_mtime_ns, key, info.st_size))
    return found


def _reap(tmp: Path) -> int:
    """Delete the temporary files of writers that are gone; return how many.

    A name reads ``<key>.<host>.<pid>.<thread>.tmp``. A file of this host's
    process that no longer exists goes at once. Any other writer (on another
    host, in a pid namespace since gone, or whose pid another process now
    has) cannot be asked whether it lives, so its file goes once untouched for
    :data:`STALE_TEMPORARY_SECONDS` (a live writer stuck that long finds its
    file gone and fails its put, cleanly). Names in another form are left alone.

    Untouched for how long is read off the clock that stamped the file: a
    network folder's server stamps it, and this host's clock may be hours off
    the server's (:func:`_folder_now`), which would reap a live writer's file.

    The folder is opened once and never through a link, and its files are
    named from it, so a ``.tmp`` swapped for a link meanwhile cannot turn the
    reaping on another folder's files.

    Raises:
        OSError: ``.tmp`` could not be opened or listed (it is a link now).
    """
    reaped = 0
    now: list[float | None] = []  # the folder's time: read once, and only when a file needs it
    folder = _open_folder(str(tmp))
    try:
        with os.scandir(folder) as listing:  # listed before the clock's probe is made there
            names = [entry.name for entry in listing if entry.name.endswith(".tmp")]
        for name in names:
            parts = name.split(".")
            if len(parts) != 5:
                continue
            if not _gone(parts[1], parts[2]):
                now = now or [_folder_now(folder)]
                if not _stale(name, folder, now[0]):
                    continue
            try:
                os.unlink(name, dir_fd=folder)
            except OSError:  # another store reaped it first, or it is not ours to delete
                continue
            reaped += 1
    finally:
        os.close(folder)
    return reaped


def _gone(host: str, pid: str) -> bool:
    """Whether ``pid`` of ``host``, read from a temporary file's name, has exited on this host."""
    if host != _HOST or os.name != "posix":  # os.kill(pid, 0) tests a process only on POSIX
        return False
    if not (pid.isascii() and pid.isdigit()):  # "²" is a digit to isdigit, not to int
        return False
    return not _alive(int(pid))


def _folder_now(tmp: int) -> float | None:
    """Return the time now by the clock that stamps files made in the open folder ``tmp``.

    A file's modification time comes from the clock of whoever stores it: the
    kernel's for a local disk, the server's for a network folder (NFS sets it
    on create and write). A file made here now (an empty probe, deleted at
    once) reads that clock, so a temporary file's age is measured on one clock
    however far this host's is off. The probe is named as a temporary file of
    this thread, so a crash between its making and its deletion leaves a file
    the next open reaps.

    None (nothing is stale) when the probe cannot be made: then no file can be
    deleted either (a read-only folder, no permission), or the folder is full
    and its files are reaped by a later open, rather than by a clock that may
    be hours off.
    """
    probe = f"clock.{_HOST}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        fd = _fresh_file(tmp, probe, 0o600)
    except OSError:
        return None
    try:
        return os.fstat(fd).st_mtime
    except OSError:
        return None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe, dir_fd=tmp)


def _stale(name: str, tmp: int, now: float | None) -> bool:
    """Whether ``name`` in the open folder ``tmp`` is :data:`STALE_TEMPORARY_SECONDS` older than ``now``.

    Never when ``now`` is None: the folder's clock could not be read.
    """
    if now is None:
        return False
    try:
        written = os.stat(name, dir_fd=tmp, follow_symlinks=False).st_mtime
    except OSError:  # reaped meanwhile, or not to be looked at: left to the next open
        return False
    return now - written >= STALE_TEMPORARY_SECONDS


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0 tests without sending)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; or not a pid at all
        return True
    return True


def _sync_directory(path: Path) -> None:
    """``fsync`` a directory, so the entries created or renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
