//! What async/await costs on a channel: the measured end drives a channel
//! with the blocking API (default spin, and without spinning) or as an
//! `AsyncChannel` in a task of tokio's multi-threaded runtime (one
//! worker; without spinning, its default, and with the blocking API's
//! default spin); the peer is another thread with the blocking API, passing
//! every buffer back. Local backend (two domains, two threads) and shared
//! memory backend (the same, over an abstract socket). Two figures each:
//! the round trip of one 4 KiB buffer (move, pass back), and the throughput
//! with 16 buffers in flight (moves per second).
//!
//! `cargo bench -p ferry --features tokio --bench async_channel`

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferry::tokio::AsyncChannel;
use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints, PoolPolicy};

const SIZE: usize = 4096;
const IN_FLIGHT: usize = 16;
const T: Duration = Duration::from_secs(10);

/// A connected channel to a peer thread that passes back every buffer it
/// receives (until the channel closes); `alloc`'s pool assigned.
fn start(endpoint: Endpoint, tag: &str) -> (Channel, Allocator, std::thread::JoinHandle<()>) {
    let domain = Domain::new(&format!("measured-{tag}"));
    let mut ch = Channel::create(&domain, &endpoint, ChannelSetup::default()).expect("create");
    let peer = std::thread::spawn(move || {
        let mut rx = Channel::connect(&Domain::new("peer"), &endpoint, BindParams::default(), T).expect("connect");
        rx.set_pool_policy(PoolPolicy::AcceptAll);
        loop {
            match rx.wait(Some(Duration::from_secs(60))) {
                Ok(Event::MoveReceived { buffer, meta }) => rx.pass(buffer, &meta).expect("pass"),
                Ok(Event::PoolAssignRequest(_)) => {}
                Ok(Event::Closed { .. } | Event::Error(_)) | Err(_) => return,
                Ok(ev) => panic!("peer: unexpected {ev:?}"),
            }
        }
    });
    ch.wait_connected(T).expect("connected");
    let alloc = Allocator::new(&domain, 2 * IN_FLIGHT as u64, SIZE, PoolConstraints::default()).expect("pool");
    ch.assign_pool_and_wait(alloc.pool(), T).expect("assigned");
    (ch, alloc, peer)
}

fn endpoint(backend: &str) -> Endpoint {
    match backend {
        "local" => Endpoint::local(),
        _ => Endpoint::shm_abstract(&format!("ferry-bench-async-{}", std::process::id())),
    }
}

fn blocking_pass(ch: &mut Channel) -> ferry::Buffer {
    match ch.wait(Some(T)) {
        Ok(Event::BufferPassed { buffer, .. }) => buffer,
        ev => panic!("expected a pass, got {ev:?}"),
    }
}

async fn async_pass(ch: &mut AsyncChannel) -> ferry::Buffer {
    match ch.next_event().await {
        Some(Event::BufferPassed { buffer, .. }) => buffer,
        ev => panic!("expected a pass, got {ev:?}"),
    }
}

/// `iters` moves with `in_flight` buffers out at most, blocking API.
fn run_blocking(ch: &mut Channel, alloc: &Allocator, iters: u64, in_flight: usize) -> Duration {
    let mut free: Vec<_> = (0..in_flight).map(|_| alloc.alloc().expect("free buffer")).collect();
    let start = Instant::now();
    let (mut sent, mut back) = (0, 0);
    while back < iters {
        while sent < iters {
            let Some(buf) = free.pop() else { break };
            ch.move_buffer(buf, &[]).expect("move");
            sent += 1;
        }
        free.push(blocking_pass(ch));
        back += 1;
    }
    start.elapsed()
}

/// The same with the async API.
async fn run_async(ch: &mut AsyncChannel, alloc: &Allocator, iters: u64, in_flight: usize) -> Duration {
    let mut free: Vec<_> = (0..in_flight).map(|_| alloc.alloc().expect("free buffer")).collect();
    let start = Instant::now();
    let (mut sent, mut back) = (0, 0);
    while back < iters {
        while sent < iters {
            let Some(buf) = free.pop() else { break };
            ch.move_buffer(buf, &[]).await.expect("move");
            sent += 1;
        }
        free.push(async_pass(ch).await);
        back += 1;
    }
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    // One worker: with the peer's thread, as many threads as the blocking
    // runs use (the development machine has two cores).
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    for (figure, in_flight) in [("round trip 4 KiB", 1), ("throughput 4 KiB, 16 in flight", IN_FLIGHT)] {
        let mut group = c.benchmark_group(figure);
        group.throughput(Throughput::Elements(1));
        for backend in ["local", "shm"] {
            for spin in [ferry::DEFAULT_SPIN, Duration::ZERO] {
                let (mut ch, alloc, peer) = start(endpoint(backend), backend);
                ch.set_spin(spin);
                let name = if spin.is_zero() { "blocking, no spin" } else { "blocking" };
                group.bench_function(BenchmarkId::new(name, backend), |b| {
                    b.iter_custom(|iters| run_blocking(&mut ch, &alloc, iters, in_flight))
                });
                drop(ch);
                peer.join().expect("peer");
            }
            for spin in [Duration::ZERO, ferry::DEFAULT_SPIN] {
                let (ch, alloc, peer) = start(endpoint(backend), backend);
                let mut ch = {
                    let _in_runtime = rt.enter();
                    AsyncChannel::new(ch).map_err(|r| r.error).expect("wrap")
                };
                ch.set_spin(spin);
                let name = if spin.is_zero() { "tokio task" } else { "tokio task, spin" };
                // The channel and pool travel into a task on the runtime's
                // workers for every measurement, and back.
                let mut state = Some((ch, alloc));
                group.bench_function(BenchmarkId::new(name, backend), |b| {
                    b.iter_custom(|iters| {
                        let (mut ch, alloc) = state.take().expect("ours");
                        let task = rt.spawn(async move {
                            let took = run_async(&mut ch, &alloc, iters, in_flight).await;
                            (ch, alloc, took)
                        });
                        let (ch, alloc, took) = rt.block_on(task).expect("task");
                        state = Some((ch, alloc));
                        took
                    })
                });
                drop(state);
                peer.join().expect("peer");
            }
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
