//! Tests of the reference model (`tests/model/reference.rs`) on its own:
//! hand-written scenarios from [ETH-BT] §5.2 and SEMANTICS.md, and a
//! property test that runs random operation sequences and checks the
//! invariants after every step.

mod model;

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use model::reference::{
    initial_seed, BufId, BufferState, ChanId, ChannelState, DomainId, Event, Model, Op, Outcome, PoolId, Queue, Reject,
    Trust, AGG_MAX,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use model::gen::{pick_step, setup, use_aggregates, RawStep, Step, META};

const A: DomainId = 0;
const B: DomainId = 1;
const C: DomainId = 2;

// ----------------------------------------------------------------------
// Helpers.

/// Apply an operation that must succeed; check the invariants after it.
fn ok(m: &mut Model, op: Op) -> Outcome {
    let out = m.apply(&op).unwrap_or_else(|e| panic!("{op:?} refused with {e:?}"));
    m.check_invariants().unwrap_or_else(|e| panic!("after {op:?}: {e}"));
    out
}

/// Apply an operation that must be refused with `want` and change nothing.
fn rej(m: &mut Model, op: Op, want: Reject) {
    let before = m.clone();
    assert_eq!(m.apply(&op), Err(want), "{op:?}");
    assert_eq!(*m, before, "{op:?} changed the state although refused");
}

fn create_pool(m: &mut Model, domain: DomainId, count: usize) -> PoolId {
    match ok(m, Op::CreatePool { domain, count }) {
        Outcome::Created(id) => id,
        other => panic!("{other:?}"),
    }
}

fn connect(m: &mut Model, source: DomainId, sink: DomainId, trust: Trust) -> ChanId {
    match ok(m, Op::Connect { source, sink, trust }) {
        Outcome::Created(id) => id,
        other => panic!("{other:?}"),
    }
}

fn deliver(m: &mut Model, chan: ChanId, queue: Queue) -> (DomainId, Event) {
    match ok(m, Op::Deliver { chan, queue }) {
        Outcome::Delivered { to, event } => (to, event),
        other => panic!("{other:?}"),
    }
}

/// The queue that carries messages sent by `domain` on `chan`.
fn out_queue(m: &Model, chan: ChanId, domain: DomainId) -> Queue {
    if m.endpoints(chan).0 == domain {
        Queue::Data
    } else {
        Queue::Control
    }
}

/// Full two-phase assignment of `pool` to `chan` by `domain`, accepted.
fn assign(m: &mut Model, domain: DomainId, chan: ChanId, pool: PoolId) {
    let (source, sink) = m.endpoints(chan);
    let peer = if domain == source { sink } else { source };
    ok(m, Op::AssignPool { domain, chan, pool });
    let q = out_queue(m, chan, domain);
    assert_eq!(deliver(m, chan, q), (peer, Event::PoolAssignRequest { pool }));
    ok(m, Op::RespondAssign { domain: peer, chan, pool, accept: true });
    let q = out_queue(m, chan, peer);
    assert_eq!(deliver(m, chan, q), (domain, Event::PoolAssigned { pool }));
    assert!(m.pool_assigned(pool, chan, domain) && m.pool_assigned(pool, chan, peer));
}

fn buf(pool: PoolId, index: usize) -> BufId {
    BufId { pool, index }
}

fn mv(domain: DomainId, chan: ChanId, buf: BufId) -> Op {
    Op::Move { domain, chan, buf, meta_len: 1 }
}

fn pass(domain: DomainId, chan: ChanId, buf: BufId) -> Op {
    Op::Pass { domain, chan, buf, meta_len: 2 }
}

fn copy(domain: DomainId, chan: ChanId, buf: BufId) -> Op {
    Op::Copy { domain, chan, buf, meta_len: 3 }
}

fn release(domain: DomainId, chan: ChanId, buf: BufId) -> Op {
    Op::Release { domain, chan, buf }
}

// ----------------------------------------------------------------------
// Hand-written scenarios.

/// §5.2.4 transmit master: allocate, assign, move, deliver, pass back.
#[test]
fn transmit_master_flow() {
    let mut m = Model::new(2, META);
    let p = create_pool(&mut m, A, 2);
    let c = connect(&mut m, A, B, Trust::Full);
    assert_eq!(m.pool_trust(p), Trust::Uninitialized);
    assert!(m.knows_pool(A, p) && !m.knows_pool(B, p));

    ok(&mut m, Op::AssignPool { domain: A, chan: c, pool: p });
    assert_eq!(m.pool_trust(p), Trust::Full);
    assert_eq!(m.pending(c, Queue::Data), 1);
    // Not yet assigned anywhere: buffers cannot move.
    rej(&mut m, mv(A, c, buf(p, 0)), Reject::PoolNotAssigned);
    assert_eq!(deliver(&mut m, c, Queue::Data), (B, Event::PoolAssignRequest { pool: p }));
    assert!(m.knows_pool(B, p));
    assert_eq!(m.pending_requests(c, B), vec![p]);
    ok(&mut m, Op::RespondAssign { domain: B, chan: c, pool: p, accept: true });
    assert!(m.pool_assigned(p, c, B) && !m.pool_assigned(p, c, A));
    assert_eq!(deliver(&mut m, c, Queue::Control), (A, Event::PoolAssigned { pool: p }));
    assert!(m.pool_assigned(p, c, A));

    let b = buf(p, 0);
    assert_eq!(m.buffer_state(b, A), BufferState::ReadWrite);
    ok(&mut m, mv(A, c, b));
    assert_eq!(m.owner(b), B);
    assert_eq!(m.buffer_state(b, A), BufferState::Invalid);
    assert_eq!(m.buffer_state(b, B), BufferState::Invalid);
    // In flight: nobody can use it.
    rej(&mut m, mv(A, c, b), Reject::ForeignBuffer);
    rej(&mut m, pass(B, c, b), Reject::ForeignBuffer);
    assert_eq!(deliver(&mut m, c, Queue::Data), (B, Event::MoveReceived { buf: b, meta_len: 1 }));
    assert_eq!(m.buffer_state(b, B), BufferState::ReadWrite);

    ok(&mut m, pass(B, c, b));
    assert_eq!(m.owner(b), A);
    assert_eq!(m.buffer_state(b, B), BufferState::Invalid);
    assert_eq!(deliver(&mut m, c, Queue::Control), (A, Event::BufferPassed { buf: b, meta_len: 2 }));
    assert_eq!(m.buffer_state(b, A), BufferState::ReadWrite);
    rej(&mut m, Op::Deliver { chan: c, queue: Queue::Data }, Reject::QueueEmpty);
}

/// §5.2.4 receive master: the sink allocates and assigns, then passes
/// buffers to the source, which moves them back.
#[test]
fn receive_master_flow() {
    let mut m = Model::new(2, META);
    let c = connect(&mut m, A, B, Trust::Half);
    let p = create_pool(&mut m, B, 2);
    ok(&mut m, Op::AssignPool { domain: B, chan: c, pool: p });
    assert_eq!(m.pending(c, Queue::Control), 1);
    assert_eq!(deliver(&mut m, c, Queue::Control), (A, Event::PoolAssignRequest { pool: p }));
    ok(&mut m, Op::RespondAssign { domain: A, chan: c, pool: p, accept: true });
    // The source may already use the pool; the sink only after the reply.
    rej(&mut m, pass(B, c, buf(p, 0)), Reject::PoolNotAssigned);
    assert_eq!(deliver(&mut m, c, Queue::Data), (B, Event::PoolAssigned { pool: p }));
    for i in 0..2 {
        ok(&mut m, pass(B, c, buf(p, i)));
    }
    for i in 0..2 {
        assert_eq!(deliver(&mut m, c, Queue::Control), (A, Event::BufferPassed { buf: buf(p, i), meta_len: 2 }));
        assert_eq!(m.buffer_state(buf(p, i), A), BufferState::ReadWrite);
    }
    ok(&mut m, mv(A, c, buf(p, 1)));
    assert_eq!(deliver(&mut m, c, Queue::Data), (B, Event::MoveReceived { buf: buf(p, 1), meta_len: 1 }));
    assert_eq!(m.owner(buf(p, 1)), B);
    assert_eq!(m.owner(buf(p, 0)), A);
}

/// A→B→C with a forwarded copy (Alg. 9, 10 and invariant 5).
#[test]
fn chain_forwarded_copy() {
    let mut m = Model::new(3, META);
    let p = create_pool(&mut m, A, 1);
    let ab = connect(&mut m, A, B, Trust::Full);
    let bc = connect(&mut m, B, C, Trust::Full);
    assign(&mut m, A, ab, p);
    assign(&mut m, B, bc, p); // B learned the pool through the first assignment
    let b = buf(p, 0);

    ok(&mut m, copy(A, ab, b));
    assert_eq!(m.buffer_state(b, A), BufferState::ReadOnlyOwned);
    assert_eq!(m.buffer_state(b, B), BufferState::Invalid);
    // B cannot forward a copy it has not received yet.
    rej(&mut m, copy(B, bc, b), Reject::ForeignBuffer);
    rej(&mut m, release(B, ab, b), Reject::ForeignBuffer);
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::CopyReceived { buf: b, meta_len: 3 }));
    assert_eq!(m.buffer_state(b, B), BufferState::ReadOnly);
    // The owner cannot move while copies are out.
    rej(&mut m, mv(A, ab, b), Reject::CopiesOutstanding);
    // A holder may not move, only forward.
    rej(&mut m, mv(B, bc, b), Reject::ForeignBuffer);

    ok(&mut m, copy(B, bc, b));
    assert_eq!(m.copies_count(b, bc), 1);
    assert_eq!(deliver(&mut m, bc, Queue::Data), (C, Event::CopyReceived { buf: b, meta_len: 3 }));
    assert_eq!(m.buffer_state(b, C), BufferState::ReadOnly);

    rej(&mut m, release(B, ab, b), Reject::CopiesForwarded);
    ok(&mut m, release(C, bc, b));
    assert_eq!(m.buffer_state(b, C), BufferState::Invalid);
    // Issued but not delivered: B's forwarded copy is still out.
    rej(&mut m, release(B, ab, b), Reject::CopiesForwarded);
    assert_eq!(deliver(&mut m, bc, Queue::Control), (B, Event::CopyReleased { buf: b, writable: false }));
    ok(&mut m, release(B, ab, b));
    assert_eq!(m.buffer_state(b, B), BufferState::Invalid);
    assert_eq!(m.buffer_state(b, A), BufferState::ReadOnlyOwned);
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::CopyReleased { buf: b, writable: true }));
    assert_eq!(m.buffer_state(b, A), BufferState::ReadWrite);
}

/// The owner stays READ_ONLY_OWNED until every copy is back (multiset).
#[test]
fn owner_read_only_until_all_copies_back() {
    let mut m = Model::new(2, META);
    let p = create_pool(&mut m, A, 1);
    let ab = connect(&mut m, A, B, Trust::None);
    assign(&mut m, A, ab, p);
    let b = buf(p, 0);
    ok(&mut m, copy(A, ab, b));
    ok(&mut m, copy(A, ab, b));
    assert_eq!(m.copies_count(b, ab), 2);
    deliver(&mut m, ab, Queue::Data);
    deliver(&mut m, ab, Queue::Data);
    assert_eq!(m.held_count(b, ab), 2);
    ok(&mut m, release(B, ab, b));
    assert_eq!(m.buffer_state(b, B), BufferState::ReadOnly);
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::CopyReleased { buf: b, writable: false }));
    assert_eq!(m.buffer_state(b, A), BufferState::ReadOnlyOwned);
    ok(&mut m, release(B, ab, b));
    rej(&mut m, release(B, ab, b), Reject::ForeignBuffer);
    assert_eq!(m.buffer_state(b, A), BufferState::ReadOnlyOwned);
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::CopyReleased { buf: b, writable: true }));
    assert_eq!(m.buffer_state(b, A), BufferState::ReadWrite);
}

/// A holder holding `(b, c)` twice may release one even with forwarded
/// copies out; a holder that is not the owner otherwise may not.
#[test]
fn release_with_double_hold() {
    let mut m = Model::new(3, META);
    let p = create_pool(&mut m, A, 1);
    let ab = connect(&mut m, A, B, Trust::Full);
    let bc = connect(&mut m, B, C, Trust::Full);
    assign(&mut m, A, ab, p);
    assign(&mut m, B, bc, p);
    let b = buf(p, 0);
    ok(&mut m, copy(A, ab, b));
    ok(&mut m, copy(A, ab, b));
    deliver(&mut m, ab, Queue::Data);
    deliver(&mut m, ab, Queue::Data);
    ok(&mut m, copy(B, bc, b));
    ok(&mut m, release(B, ab, b));
    rej(&mut m, release(B, ab, b), Reject::CopiesForwarded);
}

/// The owner getting its own copy back (A→B→A) may release it while its
/// own copies are out; then B may release.
#[test]
fn owner_releases_copy_of_its_own_buffer() {
    let mut m = Model::new(2, META);
    let p = create_pool(&mut m, A, 1);
    let ab = connect(&mut m, A, B, Trust::Full);
    let ba = connect(&mut m, B, A, Trust::Full);
    assign(&mut m, A, ab, p);
    assign(&mut m, B, ba, p);
    let b = buf(p, 0);
    ok(&mut m, copy(A, ab, b));
    deliver(&mut m, ab, Queue::Data);
    ok(&mut m, copy(B, ba, b));
    deliver(&mut m, ba, Queue::Data);
    assert_eq!(m.buffer_state(b, A), BufferState::ReadOnlyOwned);
    rej(&mut m, release(B, ab, b), Reject::CopiesForwarded);
    ok(&mut m, release(A, ba, b));
    assert_eq!(m.buffer_state(b, A), BufferState::ReadOnlyOwned);
    assert_eq!(deliver(&mut m, ba, Queue::Control), (B, Event::CopyReleased { buf: b, writable: false }));
    ok(&mut m, release(B, ab, b));
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::CopyReleased { buf: b, writable: true }));
}

/// SEMANTICS.md invariant 5: the B→C→B cycle. No release may cut the
/// cycle off from the owner, so the owner never becomes READ_WRITE while
/// copies exist. (With the rule as written the cycle cannot be undone.)
#[test]
fn copy_cycle_keeps_owner_read_only() {
    let mut m = Model::new(3, META);
    let p = create_pool(&mut m, A, 1);
    let ab = connect(&mut m, A, B, Trust::Full);
    let bc = connect(&mut m, B, C, Trust::Full);
    let cb = connect(&mut m, C, B, Trust::Full);
    assign(&mut m, A, ab, p);
    assign(&mut m, B, bc, p);
    assign(&mut m, C, cb, p);
    let b = buf(p, 0);
    ok(&mut m, copy(A, ab, b));
    deliver(&mut m, ab, Queue::Data);
    ok(&mut m, copy(B, bc, b));
    deliver(&mut m, bc, Queue::Data);
    ok(&mut m, copy(C, cb, b));
    deliver(&mut m, cb, Queue::Data);
    // [ETH-BT]'s rule would let B release (b, ab): the copies bc, cb would
    // still each have a copy receiver as source, but A would be READ_WRITE.
    rej(&mut m, release(B, ab, b), Reject::CopiesForwarded);
    rej(&mut m, release(B, cb, b), Reject::CopiesForwarded);
    rej(&mut m, release(C, bc, b), Reject::CopiesForwarded);
    assert_eq!(m.buffer_state(b, A), BufferState::ReadOnlyOwned);
    assert_eq!(m.buffer_state(b, B), BufferState::ReadOnly);
    assert_eq!(m.buffer_state(b, C), BufferState::ReadOnly);
    rej(&mut m, mv(A, ab, b), Reject::CopiesOutstanding);
    // A second round of copies from A changes nothing for the cycle.
    ok(&mut m, copy(A, ab, b));
    deliver(&mut m, ab, Queue::Data);
    ok(&mut m, release(B, ab, b)); // held twice
    deliver(&mut m, ab, Queue::Control);
    assert_eq!(m.buffer_state(b, A), BufferState::ReadOnlyOwned);
    rej(&mut m, release(B, ab, b), Reject::CopiesForwarded);
}

/// Alg. 6 with a veto: the pool leaves the peer's list, trust resets.
#[test]
fn vetoed_assignment() {
    let mut m = Model::new(3, META);
    let p = create_pool(&mut m, A, 1);
    let ab = connect(&mut m, A, B, Trust::Half);
    let ac = connect(&mut m, A, C, Trust::Full);
    ok(&mut m, Op::AssignPool { domain: A, chan: ab, pool: p });
    assert_eq!(m.pool_trust(p), Trust::Half);
    rej(&mut m, Op::AssignPool { domain: A, chan: ac, pool: p }, Reject::TrustMismatch);
    deliver(&mut m, ab, Queue::Data);
    assert!(m.knows_pool(B, p));
    rej(&mut m, Op::RespondAssign { domain: B, chan: ab, pool: p + 1, accept: true }, Reject::NoPendingRequest);
    rej(&mut m, Op::RespondAssign { domain: A, chan: ab, pool: p, accept: true }, Reject::NoPendingRequest);
    ok(&mut m, Op::RespondAssign { domain: B, chan: ab, pool: p, accept: false });
    assert!(!m.knows_pool(B, p));
    assert!(!m.pool_assigned(p, ab, B));
    assert_eq!(m.pool_trust(p), Trust::Half); // until A hears of the veto
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::PoolVetoed { pool: p }));
    assert_eq!(m.pool_trust(p), Trust::Uninitialized);
    assert!(!m.pool_assigned(p, ab, A));
    assert!(m.knows_pool(A, p));
    // Now the pool can go to a channel of another trust level.
    assign(&mut m, A, ac, p);
    assert_eq!(m.pool_trust(p), Trust::Full);
    // A veto of a pool the peer already knew keeps it in the peer's list,
    // and the trust stays because a channel has the pool.
    let ca = connect(&mut m, C, A, Trust::Full);
    ok(&mut m, Op::AssignPool { domain: C, chan: ca, pool: p });
    deliver(&mut m, ca, Queue::Data);
    ok(&mut m, Op::RespondAssign { domain: A, chan: ca, pool: p, accept: false });
    assert!(m.knows_pool(A, p));
    deliver(&mut m, ca, Queue::Control);
    assert_eq!(m.pool_trust(p), Trust::Full);
    // B learns the pool through two requests; vetoing one keeps the entry
    // for the other; vetoing both drops it.
    let cb = connect(&mut m, C, B, Trust::Full);
    let ab2 = connect(&mut m, A, B, Trust::Full);
    ok(&mut m, Op::AssignPool { domain: C, chan: cb, pool: p });
    ok(&mut m, Op::AssignPool { domain: A, chan: ab2, pool: p });
    deliver(&mut m, cb, Queue::Data);
    deliver(&mut m, ab2, Queue::Data);
    let veto = |chan| Op::RespondAssign { domain: B, chan, pool: p, accept: false };
    ok(&mut m, veto(ab2));
    assert!(m.knows_pool(B, p));
    ok(&mut m, veto(cb));
    assert!(!m.knows_pool(B, p));
    // A channel still has the pool: trust stays.
    deliver(&mut m, cb, Queue::Control);
    deliver(&mut m, ab2, Queue::Control);
    assert_eq!(m.pool_trust(p), Trust::Full);
}

/// Double assignment and the other assignment errors.
#[test]
fn double_assignment_refused() {
    let mut m = Model::new(3, META);
    let p = create_pool(&mut m, A, 1);
    let q = create_pool(&mut m, C, 1);
    let ab = connect(&mut m, A, B, Trust::Full);
    rej(&mut m, Op::AssignPool { domain: A, chan: ab, pool: q }, Reject::UnknownPool);
    rej(&mut m, Op::AssignPool { domain: A, chan: ab, pool: 7 }, Reject::UnknownPool);
    rej(&mut m, Op::AssignPool { domain: B, chan: ab, pool: p }, Reject::UnknownPool);
    rej(&mut m, Op::AssignPool { domain: C, chan: ab, pool: q }, Reject::NotADomainOfChannel);
    ok(&mut m, Op::AssignPool { domain: A, chan: ab, pool: p });
    // Pending at the assigner.
    rej(&mut m, Op::AssignPool { domain: A, chan: ab, pool: p }, Reject::PoolAlreadyAssigned);
    deliver(&mut m, ab, Queue::Data);
    // Delivered and unanswered at the peer: B only has a provisional entry,
    // so it cannot offer the pool itself yet.
    rej(&mut m, Op::AssignPool { domain: B, chan: ab, pool: p }, Reject::UnknownPool);
    ok(&mut m, Op::RespondAssign { domain: B, chan: ab, pool: p, accept: true });
    // Listed at the peer.
    rej(&mut m, Op::AssignPool { domain: B, chan: ab, pool: p }, Reject::PoolAlreadyAssigned);
    deliver(&mut m, ab, Queue::Control);
    rej(&mut m, Op::AssignPool { domain: A, chan: ab, pool: p }, Reject::PoolAlreadyAssigned);
    rej(&mut m, Op::AssignPool { domain: B, chan: ab, pool: p }, Reject::PoolAlreadyAssigned);
}

/// Both sides assign the same pool concurrently: each vetoes the other's
/// offer, so they agree that it is not assigned; one may then assign it.
#[test]
fn concurrent_assignment_from_both_sides() {
    let mut m = Model::new(2, META);
    let p = create_pool(&mut m, A, 1);
    let ab = connect(&mut m, A, B, Trust::Full);
    let ba = connect(&mut m, B, A, Trust::Full);
    assign(&mut m, A, ba, p); // now B knows p
    ok(&mut m, Op::AssignPool { domain: A, chan: ab, pool: p });
    ok(&mut m, Op::AssignPool { domain: B, chan: ab, pool: p });
    // Each side receives the other's offer while its own is out: vetoed.
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::PoolVetoed { pool: p }));
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::PoolVetoed { pool: p }));
    for d in [A, B] {
        rej(&mut m, Op::RespondAssign { domain: d, chan: ab, pool: p, accept: true }, Reject::NoPendingRequest);
    }
    // Then each learns its own offer was vetoed: the two sides agree.
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::PoolVetoed { pool: p }));
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::PoolVetoed { pool: p }));
    assert!(!m.pool_assigned(p, ab, A) && !m.pool_assigned(p, ab, B));
    // Either may offer again.
    assign(&mut m, A, ab, p);
    assert!(m.pool_assigned(p, ab, A) && m.pool_assigned(p, ab, B));
}

/// Direction, endpoint and check-order errors.
#[test]
fn wrong_direction_and_check_order() {
    let mut m = Model::new(3, META);
    let p = create_pool(&mut m, A, 2);
    let ab = connect(&mut m, A, B, Trust::Full);
    assign(&mut m, A, ab, p);
    let b = buf(p, 0);
    rej(&mut m, pass(A, ab, b), Reject::WrongDirection);
    rej(&mut m, release(A, ab, b), Reject::WrongDirection);
    rej(&mut m, mv(B, ab, b), Reject::WrongDirection);
    rej(&mut m, copy(B, ab, b), Reject::WrongDirection);
    rej(&mut m, mv(C, ab, b), Reject::NotADomainOfChannel);
    rej(&mut m, mv(A, 9, b), Reject::InvalidArgument);
    rej(&mut m, mv(A, ab, buf(p, 5)), Reject::InvalidArgument);
    rej(&mut m, mv(A, ab, buf(3, 0)), Reject::InvalidArgument);
    rej(&mut m, Op::Move { domain: A, chan: ab, buf: b, meta_len: META + 1 }, Reject::MetaTooLarge);
    rej(&mut m, Op::Copy { domain: A, chan: ab, buf: b, meta_len: META + 1 }, Reject::MetaTooLarge);
    ok(&mut m, Op::Move { domain: A, chan: ab, buf: b, meta_len: META });
    // In flight and wrong direction: direction comes first.
    rej(&mut m, mv(B, ab, b), Reject::WrongDirection);
    rej(&mut m, mv(A, ab, b), Reject::ForeignBuffer);
    deliver(&mut m, ab, Queue::Data);
    rej(&mut m, release(B, ab, b), Reject::NotCopyHolder);
    rej(&mut m, release(B, ab, buf(p, 1)), Reject::ForeignBuffer);
    // Pool not assigned comes after ownership.
    let q = create_pool(&mut m, A, 1);
    rej(&mut m, mv(A, ab, buf(q, 0)), Reject::PoolNotAssigned);
    rej(&mut m, mv(B, ab, buf(q, 0)), Reject::WrongDirection);
    rej(&mut m, pass(B, ab, buf(q, 0)), Reject::ForeignBuffer);
    // Bad creation arguments.
    rej(&mut m, Op::CreatePool { domain: 3, count: 1 }, Reject::InvalidArgument);
    rej(&mut m, Op::CreatePool { domain: A, count: 0 }, Reject::InvalidArgument);
    rej(&mut m, Op::Connect { source: A, sink: A, trust: Trust::Full }, Reject::InvalidArgument);
    rej(&mut m, Op::Connect { source: A, sink: B, trust: Trust::Uninitialized }, Reject::InvalidArgument);
    rej(&mut m, Op::Deliver { chan: 9, queue: Queue::Data }, Reject::InvalidArgument);
}

/// §5.1.11 full copy.
#[test]
fn full_copy() {
    let mut m = Model::new(3, META);
    let p = create_pool(&mut m, A, 2);
    let q = create_pool(&mut m, C, 1);
    let ab = connect(&mut m, A, B, Trust::Full);
    let ca = connect(&mut m, C, A, Trust::Full);
    assign(&mut m, A, ab, p);
    assign(&mut m, C, ca, q);
    let (s, t) = (buf(p, 0), buf(p, 1));
    let fc = |src, dst| Op::FullCopy { domain: A, chan: ab, src, dst, meta_len: 4 };
    rej(&mut m, fc(s, s), Reject::SameBuffer);
    // A copy received from C can be a full-copy source, even of a pool not on ab.
    let r = buf(q, 0);
    rej(&mut m, fc(r, t), Reject::ForeignBuffer);
    ok(&mut m, copy(C, ca, r));
    deliver(&mut m, ca, Queue::Data);
    ok(&mut m, fc(r, t));
    assert_eq!(m.owner(t), B);
    assert_eq!(m.buffer_state(t, A), BufferState::Invalid);
    assert_eq!(m.buffer_state(r, A), BufferState::ReadOnly);
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::MoveReceived { buf: t, meta_len: 4 }));
    // The destination must be READ_WRITE.
    ok(&mut m, copy(A, ab, s));
    rej(&mut m, fc(r, s), Reject::CopiesOutstanding);
    // Source and destination both foreign: ForeignBuffer; then SameBuffer.
    rej(&mut m, fc(t, t), Reject::ForeignBuffer);
}

/// An aggregate: all checks first (a refusal changes nothing), then a move
/// per unshared READ_WRITE owned buffer and a copy per other member, one
/// event at the sink; forwarded on, moved buffers move again and copies
/// are forwarded; every buffer ends where the rules say.
#[test]
fn aggregates_move_unshared_buffers_and_copy_the_rest() {
    let mut m = Model::new(3, META);
    let p = create_pool(&mut m, A, 3);
    let q = create_pool(&mut m, A, 1);
    let ab = connect(&mut m, A, B, Trust::Full);
    let bc = connect(&mut m, B, C, Trust::Full);
    assign(&mut m, A, ab, p);
    let (x, y, z, w) = (buf(p, 0), buf(p, 1), buf(p, 2), buf(q, 0));
    let agg = |domain, chan, members: &[(BufId, bool)], meta_len| {
        let mut a = [None; AGG_MAX];
        for (slot, mbr) in a.iter_mut().zip(members) {
            *slot = Some(*mbr);
        }
        Op::SendAggregate { domain, chan, members: a, meta_len }
    };
    // w's pool is not on the channel; meta too long; the sink cannot send.
    rej(&mut m, agg(A, ab, &[(x, false), (w, false)], 0), Reject::PoolNotAssigned);
    rej(&mut m, agg(A, ab, &[(x, false)], META + 1), Reject::MetaTooLarge);
    rej(&mut m, agg(B, ab, &[(x, false)], 0), Reject::WrongDirection);
    rej(&mut m, agg(A, ab, &[(x, false), (x, true)], 0), Reject::InvalidArgument);
    // z has a copy out: copied even though A does not keep it.
    ok(&mut m, copy(A, ab, z));
    ok(&mut m, agg(A, ab, &[(x, false), (y, true), (z, false)], 2));
    assert_eq!((m.owner(x), m.owner(y), m.owner(z)), (B, A, A));
    assert_eq!(m.buffer_state(y, A), BufferState::ReadOnlyOwned);
    deliver(&mut m, ab, Queue::Data); // the plain copy of z
    let got = deliver(&mut m, ab, Queue::Data);
    assert_eq!(
        got,
        (B, Event::AggregateReceived { members: [Some((x, true)), Some((y, false)), Some((z, false))], meta_len: 2 })
    );
    assert_eq!(m.pending(ab, Queue::Data), 0, "the whole run in one delivery");
    // B forwards: x (its own now) moves on, the copies are forwarded.
    assign(&mut m, B, bc, p);
    ok(&mut m, agg(B, bc, &[(y, false), (x, false)], 0));
    assert_eq!(m.owner(x), C);
    let got = deliver(&mut m, bc, Queue::Data);
    assert_eq!(got, (C, Event::AggregateReceived { members: [Some((y, false)), Some((x, true)), None], meta_len: 0 }));
    // B cannot release y while the copy it forwarded is out.
    rej(&mut m, release(B, ab, y), Reject::CopiesForwarded);
    ok(&mut m, release(C, bc, y));
    deliver(&mut m, bc, Queue::Control);
    ok(&mut m, release(B, ab, y));
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::CopyReleased { buf: y, writable: true }));
    assert_eq!(m.buffer_state(y, A), BufferState::ReadWrite);
    assert_eq!(m.buffer_state(x, C), BufferState::ReadWrite);
}

/// A received aggregate dropped whole or in pieces releases its copies in
/// whatever order its last references go (the model-based harness drops
/// held aggregates and split pieces so): every order, with the releases
/// delivered at once or all at the end, leaves the same state, every
/// buffer back READ_WRITE at its owner.
#[test]
fn aggregate_copies_released_in_any_order_end_alike() {
    let mut start = Model::new(3, META);
    let p = create_pool(&mut start, A, 3);
    let ab = connect(&mut start, A, B, Trust::Full);
    assign(&mut start, A, ab, p);
    let bufs = [buf(p, 0), buf(p, 1), buf(p, 2)];
    let members = [Some((bufs[0], true)), Some((bufs[1], true)), Some((bufs[2], true))];
    ok(&mut start, Op::SendAggregate { domain: A, chan: ab, members, meta_len: 0 });
    let got = deliver(&mut start, ab, Queue::Data);
    let held = [Some((bufs[0], false)), Some((bufs[1], false)), Some((bufs[2], false))];
    assert_eq!(got, (B, Event::AggregateReceived { members: held, meta_len: 0 }));
    let orders = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
    let mut ends = Vec::new();
    for order in orders {
        for at_once in [true, false] {
            let mut m = start.clone();
            for &i in &order {
                ok(&mut m, release(B, ab, bufs[i]));
                if at_once {
                    deliver(&mut m, ab, Queue::Control);
                }
            }
            while m.pending(ab, Queue::Control) > 0 {
                deliver(&mut m, ab, Queue::Control);
            }
            for b in bufs {
                assert_eq!(
                    (m.buffer_state(b, A), m.buffer_state(b, B)),
                    (BufferState::ReadWrite, BufferState::Invalid)
                );
            }
            ends.push(m);
        }
    }
    assert!(ends.windows(2).all(|w| w[0] == w[1]), "the release order changed the end state");
}

/// Contents: written only by a READ_WRITE owner (first failing check
/// wins, a refusal changes nothing); moves, passes and copies carry them;
/// a full copy gives the destination the source's.
#[test]
fn contents_follow_the_buffer() {
    let mut m = Model::new(3, META);
    let p = create_pool(&mut m, A, 2);
    let ab = connect(&mut m, A, B, Trust::Half);
    let bc = connect(&mut m, B, C, Trust::Half);
    assign(&mut m, A, ab, p);
    assign(&mut m, B, bc, p);
    let (s, t) = (buf(p, 0), buf(p, 1));
    assert_eq!((m.contents(s), m.contents(t)), (initial_seed(p, 0), initial_seed(p, 1)));
    assert_ne!(m.contents(s), m.contents(t), "every buffer starts with its own pattern");
    let write = |m: &mut Model, d, b, seed| m.write(d, b, seed);
    assert_eq!(write(&mut m, A, buf(p, 2), 1), Err(Reject::InvalidArgument));
    assert_eq!(write(&mut m, 3, s, 1), Err(Reject::InvalidArgument));
    let before = m.clone();
    assert_eq!(write(&mut m, B, s, 1), Err(Reject::ForeignBuffer));
    assert_eq!(m, before);
    assert_eq!(write(&mut m, A, s, 7), Ok(Outcome::Done));
    // In flight nobody writes; delivered, the new owner sees A's bytes.
    ok(&mut m, mv(A, ab, s));
    assert_eq!(write(&mut m, A, s, 1), Err(Reject::ForeignBuffer));
    assert_eq!(write(&mut m, B, s, 1), Err(Reject::ForeignBuffer));
    deliver(&mut m, ab, Queue::Data);
    assert_eq!(m.contents(s), 7);
    assert_eq!(write(&mut m, B, s, 8), Ok(Outcome::Done));
    // Copies out: the owner cannot write; the holder reads the owner's bytes.
    ok(&mut m, copy(B, bc, s));
    let before = m.clone();
    assert_eq!(write(&mut m, B, s, 9), Err(Reject::CopiesOutstanding));
    assert_eq!(m, before);
    deliver(&mut m, bc, Queue::Data);
    assert_eq!((m.buffer_state(s, C), m.contents(s)), (BufferState::ReadOnly, 8));
    assert_eq!(write(&mut m, C, s, 9), Err(Reject::ForeignBuffer));
    ok(&mut m, release(C, bc, s));
    deliver(&mut m, bc, Queue::Control);
    // A full copy: the destination takes the source's bytes at issue.
    ok(&mut m, pass(B, ab, s));
    deliver(&mut m, ab, Queue::Control);
    ok(&mut m, Op::FullCopy { domain: A, chan: ab, src: s, dst: t, meta_len: 0 });
    assert_eq!(write(&mut m, A, s, 10), Ok(Outcome::Done));
    assert_eq!((m.contents(s), m.contents(t)), (10, 8));
    deliver(&mut m, ab, Queue::Data);
    assert_eq!((m.owner(t), m.contents(t)), (B, 8));
}

/// Teardown: messages ahead of the marker are delivered first; the peer
/// answers; both sides end CLOSED; copies stay read-only.
#[test]
fn teardown_with_messages_in_flight() {
    let mut m = Model::new(2, META);
    let p = create_pool(&mut m, A, 4);
    let ab = connect(&mut m, A, B, Trust::Full);
    assign(&mut m, A, ab, p);
    ok(&mut m, mv(A, ab, buf(p, 2)));
    deliver(&mut m, ab, Queue::Data);

    ok(&mut m, mv(A, ab, buf(p, 0)));
    ok(&mut m, copy(A, ab, buf(p, 1)));
    ok(&mut m, Op::Teardown { domain: A, chan: ab });
    assert_eq!(m.channel_state(ab, A), ChannelState::Teardown);
    assert_eq!(m.channel_state(ab, B), ChannelState::Connected);
    rej(&mut m, mv(A, ab, buf(p, 3)), Reject::TearingDown);
    rej(&mut m, Op::Teardown { domain: A, chan: ab }, Reject::TearingDown);
    rej(&mut m, Op::AssignPool { domain: A, chan: ab, pool: p }, Reject::TearingDown);
    // The side state is checked before the direction.
    rej(&mut m, pass(A, ab, buf(p, 3)), Reject::TearingDown);
    // B does not know yet and still sends.
    ok(&mut m, pass(B, ab, buf(p, 2)));

    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::MoveReceived { buf: buf(p, 0), meta_len: 1 }));
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::CopyReceived { buf: buf(p, 1), meta_len: 3 }));
    assert_eq!(m.channel_state(ab, B), ChannelState::Connected);
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::TeardownReceived));
    assert_eq!(m.channel_state(ab, B), ChannelState::Closed);
    assert_eq!(m.channel_state(ab, A), ChannelState::Teardown);
    rej(&mut m, pass(B, ab, buf(p, 0)), Reject::NotConnected);
    rej(&mut m, release(B, ab, buf(p, 1)), Reject::NotConnected);
    rej(&mut m, Op::Teardown { domain: B, chan: ab }, Reject::NotConnected);

    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::BufferPassed { buf: buf(p, 2), meta_len: 2 }));
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::Closed));
    assert_eq!(m.channel_state(ab, A), ChannelState::Closed);
    assert_eq!(m.pending(ab, Queue::Data) + m.pending(ab, Queue::Control), 0);
    rej(&mut m, Op::Deliver { chan: ab, queue: Queue::Control }, Reject::QueueEmpty);
    // Copies out at close stay read-only on both sides.
    assert_eq!(m.buffer_state(buf(p, 1), A), BufferState::ReadOnlyOwned);
    assert_eq!(m.buffer_state(buf(p, 1), B), BufferState::ReadOnly);
    assert_eq!(m.buffer_state(buf(p, 0), B), BufferState::ReadWrite);
    assert_eq!(m.buffer_state(buf(p, 2), A), BufferState::ReadWrite);
}

/// Both sides tear down at once: each receives the other's marker.
#[test]
fn simultaneous_teardown() {
    let mut m = Model::new(2, META);
    let ab = connect(&mut m, A, B, Trust::None);
    ok(&mut m, Op::Teardown { domain: A, chan: ab });
    ok(&mut m, Op::Teardown { domain: B, chan: ab });
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::Closed));
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::Closed));
    assert_eq!(m.channel_state(ab, A), ChannelState::Closed);
    assert_eq!(m.channel_state(ab, B), ChannelState::Closed);
}

/// Requests reaching a side that has sent its marker are never answered.
#[test]
fn requests_during_teardown() {
    let mut m = Model::new(2, META);
    let p = create_pool(&mut m, A, 1);
    let q = create_pool(&mut m, A, 1);
    let ab = connect(&mut m, A, B, Trust::Full);
    assign(&mut m, A, ab, q);
    ok(&mut m, Op::AssignPool { domain: A, chan: ab, pool: p });
    ok(&mut m, Op::RemovePool { domain: A, chan: ab, pool: q });
    ok(&mut m, Op::Teardown { domain: B, chan: ab });
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::PoolAssignRequest { pool: p }));
    rej(&mut m, Op::RespondAssign { domain: B, chan: ab, pool: p, accept: true }, Reject::TearingDown);
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::PoolRemoveRequest { pool: q, accepted: false }));
    assert!(m.pool_assigned(q, ab, B));
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::TeardownReceived));
    // Before B closes, its unanswered request is still listed.
    assert_eq!(m.pending_requests(ab, B), vec![p]);
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::Closed));
    // Closed sides free their resources: nothing pending, nothing listed.
    assert!(!m.removal_pending(ab, A, q));
    assert!(m.pending_requests(ab, B).is_empty());
    assert!(!m.pool_assigned(q, ab, B) && !m.pool_assigned(q, ab, A));
}

/// Two-phase pool removal: accepted, refused by the peer, and pending.
#[test]
fn pool_removal() {
    let mut m = Model::new(2, META);
    let p = create_pool(&mut m, A, 2);
    let ab = connect(&mut m, A, B, Trust::Full);
    assign(&mut m, A, ab, p);
    let (b0, b1) = (buf(p, 0), buf(p, 1));
    let remove = |domain| Op::RemovePool { domain, chan: ab, pool: p };
    rej(&mut m, Op::RemovePool { domain: A, chan: ab, pool: p + 1 }, Reject::PoolNotAssigned);

    // Copies out or held make the pool in use.
    ok(&mut m, copy(A, ab, b0));
    rej(&mut m, remove(A), Reject::PoolInUse);
    deliver(&mut m, ab, Queue::Data);
    rej(&mut m, remove(B), Reject::PoolInUse);
    ok(&mut m, release(B, ab, b0));
    ok(&mut m, remove(B));
    rej(&mut m, remove(B), Reject::PoolRemovalPending);
    rej(&mut m, pass(B, ab, b0), Reject::ForeignBuffer);
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::CopyReleased { buf: b0, writable: true }));
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::PoolRemoveRequest { pool: p, accepted: true }));
    assert!(!m.pool_assigned(p, ab, A) && m.pool_assigned(p, ab, B));
    rej(&mut m, mv(A, ab, b0), Reject::PoolNotAssigned);
    rej(&mut m, remove(A), Reject::PoolNotAssigned);
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::PoolRemoved { pool: p }));
    assert!(!m.pool_assigned(p, ab, B));
    // B refers to the pool no more: it leaves B's list (the creator keeps it).
    assert!(!m.knows_pool(B, p) && m.knows_pool(A, p));

    // The peer refuses when a copy is in flight towards the requester.
    assign(&mut m, A, ab, p);
    ok(&mut m, copy(A, ab, b0));
    ok(&mut m, remove(B));
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::PoolRemoveRequest { pool: p, accepted: false }));
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::CopyReceived { buf: b0, meta_len: 3 }));
    // Pending removal blocks the requester's buffer operations.
    rej(&mut m, release(B, ab, b0), Reject::PoolRemovalPending);
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::PoolRemoveRefused { pool: p }));
    assert!(m.pool_assigned(p, ab, B));
    ok(&mut m, release(B, ab, b0));
    deliver(&mut m, ab, Queue::Control);

    // Buffers keep their owners across a removal.
    ok(&mut m, mv(A, ab, b1));
    ok(&mut m, remove(A));
    rej(&mut m, mv(A, ab, b0), Reject::PoolRemovalPending);
    rej(&mut m, copy(A, ab, b0), Reject::PoolRemovalPending);
    deliver(&mut m, ab, Queue::Data); // the move
    assert_eq!(deliver(&mut m, ab, Queue::Data), (B, Event::PoolRemoveRequest { pool: p, accepted: true }));
    assert_eq!(deliver(&mut m, ab, Queue::Control), (A, Event::PoolRemoved { pool: p }));
    assert_eq!(m.owner(b1), B);
    assert_eq!(m.buffer_state(b1, B), BufferState::ReadWrite);
    rej(&mut m, pass(B, ab, b1), Reject::PoolNotAssigned);
}

// ----------------------------------------------------------------------
// Property test: random operation sequences.

/// What the random runs reached, summed over all cases.
#[derive(Default)]
struct Coverage {
    counts: BTreeMap<&'static str, usize>,
    rejects: BTreeSet<Reject>,
}

impl Coverage {
    fn bump(&mut self, what: &'static str) {
        *self.counts.entry(what).or_insert(0) += 1;
    }
}

/// Run one sequence; check the invariants after every step and that a
/// refused operation changed nothing.
fn run_case(trusts: &[u8], steps: &[RawStep], cov: &mut Coverage) -> Result<(), TestCaseError> {
    use_aggregates(true);
    let mut m = setup(trusts);
    m.check_invariants().map_err(TestCaseError::fail)?;
    let mut trace = Vec::new();
    for &raw in steps {
        let op = match pick_step(&m, raw) {
            Step::Op(op) => op,
            Step::Write { domain, buf, seed } => {
                let before = m.clone();
                match m.write(domain, buf, seed) {
                    Ok(_) => {
                        cov.bump("writes");
                        prop_assert_eq!(m.contents(buf), seed);
                    }
                    Err(reject) => {
                        cov.bump("refused_writes");
                        prop_assert_eq!(reject, Reject::CopiesOutstanding, "the generator writes as owner");
                        prop_assert_eq!(&m, &before, "refused write changed the state; trace {:?}", trace);
                    }
                }
                continue;
            }
        };
        trace.push(op);
        let before = m.clone();
        let result = m.apply(&op);
        match result {
            Err(reject) => {
                cov.rejects.insert(reject);
                if reject == Reject::CopiesForwarded {
                    cov.bump("copies_forwarded_refusals");
                }
                prop_assert_eq!(&m, &before, "refused {:?} changed the state; trace {:?}", op, trace);
            }
            Ok(outcome) => {
                match op {
                    Op::Release { .. } => cov.bump("releases"),
                    Op::Copy { domain, buf, .. } if before.owner(buf) != domain => cov.bump("forwarded_copies"),
                    Op::FullCopy { .. } => cov.bump("full_copies"),
                    Op::Move { .. } | Op::Pass { .. } => cov.bump("moves_and_passes"),
                    Op::SendAggregate { .. } => cov.bump("aggregates"),
                    _ => {}
                }
                if let Outcome::Delivered { event, .. } = outcome {
                    match event {
                        Event::PoolAssigned { .. } => cov.bump("assignments"),
                        Event::PoolVetoed { .. } => cov.bump("vetoes"),
                        Event::PoolRemoved { .. } => cov.bump("removals"),
                        Event::PoolRemoveRefused { .. } => cov.bump("refused_removals"),
                        Event::CopyReleased { writable: true, .. } => cov.bump("writable_again"),
                        Event::Closed => cov.bump("teardowns_completed"),
                        Event::AggregateReceived { .. } => cov.bump("aggregates_delivered"),
                        _ => {}
                    }
                }
            }
        }
        if let Err(e) = m.check_invariants() {
            return Err(TestCaseError::fail(format!("{e}\nafter {op:?}\ntrace {trace:?}")));
        }
    }
    // Copies two hops away from their owner at the end of the run.
    if m.copies.keys().any(|&(b, c)| m.endpoints(c).0 != m.owner(b)) {
        cov.bump("runs_ending_with_forwarded_copies");
    }
    Ok(())
}

#[test]
fn random_sequences_keep_invariants() {
    let config = Config { cases: 1024, failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new(config);
    let strategy = (vec(any::<u8>(), 6), vec(any::<RawStep>(), 1..200));
    let coverage = RefCell::new(Coverage::default());
    let result = runner.run(&strategy, |(trusts, steps)| run_case(&trusts, &steps, &mut coverage.borrow_mut()));
    if let Err(e) = result {
        panic!("{e}");
    }
    let cov = coverage.into_inner();
    println!("coverage: {:#?}\nrejects seen: {:?}", cov.counts, cov.rejects);
    for what in [
        "releases",
        "forwarded_copies",
        "copies_forwarded_refusals",
        "full_copies",
        "moves_and_passes",
        "assignments",
        "vetoes",
        "removals",
        "refused_removals",
        "writable_again",
        "teardowns_completed",
        "runs_ending_with_forwarded_copies",
        "writes",
        "refused_writes",
    ] {
        let n = cov.counts.get(what).copied().unwrap_or(0);
        assert!(n > 0, "the generator never reached `{what}`");
    }
    let missing: Vec<Reject> = Reject::ALL.into_iter().filter(|r| !cov.rejects.contains(r)).collect();
    assert!(missing.is_empty(), "never refused with {missing:?}");
}
