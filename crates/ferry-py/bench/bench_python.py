"""Ferry from Python against Ferry from Rust and against Python's own ways
of moving arrays between processes (run by scripts/bench-python).

1. Round trip of a 4 KiB buffer (move + pass) from Python to a `ferry echo
   --busy-poll` process over shared memory, against `ferry bench rtt
   --backend shm --size 4096` (Rust on both sides), in the same run.
2. Throughput of 1 MiB numpy arrays from one Python process to another:
   Ferry (shm, the receiver views each array in place and passes it back),
   multiprocessing.Pipe (send_bytes / recv_bytes_into), and
   multiprocessing.shared_memory slots with a Queue each way for the
   signalling. The sender writes a sequence number into each array, the
   receiver reads it: what is measured is the handing over. And iceoryx2's
   Python binding (PyPI `iceoryx2`) on the same publish/receive pattern.
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from multiprocessing import shared_memory

import numpy as np

import ferry

MIB = 1 << 20
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FERRY = os.path.join(REPO, "target", "release", "ferry")


def python_rtt(runs, trips=250):
    """Median µs per move + pass round trip of 4 KiB to `ferry echo`."""
    name = f"ferry-bench-python-{os.getpid()}"
    domain = ferry.Domain("python")
    tx = ferry.Channel.create(domain, ferry.Endpoint.shm_abstract(name))
    echo = subprocess.Popen([FERRY, "echo", "--busy-poll", "--endpoint", f"shm@{name}"], stdout=subprocess.DEVNULL)
    try:
        tx.wait_connected(30)
        alloc = ferry.Allocator(domain, 4, 4096)
        tx.assign_pool_and_wait(alloc, 30)
        buf = alloc.alloc()
        samples = []
        for run in range(runs + 1):  # one warm-up run
            start = time.perf_counter_ns()
            for _ in range(trips):
                tx.move(buf)
                ev = tx.poll()
                while ev is None:
                    ev = tx.poll()
                buf = ev.buffer
            if run:
                samples.append((time.perf_counter_ns() - start) / trips / 1000)
        tx.teardown()
        tx.wait(10)
    finally:
        tx.close()
        echo.wait(10)
    return statistics.median(samples)


def rust_rtt(runs):
    out = subprocess.run([FERRY, "bench", "rtt", "--backend", "shm", "--size", "4096", "--runs", str(runs), "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["median"]


# --- throughput of 1 MiB arrays ---------------------------------------------------------


def ferry_sink(name):
    domain = ferry.Domain("sink")
    with ferry.Channel.connect(domain, ferry.Endpoint.shm_abstract(name), timeout=30) as rx:
        rx.set_pool_policy("accept_all")
        total = 0
        while True:
            ev = rx.wait(30)
            if isinstance(ev, ferry.MoveReceived):
                arr = np.frombuffer(ev.buffer, dtype=np.uint64)
                total += int(arr[0])
                del arr
                rx.pass_unfilled(ev.buffer)
            elif isinstance(ev, ferry.Closed) or ev is None:
                break
    print(total)


def ferry_throughput(n):
    name = f"ferry-bench-python-tp-{os.getpid()}"
    domain = ferry.Domain("source")
    tx = ferry.Channel.create(domain, ferry.Endpoint.shm_abstract(name))
    child = subprocess.Popen([sys.executable, __file__, "ferry-sink", name], stdout=subprocess.PIPE, text=True)
    tx.wait_connected(30)
    alloc = ferry.Allocator(domain, 16, MIB)
    tx.assign_pool_and_wait(alloc, 30)
    start = time.perf_counter()
    sent = back = 0
    while back < n:
        while sent < n:
            buf = alloc.alloc()
            if buf is None:
                break
            arr = np.frombuffer(buf, dtype=np.uint64)
            arr[0] = sent
            del arr
            tx.move(buf)
            sent += 1
        ev = tx.wait(30)
        assert isinstance(ev, ferry.BufferPassed), ev
        back += 1
    del ev
    elapsed = time.perf_counter() - start
    tx.teardown()
    tx.wait(10)
    tx.close()
    out, _ = child.communicate(timeout=30)
    assert int(out) == n * (n - 1) // 2
    return n * MIB / elapsed


def pipe_sink(conn, n):
    arr = np.empty(MIB // 8, dtype=np.uint64)
    total = 0
    for _ in range(n):
        conn.recv_bytes_into(arr)
        total += int(arr[0])
    conn.send(total)


def pipe_throughput(n):
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    child = ctx.Process(target=pipe_sink, args=(b, n))
    child.start()
    arr = np.zeros(MIB // 8, dtype=np.uint64)
    start = time.perf_counter()
    for seq in range(n):
        arr[0] = seq
        a.send_bytes(arr)
    total = a.recv()
    elapsed = time.perf_counter() - start
    child.join()
    assert total == n * (n - 1) // 2
    return n * MIB / elapsed


SLOTS = 16


def shm_sink(name, full, free, done, n):
    mem = shared_memory.SharedMemory(name=name)
    slots = np.ndarray((SLOTS, MIB // 8), dtype=np.uint64, buffer=mem.buf)
    total = 0
    for _ in range(n):
        slot = full.get()
        total += int(slots[slot][0])
        free.put(slot)
    del slots
    mem.close()
    done.put(total)


def shm_throughput(n):
    ctx = mp.get_context("fork")
    mem = shared_memory.SharedMemory(create=True, size=SLOTS * MIB)
    full, free, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    for s in range(SLOTS):
        free.put(s)
    child = ctx.Process(target=shm_sink, args=(mem.name, full, free, done, n))
    child.start()
    slots = np.ndarray((SLOTS, MIB // 8), dtype=np.uint64, buffer=mem.buf)
    start = time.perf_counter()
    for seq in range(n):
        slot = free.get()
        slots[slot][0] = seq
        full.put(slot)
    total = done.get()
    elapsed = time.perf_counter() - start
    child.join()
    del slots
    mem.close()
    mem.unlink()
    assert total == n * (n - 1) // 2
    return n * MIB / elapsed


ICEORYX2_SERVICE = "ferry-bench-python/arrays"


def iceoryx2_service(iox2, node, create):
    import ctypes

    builder = (node.service_builder(iox2.ServiceName.new(f"{ICEORYX2_SERVICE}-{os.getppid() if not create else os.getpid()}"))
               .publish_subscribe(iox2.Slice[ctypes.c_uint8])
               .enable_safe_overflow(False)
               .subscriber_max_buffer_size(SLOTS)
               .history_size(0)
               .max_publishers(1)
               .max_subscribers(1))
    return builder.create() if create else builder.open()


def iceoryx2_sink(n):
    import iceoryx2 as iox2

    iox2.set_log_level(iox2.LogLevel.Error)
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    sub = iceoryx2_service(iox2, node, create=False).subscriber_builder().buffer_size(SLOTS).create()
    print("ready", flush=True)
    total = got = 0
    while got < n:
        sample = sub.receive()
        if sample is None:
            continue
        arr = np.frombuffer(sample.payload().as_memory_view(), dtype=np.uint64)
        total += int(arr[0])
        del arr
        sample.delete()
        got += 1
    print(total, flush=True)


def iceoryx2_throughput(n):
    """The same pattern on iceoryx2's Python binding: the publisher loans a
    1 MiB slice, writes the sequence number through a numpy view, sends;
    the subscriber views it, reads the number, drops the sample. No sample
    is dropped (safe overflow off, the publisher retries until delivered)."""
    try:
        import iceoryx2 as iox2
    except ImportError as e:
        return f"not installed ({e})"
    iox2.set_log_level(iox2.LogLevel.Error)
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    service = iceoryx2_service(iox2, node, create=True)
    pub = (service.publisher_builder().initial_max_slice_len(MIB)
           .backpressure_strategy(iox2.BackpressureStrategy.RetryUntilDelivered).create())
    child = subprocess.Popen([sys.executable, __file__, "iceoryx2-sink", str(n)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    pub.update_connections()
    start = time.perf_counter()
    for seq in range(n):
        sample = pub.loan_slice_uninit(MIB)
        arr = np.frombuffer(sample.payload().as_memory_view(), dtype=np.uint64)
        arr[0] = seq
        del arr
        sample.assume_init().send()
    total = int(child.stdout.readline())
    elapsed = time.perf_counter() - start
    child.wait(30)
    assert total == n * (n - 1) // 2
    return n * MIB / elapsed


def spread(values):
    """Median and range of one figure over the rounds."""
    return statistics.median(values), min(values), max(values)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: one round, few runs and few arrays")
    ap.add_argument("--rounds", type=int, default=3, metavar="N",
                    help="alternated rounds of every experiment; figures are medians over them (default 3)")
    ap.add_argument("--json", metavar="FILE", help="append the results to FILE as JSON lines (scripts/bench-report)")
    args = ap.parse_args()
    runs, arrays = (3, 300) if args.quick else (50, 5000)
    rounds = 1 if args.quick else max(1, args.rounds)

    # Each round runs every experiment once, in the same order, so a slow
    # spell of the machine hits all of them alike rather than one.
    throughputs = {
        "Ferry (shm)": ferry_throughput,
        "multiprocessing.Pipe": pipe_throughput,
        "shared_memory + Queue": shm_throughput,
        "iceoryx2 (PyPI)": iceoryx2_throughput,
    }
    rtts = {"python": [], "rust": []}
    rates = {who: [] for who in throughputs}
    for _ in range(rounds):
        rtts["python"].append(python_rtt(runs))
        rtts["rust"].append(rust_rtt(runs))
        for who, measure in throughputs.items():
            rates[who].append(measure(arrays))

    def cell(values, scale=1.0):
        med, lo, hi = spread([v * scale for v in values])
        return f"{med:.2f}" if rounds == 1 else f"{med:.2f} ({lo:.2f}–{hi:.2f})"

    what = "quick smoke run" if args.quick else f"{rounds} alternated rounds, median (range)"
    print(f"Ferry from Python ({what}), Python {sys.version.split()[0]}")
    print()
    print("| 4 KiB move + pass round trip, shared memory | median µs |")
    print("|---|---:|")
    print(f"| Python → `ferry echo --busy-poll` | {cell(rtts['python'])} |")
    print(f"| Rust (`ferry bench rtt --backend shm`) | {cell(rtts['rust'])} |")
    per_round = [p / r for p, r in zip(rtts["python"], rtts["rust"])]
    print(f"| Python / Rust | {cell(per_round)}× |")
    print()
    print(f"| 1 MiB numpy arrays, two Python processes ({arrays} arrays) | GB/s | Ferry is |")
    print("|---|---:|---:|")
    ferry_rates = rates["Ferry (shm)"]
    for who, values in rates.items():
        missing = next((v for v in values if isinstance(v, str)), None)
        if missing is not None:
            print(f"| {who} | {missing} | — |")
            continue
        if who.startswith("Ferry"):
            ratio = "—"
        else:
            ratio = f"{statistics.median(f / v for f, v in zip(ferry_rates, values)):.1f}× faster"
        print(f"| {who} | {cell(values, 1e-9)} | {ratio} |")
    if args.json:
        with open(args.json, "a") as out:
            for r in range(rounds):
                for who in ("python", "rust"):
                    out.write(json.dumps({"kind": "rtt", "who": who, "size": 4096, "median": rtts[who][r], "unit": "us",
                                          "runs": runs, "round": r + 1, "quick": args.quick}) + "\n")
                for who, values in rates.items():
                    point = {"kind": "throughput", "who": who, "size": MIB, "arrays": arrays, "round": r + 1,
                             "quick": args.quick}
                    if isinstance(values[r], str):
                        point["missing"] = values[r]
                    else:
                        point["gb_s"] = values[r] / 1e9
                    out.write(json.dumps(point) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["ferry-sink"]:
        ferry_sink(sys.argv[2])
    elif sys.argv[1:2] == ["iceoryx2-sink"]:
        iceoryx2_sink(int(sys.argv[2]))
    else:
        main()
