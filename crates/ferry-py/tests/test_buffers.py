"""Buffers over the pool memory itself, and the ownership rules in Python:
no move, pass, copy, release or free while a view is exported; no access
once ownership left; copies are read-only."""

import gc

import numpy as np
import pytest

import ferry


def test_views_are_the_pool_memory(pair):
    buf = pair.alloc.alloc()
    pool = pair.alloc.pool
    assert buf.address == pool.base_address + buf.index * pool.buffer_size
    arr = np.frombuffer(buf, dtype=np.uint32)
    assert arr.__array_interface__["data"][0] == buf.address
    assert arr.flags.writeable and arr.size == 1024
    arr[:] = np.arange(1024, dtype=np.uint32)
    view = memoryview(buf)
    assert view.readonly is False and view.nbytes == 4096 and view.format == "B"
    assert view[4] == 1 and buf[4] == 1 and buf[-4] == 0xFF
    buf[8:12] = b"\x01\x02\x03\x04"
    assert arr[2] == 0x04030201  # the array sees the write: same memory
    part = buf[8:12]
    assert bytes(part) == b"\x01\x02\x03\x04" and part.readonly is False
    part[0] = 9
    assert buf[8] == 9
    assert buf.exports == 3
    del arr, part
    view.release()
    gc.collect()
    assert buf.exports == 0
    # The receiver sees the bytes written through the views.
    ev = pair.moved(buf, b"seq")
    got = np.frombuffer(ev.buffer, dtype=np.uint32)
    assert got[2] == 0x04030209 and got[1000] == 1000 and ev.meta == b"seq"


def test_move_refused_while_a_view_is_exported(pair):
    buf = pair.alloc.alloc()
    arr = np.frombuffer(buf, dtype=np.uint8)
    for op in (pair.tx.move, pair.tx.copy, pair.alloc.free):
        with pytest.raises(ferry.BufferError, match="still exported") as info:
            op(buf)
        assert isinstance(info.value, BufferError) and isinstance(info.value, ferry.Error)
    # Refused means unchanged: still ours, still writable through the array.
    assert buf.valid and buf.kind == "owned"
    arr[0] = 1
    del arr
    ev = pair.moved(buf)
    assert ev.buffer[0] == 1
    # The sink cannot pass it back while it holds a memoryview either.
    view = memoryview(ev.buffer)
    with pytest.raises(ferry.BufferError, match="still exported"):
        pair.rx.pass_(ev.buffer)
    view.release()
    pair.rx.pass_(ev.buffer)
    assert isinstance(pair.tx.wait(10), ferry.BufferPassed)


def test_a_moved_buffer_gives_no_access(pair):
    buf = pair.alloc.alloc()
    pair.tx.move(buf)
    assert not buf.valid and buf.kind == "gone"
    for access in (len, memoryview, bytes, lambda b: b[0], lambda b: b.address,
                   lambda b: np.frombuffer(b, dtype=np.uint8)):
        with pytest.raises(ferry.BufferGone, match="moved"):
            access(buf)
    with pytest.raises(ferry.BufferGone):
        buf[0] = 1
    with pytest.raises(ferry.BufferGone):
        pair.tx.move(buf)
    assert "gone" in repr(buf)


def test_a_received_copy_is_read_only(pair):
    buf = pair.alloc.alloc()
    buf[0:5] = b"hello"
    pair.tx.copy(buf, b"c")
    ev = pair.rx.wait(10)
    assert isinstance(ev, ferry.CopyReceived)
    copy = ev.buffer
    assert copy.kind == "copy" and copy.readonly
    view = memoryview(copy)
    assert view.readonly and bytes(view[:5]) == b"hello"
    arr = np.frombuffer(copy, dtype=np.uint8)
    assert arr.flags.writeable is False
    with pytest.raises(ValueError):
        arr[0] = 1
    with pytest.raises(ferry.BufferError, match="read-only"):
        copy[0] = 1
    # The owner is read-only too while the copy is out.
    assert buf.readonly and memoryview(buf).readonly
    with pytest.raises(ferry.BufferError, match="read-only"):
        buf[0] = 1
    with pytest.raises(ferry.BufferError, match="still exported"):
        pair.rx.release(copy)
    del arr
    view.release()
    with pytest.raises(ferry.CopyError, match="read-only copy"):
        pair.rx.pass_(copy)  # a copy cannot be passed
    pair.rx.release(copy)
    assert not copy.valid
    ev = pair.tx.wait(10)
    assert isinstance(ev, ferry.CopyReleased) and ev.writable
    assert (ev.pool, ev.index) == (buf.pool_id, buf.index)
    assert not buf.readonly
    buf[0] = ord("j")


def test_refused_operations_hand_the_buffer_back(pair):
    buf = pair.alloc.alloc()
    with pytest.raises(ferry.WrongDirection) as info:
        pair.rx.move(buf)  # not the source
    assert info.value.buffer is buf and buf.valid
    with pytest.raises(ferry.InvalidArgument, match="meta data of 17 bytes") as info:
        pair.tx.move(buf, b"x" * 17)
    assert info.value.kind == "MetaTooLarge" and info.value.buffer is buf
    other = ferry.Allocator(pair.a, 1, 4096)  # not assigned to the channel
    with pytest.raises(ferry.PoolError, match="not assigned") as info:
        pair.tx.move(other.alloc())
    assert info.value.kind == "PoolNotAssigned"
    pair.tx.move(buf)


def test_dropped_buffers_go_back_to_the_free_list(pair):
    assert pair.alloc.available == 8
    bufs = [pair.alloc.alloc() for _ in range(8)]
    assert pair.alloc.alloc() is None and pair.alloc.available == 0
    del bufs
    gc.collect()
    assert pair.alloc.available == 8
    buf = pair.alloc.alloc()
    pair.alloc.free(buf)
    assert pair.alloc.available == 8
    with pytest.raises(ferry.BufferGone, match="freed"):
        len(buf)


def test_queue_full_is_refused_and_nothing_lost():
    d1, d2 = ferry.Domain("a"), ferry.Domain("b")
    ep = ferry.Endpoint.local()
    tx = ferry.Channel.create(d1, ep, queue_depth=2)
    rx = ferry.Channel.bind(d2, ep)
    tx.wait_connected(10)
    rx.wait_connected(10)
    rx.set_pool_policy("accept_all")
    alloc = ferry.Allocator(d1, 8, 4096)
    tx.assign_pool(alloc)
    assert isinstance(rx.wait(10), ferry.PoolAssignRequest)
    assert isinstance(tx.wait(10), ferry.PoolAssigned)
    sent = 0
    with pytest.raises(ferry.QueueFull) as info:
        while True:
            tx.move(alloc.alloc())
            sent += 1
    assert info.value.buffer.valid
    got = 0
    while rx.poll() is not None:
        got += 1
    # What the sink took (the pool request was taken already) is what was sent.
    assert got == sent
