//! Two processes, one channel over TCP (here on loopback): the sender
//! moves 16 MiB in 64 KiB buffers (`--bytes N` for another amount), the
//! receiver checks every byte and passes each buffer back. Payloads go
//! from the sender's buffer memory straight into the receiver's.
//!
//! Run without arguments, the program starts the receiver as a child
//! process of itself and plays the sender:
//!
//! ```text
//! cargo run -p ferry --release --example processes_tcp
//! ```
//!
//! Or start the two roles yourself: the receiver listens (port 0: the
//! kernel picks one) and prints its address; give it to the sender.
//!
//! ```text
//! cargo run -p ferry --release --example processes_tcp -- --role receiver --addr 127.0.0.1:0
//! cargo run -p ferry --release --example processes_tcp -- --role sender --addr 127.0.0.1:PORT
//! ```

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use ferry::{BindParams, Channel, ChannelSetup, Direction, Domain, Endpoint, Role};

use common::{exit_code, receive, send, summary, Args, Result, TIMEOUT};

/// What the receiver prints first, followed by its address.
const LISTENING: &str = "listening on ";

fn main() -> ExitCode {
    exit_code(run())
}

fn run() -> Result<()> {
    let args = Args::parse(&["role", "addr", "bytes"])?;
    let bytes = args.bytes()?;
    let addr = match args.get("addr") {
        Some(a) => Some(a.parse::<SocketAddr>().map_err(|e| format!("--addr {a}: {e}"))?),
        None => None,
    };
    match (args.get("role"), addr) {
        (Some("receiver"), addr) => receiver(addr.unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0))), bytes),
        (Some("sender"), Some(addr)) => sender(addr, bytes),
        (None, None) => both(bytes),
        _ => {
            Err("usage: processes_tcp [--role receiver [--addr IP:PORT] | --role sender --addr IP:PORT] [--bytes N]"
                .into())
        }
    }
}

/// The receiver creates the channel (its end is RX; the sender provides the
/// pool, so it is the master), says where it listens, waits for the sender.
fn receiver(addr: SocketAddr, bytes: usize) -> Result<()> {
    let start = Instant::now();
    let setup = ChannelSetup { direction: Direction::Rx, role: Role::Slave, ..ChannelSetup::default() };
    let mut rx = Channel::create(&Domain::new("receiver"), &Endpoint::tcp(addr), setup)?;
    let listening = rx.listen_addr().ok_or("no listening address")?;
    println!("{LISTENING}{listening}");
    std::io::stdout().flush()?;
    rx.wait_connected(TIMEOUT)?;
    let received = receive(&mut rx, bytes)?;
    println!("{}", summary("receiver", received, "received, every byte verified,", start));
    Ok(())
}

/// The sender binds (retrying until the receiver listens) and sends.
fn sender(addr: SocketAddr, bytes: usize) -> Result<()> {
    let start = Instant::now();
    let mut tx = Channel::connect(&Domain::new("sender"), &Endpoint::tcp(addr), BindParams::default(), TIMEOUT)?;
    let sent = send(&mut tx, bytes)?;
    println!("{}", summary("sender  ", sent, "moved, all passed back,", start));
    Ok(())
}

/// This program again as the receiver on a port the kernel picks, and the
/// sender here, told the port by the receiver's first line.
fn both(bytes: usize) -> Result<()> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--role", "receiver", "--addr", "127.0.0.1:0", "--bytes", &bytes.to_string()])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().ok_or("no pipe from the receiver")?).lines();
    let first = lines.next().transpose()?.unwrap_or_default();
    let sent = match first.strip_prefix(LISTENING).map(str::parse::<SocketAddr>) {
        Some(Ok(addr)) => sender(addr, bytes),
        _ => Err(format!("the receiver did not say where it listens: {first:?}").into()),
    };
    // The rest of what the receiver prints.
    for line in lines {
        println!("{}", line?);
    }
    let status = child.wait()?;
    sent?;
    if !status.success() {
        return Err(format!("the receiver process failed ({status})").into());
    }
    Ok(())
}
