//! The [ETH-NET] experiments on Ferry's channels (§5.1.4 rtt, §5.1.3
//! throughput): a source and an echo domain that passes every moved buffer
//! straight back; and the driver that runs them — alone, or alternately
//! with the baselines of bench/peers (`--compare`).
//!
//! rtt `--blocking --wait MODE`: how the source sleeps between sending and
//! the buffer's return — `Channel::wait` (`channel`), the channel's fd in an
//! epoll set of our own as an application's event loop would hold it
//! (`epoll`: poll until nothing, arm, `epoll_wait`, poll; no spin), a
//! `Selector` (`selector`, spinning `ferry::DEFAULT_SPIN` before it sleeps,
//! as `Channel::wait` does) or `wait_any` (`wait-any`) holding the one
//! channel. Several modes are measured in turn, each a point of its own.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use ferry::{Allocator, Channel, ChannelSetup, Direction, Event, PoolConstraints, Role, Selector};
use rustix::event::epoll;
use serde_json::json;

use super::point::{Head, Point};
use super::progress::Progress;
use super::rig::{self, EchoRole, EchoSpec, Rig};
use super::{compare, peers, Backend, Ctx, Experiment, Wait};
use crate::setup::{describe, next_event, send_when_room};
use crate::stats::{round, Summary};
use crate::{pattern, CliError};

/// [ETH-NET] §5.1.3/§5.1.4: operations per run.
pub const MOVES_PER_RUN: usize = 250;
/// Buffers in the rtt pool (one is out at a time).
pub const RTT_POOL: usize = 16;

fn runs(ctx: &Ctx<'_>) -> usize {
    ctx.args.runs.unwrap_or(match ctx.args.experiment {
        Experiment::Rtt => 100,
        _ => 20,
    })
}

/// Run rtt or throughput on the chosen backend, or with `--compare` on it
/// and its baselines alternately.
pub fn run(ctx: &mut Ctx<'_>) -> Result<(), CliError> {
    let a = ctx.args;
    let sizes = if a.sizes.is_empty() { vec![4096] } else { a.sizes.clone() };
    let primary = a.backend();
    let runs = runs(ctx);
    let waits: Vec<Option<Wait>> =
        if a.waits.is_empty() { vec![None] } else { a.waits.iter().copied().map(Some).collect() };
    let nw = waits.len();
    if !a.compare {
        if !primary.is_ferry() {
            ctx.progress = Progress::new((runs * sizes.len()) as u64, a.json);
            // As given: the peer has its own default (the eventfd floor has no size at all).
            for p in baseline(ctx, primary, &a.sizes)? {
                ctx.emit(p);
            }
            return Ok(());
        }
        ctx.progress = Progress::new((runs * sizes.len() * nw) as u64, a.json);
    }
    let others = if a.compare { compare::baselines(a)? } else { Vec::new() };
    let rounds = if a.compare { a.rounds } else { 1 };
    if a.compare {
        let per_other = |b: &Backend| if b.is_ferry() { nw } else { 1 };
        let per_round = runs * sizes.len() * (nw + others.iter().map(per_other).sum::<usize>());
        ctx.progress = Progress::new((per_round * rounds) as u64, a.json);
    }
    let mut kept: Option<Rig> = None;
    for round in 0..rounds {
        for (i, &size) in sizes.iter().enumerate() {
            for &wait in &waits {
                let how = wait.map_or(String::new(), |w| format!(" --wait {}", w.name()));
                ctx.progress.say(format!("{} {} {size} B{how}", a.experiment.name(), primary.name()));
                let mut p = ferry_point(ctx, primary, size, wait, &mut kept, false)?;
                if a.compare {
                    p.set("round", json!(round + 1));
                }
                ctx.emit(p);
            }
            for &b in &others {
                // The eventfd floor has no payload: once per round.
                if b == Backend::Eventfd && i > 0 {
                    ctx.progress.inc(runs as u64);
                    continue;
                }
                ctx.progress.say(format!("{} {} {size} B", a.experiment.name(), b.name()));
                if b.is_ferry() {
                    // A session's baseline: a channel over a connection of its
                    // own, its echo a thread too, waiting as the session's does.
                    for &wait in &waits {
                        let mut p = ferry_point(ctx, b, size, wait, &mut None, true)?;
                        p.set("round", json!(round + 1));
                        ctx.emit(p);
                    }
                    continue;
                }
                let only = if b == Backend::Eventfd { Vec::new() } else { vec![size] };
                for mut p in baseline(ctx, b, &only)? {
                    p.set("round", json!(round + 1));
                    ctx.emit(p);
                }
            }
        }
    }
    if let Some(rig) = kept {
        rig.finish()?;
    }
    Ok(())
}

/// Payload copies in user space per message: none, but TLS encrypts into
/// and decrypts out of its records (not counted per message).
fn user_copies(backend: Backend) -> Option<u64> {
    (backend != Backend::NetTls).then_some(0)
}

/// A baseline's or peer's points: bench/peers, or rustls on a stream
/// (measured here).
fn baseline(ctx: &Ctx<'_>, backend: Backend, sizes: &[usize]) -> Result<Vec<Point>, CliError> {
    match backend {
        Backend::RustlsStream => super::tls_stream::measure(ctx, sizes),
        Backend::Iperf3 => super::iperf3::measure(ctx, sizes),
        _ => peers::measure(ctx, backend, sizes),
    }
}

/// One point on one of Ferry's backends; with `echo_thread`, the echo of
/// net is a thread of this process, as a session's is.
fn ferry_point(
    ctx: &Ctx<'_>,
    backend: Backend,
    size: usize,
    wait: Option<Wait>,
    kept: &mut Option<Rig>,
    echo_thread: bool,
) -> Result<Point, CliError> {
    let a = ctx.args;
    let count = match a.experiment {
        Experiment::Rtt => RTT_POOL,
        _ => a.inflight.unwrap_or(250),
    };
    let setup = ChannelSetup {
        direction: Direction::Tx,
        role: Role::Master,
        trust: a.trust().level(),
        meta_size: 16,
        queue_depth: (count * 2).next_power_of_two().clamp(64, 65536) as u32,
        ..ChannelSetup::default()
    };
    let spec = EchoSpec {
        role: EchoRole::Standard,
        busy: a.busy(),
        touch: a.touch,
        batch: !a.no_batching,
        unfilled: a.one_way,
        one_domain: a.one_domain,
    };
    let mut rig = match kept.take() {
        Some(r) => r,
        None if echo_thread && backend == Backend::Net => rig::connect_net_thread(setup, spec)?,
        None => rig::connect(backend, setup, spec, a.peer.as_deref(), &a.tls)?,
    };
    let alloc = Allocator::new(&rig.domain, count as u64, size, PoolConstraints::default())?;
    rig.assign(&alloc)?;
    // Pre-fault every buffer in both views: first touch of a page costs
    // microseconds, and we measure steady-state transfer, not page faults.
    let mut bufs: Vec<_> = std::iter::from_fn(|| alloc.alloc()).collect();
    for b in &mut bufs {
        b.as_mut_slice()?.fill(1);
    }
    drop(bufs);
    let runs = runs(ctx);
    let (point, moved) = match a.experiment {
        Experiment::Rtt => rtt(ctx, &mut rig, &alloc, backend, size, runs, wait)?,
        _ => throughput(ctx, &mut rig, &alloc, backend, size, runs)?,
    };
    let mut point = point;
    if echo_thread || matches!(backend, Backend::Mux | Backend::NetTls) {
        point.set("echo", json!("thread"));
    }
    if a.peer.is_some() {
        *kept = Some(rig);
    } else {
        rig::check_echoed(rig.finish()?, moved)?;
        if a.touch {
            // The echo checked every byte of every payload against the
            // pattern (it fails the run on the first wrong one), and it saw
            // every move.
            point.set("verified", json!(moved));
        }
    }
    Ok(point)
}

fn head<'a>(ctx: &'a Ctx<'_>, backend: Backend, size: usize, runs: usize, unit: &'a str) -> Head<'a> {
    let a = ctx.args;
    Head {
        experiment: a.experiment.name(),
        backend: backend.name(),
        size,
        trust: a.trust().name(),
        mode: a.mode(),
        touch: a.touch,
        runs,
        unit,
    }
}

/// How the source waits in rtt: the channel itself, or a waiter that holds it.
enum Waiter {
    /// `Channel::wait` (or the spin of `--busy-poll`).
    Channel,
    /// An epoll set of our own holding the channel's fd.
    Epoll(OwnedFd),
    /// A selector that holds the channel (under this key) for the measurement.
    Selector(Selector, usize),
    /// `wait_any` over the one channel.
    WaitAny,
}

impl Waiter {
    /// Set up `wait` for `source`; a selector takes the channel, which
    /// [`Waiter::finish`] gives back.
    fn new(wait: Option<Wait>, source: &mut Channel, domain: &ferry::Domain) -> Result<Waiter, CliError> {
        Ok(match wait {
            None | Some(Wait::Channel) => Waiter::Channel,
            Some(Wait::Any) => Waiter::WaitAny,
            Some(Wait::Epoll) => {
                let ep = epoll::create(epoll::CreateFlags::CLOEXEC)
                    .map_err(|e| CliError::Failed(format!("epoll_create: {e}")))?;
                epoll::add(&ep, &*source, epoll::EventData::new_u64(0), epoll::EventFlags::IN)
                    .map_err(|e| CliError::Failed(format!("epoll_ctl: {e}")))?;
                Waiter::Epoll(ep)
            }
            Some(Wait::Selector) => {
                let mut sel = Selector::new()?;
                // Spin as Channel::wait does before sleeping (a Selector's own default is not to).
                sel.set_spin(ferry::DEFAULT_SPIN);
                // The selector owns what it waits on: the source goes in for
                // the measurement and an unconnected channel stands in for it.
                let stand_in = Channel::create(domain, &ferry::Endpoint::local(), ChannelSetup::default())?;
                let key = sel.insert(std::mem::replace(source, stand_in));
                Waiter::Selector(sel, key)
            }
        })
    }

    /// The source, wherever it is.
    fn source<'a>(&'a mut self, rig: &'a mut Rig) -> &'a mut Channel {
        match self {
            Waiter::Selector(sel, key) => sel.get_mut(*key).expect("the source stays in the selector"),
            _ => &mut rig.source,
        }
    }

    /// The next event of the source.
    fn next(&mut self, rig: &mut Rig, busy: bool) -> Option<Event> {
        match self {
            Waiter::Channel => next_event(&mut rig.source, busy),
            Waiter::WaitAny => ferry::wait_any(&mut [&mut rig.source], None).map(|(_, ev)| ev).ok(),
            Waiter::Selector(sel, _) => sel.wait(None).map(|(_, ev)| ev).ok(),
            Waiter::Epoll(ep) => {
                let ch = &mut rig.source;
                let mut events = Vec::with_capacity(1);
                loop {
                    if let Some(ev) = ch.poll() {
                        return Some(ev);
                    }
                    if ch.state() == ferry::ChannelState::Closed {
                        return None;
                    }
                    if ch.arm() {
                        events.clear();
                        // A second at most: the buffer is back long before.
                        let t = rustix::event::Timespec { tv_sec: 1, tv_nsec: 0 };
                        match epoll::wait(&*ep, rustix::buffer::spare_capacity(&mut events), Some(&t)) {
                            Ok(_) | Err(rustix::io::Errno::INTR) => {}
                            Err(e) => {
                                eprintln!("ferry bench: epoll_wait: {e}");
                                return None;
                            }
                        }
                    }
                }
            }
        }
    }

    /// Give the source back to the rig.
    fn finish(self, rig: &mut Rig) {
        if let Waiter::Selector(mut sel, key) = self {
            if let Some(ch) = sel.remove(key) {
                rig.source = ch;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn rtt(
    ctx: &Ctx<'_>,
    rig: &mut Rig,
    alloc: &Allocator,
    backend: Backend,
    size: usize,
    runs: usize,
    wait: Option<Wait>,
) -> Result<(Point, u64), CliError> {
    let mut waiter = Waiter::new(wait, &mut rig.source, &rig.domain)?;
    let r = rtt_with(ctx, rig, &mut waiter, alloc, backend, size, runs);
    waiter.finish(rig);
    let (mut point, moved) = r?;
    if let Some(w) = wait {
        point.set("variant", json!(w.name()));
        point.set("wait", json!(w.name()));
    }
    Ok((point, moved))
}

fn rtt_with(
    ctx: &Ctx<'_>,
    rig: &mut Rig,
    waiter: &mut Waiter,
    alloc: &Allocator,
    backend: Backend,
    size: usize,
    runs: usize,
) -> Result<(Point, u64), CliError> {
    let a = ctx.args;
    let busy = a.busy();
    let idle = Duration::from_micros(a.idle_us);
    let mut samples = Vec::with_capacity(runs * MOVES_PER_RUN);
    // One warm-up run, not recorded.
    for run in 0..=runs {
        for i in 0..MOVES_PER_RUN {
            let mut buf = alloc.alloc().ok_or_else(|| CliError::Failed("pool exhausted".into()))?;
            if a.touch {
                pattern::fill(buf.as_mut_slice()?, i as u64);
            }
            if !idle.is_zero() {
                std::thread::sleep(idle);
            }
            let t0 = Instant::now();
            let source = waiter.source(rig);
            send_when_room(buf, busy, |b| source.move_buffer(b, &(i as u64).to_le_bytes()))?;
            match waiter.next(rig, busy) {
                Some(Event::BufferPassed { buffer, .. }) => drop(buffer),
                ev => {
                    return Err(CliError::Failed(format!(
                        "rtt: the source expected the buffer back but got {}; run the benchmark again",
                        describe(&ev)
                    )))
                }
            }
            let dt = t0.elapsed();
            if run > 0 {
                samples.push(dt.as_secs_f64() * 1e6);
            }
        }
        if run > 0 {
            ctx.progress.inc(1);
        }
    }
    let summary = Summary::of(&samples).ok_or_else(|| CliError::Failed("no samples".into()))?;
    let extra = if a.idle_us > 0 { json!({ "idle_us": a.idle_us }) } else { json!({}) };
    let point = Point::new(head(ctx, backend, size, runs, "us"), summary, user_copies(backend), extra);
    Ok((point, ((runs + 1) * MOVES_PER_RUN) as u64))
}

fn throughput(
    ctx: &Ctx<'_>,
    rig: &mut Rig,
    alloc: &Allocator,
    backend: Backend,
    size: usize,
    runs: usize,
) -> Result<(Point, u64), CliError> {
    let a = ctx.args;
    let busy = a.busy();
    let window = a.inflight.unwrap_or(250);
    // As bench/peers: 50 000 moves per run, but where every byte is handled (--touch, or
    // TLS, which encrypts and decrypts each) above 64 KiB 2 GiB per run (a 1 MiB run would
    // otherwise move 50 GB).
    let default_moves = super::default_moves(size, a.touch || backend == Backend::NetTls);
    let moves = a.moves.unwrap_or(default_moves).max(window);
    let mut rates = Vec::with_capacity(runs);
    // Time of the recorded runs (one way: the baseline runs about as long).
    let mut measured = 0.0;
    for run in 0..=runs {
        let (mut sent, mut done, mut inflight) = (0usize, 0usize, 0usize);
        let t0 = Instant::now();
        while done < moves {
            while inflight < window && sent < moves {
                let Some(mut buf) = alloc.alloc() else { break };
                if a.touch {
                    pattern::fill(buf.as_mut_slice()?, sent as u64);
                }
                send_when_room(buf, busy, |b| rig.source.move_buffer(b, &(sent as u64).to_le_bytes()))?;
                sent += 1;
                inflight += 1;
            }
            // Take every completion that is there (batching), at least one.
            let mut got = 0;
            loop {
                let ev = if got == 0 { next_event(&mut rig.source, busy) } else { rig.source.poll() };
                match ev {
                    Some(Event::BufferPassed { buffer, .. }) => {
                        drop(buffer);
                        done += 1;
                        inflight -= 1;
                        got += 1;
                    }
                    None if got > 0 => break,
                    ev => {
                        return Err(CliError::Failed(format!(
                            "throughput: the source expected buffers back but got {}; run the benchmark again",
                            describe(&ev)
                        )))
                    }
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        if run > 0 {
            measured += secs;
            rates.push(if a.one_way { (moves * size) as f64 / secs / 1e9 } else { moves as f64 / secs / 1e6 });
        }
        if run > 0 {
            ctx.progress.inc(1);
        }
    }
    let summary = Summary::of(&rates).ok_or_else(|| CliError::Failed("no samples".into()))?;
    let (unit, gbit) = if a.one_way {
        ("GB/s", round(summary.median * 8.0))
    } else {
        ("Mops/s", round(summary.median * 1e6 * size as f64 * 8.0 / 1e9))
    };
    let mut extra = json!({ "inflight": window, "moves_per_run": moves, "gbit_s_median": gbit });
    if a.one_way {
        extra["variant"] = json!("one-way");
        extra["seconds"] = json!(round(measured));
    }
    let point = Point::new(head(ctx, backend, size, runs, unit), summary, user_copies(backend), extra);
    Ok((point, ((runs + 1) * moves) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::parse_bench_args;

    /// TLS throughput runs beside the rustls-stream baseline, every
    /// buffer echoed (the echo's count is checked at the teardown), and
    /// the ratio of the two is printed.
    #[test]
    fn net_tls_throughput_runs_beside_a_rustls_stream() {
        let args = parse_bench_args(
            "throughput --backend net-tls --size 65536 --runs 1 --moves 300 --inflight 32 --compare --rounds 1",
        )
        .unwrap();
        let mut ctx = Ctx { args: &args, progress: Progress::hidden(), points: Vec::new() };
        run(&mut ctx).unwrap();
        let got: Vec<(&str, &str, Option<f64>)> =
            ctx.points.iter().map(|p| (p.backend(), p.str("variant"), p.num("samples"))).collect();
        assert_eq!(
            got,
            [("net-tls", "", Some(1.0)), ("rustls-stream", "", Some(1.0)), ("rustls-stream", "hot", Some(1.0))]
        );
    }

    /// A session's channel runs beside a channel over a connection of its
    /// own (net, its echo a thread too), each wait mode against the same
    /// mode, every buffer echoed (the echo's count is checked at the
    /// teardown).
    #[test]
    fn mux_rtt_runs_beside_net() {
        let args = parse_bench_args(
            "rtt --backend mux --blocking --runs 1 --wait channel,selector --compare --against net --rounds 1",
        )
        .unwrap();
        let mut ctx = Ctx { args: &args, progress: Progress::hidden(), points: Vec::new() };
        run(&mut ctx).unwrap();
        let got: Vec<(&str, &str, &str, Option<f64>)> =
            ctx.points.iter().map(|p| (p.backend(), p.str("wait"), p.str("echo"), p.num("samples"))).collect();
        let n = Some(MOVES_PER_RUN as f64);
        assert_eq!(
            got,
            [
                ("mux", "channel", "thread", n),
                ("mux", "selector", "thread", n),
                ("net", "channel", "thread", n),
                ("net", "selector", "thread", n)
            ]
        );
    }

    /// Each wait mode measures its own point, and the source comes back from
    /// the selector (the echo's count is checked at the teardown).
    #[test]
    fn rtt_measures_each_wait_mode() {
        let args = parse_bench_args("rtt --blocking --runs 1 --wait channel,epoll,selector,wait-any").unwrap();
        let mut ctx = Ctx { args: &args, progress: Progress::hidden(), points: Vec::new() };
        run(&mut ctx).unwrap();
        let got: Vec<(&str, Option<f64>)> = ctx.points.iter().map(|p| (p.str("wait"), p.num("samples"))).collect();
        let n = Some(MOVES_PER_RUN as f64);
        assert_eq!(got, [("channel", n), ("epoll", n), ("selector", n), ("wait-any", n)]);
    }
}
