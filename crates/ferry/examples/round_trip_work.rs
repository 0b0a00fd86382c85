//! The work of round trips, without the waiting: one thread holds both
//! ends of a channel (two domains, one process) and moves a buffer to the
//! sink and passes it back, `--trips N` times (default 10 000). The sink's
//! poll always finds the message there, so no empty polls are counted: run
//! it under an instruction counter, once with N and once with 2N, and the
//! difference over N is the instructions of one round trip (both ends
//! together). The C interface's `crates/ferry-c/bench/bulk_work.c` does
//! the same in C.
//!
//! ```text
//! cargo build -p ferry --release --example round_trip_work
//! valgrind --tool=callgrind target/release/examples/round_trip_work --backend shm --trips 10000
//! ```
//!
//! `--backend local|shm` (default shm) picks the channel; `--one-domain`
//! puts both ends in one domain (as the C interface's local channels do).
//! `--window W` moves W buffers one after the other before they come back
//! (at most the queue depth), `--batch` has both ends publish in batches
//! as the benchmarks do: the cost per message of a stream. `--size` sets
//! the buffer size (default 4096). `--copy release` sends a copy instead
//! of moving the buffer, and the sink releases it; `--copy drop` has the
//! sink drop it instead (released the next time its channel runs).

use std::process::ExitCode;
use std::time::Duration;

use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const TIMEOUT: Duration = Duration::from_secs(10);

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("round_trip_work: {e}");
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
    // Buffers in flight at once (moved one after the other, then all
    // passed back), and whether both ends publish in batches.
    let window: u64 = arg("window", 1)?;
    let batch = std::env::args().any(|a| a == "--batch");
    let backend: String = arg("backend", "shm".to_string())?;
    let copy: String = arg("copy", String::new())?;
    if !copy.is_empty() {
        if !matches!(copy.as_str(), "release" | "drop") {
            return Err(format!("--copy {copy}: choose release or drop").into());
        }
        if window != 1 || batch {
            return Err("--copy goes with neither --window nor --batch".into());
        }
    }
    let a = Domain::new("source");
    let b = if std::env::args().any(|a| a == "--one-domain") { a.clone() } else { Domain::new("sink") };
    let ep = match backend.as_str() {
        "shm" => Endpoint::shm_abstract(&format!("ferry-round-trip-{}", std::process::id())),
        "local" => Endpoint::local(),
        other => return Err(format!("--backend {other}: choose local or shm").into()),
    };
    let mut tx = Channel::create(&a, &ep, ChannelSetup::default())?;
    let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
    tx.wait_connected(TIMEOUT)?;
    rx.wait_connected(TIMEOUT)?;
    let alloc = Allocator::new(&a, window.max(4), size, PoolConstraints::default())?;
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
    if batch {
        tx.set_batching(true)?;
        rx.set_batching(true)?;
    }
    if !copy.is_empty() {
        let buf = alloc.alloc().ok_or("pool exhausted")?;
        for trip in 0..trips {
            tx.copy(&buf, &trip.to_le_bytes())?;
            let copy_in = loop {
                match rx.poll() {
                    Some(Event::CopyReceived { copy, .. }) => break copy,
                    Some(ev) => return Err(format!("sink: unexpected {ev:?}").into()),
                    None => {}
                }
            };
            if copy == "release" {
                rx.release(copy_in).map_err(|r| r.error)?;
            } else {
                // Released by the sink's next poll.
                drop(copy_in);
            }
            loop {
                match tx.poll() {
                    Some(Event::CopyReleased { writable: true, .. }) => break,
                    Some(ev) => return Err(format!("source: unexpected {ev:?}").into()),
                    None => {
                        rx.poll().map_or(Ok(()), |ev| Err(format!("sink: unexpected {ev:?}")))?;
                    }
                }
            }
        }
        let how = if copy == "release" { "released" } else { "dropped" };
        println!("{trips} copies of a buffer of {size} bytes over {backend}, {how} by the sink");
        return Ok(());
    }
    for trip in 0..trips {
        for i in 0..window {
            let buf = alloc.alloc().ok_or("pool exhausted")?;
            tx.move_buffer(buf, &(trip * window + i).to_le_bytes()).map_err(|r| r.error)?;
        }
        // Buffers back at the source (a pass may be published, and taken,
        // before the sink has seen the whole window).
        let mut back = 0;
        for _ in 0..window {
            let (buffer, meta) = loop {
                match rx.poll() {
                    Some(Event::MoveReceived { buffer, meta }) => break (buffer, meta),
                    Some(_) => {}
                    None => match tx.poll() {
                        Some(Event::BufferPassed { buffer, .. }) => {
                            drop(buffer);
                            back += 1;
                        }
                        Some(ev) => return Err(format!("source: unexpected {ev:?}").into()),
                        None => {}
                    },
                }
            };
            rx.pass(buffer, &meta).map_err(|r| r.error)?;
        }
        for _ in back..window {
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
    }
    println!("{trips} round trips of {window} buffers of {size} bytes over {backend}");
    Ok(())
}
