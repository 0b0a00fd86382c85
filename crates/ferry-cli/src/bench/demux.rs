//! `ferry bench demux`: early demultiplexing (application device channels,
//! Druschel, Peterson and Davie, "Experiences with a High-Speed Network
//! Adaptor: A Software Perspective", SIGCOMM 1994) — N channels over one
//! TCP connection (`ferry::MuxSession`) against N channels over N TCP
//! connections (the one-channel TCP backend), loopback, in one process
//! (a client and an echo side, each one thread serving all of its channels
//! with a `Selector`).
//!
//! Two measurements per transport, alternately in rounds:
//!
//! * `throughput`: every channel moves `--size` buffers (`--inflight` in
//!   flight each) to the echo side, which passes them back: aggregate
//!   Gbit/s (one sample per round, the bytes returned over a fixed time).
//! * `priority rtt`: channel 0 does round trips of a 4 KiB buffer while the
//!   other N − 1 channels saturate the link as above: the round-trip times
//!   (µs). On the session, channel 0 has priority 7 both ways (the
//!   `mux-equal` variant: the same session with priority 0 for all).
//! * `idle rtt` (transports `mux-idle`, `net-idle`): the same round trips
//!   with the other channels open and silent — the latency a priority
//!   channel has to keep when bulk saturates the link.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{
    Allocator, BindParams, Buffer, Channel, ChannelSetup, Direction, Domain, Endpoint, Event, Meta, MuxSession,
    NetOptions, PoolConstraints, PoolPolicy, Role, Selector,
};
use serde_json::json;

use super::point::Head;
use super::{Backend, Ctx, Point};
use crate::stats::Summary;
use crate::CliError;

/// Size of the priority channel's buffers.
const PROBE_SIZE: usize = 4096;
/// How long each measurement runs (after its warm-up).
const MEASURE: Duration = Duration::from_millis(1500);
/// Warm-up before the figures count.
const WARMUP: Duration = Duration::from_millis(300);
/// Bound on any one wait.
const STEP: Duration = Duration::from_secs(10);
/// Queue depth of every channel.
const DEPTH: u32 = 64;

/// What the channels do during one measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Load {
    /// Every channel saturates (throughput).
    Bulk,
    /// Channel 0 does round trips while the others saturate.
    Probe,
    /// Channel 0 does round trips; the others are silent.
    Idle,
}

/// How the channels travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    /// One session; channel 0 at priority 7.
    Mux,
    /// One session, every channel at priority 0.
    MuxEqual,
    /// One TCP connection per channel.
    Net,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Mux => "mux",
            Transport::MuxEqual => "mux-equal",
            Transport::Net => "net",
        }
    }

    /// The transport's name on its idle round-trip row.
    fn idle_name(self) -> &'static str {
        match self {
            Transport::Mux => "mux-idle",
            Transport::MuxEqual => "mux-equal-idle",
            Transport::Net => "net-idle",
        }
    }
}

/// `ferry bench demux`.
pub fn run(ctx: &mut Ctx<'_>) -> Result<(), CliError> {
    let a = ctx.args;
    if a.backend.is_some_and(|b| b != Backend::Net) {
        return Err(CliError::Usage(
            "--backend: demux compares one TCP connection with many (net); leave --backend out".into(),
        ));
    }
    if a.compare || a.busy_poll || a.blocking || a.touch || a.no_batching || a.idle_us > 0 {
        return Err(CliError::Usage(
            "demux measures its own comparison; leave out --compare, --busy-poll, --blocking, --touch, --no-batching and --idle-us".into(),
        ));
    }
    let size = match a.sizes[..] {
        [] => 256 << 10,
        [s] => s,
        _ => return Err(CliError::Usage("--size: demux measures one size; give --size once".into())),
    };
    let n = a.channels.unwrap_or(16);
    if n < 2 {
        return Err(CliError::Usage("--channels: demux needs at least 2 channels (one priority, one bulk)".into()));
    }
    let window = a.inflight.unwrap_or(8);
    let runs = a.runs.unwrap_or(3);
    let kinds = [Transport::Mux, Transport::Net, Transport::MuxEqual];
    let mut gbit: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    let mut rtt: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    let mut loaded: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    let mut idle: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    for _round in 0..runs {
        for (k, &kind) in kinds.iter().enumerate() {
            if kind != Transport::MuxEqual {
                let (g, _) = measure(kind, n, size, window, Load::Bulk).map_err(CliError::Failed)?;
                gbit[k].push(g);
                let (_, samples) = measure(kind, n, size, window, Load::Idle).map_err(CliError::Failed)?;
                idle[k].extend(samples);
            }
            let (g, samples) = measure(kind, n, size, window, Load::Probe).map_err(CliError::Failed)?;
            loaded[k].push(g);
            rtt[k].extend(samples);
        }
    }
    for (k, &kind) in kinds.iter().enumerate() {
        let head_of = |backend, unit| Head {
            experiment: "demux",
            backend,
            size,
            trust: "full",
            mode: "selector",
            touch: false,
            runs,
            unit,
        };
        let head = |unit| head_of(kind.name(), unit);
        let idle_head = |unit| head_of(kind.idle_name(), unit);
        if let Some(s) = Summary::of(&gbit[k]) {
            let extra = json!({"variant": format!("throughput, {n} channels"), "channels": n, "inflight": window});
            ctx.emit(Point::new(head("Gbit/s"), s, Some(0), extra));
        }
        if let Some(s) = Summary::of(&rtt[k]) {
            let bulk = Summary::of(&loaded[k]).map_or(0.0, |s| s.median);
            let extra = json!({
                "variant": format!("priority rtt of {PROBE_SIZE} B, {} channels saturating", n - 1),
                "channels": n, "inflight": window, "bulk_gbit_s_median": crate::stats::round(bulk),
            });
            ctx.emit(Point::new(head("us"), s, Some(0), extra));
        }
        if let Some(s) = Summary::of(&idle[k]) {
            let extra = json!({
                "variant": format!("idle rtt of {PROBE_SIZE} B, {} channels open and silent", n - 1),
                "channels": n, "inflight": window,
            });
            ctx.emit(Point::new(idle_head("us"), s, Some(0), extra));
        }
    }
    Ok(())
}

/// The two sides' channels, connected, channel 0 first.
struct Rig {
    client: Vec<Channel>,
    echo: Vec<Channel>,
    /// Keeps the sessions alive.
    _sessions: Vec<MuxSession>,
}

fn connect(kind: Transport, n: usize) -> Result<Rig, String> {
    let e = |e: ferry::Error| e.to_string();
    let (dc, de) = (Domain::new("client"), Domain::new("echo"));
    let setup =
        ChannelSetup { direction: Direction::Tx, role: Role::Master, queue_depth: DEPTH, ..ChannelSetup::default() };
    let mut sessions = Vec::new();
    let (client_eps, echo_eps): (Vec<Endpoint>, Vec<Option<Endpoint>>) = match kind {
        Transport::Mux | Transport::MuxEqual => {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
            let addr = listener.local_addr().map_err(|e| e.to_string())?;
            let other = std::thread::spawn(move || MuxSession::connect(addr, NetOptions::default(), STEP));
            let ours = MuxSession::accept(&listener, NetOptions::default(), STEP).map_err(e)?;
            let theirs = other.join().map_err(|_| "session thread panicked")?.map_err(e)?;
            let prio = |i: usize| if i == 0 && kind == Transport::Mux { 7 } else { 0 };
            let c = (0..n).map(|i| ours.endpoint_with_priority(i as u32 + 1, prio(i))).collect();
            let s = (0..n).map(|i| Some(theirs.endpoint_with_priority(i as u32 + 1, prio(i)))).collect();
            sessions.push(ours);
            sessions.push(theirs);
            (c, s)
        }
        Transport::Net => {
            ((0..n).map(|_| Endpoint::tcp("127.0.0.1:0".parse().expect("address"))).collect(), vec![None; n])
        }
    };
    let mut client = Vec::with_capacity(n);
    let mut echo_eps = echo_eps;
    for (i, ep) in client_eps.iter().enumerate() {
        let ch = Channel::create(&dc, ep, setup).map_err(e)?;
        if echo_eps[i].is_none() {
            echo_eps[i] = Some(Endpoint::tcp(ch.listen_addr().ok_or("not listening")?));
        }
        client.push(ch);
    }
    let mut echo = Vec::with_capacity(n);
    for ep in echo_eps.iter().flatten() {
        let mut ch = Channel::bind(&de, ep, BindParams::default()).map_err(e)?;
        ch.set_pool_policy(PoolPolicy::AcceptAll);
        echo.push(ch);
    }
    for ch in client.iter_mut().chain(echo.iter_mut()) {
        ch.wait_connected(STEP).map_err(e)?;
    }
    Ok(Rig { client, echo, _sessions: sessions })
}

/// One measurement: (aggregate Gbit/s of the bulk channels, round-trip
/// times of channel 0 in µs unless `load` is [`Load::Bulk`], where channel 0
/// is bulk too).
/// Each side is one thread with a `Selector` over all of its channels, as
/// an event loop serving many channels would be.
fn measure(kind: Transport, n: usize, size: usize, window: usize, load: Load) -> Result<(f64, Vec<f64>), String> {
    let probe = load != Load::Bulk;
    let Rig { mut client, echo, _sessions } = connect(kind, n)?;
    let stop = Arc::new(AtomicBool::new(false));
    let echo = {
        let stop = stop.clone();
        std::thread::spawn(move || echo_loop(echo, &stop))
    };
    let result = (|| -> Result<(f64, Vec<f64>), String> {
        let allocs = client
            .iter_mut()
            .enumerate()
            .map(|(i, ch)| if probe && i == 0 { assign(ch, 2, PROBE_SIZE) } else { assign(ch, window, size) })
            .collect::<Result<Vec<_>, String>>()?;
        drive(client, &allocs, size, load)
    })();
    stop.store(true, Ordering::Relaxed);
    let _ = echo.join();
    result
}

/// A pool of `count` buffers of `size` on `ch`, assigned.
fn assign(ch: &mut Channel, count: usize, size: usize) -> Result<Allocator, String> {
    let alloc =
        Allocator::new(ch.domain(), count as u64, size, PoolConstraints::default()).map_err(|e| e.to_string())?;
    ch.assign_pool(alloc.pool()).map_err(|e| e.to_string())?;
    match ch.wait(Some(STEP)) {
        Ok(Event::PoolAssigned(_)) => Ok(alloc),
        ev => Err(format!("expected the pool assigned, got {ev:?}")),
    }
}

/// Keep every buffer of each bulk channel's pool in flight for the
/// warm-up and the measurement (none with [`Load::Idle`]); unless `load` is
/// [`Load::Bulk`], channel 0 does one round trip after another meanwhile.
/// The Gbit/s of bulk that came back after the warm-up, and the probe's
/// round-trip times (µs).
fn drive(chans: Vec<Channel>, allocs: &[Allocator], size: usize, load: Load) -> Result<(f64, Vec<f64>), String> {
    let probe = load != Load::Bulk;
    let mut sel = Selector::new().map_err(|e| e.to_string())?;
    let keys: Vec<usize> = chans.into_iter().map(|ch| sel.insert(ch)).collect();
    let t0 = Instant::now();
    let mut counted: Option<(Instant, u64)> = None;
    let mut back = 0u64;
    let mut samples = Vec::new();
    let mut probe_out: Option<Instant> = None;
    // Channels whose buffers came back (or whose queue was full): top up.
    let mut refill = vec![load != Load::Idle; keys.len()];
    while t0.elapsed() < WARMUP + MEASURE {
        if counted.is_none() && t0.elapsed() >= WARMUP {
            counted = Some((Instant::now(), back));
        }
        if probe && probe_out.is_none() {
            let buf = allocs[0].alloc().ok_or("the probe's pool is exhausted")?;
            let ch = sel.get_mut(keys[0]).expect("inserted");
            ch.move_buffer(buf, &[]).map_err(|r| r.error.to_string())?;
            // Out now, not with the next batch (the TCP backend batches).
            ch.flush().map_err(|e| e.to_string())?;
            probe_out = Some(Instant::now());
        }
        for (i, &k) in keys.iter().enumerate() {
            if !refill[i] || (probe && i == 0) {
                continue;
            }
            refill[i] = false;
            let ch = sel.get_mut(k).expect("inserted");
            while let Some(buf) = allocs[i].alloc() {
                match ch.move_buffer(buf, &[]) {
                    Ok(()) => {}
                    Err(r) if r.error == ferry::ErrorKind::QueueFull => {
                        refill[i] = true;
                        break;
                    }
                    Err(r) => return Err(r.error.to_string()),
                }
            }
            ch.flush().map_err(|e| e.to_string())?;
        }
        // The application serves its latency-sensitive channel first, on
        // every transport alike: what is left is the transport's own delay.
        let priority = if probe { sel.get_mut(keys[0]).expect("inserted").poll().map(|e| (keys[0], e)) } else { None };
        let Some((k, first)) = priority.or_else(|| sel.wait(Some(Duration::from_millis(10))).ok()) else { continue };
        let i = keys.iter().position(|&x| x == k).ok_or("an unknown key")?;
        // This channel's events until it has none (then the others').
        let mut ev = Some(first);
        while let Some(e) = ev {
            match e {
                Event::BufferPassed { .. } if probe && i == 0 => {
                    let t = probe_out.take().ok_or("a probe came back twice")?;
                    if t0.elapsed() > WARMUP {
                        samples.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                }
                Event::BufferPassed { .. } => {
                    back += 1;
                    refill[i] = true;
                }
                e => return Err(format!("a channel expected buffers back, got {e:?}")),
            }
            ev = sel.get_mut(k).expect("inserted").poll();
        }
    }
    let gbit = match counted {
        Some((t, b)) => (back - b) as f64 * size as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e9,
        None => 0.0,
    };
    let mut chans: Vec<Channel> = keys.iter().filter_map(|&k| sel.remove(k)).collect();
    close(&mut chans);
    Ok((gbit, samples))
}

/// Tear down every channel and wait (bounded) for the closes.
fn close(chans: &mut [Channel]) {
    for ch in chans.iter_mut() {
        let _ = ch.teardown();
    }
    let deadline = Instant::now() + STEP;
    for ch in chans.iter_mut() {
        while Instant::now() < deadline {
            match ch.wait(Some(Duration::from_millis(100))) {
                Ok(Event::Closed { .. } | Event::Error(_)) => break,
                _ if ch.state() == ferry::ChannelState::Closed => break,
                _ => {}
            }
        }
    }
}

/// Pass every buffer straight back until every channel closed (or `stop`).
fn echo_loop(chans: Vec<Channel>, stop: &AtomicBool) {
    let Ok(mut sel) = Selector::new() else { return };
    let keys: Vec<usize> = chans.into_iter().map(|ch| sel.insert(ch)).collect();
    // Channel 0 carries the latency probe: served first, as on the client.
    let first_key = keys.first().copied();
    let mut waiting: Vec<(usize, Buffer, Meta)> = Vec::new();
    while !sel.is_empty() && !stop.load(Ordering::Relaxed) {
        let mut still = Vec::new();
        let mut passed = Vec::new();
        // The probe's buffer goes back first, before bulk that waited for
        // room (as the probe's channel is served first below): on a
        // session a bulk pass ahead of it would put bulk ahead of it on
        // the shared connection, over 16 connections not.
        waiting.sort_by_key(|&(k, ..)| Some(k) != first_key);
        for (k, buf, meta) in waiting.drain(..) {
            let Some(ch) = sel.get_mut(k) else { continue };
            match ch.pass(buf, &meta) {
                Ok(()) => passed.push(k),
                Err(r) if r.error == ferry::ErrorKind::QueueFull => still.push((k, r.into_inner(), meta)),
                Err(_) => {}
            }
        }
        // Out now, not with the next batch (the TCP backend batches).
        passed.dedup();
        for k in passed {
            if let Some(ch) = sel.get_mut(k) {
                let _ = ch.flush();
            }
        }
        waiting = still;
        let wait = if waiting.is_empty() { Duration::from_millis(10) } else { Duration::ZERO };
        let priority = first_key.and_then(|k| sel.get_mut(k).and_then(Channel::poll).map(|e| (k, e)));
        let Some((k, first)) = priority.or_else(|| sel.wait(Some(wait)).ok()) else { continue };
        // This channel's events until it has none (then the others').
        let mut ev = Some(first);
        while let Some(e) = ev {
            match e {
                Event::MoveReceived { buffer, meta } => waiting.push((k, buffer, meta)),
                Event::Closed { .. } | Event::Error(_) => {
                    sel.remove(k);
                    break;
                }
                _ => {}
            }
            ev = sel.get_mut(k).and_then(Channel::poll);
        }
    }
}
