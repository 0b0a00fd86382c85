//! `ferry bench layers`: the layered protocol stack of fbufs (Druschel and
//! Peterson, "Fbufs: A High-Bandwidth Cross-Domain Transfer Facility",
//! SOSP 1993, §2) on Ferry's aggregates, against the same stack that
//! copies at every layer.
//!
//! Three real processes joined by shm channels, A → B → C: A (this
//! process) is the sending stack, B (`ferry bench-child layers --role
//! router`) a router domain in the middle, C (`--role receiver`) the
//! receiving stack. Per message of S bytes (`--size`, default 64 KiB,
//! 256 KiB, 1 MiB and 4 MiB):
//!
//! 1. **Application** (A): fills the S payload bytes of a buffer taken from
//!    a [`DataPath`] (one byte value per message, and a stamp of the
//!    message and page number at the start of every 4 KiB page), on every
//!    message; on every 16th message it also computes a
//!    checksum of the payload, carried in its header. Then it adds its
//!    32-byte header.
//! 2. **Transport** (A): adds its 32-byte header.
//! 3. **Network** (A): adds its 32-byte header and fragments the datagram
//!    (S + 96 bytes) into 4 KiB units, each preceded by a 16-byte unit
//!    header (message, unit number, length), the last unit shorter.
//!
//! B reads the first unit header of each message (its routing decision),
//! forwards the message to C and hands returned buffers on to A. C
//! reassembles the units into one datagram, strips the network, transport
//! and application headers in turn, checks every header (message number,
//! unit numbers, lengths) and, on the sampled messages, recomputes the
//! payload checksum and compares it with the application header's
//! (`verified` counts them). The buffers then go back to A.
//!
//! * **aggregate** stack: the payload buffer becomes an [`Aggregate`];
//!   each layer's header is a buffer of its own (`from_bytes_in`, the 32
//!   header bytes being the only bytes written) put in front with
//!   `prepend`; the network layer writes the unit headers into one
//!   header buffer and builds the unit train by moving unit header and
//!   unit off the front of the header buffer's aggregate and the datagram
//!   in turn (`append_from`). The whole train (all units,
//!   two fragments each) crosses each channel as **one** aggregate
//!   (`send_aggregate`): a message is the unit of the stack's work, and one
//!   crossing per message keeps the per-message channel cost (a few ring
//!   slots: header, one per buffer, the fragment table) away from the
//!   per-unit cost; B could still route per unit, since it sees every unit
//!   header. B forwards the received aggregate as it is (an aggregate
//!   received and not edited goes on with the fragment table it came
//!   with: B builds no fragment list). C reads each unit
//!   header, moves it aside and the unit's bytes onto the datagram
//!   (`append_from`, taking the pieces off the received table), where the
//!   pieces of the payload buffer merge back into one fragment;
//!   each layer then splits its header off and reads it. The headers split
//!   off are kept aside rather than clipped away (a clip would drop them
//!   in C, where the moved header buffers would go to C's free list), and
//!   at the end `into_members` hands every buffer back, passed to B and by
//!   B to A, where it returns to its pool: no payload byte is copied
//!   anywhere (`copies_user` 0).
//! * **copying** stack: the same processes, channels, sizes, headers and
//!   checks, but every layer copies. In A: the application layer copies
//!   header + payload (S) into a new buffer, the transport and network
//!   layers each copy header + everything below into a new buffer, and
//!   fragmentation copies every unit (header + piece) into a train buffer,
//!   which is moved to B: 4 copies of about S. B copies the train into a
//!   fresh buffer of its own, moves that to C and passes A's back: 1 copy.
//!   C copies the units' pieces into a reassembly buffer, then each layer
//!   copies everything after its header into a new buffer: 4 copies. In
//!   all 9 copies of about S per message (`copies_user` 9).
//!
//! Both stacks fill the payload, and take and return buffers, alike; at
//! most 8 MiB of messages (and at least 4) are in flight. A run is `per_run` messages (about
//! 256 MiB), timed from the first message to C's report that it checked the
//! last; the per-layer costs are the time of each layer's header (and
//! fragment) work, measured in A and C, averaged over a run's messages.
//! Every sample is the median over runs; `--rounds` repeats the two stacks
//! alternately and the ratio is taken of medians over every round.

use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use ferry::{
    Aggregate, Allocator, BindParams, Buffer, Channel, ChannelSetup, DataPath, Domain, Endpoint, Event, Member,
    PathConfig, PathQuota, PoolConstraints, PoolId, PoolPolicy,
};
use serde_json::json;

use super::point::{Head, Point};
use super::progress::Progress;
use super::Ctx;
use crate::setup::{describe_event, send_when_room};
use crate::stats::{round, Summary};
use crate::CliError;

/// The sizes measured unless `--size` says.
pub const SIZES: [usize; 4] = [64 << 10, 256 << 10, 1 << 20, 4 << 20];
/// The largest message (the copying stack holds some 40 buffers of twice
/// the size across the three processes).
const MAX_SIZE: usize = 16 << 20;
/// Bytes of a unit's piece of the datagram.
const UNIT: usize = 4096;
/// Bytes of each layer's header.
const HDR: usize = 32;
/// Bytes of a unit header.
const UHDR: usize = 16;
/// Bytes of messages in flight at most (and at least 4 messages): enough
/// that each process finds several messages waiting when it wakes up, so a
/// run measures the stacks' work rather than three wake-ups per message.
const WINDOW_BYTES: usize = 8 << 20;

/// Messages in flight at most, for messages of `size` bytes.
fn window(size: usize) -> usize {
    (WINDOW_BYTES / size).max(4)
}
/// Setup steps.
const STEP: Duration = Duration::from_secs(20);
/// Longest run.
const RUN_LIMIT: Duration = Duration::from_secs(120);
/// Header magic numbers: application, transport, network.
const MAGIC: [u64; 3] = [0x4150_504c_4159_4552, 0x5452_414e_5350_4f52, 0x4e45_5457_4f52_4b21];

/// The two stacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Stack {
    /// Headers and units as aggregates: no payload copy.
    Aggregate,
    /// Every layer copies.
    Copying,
}

impl Stack {
    fn name(self) -> &'static str {
        match self {
            Stack::Aggregate => "aggregate",
            Stack::Copying => "copying",
        }
    }
}

/// Which process of the stack a child is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Part {
    /// B, the router in the middle.
    Router,
    /// C, the receiving stack.
    Receiver,
}

/// Arguments of B and C (set by the coordinator).
#[derive(Debug, Args)]
pub struct ChildArgs {
    #[arg(long, value_enum)]
    role: Part,
    #[arg(long, value_enum)]
    stack: Stack,
    #[arg(long)]
    size: usize,
    #[arg(long)]
    per_run: u64,
    #[arg(long)]
    verify_every: u64,
    /// Endpoint name stem.
    #[arg(long)]
    name: String,
}

fn fail(msg: impl Into<String>) -> CliError {
    CliError::Failed(msg.into())
}

/// Units of a message of `size` payload bytes.
fn units(size: usize) -> usize {
    (size + 3 * HDR).div_ceil(UNIT)
}

/// Bytes of a buffer holding the datagram or the unit train of the copying stack.
fn big(size: usize) -> usize {
    (size + 3 * HDR + units(size) * UHDR).next_power_of_two()
}

/// Bytes of the unit-header buffer of the aggregate stack.
fn uhdr_buf(size: usize) -> usize {
    (units(size) * UHDR).next_power_of_two().max(4096)
}

fn header(words: [u64; 4]) -> [u8; HDR] {
    let mut h = [0u8; HDR];
    for (c, w) in h.chunks_exact_mut(8).zip(words) {
        c.copy_from_slice(&w.to_le_bytes());
    }
    h
}

fn words<const N: usize>(b: &[u8]) -> [u64; N] {
    let mut w = [0u64; N];
    for (x, c) in w.iter_mut().zip(b.chunks_exact(8)) {
        *x = u64::from_le_bytes(c.try_into().expect("8 bytes"));
    }
    w
}

fn unit_header(seq: u64, idx: usize, len: usize) -> [u8; UHDR] {
    let mut h = [0u8; UHDR];
    h[..8].copy_from_slice(&seq.to_le_bytes());
    h[8..12].copy_from_slice(&(idx as u32).to_le_bytes());
    h[12..].copy_from_slice(&(len as u32).to_le_bytes());
    h
}

fn parse_unit(h: &[u8]) -> (u64, usize, usize) {
    let seq = u64::from_le_bytes(h[..8].try_into().expect("8"));
    let idx = u32::from_le_bytes(h[8..12].try_into().expect("4")) as usize;
    let len = u32::from_le_bytes(h[12..16].try_into().expect("4")) as usize;
    (seq, idx, len)
}

/// The application's payload of message `seq`.
fn fill(buf: &mut [u8], seq: u64) {
    buf.fill(seq as u8 | 1);
    for (page, c) in buf.chunks_mut(UNIT).enumerate().filter(|(_, c)| c.len() >= 16) {
        c[..8].copy_from_slice(&seq.to_le_bytes());
        c[8..16].copy_from_slice(&(page as u64).to_le_bytes());
    }
}

/// A position-dependent checksum over a byte stream given in pieces
/// (four independent multiply chains, word i in chain i mod 4).
#[derive(Default)]
struct Sum {
    acc: [u64; 4],
    words: usize,
    carry: [u8; 8],
    n: usize,
}

impl Sum {
    fn word(&mut self, w: u64) {
        let a = &mut self.acc[self.words & 3];
        *a = (*a ^ w).wrapping_mul(0x100_0000_01b3).rotate_left(7);
        self.words += 1;
    }

    fn feed(&mut self, mut b: &[u8]) {
        while self.n > 0 && !b.is_empty() {
            self.carry[self.n] = b[0];
            self.n = (self.n + 1) % 8;
            b = &b[1..];
            if self.n == 0 {
                self.word(u64::from_le_bytes(self.carry));
            }
        }
        while self.words & 3 != 0 && b.len() >= 8 {
            self.word(u64::from_le_bytes(b[..8].try_into().expect("8 bytes")));
            b = &b[8..];
        }
        // Four words at a time, one per chain (the same result as word by word).
        let mut quads = b.chunks_exact(32);
        let mut acc = self.acc;
        for q in &mut quads {
            for (a, w) in acc.iter_mut().zip(q.chunks_exact(8)) {
                let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
                *a = (*a ^ w).wrapping_mul(0x100_0000_01b3).rotate_left(7);
            }
        }
        self.acc = acc;
        self.words += (b.len() / 32) * 4;
        let mut chunks = quads.remainder().chunks_exact(8);
        for c in &mut chunks {
            self.word(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        for &x in chunks.remainder() {
            self.carry[self.n] = x;
            self.n += 1;
        }
    }

    fn finish(mut self) -> u64 {
        if self.n > 0 {
            self.carry[self.n..].fill(0);
            self.word(u64::from_le_bytes(self.carry));
        }
        (self.acc[0] ^ self.acc[1].rotate_left(16) ^ self.acc[2].rotate_left(32) ^ self.acc[3].rotate_left(48)) | 1
    }
}

fn checksum(b: &[u8]) -> u64 {
    let mut s = Sum::default();
    s.feed(b);
    s.finish()
}

fn ep(name: &str, i: usize) -> Endpoint {
    Endpoint::shm_abstract(&format!("{name}-{i}"))
}

fn setup() -> ChannelSetup {
    // Large slots: 14 fragment-table entries each (a train of units folds
    // into about 10 entries, a table of other shapes takes one per fragment).
    ChannelSetup { meta_size: ferry::MAX_META_SIZE, queue_depth: 4096, ..ChannelSetup::default() }
}

fn meta(seq: u64, len: usize) -> [u8; 16] {
    let mut m = [0u8; 16];
    m[..8].copy_from_slice(&seq.to_le_bytes());
    m[8..].copy_from_slice(&(len as u64).to_le_bytes());
    m
}

// ---------------------------------------------------------------- A (coordinator)

/// What one run measured.
struct Sample {
    secs: f64,
    /// Per message, ns: application, transport, network header, fragmentation,
    /// and the application's filling of the payload (A).
    a: [f64; 5],
    /// Per message, ns: reassembly, network, transport, application (C).
    c: [f64; 4],
    verified: u64,
}

/// `ferry bench layers`.
pub fn run(ctx: &mut Ctx<'_>) -> Result<(), CliError> {
    let a = ctx.args;
    if let Some(b) = a.backend.filter(|b| *b != super::Backend::Shm) {
        return Err(CliError::Usage(format!(
            "--backend {}: the layered stack runs over shm channels between three processes; give --backend shm or leave it out",
            b.name()
        )));
    }
    let sizes: Vec<usize> = if a.sizes.is_empty() { SIZES.to_vec() } else { a.sizes.clone() };
    if let Some(s) = sizes.iter().find(|s| **s < 65536 || **s > MAX_SIZE) {
        return Err(CliError::Usage(format!(
            "--size {s}: layers measures messages of 65536 to {MAX_SIZE} bytes; give e.g. 1048576"
        )));
    }
    let quick = a.quick;
    let runs = if quick { 1 } else { a.runs.unwrap_or(5) };
    let rounds = if quick { 1 } else { a.rounds };
    let verify_every = if quick { 1 } else { 16 };
    ctx.progress = Progress::new((sizes.len() * rounds * 2) as u64, a.json);
    let mut summary = Vec::new();
    for &size in &sizes {
        let per_run = if quick { 4 } else { ((256usize << 20) / size).max(32) as u64 };
        let mut all: [Vec<Sample>; 2] = [Vec::new(), Vec::new()];
        for round_no in 1..=rounds {
            for (k, stack) in [Stack::Aggregate, Stack::Copying].into_iter().enumerate() {
                ctx.progress.say(format!("layers {} {size}", stack.name()));
                let samples = measure(stack, size, runs, per_run, verify_every)?;
                let mut p = point(stack, size, runs, per_run, &samples)?;
                if rounds > 1 {
                    p.set("round", json!(round_no));
                }
                ctx.emit(p);
                ctx.progress.inc(1);
                all[k].extend(samples);
            }
        }
        let rate = |s: &[Sample]| med(s.iter().map(|x| per_run as f64 * size as f64 / x.secs / 1e9));
        let (ga, gc) = (rate(&all[0]), rate(&all[1]));
        let verified: u64 = all.iter().flatten().map(|s| s.verified).sum();
        summary.push((size, ga, gc, verified));
    }
    drop(std::mem::replace(&mut ctx.progress, Progress::hidden()));
    for (size, ga, gc, verified) in summary {
        let ratio = ga / gc;
        if a.json {
            println!(
                "{}",
                json!({"experiment": "layers", "kind": "ratio", "size": size, "ratio": round(ratio),
                    "aggregate_gb_s": round(ga), "copying_gb_s": round(gc), "verified": verified})
            );
        } else {
            println!(
                "layers size {size}: aggregate {ga:.3} GB/s, copying {gc:.3} GB/s, ratio {ratio:.2}x (same run; {verified} messages verified)"
            );
        }
    }
    Ok(())
}

fn med(it: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = it.collect();
    Summary::of(&v).map_or(0.0, |s| s.median)
}

fn point(stack: Stack, size: usize, runs: usize, per_run: u64, s: &[Sample]) -> Result<Point, CliError> {
    let rates: Vec<f64> = s.iter().map(|x| per_run as f64 * size as f64 / x.secs / 1e9).collect();
    let sum = Summary::of(&rates).ok_or_else(|| fail("no samples"))?;
    let msgs = med(s.iter().map(|x| per_run as f64 / x.secs));
    let a = |i: usize| round(med(s.iter().map(|x| x.a[i])));
    let c = |i: usize| round(med(s.iter().map(|x| x.c[i])));
    let head = Head {
        experiment: "layers",
        backend: "shm",
        size,
        trust: "full",
        mode: "blocking",
        touch: true,
        runs,
        unit: "GB/s",
    };
    let verified: u64 = s.iter().map(|x| x.verified).sum();
    let extra = json!({
        "variant": stack.name(), "units": units(size), "messages_per_run": per_run,
        "msgs_s": round(msgs), "verified": verified,
        "a_fill_ns": a(4), "a_app_ns": a(0), "a_transport_ns": a(1), "a_network_ns": a(2), "a_fragment_ns": a(3),
        "a_fragment_ns_per_unit": round(med(s.iter().map(|x| x.a[3])) / units(size) as f64),
        "c_reassemble_ns": c(0), "c_network_ns": c(1), "c_transport_ns": c(2), "c_app_ns": c(3),
        "c_reassemble_ns_per_unit": round(med(s.iter().map(|x| x.c[0])) / units(size) as f64),
    });
    let copies = match stack {
        Stack::Aggregate => 0,
        Stack::Copying => 9,
    };
    Ok(Point::new(head, sum, Some(copies), extra))
}

/// B and C as child processes, and C's report lines.
struct Peers {
    children: Vec<Child>,
    lines: mpsc::Receiver<(Instant, String)>,
}

impl Peers {
    fn start(stack: Stack, size: usize, per_run: u64, verify_every: u64, name: &str) -> Result<Peers, CliError> {
        let exe = std::env::current_exe().map_err(|e| fail(format!("cannot find own executable: {e}")))?;
        let mut peers = Peers { children: Vec::new(), lines: mpsc::channel().1 };
        for role in [Part::Router, Part::Receiver] {
            let mut cmd = Command::new(&exe);
            cmd.args(["bench-child", "layers", "--role"]).arg(format!("{role:?}").to_lowercase());
            cmd.arg("--stack").arg(stack.name());
            for (k, v) in [
                ("--size", size.to_string()),
                ("--per-run", per_run.to_string()),
                ("--verify-every", verify_every.to_string()),
                ("--name", name.to_string()),
            ] {
                cmd.arg(k).arg(v);
            }
            cmd.stdin(Stdio::null()).stderr(Stdio::inherit());
            cmd.stdout(if role == Part::Receiver { Stdio::piped() } else { Stdio::null() });
            let mut child = cmd.spawn().map_err(|e| fail(format!("cannot start the {role:?}: {e}")))?;
            if role == Part::Receiver {
                peers.lines = super::child::timed_lines(child.stdout.take().expect("piped"));
            }
            peers.children.push(child);
        }
        Ok(peers)
    }

    /// C's next line, if one came; an error if a child died.
    fn line(&mut self) -> Result<Option<(Instant, String)>, CliError> {
        match self.lines.try_recv() {
            Ok(l) => return Ok(Some(l)),
            Err(mpsc::TryRecvError::Empty) => {}
            Err(mpsc::TryRecvError::Disconnected) => return Err(fail("layers: the receiver process ended")),
        }
        for (i, c) in self.children.iter_mut().enumerate() {
            if let Ok(Some(st)) = c.try_wait() {
                let who = if i == 0 { "router" } else { "receiver" };
                return Err(fail(format!("layers: the {who} process died ({st})")));
            }
        }
        Ok(None)
    }

    fn stop(mut self) -> Result<(), CliError> {
        let t0 = Instant::now();
        for c in &mut self.children {
            loop {
                match c.try_wait() {
                    Ok(Some(st)) if st.success() => break,
                    Ok(Some(st)) => return Err(fail(format!("layers: a peer process failed ({st})"))),
                    Ok(None) if t0.elapsed() < STEP => std::thread::sleep(Duration::from_millis(2)),
                    Ok(None) => return Err(fail("layers: a peer process did not exit")),
                    Err(e) => return Err(fail(format!("layers: {e}"))),
                }
            }
        }
        Ok(())
    }
}

impl Drop for Peers {
    fn drop(&mut self) {
        for c in &mut self.children {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// A's state: the path, the header pools, and the messages in flight.
struct Sender {
    stack: Stack,
    size: usize,
    verify_every: u64,
    path: DataPath,
    /// Aggregate: layer headers; copying: the train buffers (on the channel).
    small: Allocator,
    /// Aggregate: unit-header buffers; copying: the layers' own buffers (local).
    second: Allocator,
    /// The pool whose returns end a message in flight.
    ret_pool: Option<PoolId>,
    inflight: usize,
}

impl Sender {
    fn new(stack: Stack, size: usize, verify_every: u64, name: &str) -> Result<Sender, CliError> {
        let domain = Domain::new("layers-a");
        let ch = Channel::accept(&domain, &ep(name, 0), setup(), STEP)?;
        let quota = PathQuota { max_pools: 1, max_bytes: (window(size) * size) as u64 };
        let mut path = DataPath::new(&domain, vec![ch], PathConfig::new(size, window(size) as u64, quota))?;
        let c = PoolConstraints::default();
        let (small, second) = match stack {
            Stack::Aggregate => (
                Allocator::new(&domain, (3 * window(size) + 3) as u64, 4096, c)?,
                Allocator::new(&domain, (window(size) + 1) as u64, uhdr_buf(size), c)?,
            ),
            Stack::Copying => (
                Allocator::new(&domain, (window(size) + 1) as u64, big(size), c)?,
                Allocator::new(&domain, 4, big(size), c)?,
            ),
        };
        path.channel_mut(0).assign_pool_and_wait(small.pool(), STEP)?;
        if stack == Stack::Aggregate {
            path.channel_mut(0).assign_pool_and_wait(second.pool(), STEP)?;
        }
        // Every buffer written once before measuring (no first-touch faults in the runs).
        for al in [&small, &second] {
            let mut v: Vec<Buffer> = std::iter::from_fn(|| al.alloc()).collect();
            for b in &mut v {
                b.as_mut_slice()?.fill(0);
            }
        }
        let first = path.alloc()?;
        let ret_pool = match stack {
            Stack::Aggregate => Some(first.id().pool),
            Stack::Copying => Some(small.pool().id()),
        };
        drop(first);
        Ok(Sender { stack, size, verify_every, path, small, second, ret_pool, inflight: 0 })
    }

    /// Take returned buffers; wait for an event first when `block`.
    fn drain(&mut self, block: bool) -> Result<(), CliError> {
        let ch = self.path.channel_mut(0);
        let mut ev = if block { ch.wait(Some(Duration::from_millis(5))).ok() } else { ch.poll() };
        while let Some(e) = ev {
            match e {
                Event::BufferPassed { buffer, .. } => {
                    if Some(buffer.id().pool) == self.ret_pool {
                        self.inflight -= 1;
                    }
                    drop(buffer);
                }
                Event::PoolAssigned(_) | Event::CopyReleased { .. } => {}
                Event::Error(e) => return Err(e.into()),
                other => return Err(fail(format!("layers: A got {}", describe_event(&other)))),
            }
            ev = self.path.channel_mut(0).poll();
        }
        Ok(())
    }

    fn take(&mut self, second: bool) -> Result<Buffer, CliError> {
        let t0 = Instant::now();
        loop {
            let al = if second { &self.second } else { &self.small };
            if let Some(b) = al.alloc() {
                return Ok(b);
            }
            if t0.elapsed() > STEP {
                return Err(fail("layers: A's buffers did not come back"));
            }
            self.drain(true)?;
        }
    }

    /// Build and send message `seq`; adds the time of each layer to `t`.
    fn send(&mut self, seq: u64, t: &mut [f64; 5]) -> Result<(), CliError> {
        let t0 = Instant::now();
        while self.inflight >= window(self.size) {
            if t0.elapsed() > RUN_LIMIT {
                return Err(fail("layers: no buffer came back"));
            }
            self.drain(true)?;
        }
        let size = self.size;
        // The application's data.
        let mut p = self.path.alloc()?;
        let tf = Instant::now();
        fill(&mut p.as_mut_slice()?[..size], seq);
        t[4] += tf.elapsed().as_nanos() as f64;
        let sum = if seq % self.verify_every == 0 { checksum(&p[..size]) } else { 0 };
        let hdrs = [
            header([MAGIC[0], seq, size as u64, sum]),
            header([MAGIC[1], seq, (size + HDR) as u64, 0]),
            header([MAGIC[2], seq, (size + 2 * HDR) as u64, units(size) as u64]),
        ];
        let n = units(size);
        let train_len = size + 3 * HDR + n * UHDR;
        let m = meta(seq, train_len);
        match self.stack {
            Stack::Aggregate => {
                let mut h = [self.take(false)?, self.take(false)?, self.take(false)?].into_iter();
                let uh = self.take(true)?;
                let mut l = Instant::now();
                let mut lap = |i: usize, t: &mut [f64; 5]| {
                    let now = Instant::now();
                    t[i] += now.duration_since(l).as_nanos() as f64;
                    l = now;
                };
                let mut msg = Aggregate::from_buffer_range(p, 0..size)?;
                for (i, hb) in hdrs.iter().enumerate() {
                    msg.prepend(Aggregate::from_bytes_in(h.next().expect("three"), hb)?);
                    lap(i, t);
                }
                let train = fragment(msg, uh, seq)?;
                lap(3, t);
                let ch = self.path.channel_mut(0);
                send_when_room(train, false, |a| ch.send_aggregate(a, &m))?;
            }
            Stack::Copying => {
                let mut l = Instant::now();
                let mut lap = |i: usize, t: &mut [f64; 5]| {
                    let now = Instant::now();
                    t[i] += now.duration_since(l).as_nanos() as f64;
                    l = now;
                };
                // Each layer: a new buffer, its header, then a copy of everything below.
                let mut below = p;
                let mut len = size;
                for (i, hb) in hdrs.iter().enumerate() {
                    let mut nb = self.take(true)?;
                    let s = nb.as_mut_slice()?;
                    s[..HDR].copy_from_slice(hb);
                    s[HDR..HDR + len].copy_from_slice(&below[..len]);
                    len += HDR;
                    below = nb;
                    lap(i, t);
                }
                // Fragmentation: every unit copied into the train.
                let mut train = self.take(false)?;
                let s = train.as_mut_slice()?;
                let mut at = 0;
                for (i, piece) in below[..len].chunks(UNIT).enumerate() {
                    s[at..at + UHDR].copy_from_slice(&unit_header(seq, i, piece.len()));
                    s[at + UHDR..at + UHDR + piece.len()].copy_from_slice(piece);
                    at += UHDR + piece.len();
                }
                drop(below);
                lap(3, t);
                let ch = self.path.channel_mut(0);
                send_when_room(train, false, |b| ch.move_buffer(b, &m))?;
            }
        }
        self.inflight += 1;
        self.drain(false)
    }

    fn close(mut self) -> Result<(), CliError> {
        let ch = self.path.channel_mut(0);
        ch.teardown()?;
        let t0 = Instant::now();
        while t0.elapsed() < STEP {
            match ch.wait(Some(Duration::from_millis(100))) {
                Ok(Event::Closed { .. }) => break,
                _ if ch.state() == ferry::ChannelState::Closed => break,
                _ => {}
            }
        }
        Ok(())
    }
}

/// The network layer's fragmentation: the datagram cut into units of
/// [`UNIT`] bytes, each behind its unit header (written into `uh`).
fn fragment(mut dgram: Aggregate, mut uh: Buffer, seq: u64) -> Result<Aggregate, CliError> {
    let len = dgram.len();
    let n = len.div_ceil(UNIT);
    {
        let s = uh.as_mut_slice()?;
        for i in 0..n {
            let piece = UNIT.min(len - i * UNIT);
            s[i * UHDR..(i + 1) * UHDR].copy_from_slice(&unit_header(seq, i, piece));
        }
    }
    let mut hdrs = Aggregate::from_buffer_range(uh, 0..n * UHDR)?;
    let mut train = Aggregate::new();
    train.reserve(2 * n);
    for _ in 0..n {
        train.append_from(&mut hdrs, UHDR)?;
        let piece = UNIT.min(dgram.len());
        train.append_from(&mut dgram, piece)?;
    }
    Ok(train)
}

/// One (stack, size): start B and C, a warm-up run and `runs` runs.
fn measure(stack: Stack, size: usize, runs: usize, per_run: u64, verify_every: u64) -> Result<Vec<Sample>, CliError> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let name = format!("ferry-layers-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
    let mut peers = Peers::start(stack, size, per_run, verify_every, &name)?;
    let mut a = Sender::new(stack, size, verify_every, &name)?;
    let mut seq = 0u64;
    let mut out = Vec::with_capacity(runs);
    for run in 0..=runs {
        let mut t = [0f64; 5];
        let t0 = Instant::now();
        for _ in 0..per_run {
            a.send(seq, &mut t)?;
            seq += 1;
        }
        // Until C says it has checked the run's last message.
        let (at, line) = loop {
            if let Some(l) = peers.line()? {
                break l;
            }
            if t0.elapsed() > RUN_LIMIT {
                return Err(fail(format!("layers: no report from the receiver within {} s", RUN_LIMIT.as_secs())));
            }
            a.drain(true)?;
        };
        let f: Vec<&str> = line.split_whitespace().collect();
        let nums: Vec<f64> = f.iter().skip(1).filter_map(|x| x.parse().ok()).collect();
        if f.first() != Some(&"done") || nums.len() != 5 {
            return Err(fail(format!("layers: the receiver said \"{line}\"")));
        }
        if run > 0 {
            let pm = |x: f64| x / per_run as f64;
            out.push(Sample {
                secs: at.duration_since(t0).as_secs_f64(),
                a: t.map(pm),
                c: [pm(nums[1]), pm(nums[2]), pm(nums[3]), pm(nums[4])],
                verified: nums[0] as u64,
            });
        }
    }
    a.close()?;
    peers.stop()?;
    if out.iter().map(|s| s.verified).sum::<u64>() == 0 {
        return Err(fail("layers: the receiver verified no message"));
    }
    Ok(out)
}

// ---------------------------------------------------------------- B and C

/// `ferry bench-child layers`.
pub fn child(a: &ChildArgs) -> Result<(), CliError> {
    let r = match a.role {
        Part::Router => router(a),
        Part::Receiver => receiver(a),
    };
    r.map_err(|e| fail(format!("layers {:?}: {e}", a.role)))
}

fn router(a: &ChildArgs) -> Result<(), CliError> {
    let domain = Domain::new("layers-b");
    let mut out = Channel::accept(&domain, &ep(&a.name, 1), setup(), STEP)?;
    let mut inn = Channel::connect(&domain, &ep(&a.name, 0), BindParams::default(), STEP)?;
    // B's own buffers for the copying stack (made in both, so the two differ only in copying).
    let own = Allocator::new(&domain, (2 * window(a.size) + 2) as u64, big(a.size), PoolConstraints::default())?;
    out.assign_pool_and_wait(own.pool(), STEP)?;
    loop {
        let Ok((i, ev)) = ferry::wait_any(&mut [&mut inn, &mut out], Some(STEP)) else {
            if inn.state() == ferry::ChannelState::Closed {
                return Ok(());
            }
            continue;
        };
        match (i, ev) {
            (0, Event::PoolAssignRequest(req)) => ferry::forward_pool(&mut inn, req.pool, &mut [&mut out], STEP)?,
            (0, Event::Aggregate { agg, meta }) => {
                // The routing decision: read the first unit header.
                let first = agg.fragments().next().ok_or_else(|| fail("empty message"))?;
                let (seq, idx, _) = parse_unit(first.bytes());
                if idx != 0 || meta[..8] != seq.to_le_bytes() {
                    return Err(fail(format!("message {seq}: bad first unit")));
                }
                send_when_room(agg, false, |x| out.send_aggregate(x, &meta))?;
            }
            (0, Event::MoveReceived { buffer, meta }) => {
                let len = words::<2>(&meta)[1] as usize;
                let (seq, idx, _) = parse_unit(&buffer[..UHDR]);
                if idx != 0 || meta[..8] != seq.to_le_bytes() {
                    return Err(fail(format!("message {seq}: bad first unit")));
                }
                let mut fresh = loop {
                    if let Some(b) = own.alloc() {
                        break b;
                    }
                    match out.wait(Some(STEP)) {
                        Ok(Event::BufferPassed { buffer, .. }) => drop(buffer),
                        Ok(Event::Error(e)) => return Err(e.into()),
                        Ok(other) => return Err(fail(format!("B got {}", describe_event(&other)))),
                        Err(_) => return Err(fail("B's buffers did not come back")),
                    }
                };
                fresh.as_mut_slice()?[..len].copy_from_slice(&buffer[..len]);
                send_when_room(buffer, false, |b| inn.pass(b, &[]))?;
                send_when_room(fresh, false, |b| out.move_buffer(b, &meta))?;
            }
            (0, Event::Closed { .. }) => {
                out.teardown()?;
                while let Ok(ev) = out.wait(Some(STEP)) {
                    if matches!(ev, Event::Closed { .. }) {
                        break;
                    }
                }
                return Ok(());
            }
            (1, Event::BufferPassed { buffer, .. }) => {
                if buffer.id().pool == own.pool().id() {
                    drop(buffer);
                } else {
                    send_when_room(buffer, false, |b| inn.pass(b, &[]))?;
                }
            }
            (_, Event::PoolAssigned(_) | Event::CopyReleased { .. }) => {}
            (_, Event::Error(e)) => return Err(e.into()),
            (_, other) => return Err(fail(format!("B got {}", describe_event(&other)))),
        }
    }
}

/// The first `N` words of an aggregate (a header).
fn agg_words<const N: usize>(a: &Aggregate) -> [u64; N] {
    match a.fragments().next() {
        Some(f) if f.bytes().len() >= 8 * N => words(f.bytes()),
        _ => words(&a.to_vec()),
    }
}

fn check_header(w: [u64; 4], layer: usize, seq: u64, len: usize) -> Result<(), CliError> {
    if w[0] != MAGIC[layer] || w[1] != seq || w[2] != len as u64 {
        return Err(fail(format!("message {seq}: layer {} header wrong: {w:x?}", 3 - layer)));
    }
    Ok(())
}

/// Units `first..first + n` of message `seq` (the whole of `units`): each
/// unit's header read, checked and put on `spent`, its bytes on `dgram`.
/// `append_from` moves each piece off the front in time independent of
/// the units left, and makes no aggregate in between.
fn reassemble(
    mut units: Aggregate,
    first: usize,
    n: usize,
    seq: u64,
    dgram: &mut Aggregate,
    spent: &mut Aggregate,
) -> Result<(), CliError> {
    for idx in first..first + n {
        if units.len() < UHDR {
            return Err(fail(format!("message {seq}: unit {idx} expected, {} bytes left", units.len())));
        }
        let (s, i, len) = match units.fragments().next() {
            Some(f) if f.bytes().len() >= UHDR => parse_unit(&f.bytes()[..UHDR]),
            _ => parse_unit(&units.to_vec()[..UHDR]),
        };
        spent.append_from(&mut units, UHDR)?;
        if s != seq || i != idx || len > units.len() || (len < UNIT && len != units.len()) {
            return Err(fail(format!("message {seq}: unit {idx} expected, got {s}/{i} of {len} bytes")));
        }
        dgram.append_from(&mut units, len)?;
    }
    if !units.is_empty() {
        return Err(fail(format!("message {seq}: {} bytes after the last unit", units.len())));
    }
    Ok(())
}

fn receiver(a: &ChildArgs) -> Result<(), CliError> {
    let domain = Domain::new("layers-c");
    let mut inn = Channel::connect(&domain, &ep(&a.name, 1), BindParams::default(), STEP)?;
    inn.set_pool_policy(PoolPolicy::AcceptAll);
    let size = a.size;
    let scratch = Allocator::new(&domain, 4, big(size), PoolConstraints::default())?;
    let mut seq = 0u64;
    let mut t = [0f64; 4];
    let mut verified = 0u64;
    let stdout = std::io::stdout();
    loop {
        let ev = match inn.wait(Some(STEP)) {
            Ok(ev) => ev,
            Err(_) if inn.state() == ferry::ChannelState::Closed => return Ok(()),
            Err(_) => continue,
        };
        let verify = seq % a.verify_every == 0;
        match ev {
            Event::Aggregate { agg, meta } => {
                if words::<1>(&meta)[0] != seq {
                    return Err(fail(format!("message {seq} expected, got {meta:?}")));
                }
                let mut l = Instant::now();
                let mut lap = |i: usize, t: &mut [f64; 4]| {
                    let now = Instant::now();
                    t[i] += now.duration_since(l).as_nanos() as f64;
                    l = now;
                };
                // Reassembly: unit headers aside, the units' bytes joined (the
                // payload pieces merge back into one fragment).
                let mut spent = Aggregate::new();
                let mut dgram = Aggregate::new();
                let n = agg.len().div_ceil(UNIT + UHDR);
                reassemble(agg, 0, n, seq, &mut dgram, &mut spent)?;
                lap(0, &mut t);
                // Each layer: its header split off, read and checked.
                let mut hdr_sum = 0;
                for (k, layer) in [2usize, 1, 0].into_iter().enumerate() {
                    let body = dgram.split_off(HDR)?;
                    let w = agg_words::<4>(&dgram);
                    check_header(w, layer, seq, body.len())?;
                    if layer == 0 {
                        hdr_sum = w[3];
                    }
                    spent.append(std::mem::replace(&mut dgram, body));
                    lap(k + 1, &mut t);
                }
                if dgram.len() != size {
                    return Err(fail(format!("message {seq}: {} payload bytes", dgram.len())));
                }
                if verify {
                    let mut s = Sum::default();
                    for f in dgram.fragments() {
                        s.feed(f.bytes());
                    }
                    if s.finish() != hdr_sum {
                        return Err(fail(format!("message {seq}: payload checksum wrong")));
                    }
                    verified += 1;
                }
                let all = dgram.join(spent);
                let members = all.into_members().map_err(|_| fail("a buffer is still shared"))?;
                for m in members {
                    if let Member::Buffer(b) = m {
                        send_when_room(b, false, |b| inn.pass(b, &[]))?;
                    }
                }
            }
            Event::MoveReceived { buffer, meta } => {
                let [s0, len] = words::<2>(&meta);
                if s0 != seq {
                    return Err(fail(format!("message {seq} expected, got {s0}")));
                }
                let len = len as usize;
                let mut l = Instant::now();
                let mut lap = |i: usize, t: &mut [f64; 4]| {
                    let now = Instant::now();
                    t[i] += now.duration_since(l).as_nanos() as f64;
                    l = now;
                };
                // Reassembly: the units' pieces copied into one buffer.
                let mut r = scratch.alloc().ok_or_else(|| fail("C's scratch buffers ran out"))?;
                let (mut at, mut got, mut idx) = (0, 0, 0);
                {
                    let d = r.as_mut_slice()?;
                    while at < len {
                        let (s, i, n) = parse_unit(&buffer[at..at + UHDR]);
                        if s != seq || i != idx || at + UHDR + n > len {
                            return Err(fail(format!("message {seq}: unit {idx} expected, got {s}/{i}")));
                        }
                        d[got..got + n].copy_from_slice(&buffer[at + UHDR..at + UHDR + n]);
                        at += UHDR + n;
                        got += n;
                        idx += 1;
                    }
                }
                lap(0, &mut t);
                // Each layer: its header checked, the rest copied out into a new buffer.
                let mut hdr_sum = 0;
                for (k, layer) in [2usize, 1, 0].into_iter().enumerate() {
                    let w = words::<4>(&r[..HDR]);
                    check_header(w, layer, seq, got - HDR)?;
                    if layer == 0 {
                        hdr_sum = w[3];
                    }
                    let mut nb = scratch.alloc().ok_or_else(|| fail("C's scratch buffers ran out"))?;
                    nb.as_mut_slice()?[..got - HDR].copy_from_slice(&r[HDR..got]);
                    got -= HDR;
                    r = nb;
                    lap(k + 1, &mut t);
                }
                if got != size {
                    return Err(fail(format!("message {seq}: {got} payload bytes")));
                }
                if verify {
                    if checksum(&r[..size]) != hdr_sum {
                        return Err(fail(format!("message {seq}: payload checksum wrong")));
                    }
                    verified += 1;
                }
                drop(r);
                send_when_room(buffer, false, |b| inn.pass(b, &[]))?;
            }
            Event::PoolAssignRequest(_) | Event::PoolAssigned(_) | Event::CopyReleased { .. } => continue,
            Event::Closed { .. } => return Ok(()),
            Event::Error(e) => return Err(e.into()),
            other => return Err(fail(format!("C got {}", describe_event(&other)))),
        }
        seq += 1;
        if seq % a.per_run == 0 {
            let mut o = stdout.lock();
            writeln!(o, "done {verified} {} {} {} {}", t[0], t[1], t[2], t[3])
                .and_then(|()| o.flush())
                .map_err(|e| fail(format!("report: {e}")))?;
            t = [0.0; 4];
            verified = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checksum is the same however the bytes are cut into pieces,
    /// and changes when bytes move.
    #[test]
    fn checksum_of_pieces() {
        let mut b = vec![0u8; 3 * UNIT + 5];
        fill(&mut b, 7);
        let whole = checksum(&b);
        for cuts in [&[1usize, 9, 40, 4095][..], &[8, 16, 33], &[31, 32, 64, 100, 8000]] {
            let mut s = Sum::default();
            let mut at = 0;
            for &c in cuts {
                s.feed(&b[at..c]);
                at = c;
            }
            s.feed(&b[at..]);
            assert_eq!(s.finish(), whole, "{cuts:?}");
        }
        b.swap(8, UNIT + 8);
        assert_ne!(checksum(&b), whole);
    }
}
