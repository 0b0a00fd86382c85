//! `ferry inspect`: what every Ferry process of the user is doing, read
//! from the registry files the library publishes (`ferry::inspect`).
//!
//! One snapshot as a table (or `--json`), or `--watch`: redrawn every
//! second with rates, stalled channels highlighted.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;
use ferry::inspect::{self, ChannelSnapshot, Listing, ProcessSnapshot};
use serde_json::{json, Value};

use crate::CliError;

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// Show only this process.
    pid: Option<u32>,
    /// Print JSON (one document per snapshot) instead of a table.
    #[arg(long)]
    json: bool,
    /// Redraw every INTERVAL with rates, like top; stalled channels are
    /// highlighted. Ctrl-C stops.
    #[arg(long)]
    watch: bool,
    /// Seconds between two redraws of --watch.
    #[arg(long, default_value_t = 1.0, value_parser = interval_arg)]
    interval: f64,
    /// Stop --watch after this many redraws.
    #[arg(long)]
    count: Option<u64>,
    /// The registry directory (default: $FERRY_INSPECT_DIR, else
    /// $XDG_RUNTIME_DIR/ferry/inspect, else /dev/shm/ferry-inspect-UID).
    #[arg(long)]
    dir: Option<PathBuf>,
}

fn interval_arg(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.1..=3600.0).contains(&v) => Ok(v),
        _ => Err("give a number of seconds from 0.1 to 3600".into()),
    }
}

/// A channel end, named across snapshots.
type ChanId = (u32, u64, u64);

/// What the table shows of one channel end besides its own snapshot.
#[derive(Debug, Clone, Default)]
struct Derived {
    /// Messages the peer sent that this end has not taken, when the peer
    /// is a process of this user (`None`: the peer is not visible).
    backlog: Option<u64>,
    /// Why the end looks stalled, if it does.
    stalled: Option<&'static str>,
    /// Per-second rates since the previous snapshot (--watch).
    rates: Option<Rates>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Rates {
    moves: f64,
    passes: f64,
    copies: f64,
    bytes: f64,
}

pub fn run(args: &InspectArgs) -> Result<(), CliError> {
    let dir = args.dir.clone().unwrap_or_else(inspect::registry_dir);
    if !args.watch {
        let listings = read(&dir, args.pid)?;
        let derived = derive(&listings, None);
        let listings = shown(&listings, args.pid);
        if args.json {
            println!("{}", serde_json::to_string_pretty(&to_json(&listings, &derived)).expect("JSON"));
        } else {
            print!("{}", table(&listings, &derived, false));
        }
        return Ok(());
    }
    let interval = Duration::from_secs_f64(args.interval);
    let mut previous: Option<Vec<Listing>> = None;
    let mut drawn = 0u64;
    loop {
        let listings = read(&dir, args.pid)?;
        let derived = derive(&listings, previous.as_deref());
        let mut out = std::io::stdout().lock();
        let these = shown(&listings, args.pid);
        let screen = if args.json {
            format!("{}\n", serde_json::to_string(&to_json(&these, &derived)).expect("JSON"))
        } else {
            // Home, clear, then the screen: a terminal shows the latest.
            format!("\x1b[H\x1b[2J{}", table(&these, &derived, true))
        };
        // A closed stdout (the reader went away) ends the watch.
        if out.write_all(screen.as_bytes()).and_then(|()| out.flush()).is_err() {
            return Ok(());
        }
        drop(out);
        drawn += 1;
        if args.count.is_some_and(|c| drawn >= c) {
            return Ok(());
        }
        previous = Some(listings);
        std::thread::sleep(interval);
    }
}

/// Every process's listing (all of them: a channel's peer may be in
/// another process than the one shown).
fn read(dir: &std::path::Path, pid: Option<u32>) -> Result<Vec<Listing>, CliError> {
    let listings = match inspect::read_all(dir) {
        Ok(l) => l,
        // No directory: no process has published anything yet.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(CliError::Failed(format!("cannot read the registry {}: {e}", dir.display()))),
    };
    if let Some(p) = pid {
        if !listings.iter().any(|l| l.pid == p) {
            return Err(CliError::Failed(format!(
                "no Ferry process {p} in {}; is it running, as this user, with FERRY_INSPECT on?",
                dir.display()
            )));
        }
    }
    Ok(listings)
}

/// The listings to show: all, or those of `pid`.
fn shown(listings: &[Listing], pid: Option<u32>) -> Vec<&Listing> {
    listings.iter().filter(|l| pid.is_none_or(|p| l.pid == p)).collect()
}

/// Every operation of `o` (saturating: a file's counters are not trusted).
fn ops_sum(o: &ferry::OpCounts) -> u64 {
    [o.passes, o.copies, o.releases, o.pool_assigns, o.pool_removes, o.aggregates]
        .into_iter()
        .fold(o.moves, u64::saturating_add)
}

/// Sent and received together (saturating).
fn both(sent: u64, received: u64) -> u64 {
    sent.saturating_add(received)
}

/// The end of another process that is this end's peer (same backend and
/// endpoint, each naming the other's pid), and whether that process
/// stopped publishing.
fn peer_of<'a>(
    pid: u32,
    ch: &ChannelSnapshot,
    all: &'a [(u32, &'a ChannelSnapshot, bool)],
) -> Option<(&'a ChannelSnapshot, bool)> {
    let peer_pid: u32 = ch.peer.strip_prefix("pid ")?.split(' ').next()?.parse().ok()?;
    if peer_pid == pid {
        return None; // a local channel: both ends are here, unmatched
    }
    let me = format!("pid {pid}");
    let mut found = all
        .iter()
        .filter(|(p, c, _)| *p == peer_pid && c.backend == ch.backend && c.endpoint == ch.endpoint && c.peer == me);
    let first = found.next()?;
    // Two candidates (two channels on one endpoint between the same two
    // processes): cannot tell which.
    found.next().is_none().then_some((first.1, first.2))
}

/// A process whose snapshot is older than this many publication intervals
/// has stopped publishing: stopped (SIGSTOP, a debugger) or hung.
const STALE_INTERVALS: u64 = 4;

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Whether a process stopped publishing (see [`STALE_INTERVALS`]).
fn silent(s: &ProcessSnapshot) -> bool {
    now_ms().saturating_sub(s.taken_at_ms) > STALE_INTERVALS * u64::from(s.interval_ms.max(100))
}

fn derive(listings: &[Listing], previous: Option<&[Listing]>) -> HashMap<ChanId, Derived> {
    let snaps: Vec<&ProcessSnapshot> = listings.iter().filter_map(|l| l.snapshot.as_ref().ok()).collect();
    let all: Vec<(u32, &ChannelSnapshot, bool)> = snaps
        .iter()
        .flat_map(|s| s.domains.iter().flat_map(move |d| d.channels.iter().map(move |c| (s.pid, c, silent(s)))))
        .collect();
    // Each end as the previous snapshot of its process had it, and when.
    let mut before: HashMap<ChanId, (ChannelSnapshot, u64)> = HashMap::new();
    for s in previous.unwrap_or_default().iter().filter_map(|l| l.snapshot.as_ref().ok()) {
        for d in &s.domains {
            for c in &d.channels {
                before.insert((s.pid, d.id, c.key), (c.clone(), s.taken_at_ms));
            }
        }
    }
    let mut out = HashMap::new();
    for s in &snaps {
        for d in &s.domains {
            for c in &d.channels {
                let id = (s.pid, d.id, c.key);
                let peer = peer_of(s.pid, c, &all);
                // What the peer sent that we have not taken, and what we
                // sent that the peer has not taken.
                let backlog = peer.map(|(p, _)| ops_sum(&p.stats.sent).saturating_sub(ops_sum(&c.stats.received)));
                let unread = peer.map_or(0, |(p, _)| ops_sum(&c.stats.sent).saturating_sub(ops_sum(&p.stats.received)));
                let peer_silent = peer.is_some_and(|(_, silent)| silent);
                let (prev, then) = match before.get(&id) {
                    Some((c, t)) => (Some(c), *t),
                    None => (None, 0),
                };
                // Seconds between the two snapshots of the process (none
                // new since: no rate).
                let elapsed = s.taken_at_ms.saturating_sub(then) as f64 / 1000.0;
                let rates = prev.filter(|_| elapsed > 0.0).map(|p| {
                    let per_s = |now: u64, then: u64| now.saturating_sub(then) as f64 / elapsed;
                    let (a, b) = (&c.stats, &p.stats);
                    Rates {
                        moves: per_s(both(a.sent.moves, a.received.moves), both(b.sent.moves, b.received.moves)),
                        passes: per_s(both(a.sent.passes, a.received.passes), both(b.sent.passes, b.received.passes)),
                        copies: per_s(both(a.sent.copies, a.received.copies), both(b.sent.copies, b.received.copies)),
                        bytes: per_s(both(a.bytes_sent, a.bytes_received), both(b.bytes_sent, b.bytes_received)),
                    }
                });
                let no_progress = prev.is_some_and(|p| {
                    elapsed > 0.0 && p.stats.received == c.stats.received && p.stats.sent == c.stats.sent
                });
                let live = matches!(c.state.as_str(), "Connected" | "Teardown");
                let stalled = if !live {
                    None
                } else if silent(s) {
                    Some("process stopped or hung")
                } else if c.stats.blocked {
                    Some("queue full, peer not taking")
                } else if peer_silent && unread > 0 {
                    Some("peer stopped or hung")
                } else if no_progress && backlog.is_some_and(|b| b > 0) {
                    Some("not taking what waits")
                } else if no_progress && unread > 0 {
                    Some("peer not taking")
                } else {
                    None
                };
                out.insert(id, Derived { backlog, stalled, rates });
            }
        }
    }
    out
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// `s` in at most `max` characters, its end cut (names).
fn short(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let head: String = s.chars().take(max - 1).collect();
    format!("{head}…")
}

/// `s` in at most `max` characters, its start cut (paths: the end says most).
fn short_tail(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let tail: String = s.chars().rev().take(max - 1).collect::<Vec<_>>().into_iter().rev().collect();
    format!("…{tail}")
}

/// The table of every process (`watch`: rates, stalled rows in bold red).
fn table(listings: &[&Listing], derived: &HashMap<ChanId, Derived>, watch: bool) -> String {
    let mut o = String::new();
    let live: Vec<&ProcessSnapshot> = listings.iter().filter_map(|l| l.snapshot.as_ref().ok()).collect();
    let chans: usize = live.iter().map(|s| s.domains.iter().map(|d| d.channels.len()).sum::<usize>()).sum();
    let pools: usize = live.iter().map(|s| s.domains.iter().map(|d| d.pools.len()).sum::<usize>()).sum();
    let stalled = derived.values().filter(|d| d.stalled.is_some()).count();
    o += &format!(
        "ferry inspect: {} process{}, {chans} channel end{}, {pools} pool{}{}\n",
        live.len(),
        if live.len() == 1 { "" } else { "es" },
        if chans == 1 { "" } else { "s" },
        if pools == 1 { "" } else { "s" },
        if stalled > 0 { format!(", {stalled} stalled") } else { String::new() },
    );
    for l in listings {
        if let Err(e) = &l.snapshot {
            o += &format!("  pid {}: unreadable registry file {}: {e}\n", l.pid, l.path.display());
        }
    }
    if chans > 0 {
        o += "\nCHANNELS\n";
        let volume =
            if watch { ["MOVES/s", "PASSES/s", "COPIES/s", "GB/s"] } else { ["MOVES", "PASSES", "COPIES", "BYTES"] };
        o += &format!(
            "{:>7} {:<14} {:>3} {:<5} {:<3} {:<10} {:<12} {:<20} {:>8} {:>8} {:>8} {:>9} {:>11} {:>7} {:>6} {:>5} {:>3}  {}\n",
            "PID", "DOMAIN", "CH", "BACK", "DIR", "STATE", "PEER", "ENDPOINT", volume[0], volume[1], volume[2],
            volume[3], "QUEUE/HW", "WAITING", "FULL", "WAKE", "ERR", "NOTE"
        );
        for s in &live {
            for d in &s.domains {
                for c in &d.channels {
                    let dv = derived.get(&(s.pid, d.id, c.key)).cloned().unwrap_or_default();
                    let st = &c.stats;
                    let [moves, passes, copies, bytes] = match (watch, dv.rates) {
                        (true, Some(r)) => {
                            [rate(r.moves), rate(r.passes), rate(r.copies), format!("{:.2}", r.bytes / 1e9)]
                        }
                        (true, None) => ["-".into(), "-".into(), "-".into(), "-".into()],
                        (false, _) => [
                            both(st.sent.moves, st.received.moves).to_string(),
                            both(st.sent.passes, st.received.passes).to_string(),
                            both(st.sent.copies, st.received.copies).to_string(),
                            human_bytes(both(st.bytes_sent, st.bytes_received)),
                        ],
                    };
                    let note = dv.stalled.map_or(String::new(), |why| format!("STALLED: {why}"));
                    let row = format!(
                        "{:>7} {:<14} {:>3} {:<5} {:<3} {:<10} {:<12} {:<20} {:>8} {:>8} {:>8} {:>9} {:>11} {:>7} {:>6} {:>5} {:>3}  {}",
                        s.pid,
                        short(&d.name, 14),
                        c.key,
                        c.backend,
                        c.direction,
                        c.state,
                        short(&c.peer, 12),
                        short_tail(&c.endpoint, 20),
                        moves,
                        passes,
                        copies,
                        bytes,
                        format!("{}/{}/{}", st.queue_depth, st.queue_high_water, st.queue_capacity),
                        dv.backlog.map_or("-".into(), |b| b.to_string()),
                        st.queue_full,
                        st.wakeups,
                        st.errors,
                        note
                    );
                    if watch && dv.stalled.is_some() {
                        o += &format!("\x1b[1;31m{row}\x1b[0m\n");
                    } else {
                        o += &format!("{}\n", row.trim_end());
                    }
                }
            }
        }
    }
    if pools > 0 {
        o += "\nPOOLS\n";
        o += &format!(
            "{:>7} {:<14} {:<16} {:<6} {:>8} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8}\n",
            "PID", "DOMAIN", "POOL", "ORIGIN", "BUFFERS", "SIZE", "FREE", "IN USE", "LENT", "COPIES", "COPIES"
        );
        o += &format!(
            "{:>7} {:<14} {:<16} {:<6} {:>8} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8}\n",
            "", "", "", "", "", "", "", "", "", "HELD", "OUT"
        );
        for s in &live {
            for d in &s.domains {
                for p in &d.pools {
                    let ps = &p.stats;
                    o += &format!(
                        "{:>7} {:<14} {:<16} {:<6} {:>8} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8}\n",
                        s.pid,
                        short(&d.name, 14),
                        ferry::PoolId::from_u128(p.id).to_string(),
                        if p.created_here { "here" } else { "peer" },
                        p.buffers,
                        human_bytes(p.buffer_size),
                        ps.free,
                        ps.in_use,
                        ps.lent,
                        ps.copies_held,
                        ps.copies_out
                    );
                }
            }
        }
    }
    if live.is_empty() && listings.is_empty() {
        o += "no Ferry process of this user is publishing (FERRY_INSPECT=0 turns publishing off)\n";
    }
    o
}

fn to_json(listings: &[&Listing], derived: &HashMap<ChanId, Derived>) -> Value {
    let procs: Vec<Value> = listings
        .iter()
        .map(|l| match &l.snapshot {
            Err(e) => json!({ "pid": l.pid, "path": l.path.display().to_string(), "error": e.to_string() }),
            Ok(s) => process_json(s, derived),
        })
        .collect();
    json!({ "processes": procs })
}

fn process_json(s: &ProcessSnapshot, derived: &HashMap<ChanId, Derived>) -> Value {
    let domains: Vec<Value> = s
        .domains
        .iter()
        .map(|d| {
            let pools: Vec<Value> = d.pools.iter().map(pool_json).collect();
            let channels: Vec<Value> = d
                .channels
                .iter()
                .map(|c| channel_json(c, derived.get(&(s.pid, d.id, c.key)).cloned().unwrap_or_default()))
                .collect();
            json!({ "id": d.id, "name": d.name, "pools": pools, "channels": channels })
        })
        .collect();
    json!({
        "pid": s.pid,
        "name": s.name,
        "start_time": s.start_time,
        "taken_at_ms": s.taken_at_ms,
        "generation": s.generation,
        "interval_ms": s.interval_ms,
        "age_ms": now_ms().saturating_sub(s.taken_at_ms),
        "publishing": !silent(s),
        "domains": domains,
    })
}

fn pool_json(p: &ferry::inspect::PoolSnapshot) -> Value {
    json!({
        "id": ferry::PoolId::from_u128(p.id).to_string(),
        "buffers": p.buffers,
        "buffer_size": p.buffer_size,
        "created_here": p.created_here,
        "trust": p.trust,
        "free": p.stats.free,
        "in_use": p.stats.in_use,
        "lent": p.stats.lent,
        "copies_held": p.stats.copies_held,
        "copies_out": p.stats.copies_out,
    })
}

fn ops_json(o: &ferry::OpCounts) -> Value {
    json!({
        "moves": o.moves,
        "passes": o.passes,
        "copies": o.copies,
        "releases": o.releases,
        "pool_assigns": o.pool_assigns,
        "pool_removes": o.pool_removes,
        "aggregates": o.aggregates,
    })
}

fn channel_json(c: &ChannelSnapshot, dv: Derived) -> Value {
    let st = &c.stats;
    let rates = dv.rates.map(|r| {
        json!({ "moves_per_s": r.moves, "passes_per_s": r.passes, "copies_per_s": r.copies, "bytes_per_s": r.bytes })
    });
    let mut v = json!({
        "key": c.key,
        "backend": c.backend,
        "endpoint": c.endpoint,
        "peer": c.peer,
        "role": c.role,
        "direction": c.direction,
        "trust": c.trust,
        "state": c.state,
        "sent": ops_json(&st.sent),
        "received": ops_json(&st.received),
        "bytes_sent": st.bytes_sent,
        "bytes_received": st.bytes_received,
    });
    let more = json!({
        "queue_capacity": st.queue_capacity,
        "queue_depth": st.queue_depth,
        "queue_high_water": st.queue_high_water,
        "queue_full": st.queue_full,
        "blocked": st.blocked,
        "wakeups": st.wakeups,
        "errors": st.errors,
        "waiting": dv.backlog,
        "stalled": dv.stalled.is_some(),
        "stalled_why": dv.stalled,
        "rates": rates,
    });
    if let (Some(v), Value::Object(more)) = (v.as_object_mut(), more) {
        v.extend(more);
    }
    v
}
