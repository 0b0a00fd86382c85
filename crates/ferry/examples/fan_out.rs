//! One source, three sink processes over shared memory: the source
//! publishes each buffer to every sink at once as a read-only copy
//! (`ferry::FanOut`), and gets it back, writable, when the last sink has
//! released its copy. Each sink checks every byte; the program exits
//! non-zero on any mismatch. 16 MiB in 64 KiB buffers by default
//! (`--bytes N` for another amount).
//!
//! ```text
//! cargo run -p ferry --release --example fan_out
//! ```
//!
//! Run without arguments, it starts the sinks as child processes of itself
//! (`--role sink --path SOCKET`).

// The two-party examples' send and receive loops are not used here: a fan-out has its own.
#[allow(dead_code)]
mod common;

use std::path::PathBuf;
use std::process::{Child, Command, ExitCode};
use std::time::Instant;

use ferry::{
    Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, FanOut, FanOutEvent, PoolConstraints,
    PoolPolicy,
};

use common::{exit_code, summary, Args, Result, BUFFER_SIZE, TIMEOUT};

/// Sink processes.
const SINKS: usize = 3;
/// Buffers in the source's pool: the most published at once.
const POOL_BUFFERS: u64 = 8;

fn main() -> ExitCode {
    exit_code(run())
}

fn run() -> Result<()> {
    let args = Args::parse(&["role", "path", "bytes"])?;
    let bytes = args.bytes()?;
    match (args.get("role"), args.get("path")) {
        (Some("sink"), Some(path)) => sink(PathBuf::from(path), bytes),
        (None, None) => source(bytes),
        _ => Err("usage: fan_out [--role sink --path SOCKET] [--bytes N]".into()),
    }
}

/// Word `i` of buffer number `seq`: every word of every buffer differs.
fn word(seq: u64, i: usize) -> u64 {
    ((seq << 32) | i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The source: a channel per sink, the sinks started as child processes,
/// then every buffer published to all of them.
fn source(bytes: usize) -> Result<()> {
    let start = Instant::now();
    let domain = Domain::new("source");
    let (mut channels, mut children) = (Vec::new(), Vec::new());
    for i in 0..SINKS {
        let path = std::env::temp_dir().join(format!("ferry-fan-out-{}-{i}.sock", std::process::id()));
        let mut tx = Channel::create(&domain, &Endpoint::shm(&path), ChannelSetup::default())?;
        children.push(spawn_sink(&path, bytes)?);
        tx.wait_connected(TIMEOUT)?;
        channels.push(tx);
    }
    let published = publish_all(&domain, channels, bytes);
    let mut failed = Vec::new();
    for mut child in children {
        let status = child.wait()?;
        if !status.success() {
            failed.push(status.to_string());
        }
    }
    let published = published?;
    if !failed.is_empty() {
        return Err(format!("sink processes failed: {}", failed.join(", ")).into());
    }
    println!("{}", summary("source", published, &format!("published to {SINKS} sinks, all back,"), start));
    Ok(())
}

fn spawn_sink(path: &std::path::Path, bytes: usize) -> Result<Child> {
    Ok(Command::new(std::env::current_exe()?)
        .args(["--role", "sink", "--bytes", &bytes.to_string(), "--path"])
        .arg(path)
        .spawn()?)
}

/// Publish `bytes` (whole buffers) over the fan-out, refilling each buffer
/// as it comes back. Returns the number of buffers published.
fn publish_all(domain: &Domain, channels: Vec<Channel>, bytes: usize) -> Result<u64> {
    let mut fan = FanOut::new(channels).map_err(|r| r.error)?;
    let alloc = Allocator::new(domain, POOL_BUFFERS, BUFFER_SIZE, PoolConstraints::default())?;
    fan.assign_pool_and_wait(alloc.pool(), TIMEOUT)?;
    let count = bytes.div_ceil(BUFFER_SIZE) as u64;
    let (mut sent, mut back) = (0, 0);
    while back < count {
        while sent < count {
            let Some(mut buf) = alloc.alloc() else { break };
            for (i, w) in buf.as_mut_slice_of::<u64>()?.iter_mut().enumerate() {
                *w = word(sent, i);
            }
            fan.publish(buf, &sent.to_le_bytes()).map_err(|r| r.error)?;
            sent += 1;
        }
        match fan.wait(Some(TIMEOUT)) {
            // Every sink released its copy: dropping the buffer frees it.
            Some(FanOutEvent::Returned { writable: true, .. }) => back += 1,
            Some(FanOutEvent::Sink { sink, event: Event::Error(e) }) => return Err(format!("sink {sink}: {e}").into()),
            Some(other) => return Err(format!("unexpected {other:?}").into()),
            None => return Err("no buffer came back in time".into()),
        }
    }
    fan.teardown()?;
    let mut closed = 0;
    while closed < SINKS {
        match fan.wait(Some(TIMEOUT)) {
            Some(FanOutEvent::Sink { event: Event::Closed { .. }, .. }) => closed += 1,
            other => return Err(format!("expected the sinks' closes, got {other:?}").into()),
        }
    }
    Ok(count)
}

/// A sink: connect (retrying until the source listens), check every byte
/// of every copy, release it, until the source closes.
fn sink(path: PathBuf, bytes: usize) -> Result<()> {
    let start = Instant::now();
    let mut rx = Channel::connect(&Domain::new("sink"), &Endpoint::shm(path), BindParams::default(), TIMEOUT)?;
    rx.set_pool_policy(PoolPolicy::AcceptAll);
    let mut next = 0u64;
    loop {
        match rx.wait(Some(TIMEOUT)) {
            Ok(Event::CopyReceived { copy, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into()?);
                if seq != next {
                    return Err(format!("copy {seq} arrived, expected {next}").into());
                }
                let words = copy.as_slice_of::<u64>()?;
                if let Some(i) = (0..words.len()).find(|&i| words[i] != word(seq, i)) {
                    return Err(format!("copy {seq}: byte {} differs", i * 8).into());
                }
                rx.release(copy).map_err(|r| r.error)?;
                next += 1;
            }
            Ok(Event::Closed { .. }) | Err(ferry::WaitError::Closed) => break,
            Ok(Event::Error(e)) => return Err(e.into()),
            Ok(other) => return Err(format!("unexpected {other:?}").into()),
            Err(ferry::WaitError::TimedOut) => return Err("the source went quiet".into()),
        }
    }
    if next != bytes.div_ceil(BUFFER_SIZE) as u64 {
        return Err(format!("{next} copies received, expected {}", bytes.div_ceil(BUFFER_SIZE)).into());
    }
    println!("{}", summary("sink  ", next, "read and released, every byte verified,", start));
    Ok(())
}
