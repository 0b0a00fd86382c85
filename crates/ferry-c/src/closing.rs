//! Channel ends the program destroyed, kept until their peer has closed
//! too.
//!
//! `bulk_channel_destroy` tears the end down and returns at once, but the
//! peer may have sent messages before it saw the teardown: buffers passed
//! back, moves, copies. Over shared memory and TCP those wait in a ring or
//! a socket that only this end reads; dropped at once, the end would leave
//! them there, and their buffers would be lost to the pool for good (the
//! peer gave them up, this process never took them back). So a destroyed
//! end lingers on its waitset, off the program's sight, while dispatch
//! takes in what arrives (a buffer goes back to its pool's free list, a
//! copy is released) until the peer's own closing marker comes, the peer
//! goes, or [`LINGER`] passes; then it is dropped. Dropping the waitset
//! drops what still lingers, as a destroy did before.

use std::time::{Duration, Instant};

use ferry::{Channel, ChannelState, Event};

/// How long a destroyed end waits for its peer's closing marker. A peer
/// that dispatches answers within microseconds; one that does not may
/// lose what it sends later, as with any closed channel.
pub const LINGER: Duration = Duration::from_secs(2);

/// Events one poll takes from one lingering end at most: a peer that keeps
/// sending cannot hold a dispatch.
const EVENTS_PER_POLL: usize = 64;

/// The destroyed channel ends of a waitset that wait for their peers.
pub struct Closing {
    ends: Vec<(Channel, Instant)>,
    /// How long each waits ([`LINGER`]).
    linger: Duration,
}

impl Default for Closing {
    fn default() -> Closing {
        Closing { ends: Vec::new(), linger: LINGER }
    }
}

impl Closing {
    /// Takes over a destroyed end: tears it down (again, if the queue was
    /// full the first time) and keeps it until its peer has closed, unless
    /// it is not connected (nothing can be on its way) or closed already.
    pub fn add(&mut self, mut channel: Channel) {
        if !matches!(channel.state(), ChannelState::Connected | ChannelState::Teardown) {
            return;
        }
        if channel.state() == ChannelState::Connected {
            let _ = channel.teardown();
        }
        let _ = channel.flush();
        self.ends.push((channel, Instant::now() + self.linger));
    }

    /// Whether an end lingers.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Takes in what the lingering ends received and drops each one whose
    /// peer has closed, has gone, or did not answer in time.
    pub fn poll(&mut self) {
        let now = Instant::now();
        self.ends.retain_mut(|(channel, until)| take_in(channel) && now < *until);
    }
}

/// Takes in up to [`EVENTS_PER_POLL`] events of a lingering end; false
/// once it is closed.
fn take_in(channel: &mut Channel) -> bool {
    if channel.state() == ChannelState::Connected {
        // The teardown found the queue full: it goes out once there is room.
        let _ = channel.teardown();
    }
    for _ in 0..EVENTS_PER_POLL {
        let Some(event) = channel.poll() else { break };
        // A copy goes back to its owner (refused: the channel closed, and
        // with it the copy). Buffers moved or passed to us go back to
        // their pools' free lists as the event is dropped; the rest needs
        // no answer.
        if let Event::CopyReceived { copy, .. } = event {
            let _ = channel.release(copy);
        }
        if channel.state() == ChannelState::Closed {
            return false;
        }
    }
    channel.state() != ChannelState::Closed
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry::{Allocator, BindParams, ChannelSetup, Domain, Endpoint, PoolConstraints, PoolPolicy};

    const T: Duration = Duration::from_secs(10);

    /// A connected shm channel (`tx` in `a`, `rx` in `b`, both in this
    /// process) with `alloc`'s pool assigned.
    fn channel(name: &str) -> (Domain, Channel, Channel, Allocator) {
        let (a, b) = (Domain::new("a"), Domain::new("b"));
        let path = std::env::temp_dir().join(format!("ferry-c-closing-{}-{name}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let ep = Endpoint::shm(&path);
        let mut tx = Channel::create(&a, &ep, ChannelSetup::default()).expect("create");
        let mut rx = Channel::bind(&b, &ep, BindParams::default()).expect("bind");
        tx.wait_connected(T).expect("tx connected");
        rx.wait_connected(T).expect("rx connected");
        rx.set_pool_policy(PoolPolicy::AcceptAll);
        let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default()).expect("allocator");
        tx.assign_pool(alloc.pool()).expect("assign");
        rx.poll();
        tx.poll();
        (a, tx, rx, alloc)
    }

    /// What the peer passes back before it sees the teardown reaches the
    /// lingering end and goes back to the pool; the end goes once the
    /// peer's marker came.
    #[test]
    fn a_lingering_end_takes_in_what_the_peer_sent_before_its_marker() {
        let (_a, mut tx, mut rx, alloc) = channel("takes-in");
        tx.move_buffer(alloc.alloc().expect("buffer"), &[]).expect("move");
        let Ok(Event::MoveReceived { buffer, .. }) = rx.wait(Some(T)) else { panic!("no move") };
        let mut closing = Closing::default();
        closing.add(tx);
        // The peer passes the buffer back before it polls the teardown.
        rx.pass(buffer, &[]).expect("pass back");
        assert!(matches!(rx.wait(Some(T)), Ok(Event::Closed { by_peer: true })));
        let deadline = Instant::now() + T;
        while !closing.is_empty() {
            assert!(Instant::now() < deadline, "the lingering end never closed");
            closing.poll();
        }
        assert_eq!(alloc.available(), 4, "the buffer passed back did not reach the pool");
    }

    /// A peer that never answers does not keep the end for ever.
    #[test]
    fn a_lingering_end_whose_peer_never_answers_goes_after_its_time() {
        let (_a, tx, _rx, _alloc) = channel("goes");
        let mut closing = Closing { ends: Vec::new(), linger: Duration::from_millis(20) };
        closing.add(tx);
        assert!(!closing.is_empty());
        std::thread::sleep(Duration::from_millis(30));
        closing.poll();
        assert!(closing.is_empty());
    }
}
