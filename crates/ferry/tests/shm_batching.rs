//! Batching over shared memory with both channel ends in this process, so
//! what an end has published, and when, shows without any timing: the peer
//! end can take a message only once it is published.

use std::time::Duration;

use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints};

const T: Duration = Duration::from_secs(10);

/// A connected shared-memory channel (source, sink), a pool of `n`
/// buffers of the source's assigned, both ends batching.
fn batching_pair(tag: &str, n: u64) -> (Channel, Channel, Allocator) {
    let (a, b) = (Domain::new("source"), Domain::new("sink"));
    let ep = Endpoint::shm_abstract(&format!("ferry-test-{tag}-{}", std::process::id()));
    let mut tx = Channel::create(&a, &ep, ChannelSetup::default()).unwrap();
    let mut rx = Channel::bind(&b, &ep, BindParams::default()).unwrap();
    tx.wait_connected(T).unwrap();
    rx.wait_connected(T).unwrap();
    let alloc = Allocator::new(&a, n, 4096, PoolConstraints::default()).unwrap();
    tx.assign_pool(alloc.pool()).unwrap();
    match rx.wait(Some(T)) {
        Ok(Event::PoolAssignRequest(req)) => rx.respond_pool(req.pool, true).unwrap(),
        other => panic!("sink: {other:?}"),
    }
    assert!(matches!(tx.wait(Some(T)), Ok(Event::PoolAssigned(_))));
    tx.set_batching(true).unwrap();
    rx.set_batching(true).unwrap();
    (tx, rx, alloc)
}

/// Polls `ch` a bounded number of times; the first event, if any.
fn poll_some(ch: &mut Channel) -> Option<Event> {
    (0..1000).find_map(|_| ch.poll())
}

/// The answer to a request goes out at once: the sink has taken all the
/// source sent, so the source is waiting for it. Held back, it would wait
/// for the sink's next empty poll.
#[test]
fn answer_to_a_request_is_published_at_once() {
    let (mut tx, mut rx, alloc) = batching_pair("answer", 4);
    for seq in 0..3u8 {
        tx.move_buffer(alloc.alloc().unwrap(), &[seq]).unwrap();
        tx.flush().unwrap();
        let Some(Event::MoveReceived { buffer, meta }) = poll_some(&mut rx) else { panic!("no move") };
        rx.pass(buffer, &meta).unwrap();
        // Only the source polls: the pass must have been published by the
        // pass itself.
        match poll_some(&mut tx) {
            Some(Event::BufferPassed { meta, .. }) => assert_eq!(&meta[..], &[seq]),
            other => panic!("the answer was held back: {other:?}"),
        }
    }
}

/// Within a stream, batching stays: after the first answer (published at
/// once), the sink holds its further passes back until its next poll
/// finds nothing.
#[test]
fn a_stream_of_answers_is_still_batched() {
    let (mut tx, mut rx, alloc) = batching_pair("stream", 4);
    for seq in 0..3u8 {
        tx.move_buffer(alloc.alloc().unwrap(), &[seq]).unwrap();
    }
    tx.flush().unwrap();
    let mut got = Vec::new();
    while got.len() < 3 {
        match poll_some(&mut rx) {
            Some(Event::MoveReceived { buffer, meta }) => got.push((buffer, meta)),
            other => panic!("sink: {other:?}"),
        }
    }
    for (buffer, meta) in got {
        rx.pass(buffer, &meta).unwrap();
    }
    assert!(matches!(poll_some(&mut tx), Some(Event::BufferPassed { .. })), "the first answer");
    assert!(poll_some(&mut tx).is_none(), "the others are held back");
    assert!(rx.poll().is_none());
    for _ in 0..2 {
        assert!(matches!(poll_some(&mut tx), Some(Event::BufferPassed { .. })));
    }
}
