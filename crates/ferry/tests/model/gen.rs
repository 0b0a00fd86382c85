//! Random operation sequences for model-based tests: a raw random step is
//! interpreted against the current model state so that most operations are
//! plausible (buffers the domain holds, pools it knows, pending requests)
//! and some are arbitrary. Shared by the model's own property test and the
//! harnesses that hold each backend to the model.

use super::reference::*;

/// Largest meta-data length of generated channels.
pub const META: usize = 8;

/// Raw random input of one step, interpreted against the current state.
pub type RawStep = (u8, u16, u16, u16, u16);

/// Number of domains in the generated systems.
pub const DOMAINS: usize = 4;

/// Trust levels a run may give its channels, drawn uniformly from this list
/// (repeat an entry to weight it). The model takes all; a backend's harness
/// lists the ones it supports.
pub static ALL_TRUSTS: [Trust; 8] =
    [Trust::None, Trust::Half, Trust::Full, Trust::Full, Trust::Full, Trust::Full, Trust::Full, Trust::Full];

thread_local! {
    static TRUSTS: std::cell::Cell<&'static [Trust]> = const { std::cell::Cell::new(&ALL_TRUSTS) };
}

thread_local! {
    static AGGREGATES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Let `pick_op` draw [`Op::SendAggregate`] (per thread; off by default,
/// for harnesses that do not run aggregates).
pub fn use_aggregates(on: bool) {
    AGGREGATES.with(|a| a.set(on));
}

/// Restrict the trust levels that `setup` and `pick_op` draw (per thread).
pub fn use_trusts(trusts: &'static [Trust]) {
    TRUSTS.with(|t| t.set(trusts));
}

pub fn trust_of(x: u8) -> Trust {
    let t = TRUSTS.with(|t| t.get());
    t[usize::from(x) % t.len()]
}

/// The pools `setup` creates: (creating domain, buffer count).
pub const POOLS: [(DomainId, usize); 3] = [(0, 3), (1, 2), (3, 2)];
/// The channels `setup` connects: (source, sink).
pub const LINKS: [(DomainId, DomainId); 6] = [(0, 1), (1, 2), (2, 1), (1, 0), (3, 0), (0, 3)];

/// Three pools and six channels: the chain 0→1→2, the cycle 1→2→1, and
/// channels back to 0 and to/from 3.
pub fn setup(trusts: &[u8]) -> Model {
    setup_links(&LINKS, trusts)
}

/// Channels for runs that mix backends: from domain 0 to domain 2 directly and
/// over 1, from 1 to 3 directly and over 2, back from 3 to 0 and from 2 to
/// 1, so that a pool reaches a domain along several paths.
pub const MIXED_LINKS: [(DomainId, DomainId); 7] = [(0, 1), (0, 2), (1, 2), (2, 3), (1, 3), (3, 0), (2, 1)];

/// The pools of [`POOLS`] and the channels `links`, with the trust levels
/// `trusts[i]` picks (see [`trust_of`]).
pub fn setup_links(links: &[(DomainId, DomainId)], trusts: &[u8]) -> Model {
    let mut m = Model::new(DOMAINS, META);
    for &(domain, count) in &POOLS {
        m.apply(&Op::CreatePool { domain, count }).unwrap();
    }
    for (i, &(source, sink)) in links.iter().enumerate() {
        let trust = trust_of(trusts[i]);
        m.apply(&Op::Connect { source, sink, trust }).unwrap();
    }
    m
}

pub fn choose<T: Copy>(v: &[T], x: usize) -> Option<T> {
    if v.is_empty() {
        None
    } else {
        Some(v[x % v.len()])
    }
}

pub fn connected(m: &Model, chan: ChanId, domain: DomainId) -> bool {
    m.channel_state(chan, domain) == ChannelState::Connected
}

/// `d` can read `b`: delivered owner or holder.
pub fn readable(m: &Model, b: BufId, d: DomainId) -> bool {
    m.buffer_state(b, d) != BufferState::Invalid
}

/// An arbitrary operation with ids slightly out of range.
pub fn garbage(m: &Model, kind: usize, a: usize, b: usize, c: usize) -> Op {
    let domain = a % (DOMAINS + 1);
    let chan = b % (m.num_channels() + 1);
    let pool = c % (m.num_pools() + 1);
    let buf_ = BufId { pool, index: (c / 7) % 4 };
    let other = BufId { pool: (a / 5) % (m.num_pools() + 1), index: (b / 7) % 4 };
    let meta_len = (a / 3) % (META + 2);
    match kind % 13 {
        0 => Op::CreatePool { domain, count: c % 3 },
        1 => Op::Connect {
            source: domain,
            sink: b % (DOMAINS + 1),
            // Now and then the invalid UNINITIALIZED; otherwise a level the
            // backend under test supports.
            trust: if c % 4 == 0 { Trust::Uninitialized } else { trust_of(c as u8) },
        },
        2 => Op::AssignPool { domain, chan, pool },
        3 => Op::RespondAssign { domain, chan, pool, accept: a % 2 == 0 },
        4 => Op::RemovePool { domain, chan, pool },
        5 => Op::Move { domain, chan, buf: buf_, meta_len },
        6 => Op::Pass { domain, chan, buf: buf_, meta_len },
        7 => Op::Copy { domain, chan, buf: buf_, meta_len },
        8 => Op::Release { domain, chan, buf: buf_ },
        9 => Op::FullCopy { domain, chan, src: other, dst: buf_, meta_len },
        10 => Op::FullCopy { domain, chan, src: buf_, dst: buf_, meta_len },
        11 if a % 4 == 0 => Op::Teardown { domain, chan },
        _ => Op::Deliver { chan, queue: if a % 2 == 0 { Queue::Data } else { Queue::Control } },
    }
}

/// Interpret one raw step: most of the time a plausible operation (picked
/// among buffers the domain holds, pools it knows, requests it has...),
/// otherwise an arbitrary one.
pub fn pick_op(m: &Model, raw: RawStep) -> Op {
    let kind = usize::from(raw.0) % 100;
    let (a, b, c) = (usize::from(raw.1), usize::from(raw.2), usize::from(raw.3));
    let plausible = raw.4 % 8 != 0;
    let meta_len = if raw.4 % 50 == 1 { META + 1 } else { a % (META + 1) };
    let chans: Vec<ChanId> = (0..m.num_channels()).collect();
    let bufs = m.all_buffers();
    let fallback = garbage(m, b / 3, a, b, c);
    let mut queues = Vec::new();
    for &ch in &chans {
        for q in [Queue::Data, Queue::Control] {
            if m.pending(ch, q) > 0 {
                queues.push((ch, q));
            }
        }
    }
    let deliver_op = choose(&queues, a).map(|(chan, queue)| Op::Deliver { chan, queue });
    let candidate: Option<Op> = match kind {
        0..=29 => deliver_op,
        30..=46 => {
            // Move (source) or pass (sink) of a READ_WRITE buffer.
            let as_pass = kind >= 40;
            let mut cands = Vec::new();
            for &ch in &chans {
                let (source, sink) = m.endpoints(ch);
                let d = if as_pass { sink } else { source };
                for &bf in &bufs {
                    // Now and then a READ_ONLY_OWNED one (CopiesOutstanding).
                    let state = m.buffer_state(bf, d);
                    let usable = state == BufferState::ReadWrite || (b % 4 == 0 && state == BufferState::ReadOnlyOwned);
                    if connected(m, ch, d) && usable && m.pool_assigned(bf.pool, ch, d) {
                        cands.push((d, ch, bf));
                    }
                }
            }
            choose(&cands, a).map(|(domain, chan, buf)| {
                if as_pass {
                    Op::Pass { domain, chan, buf, meta_len }
                } else {
                    Op::Move { domain, chan, buf, meta_len }
                }
            })
        }
        47..=58 => {
            let mut cands = Vec::new();
            for &ch in &chans {
                let d = m.endpoints(ch).0;
                for &bf in &bufs {
                    if connected(m, ch, d) && readable(m, bf, d) && m.pool_assigned(bf.pool, ch, d) {
                        cands.push((d, ch, bf));
                    }
                }
            }
            // Half of the time, prefer forwarding a received copy.
            let forwards: Vec<_> = cands.iter().copied().filter(|&(d, _, bf)| m.owner(bf) != d).collect();
            if b % 2 == 0 && !forwards.is_empty() {
                cands = forwards;
            }
            choose(&cands, a).map(|(domain, chan, buf)| Op::Copy { domain, chan, buf, meta_len })
        }
        59..=68 => {
            // Mostly copies actually held; sometimes any buffer the sink
            // can read (e.g. its own, or held over another channel).
            let any_readable = b % 4 == 0;
            let mut cands = Vec::new();
            for &ch in &chans {
                let sink = m.endpoints(ch).1;
                for &bf in &bufs {
                    if m.held_count(bf, ch) > 0
                        || (any_readable && readable(m, bf, sink) && m.pool_assigned(bf.pool, ch, sink))
                    {
                        cands.push((sink, ch, bf));
                    }
                }
            }
            choose(&cands, a).map(|(domain, chan, buf)| Op::Release { domain, chan, buf })
        }
        69..=71 => {
            let mut cands = Vec::new();
            for &ch in &chans {
                let d = m.endpoints(ch).0;
                for &dst in &bufs {
                    if connected(m, ch, d)
                        && m.buffer_state(dst, d) == BufferState::ReadWrite
                        && m.pool_assigned(dst.pool, ch, d)
                    {
                        for &src in &bufs {
                            if src != dst && readable(m, src, d) {
                                cands.push((d, ch, src, dst));
                            }
                        }
                    }
                }
            }
            choose(&cands, a).map(|(domain, chan, src, dst)| Op::FullCopy { domain, chan, src, dst, meta_len })
        }
        72..=78 => {
            let mut cands = Vec::new();
            for &ch in &chans {
                let (source, sink) = m.endpoints(ch);
                for d in [source, sink] {
                    for pool in 0..m.num_pools() {
                        if connected(m, ch, d) && m.knows_pool(d, pool) && !m.pool_assigned(pool, ch, d) {
                            cands.push((d, ch, pool));
                        }
                    }
                }
            }
            choose(&cands, a).map(|(domain, chan, pool)| Op::AssignPool { domain, chan, pool })
        }
        79..=87 => {
            let mut cands = Vec::new();
            for &ch in &chans {
                let (source, sink) = m.endpoints(ch);
                for d in [source, sink] {
                    for pool in m.pending_requests(ch, d) {
                        cands.push((d, ch, pool));
                    }
                }
            }
            choose(&cands, a).map(|(domain, chan, pool)| Op::RespondAssign { domain, chan, pool, accept: b % 5 != 0 })
        }
        88..=90 => {
            let mut cands = Vec::new();
            for &ch in &chans {
                let (source, sink) = m.endpoints(ch);
                for d in [source, sink] {
                    for pool in 0..m.num_pools() {
                        if m.pool_assigned(pool, ch, d) {
                            cands.push((d, ch, pool));
                        }
                    }
                }
            }
            choose(&cands, a).map(|(domain, chan, pool)| Op::RemovePool { domain, chan, pool })
        }
        // Teardown at half the rate of the other rare operations.
        91 if b % 2 == 0 => choose(&chans, a).map(|chan| {
            let (source, sink) = m.endpoints(chan);
            Op::Teardown { domain: if b % 4 == 0 { source } else { sink }, chan }
        }),
        92 => {
            let source = a % DOMAINS;
            let sink = (source + 1 + b % (DOMAINS - 1)) % DOMAINS;
            Some(Op::Connect { source, sink, trust: trust_of(raw.3 as u8) })
        }
        93 => Some(Op::CreatePool { domain: a % DOMAINS, count: 1 + b % 3 }),
        94..=98 if AGGREGATES.with(|x| x.get()) => pick_aggregate(m, &chans, &bufs, (a, b, c), meta_len),
        _ => None,
    };
    // Without a plausible operation of the kind drawn, make progress.
    match (plausible, candidate, deliver_op) {
        (true, Some(op), _) => op,
        (true, None, Some(op)) if kind < 94 => op,
        _ => fallback,
    }
}

/// An aggregate from a source end: up to [`AGG_MAX`] distinct buffers the
/// domain can read, mostly of pools assigned to the channel, each kept by
/// the sender now and then (a copy instead of a move).
fn pick_aggregate(
    m: &Model,
    chans: &[ChanId],
    bufs: &[BufId],
    (a, b, c): (usize, usize, usize),
    meta_len: usize,
) -> Option<Op> {
    let open: Vec<ChanId> = chans.iter().copied().filter(|&ch| connected(m, ch, m.endpoints(ch).0)).collect();
    let chan = choose(&open, a)?;
    let d = m.endpoints(chan).0;
    let any_pool = c % 8 == 0;
    let cands: Vec<BufId> = bufs
        .iter()
        .copied()
        .filter(|&bf| readable(m, bf, d) && (any_pool || m.pool_assigned(bf.pool, chan, d)))
        .collect();
    let n = (1 + c % AGG_MAX).min(cands.len());
    let mut members: AggMembers = [None; AGG_MAX];
    for (i, slot) in members.iter_mut().enumerate().take(n) {
        let buf = cands[(a / 3 + i * (1 + b % 5)) % cands.len()];
        *slot = Some((buf, (b >> i) % 4 == 0));
    }
    Some(Op::SendAggregate { domain: d, chan, members, meta_len })
}

/// One step of a run that also writes buffers: an operation of the model,
/// or a write of the pattern of `seed` into `buf` by `domain` (through its
/// owned handle: [`Model::write`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// A model operation ([`pick_op`]).
    Op(Op),
    /// A write ([`Model::write`]).
    Write {
        /// The writing domain.
        domain: DomainId,
        /// The buffer.
        buf: BufId,
        /// The seed of the pattern written.
        seed: u64,
    },
}

/// Interpret one raw step for a run that writes: about one step in eight
/// is a write by the owner of a buffer (mostly READ_WRITE, now and then
/// READ_ONLY_OWNED, which is refused); the others are [`pick_op`]'s.
pub fn pick_step(m: &Model, raw: RawStep) -> Step {
    if raw.0 < 224 {
        return Step::Op(pick_op(m, raw));
    }
    let (a, b) = (usize::from(raw.1), usize::from(raw.2));
    let mut cands = Vec::new();
    for buf in m.all_buffers() {
        for domain in 0..m.domains {
            let state = m.buffer_state(buf, domain);
            if state == BufferState::ReadWrite || (b % 4 == 0 && state == BufferState::ReadOnlyOwned) {
                cands.push((domain, buf));
            }
        }
    }
    // A seed no buffer was created with, different for most raw steps.
    let seed = 1 << 63 | (raw.1 as u64) << 40 | (raw.2 as u64) << 24 | (raw.3 as u64) << 8 | u64::from(raw.0);
    match choose(&cands, a) {
        Some((domain, buf)) => Step::Write { domain, buf, seed },
        None => Step::Op(pick_op(m, (raw.0 % 30, raw.1, raw.2, raw.3, raw.4))),
    }
}
