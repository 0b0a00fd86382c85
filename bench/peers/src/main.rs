//! `ferry-peers`: the peers and baselines that Ferry's benchmarks are
//! compared with (see bench/peers/README.md). Every subcommand measures
//! between two processes, the source pinned to CPU 0 and an echo process
//! (this binary re-executed as the hidden `echo` subcommand) pinned to CPU 1,
//! and prints one line per point in the schema of `ferry bench --json`.

mod child;
#[cfg(feature = "iceoryx2")]
mod iox;
mod pattern;
mod plan;
mod report;
mod stats;
mod stream;
mod wake;

use clap::{Parser, Subcommand};

use plan::{BenchArgs, Peer};

#[derive(Debug, Parser)]
#[command(name = "ferry-peers", version, about = "Ferry's benchmark peers: iceoryx2, eventfd, UDS, TCP, pipes")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// iceoryx2 0.10 zero-copy publish-subscribe (ping and pong services); busy-poll or --blocking.
    Iceoryx2(BenchArgs),
    /// Round-trip floor without payload: eventfd ping-pong (blocking) or, with --busy-poll,
    /// a cache-line ping-pong in a shared memfd.
    Eventfd(BenchArgs),
    /// Unix stream socket (socketpair), each message copied through the kernel.
    UdsCopy(BenchArgs),
    /// TCP over 127.0.0.1 with TCP_NODELAY, each message copied through the kernel.
    TcpCopy(BenchArgs),
    /// Two pipes, each message copied through the kernel.
    PipeCopy(BenchArgs),
    /// The echo process (started by the others).
    #[command(hide = true)]
    Echo(child::EchoArgs),
    /// The optional peers this binary was built with, one per line (for `ferry bench`).
    #[command(hide = true)]
    Features,
}

fn main() {
    let cli = Cli::parse();
    let (peer, args) = match cli.command {
        Command::Echo(a) => match child::echo_main(&a) {
            Ok(n) => {
                println!("echoed {n}");
                return;
            }
            Err(e) => {
                eprintln!("ferry-peers echo: {e}");
                std::process::exit(1);
            }
        },
        Command::Features => {
            if cfg!(feature = "iceoryx2") {
                println!("iceoryx2");
            }
            return;
        }
        Command::Iceoryx2(a) => (Peer::Iceoryx2, a),
        Command::Eventfd(a) => (Peer::Eventfd, a),
        Command::UdsCopy(a) => (Peer::Uds, a),
        Command::TcpCopy(a) => (Peer::Tcp, a),
        Command::PipeCopy(a) => (Peer::Pipe, a),
    };
    let plan = match plan::plan(peer, &args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("ferry-peers: {e}");
            std::process::exit(2);
        }
    };
    let result = match peer {
        #[cfg(feature = "iceoryx2")]
        Peer::Iceoryx2 => iox::measure(&plan),
        #[cfg(not(feature = "iceoryx2"))]
        Peer::Iceoryx2 => {
            eprintln!(
                "ferry-peers: built without iceoryx2; build it with `scripts/bench-peers --build` (needs libclang)"
            );
            std::process::exit(2);
        }
        Peer::Eventfd => wake::measure(&plan),
        Peer::Uds | Peer::Tcp | Peer::Pipe => stream::measure(&plan),
    };
    if let Err(e) = result {
        eprintln!("ferry-peers: {e}");
        std::process::exit(1);
    }
}
