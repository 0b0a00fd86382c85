//! iperf3, the baseline of `throughput --one-way --backend net`: one TCP
//! stream one way over 127.0.0.1 with messages of the same size (`-l`),
//! run by this command between Ferry's points (`iperf3 -s -1` and
//! `iperf3 -c 127.0.0.1 -l SIZE -t N -J`), read back into a [`Point`] in
//! GB/s whose samples are iperf3's own intervals.
//!
//! iperf3 runs about as long as Ferry's point of the same size just did
//! (whole seconds, at least one), so that both see the same machine; its
//! intervals are cut so that it gives about as many samples as Ferry's
//! runs. Client and server are pinned to CPUs 0 and 1, as Ferry's source
//! and echo are.

use std::io::Read;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::point::{Head, Point};
use super::{Ctx, Experiment};
use crate::stats::{round, Summary};
use crate::{pin, CliError};

/// How long iperf3 runs when no point of Ferry's says (`--backend iperf3`).
const DEFAULT_SECONDS: u64 = 3;
/// The longest iperf3 run.
const MAX_SECONDS: u64 = 60;
/// iperf3's shortest reporting interval.
const MIN_INTERVAL: f64 = 0.1;
/// How long the server may take to listen, and the client beyond its run
/// to connect and report.
const GRACE: Duration = Duration::from_secs(20);

/// Whether iperf3 can run here.
pub fn check() -> Result<(), CliError> {
    match Command::new("iperf3").arg("--version").stdin(Stdio::null()).output() {
        Ok(out) if out.status.success() => Ok(()),
        _ => Err(CliError::Usage("iperf3 is not installed; install it with `scripts/setup iperf3`".into())),
    }
}

/// One point per size (none given: 4096 bytes, Ferry's default).
pub fn measure(ctx: &Ctx<'_>, sizes: &[usize]) -> Result<Vec<Point>, CliError> {
    check()?;
    let runs = ctx.args.runs.unwrap_or(20);
    let sizes = if sizes.is_empty() { &[4096][..] } else { sizes };
    let mut points = Vec::with_capacity(sizes.len());
    for &size in sizes {
        // As long as Ferry's last one-way point of this size took.
        let seconds = ctx
            .points
            .iter()
            .rev()
            .find(|p| p.size() == size && p.unit() == "GB/s" && p.backend() != "iperf3")
            .and_then(|p| p.num("seconds"))
            .map_or(DEFAULT_SECONDS, |s| (s.ceil() as u64).clamp(1, MAX_SECONDS));
        let interval = (seconds as f64 / runs as f64).max(MIN_INTERVAL);
        let report = run(size, seconds, interval)?;
        points.push(point(&report, size, seconds, interval)?);
        ctx.progress.inc(runs as u64);
    }
    Ok(points)
}

/// A port on 127.0.0.1 that was free a moment ago.
fn free_port() -> Result<u16, CliError> {
    let l = TcpListener::bind(("127.0.0.1", 0)).map_err(|e| CliError::Failed(format!("iperf3: no free port: {e}")))?;
    Ok(l.local_addr().map_err(|e| CliError::Failed(format!("iperf3: {e}")))?.port())
}

/// Kill and reap a child we started (it may have exited already).
fn reap(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Wait for `child` until `deadline`; kill it past that.
fn wait_until(child: &mut Child, deadline: Instant) -> Option<std::process::ExitStatus> {
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return Some(st),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// Run a server for one test and a client against it; the client's JSON
/// report.
fn run(size: usize, seconds: u64, interval: f64) -> Result<Value, CliError> {
    let port = free_port()?.to_string();
    let server = Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| CliError::Failed(format!("cannot start `iperf3 -s`: {e}")))?;
    let report = client(size, seconds, interval, &port);
    // One test (-1): the server ends once the client is done; a server
    // that did not (the client never reached it) is ended here.
    let mut server = server;
    if report.is_err() || wait_until(&mut server, Instant::now() + GRACE).is_none() {
        reap(server);
    }
    report
}

/// The client, retried while the server is not listening yet.
fn client(size: usize, seconds: u64, interval: f64, port: &str) -> Result<Value, CliError> {
    let connect_by = Instant::now() + GRACE;
    loop {
        let mut cmd = Command::new("iperf3");
        cmd.args(["-c", "127.0.0.1", "-p", port, "-J"]).args([
            "-l",
            &size.to_string(),
            "-t",
            &seconds.to_string(),
            "-i",
            &format!("{interval:.2}"),
        ]);
        if pin::cpus() >= 2 {
            // Client on CPU 0, server on CPU 1: where Ferry's source and echo run.
            cmd.args(["-A", "0,1"]);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| CliError::Failed(format!("cannot start `iperf3 -c`: {e}")))?;
        let mut out = child.stdout.take().expect("piped");
        let reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let status = wait_until(&mut child, Instant::now() + Duration::from_secs(seconds) + GRACE);
        let text = reader.join().unwrap_or_default();
        if status.is_none() {
            return Err(CliError::Failed(format!("iperf3 -c did not finish within {} s", seconds + GRACE.as_secs())));
        }
        let report: Value = serde_json::from_str(&text)
            .map_err(|_| CliError::Failed("iperf3 -c printed no JSON report; run it by hand to see why".into()))?;
        match report.get("error").and_then(Value::as_str) {
            None => return Ok(report),
            Some(e) if e.contains("Connection refused") && Instant::now() < connect_by => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Some(e) => return Err(CliError::Failed(format!("iperf3: {e}"))),
        }
    }
}

/// GB/s of an iperf3 `sum` object.
fn gb_s(sum: &Value) -> Option<f64> {
    sum.get("bits_per_second").and_then(Value::as_f64).map(|b| b / 8e9)
}

/// The point of a report: its intervals are the samples (a short last
/// one left out), the receiver's whole-run rate a field of its own.
fn point(report: &Value, size: usize, seconds: u64, interval: f64) -> Result<Point, CliError> {
    let samples = intervals(report, interval);
    let received = report.pointer("/end/sum_received").and_then(gb_s);
    let summary = Summary::of(&samples)
        .ok_or_else(|| CliError::Failed("iperf3 reported no interval; run it by hand to see why".into()))?;
    let head = Head {
        experiment: Experiment::Throughput.name(),
        backend: "iperf3",
        size,
        trust: "n/a",
        mode: "blocking",
        touch: false,
        runs: summary.n,
        unit: "GB/s",
    };
    let extra = json!({
        "gbit_s_median": round(summary.median * 8.0),
        "received_gb_s": received.map(round),
        "seconds": seconds,
        "interval_s": round(interval),
    });
    Ok(Point::new(head, summary, None, extra))
}

/// The rates of the intervals at least half as long as asked (GB/s).
fn intervals(report: &Value, interval: f64) -> Vec<f64> {
    let Some(list) = report.get("intervals").and_then(Value::as_array) else { return Vec::new() };
    list.iter()
        .filter_map(|i| i.get("sum"))
        .filter(|s| s.get("seconds").and_then(Value::as_f64).is_some_and(|t| t >= interval / 2.0))
        .filter_map(gb_s)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The samples are the intervals; a short last one is left out.
    #[test]
    fn intervals_of_a_report() {
        let report = json!({
            "intervals": [
                { "sum": { "seconds": 0.1, "bits_per_second": 8e9 } },
                { "sum": { "seconds": 0.1, "bits_per_second": 16e9 } },
                { "sum": { "seconds": 0.01, "bits_per_second": 80e9 } },
            ],
            "end": { "sum_received": { "bits_per_second": 12e9 } },
        });
        assert_eq!(intervals(&report, 0.1), [1.0, 2.0]);
        assert!(intervals(&json!({ "error": "x" }), 0.1).is_empty());
    }
}
