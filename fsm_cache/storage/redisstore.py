"""A store shared by many servers: pages as values on a Redis or Valkey server.

One key per page (``<prefix><page key>``) holds the page's header and bytes
together (:mod:`fsm_cache.storage.codec`), so a page the server evicts is gone
whole: it reads as a shorter prefix, never as a header whose bytes are missing
(LMCache's connector stored them under two keys and hit exactly that). Pages
are written with ``SET NX``: keys are content-addressed, so when two servers
store the same prefix the second write is a no-op. Prefix queries pipeline one
``EXISTS`` per key; reads ``MGET`` a batch and stop at the first page missing.

The server owns eviction (``maxmemory`` with an ``allkeys-lru`` policy): pages
vanish whenever it needs room, so :meth:`RedisStore.exists_prefix` is a hint and
:meth:`RedisStore.get` may return fewer pages than it said. A key under the
prefix that holds another type than a string (a hash, a list: not a page) is
counted by ``EXISTS`` but read as nil by ``MGET``: a read that meets one
raises :class:`~fsm_cache.errors.CorruptPage`, as for any value that is not a
page, so a cache drops it once instead of finding it again at every lookup.
``SET NX`` leaves such a key as if it held the page: a put asks each key's
``TYPE`` in the same round trip, and overwrites one of another type. A server that goes
away fails the operation with :class:`~fsm_cache.errors.StoreFailed`, which says
how many leading pages of a put were acknowledged; so does a round trip answered
with another count of answers than it sent commands, since answers are matched
to pages by position. Needs the ``redis`` client
package (the ``storage`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar, cast

import torch


try:
    import redis
except ModuleNotFoundError as exc:  # pragma: no cover - tested in a fresh interpreter
    raise ModuleNotFoundError(
        "fsm_cache.storage.RedisStore talks to the server with the redis package, which comes "
        "with the storage extra: pip install 'fsm-cache[storage]'",
        name="redis",
    ) from exc

from fsm_cache.errors import BadArgument, CorruptPage, StoreFailed
from fsm_cache.numeric import whole
from fsm_cache.storage import codec
from fsm_cache.storage.base import Capacity, PutResult, check_count, stored_prefix
from fsm_cache.storage.keys import check_keys


T = TypeVar("T")

PREFIX = "fsm:page:"
_FAILURES = (redis.exceptions.RedisError, OSError)
"""What a round trip may raise: the server went away, timed out, or answered an error
(NOPERM, BUSY, MISCONF, ...); each is a :class:`StoreFailed`. redis-py wraps a socket's
errors in its own, but a client of another make may let ``ConnectionResetError`` or
``TimeoutError`` through: both are ``OSError``."""


class RedisStore:
    """Pages on a Redis (or Valkey) server, shared by every client that connects to it.

    Args:
        client: A connected client (``redis.Redis``, or ``fakeredis.FakeRedis``
            in tests); values must come back as bytes (the default: not
            ``decode_responses``).
        prefix: What every page's Redis key starts with.
        batch_pages: The most pages one pipelined round trip carries.
        batch_bytes: The most page bytes one round trip carries, so a batch of
            large pages is not all encoded in memory at once.

    Raises:
        BadArgument: ``client`` has no ``connection_pool`` to name the server
            by or decodes replies as text, ``prefix`` is not a str, or a batch
            limit is not an int >= 1.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = PREFIX,
        batch_pages: int = 128,
        batch_bytes: int = 4 << 20,
    ) -> None:
        options = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
        if not isinstance(options, Mapping):
            raise BadArgument(
                "client must be a redis.Redis client (with a connection_pool), "
                f"not {type(client).__name__}"
            )
        decoding = options.get("decode_responses")
        if decoding:  # redis-py decodes for any true value, the string "false" of a URL included
            raise BadArgument(
                f"client must return values as bytes, not decode them (decode_responses={decoding!r})"
            )
        if not isinstance(prefix, str):  # bytes would be spelled b'...' into every name
            raise BadArgument(f"prefix must be a str, not {prefix!r}")
        self._client = client
        self.prefix = prefix
        self.batch_pages = check_count("batch_pages", batch_pages, 1)
        self.batch_bytes = check_count("batch_bytes", batch_bytes, 1)
        self.where = f"redis {options.get('host', 'localhost')}:{options.get('port', 6379)}"

    @classmethod
    def connect(cls, url: str, **options: Any) -> RedisStore:
        """Return a store on the server at ``url`` (``redis://127.0.0.1:6379/0``).

        Raises:
            BadArgument: ``url`` is not a Redis URL (the message leaves the URL
                out: it may hold a password), or an option is bad (as the class);
                the client made for it is closed.
        """
        if not isinstance(url, str):
            raise BadArgument(f"url must be a str, not {type(url).__name__}")
        try:
            client = redis.Redis.from_url(url)
        except ValueError as exc:
            raise BadArgument(f"url is not a Redis URL: {exc}") from None
        try:
            return cls(client, **options)
        except BaseException as exc:
            client.close()
            if isinstance(exc, TypeError) and not isinstance(exc, BadArgument):
                # an option the class does not take (a misspelt name)
                raise BadArgument(f"RedisStore.connect: {exc}") from None
            raise

    def name(self, key: str) -> str:
        """Return the Redis key of page ``key``.

        Raises:
            BadArgument: ``key`` is not a page key.
        """
        check_keys([key])
        return self._name(key)

    def exists_prefix(self, keys: Sequence[str]) -> int:
        """Return how many leading ``keys`` the server holds now (one pipelined round trip a batch)."""
        check_keys(keys)
        count = 0
        for batch in self.batches([0] * len(keys)):
            pipe = self._client.pipeline(transaction=False)
            for key in keys[batch.start : batch.stop]:
                pipe.exists(self._name(key))
            answers = self._answers("exists", count, len(keys), pipe.execute, len(batch))
            for answer in answers:
                if not answer:
                    return count
                count += 1
        return count

    def get(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """Return the leading pages of ``keys`` the server holds, each verified; see :class:`Store`.

        The first round trip reads one page; later ones read as many pages of
        that size as :attr:`batch_bytes` allows (redis-py reads large replies
        faster in moderate pieces). Where a page reads as missing, one more
        round trip asks whether its key holds a value of another type.

        Raises:
            CorruptPage: A value is not the page its key names, or its key
                holds another type than a string (a hash, a list).
            StoreFailed: The server went away; ``acknowledged`` pages were read.
        """
        check_keys(keys)
        pages: list[torch.Tensor] = []
        step = 1
        while len(pages) < len(keys):
            start = len(pages)
            names = [self._name(key) for key in keys[start : start + step]]
            read = partial(self._client.mget, names)
            values = self._answers("get", start, len(keys), read, len(names))
            for index, value in enumerate(cast("list[bytes | None]", values), start):
                if value is None:
                    self._refuse_other_type(names[index - start], keys[index], index, len(keys))
                    return pages
                pages.append(
                    codec.decode(f"{self.where} {names[index - start]}", keys[index], value)
                )
                step = max(1, min(self.batch_pages, self.batch_bytes // len(value)))
        return pages

    def _refuse_other_type(self, name: str, key: str, done: int, total: int) -> None:
        """Raise :class:`CorruptPage` where ``name`` holds a value that is not a string.

        ``MGET`` answers nil for a key that is missing and for one holding a
        hash, a list or any other type alike, but ``EXISTS`` counts the
        latter as there: read as missing, it would be offered by
        every lookup, fetched and found gone again for ever. As a value that
        is not a page, it is corrupt once, and a cache drops it. One round
        trip, only where a read ends early.

        Raises:
            CorruptPage: ``name`` holds a value of another type than a string.
            StoreFailed: The server went away.
        """
        answer = self._call("get", done, total, partial(self._client.type, name))
        kind = _kind(answer)
        if kind not in ("none", "string"):  # a string: stored since the read, a page after all
            raise CorruptPage(f"{self.where} {name}", key, f"a Redis {kind}, not a page")

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[PutResult]:
        """Store ``pages`` with ``SET NX``, a pipelined batch at a time; see :class:`Store`.

        A page the server refuses for want of memory (a ``noeviction`` policy)
        is ``FULL``, and the batches after it are not sent (``SKIPPED``); pages
        of the same batch after it were already sent and are reported as the
        server answered them.

        ``SET NX`` leaves a key that holds another type than a string (a hash,
        a list) and answers as for a page there: each ``SET NX`` is followed by
        the key's ``TYPE`` in the same round trip, and a key of another type is
        overwritten (``STORED``) in one more round trip, only where a batch
        has one. Called ``PRESENT``, it would cost the first read of it.

        Raises:
            StoreFailed: The server went away, or answered a batch with another
                count of answers than it sent commands; ``acknowledged`` leading
                pages were stored before, and the batch it failed in may have
                landed in part.
        """
        codec.check_pages(keys, pages)
        sizes = [page.numel() * page.element_size() for page in pages]
        results: list[PutResult] = []
        for batch in self.batches(sizes):
            if not all(result.held for result in results):  # a page was refused
                results.extend([PutResult.SKIPPED] * (batch.stop - batch.start))
                continue
            pipe = self._client.pipeline(transaction=False)
            for key, page in zip(
                keys[batch.start : batch.stop], pages[batch.start : batch.stop], strict=True
            ):
                pipe.set(self._name(key), codec.encode(key, page), nx=True)
                pipe.type(self._name(key))
            done = stored_prefix(results)
            send = partial(pipe.execute, False)
            answers = self._answers("put", done, len(keys), send, 2 * len(batch))
            settled = [self._result(answer, done, len(keys)) for answer in answers[::2]]
            others = [
                batch.start + index
                for index, (result, kind) in enumerate(zip(settled, answers[1::2], strict=True))
                if result is PutResult.PRESENT and self._other_type(kind, done, len(keys))
            ]
            if others:  # the batch's pages before the first of them are stored
                done = stored_prefix([*results, *settled[: others[0] - batch.start]])
                replaced = self._replace(keys, pages, others, done)
                for index, result in zip(others, replaced, strict=True):
                    settled[index - batch.start] = result
            results.extend(settled)
        return results

    def _other_type(self, answer: object, done: int, total: int) -> bool:
        """Whether a put's ``TYPE`` answer names another type than a string (``none``: evicted since).

        Raises:
            StoreFailed: The server answered the ``TYPE`` with an error.
        """
        if isinstance(answer, redis.exceptions.ResponseError):
            raise StoreFailed(self.where, "put", acknowledged=done, total=total, cause=str(answer))
        return _kind(answer) not in ("none", "string")

    def _replace(
        self, keys: Sequence[str], pages: Sequence[torch.Tensor], others: Sequence[int], done: int
    ) -> list[PutResult]:
        """Overwrite the keys at ``others`` (of another type) with their pages, in one round trip.

        Returns:
            What the server answered each overwrite: ``STORED``, or ``FULL``.

        Raises:
            StoreFailed: The server went away or refused an overwrite otherwise;
                ``done`` leading pages were stored.
        """
        pipe = self._client.pipeline(transaction=False)
        for index in others:
            pipe.set(self._name(keys[index]), codec.encode(keys[index], pages[index]))
        send = partial(pipe.execute, False)
        answers = self._answers("put", done, len(keys), send, len(others))
        return [self._result(answer, done, len(keys)) for answer in answers]

    def drop(self, keys: Sequence[str]) -> int:
        """Delete the pages of ``keys``, a batch at a time; return how many the server held.

        Raises:
            StoreFailed: The server went away; the ``acknowledged`` leading
                keys (the batches before the one that failed) were dropped.
        """
        check_keys(keys)
        dropped = 0
        for batch in self.batches([0] * len(keys)):
            names = [self._name(key) for key in keys[batch.start : batch.stop]]
            delete = partial(self._client.delete, *names)
            count = self._call("drop", batch.start, len(keys), delete)
            if not whole(count) or count > len(names):  # DEL answers how many keys it deleted
                cause = f"DEL of {len(names)} keys answered {count!r}, not a count of them"
                raise StoreFailed(
                    self.where, "drop", acknowledged=batch.start, total=len(keys), cause=cause
                )
            dropped += count
        return dropped

    def capacity(self) -> Capacity:
        """Return the server's memory in use and its ``maxmemory`` (None when unset).

        Raises:
            StoreFailed: The server is gone, does not answer ``INFO``, or its
                answer has no ``used_memory`` byte count (a Redis-compatible
                server may leave it out); a missing ``maxmemory`` is unset.
        """
        info = self._call("capacity", 0, 0, partial(self._client.info, "memory"))
        if not isinstance(info, dict):
            raise self._capacity_failed(f"INFO memory answered {type(info).__name__}, not fields")
        if "used_memory" not in info:
            raise self._capacity_failed("INFO memory has no used_memory")
        used, limit = info["used_memory"], info.get("maxmemory", 0)
        for field, value in (("used_memory", used), ("maxmemory", limit)):
            if not whole(value):
                raise self._capacity_failed(f"INFO memory's {field} is {value!r}, not a byte count")
        return Capacity(used, 0, limit or None, None)

    def _capacity_failed(self, cause: str) -> StoreFailed:
        """Return the :class:`StoreFailed` of an ``INFO`` answer :meth:`capacity` cannot read."""
        return StoreFailed(self.where, "capacity", acknowledged=0, total=0, cause=cause)

    def close(self) -> None:
        """Close the client's connections; the pages stay on the server."""
        self._client.close()

    def _name(self, key: str) -> str:
        """Return :meth:`name` of a key already checked."""
        return f"{self.prefix}{key}"

    def _result(self, answer: object, done: int, total: int) -> PutResult:
        """Return what the server's answer to one ``SET NX`` means."""
        if isinstance(answer, redis.exceptions.ResponseError):
            if isinstance(answer, redis.exceptions.OutOfMemoryError) or str(answer).startswith(
                "OOM"
            ):
                return PutResult.FULL
            raise StoreFailed(self.where, "put", acknowledged=done, total=total, cause=str(answer))
        return PutResult.STORED if answer else PutResult.PRESENT

    def _call(self, operation: str, done: int, total: int, call: Callable[[], T]) -> T:
        """Run one round trip; a server that went away or answered an error is a :class:`StoreFailed`."""
        try:
            return call()
        except _FAILURES as exc:
            raise StoreFailed(
                self.where, operation, acknowledged=done, total=total, cause=str(exc)
            ) from exc

    def _answers(
        self, operation: str, done: int, total: int, call: Callable[[], object], sent: int
    ) -> list[object]:
        """Run one round trip of ``sent`` commands; answers of another count are a :class:`StoreFailed`.

        Answers are matched to pages by position: a client or proxy that lost
        one would shift the rest onto the wrong pages, so a put would
        acknowledge a page never stored and a prefix count would run past a gap.
        """
        answers = self._call(operation, done, total, call)
        if not isinstance(answers, list) or len(answers) != sent:
            got = len(answers) if isinstance(answers, list) else type(answers).__name__
            cause = f"answers to {got} of {sent} commands"
            raise StoreFailed(self.where, operation, acknowledged=done, total=total, cause=cause)
        return answers

    def batches(self, sizes: Sequence[int]) -> Iterator[range]:
        """Split pages of ``sizes`` bytes into the runs one round trip each carries.

        A run holds at most :attr:`batch_pages` pages and, unless it is a single
        page, at most :attr:`batch_bytes` bytes.
        """
        start, nbytes = 0, 0
        for index, size in enumerate(sizes):
            full = index - start >= self.batch_pages or nbytes + size > self.batch_bytes
            if index > start and full:
                yield range(start, index)
                start, nbytes = index, 0
            nbytes += size
        if start < len(sizes):
            yield range(start, len(sizes))


def _kind(answer: object) -> str:
    """Return the type a ``TYPE`` answer names (bytes, or text from a client that decodes it)."""
    return answer.decode(errors="replace") if isinstance(answer, bytes) else str(answer)
