"""asyncio: `await channel.next_event()` and `async for`, cancel-safe: a
wait cut short by `asyncio.wait_for` or a cancelled task loses no event."""

import asyncio
import threading
import time

import ferry
from conftest import Pair

N = 2000


def source(pair, n, stop):
    """Move buffers 0..n-1 (seq in meta), recycling those passed back."""
    sent = 0
    while sent < n and not stop.is_set():
        buf = pair.alloc.alloc()
        if buf is None:
            ev = pair.tx.wait(0.01)
            assert ev is None or isinstance(ev, ferry.BufferPassed)
            continue
        pair.tx.move(buf, sent.to_bytes(8, "little"))
        sent += 1
        if sent % 50 == 0:
            time.sleep(0.005)  # gaps longer than the consumer's timeouts


def test_wait_for_timeouts_lose_no_event():
    pair = Pair(count=32)
    stop = threading.Event()
    t = threading.Thread(target=source, args=(pair, N, stop))

    async def consume():
        seen, timeouts = [], 0
        while len(seen) < N:
            try:
                ev = await asyncio.wait_for(pair.rx.next_event(), timeout=0.0002 * (1 + len(seen) % 7))
            except asyncio.TimeoutError:
                timeouts += 1
                continue
            assert isinstance(ev, ferry.MoveReceived), ev
            seen.append(int.from_bytes(ev.meta, "little"))
            pair.rx.pass_(ev.buffer)
        return seen, timeouts

    t.start()
    try:
        seen, timeouts = asyncio.run(asyncio.wait_for(consume(), 60))
    finally:
        stop.set()
        t.join(30)
    assert seen == list(range(N))
    assert timeouts > 0  # the waits were cut short, and nothing went missing


def test_cancelled_tasks_lose_no_event():
    """A task waiting in next_event is cancelled right after the channel's
    fd woke the loop and before the task ran again: the moment a Future
    that already held the event would lose it. Every event still arrives."""
    pair = Pair(count=8)

    async def run():
        seen, cancelled = [], 0
        for i in range(200):
            task = asyncio.ensure_future(pair.rx.next_event())
            await asyncio.sleep(0)  # the task polls, arms, waits on the fd
            pair.tx.move(pair.alloc.alloc(), i.to_bytes(8, "little"))
            await asyncio.sleep(0)  # the loop sees the fd and runs its reader callback
            await asyncio.sleep(0)
            task.cancel()  # before the task resumes
            try:
                ev = await task
            except asyncio.CancelledError:
                cancelled += 1
                ev = await asyncio.wait_for(pair.rx.next_event(), 10)
            assert isinstance(ev, ferry.MoveReceived), ev
            seen.append(int.from_bytes(ev.meta, "little"))
            pair.rx.pass_(ev.buffer)
            del ev
            while (back := pair.tx.poll()) is not None:
                assert isinstance(back, ferry.BufferPassed)
                del back
        return seen, cancelled

    seen, cancelled = asyncio.run(run())
    assert seen == list(range(200))
    assert cancelled > 0


def test_async_for_until_closed():
    pair = Pair(count=8)

    async def run():
        for i in range(5):
            pair.tx.move(pair.alloc.alloc(), bytes([i]))
        pair.tx.teardown()
        metas = []
        async for ev in pair.rx:
            if isinstance(ev, ferry.MoveReceived):
                metas.append(ev.meta)
                pair.rx.pass_(ev.buffer)
            elif isinstance(ev, ferry.Closed):
                pass
        return metas

    assert asyncio.run(run()) == [bytes([i]) for i in range(5)]
