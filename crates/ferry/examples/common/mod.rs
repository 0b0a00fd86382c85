//! The flow the three examples share, whatever carries it: the sender
//! makes a pool, assigns it, fills buffers with a pattern and moves them;
//! the receiver checks every byte and passes each buffer back; the sender
//! refills what comes back until everything is sent, then tears down.

use std::error::Error;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use ferry::{Allocator, Buffer, Channel, Event, PoolConstraints, PoolPolicy};

/// Bytes per buffer.
pub const BUFFER_SIZE: usize = 64 << 10;
/// Buffers in the sender's pool (the most in flight at once).
pub const POOL_BUFFERS: u64 = 16;
/// Bytes sent unless `--bytes` says otherwise: 256 buffers.
pub const DEFAULT_BYTES: usize = 16 << 20;
/// The longest any step may wait for the peer.
pub const TIMEOUT: Duration = Duration::from_secs(10);

pub type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

/// Word `i` of buffer number `seq`: every word of every buffer differs.
fn word(seq: u64, i: usize) -> u64 {
    ((seq << 32) | i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Send `bytes` (rounded up to whole buffers) over `tx`, a connected TX
/// end. Returns the number of buffers sent, all of them back.
pub fn send(tx: &mut Channel, bytes: usize) -> Result<u64> {
    let alloc = Allocator::new(tx.domain(), POOL_BUFFERS, BUFFER_SIZE, PoolConstraints::default())?;
    tx.assign_pool_and_wait(alloc.pool(), TIMEOUT)?;
    let count = bytes.div_ceil(BUFFER_SIZE) as u64;
    let (mut sent, mut back) = (0, 0);
    while back < count {
        // Fill and move every free buffer while there is data left.
        while sent < count {
            let Some(mut buf) = alloc.alloc() else { break };
            for (i, w) in buf.as_mut_slice_of::<u64>()?.iter_mut().enumerate() {
                *w = word(sent, i);
            }
            tx.move_buffer(buf, &sent.to_le_bytes())?;
            sent += 1;
        }
        // A buffer passed back is ours again; dropping it frees it.
        match tx.wait(Some(TIMEOUT)) {
            Ok(Event::BufferPassed { .. }) => back += 1,
            Ok(Event::Error(e)) => return Err(e.into()),
            Ok(other) => return Err(format!("unexpected event {other:?}").into()),
            Err(_) => return Err("no buffer came back in time".into()),
        }
    }
    tx.teardown()?;
    match tx.wait(Some(TIMEOUT)) {
        Ok(Event::Closed { .. }) => Ok(count),
        other => Err(format!("expected the close, got {other:?}").into()),
    }
}

/// Check every byte of buffer number `seq` against the sender's pattern.
pub fn verify(buffer: &Buffer, seq: u64) -> Result<()> {
    let words = buffer.as_slice_of::<u64>()?;
    match (0..words.len()).find(|&i| words[i] != word(seq, i)) {
        Some(i) => Err(format!("buffer {seq}: byte {} differs", i * 8).into()),
        None => Ok(()),
    }
}

/// Receive over `rx`, a connected RX end, until the sender closes: check
/// every byte of every buffer and pass it back. Fails on any mismatch, or
/// if the bytes received are not `bytes` rounded up to whole buffers.
pub fn receive(rx: &mut Channel, bytes: usize) -> Result<u64> {
    // The library accepts the sender's pool by itself.
    rx.set_pool_policy(PoolPolicy::AcceptAll);
    let mut next = 0u64;
    loop {
        match rx.wait(Some(TIMEOUT)) {
            Ok(Event::MoveReceived { buffer, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into()?);
                if seq != next {
                    return Err(format!("buffer {seq} arrived, {next} expected").into());
                }
                verify(&buffer, seq)?;
                // The sender overwrites every byte: pass it back without
                // its contents (over TCP, nothing travels back but the id).
                rx.pass_unfilled(buffer, &[])?;
                next += 1;
            }
            Ok(Event::PoolAssignRequest(_)) => {} // accepted already (AcceptAll)
            Ok(Event::Closed { .. }) => break,
            Ok(Event::Error(e)) => return Err(e.into()),
            Ok(other) => return Err(format!("unexpected event {other:?}").into()),
            Err(_) => return Err("nothing arrived in time".into()),
        }
    }
    let want = bytes.div_ceil(BUFFER_SIZE) as u64;
    if next != want {
        return Err(format!("{next} buffers arrived, {want} expected").into());
    }
    Ok(next)
}

/// The line a side prints at the end: `what` happened to `buffers`.
pub fn summary(side: &str, buffers: u64, what: &str, start: Instant) -> String {
    let mib = (buffers as usize * BUFFER_SIZE) as f64 / f64::from(1 << 20);
    let secs = start.elapsed().as_secs_f64();
    format!("{side}: {buffers} buffers ({mib:.1} MiB) {what} in {secs:.3} s")
}

/// The command line as `--name value` pairs, each name one of `known`.
pub struct Args(Vec<(String, String)>);

impl Args {
    pub fn parse(known: &[&str]) -> Result<Args> {
        let mut pairs = Vec::new();
        let mut args = std::env::args().skip(1);
        while let Some(flag) = args.next() {
            let name = flag.strip_prefix("--").filter(|n| known.contains(n));
            let (Some(name), Some(value)) = (name, args.next()) else {
                let known: Vec<String> = known.iter().map(|k| format!("--{k}")).collect();
                return Err(format!("{flag}: expected one of {} with a value", known.join(", ")).into());
            };
            pairs.push((name.to_string(), value));
        }
        Ok(Args(pairs))
    }

    /// The value of `--name`, if given.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().rev().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// `--bytes N`, or the default.
    pub fn bytes(&self) -> Result<usize> {
        match self.get("bytes") {
            Some(b) => Ok(b.parse().map_err(|_| format!("--bytes {b}: not a number"))?),
            None => Ok(DEFAULT_BYTES),
        }
    }
}

/// Exit 0 on success, 1 with the error on stderr otherwise.
pub fn exit_code(result: Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
