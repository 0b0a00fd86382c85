"""Two Python processes, one Ferry channel over shared memory: the sender
fills numpy arrays that live in Ferry buffers and moves them; the receiver
views each one as an array in place (no copy), checks it and passes the
buffer back.

    python numpy_two_processes.py            # starts the receiver itself
"""

import os
import subprocess
import sys

import numpy as np

import ferry

SOCKET = f"/tmp/ferry-numpy-{os.getpid()}.sock"
BUFFERS, SIZE = 64, 1 << 20  # 64 arrays of 1 MiB


def receiver(path):
    domain = ferry.Domain("receiver")
    with ferry.Channel.connect(domain, ferry.Endpoint.shm(path)) as rx:
        rx.set_pool_policy("accept_all")  # take the sender's pool
        for event in rx:  # until the sender closes the channel
            if isinstance(event, ferry.MoveReceived):
                frame = np.frombuffer(event.buffer, dtype=np.float64)  # in place
                seq = int.from_bytes(event.meta, "little")
                assert frame[0] == seq and frame.sum() == seq * frame.size
                del frame  # release the view before giving the buffer back
                rx.pass_(event.buffer)


def sender(path):
    child = subprocess.Popen([sys.executable, __file__, "receiver", path])
    domain = ferry.Domain("sender")
    with ferry.Channel.accept(domain, ferry.Endpoint.shm(path)) as tx:
        alloc = ferry.Allocator(domain, 8, SIZE)  # 8 buffers of 1 MiB
        tx.assign_pool_and_wait(alloc)
        sent = back = 0
        while back < BUFFERS:
            while sent < BUFFERS and (buf := alloc.alloc()) is not None:
                np.frombuffer(buf, dtype=np.float64)[:] = sent  # write in place
                tx.move(buf, sent.to_bytes(8, "little"))  # the receiver owns it now
                sent += 1
            event = tx.wait(10)  # a buffer comes back
            assert isinstance(event, ferry.BufferPassed), event
            back += 1
        tx.teardown()
        assert isinstance(tx.wait(10), ferry.Closed)
    assert child.wait(10) == 0
    print(f"moved {BUFFERS} arrays of {SIZE >> 20} MiB to another process and back, no copy")


if __name__ == "__main__":
    if sys.argv[1:2] == ["receiver"]:
        receiver(sys.argv[2])
    else:
        sender(SOCKET)
