//! An async echo server on tokio (feature `tokio`): the server serves
//! several clients, one task per client channel; each client is a task
//! that moves buffers to the server, which checks every byte, writes each
//! byte's complement and passes the buffer back; the client checks that.
//! Local backend (one process); the same code serves other processes over
//! `Endpoint::shm` or `Endpoint::tcp`.
//!
//! Run: `cargo run -p ferry --release --features tokio --example tokio_echo`
//! (`--clients N`, `--rounds N` for other amounts; default 4 clients, 1000
//! round trips each, 4 KiB buffers, 8 in flight).

use std::process::ExitCode;
use std::time::Duration;

use ferry::tokio::AsyncChannel;
use ferry::{
    Allocator, BindParams, Channel, ChannelSetup, Direction, Domain, Endpoint, Event, PoolConstraints, PoolPolicy,
};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const BUFFER_SIZE: usize = 4096;
const IN_FLIGHT: u64 = 8;
/// The longest the whole run may take.
const LIMIT: Duration = Duration::from_secs(60);

/// Byte `i` of the buffer number `seq` as the client writes it.
fn pattern(seq: u64, i: usize) -> u8 {
    (seq.wrapping_mul(31) as usize ^ i.wrapping_mul(7)) as u8
}

/// The server's side of one client: check each buffer, write the
/// complement of every byte, pass it back; until the client closes.
async fn serve(mut ch: AsyncChannel) -> Result<u64> {
    ch.wait_connected().await?;
    let mut echoed = 0;
    while let Some(ev) = ch.next_event().await {
        match ev {
            Event::MoveReceived { mut buffer, meta } => {
                let seq = u64::from_le_bytes(meta[..8].try_into()?);
                let bytes = buffer.as_mut_slice()?;
                for (i, b) in bytes.iter_mut().enumerate() {
                    if *b != pattern(seq, i) {
                        return Err(format!("server: buffer {seq}, byte {i} differs").into());
                    }
                    *b = !*b;
                }
                ch.pass(buffer, &meta).await?;
                echoed += 1;
            }
            Event::PoolAssignRequest(_) => {} // accepted already (AcceptAll)
            Event::Closed { .. } => break,
            Event::Error(e) => return Err(e.into()),
            other => return Err(format!("server: unexpected {other:?}").into()),
        }
    }
    Ok(echoed)
}

/// One client: bind to the server's endpoint, assign a pool, run `rounds`
/// round trips with up to `IN_FLIGHT` buffers out, check every byte that
/// comes back, then close.
async fn client(n: usize, endpoint: Endpoint, rounds: u64) -> Result<u64> {
    let domain = Domain::new(&format!("client-{n}"));
    let mut ch = AsyncChannel::new(Channel::bind(&domain, &endpoint, BindParams::default())?).map_err(|r| r.error)?;
    ch.wait_connected().await?;
    let alloc = Allocator::new(&domain, IN_FLIGHT, BUFFER_SIZE, PoolConstraints::default())?;
    ch.assign_pool_and_wait(alloc.pool()).await?;
    let (mut sent, mut back) = (0, 0);
    while back < rounds {
        while sent < rounds {
            let Some(mut buf) = alloc.alloc() else { break };
            for (i, b) in buf.as_mut_slice()?.iter_mut().enumerate() {
                *b = pattern(sent, i);
            }
            ch.move_buffer(buf, &sent.to_le_bytes()).await?;
            sent += 1;
        }
        match ch.next_event().await {
            Some(Event::BufferPassed { buffer, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into()?);
                if let Some(i) = (0..buffer.len()).find(|&i| buffer[i] != !pattern(seq, i)) {
                    return Err(format!("client {n}: buffer {seq} came back with byte {i} wrong").into());
                }
                back += 1;
            }
            Some(Event::Error(e)) => return Err(e.into()),
            other => return Err(format!("client {n}: unexpected {other:?}").into()),
        }
    }
    ch.teardown().await?;
    match ch.next_event().await {
        Some(Event::Closed { .. }) => Ok(back),
        other => Err(format!("client {n}: expected the close, got {other:?}").into()),
    }
}

async fn run(clients: usize, rounds: u64) -> Result<()> {
    let server = Domain::new("server");
    let mut servers = Vec::new();
    let mut tasks = Vec::new();
    for n in 0..clients {
        // One endpoint per client; the server's end receives.
        let endpoint = Endpoint::local();
        let setup = ChannelSetup { direction: Direction::Rx, ..ChannelSetup::default() };
        let mut ch = Channel::create(&server, &endpoint, setup)?;
        ch.set_pool_policy(PoolPolicy::AcceptAll);
        servers.push(tokio::spawn(serve(AsyncChannel::new(ch).map_err(|r| r.error)?)));
        tasks.push(tokio::spawn(client(n, endpoint, rounds)));
    }
    for (n, (client, server)) in tasks.into_iter().zip(servers).enumerate() {
        let back = client.await??;
        let echoed = server.await??;
        println!(
            "client {n}: {back} buffers of {} KiB echoed by the server ({echoed} served), every byte verified both ways",
            BUFFER_SIZE >> 10
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut clients = 4usize;
    let mut rounds = 1000u64;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().and_then(|v| v.parse::<u64>().ok()).filter(|&v| v > 0);
        match (flag.as_str(), value) {
            ("--clients", Some(v)) => clients = v as usize,
            ("--rounds", Some(v)) => rounds = v,
            _ => {
                eprintln!("{flag}: expected --clients N or --rounds N (N > 0)");
                return ExitCode::from(2);
            }
        }
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(async { tokio::time::timeout(LIMIT, run(clients, rounds)).await }) {
        Ok(Ok(())) => {
            println!("all checks passed: {clients} clients, {rounds} round trips each");
            ExitCode::SUCCESS
        }
        Ok(Err(e)) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!("error: not done within {} s", LIMIT.as_secs());
            ExitCode::FAILURE
        }
    }
}
