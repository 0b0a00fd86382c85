//! The work of one move and pass back, without waiting: one thread holds
//! both ends of a local channel and moves a buffer, the other end passes it
//! back, the buffer is dropped to its pool. Nothing waits for another
//! thread, so every instruction counted is work: run it under
//! `valgrind --tool=callgrind` and divide by the round trips (the C
//! interface's crates/ferry-c/bench/bulk_work.c does the same in C).
//!
//! `cargo run --release --example roundtrip_work -- ROUND_TRIPS [WINDOW] [one]`
//! (`one`: both ends in one domain, as the C interface's local channels).
use std::time::Duration;

use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints, PoolPolicy};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(1).map_or(Ok(10_000), |a| a.parse())?;
    let window: u64 = args.get(2).map_or(Ok(1), |a| a.parse())?;
    let one = args.get(3).is_some_and(|a| a == "one");
    let t = Duration::from_secs(10);
    let source_domain = Domain::new("source");
    let echo_domain = if one { source_domain.clone() } else { Domain::new("echo") };
    let ep = Endpoint::local();
    let setup = ChannelSetup { meta_size: 16, ..ChannelSetup::default() };
    let mut tx = Channel::create(&source_domain, &ep, setup)?;
    let mut rx = Channel::bind(&echo_domain, &ep, BindParams::default())?;
    tx.wait_connected(t)?;
    rx.wait_connected(t)?;
    rx.set_pool_policy(PoolPolicy::AcceptAll);
    let alloc = Allocator::new(&source_domain, window, 4096, PoolConstraints::default())?;
    tx.assign_pool(alloc.pool())?;
    while !tx.is_assigned(alloc.pool().id()) {
        rx.poll();
        tx.poll();
    }
    let meta = [0u8; 16];
    let (mut sent, mut back) = (0u64, 0u64);
    while back < n {
        while sent < n && sent - back < window {
            let Some(b) = alloc.alloc() else { break };
            tx.move_buffer(b, &meta).map_err(|r| r.error)?;
            sent += 1;
        }
        while let Some(ev) = rx.poll() {
            if let Event::MoveReceived { buffer, meta } = ev {
                rx.pass(buffer, &meta).map_err(|r| r.error)?;
            }
        }
        while let Some(ev) = tx.poll() {
            if let Event::BufferPassed { buffer, .. } = ev {
                drop(buffer);
                back += 1;
            }
        }
    }
    println!("{back} round trips");
    Ok(())
}
