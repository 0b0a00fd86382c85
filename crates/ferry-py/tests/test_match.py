"""Events in `match` statements (Python 3.10 and later; conftest leaves
this file out on 3.9)."""

import ferry


def test_events_match_by_position(pair):
    pair.tx.move(pair.alloc.alloc(), b"m")
    match pair.rx.wait(10):
        case ferry.MoveReceived(buf, meta):
            assert meta == b"m" and len(buf) == 4096
            pair.rx.pass_(buf, b"back")
        case other:
            raise AssertionError(f"unexpected {other!r}")
    match pair.tx.wait(10):
        case ferry.BufferPassed(buffer=buf, meta=b"back"):
            assert buf.valid
        case other:
            raise AssertionError(f"unexpected {other!r}")
