"""The channel API from Python: setup, events, iteration, selectors,
errors for bad arguments, and waits that release the GIL."""

import gc
import os
import selectors
import signal
import threading
import time

import pytest

import ferry
from conftest import Pair


def test_create_and_bind_return_at_once_and_one_thread_drives_both():
    a, b = ferry.Domain("a"), ferry.Domain("b")
    ep = ferry.Endpoint.local()
    with ferry.Channel.create(a, ep) as tx, ferry.Channel.bind(b, ep) as rx:
        assert tx.state == "initialized" and rx.state == "binding"
        ev = tx.poll()
        assert isinstance(ev, ferry.BindRequest) and ev.binder_role == "slave"
        assert isinstance(rx.poll(), ferry.Bound)
        assert (tx.state, tx.direction, rx.direction) == ("connected", "tx", "rx")
        assert tx.meta_size == ferry.DEFAULT_META_SIZE == 16 and tx.trust == "full"
        alloc = ferry.Allocator(a, 4, 4096)
        tx.assign_pool(alloc.pool)
        req = rx.poll()
        assert isinstance(req, ferry.PoolAssignRequest) and req.count == 4 and req.buffer_size == 4096
        rx.respond_pool(req.pool, True)
        assert isinstance(tx.poll(), ferry.PoolAssigned)
        assert tx.is_assigned(alloc) and rx.is_assigned(req.pool)
        tx.move(alloc.alloc(), b"m")
        ev = rx.wait(10)
        assert isinstance(ev, ferry.MoveReceived) and ev.meta == b"m" and len(ev.buffer) == 4096
        assert ferry.MoveReceived.__match_args__ == ("buffer", "meta")
    assert tx.closed and tx.state == "closed" and tx.poll() is None and tx.wait(0) is None
    with pytest.raises(ferry.NotConnected, match="closed"):
        tx.move(alloc.alloc())


def test_teardown_iteration_and_closed_event(pair):
    for i in range(3):
        pair.tx.move(pair.alloc.alloc(), bytes([i]))
    pair.tx.teardown()
    seen = []
    for ev in pair.rx:  # until the channel closes
        seen.append(ev)
        if isinstance(ev, ferry.MoveReceived):
            pair.rx.pass_(ev.buffer)
    assert [ev.meta for ev in seen[:3]] == [b"\x00", b"\x01", b"\x02"]
    assert isinstance(seen[-1], ferry.Closed) and seen[-1].by_peer


def test_arm_and_fileno_with_selectors(pair):
    assert pair.rx.poll() is None
    assert pair.rx.arm() is True
    sel = selectors.DefaultSelector()
    sel.register(pair.rx.fileno(), selectors.EVENT_READ)
    assert sel.select(0) == []
    pair.tx.move(pair.alloc.alloc())
    assert len(sel.select(10)) == 1
    assert isinstance(pair.rx.poll(), ferry.MoveReceived)
    sel.close()


def test_selector_serves_many_channels():
    pairs = [Pair(count=4) for _ in range(3)]
    sel = ferry.Selector([p.rx for p in pairs])
    assert len(sel) == 3 and sel.channels[1] is pairs[1].rx
    sel.add(pairs[0].rx)  # once only
    assert len(sel) == 3
    pairs[2].tx.move(pairs[2].alloc.alloc(), b"two")
    pairs[0].tx.move(pairs[0].alloc.alloc(), b"zero")
    got = {}
    for _ in range(2):
        ch, ev = sel.wait(10)
        got[ev.meta] = ch
    assert got[b"two"] is pairs[2].rx and got[b"zero"] is pairs[0].rx
    assert sel.wait(0.01) is None
    assert sel.remove(pairs[1].rx) and not sel.remove(pairs[1].rx) and len(sel) == 2


def test_selector_is_fair_and_scales():
    """64 channels; one always has another event, yet an event on another
    channel is served within a round; a channel whose peer went away raises
    from the selector with the channel named; with every channel closed the
    wait ends."""
    pairs = [Pair(count=16) for _ in range(64)]
    sel = ferry.Selector([p.rx for p in pairs])
    busy, quiet = pairs[5], pairs[60]
    for i in range(16):
        busy.tx.move(busy.alloc.alloc(), bytes([i]))
    ch, ev = sel.wait(10)
    assert ch is busy.rx
    quiet.tx.move(quiet.alloc.alloc(), b"q")
    served = []
    for _ in range(4):
        ch, ev = sel.wait(10)
        served.append(ch)
    assert quiet.rx in served[:3]
    quiet.tx.close()
    with pytest.raises(ferry.PeerGone) as info:
        while True:
            ch, ev = sel.wait(10)
            assert ch is busy.rx
    assert info.value.channel is quiet.rx
    for p in pairs:
        p.rx.close()
    assert sel.wait(None) is None


def test_wait_releases_the_gil(pair):
    """A thread waits for 10 s at most; the main thread computes meanwhile
    and then moves the buffer the waiter gets. Were the GIL held while
    waiting, the main thread could not run until the wait timed out."""
    result = {}

    def waiter():
        result["event"] = pair.rx.wait(10)
        result["at"] = time.monotonic()

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    total, start = 0, time.monotonic()
    for i in range(300_000):
        total += i
    computed = time.monotonic()
    assert t.is_alive(), "the waiter returned before anything was sent"
    pair.tx.move(pair.alloc.alloc(), b"go")
    t.join(15)
    assert total == 300_000 * 299_999 // 2
    assert isinstance(result["event"], ferry.MoveReceived) and result["event"].meta == b"go"
    assert result["at"] >= computed >= start


def test_bad_arguments_raise_clear_exceptions():
    d = ferry.Domain("d")
    with pytest.raises(ferry.InvalidArgument, match="power of two") as info:
        ferry.Allocator(d, 4, 1000)
    assert isinstance(info.value, ValueError) and info.value.kind == "BadBufferSize"
    with pytest.raises(ferry.InvalidArgument, match="is not possible"):
        ferry.Allocator(d, 0, 4096)
    with pytest.raises(ferry.InvalidArgument, match='trust level "medium"'):
        ferry.Allocator(d, 4, 4096, trust="medium")
    with pytest.raises(ferry.InvalidArgument, match="direction"):
        ferry.Channel.create(d, ferry.Endpoint.local(), direction="up")
    with pytest.raises(ferry.InvalidArgument, match="meta"):
        ferry.Channel.create(d, ferry.Endpoint.local(), meta_size=ferry.MAX_META_SIZE + 1)
    with pytest.raises(ferry.InvalidArgument, match="queue depth"):
        ferry.Channel.create(d, ferry.Endpoint.local(), queue_depth=3)
    with pytest.raises(ferry.InvalidArgument, match="port"):
        ferry.Endpoint.tcp("127.0.0.1", 70000)
    with pytest.raises(ferry.InvalidArgument, match="does not resolve"):
        ferry.Endpoint.tcp("no such host.invalid", 1)
    with pytest.raises(ferry.InvalidArgument, match="NUL"):
        ferry.Endpoint.shm_abstract("")
    with pytest.raises(ferry.EndpointNotListening, match="no channel is listening"):
        ferry.Channel.bind(d, ferry.Endpoint.local())
    with pytest.raises(ferry.TimedOut) as info:
        ferry.Channel.accept(d, ferry.Endpoint.local(), timeout=0.05)
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(TypeError):
        ferry.Channel.create("d", ferry.Endpoint.local())
    p = Pair()
    with pytest.raises(ferry.InvalidArgument, match="seconds"):
        p.rx.wait(-1)
    with pytest.raises(ferry.InvalidArgument, match="seconds"):
        p.rx.wait(float("nan"))
    with pytest.raises(ferry.InvalidArgument, match="pool policy"):
        p.rx.set_pool_policy("maybe")
    with pytest.raises(ferry.InvalidArgument, match="ferry.Pool"):
        p.tx.assign_pool("pool")
    with pytest.raises(TypeError):
        p.tx.move(b"not a buffer")
    with pytest.raises(TypeError):
        p.tx.move(p.alloc.alloc(), "text is not bytes")
    with pytest.raises(IndexError):
        p.alloc.alloc()[4096]
    with pytest.raises(ferry.InvalidArgument, match="exactly 4 bytes"):
        p.alloc.alloc()[0:4] = b"12345"
    with pytest.raises(ferry.PoolError, match="no assignment request"):
        p.rx.respond_pool(12345, True)
    with pytest.raises(ferry.InvalidArgument, match="not a pool id"):
        p.rx.respond_pool(-1, True)
    with pytest.raises(ferry.InvalidArgument, match="socket path"):
        ferry.Endpoint.shm("")


def test_exceptions_mirror_the_library():
    assert issubclass(ferry.BufferError, ferry.Error) and issubclass(ferry.BufferError, BufferError)
    assert issubclass(ferry.BufferGone, ferry.BufferError)
    assert issubclass(ferry.PeerGone, ferry.Error) and issubclass(ferry.PeerGone, ConnectionError)
    assert issubclass(ferry.TimedOut, TimeoutError) and issubclass(ferry.InvalidArgument, ValueError)
    assert ferry.PeerGone.__module__ == "ferry"


def test_closed_channels_leave_no_fd_and_no_buffer_behind(sock):
    def fds():
        return len(os.listdir("/proc/self/fd"))

    def round_trip(i):
        p = Pair(count=4)
        ev = p.moved(p.alloc.alloc(), bytes([i % 256]))
        p.rx.pass_(ev.buffer)
        assert isinstance(p.tx.wait(10), ferry.BufferPassed)
        p.tx.close()
        p.rx.close()
        shm_tx = ferry.Channel.create(p.a, ferry.Endpoint.shm(sock))
        shm_rx = ferry.Channel.bind(p.b, ferry.Endpoint.shm(sock))
        shm_tx.wait_connected(10)
        shm_rx.wait_connected(10)
        with shm_tx, shm_rx:
            pass
        return p.alloc

    round_trip(0)
    gc.collect()
    before = fds()
    allocs = [round_trip(i) for i in range(1, 30)]
    gc.collect()
    assert all(a.available == 4 for a in allocs)
    del allocs
    gc.collect()
    assert fds() == before


def test_signal_handlers_run_during_a_wait_and_may_close_the_channel(pair):
    """A wait lets Python run signal handlers (Ctrl-C works), without
    holding the channel: a handler may close it, and the wait ends."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            pair.rx.wait(30)
        signal.signal(signal.SIGALRM, lambda signum, frame: pair.rx.close())
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        assert pair.rx.wait(30) is None
        assert pair.rx.closed
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
