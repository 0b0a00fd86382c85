//! Two threads, two domains, one channel over the local backend: the
//! sender moves 16 MiB in 64 KiB buffers (`--bytes N` for another amount),
//! the receiver checks every byte and passes each buffer back.
//!
//! Run: `cargo run -p ferry --release --example threads`

mod common;

use std::process::ExitCode;
use std::time::Instant;

use ferry::{BindParams, Channel, ChannelSetup, Domain, Endpoint};

use common::{exit_code, receive, send, summary, Args, Result, TIMEOUT};

fn main() -> ExitCode {
    exit_code(run())
}

fn run() -> Result<()> {
    let bytes = Args::parse(&["bytes"])?.bytes()?;
    let start = Instant::now();
    let endpoint = Endpoint::local();
    // The receiver binds from its own thread and domain.
    let receiver = {
        let endpoint = endpoint.clone();
        std::thread::spawn(move || -> Result<u64> {
            let mut rx = Channel::connect(&Domain::new("receiver"), &endpoint, BindParams::default(), TIMEOUT)?;
            receive(&mut rx, bytes)
        })
    };
    // The sender creates the channel (its end is TX) and waits for the receiver.
    let mut tx = Channel::accept(&Domain::new("sender"), &endpoint, ChannelSetup::default(), TIMEOUT)?;
    let sent = send(&mut tx, bytes)?;
    let received = receiver.join().map_err(|_| "the receiver thread panicked")??;
    println!("{}", summary("sender  ", sent, "moved, all passed back,", start));
    println!("{}", summary("receiver", received, "received, every byte verified,", start));
    Ok(())
}
