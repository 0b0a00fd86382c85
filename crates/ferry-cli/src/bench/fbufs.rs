//! `fbufs-table` and `fbufs`: \[FBUFS\] Table 1 and its
//! throughput-vs-size figure, on Ferry.
//!
//! `fbufs` runs the same transfers on the data-path layer: the cached rows
//! take their buffers from a [`DataPath`] whose pool was made and assigned
//! before the runs, and the secured rows are volatile transfers (trust as
//! given, FULL by default) whose receiver calls `secure()` before it reads
//! (the meta data's ninth byte asks for it). What follows describes
//! `fbufs-table`.
//!
//! One transfer is one domain crossing, as in the paper's test: the
//! originator allocates a buffer, writes one word in every page, moves it
//! to the receiver, which reads one word in every page and gives it back
//! (pass: ownership returns to the originator's free list — the fbufs
//! "deallocate"). Four variants:
//!
//! * **cached**: the pool was assigned (mapped in both domains) before the
//!   run; every transfer reuses it (LIFO: the same hot buffer).
//! * **uncached**: every transfer makes a fresh pool (memfd, mapping),
//!   assigns it (the receiver maps it), transfers, and removes it again;
//!   first touches of fresh pages are the kernel's zero-fill — the paper's
//!   "clearing" cost. (The library keeps a removed pool mapped in both
//!   domains' pool lists until the domains end, so no munmap is timed.)
//! * **volatile**: trust FULL, no protection changes.
//! * **secured**: trust HALF (or NONE with `--trust none`, when a backend
//!   has it): the sender's view is protected while the buffer is away.
//!
//! Each size gets R runs of [`TRANSFERS_PER_RUN`] transfers; every transfer
//! is a sample of the per-size row (µs per transfer). The table row is the
//! incremental per-page cost: per run, the least-squares slope of the run's
//! median transfer time against the number of pages; its median and
//! percentiles over the runs. Asymptotic throughput = page size / slope.
//! The copy row (`--compare`, or `--backend uds-copy`) is `ferry-peers
//! uds-copy fbufs`: the same transfer written into a Unix socket, read out
//! whole, one word per page read, an 8-byte reply.

use std::time::Instant;

use ferry::{
    Allocator, Channel, ChannelSetup, DataPath, Direction, Domain, Endpoint, Event, PathConfig, PathQuota,
    PoolConstraints, Role,
};
use serde_json::{json, Value};

use super::point::{Head, Point};
use super::progress::Progress;
use super::rig::{self, EchoRole, EchoSpec};
use super::{compare, peers, trust_error, Backend, Ctx, Experiment, Trust};
use crate::setup::{describe, describe_event, next_event, send_when_room};
use crate::stats::{fit_line, round, Summary};
use crate::CliError;

/// Transfers per run, per size.
pub const TRANSFERS_PER_RUN: usize = 25;
const PAGE: usize = 4096;

/// The four rows of \[FBUFS\] Table 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    CachedVolatile,
    CachedSecured,
    UncachedVolatile,
    UncachedSecured,
}

impl Variant {
    const ALL: [Variant; 4] =
        [Variant::CachedVolatile, Variant::CachedSecured, Variant::UncachedVolatile, Variant::UncachedSecured];
    fn name(self) -> &'static str {
        match self {
            Variant::CachedVolatile => "cached-volatile",
            Variant::CachedSecured => "cached-secured",
            Variant::UncachedVolatile => "uncached-volatile",
            Variant::UncachedSecured => "uncached-secured",
        }
    }
    fn cached(self) -> bool {
        matches!(self, Variant::CachedVolatile | Variant::CachedSecured)
    }
    fn secured(self) -> bool {
        matches!(self, Variant::CachedSecured | Variant::UncachedSecured)
    }
}

fn default_sizes() -> Vec<usize> {
    (0..=8).map(|i| PAGE << i).collect()
}

/// Refuse a trust level the backend lacks before measuring anything.
fn probe_trust(backend: Backend, trust: Trust) -> Result<(), CliError> {
    let setup = ChannelSetup { trust: trust.level(), ..ChannelSetup::default() };
    let ep = match backend {
        Backend::Local => Endpoint::local(),
        Backend::Shm => Endpoint::shm_abstract(&format!("ferry-bench-probe-{}", std::process::id())),
        _ => return Ok(()),
    };
    Channel::create(&Domain::new("probe"), &ep, setup).map(drop).map_err(trust_error)
}

/// `ferry bench fbufs-table`.
pub fn run(ctx: &mut Ctx<'_>) -> Result<(), CliError> {
    let a = ctx.args;
    if a.touch {
        return Err(CliError::Usage(format!(
            "--touch does not apply to {} (every transfer writes and reads one word per page, as in the fbufs paper); leave it out",
            a.experiment.name()
        )));
    }
    let layer = a.experiment == Experiment::Fbufs;
    let secured = a.trust();
    if secured == Trust::Full && !layer {
        return Err(CliError::Usage(
            "--trust full: in fbufs-table --trust sets the secured rows, which protect; give half or none".into(),
        ));
    }
    let backend = a.backend();
    let sizes = if a.sizes.is_empty() { default_sizes() } else { a.sizes.clone() };
    let runs = a.runs.unwrap_or(10);
    let ferry = backend.is_ferry();
    if ferry {
        probe_trust(backend, secured)?;
    } else if !matches!(backend, Backend::UdsCopy | Backend::TcpCopy | Backend::PipeCopy) {
        return Err(CliError::Usage(format!(
            "--backend {}: {} does not run on it; give local or shm (Ferry), or a copy baseline (uds-copy, tcp-copy, pipe-copy)",
            backend.name(),
            a.experiment.name()
        )));
    }
    let mut copies = if a.compare { compare::baselines(a)? } else { Vec::new() };
    if !ferry {
        copies = vec![backend];
    }
    let rounds = if a.compare { a.rounds } else { 1 };
    let per_round = runs * sizes.len() * (if ferry { 4 } else { 0 } + copies.len());
    ctx.progress = Progress::new((per_round * rounds) as u64, a.json);
    for round_no in 1..=rounds {
        let tag = |p: &mut Point| {
            if a.compare {
                p.set("round", json!(round_no));
            }
        };
        if ferry {
            for v in Variant::ALL {
                // fbufs: the receiver secures (trust as given, FULL by
                // default); fbufs-table: the channel's trust protects.
                let trust = if v.secured() || layer { secured } else { Trust::Full };
                let mut per_run: Vec<(usize, Vec<f64>)> = Vec::new();
                for &size in &sizes {
                    ctx.progress.say(format!("fbufs {} {} {size} B", backend.name(), v.name()));
                    let (mut p, medians) = transfer_point(ctx, backend, v, trust, size, runs)?;
                    tag(&mut p);
                    ctx.emit(p);
                    per_run.push((size, medians));
                }
                let mut p =
                    slope_point(a.experiment.name(), backend.name(), v.name(), trust.name(), a.mode(), runs, &per_run)?;
                tag(&mut p);
                ctx.emit(p);
            }
        }
        for &b in &copies {
            ctx.progress.say(format!("fbufs {} copy", b.name()));
            let mut args: Vec<String> = Vec::new();
            for s in &sizes {
                args.extend(["--size".into(), s.to_string()]);
            }
            args.extend(["--runs".into(), runs.to_string()]);
            let pts = peers::invoke(b, "fbufs", &args)?;
            ctx.progress.inc((runs * sizes.len()) as u64);
            let mut per_run = Vec::new();
            for mut p in pts {
                let size = p.size();
                let medians: Vec<f64> = match p.0.remove("run_medians") {
                    Some(Value::Array(v)) => v.iter().filter_map(Value::as_f64).collect(),
                    _ => vec![p.quantiles()[0]],
                };
                p.set("experiment", json!(a.experiment.name()));
                p.set("variant", json!("copy"));
                p.set("pages", json!(size.div_ceil(PAGE)));
                p.set("gbit_s_median", json!(gbit(size, p.quantiles()[0])));
                tag(&mut p);
                ctx.emit(p);
                per_run.push((size, medians));
            }
            let mut p = slope_point(a.experiment.name(), b.name(), "copy", "n/a", "blocking", runs, &per_run)?;
            tag(&mut p);
            ctx.emit(p);
        }
    }
    Ok(())
}

/// Payload Gbit/s of one transfer of `size` bytes in `us` µs.
fn gbit(size: usize, us: f64) -> f64 {
    if us > 0.0 {
        round(size as f64 * 8.0 / us / 1e3)
    } else {
        0.0
    }
}

/// Write the transfer's sequence number into the first word of every page.
fn write_pages(buf: &mut [u8], seq: u64) {
    for page in buf.chunks_mut(PAGE) {
        page[..8].copy_from_slice(&seq.to_le_bytes());
    }
}

/// Read the first word of every page; whether all hold `seq`.
fn read_pages(buf: &[u8], seq: u64) -> bool {
    let want = seq.to_le_bytes();
    buf.chunks(PAGE).fold(true, |ok, page| ok & (page[..8] == want))
}

/// R runs of transfers of one size in one variant: the per-size point and
/// the median of each run.
fn transfer_point(
    ctx: &Ctx<'_>,
    backend: Backend,
    v: Variant,
    trust: Trust,
    size: usize,
    runs: usize,
) -> Result<(Point, Vec<f64>), CliError> {
    let a = ctx.args;
    let busy = a.busy();
    let setup = ChannelSetup {
        direction: Direction::Tx,
        role: Role::Master,
        trust: trust.level(),
        meta_size: 16,
        queue_depth: 64,
        ..ChannelSetup::default()
    };
    let mut rig = rig::connect(
        backend,
        setup,
        EchoSpec { role: EchoRole::Fbufs, busy, touch: false, batch: false, unfilled: false, one_domain: false },
        None,
        &crate::tls_args::TlsFlags::default(),
    )?;
    let layer = a.experiment == Experiment::Fbufs;
    let cached = if v.cached() && !layer {
        let alloc = Allocator::new(&rig.domain, 4, size, PoolConstraints::default())?;
        rig.assign(&alloc)?;
        let mut bufs: Vec<_> = std::iter::from_fn(|| alloc.alloc()).collect();
        for b in &mut bufs {
            b.as_mut_slice()?.fill(1);
        }
        drop(bufs);
        Some(alloc)
    } else {
        None
    };
    let secure = layer && v.secured();
    let name = a.experiment.name();
    let domain = rig.domain.clone();
    let mut seq = 0u64;
    let (samples, medians) = if v.cached() && layer {
        // fbufs: the cached rows take their buffers from a data path over
        // the rig's channel, its one pool made (and mapped at both ends)
        // before the runs.
        let quota = PathQuota { max_pools: 1, max_bytes: 4 * size as u64 };
        let mut p = DataPath::new(&domain, vec![&mut rig.source], PathConfig::new(size, 4, quota))?;
        p.grow()?;
        let mut bufs: Vec<_> = std::iter::from_fn(|| p.alloc().ok()).collect();
        for b in &mut bufs {
            b.as_mut_slice()?.fill(1);
        }
        drop(bufs);
        timed_runs(ctx, runs, &mut seq, &mut |seq| {
            let buf = p.alloc()?;
            round_trip(p.channel_mut(0), buf, seq, secure, busy, name)
        })?
    } else if let Some(alloc) = &cached {
        timed_runs(ctx, runs, &mut seq, &mut |seq| {
            let buf = alloc.alloc().ok_or_else(|| CliError::Failed(format!("{name}: pool exhausted")))?;
            round_trip(&mut rig.source, buf, seq, secure, busy, name)
        })?
    } else {
        timed_runs(ctx, runs, &mut seq, &mut |seq| {
            let fresh = Allocator::new(&domain, 1, size, PoolConstraints::default())?;
            rig.assign(&fresh)?;
            let buf = fresh.alloc().ok_or_else(|| CliError::Failed(format!("{name}: pool exhausted")))?;
            round_trip(&mut rig.source, buf, seq, secure, busy, name)?;
            rig.remove(&fresh)
        })?
    };
    rig::check_echoed(rig.finish()?, seq)?;
    let s = Summary::of(&samples).ok_or_else(|| CliError::Failed("no samples".into()))?;
    let head = Head {
        experiment: a.experiment.name(),
        backend: backend.name(),
        size,
        trust: trust.name(),
        mode: a.mode(),
        touch: false,
        runs,
        unit: "us",
    };
    let extra = json!({
        "variant": v.name(), "pages": size.div_ceil(PAGE), "transfers_per_run": TRANSFERS_PER_RUN,
        "gbit_s_median": gbit(size, s.median),
    });
    Ok((Point::new(head, s, Some(0), extra), medians))
}

/// R runs (after one warm-up run) of [`TRANSFERS_PER_RUN`] timed calls of
/// `step` with the next sequence number: every sample, and each run's
/// median.
fn timed_runs(
    ctx: &Ctx<'_>,
    runs: usize,
    seq: &mut u64,
    step: &mut dyn FnMut(u64) -> Result<(), CliError>,
) -> Result<(Vec<f64>, Vec<f64>), CliError> {
    let mut samples = Vec::with_capacity(runs * TRANSFERS_PER_RUN);
    let mut medians = Vec::with_capacity(runs);
    for run in 0..=runs {
        let mut times = Vec::with_capacity(TRANSFERS_PER_RUN);
        for _ in 0..TRANSFERS_PER_RUN {
            *seq += 1;
            let t0 = Instant::now();
            step(*seq)?;
            times.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        if run > 0 {
            medians.push(Summary::of(&times).expect("transfers").median);
            samples.extend(times);
            ctx.progress.inc(1);
        }
    }
    Ok((samples, medians))
}

/// One transfer: write one word per page, move the buffer (meta: the
/// sequence number, then 1 if the receiver is to secure it first), take it
/// back.
fn round_trip(
    source: &mut Channel,
    mut buf: ferry::Buffer,
    seq: u64,
    secure: bool,
    busy: bool,
    name: &str,
) -> Result<(), CliError> {
    let mut meta = [0u8; 9];
    meta[..8].copy_from_slice(&seq.to_le_bytes());
    meta[8] = u8::from(secure);
    write_pages(buf.as_mut_slice()?, seq);
    source.move_buffer(buf, &meta)?;
    match next_event(source, busy) {
        Some(Event::BufferPassed { buffer, .. }) => {
            drop(buffer);
            Ok(())
        }
        ev => Err(CliError::Failed(format!(
            "{name}: the originator expected the buffer back but got {}; run the benchmark again",
            describe(&ev)
        ))),
    }
}

/// The table row: per-page cost (slope per run) and asymptotic throughput.
fn slope_point(
    experiment: &'static str,
    backend: &str,
    variant: &str,
    trust: &str,
    mode: &str,
    runs: usize,
    per_size: &[(usize, Vec<f64>)],
) -> Result<Point, CliError> {
    let n = per_size.iter().map(|(_, m)| m.len()).min().unwrap_or(0);
    let mut slopes = Vec::with_capacity(n);
    let mut intercepts = Vec::with_capacity(n);
    for r in 0..n {
        let pts: Vec<(f64, f64)> = per_size.iter().map(|(s, m)| (s.div_ceil(PAGE) as f64, m[r])).collect();
        if let Some((a, b)) = fit_line(&pts) {
            intercepts.push(a);
            slopes.push(b);
        }
    }
    let s = Summary::of(&slopes).ok_or_else(|| {
        CliError::Usage("fbufs-table: the per-page cost needs two different sizes; give --size at least twice".into())
    })?;
    let intercept = Summary::of(&intercepts).map_or(0.0, |i| i.median);
    let asymptotic = if s.median > 0.0 { json!(gbit(PAGE, s.median)) } else { Value::Null };
    let head = Head { experiment, backend, size: 0, trust, mode, touch: false, runs, unit: "us/page" };
    let sizes: Vec<usize> = per_size.iter().map(|(s, _)| *s).collect();
    let mut extra = json!({
        "variant": variant, "sizes": sizes, "intercept_us": round(intercept),
        "asymptotic_gbit_s": asymptotic,
    });
    if backend.ends_with("-copy") {
        extra["copies_kernel"] = json!(2);
    }
    Ok(Point::new(head, s, Some(0), extra))
}

/// The receiving domain of an fbufs transfer: accept pools, read the first
/// word of every page (checking the sender's sequence number), pass the
/// buffer back, take pool removals; until the channel closes. The number of
/// buffers passed back.
pub fn serve(ch: &mut Channel, busy: bool) -> Result<u64, String> {
    let mut n = 0u64;
    loop {
        match next_event(ch, busy) {
            Some(Event::Bound | Event::PoolRemoved(_)) => {}
            Some(Event::PoolAssignRequest(req)) => ch.respond_pool(req.pool, true).map_err(|e| e.to_string())?,
            Some(Event::MoveReceived { buffer, meta }) => {
                let seq = crate::pattern::seq_of(&meta);
                let buffer = if meta.get(8) == Some(&1) {
                    // fbufs secured rows: secure, then read the secured bytes.
                    let secured = buffer.secure().map_err(|e| e.to_string())?;
                    if !seq.is_some_and(|s| read_pages(&secured, s)) {
                        return Err(format!(
                            "fbufs echo: secured buffer {} has wrong page words",
                            secured.handle().id().index
                        ));
                    }
                    secured.into_inner()
                } else if !seq.is_some_and(|s| read_pages(&buffer, s)) {
                    return Err(format!("fbufs echo: buffer {} arrived with wrong page words", buffer.id().index));
                } else {
                    buffer
                };
                send_when_room(buffer, true, |b| ch.pass(b, &meta)).map_err(|e| e.to_string())?;
                n += 1;
            }
            Some(Event::Closed { .. }) | None => return Ok(n),
            Some(Event::Error(e)) => return Err(e.to_string()),
            Some(other) => {
                return Err(format!("the fbufs receiver got {}, which it does not handle", describe_event(&other)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_words() {
        let mut b = vec![0u8; 3 * PAGE];
        write_pages(&mut b, 42);
        assert!(read_pages(&b, 42) && !read_pages(&b, 41));
        b[2 * PAGE] ^= 1;
        assert!(!read_pages(&b, 42));
        assert_eq!(gbit(4096, 1.0), 32.768);
        assert_eq!(default_sizes().first(), Some(&4096));
        assert_eq!(default_sizes().last(), Some(&(1 << 20)));
    }
}
