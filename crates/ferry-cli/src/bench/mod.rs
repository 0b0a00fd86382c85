//! `ferry bench`: the experiments of seed 003 §5.1 (throughput, round-trip
//! time), measured between a source domain and an echo domain that passes
//! every buffer straight back.
//!
//! Every figure is a distribution: each round trip (rtt) or each run
//! (throughput) is a sample, and we print the median with percentiles.

use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use ferry::{
    Allocator, BindParams, Channel, ChannelSetup, Direction, Domain, Event, PoolConstraints, Role, TrustLevel,
};
use serde_json::json;

use crate::echo::{self, EchoOptions};
use crate::setup::{assign, connect_local, next_event};
use crate::stats::Summary;
use crate::{pattern, pin, CliError};

/// Seed 003 §5.1.3/5.1.4: operations per run.
const MOVES_PER_RUN: usize = 250;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Experiment {
    /// R runs of 250 sequential moves to an echo domain and back: round-trip time.
    Rtt,
    /// R runs of overlapping moves (--inflight at once) to an echo domain: throughput.
    Throughput,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// Two domains in one process, one thread each.
    Local,
    /// Two processes on this host, shared-memory rings (the echo process
    /// is started by the benchmark: `ferry echo`).
    Shm,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Shm => "shm",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Trust {
    Full,
    Half,
    None,
}

impl Trust {
    fn level(self) -> TrustLevel {
        match self {
            Trust::Full => TrustLevel::Full,
            Trust::Half => TrustLevel::Half,
            Trust::None => TrustLevel::None,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Trust::Full => "full",
            Trust::Half => "half",
            Trust::None => "none",
        }
    }
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Which experiment.
    #[arg(value_enum)]
    experiment: Experiment,
    /// Which transport.
    #[arg(long, value_enum, default_value = "local")]
    backend: Backend,
    /// Buffer size in bytes (a power of two ≥ 4096); repeatable.
    #[arg(long = "size", default_values_t = [4096usize])]
    sizes: Vec<usize>,
    /// Runs (rtt: runs of 250 round trips; throughput: runs of --moves moves).
    #[arg(long)]
    runs: Option<usize>,
    /// Moves in flight at once (throughput).
    #[arg(long, default_value_t = 250)]
    inflight: usize,
    /// Moves per throughput run.
    #[arg(long, default_value_t = 50_000)]
    moves: usize,
    /// Spin on the channel instead of sleeping (default).
    #[arg(long, conflicts_with = "blocking")]
    busy_poll: bool,
    /// Sleep until woken when there is nothing to do.
    #[arg(long)]
    blocking: bool,
    /// Trust level of the channel.
    #[arg(long, value_enum, default_value = "full")]
    trust: Trust,
    /// The sender writes and the receiver reads every payload byte.
    #[arg(long)]
    touch: bool,
    /// Publish every message on its own instead of in batches (both ends;
    /// see `Channel::set_batching`).
    #[arg(long)]
    no_batching: bool,
    /// One JSON object per measured point on stdout.
    #[arg(long)]
    json: bool,
}

struct Point<'a> {
    args: &'a BenchArgs,
    size: usize,
    unit: &'static str,
    summary: Summary,
    extra: serde_json::Value,
}

impl Point<'_> {
    fn print(&self) {
        let a = self.args;
        let mode = if a.blocking { "blocking" } else { "busy-poll" };
        let experiment = match a.experiment {
            Experiment::Rtt => "rtt",
            Experiment::Throughput => "throughput",
        };
        let s = self.summary;
        if a.json {
            let mut v = json!({
                "experiment": experiment, "backend": a.backend.name(), "size": self.size,
                "trust": a.trust.name(), "mode": mode, "touch": a.touch, "batching": !a.no_batching,
                "runs": self.extra.get("runs").cloned().unwrap_or(json!(s.n)), "samples": s.n,
                "unit": self.unit, "median": round(s.median), "p5": round(s.p5),
                "p95": round(s.p95), "p99": round(s.p99), "copies_user": 0,
            });
            if let (Some(obj), Some(extra)) = (v.as_object_mut(), self.extra.as_object()) {
                for (k, x) in extra {
                    obj.insert(k.clone(), x.clone());
                }
            }
            println!("{v}");
        } else {
            println!(
                "{experiment:<10} {:<5} {:>8} B trust={:<4} {mode:<9} {}: median {:>9.3} {} (p5 {:.3}, p95 {:.3}, p99 {:.3}; {} samples){}",
                a.backend.name(),
                self.size,
                a.trust.name(),
                if a.no_batching { "unbatched" } else { "batched" },
                s.median,
                self.unit,
                s.p5,
                s.p95,
                s.p99,
                s.n,
                self.extra.get("gbit_s_median").map_or(String::new(), |g| format!(", {g} Gbit/s")),
            );
        }
    }
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub fn run(args: &BenchArgs) -> Result<(), CliError> {
    for &size in &args.sizes {
        if !size.is_power_of_two() || size < 4096 {
            return Err(CliError::Usage(format!(
                "--size {size}: pool buffers must be a power of two of at least 4096 bytes (e.g. 4096, 65536, 1048576)"
            )));
        }
    }
    if args.inflight == 0 || args.inflight > 16384 {
        return Err(CliError::Usage("--inflight must be between 1 and 16384".into()));
    }
    if args.trust == Trust::None {
        return Err(CliError::Usage(
            "--trust none is not available yet (kernel-enforced trust is being built); use full or half".into(),
        ));
    }
    for &size in &args.sizes {
        let point = match args.experiment {
            Experiment::Rtt => rtt(args, size)?,
            Experiment::Throughput => throughput(args, size)?,
        };
        point.print();
    }
    Ok(())
}

/// A source (TX, master, owns the pool) and an echo domain on the other
/// core: a thread (local) or a process (shm).
struct Rig {
    source: Channel,
    alloc: Allocator,
    echo: Echo,
}

enum Echo {
    Thread(std::thread::JoinHandle<Result<u64, String>>),
    Process(std::process::Child),
}

fn rig(args: &BenchArgs, size: usize, count: usize) -> Result<Rig, CliError> {
    let (a, b) = (Domain::new("source"), Domain::new("echo"));
    let depth = (count * 2).next_power_of_two().clamp(64, 65536) as u32;
    let setup = ChannelSetup {
        direction: Direction::Tx,
        role: Role::Master,
        trust: args.trust.level(),
        meta_size: 16,
        queue_depth: depth,
        ..ChannelSetup::default()
    };
    let busy = !args.blocking;
    let touch = args.touch;
    let batch = !args.no_batching;
    let (mut source, echo_end) = match args.backend {
        Backend::Local => {
            let (source, sink) = connect_local(&a, &b, setup, BindParams::default())?;
            (source, Ok(sink))
        }
        Backend::Shm => {
            let (source, child) = echo::spawn_process(&a, setup, EchoOptions { busy, touch, verify: false, batch })?;
            (source, Err(child))
        }
    };
    let alloc = Allocator::new(&a, count as u64, size, PoolConstraints::default())?;
    let echo = match echo_end {
        Ok(mut sink) => {
            assign(&mut source, &mut sink, alloc.pool())?;
            Echo::Thread(std::thread::spawn(move || {
                pin::to_cpu(1);
                echo::serve(&mut sink, EchoOptions { busy, touch, verify: false, batch })
            }))
        }
        Err(child) => {
            // The echo process accepts pools by itself.
            source.assign_pool(alloc.pool())?;
            match source.wait(Some(Duration::from_secs(10))) {
                Some(Event::PoolAssigned(_)) => {}
                ev => return Err(CliError::Failed(format!("echo process did not take the pool: {ev:?}"))),
            }
            Echo::Process(child)
        }
    };
    // Pre-fault every buffer in both views: first touch of a page costs
    // microseconds, and we measure steady-state transfer, not page faults.
    let bufs: Vec<_> = std::iter::from_fn(|| alloc.alloc()).collect();
    let mut bufs = bufs;
    for b in &mut bufs {
        b.as_mut_slice()?.fill(1);
    }
    drop(bufs);
    source.set_batching(batch)?;
    pin::to_cpu(0);
    Ok(Rig { source, alloc, echo })
}

fn finish(rig: Rig) -> Result<u64, CliError> {
    let Rig { mut source, alloc, echo } = rig;
    source.teardown()?;
    while let Some(ev) = source.wait(Some(Duration::from_secs(10))) {
        match ev {
            Event::Closed { .. } => break,
            Event::BufferPassed { .. } => {}
            other => return Err(CliError::Failed(format!("unexpected event at teardown: {other:?}"))),
        }
    }
    drop(alloc);
    match echo {
        Echo::Thread(h) => {
            h.join().map_err(|_| CliError::Failed("echo thread panicked".into()))?.map_err(CliError::Failed)
        }
        Echo::Process(child) => {
            let out = child.wait_with_output().map_err(|e| CliError::Failed(format!("echo process: {e}")))?;
            let text = String::from_utf8_lossy(&out.stdout);
            match text.trim().strip_prefix("echoed ").and_then(|n| n.parse().ok()) {
                Some(n) if out.status.success() => Ok(n),
                _ => Err(CliError::Failed(format!("echo process failed ({}): {text}", out.status))),
            }
        }
    }
}

fn send(source: &mut Channel, buf: ferry::Buffer, meta: &[u8], busy: bool) -> Result<(), CliError> {
    let mut b = buf;
    loop {
        match source.move_buffer(b, meta) {
            Ok(()) => return Ok(()),
            Err(r) if r.error == ferry::Error::QueueFull => {
                b = r.into_inner();
                if !busy {
                    std::thread::yield_now();
                }
            }
            Err(r) => return Err(r.into()),
        }
    }
}

fn rtt(args: &BenchArgs, size: usize) -> Result<Point<'_>, CliError> {
    let runs = args.runs.unwrap_or(100);
    let busy = !args.blocking;
    let mut rig = rig(args, size, 16)?;
    let mut samples = Vec::with_capacity(runs * MOVES_PER_RUN);
    // One warm-up run, not recorded.
    for run in 0..=runs {
        for i in 0..MOVES_PER_RUN {
            let mut buf = rig.alloc.alloc().ok_or_else(|| CliError::Failed("pool exhausted".into()))?;
            if args.touch {
                pattern::fill(buf.as_mut_slice()?, i as u64);
            }
            let t0 = Instant::now();
            send(&mut rig.source, buf, &(i as u64).to_le_bytes(), busy)?;
            match next_event(&mut rig.source, busy) {
                Some(Event::BufferPassed { buffer, .. }) => drop(buffer),
                ev => return Err(CliError::Failed(format!("rtt: expected the buffer back, got {ev:?}"))),
            }
            let dt = t0.elapsed();
            if run > 0 {
                samples.push(dt.as_secs_f64() * 1e6);
            }
        }
    }
    let echoed = finish(rig)?;
    let expected = ((runs + 1) * MOVES_PER_RUN) as u64;
    if echoed != expected {
        return Err(CliError::Failed(format!("echo saw {echoed} moves, expected {expected}")));
    }
    let summary = Summary::of(&samples).ok_or_else(|| CliError::Failed("no samples".into()))?;
    Ok(Point { args, size, unit: "us", summary, extra: json!({ "runs": runs }) })
}

fn throughput(args: &BenchArgs, size: usize) -> Result<Point<'_>, CliError> {
    let runs = args.runs.unwrap_or(20);
    let busy = !args.blocking;
    let window = args.inflight;
    let moves = args.moves.max(window);
    let mut rig = rig(args, size, window)?;
    let mut rates = Vec::with_capacity(runs);
    for run in 0..=runs {
        let (mut sent, mut done, mut inflight) = (0usize, 0usize, 0usize);
        let t0 = Instant::now();
        while done < moves {
            while inflight < window && sent < moves {
                let Some(mut buf) = rig.alloc.alloc() else { break };
                if args.touch {
                    pattern::fill(buf.as_mut_slice()?, sent as u64);
                }
                send(&mut rig.source, buf, &(sent as u64).to_le_bytes(), busy)?;
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
                    ev => return Err(CliError::Failed(format!("throughput: expected buffers back, got {ev:?}"))),
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        if run > 0 {
            rates.push(moves as f64 / secs / 1e6);
        }
    }
    let echoed = finish(rig)?;
    let expected = ((runs + 1) * moves) as u64;
    if echoed != expected {
        return Err(CliError::Failed(format!("echo saw {echoed} moves, expected {expected}")));
    }
    let summary = Summary::of(&rates).ok_or_else(|| CliError::Failed("no samples".into()))?;
    let gbit = |mops: f64| round(mops * 1e6 * size as f64 * 8.0 / 1e9);
    Ok(Point {
        args,
        size,
        unit: "Mops/s",
        summary,
        extra: json!({ "runs": runs, "inflight": window, "moves_per_run": moves, "gbit_s_median": gbit(summary.median) }),
    })
}
