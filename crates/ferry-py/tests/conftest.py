"""Shared fixtures: a connected local channel pair with a pool, paths for
shm endpoints, the peer script and the `ferry` binary."""

import os
import pathlib
import subprocess
import sys

import pytest

import ferry

TESTS = pathlib.Path(__file__).resolve().parent
REPO = TESTS.parents[2]
PEER = TESTS / "peer.py"


def release_binary(name):
    """A binary of the workspace's release build (scripts/test-python builds them)."""
    path = REPO / "target" / "release" / name
    if not path.exists():
        pytest.fail(f"{path} is missing: build it first (cargo build --release -p ferry-cli, "
                    "cargo build --release -p ferry --example processes_shm), or run scripts/test-python")
    return str(path)


@pytest.fixture
def ferry_bin():
    return release_binary("ferry")


@pytest.fixture
def sock(tmp_path):
    """A socket path for a shm endpoint (short: socket paths are limited)."""
    return f"/tmp/ferry-py-{os.getpid()}-{tmp_path.name[-12:]}.sock"


def spawn_peer(*args):
    return subprocess.Popen([sys.executable, str(PEER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


class Pair:
    """A connected local channel: `tx` in domain `a` (source), `rx` in
    domain `b` (sink), `alloc`'s pool assigned."""

    def __init__(self, count=8, size=4096, meta_size=16):
        self.a, self.b = ferry.Domain("a"), ferry.Domain("b")
        ep = ferry.Endpoint.local()
        self.tx = ferry.Channel.create(self.a, ep, meta_size=meta_size)
        self.rx = ferry.Channel.bind(self.b, ep)
        self.tx.wait_connected(10)
        self.rx.wait_connected(10)
        self.rx.set_pool_policy("accept_all")
        self.alloc = ferry.Allocator(self.a, count, size)
        self.tx.assign_pool(self.alloc)
        assert isinstance(self.rx.wait(10), ferry.PoolAssignRequest)
        assert isinstance(self.tx.wait(10), ferry.PoolAssigned)

    def moved(self, buf, meta=b""):
        """Move `buf` and return what the sink received."""
        self.tx.move(buf, meta)
        ev = self.rx.wait(10)
        assert isinstance(ev, ferry.MoveReceived), ev
        return ev


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.tx.close()
    p.rx.close()


# `match` statements need Python 3.10.
collect_ignore = ["test_match.py"] if sys.version_info < (3, 10) else []
