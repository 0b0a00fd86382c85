//! `ferry block bench`: throughput of the block service by request size.
//!
//! For each request size, `--total` bytes are written in requests of that
//! size (`--inflight` at once) to a memory store, then read back the same
//! way; each phase's rate is printed (or one JSON object per line). The
//! transports:
//!
//! * `local`, `shm`, `net`: [`BlockClient`] and [`serve_channel`] over a
//!   Ferry channel between two threads, over shared memory, over TCP
//!   loopback;
//! * `nbd`: Ferry's NBD server over TCP loopback, driven by a small NBD
//!   client here (simple replies, requests pipelined);
//! * `nbdkit`: nbdkit's memory plugin, driven by the same NBD client — the
//!   peer to hold Ferry's NBD server against.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use ferry::{Domain, Endpoint};
use ferry_block::{serve_channel, BlockClient, MemStore, NbdServer, Op, ServerConfig, Store};

use crate::args::{power_of_two, whole};
use crate::CliError;

/// Every wait of the benchmark ends within this.
const T: Duration = Duration::from_secs(30);

/// How the client reaches the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Via {
    /// Ferry channel between two threads.
    Local,
    /// Ferry channel over shared memory.
    Shm,
    /// Ferry channel over TCP loopback.
    Net,
    /// Ferry's NBD server over TCP loopback.
    Nbd,
    /// nbdkit's memory plugin over TCP loopback (the peer).
    Nbdkit,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// How the client reaches the store (give it more than once to compare).
    #[arg(long = "via", value_enum, default_values = ["local", "nbd"])]
    via: Vec<Via>,
    /// Request size in bytes, a power of two from 4096 to 4194304 (give it more than once).
    #[arg(long = "size", value_parser = power_of_two(4096, 4 << 20), default_values = ["4096", "65536", "1048576"])]
    sizes: Vec<usize>,
    /// Bytes written (and then read) per request size, 1M to 4G.
    #[arg(long, value_parser = total_arg, default_value = "128M")]
    total: u64,
    /// Requests in flight at once, 1 to 256.
    #[arg(long, value_parser = whole::<usize>(1, 256), default_value = "16")]
    inflight: usize,
    /// One JSON object per measured point.
    #[arg(long)]
    json: bool,
    /// Measure a running server instead of one started here: its Ferry
    /// endpoint (`shm:PATH`, `shm@NAME`, `tcp:HOST:PORT`) with `--via shm`
    /// or `--via net`, its NBD address (`unix:PATH`, `tcp:HOST:PORT`) with
    /// `--via nbd`. Its store must hold `--total` bytes; they are overwritten.
    #[arg(long)]
    connect: Option<String>,
}

/// `--total`: a size from 1 MiB to 4 GiB.
fn total_arg(s: &str) -> Result<u64, String> {
    let n = ferry_block::parse_size(s)?;
    if !(1 << 20..=4 << 30).contains(&n) {
        return Err("out of range; give a size from 1M to 4G".into());
    }
    Ok(n)
}

/// One measured phase.
struct Rate {
    via: Via,
    op: &'static str,
    size: usize,
    bytes: u64,
    secs: f64,
}

impl Rate {
    fn print(&self, json: bool, inflight: usize) {
        let mb_s = self.bytes as f64 / self.secs / 1e6;
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "experiment": "block", "via": format!("{:?}", self.via).to_lowercase(), "op": self.op,
                    "size": self.size, "bytes": self.bytes, "inflight": inflight, "seconds": self.secs, "mb_per_s": mb_s,
                })
            );
        } else {
            println!(
                "{:<7} {:<5} {:>8} B requests: {:>9.1} MB/s ({} requests in {:.3} s, {inflight} in flight)",
                format!("{:?}", self.via).to_lowercase(),
                self.op,
                self.size,
                mb_s,
                self.bytes / self.size as u64,
                self.secs
            );
        }
    }
}

pub fn run(a: &BenchArgs) -> Result<(), CliError> {
    if a.sizes.iter().any(|&s| a.total < s as u64) {
        return Err(CliError::Usage("--total is smaller than a request; give at least the largest --size".into()));
    }
    if a.connect.is_some() && a.via.iter().any(|v| matches!(v, Via::Local | Via::Nbdkit)) {
        return Err(CliError::Usage("--connect goes with --via shm, net or nbd".into()));
    }
    for &via in &a.via {
        for &size in &a.sizes {
            let rates = match via {
                Via::Local | Via::Shm | Via::Net => ferry_channel(via, size, a)?,
                Via::Nbd | Via::Nbdkit => nbd(via, size, a)?,
            };
            for r in rates {
                r.print(a.json, a.inflight);
            }
        }
    }
    Ok(())
}

fn failed(what: &str) -> impl Fn(ferry_block::Error) -> CliError + '_ {
    move |e| CliError::Failed(format!("{what}: {e}"))
}

/// The store every transport writes into: as large as the bytes written.
fn store(a: &BenchArgs) -> Result<Arc<dyn Store>, CliError> {
    Ok(Arc::new(MemStore::new(a.total).map_err(failed("no memory store"))?))
}

fn ferry_channel(via: Via, size: usize, a: &BenchArgs) -> Result<Vec<Rate>, CliError> {
    if let Some(at) = &a.connect {
        let ep = crate::echo::parse_endpoint(at).map_err(|m| CliError::Usage(format!("--connect {at}: {m}")))?;
        let mut c = BlockClient::connect(&Domain::new("bench"), &ep, a.inflight as u64, size, T)
            .map_err(failed("cannot connect to the block server"))?;
        return drive(&mut c, via, size, a);
    }
    let ep = match via {
        Via::Local => Endpoint::local(),
        Via::Shm => Endpoint::shm_abstract(&format!("ferry-block-bench-{}-{size}", std::process::id())),
        _ => {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| CliError::Failed(format!("no free TCP port: {e}")))?
                .port();
            Endpoint::tcp(([127, 0, 0, 1], port).into())
        }
    };
    let store = store(a)?;
    let server = {
        let (ep, store) = (ep.clone(), store.clone());
        std::thread::spawn(move || serve_channel(&Domain::new("block server"), &ep, &*store, T))
    };
    let mut c = BlockClient::connect(&Domain::new("bench"), &ep, a.inflight as u64, size, T)
        .map_err(failed("cannot connect to the block server"))?;
    let rates = drive(&mut c, via, size, a)?;
    drop(c);
    match server.join() {
        Ok(Ok(_)) => Ok(rates),
        Ok(Err(e)) => Err(CliError::Failed(format!("the block server failed: {e}"))),
        Err(_) => Err(CliError::Failed("the block server thread stopped".into())),
    }
}

/// Write `--total` bytes in requests of `size`, then read them back.
fn drive(c: &mut BlockClient, via: Via, size: usize, a: &BenchArgs) -> Result<Vec<Rate>, CliError> {
    if c.size() < a.total {
        return Err(CliError::Usage(format!("the store holds {} bytes, less than --total", c.size())));
    }
    let count = a.total / size as u64;
    let mut rates = Vec::new();
    for op in [Op::Write, Op::Read] {
        let t0 = Instant::now();
        let (mut sent, mut done) = (0u64, 0u64);
        while done < count {
            if sent < count {
                if op == Op::Write {
                    if let Some(mut buf) = c.buffer() {
                        let mem = buf.as_mut_slice()?;
                        mem[..8].copy_from_slice(&sent.to_le_bytes());
                        c.submit(op, buf, sent * size as u64, size, false).map_err(failed("request refused"))?;
                        sent += 1;
                        continue;
                    }
                } else {
                    match c.submit_read(sent * size as u64, size) {
                        Ok(_) => {
                            sent += 1;
                            continue;
                        }
                        Err(ferry_block::Error::NoBuffer) => {}
                        Err(e) => return Err(failed("request refused")(e)),
                    }
                }
            }
            let comp = c.complete().map_err(failed("no completion"))?;
            if let Err(e) = comp.status {
                return Err(CliError::Failed(format!("the block server answered errno {e}")));
            }
            c.recycle(comp.buffer).map_err(failed("cannot give a buffer back"))?;
            done += 1;
        }
        rates.push(Rate {
            via,
            op: if op == Op::Write { "write" } else { "read" },
            size,
            bytes: count * size as u64,
            secs: t0.elapsed().as_secs_f64(),
        });
    }
    Ok(rates)
}

/// nbdkit, killed when dropped.
struct Nbdkit(Child);

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn nbd(via: Via, size: usize, a: &BenchArgs) -> Result<Vec<Rate>, CliError> {
    let mut _peer = None;
    let addr = if let Some(at) = &a.connect {
        at.clone()
    } else if via == Via::Nbd {
        let config = ServerConfig { max_payload: (size as u32).max(4096), ..ServerConfig::default() };
        let server = NbdServer::bind(&"tcp:127.0.0.1:0".parse().map_err(failed("address"))?, store(a)?, config)
            .map_err(failed("cannot listen"))?;
        let addr = server.local_addr().to_string();
        server.spawn(|_| {}).map_err(|e| CliError::Failed(format!("no thread: {e}")))?;
        addr
    } else {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| CliError::Failed(format!("no free TCP port: {e}")))?
            .port();
        let child = Command::new("nbdkit")
            .args(["-f", "-i", "127.0.0.1", "-p", &port.to_string(), "memory", &a.total.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| {
                CliError::Usage(format!("--via nbdkit: cannot run nbdkit ({e}); install it (scripts/setup does)"))
            })?;
        _peer = Some(Nbdkit(child));
        format!("tcp:127.0.0.1:{port}")
    };
    let mut s = connect_nbd(&addr)?;
    let count = a.total / size as u64;
    let payload = vec![0x5au8; size];
    let mut data = vec![0u8; size];
    let mut rates = Vec::new();
    for (op, name) in [(1u16, "write"), (0u16, "read")] {
        let t0 = Instant::now();
        let (mut sent, mut done) = (0u64, 0u64);
        let io = |e: std::io::Error| CliError::Failed(format!("NBD connection to {addr} failed: {e}"));
        while done < count {
            while sent < count && sent - done < a.inflight as u64 {
                let mut req = [0u8; 28];
                req[..4].copy_from_slice(&0x2560_9513u32.to_be_bytes());
                req[6..8].copy_from_slice(&op.to_be_bytes());
                req[8..16].copy_from_slice(&sent.to_be_bytes());
                req[16..24].copy_from_slice(&(sent * size as u64).to_be_bytes());
                req[24..].copy_from_slice(&(size as u32).to_be_bytes());
                s.write_all(&req).map_err(io)?;
                if op == 1 {
                    s.write_all(&payload).map_err(io)?;
                }
                sent += 1;
            }
            let mut reply = [0u8; 16];
            s.read_exact(&mut reply).map_err(io)?;
            let err = u32::from_be_bytes(reply[4..8].try_into().expect("4 bytes"));
            if err != 0 {
                return Err(CliError::Failed(format!("the NBD server answered errno {err}")));
            }
            if op == 0 {
                s.read_exact(&mut data).map_err(io)?;
            }
            done += 1;
        }
        rates.push(Rate { via, op: name, size, bytes: count * size as u64, secs: t0.elapsed().as_secs_f64() });
    }
    let mut disc = [0u8; 28];
    disc[..4].copy_from_slice(&0x2560_9513u32.to_be_bytes());
    disc[6..8].copy_from_slice(&2u16.to_be_bytes());
    let _ = s.write_all(&disc);
    Ok(rates)
}

/// A connection to an NBD server.
trait Conn: Read + Write {}
impl<T: Read + Write> Conn for T {}

/// Connect (retrying while the server starts) to `tcp:HOST:PORT` or
/// `unix:PATH` and do the handshake: fixed newstyle, NBD_OPT_EXPORT_NAME
/// "", simple replies.
fn connect_nbd(addr: &str) -> Result<Box<dyn Conn>, CliError> {
    let t0 = Instant::now();
    let io = |e: std::io::Error| CliError::Failed(format!("NBD handshake with {addr} failed: {e}"));
    let mut s: Box<dyn Conn> = loop {
        let tried = if let Some(path) = addr.strip_prefix("unix:") {
            std::os::unix::net::UnixStream::connect(path).and_then(|s| {
                s.set_read_timeout(Some(T))?;
                Ok(Box::new(s) as Box<dyn Conn>)
            })
        } else {
            TcpStream::connect(addr.strip_prefix("tcp:").unwrap_or(addr)).and_then(|s| {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(T))?;
                Ok(Box::new(s) as Box<dyn Conn>)
            })
        };
        match tried {
            Ok(s) => break s,
            Err(_) if t0.elapsed() < T => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(CliError::Failed(format!("cannot reach the NBD server at {addr}: {e}"))),
        }
    };
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).map_err(io)?;
    if &hello[..8] != b"NBDMAGIC" {
        return Err(CliError::Failed(format!("{addr} is not an NBD server")));
    }
    let no_zeroes = u16::from_be_bytes([hello[16], hello[17]]) & 2 != 0;
    s.write_all(&(1u32 | if no_zeroes { 2 } else { 0 }).to_be_bytes()).map_err(io)?;
    let mut opt = 0x4948_4156_454f_5054u64.to_be_bytes().to_vec();
    opt.extend_from_slice(&1u32.to_be_bytes());
    opt.extend_from_slice(&0u32.to_be_bytes());
    s.write_all(&opt).map_err(io)?;
    let mut export = vec![0u8; if no_zeroes { 10 } else { 134 }];
    s.read_exact(&mut export).map_err(io)?;
    Ok(s)
}
