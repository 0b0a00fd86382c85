//! A sender waiting for room for a whole aggregate run sleeps until the
//! sink has taken enough messages: its channel's fd wakes it about once per
//! message the sink takes, never in a busy loop while the queue has some
//! room but not enough for the run.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{
    Aggregate, Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, ErrorKind, Event, PoolConstraints,
    PoolPolicy,
};

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 4096;
/// Queue depth of the channels.
const DEPTH: u32 = 8;
/// Single moves queued ahead of the aggregate: one slot stays free.
const AHEAD: usize = 7;

/// A connected pair (A source, B sink accepting every pool) over `ep`,
/// queue depth [`DEPTH`], with a pool of A's assigned.
fn pair(ep: &Endpoint) -> (Domain, Domain, Channel, Channel, Allocator) {
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let setup = ChannelSetup { queue_depth: DEPTH, meta_size: 8, ..ChannelSetup::default() };
    let mut tx = Channel::create(&a, ep, setup).unwrap();
    let mut rx = Channel::bind(&b, ep, BindParams::default()).unwrap();
    let deadline = Instant::now() + T;
    while tx.state() != ferry::ChannelState::Connected || rx.state() != ferry::ChannelState::Connected {
        assert!(Instant::now() < deadline, "setup timed out");
        tx.poll();
        rx.poll();
    }
    rx.set_pool_policy(PoolPolicy::AcceptAll);
    let alloc = Allocator::new(&a, 64, SIZE, PoolConstraints::default()).unwrap();
    tx.assign_pool(alloc.pool()).unwrap();
    loop {
        assert!(Instant::now() < deadline, "assignment timed out");
        rx.poll();
        match tx.poll() {
            Some(Event::PoolAssigned(_)) => break,
            None => {}
            ev => panic!("assignment: {ev:?}"),
        }
    }
    (a, b, tx, rx, alloc)
}

/// Whether `ch`'s fd becomes readable within [`T`].
fn readable(ch: &Channel) -> bool {
    let mut fds = [rustix::event::PollFd::new(ch, rustix::event::PollFlags::IN)];
    rustix::event::poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 10, tv_nsec: 0 })).unwrap() == 1
}

/// Fill the queue but one slot, then send a run of 7 slots while a sink
/// thread takes one message every few milliseconds: the sender's loop
/// (send, poll until none, arm, sleep on the fd) must go round about once
/// per message taken, not spin while the run does not fit.
fn sender_sleeps_until_the_run_fits(ep: Endpoint) {
    let (_a, _b, mut tx, mut rx, alloc) = pair(&ep);
    for _ in 0..AHEAD {
        tx.move_buffer(alloc.alloc().unwrap(), &[]).unwrap();
    }
    // Three buffers, six fragments: a run of 1 + 3 + 3 = 7 slots.
    let parts: Vec<Aggregate> =
        (0..3u8).map(|j| Aggregate::from_bytes_in(alloc.alloc().unwrap(), &[j, 1, 2, 3]).unwrap()).collect();
    let mut msg = Aggregate::new();
    for range in [0..2, 2..4] {
        for p in &parts {
            msg.append(p.slice(range.clone()).unwrap());
        }
    }
    drop(parts);
    let taken = Arc::new(AtomicUsize::new(0));
    let sink = {
        let taken = taken.clone();
        std::thread::spawn(move || {
            let deadline = Instant::now() + T;
            let mut moves = 0;
            loop {
                assert!(Instant::now() < deadline, "sink timed out");
                if moves < AHEAD {
                    // A slow consumer: a message now and then.
                    std::thread::sleep(Duration::from_millis(20));
                }
                match rx.wait(Some(T)) {
                    Ok(Event::MoveReceived { .. }) => moves += 1,
                    Ok(Event::Aggregate { agg, .. }) => {
                        assert_eq!(moves, AHEAD);
                        assert_eq!(agg.to_vec(), vec![0, 1, 1, 1, 2, 1, 2, 3, 2, 3, 2, 3]);
                        return rx;
                    }
                    ev => panic!("sink: {ev:?}"),
                }
                taken.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    let deadline = Instant::now() + T;
    let mut rounds = 0;
    loop {
        assert!(Instant::now() < deadline, "sender timed out after {rounds} rounds");
        match tx.send_aggregate(msg, &[7]) {
            Ok(()) => break,
            Err(r) if r.error == ErrorKind::QueueFull => msg = r.into_inner(),
            Err(r) => panic!("send_aggregate: {}", r.error),
        }
        rounds += 1;
        if let Some(ev) = tx.poll() {
            panic!("sender: {ev:?}");
        }
        if tx.arm() {
            assert!(readable(&tx), "armed for room that never came");
        }
    }
    let _rx = sink.join().unwrap();
    // Each message the sink takes may wake the sender once (the ring's
    // room request is answered per pop); a wake-up may be spurious now and
    // then. A busy loop goes round thousands of times in the sink's pauses.
    let taken = taken.load(Ordering::SeqCst);
    eprintln!("{rounds} rounds of the sender for {taken} messages taken");
    assert!(rounds <= taken + 3, "{rounds} rounds of the sender for {taken} messages taken");
}

#[test]
fn local_sender_sleeps_until_the_run_fits() {
    sender_sleeps_until_the_run_fits(Endpoint::local());
}

#[test]
fn shm_sender_sleeps_until_the_run_fits() {
    sender_sleeps_until_the_run_fits(Endpoint::shm_abstract(&support::unique_name("aggroom")));
}
