"""Prefix-chained page keys: one SHA-256 digest per page, namespaced by model, layout and rank.

A page's key digests its parent page's key and its own tokens, so a key names
the page *and every page before it*: two requests share a key exactly when they
share the whole prefix up to that page. That is what lets a store answer a
prefix question by counting how many leading keys it holds, and why a stored
page is useless when its parent is gone.

The first page chains from the namespace's root digest, which digests the model,
the KV layout (shape and dtype per token), the page size and the tensor-parallel
rank: KV computed by another model, with another layout, or for another rank's
heads never shares a key. Tokens are encoded as 4-byte little-endian unsigned
integers, as SGLang's HiCache chain does. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsm_cache.errors import BadArgument
from fsm_cache.storage.base import check_count, check_sequence


if TYPE_CHECKING:
    from fsm_cache.memory.kv import KVLayout

_HEX_KEY = re.compile(r"[0-9a-f]{64}")
_FORMAT = b"fsm_cache.storage/keys/v1"
_UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two servers' KV pages to be interchangeable.

    Attributes:
        model: The model's id (a name and revision), as the operator spells it.
        layout: The KV layout of one token, e.g. from :meth:`for_layout`.
        page_size: Tokens per page.
        rank: This rank's index in its tensor-parallel group.
        ranks: The group's size (1 without tensor parallelism).
        tree: A namespace of the cache's tree within the model (a LoRA
            adapter), as its ``repr``; None for the model's own pages. A field
            of its own, so no model id can spell another model's adapter.

    Raises:
        BadArgument: A field of the wrong type or out of range. The fields are
            digested as JSON, so ``page_size=4.0`` or ``rank=True`` would key
            pages apart from ``4`` and ``1`` without a word.
    """

    model: str
    layout: str
    page_size: int
    rank: int = 0
    ranks: int = 1
    tree: str | None = None

    def __post_init__(self) -> None:
        for name in ("model", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise BadArgument(f"{name} must be a non-empty str, not {value!r}")
        check_count("page_size", self.page_size, 1)
        check_count("ranks", self.ranks, 1)
        if check_count("rank", self.rank) >= self.ranks:
            raise BadArgument(f"rank {self.rank} is outside a group of {self.ranks}")
        if self.tree is not None and not isinstance(self.tree, str):
            raise BadArgument(f"tree must be a str or None, not {self.tree!r}")

    @classmethod
    def for_layout(
        cls, model: str, layout: KVLayout, *, rank: int = 0, ranks: int = 1
    ) -> Namespace:
        """Return the namespace of a cache with KV ``layout`` (its page size included).

        An MLA cache holds the same latent on every rank, so its ranks may share
        one namespace (``rank=0, ranks=1``) and only one of them write.

        Raises:
            BadArgument: ``layout`` is not a KV layout, or a field is bad (as the class).
        """
        try:
            dtype = str(layout.dtype).removeprefix("torch.")
            shape = f"layers={layout.layers},planes={layout.planes},heads={layout.heads}"
            described = f"{shape},head_dim={layout.head_dim},dtype={dtype}"
            page_size = layout.page_size
        except AttributeError:
            raise BadArgument(f"layout must be a KVLayout, not {type(layout).__name__}") from None
        return cls(model, described, page_size, rank=rank, ranks=ranks)

    def root(self) -> str:
        """Return the digest the first page of every sequence chains from (hex)."""
        fields: list[object] = [self.model, self.layout, self.page_size, self.rank, self.ranks]
        if self.tree is not None:  # the model's own pages keep the keys they always had
            fields.append(self.tree)
        encoded = json.dumps(fields, separators=(",", ":")).encode()
        return hashlib.sha256(_FORMAT + b"\0" + encoded).hexdigest()


def page_keys(namespace: Namespace, tokens: Sequence[int], parent: str | None = None) -> list[str]:
    """Return the key of each page of ``tokens``, chained from ``parent``.

    Args:
        namespace: The model, layout, page size and rank the KV belongs to.
        tokens: Token ids, a whole number of pages.
        parent: The key of the page just before ``tokens`` (a node's parent's
            last page), or None when ``tokens`` starts the sequence.

    Returns:
        One 64-character hex key per page, in order.

    Raises:
        BadArgument: ``namespace`` is not a :class:`Namespace`, ``tokens`` is
            not a sequence or not a whole number of pages, a token does not fit
            32 unsigned bits, or ``parent`` is not a page key.
    """
    if not isinstance(namespace, Namespace):
        raise BadArgument(f"namespace must be a Namespace, not {type(namespace).__name__}")
    check_sequence("tokens", tokens, "ints")
    size = namespace.page_size
    if len(tokens) % size:
        raise BadArgument(f"{len(tokens)} tokens is not a whole number of pages of {size}")
    if parent is not None:
        check_keys([parent])
    encoded = _encode(tokens)
    prior = bytes.fromhex(parent if parent is not None else namespace.root())
    keys = []
    for start in range(0, len(encoded), 4 * size):
        prior = hashlib.sha256(prior + encoded[start : start + 4 * size]).digest()
        keys.append(prior.hex())
    return keys


def check_keys(keys: Sequence[str]) -> None:
    """Refuse anything that is not a page key, before a store turns it into a path or a name.

    Raises:
        BadArgument: ``keys`` is not a sequence (:func:`check_sequence`), or
            naming the first bad key and its position.
    """
    check_sequence("keys", keys, "page keys")
    for index, key in enumerate(keys):
        if not isinstance(key, str) or not _HEX_KEY.fullmatch(key):
            raise BadArgument(f"key {index} is not a page key (64 lowercase hex digits): {key!r}")


def _encode(tokens: Sequence[int]) -> bytes:
    """Return ``tokens`` as 4-byte little-endian unsigned integers."""
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        for index, token in enumerate(tokens):
            if not isinstance(token, int) or not 0 <= token <= _UINT32_MAX:
                raise BadArgument(
                    f"token {token!r} at {index} does not fit an unsigned 32-bit integer"
                ) from None
        raise  # pragma: no cover - struct refused tokens that each fit
