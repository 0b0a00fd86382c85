//! loom models of the ordering protocol (the header atomics and slots live
//! in `LoomState`, see the module docs). Run with `.ci/loom.sh`.

use super::*;
use loom::thread;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Runs `f` under loom (LOOM_MAX_PREEMPTIONS, default 3 here) and
/// prints how many interleavings were explored.
fn model(name: &str, f: impl Fn() + Sync + Send + 'static) {
    static ITERS: AtomicUsize = AtomicUsize::new(0);
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    ITERS.store(0, Relaxed);
    builder.check(move || {
        ITERS.fetch_add(1, Relaxed);
        f();
    });
    eprintln!("loom {name}: {} iterations", ITERS.load(Relaxed));
}

/// Pop `n` items (their first byte) as a blocking consumer does: when the
/// ring is empty, declare sleep and wait as `futex_wait(word, 1)` would,
/// until the word is not 1. A lost wake-up leaves it waiting forever,
/// which loom reports.
fn pop_or_sleep(c: &mut Consumer, n: usize) -> Vec<u8> {
    let mut got = Vec::new();
    while got.len() < n {
        if let Some(x) = c.try_pop(|b| b[0]).unwrap() {
            got.push(x);
        } else if c.prepare_sleep() {
            while c.sleep_word().load(Ordering::Acquire) == 1 {
                thread::yield_now();
            }
            c.cancel_sleep();
        }
    }
    got
}

/// Two threads, capacity 2, three items: FIFO order and contents survive
/// wrap-around and Full; loom's UnsafeCell slots flag any slot race.
#[test]
fn push_pop_fifo_capacity_2() {
    model("push_pop_fifo_capacity_2", || {
        let (mut p, mut c) = heap_pair(RingLayout::new(2, 64).unwrap());
        let producer = thread::spawn(move || {
            for i in 0..3u8 {
                loop {
                    match p.try_push(|b| {
                        b[0] = i;
                        b[63] = 100 + i;
                    }) {
                        Ok(_) => break,
                        Err(RingError::Full) => thread::yield_now(),
                        Err(e) => panic!("{e}"),
                    }
                }
            }
        });
        for i in 0..3u8 {
            loop {
                match c.try_pop(|b| (b[0], b[63], b.len())).unwrap() {
                    Some(got) => {
                        assert_eq!(got, (i, 100 + i, 64));
                        break;
                    }
                    None => thread::yield_now(),
                }
            }
        }
        producer.join().unwrap();
        assert_eq!(c.try_pop(|_| ()).unwrap(), None);
    });
}

/// No lost wake-up: if the consumer decides to block (prepare_sleep
/// returned true), the concurrent push must have returned needs_wake and
/// cleared the futex word; if it decides not to block, the item must be
/// visible. Removing either SeqCst fence makes loom find a failing
/// interleaving.
#[test]
fn sleep_handshake_never_loses_wakeup() {
    model("sleep_handshake_never_loses_wakeup", || {
        let (mut p, mut c) = heap_pair(RingLayout::new(2, 64).unwrap());
        let producer = thread::spawn(move || {
            let wake = p.try_push(|b| b[0] = 42).unwrap();
            (wake, p)
        });
        let blocks = c.prepare_sleep();
        let (wake, p) = producer.join().unwrap();
        if blocks {
            // The consumer would now futex_wait(word, 1): it is only
            // woken if the producer asked for a wake, and only returns at
            // once if the word is no longer 1.
            assert!(wake, "lost wake-up: consumer sleeps, producer did not wake it");
            assert_eq!(c.sleep_word().load(Ordering::Relaxed), 0);
            c.cancel_sleep();
        } else {
            assert_eq!(c.sleep_word().load(Ordering::Relaxed), 0);
        }
        assert_eq!(c.try_pop(|b| b[0]).unwrap(), Some(42));
        drop(p);
    });
}

/// The futex protocol end to end: the consumer blocks (modelled as
/// "wait while the word is 1") whenever prepare_sleep says so, and the
/// producer pushes two items (no close, which would clear the word and
/// mask a lost wake-up). A lost wake-up leaves the consumer waiting
/// forever, which loom reports as a failure (branch limit exceeded).
#[test]
fn futex_protocol_two_items() {
    model("futex_protocol_two_items", || {
        let (mut p, mut c) = heap_pair(RingLayout::new(2, 64).unwrap());
        let producer = thread::spawn(move || {
            for i in 1..=2u8 {
                // Capacity 2: never Full. A true return means "futex_wake";
                // the swap in try_push already released the waiter.
                let _wake = p.try_push(|b| b[0] = i).unwrap();
            }
            p
        });
        assert_eq!(pop_or_sleep(&mut c, 2), [1, 2]);
        drop(producer.join().unwrap());
    });
}

/// Batching: three items staged and published in two batches (one head
/// store each) arrive in order and intact; loom's UnsafeCell slots flag
/// a consumer read of a slot that the publication did not order after
/// its write (every slot of a batch, not only the last).
#[test]
fn batched_publish_fifo() {
    model("batched_publish_fifo", || {
        let (mut p, mut c) = heap_pair(RingLayout::new(4, 64).unwrap());
        let producer = thread::spawn(move || {
            p.stage(|b| b[0] = 0).unwrap();
            p.stage(|b| {
                b[0] = 1;
                b[63] = 101;
            })
            .unwrap();
            let _ = p.publish();
            p.stage(|b| b[0] = 2).unwrap();
            let _ = p.publish();
            p
        });
        let mut got = Vec::new();
        while got.len() < 3 {
            match c.try_pop(|b| (b[0], b[63])).unwrap() {
                Some(x) => got.push(x),
                None => thread::yield_now(),
            }
        }
        assert_eq!(got, [(0, 0), (1, 101), (2, 0)]);
        drop(producer.join().unwrap());
    });
}

/// The futex protocol with a batch: two items staged, one publication
/// that does the sleep handshake once. A lost wake-up leaves the
/// consumer waiting forever.
#[test]
fn futex_protocol_batch() {
    model("futex_protocol_batch", || {
        let (mut p, mut c) = heap_pair(RingLayout::new(2, 64).unwrap());
        let producer = thread::spawn(move || {
            p.stage(|b| b[0] = 1).unwrap();
            p.stage(|b| b[0] = 2).unwrap();
            let _wake = p.publish();
            p
        });
        assert_eq!(pop_or_sleep(&mut c, 2), [1, 2]);
        drop(producer.join().unwrap());
    });
}

/// Close publishes what was staged, before the closed flag: a consumer
/// that sees the flag and then drains finds the item.
#[test]
fn close_publishes_staged() {
    model("close_publishes_staged", || {
        let (mut p, mut c) = heap_pair(RingLayout::new(2, 64).unwrap());
        let producer = thread::spawn(move || {
            p.stage(|b| b[0] = 7).unwrap();
            p.close();
            p
        });
        let mut got = Vec::new();
        loop {
            if let Some(x) = c.try_pop(|b| b[0]).unwrap() {
                got.push(x);
                continue;
            }
            if c.peer_closed() {
                while let Some(x) = c.try_pop(|b| b[0]).unwrap() {
                    got.push(x);
                }
                break;
            }
            thread::yield_now();
        }
        assert_eq!(got, [7]);
        drop(producer.join().unwrap());
    });
}

/// Same handshake with close instead of a push: a consumer that decides
/// to block must find the futex word cleared by close.
#[test]
fn sleep_handshake_close() {
    model("sleep_handshake_close", || {
        let (mut p, mut c) = heap_pair(RingLayout::new(2, 64).unwrap());
        let producer = thread::spawn(move || {
            p.close();
            p
        });
        let blocks = c.prepare_sleep();
        let p = producer.join().unwrap();
        if blocks {
            assert_eq!(c.sleep_word().load(Ordering::Relaxed), 0, "lost wake-up on close");
        }
        assert!(c.peer_closed());
        drop(p);
    });
}

/// The room handshake: a producer that finds the ring full asks for room
/// and waits (as on a doorbell) until the consumer takes its request; the
/// consumer looks for requests after every pop (unfenced) and after
/// declaring sleep (fenced), as the links do. A lost wake-up leaves the
/// producer waiting forever, which loom reports; so does removing the
/// fence in `want_room` or `prepare_sleep`.
#[test]
fn room_handshake_never_loses_wakeup() {
    model("room_handshake_never_loses_wakeup", || {
        let (mut p, mut c) = heap_pair(RingLayout::new(2, 64).unwrap());
        let producer = thread::spawn(move || {
            for i in 0..3u8 {
                loop {
                    match p.try_push(|b| b[0] = i) {
                        Ok(_) => break,
                        Err(RingError::Full) => {
                            if p.want_room() {
                                // Asleep until the consumer takes the request.
                                while p.sh.room().load(Ordering::Acquire) == 1 {
                                    thread::yield_now();
                                }
                            }
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
            }
            p
        });
        let mut got = Vec::new();
        while got.len() < 3 {
            if let Some(x) = c.try_pop(|b| b[0]).unwrap() {
                got.push(x);
                let _wake = c.take_room_request();
            } else {
                let sleep = c.prepare_sleep();
                // Wakes the producer if it asked (the swap is the wake).
                let _wake = c.take_room_request();
                if sleep {
                    while c.sleep_word().load(Ordering::Acquire) == 1 {
                        thread::yield_now();
                    }
                    c.cancel_sleep();
                }
            }
        }
        assert_eq!(got, [0, 1, 2]);
        drop(producer.join().unwrap());
    });
}

/// A consumer that finds two slots in a row by their phase bits reads the
/// head at the second (the start of a run) and must find it covering that
/// slot: the producer stores head before the phase (both Release), and the
/// consumer's Acquire load of the phase orders the head store before its
/// head load. Were the phase stored first, the consumer could read an old
/// head and report corruption (the unwrap below would panic).
#[test]
fn head_covers_a_slot_found_by_phase() {
    model("head_covers_a_slot_found_by_phase", || {
        let (mut p, mut c) = heap_pair(RingLayout::new(4, 64).unwrap());
        let producer = thread::spawn(move || {
            for i in 0..3u8 {
                p.try_push(|b| b[1] = i).unwrap();
            }
            p
        });
        let mut got = Vec::new();
        while got.len() < 3 {
            match c.try_pop(|b| b[1]).unwrap() {
                Some(x) => got.push(x),
                None => thread::yield_now(),
            }
        }
        assert_eq!(got, [0, 1, 2]);
        drop(producer.join().unwrap());
    });
}

/// The same protocol on the ring of values (`values.rs`, the local
/// backend's): loom's cells flag a value read before its write is ordered
/// (stamp), a slot reused before its value was moved out (tail), or a
/// leftover dropped while an end may still touch it; a lost wake-up leaves
/// a waiter waiting forever.
mod values {
    use super::model;
    use crate::ring::{value_pair, RingError, ValueConsumer};
    use loom::sync::atomic::Ordering;
    use loom::thread;

    /// Pop `n` values as a blocking consumer does: when the ring is empty,
    /// declare sleep and wait until the producer clears the flag.
    fn pop_or_sleep(c: &mut ValueConsumer<Box<u8>>, n: usize) -> Vec<u8> {
        let mut got = Vec::new();
        while got.len() < n {
            if let Some(x) = c.try_pop() {
                got.push(*x);
            } else if c.prepare_sleep() {
                while c.sleeping_word().load(Ordering::Acquire) == 1 {
                    thread::yield_now();
                }
                c.cancel_sleep();
            }
        }
        got
    }

    /// Capacity 2, three values: FIFO order across wrap-around and Full.
    #[test]
    fn values_fifo_capacity_2() {
        model("values_fifo_capacity_2", || {
            let (mut p, mut c) = value_pair::<Box<u8>>(2);
            let producer = thread::spawn(move || {
                for i in 0..3u8 {
                    loop {
                        match p.stage(|| Box::new(i)) {
                            Ok(()) => {
                                let _ = p.publish();
                                break;
                            }
                            Err(RingError::Full) => thread::yield_now(),
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            });
            for i in 0..3u8 {
                loop {
                    if let Some(x) = c.try_pop() {
                        assert_eq!(*x, i);
                        break;
                    }
                    thread::yield_now();
                }
            }
            producer.join().unwrap();
            assert!(c.try_pop().is_none());
        });
    }

    /// No lost wake-up between a publish and a consumer going to sleep.
    #[test]
    fn values_sleep_handshake() {
        model("values_sleep_handshake", || {
            let (mut p, mut c) = value_pair::<Box<u8>>(2);
            let producer = thread::spawn(move || {
                p.stage(|| Box::new(42)).unwrap();
                let wake = p.publish();
                (wake, p)
            });
            let blocks = c.prepare_sleep();
            let (wake, p) = producer.join().unwrap();
            if blocks {
                assert!(wake, "lost wake-up: consumer sleeps, producer did not wake it");
                c.cancel_sleep();
            }
            assert_eq!(c.sleeping_word().load(Ordering::Relaxed), 0);
            assert_eq!(c.try_pop().map(|x| *x), Some(42));
            drop(p);
        });
    }

    /// A batch of two, one publication and one handshake, against a
    /// consumer that sleeps whenever it may.
    #[test]
    fn values_futex_protocol_batch() {
        model("values_futex_protocol_batch", || {
            let (mut p, mut c) = value_pair::<Box<u8>>(2);
            let producer = thread::spawn(move || {
                p.stage(|| Box::new(1)).unwrap();
                p.stage(|| Box::new(2)).unwrap();
                let _wake = p.publish();
                p
            });
            assert_eq!(pop_or_sleep(&mut c, 2), [1, 2]);
            drop(producer.join().unwrap());
        });
    }

    /// Close publishes the staged values before the closed bit and wakes a
    /// sleeper; what the consumer does not take is dropped with the ring,
    /// by whichever end goes last.
    #[test]
    fn values_close_publishes_staged_and_drops_leftovers() {
        model("values_close_publishes_staged_and_drops_leftovers", || {
            let (mut p, mut c) = value_pair::<Box<u8>>(2);
            let producer = thread::spawn(move || {
                p.stage(|| Box::new(7)).unwrap();
                p.stage(|| Box::new(8)).unwrap();
                p.close();
            });
            loop {
                if let Some(x) = c.try_pop() {
                    assert_eq!(*x, 7);
                    break;
                }
                if c.prepare_sleep() {
                    // Close clears the flag: the wait ends.
                    while c.sleeping_word().load(Ordering::Acquire) == 1 {
                        thread::yield_now();
                    }
                    c.cancel_sleep();
                }
            }
            drop(c);
            producer.join().unwrap();
        });
    }

    /// The room handshake: a producer that finds the ring full waits until
    /// the consumer takes its request, looked at after every pop and after
    /// declaring sleep.
    #[test]
    fn values_room_handshake() {
        model("values_room_handshake", || {
            let (mut p, mut c) = value_pair::<Box<u8>>(2);
            let producer = thread::spawn(move || {
                for i in 0..3u8 {
                    loop {
                        match p.stage(|| Box::new(i)) {
                            Ok(()) => {
                                let _ = p.publish();
                                break;
                            }
                            Err(RingError::Full) => {
                                if p.want_room_for(1) {
                                    while p.room_word().load(Ordering::Acquire) == 1 {
                                        thread::yield_now();
                                    }
                                }
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
                p
            });
            let mut got = Vec::new();
            while got.len() < 3 {
                if let Some(x) = c.try_pop() {
                    got.push(*x);
                    let _wake = c.take_room_request();
                } else {
                    let sleep = c.prepare_sleep();
                    let _wake = c.take_room_request();
                    if sleep {
                        while c.sleeping_word().load(Ordering::Acquire) == 1 {
                            thread::yield_now();
                        }
                        c.cancel_sleep();
                    }
                }
            }
            assert_eq!(got, [0, 1, 2]);
            drop(producer.join().unwrap());
        });
    }
}
