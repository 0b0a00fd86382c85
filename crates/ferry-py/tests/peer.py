"""A Python peer process for the tests: binds to an endpoint and plays one
role; prints one JSON line with what it saw, then exits 0 (1 on a
mismatch, with the reason on stderr).

    python peer.py sink ENDPOINT      receive numpy arrays, check each one's
                                      checksum and address, pass it back
    python peer.py hold ENDPOINT N    receive N buffers and keep them, print
                                      "holding N", then sleep (to be killed)
"""

import json
import sys

import numpy as np

import ferry

TIMEOUT = 30.0


def endpoint(spec):
    kind, _, rest = spec.partition(":")
    if kind == "shm":
        return ferry.Endpoint.shm(rest)
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        return ferry.Endpoint.tcp(host, int(port))
    raise SystemExit(f"unknown endpoint {spec!r}")


def sink(spec):
    domain = ferry.Domain("python sink")
    with ferry.Channel.connect(domain, endpoint(spec), timeout=TIMEOUT) as rx:
        rx.set_pool_policy("accept_all")
        count, total, in_place = 0, 0, 0
        while True:
            ev = rx.wait(TIMEOUT)
            if isinstance(ev, ferry.MoveReceived):
                buf = ev.buffer
                seq = int.from_bytes(ev.meta[:8], "little")
                want = int.from_bytes(ev.meta[8:16], "little")
                arr = np.frombuffer(buf, dtype=np.uint64)
                got = int(arr.sum(dtype=np.uint64))
                if got != want or seq != count:
                    print(f"buffer {seq} (expected {count}): checksum {got:#x}, sent {want:#x}", file=sys.stderr)
                    return 1
                pool = domain.pool(buf.pool_id)
                addr = arr.__array_interface__["data"][0]
                if addr == buf.address == pool.base_address + buf.index * pool.buffer_size:
                    in_place += 1
                total += arr.nbytes
                del arr
                rx.pass_unfilled(buf)
                count += 1
            elif isinstance(ev, ferry.PoolAssignRequest):
                pass
            elif isinstance(ev, ferry.Closed):
                break
            else:
                print(f"unexpected {ev!r}", file=sys.stderr)
                return 1
        print(json.dumps({"buffers": count, "bytes": total, "in_place": in_place, "stats": rx.link_stats}))
    return 0


def hold(spec, n):
    with ferry.Channel.connect(ferry.Domain("holder"), endpoint(spec), timeout=TIMEOUT) as rx:
        rx.set_pool_policy("accept_all")
        held = []
        while len(held) < n:
            ev = rx.wait(TIMEOUT)
            if isinstance(ev, ferry.MoveReceived):
                held.append(ev.buffer)
            elif ev is None:
                return 1
        print(f"holding {len(held)}", flush=True)
        # Until killed, or until the source goes away.
        try:
            while rx.wait(600) is not None:
                pass
        except ferry.PeerGone:
            pass
    return 0


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "sink":
        sys.exit(sink(sys.argv[2]))
    if role == "hold":
        sys.exit(hold(sys.argv[2], int(sys.argv[3])))
    raise SystemExit(f"unknown role {role!r}")
