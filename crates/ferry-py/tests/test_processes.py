"""Two Python processes over shared memory and over TCP (1 GiB of numpy
arrays in 1 MiB buffers, checksummed, received in place), a peer killed
with SIGKILL, and trust NONE enforced by the kernel."""

import json
import selectors
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import ferry
from conftest import PEER, spawn_peer

MIB = 1 << 20
TOTAL = 1 << 30


def send_arrays(tx, domain, total=TOTAL):
    """Move `total` bytes of uint64 arrays in 1 MiB buffers; each meta is
    the sequence number and the array's checksum (sum of its words)."""
    alloc = ferry.Allocator(domain, 16, MIB)
    tx.assign_pool_and_wait(alloc, 30)
    base = np.arange(MIB // 8, dtype=np.uint64)
    sent = back = 0
    count = total // MIB
    while back < count:
        while sent < count:
            buf = alloc.alloc()
            if buf is None:
                break
            arr = np.frombuffer(buf, dtype=np.uint64)
            np.add(base, np.uint64(sent << 20), out=arr)
            checksum = int(arr.sum(dtype=np.uint64))
            del arr
            tx.move(buf, sent.to_bytes(8, "little") + checksum.to_bytes(8, "little"))
            sent += 1
        ev = tx.wait(30)
        assert isinstance(ev, ferry.BufferPassed), ev
        back += 1
    del ev  # the last buffer passed back: freed when its object goes
    assert alloc.available == 16
    tx.teardown()
    assert isinstance(tx.wait(30), ferry.Closed)
    return count


def run_flow(spec, create_endpoint):
    domain = ferry.Domain("python source")
    tx = ferry.Channel.create(domain, create_endpoint)
    if spec is None:
        host, port = tx.listen_addr
        spec = f"tcp:{host}:{port}"
    child = spawn_peer("sink", spec)
    try:
        tx.wait_connected(30)
        count = send_arrays(tx, domain)
        stats = tx.link_stats
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
        tx.close()
    assert child.returncode == 0, err
    report = json.loads(out)
    assert report["buffers"] == count == 1024 and report["bytes"] == TOTAL
    # Every array the sink read had its data where the buffer is in the pool.
    assert report["in_place"] == count
    return stats, report["stats"]


def test_one_gib_of_arrays_over_shm(sock):
    tx_stats, rx_stats = run_flow(f"shm:{sock}", ferry.Endpoint.shm(sock))
    assert tx_stats is None and rx_stats is None  # shared memory: nothing is sent at all


def test_one_gib_of_arrays_over_tcp():
    tx_stats, rx_stats = run_flow(None, ferry.Endpoint.tcp("127.0.0.1", 0))
    # The payload left from buffer memory and landed in buffer memory:
    # not a byte went through other memory in user space.
    assert tx_stats["payload_sent"] == TOTAL and tx_stats["payload_staged"] == 0
    assert rx_stats["payload_received"] == TOTAL and rx_stats["payload_staged"] == 0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_killed_peer_surfaces_as_peer_gone_and_buffers_come_back(transport, sock):
    domain = ferry.Domain("source")
    if transport == "shm":
        ep, spec = ferry.Endpoint.shm(sock), f"shm:{sock}"
    else:
        ep = ferry.Endpoint.tcp("127.0.0.1", 0)
    tx = ferry.Channel.create(domain, ep)
    if transport == "tcp":
        host, port = tx.listen_addr
        spec = f"tcp:{host}:{port}"
    child = spawn_peer("hold", spec, "4")
    try:
        tx.wait_connected(30)
        alloc = ferry.Allocator(domain, 8, 4096)
        tx.assign_pool_and_wait(alloc, 30)
        for _ in range(4):
            tx.move(alloc.alloc())
        # Keep the channel running (a TCP end sends as it is polled) until
        # the peer says it holds the buffers.
        ready = selectors.DefaultSelector()
        ready.register(child.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 30
        while not ready.select(0.01) and time.monotonic() < deadline:
            assert tx.wait(0.01) is None
        assert child.stdout.readline().strip() == "holding 4"
        assert alloc.available == 4
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        with pytest.raises(ferry.PeerGone) as info:
            while tx.wait(30) is not None:
                pass
        # The message names the channel and the peer's endpoint.
        assert "peer went away" in str(info.value) or "treated as dead" in str(info.value)
        assert spec.split(":", 1)[1].split(":")[0] in str(info.value) and "source" in str(info.value)
        assert alloc.available == 8
        assert tx.state == "closed" and tx.wait(0) is None
    finally:
        child.kill()
        tx.close()


TRUST_NONE = textwrap.dedent("""
    import ctypes, subprocess, sys
    import ferry
    sock, peer = sys.argv[1], sys.argv[2]
    domain = ferry.Domain("source")
    tx = ferry.Channel.create(domain, ferry.Endpoint.shm(sock), trust="none")
    child = subprocess.Popen([sys.executable, peer, "hold", "shm:" + sock, "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    tx.wait_connected(30)
    alloc = ferry.Allocator(domain, 4, 4096, trust="none")
    tx.assign_pool_and_wait(alloc, 30)
    buf = alloc.alloc()
    addr = buf.address
    ctypes.memset(addr, 0xAB, 16)  # ours: writing works
    tx.move(buf)
    assert child.stdout.readline().strip() == "holding 1"
    print("moved", flush=True)
    try:
        ctypes.memset(addr, 0xCD, 16)  # the peer's now: the kernel stops it
        print("wrote into a moved buffer", flush=True)
    finally:
        child.kill()
""")


def test_trust_none_a_write_to_a_moved_buffer_faults(sock):
    proc = subprocess.run([sys.executable, "-c", TRUST_NONE, sock, str(PEER)], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.splitlines() == ["moved"], (proc.stdout, proc.stderr)
    assert proc.returncode == -signal.SIGSEGV, proc.stderr
