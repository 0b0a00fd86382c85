//! Command-line arguments of the measuring (source) side and their
//! validation into a [`Plan`]: which points to measure, and how.

use clap::{Args, ValueEnum};

/// Round trips per rtt run ([ETH-NET] §5.1.3/§5.1.4, as `ferry bench`).
pub const RTT_PER_RUN: usize = 250;
/// Transfers per fbufs run (as `ferry bench fbufs-table`).
pub const FBUFS_PER_RUN: usize = 25;
/// The page of the fbufs transfers: one word written and read per page.
pub const PAGE: usize = 4096;
/// Default messages per throughput run up to 64 KiB (as `ferry bench`).
pub const MOVES_SMALL: usize = 50_000;
/// Above 64 KiB, copying peers (and --touch) move this many bytes per run by default (≈ 1 s here).
pub const BYTES_PER_RUN_LARGE: usize = 2 << 30;
/// Largest message: a run must fit in memory, and iceoryx2 preallocates (inflight + 4) of them per direction.
pub const MAX_SIZE: usize = 1 << 30;
/// iceoryx2 shared memory allowed for one point (both directions).
pub const MAX_SHM: usize = 8 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Experiment {
    /// R runs of 250 sequential round trips; every round trip is a sample (µs).
    Rtt,
    /// R runs of --moves messages with up to --inflight in flight; every run is a sample (Mops/s).
    Throughput,
    /// fbufs (Table 1) transfers, copying peers only: R runs of 25 one-way messages, each with
    /// one word written per page, read whole by the echo (one word per page checked) and answered
    /// with 8 bytes; every transfer is a sample (µs), and each run's median is reported.
    Fbufs,
}

/// The transports measured here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Peer {
    Iceoryx2,
    Eventfd,
    Uds,
    Tcp,
    Pipe,
}

impl Peer {
    fn copies_through_kernel(self) -> bool {
        matches!(self, Peer::Uds | Peer::Tcp | Peer::Pipe)
    }
}

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Which experiment.
    #[arg(value_enum)]
    pub experiment: Experiment,
    /// Message size in bytes (a multiple of 8; default 4096); repeatable.
    #[arg(long = "size")]
    pub sizes: Vec<usize>,
    /// Runs (rtt: runs of 250 round trips, default 100; throughput: runs of --moves messages, default 20).
    #[arg(long)]
    pub runs: Option<usize>,
    /// Messages per throughput run (default 50 000 up to 64 KiB; above, 2 GiB / size for copying peers or --touch).
    #[arg(long)]
    pub moves: Option<usize>,
    /// Messages in flight at once (throughput).
    #[arg(long, default_value_t = 250)]
    pub inflight: usize,
    /// Spin instead of sleeping (iceoryx2 default; eventfd: the shared-memory cache-line ping-pong).
    #[arg(long, conflicts_with = "blocking")]
    pub busy_poll: bool,
    /// Sleep until woken (iceoryx2: listener/notifier events; the default of the other peers).
    #[arg(long)]
    pub blocking: bool,
    /// The sender writes and the receiver reads (checks) every payload byte.
    #[arg(long)]
    pub touch: bool,
    /// One JSON object per measured point on stdout.
    #[arg(long)]
    pub json: bool,
    /// Give up on a point after this many seconds (the echo process is killed).
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// rtt: pause this many µs before each round trip, so the echo goes idle (sleeps) and the
    /// measured path is the wake-up rather than the spin.
    #[arg(long, default_value_t = 0)]
    pub idle_us: u64,
    /// Testing only: the echo process exits after echoing this many messages.
    #[arg(long, hide = true)]
    pub die_after: Option<u64>,
}

/// One measured point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointPlan {
    /// Payload bytes per message (0: no payload, the eventfd / spin floors).
    pub size: usize,
    /// Messages per throughput run.
    pub moves: usize,
}

/// A validated invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub peer: Peer,
    pub experiment: Experiment,
    pub points: Vec<PointPlan>,
    pub runs: usize,
    pub inflight: usize,
    pub busy: bool,
    pub touch: bool,
    pub json: bool,
    pub timeout_s: u64,
    pub idle_us: u64,
    pub die_after: Option<u64>,
}

impl Plan {
    /// The `backend` field of the JSON line.
    pub fn backend(&self) -> &'static str {
        match (self.peer, self.busy) {
            (Peer::Iceoryx2, _) => "iceoryx2",
            (Peer::Eventfd, false) => "eventfd",
            (Peer::Eventfd, true) => "memfd-spin",
            (Peer::Uds, _) => "uds-copy",
            (Peer::Tcp, _) => "tcp-copy",
            (Peer::Pipe, _) => "pipe-copy",
        }
    }
    pub fn mode(&self) -> &'static str {
        if self.busy {
            "busy-poll"
        } else {
            "blocking"
        }
    }
    /// Payload copies per one-way message made by user code (the `copies_user` of `ferry bench`):
    /// none for every peer here — the socket echo writes back the very buffer it read into.
    pub fn copies_user(&self) -> u32 {
        0
    }
    /// Payload copies per one-way message made by the kernel on the user's behalf:
    /// write() copies into the socket/pipe buffer, read() copies out of it.
    /// The idle gap before each round trip (rtt, `--idle-us`).
    pub fn idle(&self) {
        if self.idle_us > 0 {
            std::thread::sleep(std::time::Duration::from_micros(self.idle_us));
        }
    }
    pub fn copies_kernel(&self) -> u32 {
        if self.peer.copies_through_kernel() {
            2
        } else {
            0
        }
    }
}

pub fn plan(peer: Peer, a: &BenchArgs) -> Result<Plan, String> {
    if a.runs == Some(0) {
        return Err("--runs must be at least 1".into());
    }
    if a.moves == Some(0) {
        return Err("--moves must be at least 1".into());
    }
    if a.inflight == 0 || a.inflight > 16384 {
        return Err("--inflight must be between 1 and 16384".into());
    }
    if a.timeout == 0 {
        return Err("--timeout must be at least 1 second".into());
    }
    if a.idle_us > 0 && a.experiment != Experiment::Rtt {
        return Err("--idle-us applies to rtt only".into());
    }
    if a.idle_us > 10_000_000 {
        return Err("--idle-us: at most 10 000 000 (10 s)".into());
    }
    if a.experiment == Experiment::Fbufs && (a.touch || a.blocking || a.busy_poll) {
        return Err("fbufs: one word per page is written and read; no --touch, and blocking I/O only".into());
    }
    if a.experiment == Experiment::Fbufs && !peer.copies_through_kernel() {
        return Err(
            "fbufs: the copy rows of the fbufs table are for the copying peers (uds-copy, tcp-copy, pipe-copy)".into(),
        );
    }
    let busy = match peer {
        Peer::Iceoryx2 => !a.blocking,
        Peer::Eventfd => a.busy_poll,
        Peer::Uds | Peer::Tcp | Peer::Pipe => {
            if a.busy_poll {
                return Err(format!("{peer:?}: only blocking I/O is measured (no --busy-poll)"));
            }
            false
        }
    };
    let sizes = if peer == Peer::Eventfd {
        if a.experiment != Experiment::Rtt {
            return Err("eventfd: only rtt (the wake-up floor has no payload to stream)".into());
        }
        if !a.sizes.is_empty() || a.touch {
            return Err("eventfd: no payload, so no --size or --touch".into());
        }
        vec![0]
    } else if a.sizes.is_empty() {
        vec![4096]
    } else {
        a.sizes.clone()
    };
    let mut points = Vec::with_capacity(sizes.len());
    for size in sizes {
        if peer != Peer::Eventfd && (size < 8 || size % 8 != 0 || size > MAX_SIZE) {
            return Err(format!("--size {size}: must be a multiple of 8 between 8 and {MAX_SIZE} bytes"));
        }
        let window = if a.experiment == Experiment::Throughput { a.inflight } else { 16 };
        if peer == Peer::Iceoryx2 && (window + 4).saturating_mul(size).saturating_mul(2) > MAX_SHM {
            return Err(format!(
                "--size {size} with {window} in flight needs more than {} GiB of shared memory",
                MAX_SHM >> 30
            ));
        }
        let zero_copy = !peer.copies_through_kernel() && !a.touch;
        let default_moves =
            if size <= 64 << 10 || zero_copy { MOVES_SMALL } else { (BYTES_PER_RUN_LARGE / size).max(1) };
        // As `ferry bench`: a run has at least one window of messages.
        let moves = a.moves.unwrap_or(default_moves).max(a.inflight);
        points.push(PointPlan { size, moves });
    }
    let runs = a.runs.unwrap_or(match a.experiment {
        Experiment::Rtt => 100,
        Experiment::Throughput => 20,
        Experiment::Fbufs => 10,
    });
    Ok(Plan {
        peer,
        experiment: a.experiment,
        points,
        runs,
        inflight: a.inflight,
        busy,
        touch: a.touch,
        json: a.json,
        timeout_s: a.timeout,
        idle_us: a.idle_us,
        die_after: a.die_after,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: BenchArgs,
    }

    fn p(peer: Peer, args: &[&str]) -> Result<Plan, String> {
        let t = T::try_parse_from(std::iter::once("t").chain(args.iter().copied())).map_err(|e| e.to_string())?;
        plan(peer, &t.a)
    }

    #[test]
    fn defaults_follow_ferry_bench() {
        let r = p(Peer::Uds, &["rtt"]).unwrap();
        assert_eq!((r.runs, r.busy, r.points.clone()), (100, false, vec![PointPlan { size: 4096, moves: 50_000 }]));
        assert_eq!((r.backend(), r.mode(), r.copies_user(), r.copies_kernel()), ("uds-copy", "blocking", 0, 2));
        let t = p(Peer::Iceoryx2, &["throughput", "--size", "4096", "--size", "1048576"]).unwrap();
        assert_eq!((t.runs, t.inflight, t.busy, t.mode()), (20, 250, true, "busy-poll"));
        // Zero copy: the run length does not depend on the size.
        assert_eq!(t.points[1], PointPlan { size: 1 << 20, moves: 50_000 });
        // Copying peers move ≈ 2 GiB per run at 1 MiB.
        let c = p(Peer::Tcp, &["throughput", "--size", "1048576"]).unwrap();
        assert_eq!(c.points[0].moves, 2048);
        let ct = p(Peer::Iceoryx2, &["throughput", "--size", "1048576", "--touch"]).unwrap();
        assert_eq!(ct.points[0].moves, 2048);
        // At least one window per run.
        assert_eq!(p(Peer::Pipe, &["throughput", "--moves", "10"]).unwrap().points[0].moves, 250);
        assert!(!p(Peer::Iceoryx2, &["rtt", "--blocking"]).unwrap().busy);
    }

    #[test]
    fn eventfd_modes() {
        let b = p(Peer::Eventfd, &["rtt"]).unwrap();
        assert_eq!((b.backend(), b.mode(), b.points[0].size), ("eventfd", "blocking", 0));
        let s = p(Peer::Eventfd, &["rtt", "--busy-poll"]).unwrap();
        assert_eq!((s.backend(), s.mode()), ("memfd-spin", "busy-poll"));
        assert!(p(Peer::Eventfd, &["throughput"]).is_err());
        assert!(p(Peer::Eventfd, &["rtt", "--size", "4096"]).is_err());
        assert!(p(Peer::Eventfd, &["rtt", "--touch"]).is_err());
    }

    #[test]
    fn rejects_bad_arguments() {
        for bad in [
            &["rtt", "--size", "0"][..],
            &["rtt", "--size", "4097"],
            &["rtt", "--size", "4"],
            &["rtt", "--size", "2147483648"],
            &["rtt", "--runs", "0"],
            &["throughput", "--moves", "0"],
            &["throughput", "--inflight", "0"],
            &["throughput", "--inflight", "16385"],
            &["rtt", "--timeout", "0"],
            &["rtt", "--busy-poll", "--blocking"],
            &["fast"],
        ] {
            assert!(p(Peer::Iceoryx2, bad).is_err(), "{bad:?} accepted");
        }
        assert!(p(Peer::Tcp, &["rtt", "--busy-poll"]).is_err());
        // 1 GiB × 254 × 2 of shared memory is refused, 1 MiB is fine.
        assert!(p(Peer::Iceoryx2, &["throughput", "--size", "1073741824"]).is_err());
        assert!(p(Peer::Iceoryx2, &["throughput", "--size", "1048576"]).is_ok());
    }
}
