//! `AsyncChannel::accept` and `AsyncChannel::connect`: the async forms of
//! the blocking setup helpers, over the local, shared-memory and TCP
//! backends, the binder starting first, timeouts, refusals, cancellation,
//! and a runtime thread that is never held by a retry.
#![cfg(feature = "tokio")]

mod support;

use std::time::Duration;

use ferry::tokio::AsyncChannel;
use ferry::{
    Allocator, BindParams, Channel, ChannelSetup, ChannelState, Domain, Endpoint, ErrorKind, Event, PoolConstraints,
    PoolPolicy, TrustLevel,
};

const T: Duration = Duration::from_secs(10);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// One buffer moved from `tx` to `rx` and passed back: the pair works. The
/// sink runs in a task of its own until the channel closes (over TCP, what
/// an end sends goes out as it polls).
async fn round_trip(mut tx: AsyncChannel, mut rx: AsyncChannel) {
    rx.get_mut().set_pool_policy(PoolPolicy::AcceptAll);
    let sink = tokio::spawn(async move {
        let mut moves = 0;
        while let Some(ev) = rx.next_event().await {
            match ev {
                Event::MoveReceived { buffer, .. } => {
                    assert_eq!(&buffer[..4], b"ping");
                    rx.pass(buffer, &[]).await.unwrap();
                    moves += 1;
                }
                Event::Closed { .. } => break,
                other => panic!("sink: {other:?}"),
            }
        }
        moves
    });
    let alloc = Allocator::new(tx.get_ref().domain(), 1, 4096, PoolConstraints::default()).unwrap();
    tokio::time::timeout(T, tx.assign_pool_and_wait(alloc.pool())).await.unwrap().unwrap();
    let mut buf = alloc.alloc().unwrap();
    buf.as_mut_slice().unwrap()[..4].copy_from_slice(b"ping");
    tx.move_buffer(buf, &[]).await.unwrap();
    let back = tokio::time::timeout(T, tx.next_event()).await.unwrap();
    assert!(matches!(back, Some(Event::BufferPassed { .. })), "{back:?}");
    tx.teardown().await.unwrap();
    while let Some(ev) = tokio::time::timeout(T, tx.next_event()).await.unwrap() {
        if matches!(ev, Event::Closed { .. }) {
            break;
        }
    }
    assert_eq!(tokio::time::timeout(T, sink).await.unwrap().unwrap(), 1);
}

/// The binder starts first and retries until the creator is there, on the
/// local and the shared-memory backends.
#[test]
fn binder_first_then_creator() {
    runtime().block_on(async {
        for ep in [Endpoint::local(), Endpoint::shm_abstract(&support::unique_name("async-connect"))] {
            let binder = tokio::spawn({
                let ep = ep.clone();
                async move { AsyncChannel::connect(&Domain::new("sink"), &ep, BindParams::default(), T).await }
            });
            tokio::time::sleep(Duration::from_millis(30)).await;
            let tx = AsyncChannel::accept(&Domain::new("source"), &ep, ChannelSetup::default(), T).await.unwrap();
            let rx = tokio::time::timeout(T, binder).await.unwrap().unwrap().unwrap();
            assert_eq!(tx.get_ref().state(), ChannelState::Connected);
            assert_eq!(rx.get_ref().state(), ChannelState::Connected);
            round_trip(tx, rx).await;
        }
    });
}

/// Over TCP: a creator on a kernel-chosen port, the async binder connects.
#[test]
fn connects_over_tcp() {
    runtime().block_on(async {
        let ep = Endpoint::tcp("127.0.0.1:0".parse().unwrap());
        let tx = Channel::create(&Domain::new("source"), &ep, ChannelSetup::default()).unwrap();
        let addr = tx.listen_addr().unwrap();
        let mut tx = AsyncChannel::new(tx).unwrap();
        let (sink, ep) = (Domain::new("sink"), Endpoint::tcp(addr));
        let (rx, connected) =
            tokio::join!(AsyncChannel::connect(&sink, &ep, BindParams::default(), T), tx.wait_connected());
        connected.unwrap();
        round_trip(tx, rx.unwrap()).await;
    });
}

/// Nobody binds: TimedOut, and the endpoint is free again. Nobody listens:
/// EndpointNotListening. A creator that refuses the bind: BindRefused.
#[test]
fn typed_errors() {
    runtime().block_on(async {
        let ep = Endpoint::shm_abstract(&support::unique_name("async-accept"));
        let d = Domain::new("d");
        let err = AsyncChannel::accept(&d, &ep, ChannelSetup::default(), Duration::from_millis(30)).await;
        assert_eq!(err.unwrap_err(), ErrorKind::TimedOut);
        drop(Channel::create(&d, &ep, ChannelSetup::default()).expect("the endpoint is free again"));

        let err = AsyncChannel::connect(&d, &ep, BindParams::default(), Duration::from_millis(30)).await;
        assert_eq!(err.unwrap_err(), ErrorKind::EndpointNotListening);

        let setup = ChannelSetup { trust: TrustLevel::Full, ..ChannelSetup::default() };
        let creator = tokio::spawn({
            let ep = ep.clone();
            async move { AsyncChannel::accept(&Domain::new("c"), &ep, setup, Duration::from_millis(500)).await }
        });
        let params = BindParams { trust: Some(TrustLevel::None), ..BindParams::default() };
        let err = AsyncChannel::connect(&d, &ep, params, T).await;
        assert!(matches!(err.as_ref().map_err(|e| e.kind()), Err(ErrorKind::BindRefused(_))), "{err:?}");
        assert!(creator.await.unwrap().is_err(), "the creator got no binder");
    });
}

/// A dropped accept frees its endpoint at once.
#[test]
fn dropped_accept_frees_the_endpoint() {
    runtime().block_on(async {
        let ep = Endpoint::shm_abstract(&support::unique_name("async-cancel"));
        let d = Domain::new("d");
        tokio::select! {
            r = AsyncChannel::accept(&d, &ep, ChannelSetup::default(), T) => panic!("{r:?}"),
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
        drop(Channel::create(&d, &ep, ChannelSetup::default()).expect("the endpoint is free again"));
    });
}

/// On a single-threaded runtime, another task runs while connect retries:
/// the pauses are timers and the attempts run on the blocking pool.
#[test]
fn retries_leave_the_runtime_thread_free() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let ticks = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let ticker = tokio::spawn({
            let ticks = ticks.clone();
            async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    ticks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        });
        let err = AsyncChannel::connect(
            &Domain::new("d"),
            &Endpoint::local(),
            BindParams::default(),
            Duration::from_millis(100),
        )
        .await
        .unwrap_err();
        assert_eq!(err, ErrorKind::EndpointNotListening);
        assert!(ticks.load(std::sync::atomic::Ordering::Relaxed) > 0, "the other task ran meanwhile");
        ticker.abort();
    });
}
