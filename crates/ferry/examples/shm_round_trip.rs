//! The work of shared-memory round trips, without the waiting: one thread
//! holds both ends of a shared-memory channel (two domains, one process)
//! and moves a buffer to the sink and passes it back, `--trips N` times
//! (default 10 000). The sink's poll always finds the message there, so
//! no empty polls are counted: run it under an instruction counter, once
//! with N and once with 2N, and the difference over N is the instructions
//! of one round trip (both ends together):
//!
//! ```text
//! cargo build -p ferry --release --example shm_round_trip
//! valgrind --tool=callgrind target/release/examples/shm_round_trip --trips 10000
//! ```

use std::process::ExitCode;
use std::time::Duration;

use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const TIMEOUT: Duration = Duration::from_secs(10);

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shm_round_trip: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The value of `--name VALUE`, if given.
fn arg<T: std::str::FromStr>(name: &str, default: T) -> Result<T>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a.strip_prefix("--") == Some(name) {
            return Ok(args.next().ok_or(format!("--{name} needs a value"))?.parse()?);
        }
    }
    Ok(default)
}

fn run() -> Result<()> {
    let trips: u64 = arg("trips", 10_000)?;
    let size: usize = arg("size", 4096)?;
    let (a, b) = (Domain::new("source"), Domain::new("sink"));
    let ep = Endpoint::shm_abstract(&format!("ferry-round-trip-{}", std::process::id()));
    let mut tx = Channel::create(&a, &ep, ChannelSetup::default())?;
    let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
    tx.wait_connected(TIMEOUT)?;
    rx.wait_connected(TIMEOUT)?;
    let alloc = Allocator::new(&a, 4, size, PoolConstraints::default())?;
    tx.assign_pool(alloc.pool())?;
    // The sink accepts at its next poll; the source learns it at its own.
    loop {
        match rx.poll() {
            Some(Event::PoolAssignRequest(req)) => rx.respond_pool(req.pool, true)?,
            Some(ev) => return Err(format!("sink: unexpected {ev:?}").into()),
            None => {}
        }
        match tx.poll() {
            Some(Event::PoolAssigned(_)) => break,
            Some(ev) => return Err(format!("source: unexpected {ev:?}").into()),
            None => {}
        }
    }
    for seq in 0..trips {
        let buf = alloc.alloc().ok_or("pool exhausted")?;
        tx.move_buffer(buf, &seq.to_le_bytes()).map_err(|r| r.error)?;
        let (buffer, meta) = loop {
            match rx.poll() {
                Some(Event::MoveReceived { buffer, meta }) => break (buffer, meta),
                Some(_) => {}
                None => tx.poll().map_or(Ok(()), |ev| Err(format!("source: unexpected {ev:?}")))?,
            }
        };
        rx.pass(buffer, &meta).map_err(|r| r.error)?;
        loop {
            match tx.poll() {
                Some(Event::BufferPassed { buffer, .. }) => break drop(buffer),
                Some(ev) => return Err(format!("source: unexpected {ev:?}").into()),
                None => {
                    rx.poll().map_or(Ok(()), |ev| Err(format!("sink: unexpected {ev:?}")))?;
                }
            }
        }
    }
    println!("{trips} round trips of {size} bytes over shared memory");
    Ok(())
}
