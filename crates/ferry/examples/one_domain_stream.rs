//! Streams moves between two threads over a local channel, busy-polling,
//! with the two ends in two domains or in one (as the C interface's local
//! channels), and prints millions of moves per second for each.
//!
//! `cargo run --release --example one_domain_stream -- [MOVES] [WINDOW] [ROUNDS]`
use std::time::{Duration, Instant};

use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints, PoolPolicy};

fn stream(one: bool, moves: u64, window: u64) -> Result<f64, Box<dyn std::error::Error>> {
    let t = Duration::from_secs(10);
    let source_domain = Domain::new("source");
    let echo_domain = if one { source_domain.clone() } else { Domain::new("echo") };
    let ep = Endpoint::local();
    let setup = ChannelSetup { meta_size: 16, queue_depth: 512, ..ChannelSetup::default() };
    let mut tx = Channel::create(&source_domain, &ep, setup)?;
    let echo = std::thread::spawn(move || -> Result<u64, ferry::Error> {
        let mut rx = Channel::connect(&echo_domain, &ep, BindParams::default(), t)?;
        rx.set_pool_policy(PoolPolicy::AcceptAll);
        rx.set_batching(true)?;
        let mut n = 0;
        loop {
            match rx.poll() {
                Some(Event::MoveReceived { buffer, meta }) => {
                    rx.pass(buffer, &meta).map_err(|r| r.error)?;
                    n += 1;
                }
                Some(Event::PoolAssignRequest(_)) | None => std::hint::spin_loop(),
                Some(_) => return Ok(n),
            }
        }
    });
    tx.wait_connected(t)?;
    let alloc = Allocator::new(&source_domain, window, 4096, PoolConstraints::default())?;
    tx.assign_pool_and_wait(alloc.pool(), t)?;
    let meta = [0u8; 16];
    let (mut sent, mut back) = (0u64, 0u64);
    let t0 = Instant::now();
    while back < moves {
        while sent < moves && sent - back < window {
            let Some(b) = alloc.alloc() else { break };
            tx.move_buffer(b, &meta).map_err(|r| r.error)?;
            sent += 1;
        }
        while let Some(ev) = tx.poll() {
            if let Event::BufferPassed { buffer, .. } = ev {
                drop(buffer);
                back += 1;
            }
        }
    }
    let rate = moves as f64 / t0.elapsed().as_secs_f64() / 1e6;
    tx.teardown()?;
    while !matches!(tx.wait(Some(t)), Some(Event::Closed { .. }) | None) {}
    echo.join().map_err(|_| "echo panicked")??;
    Ok(rate)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let moves: u64 = args.get(1).map_or(Ok(200_000), |a| a.parse())?;
    let window: u64 = args.get(2).map_or(Ok(250), |a| a.parse())?;
    let rounds: u32 = args.get(3).map_or(Ok(3), |a| a.parse())?;
    for _ in 0..rounds {
        let two = stream(false, moves, window)?;
        let one = stream(true, moves, window)?;
        println!("two domains {two:.3} Mmoves/s, one domain {one:.3} Mmoves/s");
    }
    Ok(())
}
