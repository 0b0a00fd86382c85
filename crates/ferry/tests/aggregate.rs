//! Aggregates against a model, a layered protocol stack that must copy no
//! payload byte, and aggregates over copies received on a real channel.

use std::borrow::Cow;
use std::num::NonZeroUsize;
use std::time::Duration;

use ferry::{
    Aggregate, Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints, PoolPolicy, Unit,
};
use proptest::prelude::*;

const T: Duration = Duration::from_secs(10);

fn fixed(n: usize) -> Unit {
    Unit::Fixed(NonZeroUsize::new(n).unwrap())
}

/// The fragment boundaries of `a` (offsets where one fragment ends and the
/// next begins).
fn boundaries(a: &Aggregate) -> Vec<usize> {
    let mut pos = 0;
    let mut out = Vec::new();
    for f in a.fragments() {
        pos += f.bytes().len();
        out.push(pos);
    }
    out.pop();
    out
}

#[derive(Debug, Clone)]
enum Op {
    /// A new aggregate over `start..start+len` of a fresh buffer.
    New {
        start: usize,
        len: usize,
    },
    /// A header (or trailer) copied into a buffer of the header allocator.
    Header {
        target: usize,
        bytes: Vec<u8>,
        front: bool,
    },
    /// Append aggregate `b` (taken out of the list) to `a`.
    Join {
        a: usize,
        b: usize,
    },
    /// Split `a` at `at` (modulo len + 2, so sometimes past the end).
    Split {
        a: usize,
        at: usize,
    },
    /// Take the first `at` bytes of `a` off as a new aggregate (modulo
    /// len + 2, so sometimes past the end).
    SplitTo {
        a: usize,
        at: usize,
    },
    /// Move the first `n` bytes of `b` to the end of `a` (modulo b's len +
    /// 2, so sometimes past the end; `a` and `b` distinct).
    AppendFrom {
        a: usize,
        b: usize,
        n: usize,
    },
    ClipFront {
        a: usize,
        n: usize,
    },
    ClipBack {
        a: usize,
        n: usize,
    },
    Truncate {
        a: usize,
        n: usize,
    },
    Clone {
        a: usize,
    },
    Drop {
        a: usize,
    },
    /// Read `n` bytes from the front through `std::io::Read`.
    Read {
        a: usize,
        n: usize,
    },
    /// Cut a clone of `a` into units of `size` bytes and check them.
    Units {
        a: usize,
        size: usize,
    },
    /// Send a clone of `a` over a channel to another domain (every buffer
    /// crosses as a copy: `a` still refers to it) and put what arrives in
    /// its place: later steps work on a received aggregate.
    Cross {
        a: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let i = 0..16usize;
    prop_oneof![
        3 => (0..4096usize, 0..4096usize).prop_map(|(start, len)| Op::New { start, len: len.min(4096 - start) }),
        2 => (i.clone(), proptest::collection::vec(any::<u8>(), 0..40), any::<bool>())
            .prop_map(|(target, bytes, front)| Op::Header { target, bytes, front }),
        3 => (i.clone(), i.clone()).prop_map(|(a, b)| Op::Join { a, b }),
        3 => (i.clone(), any::<usize>()).prop_map(|(a, at)| Op::Split { a, at }),
        2 => (i.clone(), any::<usize>()).prop_map(|(a, at)| Op::SplitTo { a, at }),
        3 => (i.clone(), i.clone(), any::<usize>()).prop_map(|(a, b, n)| Op::AppendFrom { a, b, n }),
        1 => (i.clone(), 0..5000usize).prop_map(|(a, n)| Op::ClipFront { a, n }),
        1 => (i.clone(), 0..5000usize).prop_map(|(a, n)| Op::ClipBack { a, n }),
        1 => (i.clone(), 0..5000usize).prop_map(|(a, n)| Op::Truncate { a, n }),
        2 => i.clone().prop_map(|a| Op::Clone { a }),
        2 => i.clone().prop_map(|a| Op::Drop { a }),
        1 => (i.clone(), 0..3000usize).prop_map(|(a, n)| Op::Read { a, n }),
        1 => (i.clone(), 1..600usize).prop_map(|(a, size)| Op::Units { a, size }),
        2 => i.prop_map(|a| Op::Cross { a }),
    ]
}

/// Every aggregate holds its model's bytes, in non-empty fragments.
fn check(aggs: &[Aggregate], models: &[Vec<u8>]) {
    assert_eq!(aggs.len(), models.len());
    for (a, m) in aggs.iter().zip(models) {
        assert_eq!(a.len(), m.len());
        assert_eq!(a.is_empty(), m.is_empty());
        assert!(a.fragments().all(|f| !f.bytes().is_empty() && f.range().len() == f.bytes().len()));
        assert_eq!(a.fragments().map(|f| f.bytes().len()).sum::<usize>(), m.len());
        assert_eq!(&a.to_vec(), m);
    }
}

fn run(ops: Vec<Op>) {
    use std::io::Read;
    let d = Domain::new("model");
    let payload = Allocator::new(&d, 24, 4096, PoolConstraints::default()).unwrap();
    let headers = Allocator::new(&d, 24, 4096, PoolConstraints::default()).unwrap();
    // A channel to another domain, both pools assigned, for `Cross`.
    let far = Domain::new("far");
    let ep = Endpoint::local();
    let setup = ChannelSetup { meta_size: ferry::MAX_META_SIZE, queue_depth: 4096, ..ChannelSetup::default() };
    let mut tx = Channel::create(&d, &ep, setup).unwrap();
    let mut rx = Channel::bind(&far, &ep, BindParams::default()).unwrap();
    tx.wait_connected(T).unwrap();
    rx.wait_connected(T).unwrap();
    rx.set_pool_policy(PoolPolicy::AcceptAll);
    for pool in [payload.pool(), headers.pool()] {
        tx.assign_pool(pool).unwrap();
        rx.poll();
        assert!(matches!(tx.wait(Some(T)), Ok(Event::PoolAssigned(_))));
    }
    let mut aggs: Vec<Aggregate> = Vec::new();
    let mut models: Vec<Vec<u8>> = Vec::new();
    let mut serial = 0u32;
    for op in ops {
        let n = aggs.len();
        match op {
            Op::New { start, len } => {
                let Some(mut b) = payload.alloc() else { continue };
                serial += 1;
                for (i, x) in b.as_mut_slice().unwrap().iter_mut().enumerate() {
                    *x = (serial.wrapping_mul(131) as usize + i * 7) as u8;
                }
                let bytes = b[start..start + len].to_vec();
                aggs.push(Aggregate::from_buffer_range(b, start..start + len).unwrap());
                models.push(bytes);
            }
            Op::Header { target, bytes, front } if n > 0 => {
                let Some(b) = headers.alloc() else { continue };
                let h = Aggregate::from_bytes_in(b, &bytes).unwrap();
                let (a, m) = (&mut aggs[target % n], &mut models[target % n]);
                if front {
                    a.prepend(h);
                    m.splice(0..0, bytes);
                } else {
                    a.append(h);
                    m.extend_from_slice(&bytes);
                }
            }
            Op::Join { a, b } if n > 0 => {
                let (a, b) = (a % n, b % n);
                if a == b {
                    let c = aggs[a].clone();
                    aggs[a].append(c);
                    let m = models[a].clone();
                    models[a].extend_from_slice(&m);
                } else {
                    let (tail, tm) = (aggs.remove(b), models.remove(b));
                    let a = if a > b { a - 1 } else { a };
                    let joined = std::mem::take(&mut aggs[a]).join(tail);
                    aggs[a] = joined;
                    models[a].extend_from_slice(&tm);
                }
            }
            Op::Split { a, at } if n > 0 => {
                let a = a % n;
                let len = models[a].len();
                let at = at % (len + 2);
                match aggs[a].split_at(at) {
                    Ok((h, t)) => {
                        assert!(at <= len);
                        let tm = models[a][at..].to_vec();
                        models[a].truncate(at);
                        aggs[a] = h;
                        aggs.push(t);
                        models.push(tm);
                    }
                    Err(e) => {
                        assert!(at > len);
                        assert_eq!(e, ferry::ErrorKind::BadRange { start: at, end: len, len });
                    }
                }
            }
            Op::SplitTo { a, at } if n > 0 => {
                let a = a % n;
                let len = models[a].len();
                let at = at % (len + 2);
                match aggs[a].split_to(at) {
                    Ok(h) => {
                        assert!(at <= len);
                        let hm: Vec<u8> = models[a].drain(..at).collect();
                        aggs.push(h);
                        models.push(hm);
                    }
                    Err(e) => {
                        assert!(at > len);
                        assert_eq!(e, ferry::ErrorKind::BadRange { start: at, end: len, len });
                    }
                }
            }
            Op::AppendFrom { a, b, n: k } if n > 1 => {
                let (a, b) = (a % n, b % n);
                let b = if a == b { (b + 1) % n } else { b };
                let len = models[b].len();
                let k = k % (len + 2);
                let mut src = std::mem::take(&mut aggs[b]);
                let r = aggs[a].append_from(&mut src, k);
                aggs[b] = src;
                match r {
                    Ok(()) => {
                        assert!(k <= len);
                        let moved: Vec<u8> = models[b].drain(..k).collect();
                        models[a].extend_from_slice(&moved);
                    }
                    Err(e) => {
                        assert!(k > len);
                        assert_eq!(e, ferry::ErrorKind::BadRange { start: k, end: len, len });
                    }
                }
            }
            Op::ClipFront { a, n: k } if n > 0 => {
                aggs[a % n].clip_front(k);
                let m = &mut models[a % n];
                m.drain(..k.min(m.len()));
            }
            Op::ClipBack { a, n: k } if n > 0 => {
                aggs[a % n].clip_back(k);
                let m = &mut models[a % n];
                m.truncate(m.len().saturating_sub(k));
            }
            Op::Truncate { a, n: k } if n > 0 => {
                aggs[a % n].truncate(k);
                models[a % n].truncate(k);
            }
            Op::Clone { a } if n > 0 => {
                aggs.push(aggs[a % n].clone());
                models.push(models[a % n].clone());
            }
            Op::Drop { a } if n > 0 => {
                aggs.remove(a % n);
                models.remove(a % n);
            }
            Op::Read { a, n: k } if n > 0 => {
                let mut out = vec![0u8; k];
                let mut got = 0;
                loop {
                    let r = aggs[a % n].read(&mut out[got..]).unwrap();
                    if r == 0 {
                        break;
                    }
                    got += r;
                }
                let m = &mut models[a % n];
                assert_eq!(got, k.min(m.len()));
                assert_eq!(&out[..got], &m[..got]);
                m.drain(..got);
            }
            Op::Units { a, size } if n > 0 => {
                let agg = &aggs[a % n];
                let cuts = boundaries(agg);
                let mut units = agg.units(fixed(size));
                let mut pos = 0;
                let mut expect_copies = 0;
                for u in units.by_ref() {
                    let end = pos + u.len();
                    assert_eq!(&u[..], &models[a % n][pos..end]);
                    assert!(u.len() == size || end == agg.len(), "only the last unit is short");
                    let crosses = cuts.iter().any(|&c| c > pos && c < end);
                    assert_eq!(matches!(u, Cow::Owned(_)), crosses, "copied exactly when crossing a fragment");
                    expect_copies += crosses as usize;
                    pos = end;
                }
                assert_eq!(pos, agg.len());
                assert_eq!(units.copies(), expect_copies);
            }
            Op::Cross { a } if n > 0 => {
                let frags: Vec<_> = aggs[a % n].fragments().map(|f| (f.buffer_id(), f.range())).collect();
                if let Err(r) = tx.send_aggregate(aggs[a % n].clone(), b"x") {
                    // Too many fragments for the queue, or fragments of
                    // buffers received in `far` (not this domain's to send):
                    // nothing crossed.
                    let crossed = aggs[a % n].fragments().any(|f| f.is_copy());
                    match r.error.kind() {
                        ferry::ErrorKind::AggregateTooLarge { .. } => {}
                        ferry::ErrorKind::ForeignBuffer => assert!(crossed),
                        e => panic!("{e:?}"),
                    }
                    continue;
                }
                let got = match rx.wait(Some(T)) {
                    Ok(Event::Aggregate { agg, meta }) if &meta[..] == b"x" => agg,
                    other => panic!("unexpected {other:?}"),
                };
                // The same fragments: the same byte ranges of the same buffers.
                let same: Vec<_> = got.fragments().map(|f| (f.buffer_id(), f.range())).collect();
                assert_eq!(same, frags);
                assert!(got.fragments().all(|f| f.is_copy()));
                aggs[a % n] = got;
            }
            _ => {}
        }
        check(&aggs, &models);
        // Copies dropped in `far` go back when its channel runs.
        rx.poll();
        while let Some(ev) = tx.poll() {
            assert!(matches!(ev, Event::CopyReleased { .. }), "unexpected {ev:?}");
        }
    }
    drop(aggs);
    rx.poll();
    while let Some(ev) = tx.poll() {
        assert!(matches!(ev, Event::CopyReleased { .. }), "unexpected {ev:?}");
    }
    assert_eq!((payload.available(), headers.available()), (24, 24), "every buffer is back");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Random joins, splits, clips, headers, clones, drops and reads against
    /// a `Vec<u8>` per aggregate; at the end every buffer is back.
    #[test]
    fn aggregates_behave_like_byte_vectors(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops);
    }
}

/// Three layers each prepend a header; the message is cut into 4 KiB
/// packets and reassembled; the layers strip their headers. The payload
/// comes out as the very fragments that went in (same memory), and its
/// 4 KiB units are all borrowed: no payload byte was copied.
#[test]
fn layered_stack_copies_no_payload() {
    let d = Domain::new("stack");
    let payload = Allocator::new(&d, 4, 64 << 10, PoolConstraints::default()).unwrap();
    let headers = Allocator::new(&d, 4, 4096, PoolConstraints::default()).unwrap();
    let mut msg = Aggregate::new();
    let mut bases = Vec::new();
    for k in 0..4u8 {
        let mut b = payload.alloc().unwrap();
        b.as_mut_slice().unwrap().iter_mut().enumerate().for_each(|(i, x)| *x = k ^ (i / 4096) as u8);
        bases.push(b.as_ptr() as usize);
        msg.append(Aggregate::from(b));
    }
    let total = msg.len();
    assert_eq!(total, 256 << 10);

    for layer in 1..=3u8 {
        let h = Aggregate::from_bytes_in(headers.alloc().unwrap(), &[layer; 20]).unwrap();
        msg.prepend(h);
    }
    assert_eq!(msg.len(), total + 60);

    // Fragment into 4 KiB packets (the last one shorter), then reassemble.
    let mut packets = Vec::new();
    while msg.len() > 4096 {
        let rest = msg.split_off(4096).unwrap();
        packets.push(std::mem::replace(&mut msg, rest));
    }
    packets.push(msg);
    assert_eq!(packets.len(), (total + 60).div_ceil(4096));
    assert!(packets.iter().all(|p| p.len() <= 4096));
    let mut msg = packets.into_iter().fold(Aggregate::new(), Aggregate::join);
    assert_eq!(msg.fragments().count(), 7, "adjacent pieces of one buffer joined back into one fragment");

    for layer in (1..=3u8).rev() {
        assert_eq!(msg.slice(0..20).unwrap().to_vec(), [layer; 20]);
        msg.clip_front(20);
    }
    assert_eq!(msg.len(), total);
    let frags: Vec<_> = msg.fragments().map(|f| f.bytes().as_ptr() as usize).collect();
    assert_eq!(frags, bases, "the payload is the buffers that went in");

    let mut units = msg.units(fixed(4096));
    let mut n = 0;
    for (k, u) in units.by_ref().enumerate() {
        let Cow::Borrowed(s) = u else { panic!("unit {k} was copied") };
        assert_eq!(s.as_ptr() as usize, bases[k / 16] + (k % 16) * 4096, "unit {k} is in place");
        assert!(s.iter().all(|&x| x == (k / 16) as u8 ^ (k % 16) as u8));
        n += 1;
    }
    assert_eq!((n, units.copies(), units.copied_bytes()), (64, 0, 0));
    drop(msg);
    assert_eq!((payload.available(), headers.available()), (4, 4));
}

/// A local channel from `a` to `b`, connected, with a pool of two 4 KiB
/// buffers of `a` assigned (`b` accepts every pool).
fn local_pair_with_pool(a: &Domain, b: &Domain) -> (Channel, Channel, Allocator) {
    let ep = Endpoint::local();
    let mut tx = Channel::create(a, &ep, ChannelSetup::default()).unwrap();
    let mut rx = Channel::bind(b, &ep, BindParams::default()).unwrap();
    tx.wait_connected(T).unwrap();
    rx.wait_connected(T).unwrap();
    rx.set_pool_policy(PoolPolicy::AcceptAll);
    let alloc = Allocator::new(a, 2, 4096, PoolConstraints::default()).unwrap();
    tx.assign_pool(alloc.pool()).unwrap();
    rx.poll(); // accepts the pool (policy)
    match tx.wait(Some(T)) {
        Ok(Event::PoolAssigned(_)) => {}
        other => panic!("unexpected {other:?}"),
    }
    (tx, rx, alloc)
}

/// Copies received over a real channel go into aggregates; dropping the
/// last aggregate that refers to a copy releases it to its owner, who can
/// then write the buffer again.
#[test]
fn copies_are_released_when_the_last_fragment_goes() {
    let (a, b) = (Domain::new("owner"), Domain::new("holder"));
    let (mut tx, mut rx, alloc) = local_pair_with_pool(&a, &b);

    let mut buf = alloc.alloc().unwrap();
    buf.as_mut_slice().unwrap()[..11].copy_from_slice(b"hello world");
    tx.copy(&buf, &[]).unwrap();
    let copy = loop {
        match rx.wait(Some(T)) {
            Ok(Event::CopyReceived { copy, .. }) => break copy,
            Ok(Event::PoolAssignRequest(_)) => {}
            other => panic!("unexpected {other:?}"),
        }
    };
    let id = copy.id();
    let whole = Aggregate::from_copy_range(copy, 0..11).unwrap();
    let f = whole.fragments().next().unwrap();
    assert!(f.is_copy());
    assert_eq!((f.buffer_id(), f.range()), (id, 0..11));
    let (hello, world) = whole.split_at(6).unwrap();
    drop(whole);
    assert_eq!(world.to_vec(), b"world");
    drop(world);
    rx.poll();
    assert!(buf.as_mut_slice().is_err(), "`hello` still refers to the copy");
    drop(hello);
    rx.poll(); // the channel runs: the deferred release goes out
    match tx.wait(Some(T)) {
        Ok(Event::CopyReleased { writable: true, .. }) => {}
        other => panic!("unexpected {other:?}"),
    }
    assert!(buf.as_mut_slice().is_ok(), "the owner writes again");
}

/// A received aggregate taken apart from the front: each buffer goes back
/// when the last fragment that refers to it is taken away and dropped,
/// not when the rest of the received aggregate goes.
#[test]
fn received_buffers_go_back_with_their_last_fragment() {
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let (mut tx, mut rx, alloc) = local_pair_with_pool(&a, &b);
    let (x, y) = (Aggregate::from(alloc.alloc().unwrap()), Aggregate::from(alloc.alloc().unwrap()));
    let y_id = y.fragments().next().unwrap().buffer_id();
    // x[0..10] y[0..10] x[20..30]; `x` and `y` keep references: both cross as copies.
    let msg = x.slice(0..10).unwrap().join(y.slice(0..10).unwrap()).join(x.slice(20..30).unwrap());
    tx.send_aggregate(msg, b"m").unwrap();
    let mut got = loop {
        match rx.wait(Some(T)) {
            Ok(Event::Aggregate { agg, .. }) => break agg,
            Ok(Event::PoolAssignRequest(_) | Event::PoolAssigned(_)) => {}
            other => panic!("unexpected {other:?}"),
        }
    };
    drop((x, y));
    let mut head = Aggregate::new();
    head.append_from(&mut got, 20).unwrap(); // x's first fragment and y's only one
    assert_eq!((head.fragments().count(), got.len()), (2, 10));
    drop(head);
    rx.flush().unwrap();
    match tx.wait(Some(T)) {
        Ok(Event::CopyReleased { buffer, writable: true }) => assert_eq!(buffer, y_id),
        other => panic!("y's copy should be back while `got` still holds x: {other:?}"),
    }
    got.clip_front(10);
    rx.flush().unwrap();
    assert!(matches!(tx.wait(Some(T)), Ok(Event::CopyReleased { writable: true, .. })));
    assert_eq!(alloc.available(), 2);
}

/// A received aggregate clipped from the front, in steps, past the last
/// fragment of one member while it still holds another: that member's
/// buffer goes back then (its owner gets it back and can allocate it
/// again), not when the aggregate goes; what is left reads as the other
/// member's bytes.
#[test]
fn clipping_a_received_aggregate_past_a_member_gives_its_buffer_back() {
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let (mut tx, mut rx, alloc) = local_pair_with_pool(&a, &b);
    let mut x = alloc.alloc().unwrap();
    x.as_mut_slice().unwrap()[..10].copy_from_slice(b"0123456789");
    let mut y = alloc.alloc().unwrap();
    y.as_mut_slice().unwrap()[..10].copy_from_slice(b"abcdefghij");
    let (x, y) = (Aggregate::from(x), Aggregate::from(y));
    let x_id = x.fragments().next().unwrap().buffer_id();
    // `x` and `y` keep references: both cross as copies.
    tx.send_aggregate(x.slice(0..10).unwrap().join(y.slice(0..10).unwrap()), b"m").unwrap();
    let mut got = loop {
        match rx.wait(Some(T)) {
            Ok(Event::Aggregate { agg, .. }) => break agg,
            Ok(Event::PoolAssignRequest(_) | Event::PoolAssigned(_)) => {}
            other => panic!("unexpected {other:?}"),
        }
    };
    drop((x, y));
    assert_eq!(alloc.available(), 0, "both buffers are out as copies");
    // Into x's only fragment, then to its end: x is done with.
    got.clip_front(4);
    assert_eq!(got.to_vec(), b"456789abcdefghij");
    got.clip_front(6);
    assert_eq!(got.to_vec(), b"abcdefghij");
    rx.flush().unwrap();
    match tx.wait(Some(T)) {
        Ok(Event::CopyReleased { buffer, writable: true }) => assert_eq!(buffer, x_id),
        other => panic!("x's copy should be back while the aggregate still holds y: {other:?}"),
    }
    assert_eq!(alloc.available(), 1, "x is free again");
    let again = alloc.alloc().expect("x, allocated again");
    assert_eq!(again.id(), x_id);
    drop(again);
    // y goes with the aggregate's last byte.
    got.clip_front(3);
    assert_eq!(got.to_vec(), b"defghij");
    got.clip_front(100);
    assert!(got.is_empty());
    rx.flush().unwrap();
    assert!(matches!(tx.wait(Some(T)), Ok(Event::CopyReleased { writable: true, .. })));
    assert_eq!(alloc.available(), 2);
}
