//! `ferry`: the command-line face of Ferry.
//!
//! * `ferry demo` — moves real data with Ferry and prints what it verified
//!   and how fast.
//! * `ferry bench EXPERIMENT` — the benchmark experiments (see BENCHMARKS.md).
//! * `ferry echo` — the echo domain of an experiment run elsewhere.
//! * `ferry block serve` — Ferry's network block service for NBD clients.
//! * `ferry cp SRC DST` — copy through a Ferry pool with container-shipping I/O.
//! * `ferry tls gen DIR` — write a set of test certificates for TLS.
//! * `ferry inspect [PID]` — the channels and pools of every Ferry process
//!   of the user, with their counters (`--watch`: like top).

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, Subcommand};

mod args;
mod bench;
mod block;
mod cp;
mod cp_tls;
mod demo;
mod echo;
mod inspect;
mod pattern;
mod pin;
mod setup;
mod stats;
mod tls;
mod tls_args;

#[derive(Parser)]
#[command(name = "ferry", version, about = "Ferry: zero-copy bulk transfer between threads, processes and machines")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Move real data through Ferry, verify every byte, report the rate.
    Demo(demo::DemoArgs),
    /// Run one of the benchmark experiments (see BENCHMARKS.md).
    Bench(Box<bench::BenchArgs>),
    /// Be the echo peer of an experiment run elsewhere: pass every buffer back.
    ///
    /// Binds to the endpoint and passes every buffer back until the channel closes.
    Echo(echo::EchoArgs),
    /// Copy SRC to DST (files, `-`, tcp:HOST:PORT, unix:PATH) through a Ferry pool, without copies in user space.
    Cp(cp::CpArgs),
    /// Internal: the processes `ferry bench` starts (fbufs receiver, pipeline stages).
    #[command(hide = true, name = "bench-child")]
    BenchChild(bench::child::ChildArgs),
    /// Ferry's network block service: serve a store to NBD clients.
    Block(block::BlockArgs),
    /// TLS helpers: `ferry tls gen DIR` writes test certificates.
    Tls(tls::TlsArgs),
    /// Show the channels and pools of every Ferry process of this user (or of PID), with their
    /// counters; --watch redraws every second with rates and flags stalled channels.
    Inspect(inspect::InspectArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and version go to stdout as clap writes them.
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => e.exit(),
        Err(e) if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => e.exit(),
        Err(e) => {
            let top = Cli::command();
            let sub = std::env::args().nth(1).filter(|a| command_names(&top).contains(a));
            // An unknown command is named against the commands of its level:
            // `ferry frob` against ferry's, `ferry tls frob` against tls's.
            let level = sub.as_deref().and_then(|s| top.find_subcommand(s)).filter(|c| c.has_subcommands());
            let commands = command_names(level.unwrap_or(&top));
            eprintln!("ferry: {}", args::usage_line(&e, sub.as_deref(), &commands));
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Demo(args) => demo::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::Echo(args) => echo::run(&args),
        Command::Cp(args) => cp::run(&args),
        Command::BenchChild(args) => bench::child::run(&args),
        Command::Block(args) => block::run(&args),
        Command::Tls(args) => tls::run(&args),
        Command::Inspect(args) => inspect::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry: {}", e.sentence());
            ExitCode::from(e.exit_code())
        }
    }
}

/// The commands a user may give at the level of `command`, as `--help`
/// lists them (hidden ones and `help` left out).
fn command_names(command: &clap::Command) -> Vec<String> {
    command
        .get_subcommands()
        .filter(|c| !c.is_hide_set() && c.get_name() != "help")
        .map(|c| c.get_name().to_string())
        .collect()
}

/// A failure of a command, with its exit code (2: bad usage, 1: failed run).
#[derive(Debug)]
pub enum CliError {
    Usage(String),
    Failed(String),
}

impl CliError {
    /// The message as printed: what happened, then what to do (a failed
    /// run whose message does not say gets the general advice).
    fn sentence(&self) -> String {
        match self {
            CliError::Failed(m) if !m.contains("; ") => format!("{m}; the run stopped here, run the command again"),
            CliError::Usage(m) | CliError::Failed(m) => m.clone(),
        }
    }

    fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Failed(_) => 1,
        }
    }
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Usage(m) | CliError::Failed(m) => f.write_str(m),
        }
    }
}

impl From<ferry::Error> for CliError {
    fn from(e: ferry::Error) -> Self {
        CliError::Failed(e.to_string())
    }
}

impl<T> From<ferry::Refused<T>> for CliError {
    fn from(e: ferry::Refused<T>) -> Self {
        CliError::Failed(e.error.to_string())
    }
}
