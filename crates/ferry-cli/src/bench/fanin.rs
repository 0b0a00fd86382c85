//! `fanin`: one server thread waiting on `--channels` channels at once (a
//! `ferry::Selector`, or `ferry::wait_any`), each channel from a client
//! thread of its own (local backend); the server passes every buffer it is
//! moved straight back. Two measurements, each against what the same work
//! costs without the fan-in:
//!
//! * **one client active** — the round trip of [`super::channel`]'s rtt
//!   (250 sequential moves per run, `--idle-us` of pause before each) from
//!   one client while every other channel stays idle, against one channel
//!   whose server end waits with `Channel::wait`.
//! * **every client busy** — each client keeps `--inflight` moves in flight
//!   (16 by default) and polls for their return; the sample is the
//!   aggregate rate of a run (every client moves [`MOVES_PER_CLIENT`]
//!   buffers), against as many independent pairs, each with an echo
//!   thread of its own that busy-polls its channel.
//!
//! The fan-in server takes the channel that woke it and polls it until it
//! has nothing more (as an event loop does) before it waits again.
//!
//! `--backend shm`: the clients are processes (`ferry bench-child
//! fanin-client`) bound to shared-memory channels the server created; the
//! round trips only (a busy client process per channel would measure the
//! scheduler more than the server).
//!
//! Clients run on CPU 0, the server (or the pairs' echo threads) on CPU 1:
//! both sides of each comparison use the same cores. Clients and busy
//! echoes poll and, when there is nothing, yield the core (with 64 threads
//! on one core, spinning in place would only burn the others' turns).

use std::sync::{Arc, Barrier};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry::{Allocator, BindParams, Channel, ChannelSetup, Direction, Domain, Event, PoolConstraints, Role, Selector};
use serde_json::json;

use super::compare::median;
use super::point::{Head, Point};
use super::progress::Progress;
use super::{Backend, Ctx, Wait};
use crate::setup::{assign, connect_local, describe_event, describe_wait, send_when_room};
use crate::stats::{round, Summary};
use crate::{pin, CliError};

/// Moves in flight per client when every client is busy (`--inflight`).
pub const WINDOW: usize = 16;
/// Moves per client per run when every client is busy.
pub const MOVES_PER_CLIENT: usize = 1000;
/// Round trips per run with one client active (as rtt).
const ROUND_TRIPS: usize = super::channel::MOVES_PER_RUN;
/// How long any one step may take before the run is declared stuck.
const STEP: Duration = Duration::from_secs(10);

/// Who serves the channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Server {
    /// One thread, one channel, `Channel::wait`.
    One,
    /// One busy-polling echo thread per channel.
    Pairs,
    /// One thread, every channel in a `Selector`.
    Selector,
    /// One thread, `wait_any` over every channel.
    WaitAny,
}

impl Server {
    fn of(w: Wait) -> Server {
        match w {
            Wait::Any => Server::WaitAny,
            _ => Server::Selector,
        }
    }

    fn variant(self, n: usize) -> String {
        match self {
            Server::One => "1 channel, Channel::wait".into(),
            Server::Pairs => format!("{n} pairs, busy-poll"),
            Server::Selector => format!("{n} channels, selector"),
            Server::WaitAny => format!("{n} channels, wait-any"),
        }
    }

    fn mode(self) -> &'static str {
        if self == Server::Pairs {
            "busy-poll"
        } else {
            "blocking"
        }
    }
}

/// `ferry bench fanin`.
pub fn run(ctx: &mut Ctx<'_>) -> Result<(), CliError> {
    let a = ctx.args;
    let shm = match a.backend() {
        Backend::Local => false,
        Backend::Shm => true,
        b => {
            return Err(CliError::Usage(format!(
                "--backend {}: fanin's clients are threads (local) or processes (shm); give local or shm",
                b.name()
            )))
        }
    };
    if a.compare || a.busy_poll || a.blocking || a.touch || a.no_batching {
        return Err(CliError::Usage(
            "fanin measures its own baselines, blocking server against busy pairs; leave out --compare, --busy-poll, --blocking, --touch and --no-batching".into(),
        ));
    }
    let size = match a.sizes[..] {
        [] => 4096,
        [s] => s,
        _ => return Err(CliError::Usage("--size: fanin measures one size; give --size once".into())),
    };
    let n = a.channels.unwrap_or(64);
    let window = a.inflight.unwrap_or(WINDOW);
    let runs = a.runs.unwrap_or(20);
    let waits = if a.waits.is_empty() { vec![Wait::Selector, Wait::Any] } else { a.waits.clone() };
    let servers: Vec<Server> = waits.iter().map(|&w| Server::of(w)).collect();
    let parts = if shm { 1 } else { 2 };
    ctx.progress = Progress::new((a.rounds * parts * (1 + servers.len()) * runs) as u64, a.json);
    for round_no in 1..=a.rounds {
        for &s in std::iter::once(&Server::One).chain(&servers) {
            let k = if s == Server::One { 1 } else { n };
            ctx.progress.say(format!("fanin round trip, {}", s.variant(k)));
            let mut p = if shm { one_active_shm(ctx, s, k, size, runs)? } else { one_active(ctx, s, k, size, runs)? };
            p.set("round", json!(round_no));
            ctx.emit(p);
        }
        if shm {
            continue;
        }
        for &s in std::iter::once(&Server::Pairs).chain(&servers) {
            ctx.progress.say(format!("fanin throughput, {}", s.variant(n)));
            let mut p = all_busy(ctx, s, n, size, window, runs)?;
            p.set("round", json!(round_no));
            ctx.emit(p);
        }
    }
    Ok(())
}

/// Client ends, each with the allocator of its pool.
type Clients = Vec<(Channel, Allocator)>;

/// `n` connected channels: (client ends, server ends).
fn connect(n: usize, size: usize, buffers: usize) -> Result<(Clients, Vec<Channel>), CliError> {
    let server = Domain::new("server");
    let setup = ChannelSetup {
        direction: Direction::Tx,
        role: Role::Master,
        meta_size: 16,
        queue_depth: (buffers * 2).next_power_of_two().max(64) as u32,
        ..ChannelSetup::default()
    };
    let (mut clients, mut servers) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        let domain = Domain::new(&format!("client{i}"));
        let (mut c, mut s) = connect_local(&domain, &server, setup, BindParams::default())?;
        let alloc = Allocator::new(&domain, buffers as u64, size, PoolConstraints::default())?;
        assign(&mut c, &mut s, alloc.pool())?;
        // Pre-fault every buffer: first touches cost microseconds.
        let mut bufs: Vec<_> = std::iter::from_fn(|| alloc.alloc()).collect();
        for b in &mut bufs {
            b.as_mut_slice()?.fill(1);
        }
        drop(bufs);
        clients.push((c, alloc));
        servers.push(s);
    }
    Ok((clients, servers))
}

/// What a server does with one event: `Ok(true)` when the channel is done.
fn serve_event(ch: &mut Channel, ev: Event, echoed: &mut u64) -> Result<bool, String> {
    match ev {
        Event::MoveReceived { buffer, meta } => {
            send_when_room(buffer, false, |b| ch.pass(b, &meta)).map_err(|e| e.to_string())?;
            *echoed += 1;
            Ok(false)
        }
        Event::Closed { .. } => Ok(true),
        Event::Error(e) if e == ferry::ErrorKind::PeerGone => Ok(true),
        // Clients that are processes bind to the server's channels and offer their pool.
        Event::BindRequest { .. } => {
            ch.set_pool_policy(ferry::PoolPolicy::AcceptAll);
            Ok(false)
        }
        Event::PoolAssignRequest(_) => Ok(false),
        Event::Error(e) => Err(format!("fanin server: {e}")),
        other => Err(format!("the fanin server got {}, which it does not handle", describe_event(&other))),
    }
}

/// Serve `ev`, then whatever else the channel has (poll until nothing), as
/// an event loop does with the channel that woke it: `Ok(true)` when the
/// channel is done.
fn serve_drained(ch: &mut Channel, ev: Event, echoed: &mut u64) -> Result<bool, String> {
    let mut done = serve_event(ch, ev, echoed)?;
    while !done {
        let Some(ev) = ch.poll() else { break };
        done = serve_event(ch, ev, echoed)?;
    }
    Ok(done)
}

/// Start the server side: one thread (or one per channel for pairs) that
/// echoes until every channel is closed; each returns how many it echoed.
fn start_server(kind: Server, chans: Vec<Channel>) -> Result<Vec<JoinHandle<Result<u64, String>>>, CliError> {
    let spawn = |name: String, f: Box<dyn FnOnce() -> Result<u64, String> + Send>| {
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                pin::to_cpu(1);
                f()
            })
            .map_err(|e| CliError::Failed(format!("cannot start a server thread: {e}")))
    };
    let stuck = || format!("the fanin server had no event for {} s", STEP.as_secs());
    match kind {
        Server::Pairs => chans
            .into_iter()
            .enumerate()
            .map(|(i, mut ch)| {
                spawn(
                    format!("echo{i}"),
                    Box::new(move || {
                        let mut echoed = 0;
                        let mut last = Instant::now();
                        loop {
                            match ch.poll() {
                                Some(ev) => {
                                    last = Instant::now();
                                    if serve_event(&mut ch, ev, &mut echoed)? {
                                        return Ok(echoed);
                                    }
                                }
                                None if ch.state() == ferry::ChannelState::Closed => return Ok(echoed),
                                None if last.elapsed() > STEP => return Err(stuck()),
                                None => std::thread::yield_now(),
                            }
                        }
                    }),
                )
            })
            .collect(),
        Server::One => {
            let mut chans = chans;
            let mut ch = chans.pop().ok_or_else(|| CliError::Failed("no channel to serve".into()))?;
            Ok(vec![spawn(
                "server".into(),
                Box::new(move || {
                    let mut echoed = 0;
                    loop {
                        match ch.wait(Some(STEP)) {
                            Ok(ev) => {
                                if serve_event(&mut ch, ev, &mut echoed)? {
                                    return Ok(echoed);
                                }
                            }
                            Err(_) if ch.state() == ferry::ChannelState::Closed => return Ok(echoed),
                            Err(_) => return Err(stuck()),
                        }
                    }
                }),
            )?])
        }
        Server::Selector => {
            Ok(vec![spawn(
                "server".into(),
                Box::new(move || {
                    // Made in the thread that waits on it: a Selector is not Send.
                    let mut sel = Selector::new().map_err(|e| format!("selector: {e}"))?;
                    // Spin as Channel::wait and wait_any do before sleeping (a
                    // Selector's own default is not to spin).
                    sel.set_spin(ferry::DEFAULT_SPIN);
                    for ch in chans {
                        sel.insert(ch);
                    }
                    let mut echoed = 0;
                    while !sel.is_empty() {
                        let (key, ev) = sel.wait(Some(STEP)).map_err(|_| stuck())?;
                        let ch = sel.get_mut(key).ok_or("the selector returned a key it does not hold")?;
                        if serve_drained(ch, ev, &mut echoed)? {
                            drop(sel.remove(key));
                        }
                    }
                    Ok(echoed)
                }),
            )?])
        }
        Server::WaitAny => {
            let mut chans = chans;
            Ok(vec![spawn(
                "server".into(),
                Box::new(move || {
                    let mut echoed = 0;
                    let mut open = chans.len();
                    while open > 0 {
                        let (i, ev) = {
                            let mut refs: Vec<&mut Channel> = chans.iter_mut().collect();
                            ferry::wait_any(&mut refs, Some(STEP)).map_err(|_| stuck())?
                        };
                        if serve_drained(&mut chans[i], ev, &mut echoed)? {
                            open -= 1;
                        }
                    }
                    Ok(echoed)
                }),
            )?])
        }
    }
}

/// Collect the server threads; the buffers they echoed, in all.
fn join_server(handles: Vec<JoinHandle<Result<u64, String>>>) -> Result<u64, CliError> {
    let mut total = 0;
    for h in handles {
        total += h
            .join()
            .map_err(|_| CliError::Failed("a fanin server thread panicked".into()))?
            .map_err(CliError::Failed)?;
    }
    Ok(total)
}

/// Close a client's channel and wait until the server saw it.
fn close(ch: &mut Channel) -> Result<(), String> {
    ch.teardown().map_err(|e| format!("teardown: {e}"))?;
    let t0 = Instant::now();
    while t0.elapsed() < STEP {
        match ch.wait(Some(Duration::from_millis(100))) {
            Ok(Event::Closed { .. }) => return Ok(()),
            Err(_) if ch.state() == ferry::ChannelState::Closed => return Ok(()),
            Ok(Event::BufferPassed { .. }) | Err(_) => {}
            Ok(other) => return Err(format!("at the teardown the client got {}", describe_event(&other))),
        }
    }
    Err(format!("the server did not close within {} s", STEP.as_secs()))
}

fn head(ctx: &Ctx<'_>, kind: Server, size: usize, runs: usize, unit: &'static str) -> Head<'static> {
    Head {
        experiment: "fanin",
        backend: "local",
        size,
        trust: ctx.args.trust().name(),
        mode: kind.mode(),
        touch: false,
        runs,
        unit,
    }
}

/// Round trips from client 0 while the other `n - 1` channels stay idle.
fn one_active(ctx: &Ctx<'_>, kind: Server, n: usize, size: usize, runs: usize) -> Result<Point, CliError> {
    let idle = Duration::from_micros(ctx.args.idle_us);
    let (mut clients, servers) = connect(n, size, 4)?;
    let handles = start_server(kind, servers)?;
    let (mut active, alloc) = clients.remove(0);
    let client = std::thread::Builder::new()
        .name("client".into())
        .spawn(move || -> Result<Vec<f64>, String> {
            pin::to_cpu(0);
            let samples = round_trips(&mut active, &alloc, runs, idle)?;
            close(&mut active)?;
            Ok(samples)
        })
        .map_err(|e| CliError::Failed(format!("cannot start the client thread: {e}")))?;
    let samples = client.join().map_err(|_| CliError::Failed("the client thread panicked".into()))?;
    ctx.progress.inc(runs as u64);
    // The idle clients close too (also when the active one failed: the server ends).
    let closed: Result<(), String> = clients.iter_mut().try_for_each(|(c, _)| close(c));
    let echoed = join_server(handles)?;
    let samples = samples.map_err(CliError::Failed)?;
    closed.map_err(CliError::Failed)?;
    let expected = ((runs + 1) * ROUND_TRIPS) as u64;
    if echoed != expected {
        return Err(CliError::Failed(format!("the fanin server echoed {echoed} buffers, expected {expected}")));
    }
    let s = Summary::of(&samples).ok_or_else(|| CliError::Failed("no samples".into()))?;
    let extra = json!({ "variant": kind.variant(n), "channels": n, "idle_us": ctx.args.idle_us, "active": 1 });
    Ok(Point::new(head(ctx, kind, size, runs, "us"), s, Some(0), extra))
}

/// `runs` runs (and one warm-up) of [`ROUND_TRIPS`] round trips, `idle`
/// before each: the samples in µs.
fn round_trips(ch: &mut Channel, alloc: &Allocator, runs: usize, idle: Duration) -> Result<Vec<f64>, String> {
    let mut samples = Vec::with_capacity(runs * ROUND_TRIPS);
    for run in 0..=runs {
        for i in 0..ROUND_TRIPS {
            let buf = alloc.alloc().ok_or("pool exhausted")?;
            if !idle.is_zero() {
                std::thread::sleep(idle);
            }
            let t0 = Instant::now();
            ch.move_buffer(buf, &(i as u64).to_le_bytes()).map_err(|r| r.error.to_string())?;
            match ch.wait(Some(STEP)) {
                Ok(Event::BufferPassed { buffer, .. }) => drop(buffer),
                ev => return Err(format!("the client expected its buffer back but got {}", describe_wait(&ev))),
            }
            if run > 0 {
                samples.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    Ok(samples)
}

/// Round trips as [`one_active`], the clients being processes over shared
/// memory (`ferry bench-child fanin-client`): the server creates every
/// channel; client 0 measures and prints its samples, the others bind,
/// offer their pool and stay idle until their stdin closes.
fn one_active_shm(ctx: &Ctx<'_>, kind: Server, n: usize, size: usize, runs: usize) -> Result<Point, CliError> {
    use std::io::Read;
    use std::sync::atomic::{AtomicU32, Ordering};
    static K: AtomicU32 = AtomicU32::new(0);
    let stem = format!("ferry-fanin-{}-{}", std::process::id(), K.fetch_add(1, Ordering::Relaxed));
    let server = Domain::new("server");
    let setup = ChannelSetup {
        direction: Direction::Rx,
        role: Role::Slave,
        meta_size: 16,
        queue_depth: 64,
        ..ChannelSetup::default()
    };
    let exe = std::env::current_exe().map_err(|e| CliError::Failed(format!("cannot find own executable: {e}")))?;
    let mut chans = Vec::with_capacity(n);
    let mut kids = Kids(Vec::with_capacity(n));
    for i in 0..n {
        let name = format!("{stem}-{i}");
        chans.push(Channel::create(&server, &ferry::Endpoint::shm_abstract(&name), setup)?);
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(["bench-child", "fanin-client", "--endpoint", &format!("shm@{name}"), "--size", &size.to_string()]);
        cmd.args(["--cpu", "0", "--runs", &runs.to_string(), "--idle-us", &ctx.args.idle_us.to_string()]);
        if i == 0 {
            cmd.arg("--active");
        }
        cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
        kids.0.push(cmd.spawn().map_err(|e| CliError::Failed(format!("cannot start a fanin client: {e}")))?);
    }
    let handles = start_server(kind, chans)?;
    // The active client's report: its samples, on one line (it ends by itself: every wait is bounded).
    let mut text = String::new();
    if let Some(out) = kids.0[0].stdout.as_mut() {
        let _ = out.read_to_string(&mut text);
    }
    ctx.progress.inc(runs as u64);
    // The idle clients close when their stdin does.
    for k in &mut kids.0 {
        drop(k.stdin.take());
    }
    let status = kids.wait_all();
    let echoed = join_server(handles)?;
    status?;
    let samples: Vec<f64> = match text.trim().strip_prefix("samples ") {
        Some(list) => list.split(' ').filter_map(|x| x.parse().ok()).collect(),
        None => return Err(CliError::Failed(format!("the active fanin client said {:?}", text.trim()))),
    };
    let expected = ((runs + 1) * ROUND_TRIPS) as u64;
    if echoed != expected || samples.len() != runs * ROUND_TRIPS {
        return Err(CliError::Failed(format!(
            "the fanin server echoed {echoed} buffers, expected {expected}; the client measured {} round trips",
            samples.len()
        )));
    }
    let s = Summary::of(&samples).ok_or_else(|| CliError::Failed("no samples".into()))?;
    let extra = json!({ "variant": kind.variant(n), "channels": n, "idle_us": ctx.args.idle_us, "active": 1, "clients": "processes" });
    let mut head = head(ctx, kind, size, runs, "us");
    head.backend = "shm";
    Ok(Point::new(head, s, Some(0), extra))
}

/// Client processes, killed if still running when dropped.
struct Kids(Vec<std::process::Child>);

impl Kids {
    /// Wait for every one (bounded), the first failure if any.
    fn wait_all(&mut self) -> Result<(), CliError> {
        let t0 = Instant::now();
        let mut first = Ok(());
        for (i, k) in self.0.iter_mut().enumerate() {
            let st = loop {
                match k.try_wait() {
                    Ok(Some(st)) => break Some(st),
                    Ok(None) if t0.elapsed() < STEP => std::thread::sleep(Duration::from_millis(1)),
                    _ => break None,
                }
            };
            match st {
                Some(st) if st.success() => {}
                Some(st) => first = first.and(Err(CliError::Failed(format!("fanin client {i} failed ({st})")))),
                None => first = first.and(Err(CliError::Failed(format!("fanin client {i} did not exit")))),
            }
        }
        first
    }
}

impl Drop for Kids {
    fn drop(&mut self) {
        for k in &mut self.0 {
            if let Ok(None) = k.try_wait() {
                let _ = k.kill();
                let _ = k.wait();
            }
        }
    }
}

/// Arguments of `ferry bench-child fanin-client` (set by `ferry bench fanin --backend shm`).
#[derive(Debug, clap::Args)]
pub struct ClientArgs {
    /// The server's endpoint (`shm@NAME`).
    #[arg(long, value_parser = crate::echo::endpoint_arg)]
    endpoint: String,
    #[arg(long)]
    size: usize,
    #[arg(long, value_parser = crate::args::cpu)]
    cpu: Option<usize>,
    #[arg(long)]
    runs: usize,
    #[arg(long)]
    idle_us: u64,
    /// Measure round trips (else stay idle until stdin closes).
    #[arg(long)]
    active: bool,
}

/// `ferry bench-child fanin-client`: bind, offer a pool, then measure round
/// trips and print them (`samples …`) or stay idle until stdin closes; close.
pub fn client_process(a: &ClientArgs) -> Result<(), CliError> {
    use std::io::Read;
    if let Some(cpu) = a.cpu {
        pin::to_cpu(cpu);
    }
    let ep = crate::echo::parse_endpoint(&a.endpoint)
        .map_err(|why| CliError::Usage(format!("--endpoint {}: {why}", a.endpoint)))?;
    let domain = Domain::new("client");
    let mut ch = Channel::connect(&domain, &ep, BindParams::default(), STEP)?;
    let alloc = Allocator::new(&domain, 4, a.size, PoolConstraints::default())?;
    ch.assign_pool_and_wait(alloc.pool(), STEP)?;
    let mut bufs: Vec<_> = std::iter::from_fn(|| alloc.alloc()).collect();
    for b in &mut bufs {
        b.as_mut_slice()?.fill(1);
    }
    drop(bufs);
    if a.active {
        let samples =
            round_trips(&mut ch, &alloc, a.runs, Duration::from_micros(a.idle_us)).map_err(CliError::Failed)?;
        let list: Vec<String> = samples.iter().map(|x| format!("{x:.3}")).collect();
        println!("samples {}", list.join(" "));
    } else {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
    }
    close(&mut ch).map_err(CliError::Failed)
}

/// Every client keeps `window` moves in flight; the aggregate rate per run.
fn all_busy(ctx: &Ctx<'_>, kind: Server, n: usize, size: usize, window: usize, runs: usize) -> Result<Point, CliError> {
    let (clients, servers) = connect(n, size, window)?;
    let handles = start_server(kind, servers)?;
    let start = Arc::new(Barrier::new(n + 1));
    let mut threads = Vec::with_capacity(n);
    for (i, (mut ch, alloc)) in clients.into_iter().enumerate() {
        let start = start.clone();
        let t = std::thread::Builder::new()
            .name(format!("client{i}"))
            .spawn(move || -> Result<(), String> {
                pin::to_cpu(0);
                let mut r = Ok(());
                for _ in 0..=runs {
                    // Start together; the run ends when the last client is done.
                    start.wait();
                    if r.is_ok() {
                        r = busy_client(&mut ch, &alloc, window);
                    }
                    start.wait();
                }
                r?;
                close(&mut ch)
            })
            .map_err(|e| CliError::Failed(format!("cannot start a client thread: {e}")))?;
        threads.push(t);
    }
    let mut rates = Vec::with_capacity(runs);
    for run in 0..=runs {
        start.wait();
        let t0 = Instant::now();
        start.wait();
        let secs = t0.elapsed().as_secs_f64();
        if run > 0 {
            rates.push((n * MOVES_PER_CLIENT) as f64 / secs / 1e6);
            ctx.progress.inc(1);
        }
    }
    let mut failed = None;
    for t in threads {
        match t.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failed = failed.or(Some(e)),
            Err(_) => failed = failed.or(Some("a client thread panicked".into())),
        }
    }
    let echoed = join_server(handles)?;
    if let Some(e) = failed {
        return Err(CliError::Failed(e));
    }
    let expected = (n * MOVES_PER_CLIENT * (runs + 1)) as u64;
    if echoed != expected {
        return Err(CliError::Failed(format!("the fanin server echoed {echoed} buffers, expected {expected}")));
    }
    let s = Summary::of(&rates).ok_or_else(|| CliError::Failed("no samples".into()))?;
    let extra = json!({
        "variant": kind.variant(n), "channels": n, "inflight": window, "moves_per_run": n * MOVES_PER_CLIENT,
        "gbit_s_median": round(s.median * 1e6 * size as f64 * 8.0 / 1e9),
    });
    Ok(Point::new(head(ctx, kind, size, runs, "Mops/s"), s, Some(0), extra))
}

/// One run of a busy client: [`MOVES_PER_CLIENT`] moves, `window` in flight,
/// polling for returns and yielding the core when there are none.
fn busy_client(ch: &mut Channel, alloc: &Allocator, window: usize) -> Result<(), String> {
    let (mut sent, mut done, mut inflight) = (0usize, 0usize, 0usize);
    let mut last = Instant::now();
    while done < MOVES_PER_CLIENT {
        let mut did = false;
        while inflight < window && sent < MOVES_PER_CLIENT {
            let Some(buf) = alloc.alloc() else { break };
            match ch.move_buffer(buf, &(sent as u64).to_le_bytes()) {
                Ok(()) => {
                    sent += 1;
                    inflight += 1;
                    did = true;
                }
                Err(r) if r.error == ferry::ErrorKind::QueueFull => break,
                Err(r) => return Err(r.error.to_string()),
            }
        }
        while let Some(ev) = ch.poll() {
            match ev {
                Event::BufferPassed { buffer, .. } => {
                    drop(buffer);
                    done += 1;
                    inflight -= 1;
                    did = true;
                }
                other => return Err(format!("a busy client got {}", describe_event(&other))),
            }
        }
        if did {
            last = Instant::now();
        } else if last.elapsed() > STEP {
            return Err(format!("no buffer came back for {} s", STEP.as_secs()));
        } else {
            std::thread::yield_now();
        }
    }
    Ok(())
}

/// Print (or, with `--json`, emit as `"kind": "ratio"` lines) fan-in /
/// baseline per round: round trips (median and p99; lower is better) and
/// aggregate throughput (median; higher is better).
pub fn print_ratios(ctx: &Ctx<'_>) {
    let pts = &ctx.points;
    let rounds = pts.iter().filter_map(|p| p.num("round")).fold(1.0f64, f64::max) as usize;
    let mut first = true;
    for unit in ["us", "Mops/s"] {
        let is_base = |p: &Point| p.str("variant").starts_with("1 channel") || p.str("variant").contains("pairs");
        let mut variants: Vec<String> = Vec::new();
        for p in pts.iter().filter(|p| p.unit() == unit && !is_base(p)) {
            if !variants.iter().any(|v| v == p.str("variant")) {
                variants.push(p.str("variant").to_string());
            }
        }
        for v in variants {
            let (mut med, mut p99, mut base_name) = (Vec::new(), Vec::new(), String::new());
            for r in 1..=rounds {
                let in_round = |p: &&Point| p.unit() == unit && p.num("round").unwrap_or(1.0) as usize == r;
                let f = pts.iter().filter(in_round).find(|p| p.str("variant") == v);
                let b = pts.iter().filter(in_round).find(|p| is_base(p));
                if let (Some(f), Some(b)) = (f, b) {
                    let (fq, bq) = (f.quantiles(), b.quantiles());
                    if bq[0] > 0.0 && bq[3] > 0.0 {
                        med.push(fq[0] / bq[0]);
                        p99.push(fq[3] / bq[3]);
                        base_name = b.str("variant").to_string();
                    }
                }
            }
            if med.is_empty() {
                continue;
            }
            let mid = median(&med);
            let faster = if unit == "us" { 1.0 / mid } else { mid };
            if ctx.args.json {
                let mut j = json!({
                    "kind": "ratio", "experiment": "fanin", "unit": unit, "size": pts[0].size(),
                    "backend": pts[0].backend(),
                    "ferry": v, "baseline": base_name, "ratios": med.iter().map(|r| round(*r)).collect::<Vec<_>>(),
                    "median_ratio": round(mid), "ferry_faster_by": round(faster),
                });
                if unit == "us" {
                    j["p99_ratios"] = json!(p99.iter().map(|r| round(*r)).collect::<Vec<_>>());
                    j["median_p99_ratio"] = json!(round(median(&p99)));
                }
                println!("{j}");
            } else {
                if first {
                    println!("\nratios, fan-in / baseline (one per round):");
                    first = false;
                }
                let list = |v: &[f64]| v.iter().map(|r| round(*r).to_string()).collect::<Vec<_>>().join(", ");
                if unit == "us" {
                    println!(
                        "  round trip  {v} / {base_name}: median {}, p99 {}  (lower is better)",
                        list(&med),
                        list(&p99)
                    );
                } else {
                    println!("  throughput  {v} / {base_name}: {}  (higher is better)", list(&med));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::parse_bench_args;

    /// Every server kind echoes every buffer of every channel (each point
    /// checks the server's count against the clients'), one point each.
    #[test]
    fn one_server_thread_serves_every_channel() {
        let args = parse_bench_args("fanin --channels 5 --runs 1 --rounds 1 --inflight 4").unwrap();
        let mut ctx = Ctx { args: &args, progress: Progress::hidden(), points: Vec::new() };
        run(&mut ctx).unwrap();
        let got: Vec<(&str, &str, Option<f64>)> =
            ctx.points.iter().map(|p| (p.str("variant"), p.unit(), p.num("samples"))).collect();
        let rt = Some(ROUND_TRIPS as f64);
        assert_eq!(
            got,
            [
                ("1 channel, Channel::wait", "us", rt),
                ("5 channels, selector", "us", rt),
                ("5 channels, wait-any", "us", rt),
                ("5 pairs, busy-poll", "Mops/s", Some(1.0)),
                ("5 channels, selector", "Mops/s", Some(1.0)),
                ("5 channels, wait-any", "Mops/s", Some(1.0)),
            ]
        );
    }
}
