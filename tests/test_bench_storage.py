"""``fsm-cache bench storage``: the table's structure and the bit-exact check, never its timings.

The bench runs here at a tiny size (pages of 16 tokens of one layer and one
head), once; speed figures live in docs/benchmarks.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest
import torch

from fsm_cache.bench.storage import (
    DIRECTIONS,
    PATHS,
    LocalBackend,
    StorageBenchResult,
    StorageRow,
    Workload,
    run_storage_bench,
)
from fsm_cache.cli.main import main
from fsm_cache.errors import CorruptPage
from fsm_cache.storage import LocalFileStore
from fsm_cache.testing.redis_server import redis_server_path


PAGE_BYTES = 1 * 2 * 16 * 1 * 128 * 2  # layers, planes, tokens, heads, head_dim, bfloat16


def tiny(redis: str = "auto") -> StorageBenchResult:
    """Two pages of one layer and one head, once."""
    return run_storage_bench(pages=2, reps=1, layers=1, heads=1, redis=redis)


def test_every_backend_direction_and_path_has_a_row() -> None:
    result = tiny("fake")
    assert (result.pages, result.page_bytes, result.reps, result.skipped) == (2, PAGE_BYTES, 1, [])
    assert [(r.backend, r.direction, r.path) for r in sorted(result.rows, key=_order)] == [
        (backend, direction, path)
        for backend in ("local file", "redis")
        for direction in DIRECTIONS
        for path in PATHS
    ]
    assert all(r.seconds > 0 and (r.pages, r.page_bytes) == (2, PAGE_BYTES) for r in result.rows)
    row = result.row("redis", "prefetch", "HiCache")
    assert row.mb_per_s == pytest.approx(row.pages_per_s * PAGE_BYTES / 1e6)
    store = result.row("redis", "prefetch", "store")
    assert result.ratio("redis", "prefetch", "HiCache", "store") == pytest.approx(
        store.seconds / row.seconds
    )
    assert result.backends[1].startswith("redis: fakeredis ")
    assert result.backends[1].endswith(" in process")


def test_the_table_shows_pages_per_second_megabytes_and_ratios() -> None:
    lines = tiny("off").format().splitlines()
    assert lines[0] == (
        "storage: 2 pages of 0.01 MiB (0.0 MiB) per backup and per prefetch, best of 1, interleaved"
    )
    assert lines[1].startswith("  local file: LocalFileStore under ")
    assert lines[2].split() == ["pages/s", "MB/s", "/", "store", "/", "raw", "I/O"]
    labels = [line[:32].split() for line in lines[3:]]
    assert labels == [
        ["local", "file", "backup", "HiCache"],
        ["store.put"],
        ["raw", "I/O"],
        ["local", "file", "prefetch", "HiCache"],
        ["store.get"],
        ["raw", "I/O"],
    ]
    ratios = [line[50:].split() for line in lines[3:]]
    assert [len(r) for r in ratios] == [2, 1, 0, 2, 1, 0]  # / store on the cache, / raw on both
    assert all(r.endswith("x") for rs in ratios for r in rs)


def test_redis_is_a_real_server_when_one_is_on_path() -> None:
    result = tiny()
    if redis_server_path() is None:
        assert result.backends[1].endswith("in process, no redis-server on PATH")
    else:
        assert result.backends[1].startswith("redis: redis-server ")
        assert result.backends[1].endswith("(a real server)")


def _order(row: StorageRow) -> tuple[int, int, int]:
    return (
        ["local file", "redis"].index(row.backend),
        DIRECTIONS.index(row.direction),
        PATHS.index(row.path),
    )


# -- the bit-exact check ----------------------------------------------------------


def _flip_page_1(pages: list[torch.Tensor]) -> list[torch.Tensor]:
    """Return ``pages`` with the first byte of page 1 changed (a copy: the store stays intact)."""
    out = [page.clone() for page in pages]
    out[1].view(-1)[0] ^= 0xFF
    return out


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("HiCache", "local file prefetch through HiCache"),
        ("store", "local file store.get"),
        ("raw I/O", "local file raw read"),
    ],
)
def test_a_corrupted_page_fails_the_bit_exact_check(
    monkeypatch: pytest.MonkeyPatch, path: str, message: str
) -> None:
    """A page that reads back one byte off stops the bench, naming the path and the page.

    The cache reads on its storage worker thread, ``store.get`` on the
    caller's, so a corruption in only one of them shows which path checked it.
    """
    get: Callable[[LocalFileStore, Sequence[str]], list[torch.Tensor]] = LocalFileStore.get
    raw_get = LocalBackend.raw_get

    def corrupt_get(store: LocalFileStore, keys: Sequence[str]) -> list[torch.Tensor]:
        pages = get(store, keys)
        on_worker = threading.current_thread() is not threading.main_thread()
        return _flip_page_1(pages) if on_worker == (path == "HiCache") else pages

    if path == "raw I/O":
        monkeypatch.setattr(LocalBackend, "raw_get", lambda b, w: _flip_page_1(raw_get(b, w)))
    else:
        monkeypatch.setattr(LocalFileStore, "get", corrupt_get)
    work = Workload.make(2, 1, 1)
    with pytest.raises(CorruptPage) as info:
        tiny("off")
    assert str(info.value) == (
        f"{message}: not a valid page {work.keys[1][:12]}: "
        "page 1 differs from the page inserted, first at byte 0"
    )


def test_the_check_counts_missing_pages() -> None:
    work = Workload.make(2, 1, 1)
    work.check("here", work.pages)  # the pages themselves pass
    with pytest.raises(CorruptPage, match=r"^here: not a valid page \w+: 1 of 2 pages came back$"):
        work.check("here", work.pages[:1])
    with pytest.raises(CorruptPage, match=r": page 0 has 4096 bytes, not 8192$"):
        work.check("here", [work.pages[0][:, :, :8], work.pages[1]])


def test_the_workload_kv_holds_the_pages_bytes() -> None:
    """What the writer cache's device holds is what the pages say, in the device layout."""
    work = Workload.make(3, 2, 1)
    kv = work.kv.view(torch.uint8)  # [layers, planes, tokens, heads, row]
    for index, page in enumerate(work.pages):
        assert torch.equal(kv[:, :, index * 16 : (index + 1) * 16], page)


# -- the command ------------------------------------------------------------------


def test_the_command_takes_pages_and_reps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "storage", "--quick", "--pages", "2", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("storage: 2 pages of 0.06 MiB (0.1 MiB) per backup and per prefetch,")
    assert "best of 1, interleaved" in out
    assert "  local file backup   HiCache " in out


def test_the_command_refuses_a_count_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "storage", "--pages", "0"])
    assert info.value.code == 2
    assert "argument --pages: expected an int >= 1, got '0'" in capsys.readouterr().err


def test_the_command_refuses_pages_that_cannot_fit_before_allocating(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    free = {"SC_AVPHYS_PAGES": 1024, "SC_PAGE_SIZE": 4096}  # 4 MiB free
    monkeypatch.setattr("fsm_cache.bench.storage.os.sysconf", free.__getitem__)
    assert main(["bench", "storage", "--pages", "1000000000", "--reps", "1"]) == 2
    assert capsys.readouterr().err == (
        "error: bench storage: 1000000000 pages of 2.00 MiB need about 15625000.0 GiB of "
        "memory (8 copies); 0.0 GiB is free: pass fewer --pages\n"
    )
