"""Python against Rust: a Python source for `ferry echo --verify` (which
checks every byte against the demo pattern), and a Python sink for the
Rust example sender `processes_shm`."""

import subprocess

import numpy as np
import pytest

import ferry
from conftest import release_binary

K = 0x9E3779B97F4A7C15
K2 = 0xD6E8FEB86659FD93
MASK = (1 << 64) - 1


def demo_pattern(seq, words):
    """`ferry-cli`'s demo pattern: word i of buffer `seq`."""
    i = np.arange(words, dtype=np.uint64)
    x = np.uint64((seq * K) & MASK) ^ (i * np.uint64(K2))
    r = i % np.uint64(63)
    return np.where(r == 0, x, (x << r) | (x >> ((np.uint64(64) - r) % np.uint64(64))))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_python_source_and_ferry_echo_verify(transport, sock, ferry_bin):
    domain = ferry.Domain("python source")
    if transport == "shm":
        ep, spec = ferry.Endpoint.shm(sock), f"shm:{sock}"
        tx = ferry.Channel.create(domain, ep)
    else:
        tx = ferry.Channel.create(domain, ferry.Endpoint.tcp("127.0.0.1", 0))
        host, port = tx.listen_addr
        spec = f"tcp:{host}:{port}"
    echo = subprocess.Popen([ferry_bin, "echo", "--verify", "--endpoint", spec], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    size, count = 64 << 10, 512
    try:
        tx.wait_connected(30)
        alloc = ferry.Allocator(domain, 16, size)
        tx.assign_pool_and_wait(alloc, 30)
        sent = back = 0
        while back < count:
            while sent < count and (buf := alloc.alloc()) is not None:
                np.frombuffer(buf, dtype=np.uint64)[:] = demo_pattern(sent, size // 8)
                tx.move(buf, sent.to_bytes(8, "little"))
                sent += 1
            ev = tx.wait(30)
            assert isinstance(ev, ferry.BufferPassed), ev
            back += 1
        tx.teardown()
        assert isinstance(tx.wait(30), ferry.Closed)
        out, err = echo.communicate(timeout=30)
    finally:
        echo.kill()
        tx.close()
    assert echo.returncode == 0, err
    assert out.strip() == f"echoed {count}"


def test_ferry_echo_verify_catches_a_wrong_byte(sock, ferry_bin):
    """The check above can fail: one wrong byte and the echo says so."""
    domain = ferry.Domain("python source")
    tx = ferry.Channel.create(domain, ferry.Endpoint.shm(sock))
    echo = subprocess.Popen([ferry_bin, "echo", "--verify", "--endpoint", f"shm:{sock}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        tx.wait_connected(30)
        alloc = ferry.Allocator(domain, 2, 4096)
        tx.assign_pool_and_wait(alloc, 30)
        buf = alloc.alloc()
        arr = np.frombuffer(buf, dtype=np.uint64)
        arr[:] = demo_pattern(0, 512)
        arr[7] ^= np.uint64(1)
        del arr
        tx.move(buf, (0).to_bytes(8, "little"))
        echo.wait(30)
    finally:
        echo.kill()
        tx.close()
    assert echo.returncode != 0


def test_python_sink_for_a_rust_source(sock):
    """The Rust example sender moves 16 MiB in 64 KiB buffers, each word
    ((seq << 32) | i) * K; this Python sink checks every byte and passes
    each buffer back."""
    sender = release_binary("examples/processes_shm")
    domain = ferry.Domain("python sink")
    rx = ferry.Channel.create(domain, ferry.Endpoint.shm(sock), direction="rx", role="slave")
    rx.set_pool_policy("accept_all")
    proc = subprocess.Popen([sender, "--role", "sender", "--path", sock], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    words = np.arange(8192, dtype=np.uint64)
    received = 0
    try:
        while True:
            ev = rx.wait(30)
            if isinstance(ev, ferry.MoveReceived):
                seq = int.from_bytes(ev.meta[:8], "little")
                assert seq == received
                want = ((np.uint64(seq) << np.uint64(32)) | words) * np.uint64(K)
                got = np.frombuffer(ev.buffer, dtype=np.uint64)
                assert np.array_equal(got, want), f"buffer {seq} differs"
                del got
                rx.pass_unfilled(ev.buffer)
                received += 1
            elif isinstance(ev, ferry.Closed):
                break
            else:
                assert isinstance(ev, (ferry.BindRequest, ferry.PoolAssignRequest)), ev
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        rx.close()
    assert proc.returncode == 0, err
    assert received == 256 and "256 buffers" in out
