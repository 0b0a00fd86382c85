//! `ferry bench-child` (hidden): the processes `ferry bench` starts itself —
//! the receiving domain of `fbufs-table` over shm, the stages of
//! `pipeline`, the client processes of `fanin --backend shm`, the Ferry sender of `socket-touch`. Not for people: the arguments are set by the parent.

use std::io::{BufRead, BufReader};
use std::process::ChildStdout;
use std::sync::mpsc;
use std::time::Instant;

use clap::{Args, Subcommand};
use ferry::{BindParams, Channel, Domain};

use super::{fanin, fbufs, layers, pipeline, socket_touch};
use crate::{echo, pin, CliError};

/// Arguments of `ferry bench-child`.
#[derive(Debug, Args)]
pub struct ChildArgs {
    #[command(subcommand)]
    role: Role,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// The fbufs receiver: read one word per page, pass back.
    FbufsEcho(FbufsEchoArgs),
    /// One stage of a pipeline.
    Stage(pipeline::StageArgs),
    /// A client process of `fanin --backend shm`.
    FaninClient(fanin::ClientArgs),
    /// The router or the receiving stack of `layers`.
    Layers(layers::ChildArgs),
    /// The Ferry sender of `socket-touch`.
    SocketTouchSender(socket_touch::SenderArgs),
}

#[derive(Debug, Args)]
struct FbufsEchoArgs {
    /// Endpoint to bind to (`shm@NAME`, `shm:PATH`).
    #[arg(long, value_parser = echo::endpoint_arg)]
    endpoint: String,
    /// Pin to this CPU.
    #[arg(allow_negative_numbers = true, long, value_parser = crate::args::cpu)]
    cpu: Option<usize>,
    /// Spin instead of sleeping.
    #[arg(long)]
    busy_poll: bool,
}

/// Die with the parent: a benchmark that is killed leaves no processes.
pub fn die_with_parent() {
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
}

/// Raise the soft limit of open files to the hard one: uncached fbufs
/// transfers keep one memfd per pool open.
pub fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut l = getrlimit(Resource::Nofile);
    if l.current != l.maximum {
        l.current = l.maximum;
        let _ = setrlimit(Resource::Nofile, l);
    }
}

/// `ferry bench-child`.
pub fn run(a: &ChildArgs) -> Result<(), CliError> {
    die_with_parent();
    match &a.role {
        Role::FbufsEcho(e) => {
            raise_fd_limit();
            if let Some(cpu) = e.cpu {
                pin::to_cpu(cpu);
            }
            let ep = echo::parse_endpoint(&e.endpoint)
                .map_err(|why| CliError::Usage(format!("--endpoint {}: {why}", e.endpoint)))?;
            let domain = Domain::new("fbufs-receiver");
            let mut ch = Channel::bind(&domain, &ep, BindParams::default())?;
            let n = fbufs::serve(&mut ch, e.busy_poll).map_err(CliError::Failed)?;
            println!("echoed {n}");
            Ok(())
        }
        Role::Stage(s) => pipeline::stage(s),
        Role::FaninClient(c) => fanin::client_process(c),
        Role::Layers(l) => layers::child(l),
        Role::SocketTouchSender(s) => socket_touch::sender(s),
    }
}

/// The lines a child process prints, each with the moment it was read, as
/// they come (a thread reads them, so the parent can wait with a timeout).
pub(super) fn timed_lines(out: ChildStdout) -> mpsc::Receiver<(Instant, String)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    rx
}
