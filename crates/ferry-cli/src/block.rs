//! `ferry block`: Ferry's network block service on the command line.
//!
//! `ferry block serve --store mem:1G --nbd tcp:127.0.0.1:10809` serves a
//! store to NBD clients; it prints where it listens and one line per
//! client when the client disconnects, and serves until it is stopped.
//!
//! `ferry block bench` measures the block service's throughput by request
//! size: through Ferry channels ([`ferry_block::BlockClient`] between
//! threads, over shm, over TCP) and through NBD over TCP loopback, against
//! nbdkit's memory plugin driven by the same client.

use std::sync::Arc;

use clap::{Args, Subcommand};
use ferry_block::{open_store, parse_size, Listen, NbdServer, ServerConfig, StoreSpec};

use crate::CliError;

mod bench;
use bench::BenchArgs;

#[derive(Debug, Args)]
pub struct BlockArgs {
    #[command(subcommand)]
    command: BlockCommand,
}

#[derive(Debug, Subcommand)]
enum BlockCommand {
    /// Serve a store to NBD clients (qemu-img, nbdcopy, nbdinfo, fio, the
    /// Linux nbd driver) until stopped.
    Serve(ServeArgs),
    /// Throughput of the block service by request size (writes, then reads
    /// of what was written), through Ferry channels or NBD.
    Bench(BenchArgs),
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// The blocks: `mem:SIZE` (sparse memory, e.g. mem:1G) or `file:PATH`.
    #[arg(long, value_parser = store_arg)]
    store: StoreSpec,
    /// Where NBD clients connect: `tcp:HOST:PORT` or `unix:PATH` (give it
    /// more than once to listen at several places).
    #[arg(long, required = true, value_parser = listen_arg)]
    nbd: Vec<Listen>,
    /// Size of a file store: the file is created with it or extended to it
    /// (e.g. 64M, 10G).
    #[arg(long, value_parser = size_arg)]
    size: Option<u64>,
    /// Open a file store with O_DIRECT as well, for requests aligned to 4096 bytes.
    #[arg(long)]
    direct: bool,
    /// Refuse writes.
    #[arg(long)]
    read_only: bool,
    /// The export's name (the default export is "").
    #[arg(long, default_value = "", value_parser = export_arg)]
    export: String,
}

fn store_arg(s: &str) -> Result<StoreSpec, String> {
    s.parse::<StoreSpec>().map_err(|e| match e {
        ferry_block::Error::BadSpec(m) => m.strip_prefix(&format!("{s}: ")).unwrap_or(&m).to_string(),
        other => other.to_string(),
    })
}

fn listen_arg(s: &str) -> Result<Listen, String> {
    s.parse::<Listen>().map_err(|e| {
        let m = e.to_string();
        m.strip_prefix(&format!("{s}: ")).unwrap_or(&m).to_string()
    })
}

fn size_arg(s: &str) -> Result<u64, String> {
    parse_size(s)
}

fn export_arg(s: &str) -> Result<String, String> {
    if s.len() > 4096 || s.contains('\0') {
        return Err("an export name is at most 4096 bytes of text".into());
    }
    Ok(s.to_string())
}

pub fn run(args: &BlockArgs) -> Result<(), CliError> {
    match &args.command {
        BlockCommand::Serve(a) => serve(a),
        BlockCommand::Bench(a) => bench::run(a),
    }
}

fn setup_error(e: ferry_block::Error) -> CliError {
    match e {
        ferry_block::Error::BadSpec(m) => CliError::Usage(m),
        other => CliError::Failed(other.to_string()),
    }
}

fn serve(a: &ServeArgs) -> Result<(), CliError> {
    if matches!(a.store, StoreSpec::Memory { .. }) && a.size.is_some() {
        return Err(CliError::Usage("--size is for file stores; a memory store takes its size from mem:SIZE".into()));
    }
    let store = open_store(&a.store, a.size, a.direct).map_err(setup_error)?;
    let description = store.describe();
    let store: Arc<dyn ferry_block::Store> = Arc::from(store);
    let config = ServerConfig {
        export_name: a.export.clone(),
        description: format!("Ferry block store: {description}"),
        read_only: a.read_only,
        ..ServerConfig::default()
    };
    let mut servers = Vec::new();
    for listen in &a.nbd {
        servers.push(NbdServer::bind(listen, store.clone(), config.clone()).map_err(setup_error)?);
    }
    println!(
        "ferry block: serving {description} as export {:?}{}",
        a.export,
        if a.read_only { ", read-only" } else { "" }
    );
    for s in &servers {
        println!("listening for NBD clients on {}", s.local_addr());
    }
    let mut handles = Vec::new();
    for s in servers {
        let h = s
            .spawn(|client| println!("{client}"))
            .map_err(|e| CliError::Failed(format!("cannot start a thread: {e}")))?;
        handles.push(h);
    }
    for h in handles {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(CliError::Failed(e.to_string())),
            Err(_) => return Err(CliError::Failed("the accepting thread stopped".into())),
        }
    }
    Ok(())
}
