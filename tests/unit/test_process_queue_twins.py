"""The compiled and the pure-Python filing of messages in a ProcessQueue agree.

``cache_run`` files a pulled chunk and ``uncache`` takes consumed messages out again: the
ProcessQueue's two loops per message. Both implementations get the same inputs (chunks in
order, out of order, with duplicates, with offsets already cached or taken by an orderly
consumer, other objects than ``MessageExt``, bad bodies) and must leave the same state and
return the same values, or raise the same error. A ProcessQueue driven through a random
sequence of puts, removals and orderly takes on each implementation must end up the same.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.protocol import message
from rmq_async.protocol.stored import StoredChunk
from rmq_async.protocol.types import MessageExt

try:
    from rmq_async.protocol import _cmessage
except ImportError:  # pragma: no cover - the extension is built by `make setup`
    _cmessage = None  # type: ignore[assignment]

pytestmark = pytest.mark.skipif(_cmessage is None, reason="compiled codec not built")

PURE = (message._cache_run, message._uncache)


def compiled() -> tuple[Callable[..., Any], Callable[..., Any]]:
    assert _cmessage is not None
    return _cmessage.cache_run, _cmessage.uncache


class Duck:
    """Not a MessageExt: the compiled loops read its attributes the usual way."""

    def __init__(self, offset: int, body: Any) -> None:
        self.queue_offset = offset
        self.body = body


def make(offset: int, size: int, duck: bool = False) -> Any:
    if duck:
        return Duck(offset, b"d" * size)
    return MessageExt(topic="T", body=b"x" * size, queue_offset=offset)


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as exc:  # the error itself is compared
        return "raised", (type(exc), str(exc))


chunk_items = st.lists(
    st.tuples(st.integers(-3, 60), st.integers(0, 40), st.booleans()), max_size=40)


@settings(max_examples=300, deadline=None)
@given(chunk_items, st.lists(st.integers(-3, 60), max_size=20),
       st.lists(st.integers(-3, 60), max_size=10), st.integers(-5, 70))
def test_cache_run_twins_agree(items: list[tuple[int, int, bool]], cached: list[int],
                               taken: list[int], last: int) -> None:
    msgs = [make(o, n, duck) for o, n, duck in items]
    results = []
    for cache_run, _ in (PURE, compiled()):
        cache: dict[int, Any] = {o: "old" for o in cached}
        taken_map: dict[int, Any] = {o: "taken" for o in taken}
        got = outcome(cache_run, msgs, cache, taken_map, last)
        results.append((got, cache))
    assert results[0] == results[1]


@settings(max_examples=300, deadline=None)
@given(chunk_items, st.lists(st.tuples(st.integers(-3, 60), st.integers(0, 3)), max_size=40))
def test_uncache_twins_agree(items: list[tuple[int, int, bool]],
                             cached: list[tuple[int, int]]) -> None:
    msgs = [make(o, n, duck) for o, n, duck in items]
    chunk = StoredChunk.__new__(StoredChunk)
    results = []
    for _, uncache in (PURE, compiled()):
        # Cached entries: messages, other objects with a body, a stored chunk (never removed).
        cache: dict[int, Any] = {}
        for offset, kind in cached:
            cache[offset] = (make(offset, 7), Duck(offset, b"ab"), chunk, make(offset, 0))[kind]
        got = outcome(uncache, msgs, cache, StoredChunk)
        results.append((got, sorted(cache)))
    assert results[0] == results[1]


@pytest.mark.parametrize("fn", ["cache_run", "uncache"])
def test_bad_bodies_and_offsets_raise_the_same_errors(fn: str) -> None:
    bad = [Duck(1, None), Duck("x", b"a"), object()]  # type: ignore[arg-type]
    for item in bad:
        results = []
        for cache_run, uncache in (PURE, compiled()):
            cache: dict[Any, Any] = {1: Duck(1, None), "x": Duck("x", 5)}
            if fn == "cache_run":
                results.append(outcome(cache_run, [item], {}, {}, 0))
            else:
                results.append(outcome(uncache, [item], cache, StoredChunk))
        assert results[0] == results[1]
        assert results[0][0] == "raised" or fn == "uncache"


@contextmanager
def using(impl: tuple[Callable[..., Any], Callable[..., Any]]) -> Iterator[None]:
    saved = message.cache_run, message.uncache
    message.cache_run, message.uncache = impl  # type: ignore[assignment]
    try:
        yield
    finally:
        message.cache_run, message.uncache = saved


def state(pq: ProcessQueue) -> tuple[Any, ...]:
    return (sorted(pq._msgs), list(pq._offsets), sorted(pq._consuming), pq.msg_count,
            pq.msg_size, pq.queue_offset_max, pq.max_span, pq.min_offset, pq.max_offset)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**9), st.randoms(use_true_random=False))
def test_a_process_queue_behaves_the_same_on_both(base: int, rnd: random.Random) -> None:
    queues = {"pure": ProcessQueue(now=0.0), "compiled": ProcessQueue(now=0.0)}
    impls = {"pure": PURE, "compiled": compiled()}
    pulled: list[MessageExt] = []
    next_offset = base
    for _ in range(40):
        op = rnd.choice(["pull", "pull", "again", "remove", "take", "commit", "rollback"])
        if op == "pull":
            n = rnd.randint(0, 12)
            offsets = sorted(rnd.sample(range(next_offset, next_offset + 2 * n + 1), n))
            next_offset += 2 * n + 1
            chunk = [make(o, rnd.randint(0, 30)) for o in offsets]
            pulled.extend(chunk)
        elif op == "again":  # redelivered, duplicated, out of order
            chunk = rnd.sample(pulled, min(len(pulled), rnd.randint(0, 6))) if pulled else []
        else:
            chunk = rnd.sample(pulled, min(len(pulled), rnd.randint(0, 10))) if pulled else []
        answers = []
        for name, pq in queues.items():
            with using(impls[name]):
                if op in ("pull", "again"):
                    answers.append(pq.put_messages(list(chunk)))
                elif op == "remove":
                    answers.append(pq.remove_messages(chunk))
                elif op == "take":
                    answers.append([m.queue_offset for m in pq.take_messages(3)])
                elif op == "commit":
                    answers.append(pq.commit())
                else:
                    pq.rollback()
                    answers.append(None)
        assert answers[0] == answers[1], op
        assert state(queues["pure"]) == state(queues["compiled"]), op
