"""Synthetic KV and the pool writes it goes through, against straightforward references.

``synthetic_kv`` and ``Tiers.write_tokens`` compute the pattern with a few
tensor operations on precomputed constants, and the pool stores runs of pages
as slices and other pages by index. Each is compared byte for byte with a
reference that follows the definition in ``synthetic_kv``'s docstring element
by element, and with the vectorised implementation it replaced, on many
layouts, dtypes and page sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from fsm_cache.errors import ForeignSlot, NotASlot, PoolError
from fsm_cache.memory import tiers as tiers_module
from fsm_cache.memory.kv import KVLayout, KVPool, device_pool, host_pool
from fsm_cache.memory.pages import PageAllocator
from fsm_cache.memory.tiers import SLOT_RUN, CacheConfig, Tiers, synthetic_kv


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
DTYPE_NAMES |= {torch.float32: "float32", torch.float8_e4m3fn: "float8_e4m3fn"}
CPU = torch.device("cpu")
SENTINEL = 0x5A


def reference_kv(layout: KVLayout, tokens: list[int]) -> torch.Tensor:
    """The docstring's definition, one element at a time (slow: small cases only)."""
    inner = layout.heads * layout.head_dim
    step = 17 if inner >= 16 else inner + 16
    values = []
    for block in range(layout.layers * layout.planes):
        for t, token in enumerate(tokens):
            code = token * layout.page_size + t % layout.page_size
            for i in range(inner):
                k = (block * step + i) % 256
                digit = (code >> 4 * (k % 16)) & 15  # Python ints: the low 64 bits as int64's
                values.append((digit + k + k // 16) % 16 - 8)
    shape = (layout.layers, layout.planes, len(tokens), layout.heads, layout.head_dim)
    return torch.tensor(values, dtype=torch.float32).view(shape).to(layout.dtype)


def previous_kv(layout: KVLayout, tokens: list[int]) -> torch.Tensor:
    """The vectorised implementation the constants replaced (fast enough for large layouts)."""
    lay = layout
    ids = torch.tensor(list(tokens), dtype=torch.int64)
    n = len(ids)
    code = ids * lay.page_size + torch.arange(n, dtype=torch.int64) % lay.page_size
    inner, blocks = lay.heads * lay.head_dim, lay.layers * lay.planes
    step = 17 if inner >= 16 else inner + 16
    starts = [block * step % 256 for block in range(blocks)]
    if blocks * inner <= 256:
        used = torch.cat([(s + torch.arange(inner)) % 256 for s in starts])
        exact = _previous_pattern(code, used, lay.dtype).view(n, blocks, inner)
        kv = exact.permute(1, 0, 2).contiguous()
    else:
        laps = (inner + 2 * 256 - 1) // 256
        ring = _previous_pattern(code, torch.arange(256), lay.dtype).repeat(1, laps)
        kv = torch.empty((blocks, n, inner), dtype=lay.dtype)
        for block, start in enumerate(starts):
            kv[block].copy_(ring[:, start : start + inner])
    return kv.view(lay.layers, lay.planes, n, lay.heads, lay.head_dim)


def _previous_pattern(
    code: torch.Tensor, entries: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    digit = torch.bitwise_and(code[:, None] >> (entries % 16) * 4, 15)
    pattern = torch.remainder(digit + entries + entries // 16, 16) - 8
    return pattern.to(torch.float32).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


def layouts() -> st.SearchStrategy[KVLayout]:
    return st.builds(
        KVLayout,
        layers=st.integers(1, 3),
        heads=st.integers(1, 3),
        head_dim=st.integers(1, 24),
        dtype=st.sampled_from(DTYPES),
        page_size=st.integers(1, 17),
        planes=st.integers(1, 2),
    )


TOKENS = st.lists(st.integers(0, 2**63 - 1) | st.integers(0, 300), max_size=40)


# -- synthetic_kv ---------------------------------------------------------------------------


LAYOUTS = [
    KVLayout(1, 1, 8, torch.float16, 1),  # the bench's: 16 elements a token
    KVLayout(1, 1, 8, torch.float16, 16),
    KVLayout(1, 1, 1, torch.float32, 3),  # 2 elements: blocks continue each other's digits
    KVLayout(3, 1, 5, torch.bfloat16, 2),
    KVLayout(2, 2, 16, torch.float8_e4m3fn, 4),  # 128 elements: the largest direct layouts
    KVLayout(2, 4, 16, torch.float16, 16),  # exactly 256 elements
    KVLayout(2, 3, 22, torch.float32, 5),  # just over 256: the ring
    KVLayout(5, 3, 40, torch.float8_e4m3fn, 4),
    KVLayout.mla(3, 300, torch.bfloat16, 2),
    KVLayout(20, 1, 1, torch.float16, 7),  # many blocks of one element
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_synthetic_kv_has_the_bytes_of_its_definition(layout: KVLayout) -> None:
    tokens = [0, 1, 5, 997, 2**33 + 7, 151_935, 12, 13, 2**63 - 1, 2**62 + 3, 7, 7, 7, 7]
    got = synthetic_kv(layout, tokens)
    assert got.is_contiguous()
    assert same_bytes(got, reference_kv(layout, tokens))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(32, 8, 128, 16), (4, 2, 64, 1), (130, 1, 16, 4)], ids=str)
def test_synthetic_kv_of_large_layouts_is_the_previous_implementations(
    dtype: torch.dtype, shape: tuple[int, int, int, int]
) -> None:
    layers, heads, head_dim, page = shape
    layout = KVLayout(layers, heads, head_dim, dtype, page)
    tokens = list(range(1000, 1000 + 2 * page)) + [2**40 + 1] * page
    assert same_bytes(synthetic_kv(layout, tokens), previous_kv(layout, tokens))


@settings(max_examples=150, deadline=None)
@given(layouts(), TOKENS)
def test_synthetic_kv_is_the_reference_on_any_layout(layout: KVLayout, tokens: list[int]) -> None:
    got = synthetic_kv(layout, tokens)
    assert same_bytes(got, reference_kv(layout, tokens))
    assert same_bytes(got, previous_kv(layout, tokens))


@settings(max_examples=40, deadline=None)
@given(
    st.builds(
        KVLayout,
        layers=st.integers(1, 12),
        heads=st.integers(1, 8),
        head_dim=st.integers(16, 160),
        dtype=st.sampled_from(DTYPES),
        page_size=st.integers(1, 16),
    ),
    TOKENS,
)
def test_synthetic_kv_is_the_previous_implementation_on_larger_layouts(
    layout: KVLayout, tokens: list[int]
) -> None:
    assert same_bytes(synthetic_kv(layout, tokens), previous_kv(layout, tokens))


def test_synthetic_kv_of_a_tuple_a_range_and_nothing() -> None:
    layout = KVLayout(2, 2, 4, torch.bfloat16, 4)
    want = reference_kv(layout, list(range(40, 48)))
    assert same_bytes(synthetic_kv(layout, tuple(range(40, 48))), want)
    assert same_bytes(synthetic_kv(layout, range(40, 48)), want)
    assert synthetic_kv(layout, []).shape == (2, 2, 0, 2, 4)
    assert synthetic_kv(layout, ()).dtype == torch.bfloat16


# -- Tiers.write_tokens -----------------------------------------------------------------------


def tiers(layers: int, heads: int, head_dim: int, dtype: torch.dtype, page: int) -> Tiers:
    config = CacheConfig(
        device_pages=12, host_pages=1, page_size=page, layers=layers, heads=heads,
        head_dim=head_dim, dtype=DTYPE_NAMES[dtype], device="cpu",
    )  # fmt: skip
    made = Tiers(config)
    made.device.tensor.view(torch.uint8).fill_(SENTINEL)
    return made


PAGE_LISTS = [(3, 4, 5), (5, 4, 3), (0, 9, 2), (11,), (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pages", PAGE_LISTS, ids=str)
@pytest.mark.parametrize(
    "shape", [(1, 1, 8, 1), (1, 1, 8, 16), (2, 3, 8, 4), (3, 2, 64, 2)], ids=str
)
def test_write_tokens_stores_synthetic_kv_in_exactly_its_pages(
    dtype: torch.dtype, pages: tuple[int, ...], shape: tuple[int, int, int, int]
) -> None:
    layers, heads, head_dim, page = shape
    made = tiers(layers, heads, head_dim, dtype, page)
    tokens = [(7919 * i + 2**35) % 2**50 for i in range(len(pages) * page)]
    made.write_tokens(pages, tuple(tokens))
    layout = made.device.layout
    assert same_bytes(made.read_device(list(pages)), reference_kv(layout, tokens))
    others = [p for p in range(12) if p not in pages]
    assert bool((made.read_device(others).view(torch.uint8) == SENTINEL).all())


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([1, 2, 16]),
    st.sampled_from(DTYPES),
    st.permutations(range(12)).flatmap(lambda order: st.integers(1, 12).map(lambda k: order[:k])),
    st.booleans(),
    st.data(),
)
def test_write_tokens_on_any_pages_is_the_reference(
    page: int, dtype: torch.dtype, pages: list[int], sort: bool, data: st.DataObject
) -> None:
    chosen = sorted(pages) if sort else pages  # sorted: often a run of pages
    made = tiers(2, 1, 8, dtype, page)
    tokens = data.draw(
        st.lists(
            st.integers(0, 2**64 - 1), min_size=len(chosen) * page, max_size=len(chosen) * page
        )
    )
    made.write_tokens(chosen, tokens)
    assert same_bytes(made.read_device(chosen), reference_kv(made.device.layout, tokens))
    others = [p for p in range(12) if p not in chosen]
    assert bool((made.read_device(others).view(torch.uint8) == SENTINEL).all())


@pytest.mark.parametrize(
    ("pages", "tokens", "error", "message"),
    [
        ((3, 12), 8, ForeignSlot, "device pool: page 12 outside 0..11"),
        ((3, True), 8, NotASlot, "device pool: page True is not an int"),
        ((3, 4), 7, PoolError, "does not fit 2 pages"),
        ((3, 4), 12, PoolError, "does not fit 2 pages"),
        ((4, 4), 8, PoolError, "device pool: page 4 is listed twice"),
        ((), 4, PoolError, "does not fit 0 pages"),
    ],
)
def test_a_refused_write_tokens_changes_nothing(
    pages: tuple[int, ...], tokens: int, error: type[Exception], message: str
) -> None:
    made = tiers(1, 1, 8, torch.float16, 4)
    with pytest.raises(error, match=message):
        made.write_tokens(pages, list(range(tokens)))
    assert bool((made.device.tensor.view(torch.uint8) == SENTINEL).all())


def test_write_tokens_of_nothing_writes_nothing() -> None:
    made = tiers(1, 1, 8, torch.float16, 4)
    made.write_tokens((), ())
    assert bool((made.device.tensor.view(torch.uint8) == SENTINEL).all())


# -- KVPool.write and write_values: runs, scattered pages, both layouts ------------------------


def pool(name: str, layout: KVLayout, pages: int = 10) -> KVPool:
    made = (
        device_pool(layout, pages, CPU) if name == "device" else host_pool(layout, pages, pin=False)
    )
    made.tensor.view(torch.uint8).fill_(SENTINEL)
    return made


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(["device", "host"]),
    layouts(),
    st.permutations(range(10)).flatmap(lambda order: st.integers(0, 10).map(lambda k: order[:k])),
    st.booleans(),
    st.sampled_from(["kv", "values", "pages last", "slots last"]),
)
def test_a_write_stores_each_page_and_nothing_else(
    name: str, layout: KVLayout, pages: list[int], sort: bool, given_as: str
) -> None:
    chosen = sorted(pages) if sort else pages
    target = pool(name, layout)
    tokens = [(104_729 * i) % 2**45 for i in range(len(chosen) * layout.page_size)]
    kv = synthetic_kv(layout, tokens)
    if given_as == "slots last":  # [layers, planes, heads, head_dim, slots], as float64
        target.write_slots(chosen, kv.to(torch.float64).permute(0, 1, 3, 4, 2).contiguous())
    elif given_as != "kv":  # the same integers as float64 values, in pages, cast by the pool
        paged = kv.to(torch.float64).reshape(
            layout.layers,
            layout.planes,
            len(chosen),
            layout.page_size,
            layout.heads,
            layout.head_dim,
        )
        if given_as == "values":
            target.write_values(chosen, paged)
        else:  # the pages last, laid out that way in memory
            last = paged.permute(0, 1, 3, 4, 5, 2).contiguous()
            target.write_values(chosen, last, pages_last=True)
    else:
        target.write(chosen, kv)
    assert same_bytes(target.read(chosen), kv)
    others = [p for p in range(10) if p not in chosen]
    assert bool((target.read(others).view(torch.uint8) == SENTINEL).all())


@pytest.mark.parametrize("name", ["device", "host"])
def test_a_non_contiguous_kv_is_written_as_its_values(name: str) -> None:
    layout = KVLayout(2, 2, 4, torch.float16, 2)
    target = pool(name, layout)
    full = torch.randn(2, 2, 8, 2, 4).to(torch.float16)
    for pages in ([2, 3], [5, 1]):
        kv = full[:, :, ::2]  # every other token: strided
        target.write(pages, kv)
        assert torch.equal(target.read(pages), kv)


@pytest.mark.parametrize("name", ["device", "host"])
def test_write_values_refuses_a_shape_or_page_and_changes_nothing(name: str) -> None:
    layout = KVLayout(1, 2, 4, torch.bfloat16, 2)
    target = pool(name, layout)
    good = torch.zeros(1, 2, 2, 2, 2, 4)
    with pytest.raises(PoolError) as caught:
        target.write_values([1, 2], torch.zeros(1, 2, 4, 2, 4))
    assert str(caught.value) == (
        f"{name} pool: values of shape (1, 2, 4, 2, 4) do not fit 2 pages, "
        "which need shape (1, 2, 2, 2, 2, 4)"
    )
    with pytest.raises(PoolError) as caught:
        target.write_values([1, 2], good, pages_last=True)
    assert str(caught.value) == (
        f"{name} pool: values of shape (1, 2, 2, 2, 2, 4) do not fit 2 pages, "
        "which need shape (1, 2, 2, 2, 4, 2)"
    )
    last = torch.zeros(1, 2, 2, 2, 4, 2)
    with pytest.raises(PoolError, match=rf"^{name} pool: page 2 is listed twice$"):
        target.write_values([2, 2], last, pages_last=True)
    with pytest.raises(ForeignSlot, match=rf"^{name} pool: page 10 outside 0\.\.9$"):
        target.write_values([9, 10], last, pages_last=True)
    with pytest.raises(PoolError, match=rf"^{name} pool: page 2 is listed twice$"):
        target.write_values([2, 2], good)
    with pytest.raises(ForeignSlot, match=rf"^{name} pool: page 10 outside 0\.\.9$"):
        target.write_values([9, 10], good)
    with pytest.raises(NotASlot, match=rf"^{name} pool: page 1\.0 is not an int$"):
        target.write_values([0, 1.0], good)  # type: ignore[list-item]
    assert bool((target.tensor.view(torch.uint8) == SENTINEL).all())


@pytest.mark.parametrize("name", ["device", "host"])
def test_write_slots_refuses_a_shape_or_page_and_changes_nothing(name: str) -> None:
    layout = KVLayout(1, 2, 4, torch.bfloat16, 2)
    target = pool(name, layout)
    slots = torch.zeros(1, 2, 2, 4, 4)
    with pytest.raises(PoolError) as caught:
        target.write_slots([1, 2], torch.zeros(1, 2, 2, 4, 3))
    assert str(caught.value) == (
        f"{name} pool: values of shape (1, 2, 2, 4, 3) do not fit 2 pages, "
        "which need shape (1, 2, 2, 4, 4)"
    )
    with pytest.raises(PoolError, match=rf"^{name} pool: page 2 is listed twice$"):
        target.write_slots([2, 2], slots)
    with pytest.raises(ForeignSlot, match=rf"^{name} pool: page 10 outside 0\.\.9$"):
        target.write_slots([9, 10], slots)
    with pytest.raises(NotASlot, match=rf"^{name} pool: page True is not an int$"):
        target.write_slots([0, True], slots)
    with pytest.raises(NotASlot, match=rf"^{name} pool: page 1\.0 is not an int$"):
        target.write_slots([0, 1.0], slots)  # type: ignore[list-item]
    assert bool((target.tensor.view(torch.uint8) == SENTINEL).all())


def test_pages_the_allocator_handed_out_are_written_where_they_are() -> None:
    """A run the pool's allocator knows is found by identity; the pool's own bounds still hold.

    After a reset of the tiers (a new allocator), and for an allocator of
    more pages than the pool (a run past the pool's end is refused).
    """
    made = tiers(1, 1, 8, torch.float16, 16)
    layout = made.device.layout
    for _ in range(2):
        pages = made.alloc_device(3, 0)
        tokens = [(7919 * i + 5) % 2**40 for i in range(3 * 16)]
        made.write_tokens(pages, tokens)
        assert same_bytes(made.read_device(list(pages)), reference_kv(layout, tokens))
        made.device.allocator.free(pages, 0)
        made.reset()
    made.device.allocator = PageAllocator("device", 20, 16)
    with pytest.raises(ForeignSlot, match=r"^device pool: page 12 outside 0\.\.11$"):
        made.write_tokens(tuple(range(10, 13)), list(range(48)))
    assert bool((made.read_device([10, 11]).view(torch.uint8) == SENTINEL).all())


class _Calls(TorchFunctionMode):
    """Records the names of the tensor operations called under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: object,
        args: Sequence[object] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("page", [1, 2, 16])
def test_write_tokens_of_a_run_on_cpu_makes_no_torch_call(page: int) -> None:
    """A small layout's run of pages of a CPU pool is computed and stored by numpy, at any page size.

    What an insert that writes its own KV pays: a numpy call costs a fraction
    of a torch call's dispatch on arrays this small, and the store goes
    through a numpy view of the pool, so no torch call is made at all.
    """
    made = tiers(2, 1, 8, torch.float16, page)
    made.write_tokens((9, 10, 11), list(range(3 * page)))  # made once: constants, a view by length
    pages = made.alloc_device(3, 0)
    tokens = [(7919 * i + 2**35) % 2**64 for i in range(3 * page)]
    with _Calls() as calls:
        made.write_tokens(pages, tokens)
    assert calls.names == []
    assert same_bytes(made.read_device(list(pages)), reference_kv(made.device.layout, tokens))


@pytest.mark.parametrize("page", [1, 2, 16])
def test_slot_values_off_the_cpu_are_one_addcmul_and_one_shift(page: int) -> None:
    """On another device (a GPU; here the meta device) the tokens are uploaded, then two calls.

    No view of the tokens lays them out by page; the pool's slice is taken in
    the store itself (one ``__setitem__``, which ``KVPool.write_slots`` makes).
    """
    layout = KVLayout(2, 1, 8, torch.float16, page)
    pattern = tiers_module._pattern(layout, torch.device("meta"))  # noqa: SLF001
    pattern.slot_values(list(range(3 * page)))  # a view of the constants by length, made once
    with _Calls() as calls:
        made = pattern.slot_values(list(range(5, 5 + 3 * page)))
    assert calls.names == ["to", "addcmul", "bitwise_right_shift_"]  # to: the upload
    assert isinstance(made, torch.Tensor)
    assert made.shape == (2, 2, 1, 8, 3 * page)


def test_a_write_longer_than_a_slot_run_takes_the_general_path_to_the_same_bytes() -> None:
    config = CacheConfig(
        device_pages=40, host_pages=1, page_size=16, layers=1, heads=1, head_dim=8,
        dtype="float16", device="cpu",
    )  # fmt: skip
    made = Tiers(config)
    made.write_tokens((39,), list(range(16)))  # the constants are made at the first write
    for count in (SLOT_RUN // 16, SLOT_RUN // 16 + 1, 40):
        pages = tuple(range(count))
        tokens = [(104_729 * i + count) % 2**45 for i in range(count * 16)]
        with _Calls() as calls:
            made.write_tokens(pages, tokens)
        assert ("as_strided" in calls.names) == (count * 16 > SLOT_RUN)
        assert same_bytes(made.read_device(list(pages)), reference_kv(made.device.layout, tokens))


def test_pages_of_an_int_subclass_are_pages() -> None:
    class Page(int):
        pass

    layout = KVLayout(1, 1, 4, torch.float32, 1)
    target = pool("device", layout)
    kv = synthetic_kv(layout, [5, 6, 7])
    for pages in ([Page(3), Page(4), Page(5)], [Page(8), Page(0), Page(6)]):
        target.write(pages, kv)
        assert same_bytes(target.read([int(p) for p in pages]), kv)
