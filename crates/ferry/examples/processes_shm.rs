//! Two processes, one channel over shared memory: the sender moves 16 MiB
//! in 64 KiB buffers (`--bytes N` for another amount), the receiver checks
//! every byte and passes each buffer back.
//!
//! Run without arguments, the program starts the receiver as a child
//! process of itself and plays the sender:
//!
//! ```text
//! cargo run -p ferry --release --example processes_shm
//! ```
//!
//! Or start the two roles yourself, in any order (the sender retries until
//! the receiver listens):
//!
//! ```text
//! cargo run -p ferry --release --example processes_shm -- --role receiver --path /tmp/ferry.sock
//! cargo run -p ferry --release --example processes_shm -- --role sender --path /tmp/ferry.sock
//! ```

mod common;

use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::Instant;

use ferry::{BindParams, Channel, ChannelSetup, Direction, Domain, Endpoint, Role};

use common::{exit_code, receive, send, summary, Args, Result, TIMEOUT};

fn main() -> ExitCode {
    exit_code(run())
}

fn run() -> Result<()> {
    let args = Args::parse(&["role", "path", "bytes"])?;
    let bytes = args.bytes()?;
    match (args.get("role"), args.get("path")) {
        (Some("receiver"), Some(path)) => receiver(PathBuf::from(path), bytes),
        (Some("sender"), Some(path)) => sender(PathBuf::from(path), bytes),
        (None, None) => both(bytes),
        _ => Err("usage: processes_shm [--role sender|receiver --path SOCKET] [--bytes N]".into()),
    }
}

/// The receiver creates the channel on the socket path (its end is RX; the
/// sender provides the pool, so it is the master) and waits for the sender.
fn receiver(path: PathBuf, bytes: usize) -> Result<()> {
    let start = Instant::now();
    let setup = ChannelSetup { direction: Direction::Rx, role: Role::Slave, ..ChannelSetup::default() };
    let mut rx = Channel::accept(&Domain::new("receiver"), &Endpoint::shm(path), setup, TIMEOUT)?;
    let received = receive(&mut rx, bytes)?;
    println!("{}", summary("receiver", received, "received, every byte verified,", start));
    Ok(())
}

/// The sender binds (retrying until the receiver listens) and sends.
fn sender(path: PathBuf, bytes: usize) -> Result<()> {
    let start = Instant::now();
    let mut tx = Channel::connect(&Domain::new("sender"), &Endpoint::shm(path), BindParams::default(), TIMEOUT)?;
    let sent = send(&mut tx, bytes)?;
    println!("{}", summary("sender  ", sent, "moved, all passed back,", start));
    Ok(())
}

/// This program again as the receiver, and the sender here.
fn both(bytes: usize) -> Result<()> {
    let path = std::env::temp_dir().join(format!("ferry-example-{}.sock", std::process::id()));
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--role", "receiver", "--bytes", &bytes.to_string(), "--path"])
        .arg(&path)
        .spawn()?;
    let sent = sender(path, bytes);
    let status = child.wait()?;
    sent?;
    if !status.success() {
        return Err(format!("the receiver process failed ({status})").into());
    }
    Ok(())
}
