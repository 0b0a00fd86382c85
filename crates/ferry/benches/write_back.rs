//! What a channel pays when its two ends hold different memories of a pool
//! (write-back: one copy in each direction) against the same channel whose
//! ends share the pool's memory (descriptors only). One thread drives both
//! ends of a local channel: move, receive, pass back, receive.
//!
//! `cargo bench -p ferry --bench write_back`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints};

fn connect(ep: &Endpoint, a: &Domain, c: &Domain) -> (Channel, Channel) {
    let mut tx = Channel::create(a, ep, ChannelSetup::default()).expect("create");
    let ep = match ep {
        Endpoint::Net(_) => Endpoint::tcp(tx.listen_addr().expect("listening")),
        other => other.clone(),
    };
    let mut rx = Channel::bind(c, &ep, BindParams::default()).expect("bind");
    let t = Some(Duration::from_secs(10));
    assert!(matches!(tx.wait(t), Ok(Event::BindRequest { .. })));
    assert!(matches!(rx.wait(t), Ok(Event::Bound)));
    (tx, rx)
}

fn assign(tx: &mut Channel, rx: &mut Channel, alloc: &Allocator) {
    let t = Some(Duration::from_secs(10));
    tx.assign_pool(alloc.pool()).expect("assign");
    tx.flush().expect("flush");
    match rx.wait(t) {
        Ok(Event::PoolAssignRequest(req)) => rx.respond_pool(req.pool, true).expect("accept"),
        ev => panic!("expected the request, got {ev:?}"),
    }
    rx.flush().expect("flush");
    assert!(matches!(tx.wait(t), Ok(Event::PoolAssigned(_))));
}

/// A local channel from A to C over which `alloc`'s pool is assigned; with
/// `write_back`, C got the pool over TCP first, so its memory is its own.
fn setup(size: usize, write_back: bool) -> (Allocator, Channel, Channel, Vec<Channel>) {
    let (a, c) = (Domain::new("a"), Domain::new("c"));
    let alloc = Allocator::new(&a, 4, size, PoolConstraints::default()).expect("pool");
    let mut keep = Vec::new();
    if write_back {
        let (mut tx, mut rx) = connect(&Endpoint::tcp("127.0.0.1:0".parse().unwrap()), &a, &c);
        assign(&mut tx, &mut rx, &alloc);
        keep.extend([tx, rx]);
    }
    let (mut tx, mut rx) = connect(&Endpoint::local(), &a, &c);
    assign(&mut tx, &mut rx, &alloc);
    (alloc, tx, rx, keep)
}

fn round_trip(c: &mut Criterion) {
    let mut group = c.benchmark_group("local round trip");
    for size in [4096usize, 64 << 10, 1 << 20] {
        group.throughput(Throughput::Bytes(size as u64));
        for (name, write_back) in [("shared memory", false), ("write-back", true)] {
            let (alloc, mut tx, mut rx, _keep) = setup(size, write_back);
            let mut buf = Some(alloc.alloc().expect("free buffer"));
            group.bench_with_input(BenchmarkId::new(name, size), &size, |b, _| {
                b.iter(|| {
                    tx.move_buffer(buf.take().expect("ours"), &[]).expect("move");
                    let Some(Event::MoveReceived { buffer, .. }) = rx.poll() else { panic!("no move") };
                    black_box(buffer[0]);
                    rx.pass(buffer, &[]).expect("pass");
                    let Some(Event::BufferPassed { buffer, .. }) = tx.poll() else { panic!("no pass") };
                    buf = Some(buffer);
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, round_trip);
criterion_main!(benches);
