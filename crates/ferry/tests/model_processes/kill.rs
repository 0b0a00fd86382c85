//! What only separate processes can show: `kill -9` of one domain process
//! after a random sequence (all messages delivered first, so nothing is in
//! flight). The model knows no crashes; what the survivors must see follows
//! from the library's promise (SEMANTICS.md, "Failure is death"; the shm
//! tests' `killed_peer_gives_buffers_back`) read with the model's state:
//!
//! * every survivor end of an open channel to the dead domain reports it
//!   (`Error(PeerGone)`, or `Closed { by_peer: false }` after its own
//!   teardown) within [`NOTICE_MS`] and is then `Closed`, with no pool
//!   assigned; every other end is untouched (no event, same state);
//! * a buffer the dead domain owned comes back to the survivor end that
//!   gave it to the dead domain, if that end was still open: owned there
//!   again, read-write unless copies of it are held by survivors, and then
//!   on its free list (`Domain::alloc` hands it out, writable); a buffer
//!   it got over a channel closed since comes back to the same survivor,
//!   but only when an allocation there finds the pool empty (the check
//!   drains each pool, so it sees it); one whose pool leaves the survivor
//!   because nothing there refers to it any more is lost with the dead
//!   domain (SEMANTICS.md, "When a pool goes away": a pool received from
//!   the dead domain over that end only);
//! * every other buffer keeps its owner; copies the dead domain held are
//!   void (their owner may write again when no survivor holds one); copies
//!   survivors hold stay held.
//!
//! A dead domain cannot say what it passed on before it died: that a
//! buffer it moved on to a third domain is not the lender's to take back,
//! and that a copy it forwarded still keeps its owner read-only, the
//! library learns from the pool's ledger (`src/ledger.rs`). The scripted
//! tests in `model_processes.rs` pin both cases down.

use super::*;

/// Bound on the time a survivor takes to notice the death.
const NOTICE_MS: u32 = 2_000;

/// What the kill suite saw.
#[derive(Default, Debug)]
pub struct KillStats {
    /// The random sequences before the kills.
    pub run: ProcStats,
    /// Processes killed.
    pub kills: usize,
    /// Survivor ends that reported the death.
    pub notices: usize,
    /// Slowest notice (ms).
    pub slowest_notice_ms: u32,
    /// Buffers the dead domain owned that came back to their lender.
    pub reclaimed: usize,
    /// Buffers the dead domain owned that came back to a lender whose
    /// channel to it had closed before the kill (on that lender's next
    /// allocation from an empty pool).
    pub reclaimed_after_close: usize,
    /// Of all that came back, handed out again by `Domain::alloc` (and
    /// written).
    pub reallocated: usize,
    /// Buffers the dead domain owned that were lost with it.
    pub lost: usize,
    /// Buffers of survivors writable again because the dead domain's
    /// copies were voided.
    pub voided: usize,
    /// Buffers kept read-only at their owner because survivors hold copies
    /// the dead domain made or forwarded.
    pub pinned: usize,
}

/// Kill domain `k` (after [`Run::quiesce`]) and check the survivors.
pub fn kill_and_check(run: &mut Run, k: DomainId, stats: &mut KillStats) -> Result<(), String> {
    let m = run.m.clone();
    let trace = format!("{:?}", run.trace);
    let h = &mut run.h;
    let chans = h.chans.clone();
    let fail = |what: String| format!("after kill -9 of d{k}: {what}\n  trace {trace}");
    if (0..chans.len()).any(|c| m.pending(c, Queue::Data) + m.pending(c, Queue::Control) > 0) {
        return Err(fail("messages still queued".into()));
    }
    let survivors: Vec<DomainId> = (0..DOMAINS).filter(|&d| d != k).collect();
    let open = |c: ChanId, d: DomainId| m.channel_state(c, d) != MChan::Closed;
    // `s`'s end of a channel to `k` that was open at the kill.
    let open_to_k = |c: ChanId, s: DomainId| chans[c].contains(&k) && chans[c].contains(&s) && open(c, s);
    let before = h.query(&m, &survivors).map_err(fail)?;

    h.cl.kill(k).map_err(fail)?;
    stats.kills += 1;

    // Every survivor end: the ones to k notice, the others see nothing.
    for (c, ends) in chans.iter().enumerate() {
        for (me, peer) in [(ends[0], ends[1]), (ends[1], ends[0])] {
            if me == k {
                continue;
            }
            let state = m.channel_state(c, me);
            let notice = peer == k && open(c, me);
            let cmd = Cmd::Deliver { chan: c as u32, wait_ms: if notice { 5 * NOTICE_MS } else { 0 } };
            let Reply::Event { event, elapsed_ms } = h.cl.call(me, &cmd).map_err(fail)? else {
                return Err(fail(format!("d{me}: no event reply")));
            };
            let ok = match (&event, state) {
                (Some(Ev::Error { peer_gone: true, .. }), MChan::Connected) => notice,
                (Some(Ev::Closed { by_peer: false }), MChan::Teardown) => notice,
                (None, _) => !notice,
                _ => false,
            };
            if !ok {
                return Err(fail(format!("channel {c} at d{me} ({state:?}, peer d{peer}): event {event:?}")));
            }
            if notice {
                stats.notices += 1;
                stats.slowest_notice_ms = stats.slowest_notice_ms.max(elapsed_ms);
                if elapsed_ms > NOTICE_MS {
                    return Err(fail(format!("channel {c} at d{me} noticed only after {elapsed_ms} ms")));
                }
            }
        }
    }

    let after = h.query(&m, &survivors).map_err(fail)?;
    for (c, ends) in chans.iter().enumerate() {
        for &s in ends.iter().filter(|&&s| s != k) {
            let r = after[s].as_ref().expect("queried");
            let end = r.ends.iter().find(|e| e.chan as usize == c).ok_or_else(|| fail(format!("d{s} lost {c}")))?;
            let dead = open_to_k(c, s);
            let want = if dead { ChannelState::Closed } else { channel_state(m.channel_state(c, s)) };
            if end.state != want {
                return Err(fail(format!("channel {c} at d{s}: library {:?}, expected {want:?}", end.state)));
            }
            for (p, got) in end.assigned.iter().enumerate() {
                if *got != (!dead && m.pool_assigned(p, c, s)) {
                    return Err(fail(format!("pool {p} on channel {c} at d{s}: library {got}")));
                }
            }
        }
    }

    // Copies over `c` survive the kill unless the dead domain held them
    // and their sender learns of the death.
    let survives = |c: ChanId| !(chans[c][1] == k && open_to_k(c, chans[c][0]));
    let held_at = |b: BufId, s: DomainId| -> usize {
        (0..chans.len()).filter(|&c| chans[c][1] == s).map(|c| m.held_count(b, c)).sum()
    };
    // After the kill, survivor `s` keeps pool `p` while it refers to it:
    // it created it (the allocator lives), an end of it not to `k` has it,
    // or a buffer of it is owned there (with a handle: not one coming back
    // from `k`) or a copy of one held there.
    let keeps = |s: DomainId, p: usize| -> bool {
        m.pools[p].creator == s
            || (0..chans.len()).any(|c| chans[c].contains(&s) && !open_to_k(c, s) && m.side_refers_to_pool(c, s, p))
            || m.pool_buffers(p).into_iter().any(|b| m.owner(b) == s || held_at(b, s) > 0)
    };
    // Per survivor and pool: the buffers that must be on its free list.
    let mut freed: HashMap<(DomainId, usize), BTreeSet<u32>> = HashMap::new();
    for (i, &b) in m.all_buffers().iter().enumerate() {
        let o = m.owner(b);
        let ideal_owner = if o != k {
            Some(o)
        } else {
            match h.lender.get(&b) {
                Some(&(l, c)) if l != k && open(c, l) && keeps(l, b.pool) => Some(l),
                _ => None,
            }
        };
        // Copies of `b` still out after the kill.
        let remaining: usize = (0..chans.len()).filter(|&c| survives(c)).map(|c| m.copies_count(b, c)).sum();
        let holder = |s: DomainId| if held_at(b, s) > 0 { BufferState::ReadOnly } else { BufferState::Invalid };
        let ideal: Vec<BufferState> = survivors
            .iter()
            .map(|&s| match (Some(s) == ideal_owner, remaining > 0) {
                (true, true) => BufferState::ReadOnlyOwned,
                (true, false) => BufferState::ReadWrite,
                (false, _) => holder(s),
            })
            .collect();
        let got: Vec<BufferState> = survivors.iter().map(|&s| after[s].as_ref().expect("queried").bufs[i]).collect();
        if got != ideal {
            return Err(fail(format!(
                "{b:?} (owner d{o}): survivors {survivors:?} have it {got:?}, expected {ideal:?}"
            )));
        }
        for (j, &s) in survivors.iter().enumerate() {
            let was = before[s].as_ref().expect("queried").bufs[i];
            if o == s && was == BufferState::ReadOnlyOwned && got[j] == BufferState::ReadWrite {
                stats.voided += 1;
            }
            if o == k && Some(s) == ideal_owner {
                match got[j] {
                    BufferState::ReadWrite => {
                        freed.entry((s, b.pool)).or_default().insert(b.index as u32);
                    }
                    _ => stats.pinned += 1,
                }
            }
        }
        // A buffer the dead domain got over a channel its lender has closed
        // since comes back to that lender as well, but later: when an
        // allocation there finds the pool empty (SEMANTICS.md, "Failure is
        // death"). The query above does not see it; `AllocFree` below, which
        // drains the pool, does, unless copies of it are still out.
        let late_owner = match h.lender.get(&b) {
            Some(&(l, c)) if o == k && ideal_owner.is_none() && l != k && !open(c, l) && keeps(l, b.pool) => Some(l),
            _ => None,
        };
        if let Some(l) = late_owner {
            if remaining == 0 {
                freed.entry((l, b.pool)).or_default().insert(b.index as u32);
            } else {
                stats.pinned += 1;
            }
        }
        match (o == k, ideal_owner.or(late_owner), h.lender.contains_key(&b)) {
            (true, Some(_), _) if late_owner.is_some() => stats.reclaimed_after_close += 1,
            (true, Some(_), _) => stats.reclaimed += 1,
            (true, None, true) => stats.lost += 1,
            _ => {}
        }
    }

    // What came back read-write is on the free list of its new owner.
    for &s in &survivors {
        for (p, id) in h.pools.clone().into_iter().enumerate() {
            if !after[s].as_ref().expect("queried").pools.iter().any(|(q, _)| *q == id) {
                continue;
            }
            let stamp = h.stamp();
            let Reply::Allocated(got) = h.cl.call(s, &Cmd::AllocFree { pool: id, stamp }).map_err(fail)? else {
                return Err(fail(format!("d{s}: no allocation reply")));
            };
            if let Some((i, _)) = got.iter().find(|(_, ok)| !ok) {
                return Err(fail(format!("buffer {i} of pool {p} allocated at d{s} is not writable")));
            }
            let got: BTreeSet<u32> = got.into_iter().map(|(i, _)| i).collect();
            let want = freed.remove(&(s, p)).unwrap_or_default();
            if got != want {
                return Err(fail(format!("free buffers of pool {p} at d{s}: library {got:?}, expected {want:?}")));
            }
            stats.reallocated += got.len();
        }
    }
    Ok(())
}

/// A random sequence, everything delivered, then `kill -9` of one domain.
pub fn kill_case(
    cl: &mut Cluster,
    trusts: &[u8],
    steps: &[RawStep],
    victim: u8,
    stats: &mut KillStats,
) -> Result<(), String> {
    let mut run = Run::start(cl, false, trusts, &mut stats.run)?;
    for &raw in steps {
        let op = pick_op(&run.m, raw);
        run.step(op, &mut stats.run)?;
    }
    run.quiesce(&mut stats.run)?;
    // Mostly a domain that owns buffers some survivor lent it over a
    // channel still open: that is where the library has work to do.
    let m = &run.m;
    let owes: Vec<DomainId> = (0..DOMAINS)
        .filter(|&d| {
            m.all_buffers().into_iter().any(|b| {
                m.owner(b) == d && run.h.lender.get(&b).is_some_and(|&(l, c)| m.channel_state(c, l) != MChan::Closed)
            })
        })
        .collect();
    let victim = usize::from(victim);
    let k = if victim % 4 != 0 && !owes.is_empty() { owes[victim / 4 % owes.len()] } else { victim % DOMAINS };
    kill_and_check(&mut run, k, stats)
}
