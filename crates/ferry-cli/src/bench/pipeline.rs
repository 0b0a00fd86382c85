//! `pipeline`: \[CONTAINER\] (Container Shipping) Fig. 7 — data flowing through
//! a chain of N processes — on Ferry against the same chain built with
//! pipes and read/write.
//!
//! Every stage is a real process (`ferry bench-child stage`, this
//! executable). Per run, stage 0 produces `--total` bytes in `--size`
//! buffers, stages 1..N-2 forward them, stage N-1 consumes them and reports;
//! the sample is total / (time from "go" to the consumer's "done").
//!
//! * **Ferry** (`shm`): channels between neighbours; stage 0 owns one pool
//!   of `--inflight` buffers (16 by default), assigned along the chain (each
//!   stage accepts it and offers it downstream: mapped once per process);
//!   buffers are moved downstream and passed back upstream stage by stage
//!   to the producer's free list. Nobody copies payload. Blocking mode by
//!   default: more processes than cores, so spinning stages would take the
//!   CPUs from each other. An inner stage waits on both its channels at
//!   once (`ferry::wait_any`): buffers from upstream, returns from
//!   downstream, whichever comes first; on each wake-up it takes everything
//!   waiting on both and sends it on in one batch per channel (one
//!   publication, at most one doorbell), without spinning first (the
//!   first and last stages do not spin either). Stage 0
//!   fills every free buffer at once (from a source file: in one read) and
//!   moves them on in one batch; the last stage passes its returns back in
//!   batches. So a sleeping stage is woken per batch, not per buffer.
//! * **pipes** (`pipe-copy`): a shell-style chain, stage i's stdout is
//!   stage i+1's stdin; every stage moves `--size` chunks with read()
//!   (read fully) and write(); each pipe is enlarged to pipe-max-size
//!   (F_SETPIPE_SZ), as a bulk program would. The kernel copies every byte
//!   in and out at every hop: `copies_kernel` = 2 (N-1).
//!
//! Every buffer carries its sequence number in its first 8 bytes, checked
//! by the consumer; with `--touch` the producer writes the whole pattern
//! and the consumer checks every byte. Processes are not pinned. A stage
//! that dies ends the run with an error (no hang: stages die with the
//! benchmark, and the coordinator watches every one).

use std::io::{BufRead, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use ferry::{
    Allocator, BindParams, Buffer, Channel, ChannelSetup, Direction, Domain, Endpoint, Event, PoolConstraints, Role,
};
use rustix::io::Errno;
use serde_json::json;

use super::point::{Head, Point};
use super::progress::Progress;
use super::{check_pool_sizes, compare, Backend, Ctx};
use crate::setup::{describe_event, send_when_room};
use crate::stats::{round, Summary};
use crate::{pattern, CliError};

/// How long a run may go without finishing before the chain is declared stuck.
const RUN_LIMIT: Duration = Duration::from_secs(300);
/// Setup steps between stages.
const STEP: Duration = Duration::from_secs(20);

/// How the chain is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Variant {
    /// Ferry shared-memory channels, buffers moved.
    Ferry,
    /// Pipes, read/write.
    Pipe,
}

impl Variant {
    fn backend(self) -> Backend {
        match self {
            Variant::Ferry => Backend::Shm,
            Variant::Pipe => Backend::PipeCopy,
        }
    }
}

/// Arguments of one stage (set by the coordinator).
#[derive(Debug, Args)]
pub struct StageArgs {
    #[arg(long, value_enum)]
    variant: Variant,
    #[arg(long)]
    index: usize,
    #[arg(long)]
    stages: usize,
    #[arg(long)]
    size: usize,
    #[arg(long)]
    total: u64,
    #[arg(long)]
    window: usize,
    /// Endpoint name stem (Ferry).
    #[arg(long)]
    name: String,
    #[arg(long)]
    busy_poll: bool,
    #[arg(long)]
    touch: bool,
    /// The file stage 0 reads (`ferry bench chain`) instead of making data.
    #[arg(long)]
    source: Option<std::path::PathBuf>,
    /// The file (or /dev/null) the last stage writes (`ferry bench chain`).
    #[arg(long)]
    sink: Option<std::path::PathBuf>,
    /// The stages between the first and the last read every byte.
    #[arg(long)]
    touch_middle: bool,
}

/// `ferry bench pipeline`.
pub fn run(ctx: &mut Ctx<'_>) -> Result<(), CliError> {
    let a = ctx.args;
    let variants: Vec<Variant> = match (a.backend, a.compare) {
        (None, _) | (Some(Backend::Shm), true) => vec![Variant::Ferry, Variant::Pipe],
        (Some(Backend::Shm), false) => vec![Variant::Ferry],
        (Some(Backend::PipeCopy), false) => vec![Variant::Pipe],
        (Some(b), _) => {
            return Err(CliError::Usage(format!(
                "--backend {}: the pipeline's stages are processes; give shm (Ferry) or pipe-copy (pipes), or neither for both",
                b.name()
            )))
        }
    };
    if a.compare {
        compare::baselines(a)?;
    }
    let sizes = if a.sizes.is_empty() { vec![1 << 20] } else { a.sizes.clone() };
    check_pool_sizes(&sizes)?;
    let stages = if a.stages.is_empty() { vec![2, 3, 4, 5] } else { a.stages.clone() };
    for &size in &sizes {
        if a.total() < size as u64 || a.total() % size as u64 != 0 {
            return Err(CliError::Usage(format!(
                "--total {}: not a multiple of --size {size}; give a multiple such as {}",
                a.total(),
                (a.total() / size as u64).max(1) * size as u64
            )));
        }
    }
    let window = a.inflight.unwrap_or(16);
    let runs = a.runs.unwrap_or(3);
    let rounds = if variants.len() > 1 { a.rounds } else { 1 };
    let total_units = stages.len() * sizes.len() * rounds * variants.len() * runs;
    ctx.progress = Progress::new(total_units as u64, a.json);
    for &size in &sizes {
        for &n in &stages {
            for round_no in 1..=rounds {
                for &v in &variants {
                    ctx.progress.say(format!("pipeline {n} stages {}", v.backend().name()));
                    let mut p = point(ctx, v, n, size, window, runs)?;
                    if rounds > 1 {
                        p.set("round", json!(round_no));
                    }
                    ctx.emit(p);
                }
            }
        }
    }
    Ok(())
}

fn point(ctx: &Ctx<'_>, v: Variant, n: usize, size: usize, window: usize, runs: usize) -> Result<Point, CliError> {
    let a = ctx.args;
    let mut chain = Chain::start(v, n, size, a.total(), window, a.busy(), a.touch, None)?;
    let mut rates = Vec::with_capacity(runs);
    for run in 0..=runs {
        let secs = chain.run_once()?;
        if run > 0 {
            rates.push(a.total() as f64 / secs / 1e9);
        }
        if run > 0 {
            ctx.progress.inc(1);
        }
    }
    chain.stop()?;
    let s = Summary::of(&rates).ok_or_else(|| CliError::Failed("no samples".into()))?;
    let (trust, mode, kernel) = match v {
        Variant::Ferry => (a.trust().name(), a.mode(), 0),
        Variant::Pipe => ("n/a", "blocking", 2 * (n - 1)),
    };
    let head = Head {
        experiment: "pipeline",
        backend: v.backend().name(),
        size,
        trust,
        mode,
        touch: a.touch,
        runs,
        unit: "GB/s",
    };
    let mut extra = json!({
        "stages": n, "total": a.total(), "copies_kernel": kernel, "gbit_s_median": round(s.median * 8.0),
    });
    if v == Variant::Ferry {
        extra["inflight"] = json!(window);
    }
    Ok(Point::new(head, s, Some(0), extra))
}

/// The files of a `ferry bench chain` run: what stage 0 reads, what the
/// last stage writes, and whether the stages between read every byte.
pub struct Files<'a> {
    /// The source file (--total bytes, tagged per buffer).
    pub source: &'a std::path::Path,
    /// The sink: a file, or /dev/null.
    pub sink: &'a std::path::Path,
    /// Whether the stages between read every byte.
    pub touch_middle: bool,
}

/// A running chain of stage processes, seen from the coordinator.
pub struct Chain {
    children: Vec<Child>,
    control: Option<ChildStdin>,
    lines: mpsc::Receiver<(Instant, String)>,
    run: u64,
}

fn pipe_pair() -> Result<(OwnedFd, OwnedFd), CliError> {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| CliError::Failed(format!("pipe: {e}")))?;
    let max = std::fs::read_to_string("/proc/sys/fs/pipe-max-size")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(1 << 20);
    if let Err(e) = rustix::pipe::fcntl_setpipe_size(&w, max) {
        eprintln!("ferry bench: F_SETPIPE_SZ {max}: {e} (keeping the default pipe buffer)");
    }
    Ok((r, w))
}

impl Chain {
    /// Start the `n` stage processes of variant `v` and wait until they are ready.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        v: Variant,
        n: usize,
        size: usize,
        total: u64,
        window: usize,
        busy: bool,
        touch: bool,
        files: Option<&Files<'_>>,
    ) -> Result<Chain, CliError> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!("ferry-pipe-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let exe = std::env::current_exe().map_err(|e| CliError::Failed(format!("cannot find own executable: {e}")))?;
        let mut chain = Chain { children: Vec::new(), control: None, lines: mpsc::channel().1, run: 0 };
        let mut upstream: Option<OwnedFd> = None;
        for i in 0..n {
            let mut cmd = Command::new(&exe);
            cmd.args(["bench-child", "stage", "--variant"]).arg(format!("{v:?}").to_lowercase());
            for (k, val) in [
                ("--index", i.to_string()),
                ("--stages", n.to_string()),
                ("--size", size.to_string()),
                ("--total", total.to_string()),
                ("--window", window.to_string()),
                ("--name", name.clone()),
            ] {
                cmd.arg(k).arg(val);
            }
            if busy {
                cmd.arg("--busy-poll");
            }
            if touch {
                cmd.arg("--touch");
            }
            if let Some(f) = files {
                cmd.arg("--source").arg(f.source).arg("--sink").arg(f.sink);
                if f.touch_middle {
                    cmd.arg("--touch-middle");
                }
            }
            cmd.stderr(Stdio::inherit());
            // Stage 0 reads "go" lines from us; the last stage reports to us.
            if i == 0 {
                cmd.stdin(Stdio::piped());
            } else if let Some(r) = upstream.take() {
                cmd.stdin(Stdio::from(r));
            } else {
                cmd.stdin(Stdio::null());
            }
            if i == n - 1 {
                cmd.stdout(Stdio::piped());
            } else if v == Variant::Pipe {
                let (r, w) = pipe_pair()?;
                cmd.stdout(Stdio::from(w));
                upstream = Some(r);
            } else {
                cmd.stdout(Stdio::null());
            }
            let mut child = cmd.spawn().map_err(|e| CliError::Failed(format!("cannot start stage {i}: {e}")))?;
            // Our copies of the pipe ends went with `cmd`.
            drop(cmd);
            if i == 0 {
                chain.control = child.stdin.take();
            }
            if i == n - 1 {
                chain.lines = super::child::timed_lines(child.stdout.take().expect("piped"));
            }
            chain.children.push(child);
        }
        chain.expect("ready", STEP)?;
        Ok(chain)
    }

    /// Wait for the consumer's next line, which must start with `what`.
    fn expect(&mut self, what: &str, limit: Duration) -> Result<Instant, CliError> {
        let t0 = Instant::now();
        loop {
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok((at, line)) if line.starts_with(what) => return Ok(at),
                Ok((_, line)) => {
                    return Err(CliError::Failed(format!(
                        "pipeline: the consumer stage said \"{line}\" instead of {what}; run the benchmark again"
                    )))
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(CliError::Failed(format!("pipeline: the consumer stage ended before {what}")))
                }
            }
            for (i, c) in self.children.iter_mut().enumerate() {
                if let Ok(Some(st)) = c.try_wait() {
                    return Err(CliError::Failed(format!("pipeline: stage {i} died ({st})")));
                }
            }
            if t0.elapsed() > limit {
                return Err(CliError::Failed(format!("pipeline: no {what} within {} s", limit.as_secs())));
            }
        }
    }

    /// One run: seconds from "go" to the consumer's "done".
    pub fn run_once(&mut self) -> Result<f64, CliError> {
        self.run += 1;
        let ctl = self.control.as_mut().expect("running");
        let t0 = Instant::now();
        ctl.write_all(b"go\n")
            .and_then(|()| ctl.flush())
            .map_err(|e| CliError::Failed(format!("pipeline: the producer stage is gone: {e}")))?;
        let at = self.expect("done", RUN_LIMIT)?;
        Ok(at.duration_since(t0).as_secs_f64())
    }

    /// The stage processes' ids, stage 0 first.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Child::id).collect()
    }

    /// End of input for the producer; every stage must exit cleanly.
    pub fn stop(mut self) -> Result<(), CliError> {
        drop(self.control.take());
        let t0 = Instant::now();
        for (i, c) in self.children.iter_mut().enumerate() {
            let st = loop {
                match c.try_wait() {
                    Ok(Some(st)) => break st,
                    Ok(None) if t0.elapsed() < STEP => std::thread::sleep(Duration::from_millis(2)),
                    Ok(None) => return Err(CliError::Failed(format!("pipeline: stage {i} did not exit"))),
                    Err(e) => return Err(CliError::Failed(format!("pipeline: stage {i}: {e}"))),
                }
            };
            if !st.success() {
                return Err(CliError::Failed(format!("pipeline: stage {i} failed ({st})")));
            }
        }
        Ok(())
    }
}

impl Drop for Chain {
    fn drop(&mut self) {
        for c in &mut self.children {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

// ------------------------------------------------------------------ stages

fn failed(what: &str) -> impl Fn(std::io::Error) -> CliError + '_ {
    move |e| CliError::Failed(format!("stage: {what}: {e}"))
}

/// One stage of the chain (a process).
pub fn stage(a: &StageArgs) -> Result<(), CliError> {
    let r = match a.variant {
        Variant::Ferry => ferry_stage(a),
        Variant::Pipe => pipe_stage(a),
    };
    r.map_err(|e| CliError::Failed(format!("pipeline stage {} of {}: {e}", a.index, a.stages)))
}

fn per_run(a: &StageArgs) -> u64 {
    a.total / a.size as u64
}

/// Mark buffer `seq`: its tag in the first word, or with `--touch` the whole pattern.
fn mark(buf: &mut [u8], seq: u64, touch: bool) {
    if touch {
        pattern::fill(buf, seq);
    } else {
        buf[..8].copy_from_slice(&seq.to_le_bytes());
    }
}

fn check(buf: &[u8], seq: u64, touch: bool) -> Result<(), CliError> {
    let ok = if touch { pattern::check(buf, seq) } else { buf[..8] == seq.to_le_bytes() };
    if ok {
        Ok(())
    } else {
        Err(CliError::Failed(format!("buffer {seq} arrived wrong (lost, reordered or mangled)")))
    }
}

/// A stage got an event it does not handle.
fn stage_got(who: &str, ev: &Event) -> CliError {
    CliError::Failed(format!("the {who} got {}, which it does not handle", describe_event(ev)))
}

fn report(line: &str) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).map_err(failed("report"))
}

fn write_all(fd: BorrowedFd<'_>, mut buf: &[u8]) -> Result<(), CliError> {
    while !buf.is_empty() {
        match rustix::io::write(fd, buf) {
            Ok(n) => buf = &buf[n..],
            Err(Errno::INTR) => {}
            Err(e) => return Err(CliError::Failed(format!("write: {e}"))),
        }
    }
    Ok(())
}

/// Read exactly `buf.len()` bytes; `false` on end of file before the first.
fn read_exact(fd: BorrowedFd<'_>, buf: &mut [u8]) -> Result<bool, CliError> {
    let mut got = 0;
    while got < buf.len() {
        match rustix::io::read(fd, &mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(CliError::Failed(format!("end of file inside a chunk ({got} of {})", buf.len()))),
            Ok(n) => got += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(CliError::Failed(format!("read: {e}"))),
        }
    }
    Ok(true)
}

fn pipe_stage(a: &StageArgs) -> Result<(), CliError> {
    let (stdin, stdout) = (std::io::stdin(), std::io::stdout());
    let mut buf = vec![1u8; a.size];
    let last = a.index == a.stages - 1;
    if a.index == 0 {
        let mut seq = 0u64;
        for line in stdin.lock().lines() {
            line.map_err(failed("control"))?;
            let source = a.source.as_ref().map(std::fs::File::open).transpose().map_err(failed("source"))?;
            for _ in 0..per_run(a) {
                match &source {
                    Some(f) => {
                        if !read_exact(f.as_fd(), &mut buf)? {
                            return Err(CliError::Failed("the source file is shorter than --total".into()));
                        }
                    }
                    None => mark(&mut buf, seq, a.touch),
                }
                write_all(stdout.as_fd(), &buf)?;
                seq += 1;
            }
        }
        return Ok(());
    }
    if last {
        report("ready")?;
    }
    let mut seq = 0u64;
    let mut sink: Option<std::fs::File> = None;
    while read_exact(stdin.as_fd(), &mut buf)? {
        if last && a.sink.is_some() {
            check_tag(&buf, seq % per_run(a))?;
            if seq % per_run(a) == 0 {
                sink = a.sink.as_ref().map(std::fs::File::create).transpose().map_err(failed("sink"))?;
            }
            if let Some(f) = &sink {
                write_all(f.as_fd(), &buf)?;
            }
            seq += 1;
            if seq % per_run(a) == 0 {
                report(&format!("done {}", seq / per_run(a)))?;
            }
        } else if last {
            check(&buf, seq, a.touch)?;
            seq += 1;
            if seq % per_run(a) == 0 {
                report(&format!("done {}", seq / per_run(a)))?;
            }
        } else {
            if a.touch_middle {
                std::hint::black_box(pattern::touch(&buf));
            }
            write_all(stdout.as_fd(), &buf)?;
        }
    }
    Ok(())
}

/// The tag of buffer `seq` of a source file: its number in the first 8 bytes.
fn check_tag(buf: &[u8], seq: u64) -> Result<(), CliError> {
    if buf.len() >= 8 && buf[..8] == seq.to_le_bytes() {
        Ok(())
    } else {
        Err(CliError::Failed(format!("buffer {seq} arrived wrong (lost, reordered or mangled)")))
    }
}

fn step<T>(ch: &mut Channel, what: &str, mut want: impl FnMut(Event) -> Option<T>) -> Result<T, CliError> {
    let t0 = Instant::now();
    while t0.elapsed() < STEP {
        if let Ok(ev) = ch.wait(Some(Duration::from_millis(100))) {
            return match ev {
                Event::Error(e) => Err(CliError::Failed(format!("{what}: {e}"))),
                ev => {
                    let words = describe_event(&ev);
                    want(ev).ok_or_else(|| {
                        CliError::Failed(format!("while waiting for the {what} the channel gave {words}"))
                    })
                }
            };
        }
    }
    Err(CliError::Failed(format!("no {what} within {} s", STEP.as_secs())))
}

fn next(ch: &mut Channel, busy: bool) -> Option<Event> {
    crate::setup::next_event(ch, busy)
}

fn ferry_stage(a: &StageArgs) -> Result<(), CliError> {
    let domain = Domain::new(&format!("stage{}", a.index));
    let ep = |i: usize| Endpoint::shm_abstract(&format!("{}-{i}", a.name));
    let first = a.index == 0;
    let last = a.index == a.stages - 1;
    let busy = a.busy_poll;
    let mut out = if last {
        None
    } else {
        let setup = ChannelSetup {
            direction: Direction::Tx,
            role: Role::Master,
            meta_size: 16,
            queue_depth: (a.window * 2 + 8).next_power_of_two().max(64) as u32,
            ..ChannelSetup::default()
        };
        Some(Channel::create(&domain, &ep(a.index), setup)?)
    };
    let inn = if first {
        None
    } else {
        let t0 = Instant::now();
        let mut ch = loop {
            match Channel::bind(&domain, &ep(a.index - 1), BindParams::default()) {
                Ok(ch) => break ch,
                Err(e) if e == ferry::ErrorKind::EndpointNotListening && t0.elapsed() < STEP => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e.into()),
            }
        };
        step(&mut ch, "bind reply", |ev| matches!(ev, Event::Bound).then_some(()))?;
        Some(ch)
    };
    if let Some(out) = &mut out {
        step(out, "bind request", |ev| matches!(ev, Event::BindRequest { .. }).then_some(()))?;
    }
    match (inn, out) {
        (None, Some(out)) => producer(a, &domain, out),
        (Some(inn), Some(out)) => forwarder(&domain, inn, out, busy, a.touch_middle).map(|_| ()),
        (Some(inn), None) => consumer(a, inn, busy, &mut report),
        (None, None) => Err(CliError::Usage("a chain has at least two stages".into())),
    }
}

fn producer(a: &StageArgs, domain: &Domain, mut out: Channel) -> Result<(), CliError> {
    let busy = a.busy_poll;
    if !busy {
        // No spinning while it waits for returns (see the consumer).
        out.set_spin(Duration::ZERO);
    }
    let alloc = Allocator::new(domain, a.window as u64, a.size, PoolConstraints::default())?;
    out.assign_pool(alloc.pool())?;
    step(&mut out, "pool accepted downstream", |ev| matches!(ev, Event::PoolAssigned(_)).then_some(()))?;
    let mut bufs: Vec<_> = std::iter::from_fn(|| alloc.alloc()).collect();
    for b in &mut bufs {
        b.as_mut_slice()?.fill(1);
    }
    drop(bufs);
    let mut seq = 0u64;
    for line in std::io::stdin().lock().lines() {
        line.map_err(failed("control"))?;
        // The source file, read by the kernel straight into pool buffers.
        let mut source = match &a.source {
            Some(p) => Some(ferry_io::Port::open(p).map_err(|e| CliError::Failed(e.to_string()))?),
            None => None,
        };
        produce(&mut out, &alloc, source.as_mut(), &mut seq, per_run(a), a.touch, busy)?;
    }
    // End of input: every buffer home, then close the chain from here.
    while alloc.available() < a.window {
        take_returns(&mut out, true, busy)?;
    }
    out.teardown()?;
    while let Ok(ev) = out.wait(Some(STEP)) {
        if matches!(ev, Event::Closed { .. }) {
            break;
        }
    }
    Ok(())
}

/// Take the returns waiting on the producer's channel (waiting for the
/// first if `block`): their buffers go back to the free list.
fn take_returns(out: &mut Channel, block: bool, busy: bool) -> Result<(), CliError> {
    let mut ev = if block { next(out, busy) } else { out.poll() };
    while let Some(e) = ev {
        match e {
            Event::BufferPassed { buffer, .. } => drop(buffer),
            Event::Error(e) => return Err(e.into()),
            other => return Err(stage_got("producer", &other)),
        }
        ev = out.poll();
    }
    Ok(())
}

/// One run of the producer: `count` buffers numbered from `*seq`, read
/// from `source` (or marked here: `touch` writes the whole pattern) and
/// moved down `out`. Every buffer that is free is filled at once — from
/// the source in one read, the kernel writing straight into the pool
/// buffers — and moved on together, with batching, so a downstream stage
/// that sleeps is woken once for the whole batch (one publication per 32
/// messages, at most one doorbell each), not once per buffer. It waits
/// for returns only when no buffer is free.
fn produce(
    out: &mut Channel,
    alloc: &Allocator,
    mut source: Option<&mut ferry_io::Port>,
    seq: &mut u64,
    count: u64,
    touch: bool,
    busy: bool,
) -> Result<(), CliError> {
    out.set_batching(true)?;
    let size = alloc.pool().geometry().buffer_size();
    let mut left = count;
    while left > 0 {
        take_returns(out, alloc.available() == 0, busy)?;
        let want = left.min(alloc.available() as u64) as usize;
        let bufs: Vec<Buffer> = match &mut source {
            Some(port) => {
                let filled = port.read(alloc, want).map_err(|e| CliError::Failed(e.to_string()))?;
                if filled.len() < want || filled.iter().any(|f| f.len != size) {
                    return Err(CliError::Failed("the source file is shorter than --total".into()));
                }
                filled.into_iter().map(|f| f.buffer).collect()
            }
            None => {
                let mut bufs = Vec::with_capacity(want);
                for k in 0..want as u64 {
                    let mut b = alloc.alloc().ok_or_else(|| CliError::Failed("no free buffer".into()))?;
                    mark(b.as_mut_slice()?, *seq + k, touch);
                    bufs.push(b);
                }
                bufs
            }
        };
        for buf in bufs {
            send_when_room(buf, false, |b| out.move_buffer(b, &seq.to_le_bytes()))?;
            *seq += 1;
        }
        out.flush()?;
        left -= want as u64;
    }
    Ok(())
}

/// Handle one event from upstream in a forwarding stage; `true` once the
/// chain is closed (upstream closed, downstream closed after it).
fn from_upstream(domain: &Domain, inn: &mut Channel, out: &mut Channel, ev: Event) -> Result<bool, CliError> {
    match ev {
        Event::PoolAssignRequest(req) => {
            // Accept, then offer the same pool downstream (mapped once here).
            inn.respond_pool(req.pool, true)?;
            let pool = domain.pool(req.pool).ok_or_else(|| CliError::Failed("accepted pool missing".into()))?;
            out.assign_pool(&pool)?;
            step(out, "pool accepted downstream", |ev| matches!(ev, Event::PoolAssigned(_)).then_some(()))?;
        }
        Event::MoveReceived { buffer, meta } => send_when_room(buffer, false, |b| out.move_buffer(b, &meta))?,
        Event::Closed { .. } => {
            out.teardown()?;
            while let Ok(ev) = out.wait(Some(STEP)) {
                if matches!(ev, Event::Closed { .. }) {
                    break;
                }
            }
            return Ok(true);
        }
        Event::Error(e) => return Err(e.into()),
        other => return Err(stage_got("forwarder (upstream)", &other)),
    }
    Ok(false)
}

/// What a forwarding stage did: how often it woke, how many buffers it moved on.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Forwarded {
    /// Times it found nothing waiting and had to wait for its channels.
    pub wakeups: u64,
    /// Buffers moved downstream.
    pub buffers: u64,
    /// Most buffers moved downstream in one wake-up.
    pub largest_batch: u64,
    /// Buffers passed back upstream.
    pub returns: u64,
    /// Times those returns were let go upstream: a poll of the upstream
    /// channel that found nothing while returns were staged (batching
    /// publishes them then), or the flush at the end of a wake-up. (More
    /// than 32 staged are also published in parts of 32 on the way.)
    pub return_publications: u64,
}

/// Poll the upstream channel of a middle stage; a poll that finds nothing
/// publishes what batching holds there: the `staged` returns, counted in
/// `published` if there were any.
fn poll_upstream(ch: &mut Channel, staged: &mut u64, published: &mut u64) -> Option<Event> {
    let ev = ch.poll();
    if ev.is_none() && *staged > 0 {
        *published += 1;
        *staged = 0;
    }
    ev
}

/// A middle stage: waits on both channels at once; on each wake-up takes
/// everything that is waiting on either (buffers from upstream, returns
/// from downstream) and sends it all on in one batch per channel (one
/// shared-memory publication, at most one doorbell), then waits again.
/// Blocking (`busy` false): no spinning before sleeping, since more stages
/// than cores share the machine.
pub fn forwarder(
    domain: &Domain,
    mut inn: Channel,
    mut out: Channel,
    busy: bool,
    touch: bool,
) -> Result<Forwarded, CliError> {
    let mut done = Forwarded::default();
    if !busy {
        inn.set_spin(Duration::ZERO);
        out.set_spin(Duration::ZERO);
    }
    inn.set_batching(true)?;
    out.set_batching(true)?;
    loop {
        // Busy: poll both in turn. Blocking: sleep on both at once until either has an event.
        let first = if busy {
            match inn.poll() {
                Some(ev) => Some((0, ev)),
                None => out.poll().map(|ev| (1, ev)),
            }
        } else {
            done.wakeups += 1;
            ferry::wait_any(&mut [&mut inn, &mut out], Some(STEP)).ok()
        };
        let Some(first) = first else {
            if inn.state() == ferry::ChannelState::Closed {
                return Err(CliError::Failed("upstream closed without a teardown".into()));
            }
            if busy {
                std::hint::spin_loop();
            }
            continue;
        };
        // Everything already waiting on either channel, then one flush
        // each. It stays with the channel it took the last event from while
        // that one has more: polling the other channel empty publishes what
        // is staged there, so switching after every event would send the
        // returns upstream one by one.
        let mut batch = 0u64;
        let mut returns = 0u64;
        let mut next = Some(first);
        while let Some((i, ev)) = next {
            if i == 0 {
                let moved = matches!(ev, Event::MoveReceived { .. });
                if let (true, Event::MoveReceived { buffer, .. }) = (touch, &ev) {
                    std::hint::black_box(pattern::touch(buffer));
                }
                if from_upstream(domain, &mut inn, &mut out, ev)? {
                    done.buffers += batch;
                    done.largest_batch = done.largest_batch.max(batch);
                    return Ok(done);
                }
                batch += u64::from(moved);
            } else {
                match ev {
                    Event::BufferPassed { buffer, meta } => {
                        send_when_room(buffer, false, |b| inn.pass(b, &meta))?;
                        returns += 1;
                        done.returns += 1;
                    }
                    Event::Error(e) => return Err(e.into()),
                    other => return Err(stage_got("forwarder (downstream)", &other)),
                }
            }
            let mut from_inn = |inn: &mut Channel| poll_upstream(inn, &mut returns, &mut done.return_publications);
            next = if i == 0 {
                match from_inn(&mut inn) {
                    Some(ev) => Some((0, ev)),
                    None => out.poll().map(|ev| (1, ev)),
                }
            } else {
                match out.poll() {
                    Some(ev) => Some((1, ev)),
                    None => from_inn(&mut inn).map(|ev| (0, ev)),
                }
            };
        }
        out.flush()?;
        inn.flush()?;
        if returns > 0 {
            done.return_publications += 1;
        }
        done.buffers += batch;
        done.largest_batch = done.largest_batch.max(batch);
    }
}

/// The last stage: checks each buffer, writes it to the sink if there is
/// one, passes it back; tells the coordinator through `report` when it is
/// ready and when each run is done. Its returns go back in batches.
fn consumer(
    a: &StageArgs,
    mut inn: Channel,
    busy: bool,
    report: &mut dyn FnMut(&str) -> Result<(), CliError>,
) -> Result<(), CliError> {
    let mut seq = 0u64;
    let mut sink: Option<std::fs::File> = None;
    // The returns go back in batches: published when nothing more is
    // waiting (the wait's first poll), with at most one doorbell, or
    // after half the buffers in flight, so that the producer refills
    // those while this stage writes the rest (a sink that returned a
    // whole window at once would leave the producer idle until its last
    // write: with a file as the sink, reading and writing took turns).
    inn.set_batching(true)?;
    let return_every = (a.window / 2).max(1) as u64;
    let mut unpublished = 0u64;
    if !busy {
        // Sleep at once when nothing is waiting, as the middle stages do:
        // more stages than cores, so a spinning end takes a CPU from the
        // stages that would bring it something.
        inn.set_spin(Duration::ZERO);
    }
    loop {
        match next(&mut inn, busy) {
            Some(Event::PoolAssignRequest(req)) => {
                inn.respond_pool(req.pool, true)?;
                report("ready")?;
            }
            Some(Event::MoveReceived { buffer, meta }) if a.sink.is_some() => {
                check_tag(&buffer, seq % per_run(a))?;
                if seq % per_run(a) == 0 {
                    sink = a.sink.as_ref().map(std::fs::File::create).transpose().map_err(failed("sink"))?;
                }
                if let Some(f) = &sink {
                    // The kernel reads the buffer's pages straight into the file (or nowhere: /dev/null).
                    write_all(f.as_fd(), &buffer)?;
                }
                seq += 1;
                send_when_room(buffer, false, |b| inn.pass(b, &meta))?;
                unpublished += 1;
                if unpublished >= return_every {
                    inn.flush()?;
                    unpublished = 0;
                }
                if seq % per_run(a) == 0 {
                    report(&format!("done {}", seq / per_run(a)))?;
                }
            }
            Some(Event::MoveReceived { buffer, meta }) => {
                check(&buffer, seq, a.touch)?;
                seq += 1;
                send_when_room(buffer, false, |b| inn.pass(b, &meta))?;
                unpublished += 1;
                if unpublished >= return_every {
                    inn.flush()?;
                    unpublished = 0;
                }
                if seq % per_run(a) == 0 {
                    report(&format!("done {}", seq / per_run(a)))?;
                }
            }
            Some(Event::Closed { .. }) | None => return Ok(()),
            Some(Event::Error(e)) => return Err(e.into()),
            Some(other) => return Err(stage_got("consumer", &other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::setup::assign;

    /// A connected shared-memory channel from `creator` to `binder`, both in this process.
    fn connect(creator: &Domain, binder: &Domain, name: &str) -> (Channel, Channel) {
        let ep = Endpoint::shm_abstract(&format!("{name}-{}", std::process::id()));
        let setup =
            ChannelSetup { direction: Direction::Tx, role: Role::Master, meta_size: 16, ..ChannelSetup::default() };
        let mut c = Channel::create(creator, &ep, setup).unwrap();
        let mut b = Channel::bind(binder, &ep, BindParams::default()).unwrap();
        assert!(matches!(c.wait(Some(STEP)), Ok(Event::BindRequest { .. })));
        assert!(matches!(b.wait(Some(STEP)), Ok(Event::Bound)));
        (c, b)
    }

    /// The producer fills every free buffer in one read and moves them on
    /// together. Its source is a pipe fed by the test: with one buffer's
    /// bytes in it, nothing moves (it reads on until all eight are full);
    /// once all eight are written, the stage downstream finds all eight
    /// at its first wake-up, published together.
    #[test]
    fn the_producer_moves_every_free_buffer_in_one_batch() {
        let (a, c) = (Domain::new("source"), Domain::new("down"));
        let (mut out, mut down) = connect(&a, &c, "produce-test");
        let alloc = Allocator::new(&a, 8, 4096, PoolConstraints::default()).unwrap();
        assign(&mut out, &mut down, alloc.pool()).unwrap();
        let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        let mut feed = std::fs::File::from(w);
        let chunk = |seq: u64| {
            let mut c = vec![7u8; 4096];
            c[..8].copy_from_slice(&seq.to_le_bytes());
            c
        };
        let producer = std::thread::spawn(move || {
            let mut port = ferry_io::Port::from_fd(r, "feed").unwrap();
            let mut seq = 0u64;
            produce(&mut out, &alloc, Some(&mut port), &mut seq, 8, false, false).map(|()| (out, alloc, seq))
        });
        feed.write_all(&chunk(0)).unwrap();
        if let Ok(ev) = down.wait(Some(Duration::from_millis(300))) {
            panic!("before every free buffer was filled, downstream got {}", describe_event(&ev));
        }
        for seq in 1..8 {
            feed.write_all(&chunk(seq)).unwrap();
        }
        let mut got = Vec::new();
        let mut ev = down.wait(Some(STEP)).ok();
        while let Some(e) = ev {
            match e {
                Event::MoveReceived { buffer, meta } => got.push((buffer, meta)),
                other => panic!("expected a buffer, got {}", describe_event(&other)),
            }
            ev = down.poll();
        }
        assert_eq!(got.len(), 8, "all eight visible downstream together");
        for (seq, (buffer, meta)) in got.iter().enumerate() {
            assert_eq!(meta[..8], (seq as u64).to_le_bytes());
            assert_eq!(buffer[..], chunk(seq as u64)[..], "buffer {seq} holds what was read for it");
        }
        let (_out, _alloc, seq) = producer.join().unwrap().unwrap();
        assert_eq!(seq, 8);
    }

    /// Eight buffers wait upstream when the middle stage starts: it moves
    /// all eight on in its first wake-up, in one batch; their eight
    /// returns, passed back together, go upstream together too (one
    /// publication). (Where the consumer sees a batch end is up to the
    /// shared-memory link, which may publish the first message of a batch
    /// at once when its peer waits for it: the stage's own counts say what
    /// it batched.)
    #[test]
    fn a_middle_stage_forwards_everything_waiting_in_one_wake_up() {
        let (a, b, c) = (Domain::new("up"), Domain::new("middle"), Domain::new("down"));
        let (mut up, mut inn) = connect(&a, &b, "fwd-test-in");
        let (mut out, mut down) = connect(&b, &c, "fwd-test-out");
        let alloc = Allocator::new(&a, 8, 4096, PoolConstraints::default()).unwrap();
        assign(&mut up, &mut inn, alloc.pool()).unwrap();
        let pool = b.pool(alloc.pool().id()).expect("accepted in the middle");
        assign(&mut out, &mut down, &pool).unwrap();
        for seq in 0u64..8 {
            up.move_buffer(alloc.alloc().unwrap(), &seq.to_le_bytes()).unwrap();
        }
        let middle = std::thread::spawn(move || forwarder(&b, inn, out, false, false));
        let mut got = Vec::new();
        while got.len() < 8 {
            match down.wait(Some(STEP)) {
                Ok(Event::MoveReceived { buffer, meta }) => got.push((buffer, meta)),
                other => panic!("expected a buffer, got {}", describe_event(&other.unwrap_or(Event::Bound))),
            }
        }
        // The returns go back in one batch too. (A batching shm end
        // publishes the answer to what it just received at once when it
        // last published before that; publishing first, with nothing
        // staged, leaves the eight returns to the one flush below.)
        down.flush().unwrap();
        down.set_batching(true).unwrap();
        for (seq, (buffer, meta)) in got.into_iter().enumerate() {
            assert_eq!(meta[..8], (seq as u64).to_le_bytes());
            down.pass(buffer, &meta).unwrap();
        }
        down.flush().unwrap();
        // Every buffer comes home through the middle stage; then close the
        // chain.
        for _ in 0..8 {
            match up.wait(Some(STEP)) {
                Ok(Event::BufferPassed { buffer, .. }) => drop(buffer),
                other => panic!("expected a return, got {}", describe_event(&other.unwrap_or(Event::Bound))),
            }
        }
        assert_eq!(alloc.available(), 8);
        up.teardown().unwrap();
        let t0 = Instant::now();
        while !middle.is_finished() {
            assert!(t0.elapsed() < STEP, "the middle stage did not end");
            let _ = down.wait(Some(Duration::from_millis(10)));
            let _ = up.poll();
        }
        let done = middle.join().unwrap().unwrap();
        assert_eq!(done.buffers, 8);
        assert_eq!(done.largest_batch, 8, "{done:?}");
        assert_eq!((done.returns, done.return_publications), (8, 1), "{done:?}");
        // One wake-up for the eight, one for the returns, one for the close
        // (returns and close may share one): never one per buffer.
        assert!(done.wakeups <= 3, "{done:?}");
    }

    /// The last stage passes its returns back in batches (at most half
    /// the buffers in flight: four of eight): with eight buffers waiting
    /// and a sink (a FIFO read by the test) that takes one buffer at a
    /// time, no return reaches the stage upstream while the sink is stuck
    /// on the second buffer (one per buffer would have sent the first);
    /// once the sink has written four, those four come back while it is
    /// stuck again, and the other four once it has written all eight.
    #[test]
    fn the_last_stage_passes_its_returns_back_together() {
        const SIZE: usize = 65536; // what a FIFO holds by default: one buffer
        let dir = std::env::temp_dir().join(format!("ferry-consumer-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("sink");
        let _ = std::fs::remove_file(&fifo);
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
            0,
        )
        .unwrap();
        let (a, c) = (Domain::new("up"), Domain::new("sink"));
        let (mut up, mut inn) = connect(&a, &c, "consumer-test");
        let alloc = Allocator::new(&a, 8, SIZE, PoolConstraints::default()).unwrap();
        assign(&mut up, &mut inn, alloc.pool()).unwrap();
        up.set_batching(true).unwrap();
        for seq in 0u64..8 {
            let mut b = alloc.alloc().unwrap();
            b.as_mut_slice().unwrap()[..8].copy_from_slice(&seq.to_le_bytes());
            up.move_buffer(b, &seq.to_le_bytes()).unwrap();
        }
        up.flush().unwrap();
        let args = StageArgs {
            variant: Variant::Ferry,
            index: 1,
            stages: 2,
            size: SIZE,
            total: 8 * SIZE as u64,
            window: 8,
            name: String::new(),
            busy_poll: false,
            touch: false,
            source: None,
            sink: Some(fifo.clone()),
            touch_middle: false,
        };
        let (said, lines) = mpsc::channel();
        let sink = std::thread::spawn(move || {
            consumer(&args, inn, false, &mut |line: &str| {
                let _ = said.send(line.to_owned());
                Ok(())
            })
        });
        // Opening blocks until the last stage opens its end to write.
        let mut drain = std::fs::File::open(&fifo).unwrap();
        if let Ok(ev) = up.wait(Some(Duration::from_millis(300))) {
            panic!("while the sink was stuck on the second buffer, upstream got {}", describe_event(&ev));
        }
        let mut written = vec![0u8; 8 * SIZE];
        // Four buffers taken: the first four returns come back while the
        // sink is still stuck on the sixth (a whole window returned at once
        // would keep the producer waiting for the last write).
        std::io::Read::read_exact(&mut drain, &mut written[..4 * SIZE]).unwrap();
        // `n` returns, within STEP (`what`: when they were expected).
        let returns = |up: &mut Channel, n: usize, what: &str| {
            let t0 = Instant::now();
            let mut back = 0;
            while back < n {
                assert!(t0.elapsed() < STEP, "only {back} of {n} returns {what}");
                match up.wait(Some(STEP)) {
                    Ok(Event::BufferPassed { buffer, .. }) => drop(buffer),
                    Ok(other) => panic!("expected a return, got {}", describe_event(&other)),
                    Err(_) => continue,
                }
                back += 1;
            }
        };
        returns(&mut up, 4, "while the sink was stuck on the sixth buffer");
        std::io::Read::read_exact(&mut drain, &mut written[4 * SIZE..]).unwrap();
        for seq in 0..8 {
            assert_eq!(written[seq * SIZE..][..8], (seq as u64).to_le_bytes(), "buffer {seq} in the sink");
        }
        returns(&mut up, 4, "after the last write");
        assert_eq!(lines.recv_timeout(STEP).unwrap(), "done 1");
        up.teardown().unwrap();
        sink.join().unwrap().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
