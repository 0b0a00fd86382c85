//! `ferry bench`: the experiments of the papers in docs/REFERENCES.md, measured on Ferry's
//! backends and, side by side, on the baselines and peers of `bench/peers`.
//!
//! * `rtt`, `throughput` — [ETH-NET] §5.1.4/§5.1.3: a source domain and an
//!   echo domain that passes every buffer straight back ([`channel`]).
//! * `fbufs-table` — \[FBUFS\] Table 1 and its throughput-vs-size figure
//!   ([`fbufs`]); `fbufs` — the same on data paths and secured buffers.
//! * `pipeline` — \[CONTAINER\] Fig. 7: a chain of processes ([`pipeline`]).
//! * `chain` — \[CONTAINER\] Fig. 7 from a file to a file or `/dev/null`,
//!   against pipes and `cat | … | cat` ([`chain`]).
//! * `socket-touch` — \[CONTAINER\] Fig. 4 ([`socket_touch`]);
//!   `udp-forward` — \[CONTAINER\] Fig. 6 ([`udp_forward`]).
//! * `layers` — \[FBUFS\] §2: a layered protocol stack across three
//!   processes, on aggregates against copying at each layer ([`layers`]).
//!
//! Every figure is a distribution: we print the median with percentiles,
//! one [`Point`] per measured point (`--json`: one JSON object per line).
//! `--compare` runs Ferry and its baselines alternately and prints the
//! ratios ([`compare`]); `--plot FILE.svg` draws the points ([`plot`]).
//!
//! Bad input (unknown experiment or backend, sizes a pool cannot have, a
//! peer that is not built, a trust level the backend lacks) is a one-line
//! error and exit code 2.

pub mod chain;
pub mod channel;
pub mod child;
pub mod compare;
pub mod demux;
pub mod fanin;
pub mod fbufs;
pub mod iperf3;
pub mod layers;
pub mod peers;
pub mod pipeline;
pub mod plot;
pub mod point;
pub mod progress;
pub mod rig;
pub mod socket_touch;
mod tls_stream;
pub mod udp_forward;

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use crate::args::{whole, MAX_SIZE};
use crate::CliError;
pub use point::Point;

/// Most runs per point.
const MAX_RUNS: u64 = 10_000;
/// Most moves in flight.
const MAX_INFLIGHT: u64 = 16_384;
/// Most moves per throughput run (about a minute at Ferry's slowest rate).
const MAX_MOVES: u64 = 100_000_000;
/// Most bytes per pipeline run.
const MAX_TOTAL: u64 = 64 << 30;

/// `--plot`: a `.svg` file in a directory that exists.
fn svg_path(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    if p.extension().and_then(|e| e.to_str()) != Some("svg") {
        return Err("not an SVG file name; give a file name ending in .svg".into());
    }
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() && !d.is_dir() => {
            Err(format!("no directory {}; give a file in a directory that exists", d.display()))
        }
        _ => Ok(p),
    }
}

/// `--iperf3-gbit`: a rate in Gbit/s.
fn gbit_s(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(g) if g > 0.0 && g <= 10_000.0 => Ok(g),
        _ => Err("not a rate; give Gbit/s as a number more than 0 and at most 10000".into()),
    }
}

/// Bytes of memory this machine has (`MemTotal`), if it says.
fn memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// How many buffers of one size Ferry's pool holds in this experiment
/// (every one is written before measuring).
fn pool_buffers(a: &BenchArgs) -> usize {
    match a.experiment {
        Experiment::Rtt => channel::RTT_POOL,
        Experiment::Throughput => a.inflight.unwrap_or(250),
        Experiment::FbufsTable | Experiment::Fbufs => 4,
        Experiment::Pipeline => a.inflight.unwrap_or(16),
        Experiment::Fanin => a.inflight.unwrap_or(fanin::WINDOW),
        Experiment::Demux => a.inflight.unwrap_or(8),
        Experiment::SocketTouch => 4,
        Experiment::UdpForward => 128,
        Experiment::Chain => a.inflight.unwrap_or(16),
        Experiment::Layers => 4,
    }
}
use progress::Progress;

/// The experiments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Experiment {
    /// R runs of 250 sequential moves to an echo domain and back: round-trip time ([ETH-NET] §5.1.4).
    Rtt,
    /// R runs of overlapping moves (--inflight at once) to an echo domain: throughput ([ETH-NET] §5.1.3).
    Throughput,
    /// Per-page cost and asymptotic throughput of one domain crossing, cached/uncached ×
    /// volatile/secured (fbufs, Table 1 and its throughput-vs-size figure).
    FbufsTable,
    /// fbufs Table 1 on the data-path layer: cached = a `DataPath` pool reused, uncached = a fresh
    /// pool per transfer; volatile = the receiver reads in place, secured = it calls `secure()`
    /// first; against copying (--compare).
    Fbufs,
    /// A chain of N processes passing --total bytes of --size buffers end to end, against the
    /// same chain built with pipes and read/write (Container Shipping, Fig. 7).
    Pipeline,
    /// One server thread waiting on --channels channels (a Selector, or wait_any) from as many
    /// client threads: round trips with one client active (against one channel and
    /// `Channel::wait`), and throughput with all of them busy (against as many independent pairs);
    /// --backend shm: client processes, round trips only.
    Fanin,
    /// Two processes over an AF_UNIX socket, 128 KiB per I/O, the receiver touching all, half or
    /// none of the pages, with ferry-io against plain read/write (Container Shipping, Fig. 4).
    SocketTouch,
    /// Early demultiplexing: --channels channels (default 16) over one TCP connection against as
    /// many TCP connections: aggregate throughput, and the round trips of one priority channel
    /// while the others saturate the link.
    Demux,
    /// A forwarder of UDP datagrams (4 KiB) between two loopback sockets, ferry-io (batches of pool
    /// buffers) against recv/send with a buffer of its own, with 0-3 competing CPU-bound processes
    /// (Container Shipping, Fig. 6).
    UdpForward,
    /// A source process reading a file, N-2 processes handing the data on (touching it or not), a
    /// sink writing a file or /dev/null: Ferry channels against pipes with read/write and against
    /// `cat | … | cat` (Container Shipping, Fig. 7).
    Chain,
    /// A layered protocol stack across three processes A → B → C (fbufs §2): three layers add
    /// headers, the lowest fragments into 4 KiB units, a router forwards, the receiver reassembles
    /// and strips; on aggregates against the same stack copying at each layer.
    Layers,
}

impl Experiment {
    /// fbufs-table or fbufs: the per-page table and its figure.
    pub fn is_fbufs(self) -> bool {
        matches!(self, Experiment::FbufsTable | Experiment::Fbufs)
    }

    /// The name in output and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Experiment::Rtt => "rtt",
            Experiment::Throughput => "throughput",
            Experiment::FbufsTable => "fbufs-table",
            Experiment::Fbufs => "fbufs",
            Experiment::Pipeline => "pipeline",
            Experiment::Fanin => "fanin",
            Experiment::SocketTouch => "socket-touch",
            Experiment::Demux => "demux",
            Experiment::UdpForward => "udp-forward",
            Experiment::Chain => "chain",
            Experiment::Layers => "layers",
        }
    }
}

/// Transports: Ferry's backends, and the baselines and peers of bench/peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum Backend {
    /// Ferry: two domains in one process, one thread each.
    Local,
    /// Ferry: two processes on this host, shared-memory rings (the echo process is started by
    /// the benchmark, or by hand: --peer).
    Shm,
    /// Ferry: two processes over TCP (loopback; the echo process is started by the benchmark, or by hand: --peer tcp:HOST:PORT).
    Net,
    /// Ferry: TCP with TLS 1.3 and mutual certificates (loopback; the echo is a thread of this
    /// process; test certificates made for the run). Its --compare baseline is rustls-stream.
    NetTls,
    /// Ferry: one channel of a multiplexed session (`MuxSession`) over loopback TCP; the echo is a
    /// thread of this process on the session's other end; rtt and throughput. Its --compare
    /// baseline is net: a channel over a TCP connection of its own, its echo a thread as well.
    Mux,
    /// Ferry: two processes over a fabric (libfabric RMA; loopback, the provider from FI_PROVIDER,
    /// e.g. tcp; needs a ferry built with the feature `fabric`).
    Fabric,
    /// Baseline: rustls on a plain TCP stream over loopback, the same bytes as net-tls (an echo
    /// thread writes every message back; this command, no bench/peers).
    RustlsStream,
    /// Baseline: a Unix stream socket, each message copied through the kernel (bench/peers).
    UdsCopy,
    /// Baseline: TCP over 127.0.0.1 (bench/peers).
    TcpCopy,
    /// Baseline: two pipes (bench/peers).
    PipeCopy,
    /// Peer: iceoryx2 zero-copy publish-subscribe (bench/peers, built with its iceoryx2 feature).
    Iceoryx2,
    /// Floor: raw eventfd ping-pong (blocking) or a shared cache-line ping-pong (--busy-poll),
    /// no payload, rtt only (bench/peers).
    Eventfd,
    /// Baseline: iperf3, one TCP stream one way over 127.0.0.1 with --size messages, run by
    /// this command; throughput only (the baseline of --one-way --backend net).
    Iperf3,
}

impl Backend {
    /// The name in output and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Shm => "shm",
            Backend::Net => "net",
            Backend::NetTls => "net-tls",
            Backend::Mux => "mux",
            Backend::Fabric => "fabric",
            Backend::RustlsStream => "rustls-stream",
            Backend::UdsCopy => "uds-copy",
            Backend::TcpCopy => "tcp-copy",
            Backend::PipeCopy => "pipe-copy",
            Backend::Iceoryx2 => "iceoryx2",
            Backend::Eventfd => "eventfd",
            Backend::Iperf3 => "iperf3",
        }
    }

    /// Whether this is one of Ferry's own backends (measured in this process).
    pub fn is_ferry(self) -> bool {
        matches!(self, Backend::Local | Backend::Shm | Backend::Net | Backend::NetTls | Backend::Mux | Backend::Fabric)
    }
}

/// How the measured end waits for its next event when it sleeps (`--wait`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum Wait {
    /// `Channel::wait`: poll, spin, arm, sleep on the channel's fd.
    Channel,
    /// The channel's fd in an epoll set of the benchmark's own, as an application's event loop
    /// would: poll until nothing, `Channel::arm`, `epoll_wait`, poll.
    Epoll,
    /// A `ferry::Selector` holding the channel(s).
    Selector,
    /// `ferry::wait_any` over the channel(s).
    #[value(name = "wait-any")]
    Any,
}

impl Wait {
    /// The name in output and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Wait::Channel => "channel",
            Wait::Epoll => "epoll",
            Wait::Selector => "selector",
            Wait::Any => "wait-any",
        }
    }
}

/// Trust level of Ferry's channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Trust {
    /// No protection changes (fbufs: volatile).
    Full,
    /// The sender's own view is mprotected: a guard against accidents.
    Half,
    /// Kernel-enforced: shm and net (each side its own memory; not on the local backend).
    None,
}

impl Trust {
    /// The library's level.
    pub fn level(self) -> ::ferry::TrustLevel {
        match self {
            Trust::Full => ::ferry::TrustLevel::Full,
            Trust::Half => ::ferry::TrustLevel::Half,
            Trust::None => ::ferry::TrustLevel::None,
        }
    }
    /// The name in output.
    pub fn name(self) -> &'static str {
        match self {
            Trust::Full => "full",
            Trust::Half => "half",
            Trust::None => "none",
        }
    }
}

/// `ferry bench` arguments.
#[derive(Debug, Args)]
#[command(after_help = "Examples:
  ferry bench rtt --backend shm --size 4096 --size 1048576 --json
  ferry bench throughput --compare --against uds-copy --size 65536 --plot tp.svg
  ferry bench rtt --blocking --idle-us 200 --compare --against eventfd
  ferry bench rtt --backend mux --blocking --compare --against net
  ferry bench fbufs-table --backend shm --compare --plot fbufs.svg
  ferry bench fbufs --backend shm --compare
  ferry bench rtt --blocking --idle-us 200 --wait channel,epoll,selector --compare --against eventfd
  ferry bench pipeline --stages 2 --stages 5 --total 268435456
  ferry bench fanin --channels 64 --idle-us 200
  ferry bench chain --sink null,file --stages 3 --stages 5
  ferry bench udp-forward --competitors 0,1,2,3
  ferry bench layers --rounds 3")]
pub struct BenchArgs {
    /// Which experiment.
    #[arg(value_enum)]
    pub experiment: Experiment,
    /// Which transport (default: local; pipeline: shm and pipes side by side).
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// Buffer size in bytes, at most 1 GiB (Ferry: a power of two ≥ 4096); repeatable.
    #[arg(allow_negative_numbers = true, long = "size", value_parser = whole::<usize>(1, MAX_SIZE))]
    pub sizes: Vec<usize>,
    /// Runs per point (rtt: runs of 250 round trips, default 100; throughput: runs of --moves
    /// moves, default 20; fbufs-table, fbufs: runs of 25 transfers per size, default 10; pipeline:
    /// runs of --total bytes, default 3; fanin: runs of 250 round trips and runs of 1000 moves
    /// per client, default 20); 1 to 10 000. One more warm-up run is never recorded.
    #[arg(allow_negative_numbers = true, long, value_parser = whole::<usize>(1, MAX_RUNS))]
    pub runs: Option<usize>,
    /// Moves in flight at once (throughput: default 250; pipeline: buffers in the chain, default
    /// 16; fanin: per client, default 16); 1 to 16 384.
    #[arg(allow_negative_numbers = true, long, value_parser = whole::<usize>(1, MAX_INFLIGHT))]
    pub inflight: Option<usize>,
    /// Moves per throughput run (default 50 000; above 64 KiB with --touch, and for the copying
    /// peers, 2 GiB per run); at least --inflight, at most 100 000 000.
    #[arg(allow_negative_numbers = true, long, value_parser = whole::<usize>(1, MAX_MOVES))]
    pub moves: Option<usize>,
    /// Spin on the channel instead of sleeping (the default, except for pipeline).
    #[arg(long, conflicts_with = "blocking")]
    pub busy_poll: bool,
    /// Sleep until woken when there is nothing to do.
    #[arg(long)]
    pub blocking: bool,
    /// Trust level of the channel (fbufs-table: the level of the "secured" rows, default half;
    /// fbufs: of every row, default full).
    #[arg(long, value_enum)]
    pub trust: Option<Trust>,
    /// The sender writes every payload byte (a pattern) and the receiver checks every byte, as
    /// the peers do.
    #[arg(long)]
    pub touch: bool,
    /// Publish every message on its own instead of in batches (both ends;
    /// see `Channel::set_batching`).
    #[arg(long)]
    pub no_batching: bool,
    /// throughput: the echo gives every buffer back without its contents
    /// (`Channel::pass_unfilled`), as a consumer that is done with the data does, so that over
    /// TCP the payload travels one way, as iperf3's does; rates in GB/s. With --compare and
    /// --backend net the baseline is iperf3.
    #[arg(long)]
    pub one_way: bool,
    /// rtt and throughput over --backend local: both ends in one domain, as a process using
    /// Ferry's C interface holds both ends of a local channel (default: a domain per end).
    #[arg(long)]
    pub one_domain: bool,
    /// One JSON object per measured point on stdout.
    #[arg(long)]
    pub json: bool,
    /// Draw the points into this SVG file (its directory must exist).
    #[arg(long, value_name = "FILE.svg", value_parser = svg_path)]
    pub plot: Option<PathBuf>,
    /// Run Ferry and its baselines/peers alternately (--rounds times) and print the ratios.
    #[arg(long)]
    pub compare: bool,
    /// With --compare: the baselines/peers to run (default: every one that applies and is built).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub against: Vec<Backend>,
    /// With --compare: how many times each is measured, alternately (1 to 100).
    #[arg(allow_negative_numbers = true, long, default_value_t = 2, value_parser = whole::<usize>(1, 100))]
    pub rounds: usize,
    /// shm (net): use an echo domain started by hand (`ferry echo --endpoint ENDPOINT`, started
    /// after this command is waiting) instead of starting one; rtt and throughput only. With net,
    /// ENDPOINT is tcp:HOST:PORT, the address this command listens on (off the loopback: TLS, or
    /// --insecure). The TLS flags apply to rtt and throughput with --backend net: this command
    /// listens (--tls-certificates needs the server pair), the echo connects (the client pair); an
    /// echo this command starts gets the same flags, one started by hand needs them too.
    #[arg(long, value_name = "ENDPOINT")]
    pub peer: Option<String>,
    // --backend net, rtt and throughput: TLS between this command and the echo (see --peer).
    #[command(flatten)]
    pub tls: crate::tls_args::TlsFlags,
    /// rtt, fanin: pause this many µs between round trips, so a blocking channel goes idle and the
    /// measured path is the doorbell/sleep path rather than the spin (0 to 10 000 000, i.e. 10 s).
    #[arg(allow_negative_numbers = true, long, default_value_t = 0, value_parser = whole::<u64>(0, 10_000_000))]
    pub idle_us: u64,
    /// rtt --blocking: how the source waits (default channel); fanin: how the server waits on its
    /// channels (default selector and wait-any). Repeatable or comma-separated: each is measured
    /// in turn, side by side.
    #[arg(long = "wait", value_enum, value_delimiter = ',')]
    pub waits: Vec<Wait>,
    /// fanin: channels into the server (1 to 1024, default 64).
    #[arg(allow_negative_numbers = true, long, value_parser = whole::<usize>(1, 1024))]
    pub channels: Option<usize>,
    /// pipeline: bytes passed end to end per run (a multiple of --size, at most 64 GiB; default 1 GiB);
    /// socket-touch: bytes sent per run (default 256 MiB); udp-forward: bytes per run, in --size
    /// datagrams (default 100 000 datagrams).
    #[arg(allow_negative_numbers = true, long, value_parser = whole::<u64>(4096, MAX_TOTAL))]
    pub total: Option<u64>,
    /// pipeline, chain: processes in the chain (2 to 8); repeatable (default pipeline 2, 3, 4, 5; chain 3, 5).
    #[arg(allow_negative_numbers = true, long = "stages", value_parser = whole::<usize>(2, 8))]
    pub stages: Vec<usize>,
    /// udp-forward: competing CPU-bound processes (0 to 16); repeatable (default 0, 1, 2, 3).
    #[arg(allow_negative_numbers = true, long = "competitors", value_delimiter = ',', value_parser = whole::<usize>(0, 16))]
    pub competitors: Vec<usize>,
    /// chain: where the sink writes (null: /dev/null, file: a file); repeatable or comma-separated
    /// (default both).
    #[arg(long = "sink", value_enum, value_delimiter = ',')]
    pub sinks: Vec<chain::Sink>,
    /// Plots of throughput: draw a loopback iperf3 line at this many Gbit/s (measured elsewhere;
    /// more than 0, at most 10 000).
    #[arg(allow_negative_numbers = true, long, value_name = "GBIT_S", value_parser = gbit_s)]
    pub iperf3_gbit: Option<f64>,
    /// layers: a quick run for smoke tests (one run of 4 messages per size and stack, every
    /// message verified).
    #[arg(long)]
    pub quick: bool,
}

impl BenchArgs {
    /// The primary backend (the experiment's default when not given).
    pub fn backend(&self) -> Backend {
        self.backend.unwrap_or(match self.experiment {
            Experiment::Pipeline | Experiment::Layers => Backend::Shm,
            _ => Backend::Local,
        })
    }

    /// Whether channels spin (busy-poll) rather than sleep.
    pub fn busy(&self) -> bool {
        match self.experiment {
            // More processes than cores: spinning stages would take turns on the CPUs.
            Experiment::Pipeline => self.busy_poll,
            _ => !self.blocking,
        }
    }

    /// `busy-poll` or `blocking`.
    pub fn mode(&self) -> &'static str {
        if self.busy() {
            "busy-poll"
        } else {
            "blocking"
        }
    }

    /// pipeline: bytes per run (default 1 GiB).
    pub fn total(&self) -> u64 {
        self.total.unwrap_or(1 << 30)
    }

    /// The trust level asked for (default full; fbufs-table: half for the secured rows).
    pub fn trust(&self) -> Trust {
        self.trust.unwrap_or(match self.experiment {
            Experiment::FbufsTable => Trust::Half,
            _ => Trust::Full,
        })
    }
}

/// What a run of `ferry bench` carries around: the arguments, the
/// progress bar and every point measured (for the ratios and the plot).
pub struct Ctx<'a> {
    /// The arguments.
    pub args: &'a BenchArgs,
    /// The progress bar.
    pub progress: Progress,
    /// Every point so far, in order.
    pub points: Vec<Point>,
}

impl Ctx<'_> {
    /// Print a point and keep it.
    pub fn emit(&mut self, p: Point) {
        if self.args.json {
            self.progress.println(&serde_json::Value::Object(p.0.clone()).to_string());
        } else {
            self.progress.println(&p.text());
        }
        self.points.push(p);
    }
}

fn usage(msg: impl Into<String>) -> CliError {
    CliError::Usage(msg.into())
}

/// Check that `sizes` can be pool buffer sizes.
pub fn check_pool_sizes(sizes: &[usize]) -> Result<(), CliError> {
    for &size in sizes {
        if !size.is_power_of_two() || size < 4096 {
            return Err(usage(format!(
                "--size {size}: not a power of two of at least 4096 bytes, as Ferry's pool buffers are; give e.g. 4096, 65536 or 1048576"
            )));
        }
    }
    Ok(())
}

/// Map the library's "trust level not supported" to a usage error (exit 2).
pub fn trust_error(e: ::ferry::Error) -> CliError {
    match e.kind() {
        ::ferry::ErrorKind::TrustNotSupported { trust, backend } => {
            let name = match trust {
                ::ferry::TrustLevel::None => "none",
                ::ferry::TrustLevel::Half => "half",
                _ => "full",
            };
            usage(format!(
                "--trust {name}: the {backend} backend does not offer this trust level; give --trust full or half"
            ))
        }
        _ => e.into(),
    }
}

fn validate(a: &BenchArgs) -> Result<(), CliError> {
    let backend = a.backend();
    let exp = a.experiment;
    let only = |flag: &str, given: bool, applies: bool, to: &str| {
        if given && !applies {
            Err(usage(format!("{flag} applies to {to} only; leave it out for {}", exp.name())))
        } else {
            Ok(())
        }
    };
    only("--idle-us", a.idle_us > 0, matches!(exp, Experiment::Rtt | Experiment::Fanin), "rtt and fanin")?;
    let channeled = matches!(exp, Experiment::Fanin | Experiment::Demux);
    only("--channels", a.channels.is_some(), channeled, "fanin and demux")?;
    only("--quick", a.quick, exp == Experiment::Layers, "layers")?;
    if exp == Experiment::Layers {
        // Always both stacks, trust FULL, blocking, payload written and checked.
        for (flag, given) in [
            ("--compare", a.compare),
            ("--trust", a.trust.is_some()),
            ("--touch", a.touch),
            ("--busy-poll", a.busy_poll),
            ("--blocking", a.blocking),
            ("--no-batching", a.no_batching),
        ] {
            if given {
                return Err(usage(format!(
                    "{flag} does not apply to layers (it always runs both stacks, trust full, blocking, every payload written); leave it out"
                )));
            }
        }
    }
    only("--wait", !a.waits.is_empty(), matches!(exp, Experiment::Rtt | Experiment::Fanin), "rtt and fanin")?;
    if exp == Experiment::Rtt && !a.waits.is_empty() && a.busy() {
        return Err(usage("--wait chooses how a sleeping end waits; add --blocking"));
    }
    if exp == Experiment::Rtt && a.waits.iter().any(|w| *w != Wait::Channel) && !a.backend().is_ferry() {
        return Err(usage(format!(
            "--wait: {} is not one of Ferry's backends; give --backend local, shm or net",
            a.backend().name()
        )));
    }
    if let Some(w) = a.waits.iter().find(|w| exp == Experiment::Fanin && matches!(w, Wait::Channel | Wait::Epoll)) {
        return Err(usage(format!(
            "--wait {}: the fanin server waits on many channels; give selector or wait-any",
            w.name()
        )));
    }
    only("--moves", a.moves.is_some(), exp == Experiment::Throughput, "throughput")?;
    only("--one-way", a.one_way, exp == Experiment::Throughput, "throughput")?;
    only("--one-domain", a.one_domain, matches!(exp, Experiment::Rtt | Experiment::Throughput), "rtt and throughput")?;
    if a.one_domain && (backend != Backend::Local || a.compare) {
        return Err(usage(
            "--one-domain puts both ends of a local channel in one domain; give --backend local, without --compare",
        ));
    }
    if a.one_way && !backend.is_ferry() {
        return Err(usage(format!(
            "--one-way: {} is not one of Ferry's backends (its sink decides what goes back); give --backend local, shm, net or net-tls",
            backend.name()
        )));
    }
    if backend == Backend::Iperf3 && exp != Experiment::Throughput {
        return Err(usage(format!(
            "--backend iperf3: one TCP stream one way; use it with throughput, not {}",
            exp.name()
        )));
    }
    let windowed = matches!(
        exp,
        Experiment::Throughput | Experiment::Pipeline | Experiment::Fanin | Experiment::Demux | Experiment::Chain
    );
    only("--inflight", a.inflight.is_some(), windowed, "throughput, pipeline, chain, fanin and demux")?;
    let chains = matches!(exp, Experiment::Pipeline | Experiment::Chain);
    only("--stages", !a.stages.is_empty(), chains, "pipeline and chain")?;
    let totals =
        matches!(exp, Experiment::Pipeline | Experiment::SocketTouch | Experiment::UdpForward | Experiment::Chain);
    only("--total", a.total.is_some(), totals, "pipeline, chain, socket-touch and udp-forward")?;
    only("--sink", !a.sinks.is_empty(), exp == Experiment::Chain, "chain")?;
    only("--competitors", !a.competitors.is_empty(), exp == Experiment::UdpForward, "udp-forward")?;
    if exp.is_fbufs() && !a.sizes.is_empty() {
        let mut distinct = a.sizes.clone();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() < 2 {
            return Err(usage(format!(
                "--size {}: {} fits its per-page cost over two sizes or more; give --size at least twice, with different sizes",
                a.sizes[0],
                exp.name()
            )));
        }
    }
    if a.iperf3_gbit.is_some() && a.plot.is_none() {
        return Err(usage("--iperf3-gbit draws a line into the plot; give --plot FILE.svg too"));
    }
    if !a.against.is_empty() && !a.compare {
        return Err(usage("--against needs --compare; add --compare"));
    }
    // A session's channel is compared with a channel over a connection of its own.
    if let Some(b) = a.against.iter().find(|b| b.is_ferry() && !(backend == Backend::Mux && **b == Backend::Net)) {
        return Err(usage(format!(
            "--against {}: Ferry's own backends are chosen with --backend; --against takes baselines and peers \
             (and net with --backend mux)",
            b.name()
        )));
    }
    if backend == Backend::Mux && !matches!(exp, Experiment::Rtt | Experiment::Throughput) {
        return Err(usage(format!(
            "--backend mux: a session's channel is measured with rtt and throughput; for many channels on one \
             session use demux, not {}",
            exp.name()
        )));
    }
    if a.compare && !backend.is_ferry() {
        return Err(usage(format!(
            "--compare with --backend {}: --compare runs Ferry against its baselines; choose --backend local, shm, net or net-tls",
            backend.name()
        )));
    }
    if !a.tls.is_default() {
        if backend != Backend::Net || !matches!(exp, Experiment::Rtt | Experiment::Throughput) {
            return Err(usage(
                "--tls, --tls-certificates and --insecure apply to rtt and throughput with --backend net; add those, or drop the TLS flags",
            ));
        }
        a.tls.uses_tls()?;
    }
    if a.peer.is_some() {
        if !matches!(backend, Backend::Shm | Backend::Net) {
            return Err(usage("--peer needs --backend shm or net (an echo process started by hand); add one"));
        }
        if !matches!(exp, Experiment::Rtt | Experiment::Throughput) {
            return Err(usage(
                "--peer applies to rtt and throughput only (the other experiments start their own processes)",
            ));
        }
    }
    if backend.is_ferry() && exp != Experiment::UdpForward {
        check_pool_sizes(&a.sizes)?;
        let window = a.inflight.unwrap_or(250);
        if exp == Experiment::Throughput && a.moves.is_some_and(|m| m < window) {
            return Err(usage(format!(
                "--moves {}: fewer than the {window} moves in flight (--inflight); give at least {window}, or a smaller --inflight",
                a.moves.unwrap_or(0)
            )));
        }
        check_pool_memory(a)?;
    }
    if backend == Backend::Eventfd && exp != Experiment::Rtt {
        return Err(usage("--backend eventfd: the wake-up floor has no payload; use it with rtt only"));
    }
    Ok(())
}

/// Refuse pools that would not fit in memory: Ferry writes every buffer
/// of its pool before measuring.
fn check_pool_memory(a: &BenchArgs) -> Result<(), CliError> {
    let Some(mem) = memory_bytes() else { return Ok(()) };
    let count = pool_buffers(a) as u64;
    for &size in &a.sizes {
        let bytes = count.saturating_mul(size as u64);
        if bytes > mem / 2 {
            let most = (mem / 2 / count).next_power_of_two() / 2;
            return Err(usage(format!(
                "--size {size}: a pool of {count} such buffers needs {} MiB, more than half of this machine's {} MiB; \
                 give at most --size {most}{}",
                bytes >> 20,
                mem >> 20,
                if windowed_pool(a) { " or a smaller --inflight" } else { "" }
            )));
        }
    }
    Ok(())
}

fn windowed_pool(a: &BenchArgs) -> bool {
    matches!(a.experiment, Experiment::Throughput | Experiment::Pipeline | Experiment::Fanin | Experiment::Demux)
}

/// `ferry bench`.
pub fn run(args: &BenchArgs) -> Result<(), CliError> {
    validate(args)?;
    let mut ctx = Ctx { args, progress: Progress::hidden(), points: Vec::new() };
    match args.experiment {
        Experiment::Rtt | Experiment::Throughput => channel::run(&mut ctx)?,
        Experiment::FbufsTable | Experiment::Fbufs => fbufs::run(&mut ctx)?,
        Experiment::Pipeline => pipeline::run(&mut ctx)?,
        Experiment::Fanin => fanin::run(&mut ctx)?,
        Experiment::SocketTouch => socket_touch::run(&mut ctx)?,
        Experiment::Demux => demux::run(&mut ctx)?,
        Experiment::UdpForward => udp_forward::run(&mut ctx)?,
        Experiment::Chain => chain::run(&mut ctx)?,
        Experiment::Layers => layers::run(&mut ctx)?,
    }
    drop(std::mem::replace(&mut ctx.progress, Progress::hidden()));
    if args.experiment == Experiment::Fanin {
        fanin::print_ratios(&ctx);
    } else if args.compare || args.experiment == Experiment::Pipeline {
        compare::print_ratios(&ctx);
    }
    if let Some(path) = &args.plot {
        plot::draw(&ctx, path)?;
        if !args.json {
            println!("plot written to {}", path.display());
        }
    }
    Ok(())
}

/// Moves per throughput run when `--moves` is not given: 50 000, as the
/// peers in bench/peers run; where every byte is handled (`handled`: the
/// payload touched, or encrypted) and buffers are above 64 KiB, 2 GiB's
/// worth instead (a 1 MiB run would otherwise move 50 GB).
pub(crate) fn default_moves(size: usize, handled: bool) -> usize {
    if handled && size > 64 << 10 {
        ((2usize << 30) / size).max(1)
    } else {
        50_000
    }
}

/// [`BenchArgs`] from a `ferry bench` command line without the command
/// (`"rtt --backend shm"`), for the benchmarks' tests.
#[cfg(test)]
pub(crate) fn parse_bench_args(line: &str) -> Result<BenchArgs, clap::Error> {
    use clap::Parser;

    #[derive(Parser)]
    struct Command {
        #[command(flatten)]
        args: BenchArgs,
    }
    Command::try_parse_from(std::iter::once("ferry-bench").chain(line.split_whitespace())).map(|c| c.args)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(args: &[&str]) -> Result<(), CliError> {
        validate(&parse_bench_args(&args.join(" ")).map_err(|e| CliError::Usage(e.to_string()))?)
    }

    #[test]
    fn bad_input_is_a_usage_error() {
        for bad in [
            &["nonsense"][..],
            &["rtt", "--backend", "carrier-pigeon"],
            &["rtt", "--size", "1000"],
            &["rtt", "--size", "2048"],
            &["rtt", "--runs", "0"],
            &["throughput", "--inflight", "0"],
            &["throughput", "--idle-us", "10"],
            &["rtt", "--against", "uds-copy"],
            &["rtt", "--compare", "--against", "shm"],
            &["rtt", "--compare", "--backend", "uds-copy"],
            &["rtt", "--peer", "shm@x"],
            &["fbufs-table", "--backend", "shm", "--peer", "shm@x"],
            &["throughput", "--backend", "eventfd"],
            &["rtt", "--plot", "x.png"],
            &["rtt", "--busy-poll", "--blocking"],
            &["rtt", "--size", "1099511627776"],
            &["rtt", "--size", "0"],
            &["rtt", "--runs", "-1"],
            &["rtt", "--moves", "100"],
            &["rtt", "--inflight", "8"],
            &["throughput", "--moves", "0"],
            &["throughput", "--moves", "100"],
            &["throughput", "--size", "1073741824"],
            &["throughput", "--iperf3-gbit", "5"],
            &["pipeline", "--stages", "1"],
            &["pipeline", "--total", "0"],
            &["rtt", "--stages", "2"],
            &["rtt", "--rounds", "0"],
            &["fbufs-table", "--size", "4096"],
            &["fbufs-table", "--size", "4096", "--size", "4096"],
            &["fbufs", "--size", "4096"],
            &["rtt", "--wait", "epoll"],
            &["rtt", "--blocking", "--wait", "poll"],
            &["throughput", "--blocking", "--wait", "epoll"],
            &["rtt", "--blocking", "--channels", "4"],
            &["fanin", "--wait", "epoll"],
            &["fanin", "--channels", "0"],
            &["fanin", "--channels", "1025"],
            &["rtt", "--blocking", "--backend", "eventfd", "--wait", "selector"],
            &["rtt", "--quick"],
            &["layers", "--compare"],
            &["layers", "--trust", "half"],
            &["layers", "--busy-poll"],
            &["throughput", "--backend", "net-tls", "--peer", "tcp:127.0.0.1:1"],
            &["throughput", "--compare", "--against", "rustls-stream", "--backend", "rustls-stream"],
            &["rtt", "--one-way"],
            &["throughput", "--backend", "uds-copy", "--one-way"],
            &["rtt", "--backend", "iperf3"],
            // net is a baseline only of a session's channel.
            &["rtt", "--backend", "shm", "--compare", "--against", "net"],
            &["rtt", "--backend", "mux", "--compare", "--against", "shm"],
            &["fbufs-table", "--backend", "mux"],
            &["rtt", "--backend", "mux", "--peer", "tcp:127.0.0.1:1"],
            // One domain is a local channel's, measured on its own.
            &["rtt", "--backend", "shm", "--one-domain"],
            &["throughput", "--one-domain", "--compare"],
            &["fanin", "--one-domain"],
        ] {
            assert!(matches!(check(bad), Err(CliError::Usage(_))), "{bad:?} accepted");
        }
        for good in [
            &["rtt"][..],
            &["rtt", "--backend", "shm", "--peer", "shm@x", "--size", "4096"],
            &["rtt", "--blocking", "--idle-us", "200", "--compare", "--against", "eventfd"],
            &["throughput", "--backend", "uds-copy", "--size", "1000"],
            &["rtt", "--backend", "net", "--size", "4096"],
            &["pipeline", "--stages", "2", "--total", "1048576"],
            &["fbufs-table", "--plot", "f.svg"],
            &["fbufs", "--backend", "shm", "--size", "4096", "--size", "65536", "--compare"],
            &["rtt", "--blocking", "--idle-us", "200", "--wait", "epoll", "--compare", "--against", "eventfd"],
            &["rtt", "--blocking", "--backend", "shm", "--wait", "channel,epoll,selector,wait-any"],
            &["fanin", "--channels", "64", "--idle-us", "200", "--wait", "selector"],
            &["fanin", "--channels", "8", "--runs", "1", "--inflight", "4"],
            &["layers", "--quick"],
            &["layers", "--size", "1048576", "--rounds", "3"],
            &["throughput", "--backend", "net-tls", "--compare", "--size", "1048576"],
            &["throughput", "--backend", "rustls-stream", "--size", "65536"],
            &["throughput", "--backend", "net", "--one-way", "--compare", "--against", "iperf3"],
            &["throughput", "--backend", "shm", "--one-way"],
            &["throughput", "--backend", "iperf3", "--size", "65536"],
            &["rtt", "--backend", "mux", "--blocking", "--compare", "--against", "net"],
            &["rtt", "--backend", "mux", "--busy-poll", "--compare"],
            &["throughput", "--backend", "mux", "--compare", "--against", "net,tcp-copy"],
            &["rtt", "--backend", "local", "--one-domain", "--busy-poll"],
            &["throughput", "--one-domain"],
        ] {
            assert!(check(good).is_ok(), "{good:?} refused");
        }
    }

    #[test]
    fn defaults_per_experiment() {
        let a = parse_bench_args("pipeline").unwrap();
        assert_eq!((a.backend(), a.busy(), a.trust()), (Backend::Shm, false, Trust::Full));
        let a = parse_bench_args("fbufs-table").unwrap();
        assert_eq!((a.backend(), a.busy(), a.trust()), (Backend::Local, true, Trust::Half));
        // fbufs: the receiver secures, the channel stays at trust FULL.
        let a = parse_bench_args("fbufs").unwrap();
        assert_eq!((a.backend(), a.busy(), a.trust()), (Backend::Local, true, Trust::Full));
        let a = parse_bench_args("rtt --blocking").unwrap();
        assert_eq!((a.mode(), a.trust()), ("blocking", Trust::Full));
    }
}
