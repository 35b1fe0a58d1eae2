"""A local store's folder shared by many processes, and what another user may plant in it.

Many serving processes (on one host, or many hosts on one network folder) use
one directory as their storage tier. These tests put in the folder what those
processes, a crash, or a disk leave there, at the exact moment a store looks.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fsm_cache.errors import BadArgument, StoreFailed
from fsm_cache.storage import Capacity, LocalFileStore, Namespace, PutResult, codec, page_keys
from fsm_cache.storage import local as local_module


NS = Namespace("m", "l", 4)
KEYS = page_keys(NS, list(range(8)))
PAGES = [torch.full((2, 4), float(i)) for i in range(2)]


def temporary_name(key: str) -> str:
    """Return the temporary file's name a put of ``key`` in this thread writes."""
    host = local_module._HOST  # noqa: SLF001 (the name is the file planted on)
    return f"{key}.{host}.{os.getpid()}.{threading.get_ident()}.tmp"


@pytest.mark.parametrize("link", [os.symlink, os.link])
def test_local_a_link_planted_at_a_temporary_name_is_not_written_through(
    tmp_path: Path, link: Any
) -> None:
    """A link at the name a put will write is replaced, and the file it names is left whole.

    Temporary names are predictable (key, host, pid, thread): whoever can
    write the folder could plant a link there, and a put that opened the name
    with ``O_TRUNC`` emptied the linked file and wrote the page into it (a
    page file that was a link to it, for a symlink).
    """
    victim = tmp_path / "victim"
    victim.write_bytes(b"not yours to overwrite")
    store = LocalFileStore(tmp_path / "store")
    link(victim, tmp_path / "store" / ".tmp" / temporary_name(KEYS[0]))
    assert store.put(KEYS[:1], PAGES[:1]) == [PutResult.STORED]
    assert victim.read_bytes() == b"not yours to overwrite"
    assert not store.path(KEYS[0]).is_symlink()
    assert list((tmp_path / "store" / ".tmp").iterdir()) == []
    assert torch.equal(store.get(KEYS[:1])[0], PAGES[0])


def test_local_a_disk_error_indexing_at_open_is_store_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page file another process wrote that cannot be looked at is StoreFailed (open), not OSError."""
    LocalFileStore(tmp_path).put(KEYS, PAGES)
    stat = os.stat

    def eio(path: Any, *args: Any, **options: Any) -> os.stat_result:
        if str(path).endswith(".page"):
            raise OSError(5, "Input/output error", str(path))
        return stat(path, *args, **options)

    monkeypatch.setattr(os, "stat", eio)
    with pytest.raises(StoreFailed) as caught:
        LocalFileStore(tmp_path)
    assert str(caught.value).startswith(
        f"local {tmp_path}: open failed: OSError: [Errno 5] Input/output error: '{tmp_path}/"
    )
    assert (caught.value.operation, caught.value.acknowledged) == ("open", 0)


def test_local_a_temporary_name_whose_pid_is_not_ascii_digits_is_left_alone(
    tmp_path: Path,
) -> None:
    """A name whose pid part is digits only to Unicode is another form: kept, and the open succeeds.

    ``"²".isdigit()`` is true and ``int("²")`` a ValueError, which escaped the
    constructor; ``int("١٢")`` is 12, a pid this name never meant.
    """
    tmp = tmp_path / ".tmp"
    tmp.mkdir()
    host = temporary_name(KEYS[0]).split(".")[1]
    names = sorted(f"{KEYS[0]}.{host}.{pid}.1.tmp" for pid in ["\u00b2", "\u0661\u0662"])
    for name in names:
        (tmp / name).write_bytes(b"x")
    assert LocalFileStore(tmp_path).reaped == 0
    assert sorted(p.name for p in tmp.iterdir()) == names


def not_a_live_pid() -> int:
    """Return a pid no process has: one above the kernel's largest."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


@pytest.mark.skipif(not Path("/proc/self/ns/pid").exists(), reason="Linux pid namespaces")
def test_local_a_writer_on_another_machine_of_the_same_name_is_not_reaped(tmp_path: Path) -> None:
    """Machines cloned from one image share a hostname, and every machine's first pid
    namespace has the same inode: a temporary file so named, of a pid dead here, may be a
    live writer's there. Reaping it failed that writer's put; it is left alone."""
    tmp = tmp_path / ".tmp"
    tmp.mkdir()
    clone = f"{socket.gethostname().replace('.', '_')}-{os.stat('/proc/self/ns/pid').st_ino}"
    name = f"{KEYS[0]}.{clone}.{not_a_live_pid()}.1.tmp"
    (tmp / name).write_bytes(b"part of a page")
    assert LocalFileStore(tmp_path).reaped == 0
    assert [p.name for p in tmp.iterdir()] == [name]


def test_local_temporary_files_untouched_for_long_are_reaped_whoever_wrote_them(
    tmp_path: Path,
) -> None:
    """A writer on another machine, in a container since restarted (another pid namespace),
    of a previous boot, or whose pid another process took cannot be asked whether it lives;
    a page takes well under a second to write. Their files untouched for
    ``STALE_TEMPORARY_SECONDS`` are reaped, the fresh ones (a writer on its way) are not,
    and names of another form never are."""
    tmp = tmp_path / ".tmp"
    tmp.mkdir()
    here = temporary_name(KEYS[0]).split(".")[1]
    writers = [
        f"elsewhere-0123456789ab-4026531836.{os.getpid()}.1",  # another machine
        f"{here}9.1.1",  # a pid namespace gone: a container restarted
        f"{here}.{os.getpid()}.1",  # a live pid: this one, or one reused
    ]
    stale = time.time() - 86_400  # a day: past STALE_TEMPORARY_SECONDS
    for writer in writers:
        for age, key in [("old", KEYS[0]), ("new", KEYS[1])]:
            (tmp / f"{key}.{writer}.tmp").write_bytes(b"x")
            if age == "old":
                os.utime(tmp / f"{key}.{writer}.tmp", (stale, stale))
    (tmp / f"{KEYS[0]}.{os.getpid()}.1.tmp").write_bytes(b"x")  # another form
    os.utime(tmp / f"{KEYS[0]}.{os.getpid()}.1.tmp", (stale, stale))
    assert LocalFileStore(tmp_path).reaped == 3
    assert sorted(p.name for p in tmp.iterdir()) == sorted(
        [f"{KEYS[1]}.{writer}.tmp" for writer in writers] + [f"{KEYS[0]}.{os.getpid()}.1.tmp"]
    )
    assert local_module.STALE_TEMPORARY_SECONDS < 86_400


def test_local_a_page_another_process_deletes_mid_read_is_whole_or_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holds are per process: another process's drop deletes pages this one is reading.

    The page whose file the read has opened is read whole (an unlinked file's
    data lives until it is closed); the next reads as missing: a shorter
    prefix, never an error.
    """
    reader, other = LocalFileStore(tmp_path), LocalFileStore(tmp_path)
    other.put(KEYS, PAGES)
    assert reader.exists_prefix(KEYS) == 2
    read_into = codec._read_into  # noqa: SLF001 (the moment the file is open)

    def dropped_meanwhile(fd: int, path: str, key: str, nbytes: int) -> torch.Tensor:
        other.drop(KEYS)
        return read_into(fd, path, key, nbytes)

    monkeypatch.setattr(codec, "_read_into", dropped_meanwhile)
    got = reader.get(KEYS)
    assert len(got) == 1
    assert torch.equal(got[0], PAGES[0])
    assert (reader.exists_prefix(KEYS), reader.capacity().pages) == (0, 0)


@pytest.mark.parametrize("reads", [False, True])
def test_local_a_link_planted_at_a_page_path_does_not_touch_the_file_it_names(
    tmp_path: Path, reads: bool
) -> None:
    """Marking a page used sets its file's times; a symlink at the page's path is not followed.

    Another user of the folder may plant a link at a page's name, to a file
    of this process's user (or to a page elsewhere): a put finding it present,
    or a get reading through it, then set that file's modification time. A put
    reads what the link names, finds no page there, and replaces the link (not
    the file it names) with the page.
    """
    elsewhere = LocalFileStore(tmp_path / "elsewhere")
    elsewhere.put(KEYS[:1], PAGES[:1])
    victim = elsewhere.path(KEYS[0]) if reads else tmp_path / "victim"
    if not reads:
        victim.write_bytes(b"not yours to touch")
    os.utime(victim, ns=(1_000_000_000, 1_000_000_000))
    store = LocalFileStore(tmp_path / "store")
    store.path(KEYS[0]).parent.mkdir()
    store.path(KEYS[0]).symlink_to(victim)
    if reads:
        assert torch.equal(store.get(KEYS[:1])[0], PAGES[0])
    else:
        assert store.put(KEYS[:1], PAGES[:1]) == [PutResult.STORED]
        assert not store.path(KEYS[0]).is_symlink()
        assert victim.read_bytes() == b"not yours to touch"
    assert victim.stat().st_mtime_ns == 1_000_000_000
    assert store.path(KEYS[0]).lstat().st_mtime_ns != 1_000_000_000


class SkewedClock:
    """This host's ``time`` module, ``skew`` seconds off the folder's clock."""

    def __init__(self, skew: float) -> None:
        self.skew = skew

    def time(self) -> float:
        return time.time() + self.skew

    def time_ns(self) -> int:
        return time.time_ns() + int(self.skew * 1e9)


@pytest.mark.parametrize("skew", [-7200.0, 7200.0])
def test_local_a_temporary_file_s_age_is_read_off_the_folder_s_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skew: float
) -> None:
    """A network folder's server stamps its files: this host's clock two hours off the
    server's neither reaps a live writer's fresh file (ahead: its put would fail) nor keeps
    a dead writer's file untouched for longer than ``STALE_TEMPORARY_SECONDS`` (behind).
    The probe that reads the folder's clock leaves nothing behind."""
    tmp = tmp_path / ".tmp"
    tmp.mkdir()
    writer = f"elsewhere-0123456789ab-4026531836.{os.getpid()}.1"
    fresh, old = (tmp / f"{key}.{writer}.tmp" for key in KEYS[:2])
    fresh.write_bytes(b"a page on its way")
    old.write_bytes(b"a dead writer's")
    stamped = old.stat().st_mtime - local_module.STALE_TEMPORARY_SECONDS - 60
    os.utime(old, (stamped, stamped))
    monkeypatch.setattr(local_module, "time", SkewedClock(skew))
    assert LocalFileStore(tmp_path).reaped == 1
    assert [p.name for p in tmp.iterdir()] == [fresh.name]


def test_local_a_folder_whose_clock_cannot_be_read_reaps_only_this_host_s_dead_writers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No probe can be made (the folder is read-only, or out of inodes): no other
    writer's file is judged stale, whatever this host's clock says; a dead process
    of this host is still known dead without a clock."""
    tmp = tmp_path / ".tmp"
    tmp.mkdir()
    here = temporary_name(KEYS[0]).split(".")[1]
    elsewhere = tmp / f"{KEYS[0]}.elsewhere-0123456789ab-4026531836.{os.getpid()}.1.tmp"
    dead = tmp / f"{KEYS[1]}.{here}.{not_a_live_pid()}.1.tmp"
    for file in (elsewhere, dead):
        file.write_bytes(b"x")
        os.utime(file, (0, 0))
    made = os.open

    def no_probe(path: Any, flags: int, *args: Any, **options: Any) -> int:
        if Path(path).name.startswith("clock."):
            raise OSError(28, "No space left on device", str(path))
        return made(path, flags, *args, **options)

    monkeypatch.setattr(os, "open", no_probe)
    assert LocalFileStore(tmp_path).reaped == 1
    assert [p.name for p in tmp.iterdir()] == [elsewhere.name]


def test_local_a_temporary_folder_replaced_by_a_link_is_refused(tmp_path: Path) -> None:
    """Whoever can write the folder can swap ``.tmp`` for a link: opening reaped dead
    writers' files through it, deleting files so named (a day old) in the folder it
    names, one of this process's user's. The open is refused, and nothing is deleted."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    theirs = elsewhere / f"{KEYS[0]}.elsewhere-0123456789ab-4026531836.1.1.tmp"
    theirs.write_bytes(b"not yours to delete")
    os.utime(theirs, (0, 0))
    LocalFileStore(tmp_path / "store")
    (tmp_path / "store" / ".tmp").rmdir()
    (tmp_path / "store" / ".tmp").symlink_to(elsewhere)
    with pytest.raises(BadArgument) as caught:
        LocalFileStore(tmp_path / "store")
    store = tmp_path / "store"
    assert str(caught.value) == f"root {store}: {store / '.tmp'} is a link, not a directory"
    assert theirs.read_bytes() == b"not yours to delete"


def test_local_a_temporary_folder_swapped_for_a_link_while_opening_is_not_reaped_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swap may come after the open has looked at ``.tmp``: the reaping opens the
    folder without following a link, so it fails the open instead (StoreFailed)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    theirs = elsewhere / f"{KEYS[0]}.elsewhere-0123456789ab-4026531836.1.1.tmp"
    theirs.write_bytes(b"not yours to delete")
    os.utime(theirs, (0, 0))
    tmp = tmp_path / "store" / ".tmp"
    made = LocalFileStore._make_directory  # noqa: SLF001 (the moment after the look)

    def swapped(store: LocalFileStore) -> None:
        made(store)
        tmp.rmdir()
        tmp.symlink_to(elsewhere)

    monkeypatch.setattr(LocalFileStore, "_make_directory", swapped)
    with pytest.raises(StoreFailed) as caught:
        LocalFileStore(tmp_path / "store")
    assert (caught.value.operation, caught.value.acknowledged) == ("open", 0)
    assert theirs.read_bytes() == b"not yours to delete"


def shard_linked_to_a_victim(tmp_path: Path, *, holding: bool) -> tuple[LocalFileStore, Path]:
    """Return a store whose first key's shard is a link, and the folder it names.

    The folder is another store's shard: holding the first key's page (its
    times set to a known past) if ``holding``, else empty.
    """
    elsewhere = LocalFileStore(tmp_path / "elsewhere")
    if holding:
        elsewhere.put(KEYS[:1], PAGES[:1])
        os.utime(elsewhere.path(KEYS[0]), ns=(1_000_000_000, 1_000_000_000))
    victim = elsewhere.path(KEYS[0]).parent
    victim.mkdir(exist_ok=True)
    store = LocalFileStore(tmp_path / "store")
    store.path(KEYS[0]).parent.symlink_to(victim, target_is_directory=True)
    return store, victim


def folder_state(folder: Path) -> list[tuple[str, bytes, int]]:
    """Return each file in ``folder``: its name, bytes and modification time."""
    return sorted((p.name, p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir())


def operate(store: LocalFileStore, operation: str) -> object:
    """Run ``operation`` (put, exists, get or drop) on the first key's page."""
    if operation == "put":
        return store.put(KEYS[:1], PAGES[:1])
    if operation == "exists":
        return store.exists_prefix(KEYS[:1])
    if operation == "get":
        return store.get(KEYS[:1])
    return store.drop(KEYS[:1])


@pytest.mark.parametrize("operation", ["put", "exists", "get", "drop"])
def test_local_a_shard_replaced_by_a_link_is_not_followed(tmp_path: Path, operation: str) -> None:
    """Another user of the folder may replace a shard (``<root>/ab``) by a link to a
    folder of this process's user: a put wrote its page there, a lookup found the pages
    there (and a get read and touched them), a drop deleted them. Each is StoreFailed
    instead, naming the link, and the folder it names is left as it was."""
    store, victim = shard_linked_to_a_victim(tmp_path, holding=operation != "put")
    before = folder_state(victim)
    with pytest.raises(StoreFailed) as caught:
        operate(store, operation)
    link = store.path(KEYS[0]).parent
    assert str(caught.value) == (
        f"local {tmp_path / 'store'}: {operation} failed after 0 of 1 pages: "
        f"NotADirectoryError: [Errno 20] a link, not a directory: '{link}'"
    )
    assert folder_state(victim) == before
    assert store.capacity() == Capacity(0, 0, None, 0)
    assert list((tmp_path / "store" / ".tmp").iterdir()) == []


def test_local_a_linked_shard_is_not_indexed_at_open_nor_evicted_through(tmp_path: Path) -> None:
    """Opening indexed the pages under every shard, a link's too: they counted against
    the limit, and the first put to need room deleted them in the folder the link names."""
    _, victim = shard_linked_to_a_victim(tmp_path, holding=True)
    before = folder_state(victim)
    size = LocalFileStore(tmp_path / "elsewhere").capacity().used_bytes
    store = LocalFileStore(tmp_path / "store", limit_bytes=size)
    assert store.capacity() == Capacity(0, 0, size, 0)
    assert store.put(KEYS[1:], PAGES[1:]) == [PutResult.STORED]
    assert folder_state(victim) == before


def test_local_a_shard_swapped_for_a_link_mid_read_is_neither_touched_nor_evicted_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swap may come after a page is found: marking it used then set the times of the
    page of that name in the folder the link names, and evicting it deleted that page."""
    _, victim = shard_linked_to_a_victim(tmp_path, holding=True)
    before = folder_state(victim)
    size = LocalFileStore(tmp_path / "elsewhere").capacity().used_bytes
    store = LocalFileStore(tmp_path / "store", limit_bytes=size)
    store.path(KEYS[0]).parent.unlink()
    assert store.put(KEYS[:1], PAGES[:1]) == [PutResult.STORED]
    shard = store.path(KEYS[0]).parent
    read_into = codec._read_into  # noqa: SLF001 (the moment the file is open)

    def swapped_meanwhile(fd: int, path: str, key: str, nbytes: int) -> torch.Tensor:
        store.path(KEYS[0]).unlink()
        shard.rmdir()
        shard.symlink_to(victim, target_is_directory=True)
        return read_into(fd, path, key, nbytes)

    monkeypatch.setattr(codec, "_read_into", swapped_meanwhile)
    assert torch.equal(store.get(KEYS[:1])[0], PAGES[0])
    assert folder_state(victim) == before
    with pytest.raises(StoreFailed) as caught:
        store.put(KEYS[1:], PAGES[1:])
    assert str(caught.value) == (
        f"local {tmp_path / 'store'}: put failed after 0 of 1 pages: "
        f"NotADirectoryError: [Errno 20] a link, not a directory: '{shard}'"
    )
    assert folder_state(victim) == before
    assert store.put(KEYS[1:], PAGES[1:]) == [PutResult.STORED]


def test_local_a_temporary_folder_swapped_for_a_link_after_opening_is_not_written_through(
    tmp_path: Path,
) -> None:
    """``.tmp`` is checked when the store opens; a put long after made its temporary
    file through a link swapped in since, deleting first the file of that name in the
    folder the link names. The put fails instead, and that folder is left as it was."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / temporary_name(KEYS[0])).write_bytes(b"not yours to delete")
    before = folder_state(elsewhere)
    store = LocalFileStore(tmp_path / "store")
    tmp = tmp_path / "store" / ".tmp"
    tmp.rmdir()
    tmp.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(StoreFailed) as caught:
        store.put(KEYS[:1], PAGES[:1])
    assert str(caught.value) == (
        f"local {tmp_path / 'store'}: put failed after 0 of 1 pages: "
        f"NotADirectoryError: [Errno 20] a link, not a directory: '{tmp}'"
    )
    assert folder_state(elsewhere) == before
    assert not store.path(KEYS[0]).exists()
    assert store.capacity() == Capacity(0, 0, None, 0)
