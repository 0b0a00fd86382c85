//! Unit tests of the ring: layout validation, FIFO order, batches, close
//! flags, hostile peers (garbage in the region), the sleep handshake.

use super::*;
use std::sync::atomic::Ordering::SeqCst;
use std::thread;

fn layout(cap: u32, slot: u32) -> RingLayout {
    RingLayout::new(cap, slot).unwrap()
}

fn heap(layout: RingLayout) -> Arc<dyn RingMemory> {
    Arc::new(HeapRegion::new(layout.region_size()))
}

/// Stands in for a hostile peer writing a word of the region.
fn poke_u64(mem: &Arc<dyn RingMemory>, off: usize, val: u64) {
    assert!(off % 8 == 0 && off + 8 <= mem.len());
    // SAFETY: in bounds and 8-aligned (checked above, region 4096-aligned);
    // the region is only accessed atomically.
    unsafe { RawAtomicU64::from_ptr(mem.as_ptr().add(off).cast()) }.store(val, SeqCst);
}

fn poke_u32(mem: &Arc<dyn RingMemory>, off: usize, val: u32) {
    assert!(off % 4 == 0 && off + 4 <= mem.len());
    // SAFETY: as in poke_u64.
    unsafe { RawAtomicU32::from_ptr(mem.as_ptr().add(off).cast()) }.store(val, SeqCst);
}

fn peek_u64(mem: &Arc<dyn RingMemory>, off: usize) -> u64 {
    assert!(off % 8 == 0 && off + 8 <= mem.len());
    // SAFETY: as in poke_u64.
    unsafe { RawAtomicU64::from_ptr(mem.as_ptr().add(off).cast()) }.load(SeqCst)
}

/// The sequence number in bytes 8..16, a pattern derived from it in the
/// rest (bit 7 of byte 0 is the ring's phase bit: written, not carried).
fn fill_pattern(buf: &mut [u8], seq: u64) {
    let (head, rest) = buf.split_at_mut(8);
    rest[..8].copy_from_slice(&seq.to_le_bytes());
    for (i, b) in head.iter_mut().chain(&mut rest[8..]).enumerate() {
        *b = (seq as u8).wrapping_mul(31).wrapping_add(i as u8);
    }
}

fn check_pattern(buf: &[u8], expect_len: usize) -> u64 {
    assert_eq!(buf.len(), expect_len);
    let seq = u64::from_le_bytes(buf[8..16].try_into().unwrap());
    for (i, b) in buf[..8].iter().chain(&buf[16..]).enumerate() {
        let want = (seq as u8).wrapping_mul(31).wrapping_add(i as u8) & if i == 0 { 0x7f } else { 0xff };
        assert_eq!(*b, want, "seq {seq} byte {i}");
    }
    seq
}

#[test]
fn layout_validation() {
    for cap in [0, 1, 3, 6, 100, 131072, u32::MAX] {
        assert!(matches!(RingLayout::new(cap, 64), Err(RingError::BadLayout(_))), "{cap}");
    }
    for slot in [0, 8, 32, 63, 100, 128 + 64, 512, 4096] {
        assert!(matches!(RingLayout::new(4, slot), Err(RingError::BadLayout(_))), "{slot}");
    }
    for cap in [2, 4, 1024, 65536] {
        for slot in [64, 128, 256] {
            let l = layout(cap, slot);
            assert_eq!((l.capacity(), l.slot_size()), (cap, slot));
            assert_eq!(l.region_size(), 640 + cap as usize * slot as usize);
        }
    }
}

#[test]
fn send_not_sync() {
    fn send<T: Send>() {}
    send::<Producer>();
    send::<Consumer>();
    send::<HeapRegion>();
}

#[test]
fn fifo_across_wraparound() {
    for (cap, slot) in [(2, 64), (4, 128), (8, 256), (64, 64)] {
        let (mut p, mut c) = heap_pair(layout(cap, slot));
        let mut next_push = 0u64;
        let mut next_pop = 0u64;
        let mut batch = 1;
        while next_pop < 20_000 {
            for _ in 0..batch {
                match p.try_push(|b| fill_pattern(b, next_push)) {
                    Ok(wake) => {
                        assert!(!wake);
                        next_push += 1;
                    }
                    Err(RingError::Full) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            while let Some(seq) = c.try_pop(|b| check_pattern(b, slot as usize)).unwrap() {
                assert_eq!(seq, next_pop);
                next_pop += 1;
            }
            assert!(p.is_empty());
            batch = batch % (cap as usize + 1) + 1;
        }
        assert_eq!(next_push, next_pop);
    }
}

#[test]
fn full_at_capacity() {
    let (mut p, mut c) = heap_pair(layout(8, 64));
    assert_eq!(p.free_slots(), 8);
    for i in 0..8 {
        p.try_push(|b| b[0] = i).unwrap();
    }
    assert_eq!(p.free_slots(), 0);
    assert_eq!(p.try_push(|_| panic!("must not be called when full")), Err(RingError::Full));
    assert_eq!(c.len(), Ok(8));
    assert_eq!(c.try_pop(|b| b[0]), Ok(Some(0)));
    assert_eq!(p.free_slots(), 1); // looked full: tail re-read
    p.try_push(|b| b[0] = 8).unwrap();
    assert_eq!(p.try_push(|_| ()), Err(RingError::Full));
    for i in 1..=8 {
        assert_eq!(c.try_pop(|b| b[0]), Ok(Some(i)));
    }
    assert_eq!(c.try_pop(|b| b[0]), Ok(None));
}

#[test]
fn empty_and_staging_is_zeroed() {
    let (mut p, mut c) = heap_pair(layout(2, 128));
    assert_eq!(c.try_pop(|_| ()), Ok(None));
    assert_eq!(c.len(), Ok(0));
    assert!(p.is_empty());
    p.try_push(|b| b.fill(0xff)).unwrap();
    assert!(!p.is_empty());
    assert_eq!(c.len(), Ok(1));
    // All but bit 7 of the first byte, which is the ring's phase bit.
    assert_eq!(c.try_pop(|b| b[0] == 0x7f && b[1..].iter().all(|&x| x == 0xff)), Ok(Some(true)));
    assert!(p.is_empty());
    // Next pushes reuse slots that held 0xff: fill must see zeroes.
    for _ in 0..4 {
        p.try_push(|b| {
            assert_eq!(b.len(), 128);
            assert!(b.iter().all(|&x| x == 0));
            b[5] = 5;
        })
        .unwrap();
        assert_eq!(c.try_pop(|b| (b.len(), b[5], b[6])), Ok(Some((128, 5, 0))));
    }
    assert_eq!(c.try_pop(|_| ()), Ok(None));
}

#[test]
fn close_flags() {
    let (mut p, mut c) = heap_pair(layout(4, 64));
    assert!(!p.peer_closed() && !c.peer_closed());
    p.try_push(|b| b[0] = 1).unwrap();
    p.try_push(|b| b[0] = 2).unwrap();
    p.close();
    assert_eq!(p.try_push(|_| ()), Err(RingError::Closed));
    assert!(c.peer_closed());
    assert!(!p.peer_closed());
    assert!(!c.prepare_sleep() || c.len() == Ok(2));
    // Items pushed before close are still delivered.
    assert_eq!(c.try_pop(|b| b[0]), Ok(Some(1)));
    assert_eq!(c.try_pop(|b| b[0]), Ok(Some(2)));
    assert_eq!(c.try_pop(|b| b[0]), Ok(None));
    assert!(!c.prepare_sleep(), "must not sleep on a closed producer");
    assert_eq!(c.sleep_word().load(SeqCst), 0);

    let (mut p, mut c) = heap_pair(layout(4, 64));
    c.close();
    assert!(p.peer_closed());
    assert_eq!(p.try_push(|_| ()), Err(RingError::Closed));

    let (p, c) = heap_pair(layout(4, 64));
    drop(c);
    assert!(p.peer_closed());
    let (p, c) = heap_pair(layout(4, 64));
    drop(p);
    assert!(c.peer_closed());
}

#[test]
fn attach_validates() {
    let l = layout(16, 128);
    let mem = heap(l);
    // Never initialised: no magic.
    assert!(matches!(attach_consumer(mem.clone(), l), Err(RingError::Corrupt(_))));
    assert!(matches!(attach_producer(mem.clone(), l), Err(RingError::Corrupt(_))));

    let (mut p, c) = create(mem.clone(), l).unwrap();
    for i in 0..3 {
        p.try_push(|b| b[0] = i).unwrap();
    }
    // A second handle on each end (in real use: the other process).
    let mut c2 = attach_consumer(mem.clone(), l).unwrap();
    assert_eq!(c2.layout(), l);
    assert_eq!(c2.len(), Ok(3));
    assert_eq!(c2.try_pop(|b| b[0]), Ok(Some(0)));
    let mut p2 = attach_producer(mem.clone(), l).unwrap();
    assert_eq!(p2.layout(), l);
    // p2 starts at the published head and sees c2's tail.
    p2.try_push(|b| b[0] = 3).unwrap();
    for i in 1..=3 {
        assert_eq!(c2.try_pop(|b| b[0]), Ok(Some(i)));
    }
    assert_eq!(p2.free_slots(), 13); // head 4, cached tail 1 (read at attach)
    assert!(p2.is_empty());

    // Layout mismatches.
    assert!(matches!(attach_consumer(mem.clone(), layout(8, 128)), Err(RingError::BadLayout(_))));
    assert!(matches!(attach_consumer(mem.clone(), layout(16, 64)), Err(RingError::BadLayout(_))));
    assert!(matches!(attach_producer(mem.clone(), layout(32, 128)), Err(RingError::BadLayout(_))));
    // Region too small for the layout.
    let small: Arc<dyn RingMemory> = Arc::new(HeapRegion::new(l.region_size() - 1));
    assert!(matches!(attach_consumer(small.clone(), l), Err(RingError::BadLayout(_))));
    assert!(matches!(create(small, l), Err(RingError::BadLayout(_))));
    // Misaligned region.
    struct Offset(Arc<dyn RingMemory>);
    impl RingMemory for Offset {
        fn as_ptr(&self) -> *mut u8 {
            self.0.as_ptr().wrapping_add(64)
        }
        fn len(&self) -> usize {
            self.0.len() - 64
        }
    }
    let big = heap(layout(32, 128));
    assert!(matches!(create(Arc::new(Offset(big)), l), Err(RingError::BadLayout(_))));
    // Bad version, bad magic.
    poke_u32(&mem, VERSION_OFF, VERSION + 1);
    assert!(matches!(attach_consumer(mem.clone(), l), Err(RingError::BadLayout(_))));
    poke_u32(&mem, VERSION_OFF, VERSION);
    poke_u32(&mem, MAGIC_OFF, 0xdead_beef);
    assert!(matches!(attach_producer(mem.clone(), l), Err(RingError::Corrupt(_))));
    poke_u32(&mem, MAGIC_OFF, MAGIC);
    // Inconsistent counters at attach time.
    poke_u64(&mem, HEAD_OFF, 1 << 40);
    assert!(matches!(attach_consumer(mem.clone(), l), Err(RingError::Corrupt(_))));
    assert!(matches!(attach_producer(mem.clone(), l), Err(RingError::Corrupt(_))));
    drop((p, c, p2, c2));
}

#[test]
fn corrupt_head_is_reported_not_panicking() {
    let l = layout(8, 64);
    let mem = heap(l);
    let (mut p, mut c) = create(mem.clone(), l).unwrap();

    // The consumer goes by the slots' phase bits: a garbage head alone
    // neither stops it nor makes it sleep, but len() reports it.
    poke_u64(&mem, HEAD_OFF, u64::MAX / 2);
    assert_eq!(c.try_pop(|_| ()), Ok(None));
    assert!(matches!(c.len(), Err(RingError::Corrupt(_))));
    assert!(c.prepare_sleep());
    c.cancel_sleep();
    poke_u64(&mem, HEAD_OFF, 9); // capacity + 1
    assert!(matches!(c.len(), Err(RingError::Corrupt(_))));
    poke_u64(&mem, HEAD_OFF, 0); // restored: consistent again
    assert_eq!(c.len(), Ok(0));

    // The head is read at the second slot of a run found by phase: there
    // it must cover the slot.
    for i in 0..3 {
        p.try_push(|b| b[1] = i).unwrap();
    }
    poke_u64(&mem, HEAD_OFF, 1);
    assert_eq!(c.try_pop(|b| b[1]), Ok(Some(0)));
    assert_eq!(c.try_pop(|_| ()), Err(RingError::Corrupt("ring head is behind a published slot")));
    poke_u64(&mem, HEAD_OFF, u64::MAX); // behind tail by wrapping
    assert_eq!(c.try_pop(|_| ()), Err(RingError::Corrupt("ring head is behind tail")));
    poke_u64(&mem, HEAD_OFF, 3);
    assert_eq!(c.try_pop(|b| b[1]), Ok(Some(1)));
    assert_eq!(c.try_pop(|b| b[1]), Ok(Some(2)));
    assert_eq!(c.try_pop(|_| ()), Ok(None));

    // Head went backwards but is still ahead of tail.
    p.try_push(|b| b[0] = 3).unwrap();
    p.try_push(|b| b[0] = 4).unwrap();
    assert_eq!(c.len(), Ok(2));
    poke_u64(&mem, HEAD_OFF, 4);
    assert_eq!(c.len(), Err(RingError::Corrupt("ring head went backwards")));
    poke_u64(&mem, HEAD_OFF, 5);
    assert_eq!(c.try_pop(|b| b[0]), Ok(Some(3)));

    // Corrupt tail seen by the producer (only read when it looks full).
    while p.try_push(|_| ()).is_ok() {}
    let real_tail = peek_u64(&mem, TAIL_OFF);
    poke_u64(&mem, TAIL_OFF, u64::MAX / 3);
    assert!(matches!(p.try_push(|_| ()), Err(RingError::Corrupt(_))));
    assert_eq!(p.free_slots(), 0);
    poke_u64(&mem, TAIL_OFF, real_tail - 1); // backwards
    assert!(matches!(p.try_push(|_| ()), Err(RingError::Corrupt(_))));
    poke_u64(&mem, TAIL_OFF, real_tail);
    assert_eq!(p.try_push(|_| ()), Err(RingError::Full));
}

/// xorshift64*: a tiny deterministic PRNG for the scribbling peer.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

fn scribble(mem: &Arc<dyn RingMemory>, rng: &mut Rng) {
    let words = mem.len() / 8;
    let r = rng.next();
    let off = (r as usize % words) * 8;
    let val = match r >> 60 {
        0 => 0,
        1 => u64::MAX,
        2..=5 => rng.next() % 32,
        _ => rng.next(),
    };
    poke_u64(mem, off, val);
}

#[test]
fn garbage_peer_never_panics() {
    let l = layout(4, 64);
    let mem = heap(l);
    let (mut p, mut c) = create(mem.clone(), l).unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut corrupt = 0;
    for i in 0..200_000u32 {
        // Scribble mostly on the hot header words.
        if rng.next() % 2 == 0 {
            let off = [HEAD_OFF, TAIL_OFF, SLEEPING_OFF, CLOSED_OFF, MAGIC_OFF][(rng.next() % 5) as usize];
            poke_u64(&mem, off, rng.next() % 16);
        } else {
            scribble(&mem, &mut rng);
        }
        let results = [
            p.try_push(|b| b[0] = i as u8).map(|_| ()),
            p.stage(|b| b[0] = i as u8),
            c.try_pop(|b| assert_eq!(b.len(), 64)).map(|_| ()),
            c.len().map(|_| ()),
        ];
        if i % 3 == 0 {
            let _ = p.publish();
        }
        assert!(p.staged() <= 4);
        corrupt += results.iter().filter(|r| matches!(r, Err(RingError::Corrupt(_)))).count();
        let _ = (p.free_slots(), p.is_empty(), p.peer_closed(), c.peer_closed());
        if c.prepare_sleep() {
            c.cancel_sleep();
        }
        let _ = attach_consumer(mem.clone(), l).map(|mut c| c.try_pop(|_| ()));
        let _ = attach_producer(mem.clone(), l).map(|mut p| p.try_push(|_| ()));
    }
    assert!(corrupt > 0, "the scribbler should have been noticed");
}

#[test]
fn garbage_peer_concurrently_never_panics() {
    let l = layout(8, 128);
    let mem = heap(l);
    let (mut p, mut c) = create(mem.clone(), l).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scribbler = {
        let (mem, stop) = (mem.clone(), stop.clone());
        thread::spawn(move || {
            let mut rng = Rng(12345);
            while !stop.load(SeqCst) {
                scribble(&mem, &mut rng);
                thread::yield_now();
            }
        })
    };
    let pusher = thread::spawn(move || {
        for i in 0..100_000u32 {
            let _ = p.try_push(|b| b[..4].copy_from_slice(&i.to_le_bytes()));
        }
    });
    for _ in 0..100_000 {
        let _ = c.try_pop(|b| assert_eq!(b.len(), 128));
        let _ = c.len();
    }
    pusher.join().unwrap();
    stop.store(true, SeqCst);
    scribbler.join().unwrap();
}

#[test]
fn threaded_million_items() {
    const N: u64 = 1_000_000;
    let (mut p, mut c) = heap_pair(layout(1024, 64));
    let producer = thread::spawn(move || {
        let mut seq = 0;
        while seq < N {
            match p.try_push(|b| fill_pattern(b, seq)) {
                Ok(_) => seq += 1,
                Err(RingError::Full) => std::hint::spin_loop(),
                Err(e) => panic!("{e}"),
            }
            if seq % 4096 == 0 {
                thread::yield_now();
            }
        }
    });
    let mut expect = 0;
    let mut idle = 0u32;
    while expect < N {
        match c.try_pop(|b| check_pattern(b, 64)).unwrap() {
            Some(seq) => {
                assert_eq!(seq, expect);
                expect += 1;
            }
            None => {
                idle += 1;
                if idle % 64 == 0 {
                    thread::yield_now();
                }
            }
        }
    }
    producer.join().unwrap();
    assert_eq!(c.try_pop(|_| ()), Ok(None));
    assert!(c.peer_closed()); // producer dropped
}

#[test]
fn staged_slots_are_published_together() {
    let (mut p, mut c) = heap_pair(layout(4, 64));
    for i in 0..3 {
        p.stage(|b| b[0] = i).unwrap();
    }
    assert_eq!(p.staged(), 3);
    assert_eq!(c.len(), Ok(0), "staged slots are not visible yet");
    assert_eq!(c.try_pop(|b| b[0]), Ok(None));
    assert_eq!(p.free_slots(), 1, "staged slots take room");
    assert!(!p.publish(), "consumer awake: no wake-up");
    assert_eq!(p.staged(), 0);
    assert!(!p.publish(), "nothing new to publish");
    assert_eq!(c.len(), Ok(3));
    p.stage(|b| b[0] = 3).unwrap();
    assert_eq!(p.stage(|_| panic!("must not be called when full")), Err(RingError::Full));
    for i in 0..3 {
        assert_eq!(c.try_pop(|b| b[0]), Ok(Some(i)));
    }
    assert_eq!(c.try_pop(|b| b[0]), Ok(None));
    // try_push publishes the staged slot with its own.
    assert_eq!(p.try_push(|b| b[0] = 4), Ok(false));
    assert_eq!(c.try_pop(|b| b[0]), Ok(Some(3)));
    assert_eq!(c.try_pop(|b| b[0]), Ok(Some(4)));
    assert!(p.is_empty());
}

#[test]
fn one_wake_up_per_published_batch() {
    let (mut p, mut c) = heap_pair(layout(8, 64));
    assert!(c.prepare_sleep());
    for i in 0..3 {
        p.stage(|b| b[0] = i).unwrap();
    }
    assert_eq!(c.sleep_word().load(SeqCst), 1, "staging alone does not touch the flag");
    assert!(p.publish(), "the consumer sleeps: wake it");
    assert_eq!(c.sleep_word().load(SeqCst), 0);
    p.stage(|b| b[0] = 3).unwrap();
    assert!(!p.publish(), "one wake-up per sleep");
    c.cancel_sleep();
    assert_eq!(c.len(), Ok(4));
}

#[test]
fn close_publishes_staged_slots() {
    let (mut p, mut c) = heap_pair(layout(4, 64));
    p.stage(|b| b[0] = 7).unwrap();
    p.stage(|b| b[0] = 8).unwrap();
    drop(p); // closes
    assert!(c.peer_closed());
    assert_eq!(c.try_pop(|b| b[0]), Ok(Some(7)));
    assert_eq!(c.try_pop(|b| b[0]), Ok(Some(8)));
    assert_eq!(c.try_pop(|b| b[0]), Ok(None));
}

/// A consumer cannot have taken what was only staged: a tail beyond the
/// published head is corrupt even if it is within the staged one.
#[test]
fn tail_beyond_published_head_is_corrupt() {
    let l = layout(4, 64);
    let mem = heap(l);
    let (mut p, _c) = create(mem.clone(), l).unwrap();
    p.try_push(|_| ()).unwrap();
    p.try_push(|_| ()).unwrap();
    p.stage(|_| ()).unwrap();
    p.stage(|_| ()).unwrap();
    poke_u64(&mem, TAIL_OFF, 3);
    assert!(matches!(p.stage(|_| ()), Err(RingError::Corrupt(_))));
    poke_u64(&mem, TAIL_OFF, 2);
    assert_eq!(p.stage(|_| ()), Ok(()));
}

#[test]
fn sleep_handshake_basics() {
    let (mut p, mut c) = heap_pair(layout(4, 64));
    assert!(c.prepare_sleep());
    assert_eq!(c.sleep_word().load(SeqCst), 1);
    assert_eq!(p.sleep_word().load(SeqCst), 1);
    assert_eq!(p.try_push(|_| ()), Ok(true)); // consumer asleep: wake it
    assert_eq!(c.sleep_word().load(SeqCst), 0); // and the futex word is cleared
    assert_eq!(p.try_push(|_| ()), Ok(false)); // only one wake per sleep
    c.cancel_sleep();
    assert!(!c.prepare_sleep()); // work available
    assert_eq!(c.sleep_word().load(SeqCst), 0);
    assert_eq!(c.try_pop(|_| ()), Ok(Some(())));
    assert_eq!(c.try_pop(|_| ()), Ok(Some(())));
    assert!(c.prepare_sleep());
    c.cancel_sleep();
    assert_eq!(p.try_push(|_| ()), Ok(false)); // awake again: no wake
    assert_eq!(c.try_pop(|_| ()), Ok(Some(())));
    assert!(c.prepare_sleep());
    p.close(); // clears the word too
    assert_eq!(c.sleep_word().load(SeqCst), 0);
    c.cancel_sleep();
    assert!(!c.prepare_sleep());
}

/// The intended futex use: a lost wake-up shows up as a wait that times
/// out while an item is ready.
#[test]
fn futex_sleep_wake_threaded() {
    use rustix::thread::futex;
    const N: u64 = 200_000;
    let (mut p, mut c) = heap_pair(layout(16, 64));
    let producer = thread::spawn(move || {
        let mut wakes = 0u64;
        let mut seq = 0;
        while seq < N {
            match p.try_push(|b| b[8..16].copy_from_slice(&seq.to_le_bytes())) {
                Ok(wake) => {
                    seq += 1;
                    if wake {
                        wakes += 1;
                        futex::wake(p.sleep_word(), futex::Flags::PRIVATE, 1).unwrap();
                    }
                }
                Err(RingError::Full) => thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
            if seq % 64 == 0 {
                thread::yield_now(); // let the consumer run dry and sleep
            }
        }
        p.close();
        futex::wake(p.sleep_word(), futex::Flags::PRIVATE, 1).unwrap();
        wakes
    });
    let timeout = futex::Timespec { tv_sec: 5, tv_nsec: 0 };
    let (mut expect, mut sleeps, mut prepares, mut done) = (0u64, 0u64, 0u64, false);
    while !done {
        if let Some(seq) = c.try_pop(|b| u64::from_le_bytes(b[8..16].try_into().unwrap())).unwrap() {
            assert_eq!(seq, expect);
            expect += 1;
            continue;
        }
        if c.peer_closed() {
            while let Some(seq) = c.try_pop(|b| u64::from_le_bytes(b[8..16].try_into().unwrap())).unwrap() {
                assert_eq!(seq, expect);
                expect += 1;
            }
            done = true;
        } else {
            prepares += 1;
            if c.prepare_sleep() {
                sleeps += 1;
                let r = futex::wait(c.sleep_word(), futex::Flags::PRIVATE, 1, Some(&timeout));
                assert!(
                    !matches!(r, Err(rustix::io::Errno::TIMEDOUT)),
                    "lost wake-up: slept 5 s with {:?} items ready",
                    c.len()
                );
                c.cancel_sleep();
            }
        }
    }
    let wakes = producer.join().unwrap();
    assert_eq!(expect, N);
    // Every wake answers a flag set by prepare_sleep (a false return can
    // still cause one harmless spurious wake).
    assert!(wakes <= prepares, "wakes {wakes} prepares {prepares}");
    eprintln!("futex test: {prepares} prepare_sleep, {sleeps} sleeps, {wakes} wakes");
}

#[test]
fn room_requests_reach_the_consumer_once() {
    let (mut p, mut c) = heap_pair(layout(2, 64));
    assert!(!p.want_room(), "room now: nothing to ask");
    p.try_push(|b| b[0] = 1).unwrap();
    p.try_push(|b| b[0] = 2).unwrap();
    assert!(!c.take_room_request(), "nobody asked");
    assert!(p.want_room(), "full: the producer may sleep");
    assert_eq!(c.try_pop(|b| b[0]), Ok(Some(1)));
    assert!(c.take_room_request(), "the first pop after the request sees it");
    assert!(!c.take_room_request(), "and takes it: one wake-up");
    // Room appeared between the failed push and the request: withdrawn.
    p.try_push(|b| b[0] = 3).unwrap();
    assert_eq!(c.try_pop(|b| b[0]), Ok(Some(2)));
    assert!(!p.want_room());
    assert!(!c.take_room_request());
}

/// The consumer finds a published slot by its phase bit without the head
/// (whose line then stays with the producer); a staged slot carries the
/// previous lap's phase and stays invisible until published, on every lap.
#[test]
fn consumer_goes_by_the_slot_phase() {
    let l = layout(4, 64);
    let mem = heap(l);
    let (mut p, mut c) = create(mem.clone(), l).unwrap();
    for i in 0..12u8 {
        p.stage(|b| b[1] = i).unwrap();
        assert_eq!(c.try_pop(|b| b[1]), Ok(None), "staged, not published");
        assert!(c.prepare_sleep(), "nothing published: the consumer may sleep");
        c.cancel_sleep();
        p.publish();
        // As if the head's store had not reached this core yet.
        poke_u64(&mem, HEAD_OFF, u64::from(i));
        assert!(!c.prepare_sleep(), "published: no sleep");
        assert_eq!(c.try_pop(|b| b[1]), Ok(Some(i)));
        assert_eq!(c.try_pop(|b| b[1]), Ok(None));
        poke_u64(&mem, HEAD_OFF, u64::from(i) + 1);
    }
}
