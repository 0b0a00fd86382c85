//! `--compare`: Ferry and its baselines/peers measured alternately in one
//! invocation (round 1: Ferry, then each baseline; round 2: the same
//! again…), then the ratios, round by round, so drift of a shared machine
//! shows as spread rather than as a difference between transports.

use serde_json::json;

use super::{iperf3, peers, Backend, Ctx, Experiment, Point};
use crate::stats::round;
use crate::CliError;

/// The baselines/peers to run against Ferry: `--against`, or every one that
/// applies to the experiment and is built (iceoryx2 is left out, with a
/// note, when ferry-peers was built without it).
pub fn baselines(a: &super::BenchArgs) -> Result<Vec<Backend>, CliError> {
    let applies: &[Backend] = match a.experiment {
        // A session's channel against a channel over a connection of its own (and the copies).
        Experiment::Rtt | Experiment::Throughput if a.backend() == Backend::Mux => {
            &[Backend::Net, Backend::UdsCopy, Backend::TcpCopy, Backend::PipeCopy]
        }
        Experiment::Rtt => {
            &[Backend::UdsCopy, Backend::TcpCopy, Backend::PipeCopy, Backend::Iceoryx2, Backend::Eventfd]
        }
        // One way: the peers' throughput echoes every payload back; iperf3 sends one way.
        Experiment::Throughput if a.one_way => &[Backend::Iperf3],
        Experiment::Throughput => {
            &[Backend::UdsCopy, Backend::TcpCopy, Backend::PipeCopy, Backend::Iceoryx2, Backend::RustlsStream]
        }
        Experiment::FbufsTable | Experiment::Fbufs => &[Backend::UdsCopy, Backend::TcpCopy, Backend::PipeCopy],
        Experiment::Pipeline => &[Backend::PipeCopy],
        // Its baselines are Ferry's own (one channel, independent pairs): always measured.
        Experiment::Fanin => &[],
        // Its baseline (plain read/write) is measured by the experiment itself.
        Experiment::SocketTouch | Experiment::UdpForward | Experiment::Chain | Experiment::Layers => &[],
        // Compares its own transports (one connection against many).
        Experiment::Demux => &[],
    };
    if !a.against.is_empty() {
        let mut v = Vec::new();
        for &b in &a.against {
            if b == Backend::Iperf3 && a.experiment == Experiment::Throughput {
                if !a.one_way {
                    return Err(CliError::Usage(
                        "--against iperf3: iperf3 sends one way; add --one-way so that Ferry's sink gives the buffers back unfilled too".into(),
                    ));
                }
                if a.backend() != Backend::Net {
                    return Err(CliError::Usage(format!(
                        "--against iperf3: TCP is compared with TCP; give --backend net instead of {}",
                        a.backend().name()
                    )));
                }
            }
            if !applies.contains(&b) {
                let names: Vec<&str> = applies.iter().map(|b| b.name()).collect();
                return Err(CliError::Usage(format!(
                    "--against {}: not a baseline of {} (choose from {})",
                    b.name(),
                    a.experiment.name(),
                    names.join(", ")
                )));
            }
            match b {
                Backend::Iperf3 => iperf3::check()?,
                // Measured by this command.
                Backend::RustlsStream | Backend::Net => {}
                _ if a.experiment == Experiment::Pipeline => {}
                _ => peers::check(b)?,
            }
            if !v.contains(&b) {
                v.push(b);
            }
        }
        return Ok(v);
    }
    let defaults: &[Backend] = match a.experiment {
        // One copy baseline is the comparison of [FBUFS] Table 1; the others are a flag away.
        Experiment::FbufsTable | Experiment::Fbufs => &[Backend::UdsCopy],
        // TLS against TLS: the same bytes through rustls on a plain stream.
        Experiment::Throughput if a.backend() == Backend::NetTls => &[Backend::RustlsStream],
        // A session's channel against a TCP connection of its own; the copies are a flag away.
        _ if a.backend() == Backend::Mux => return Ok(vec![Backend::Net]),
        _ => applies,
    };
    let mut v = Vec::new();
    for &b in defaults {
        // iperf3 runs TCP: compared with Ferry's TCP backend, when installed.
        if b == Backend::Iperf3 {
            if a.backend() == Backend::Net {
                match iperf3::check() {
                    Ok(()) => v.push(b),
                    Err(e) => eprintln!("ferry bench: {e}; left out of the comparison"),
                }
            }
            continue;
        }
        // Only TLS is compared with TLS (measured by this command).
        if b == Backend::RustlsStream {
            if a.backend() == Backend::NetTls {
                v.push(b);
            }
            continue;
        }
        if a.experiment == Experiment::Pipeline {
            v.push(b);
            continue;
        }
        match peers::check(b) {
            Ok(()) => v.push(b),
            Err(e) if b == Backend::Iceoryx2 => eprintln!("ferry bench: {e}; left out of the comparison"),
            Err(e) => return Err(e),
        }
    }
    Ok(v)
}

fn lower_is_better(unit: &str) -> bool {
    unit.starts_with("us")
}

/// What a point is compared by: unit, size (0 matches any: the eventfd
/// floor), stages (pipeline), round.
fn key(p: &Point) -> (String, usize, i64, i64) {
    (p.unit().to_string(), p.size(), p.num("stages").map_or(-1, |s| s as i64), p.num("round").map_or(1, |r| r as i64))
}

fn label(p: &Point) -> String {
    match p.0.get("variant").and_then(|v| v.as_str()) {
        Some(v) => format!("{} {v}", p.backend()),
        None => p.backend().to_string(),
    }
}

/// Whether the point is the measured side of a ratio: one of Ferry's
/// backends, unless it was named by `--against` (net, the baseline of a
/// session's channel).
fn is_ferry(p: &Point, against: &[Backend]) -> bool {
    matches!(p.backend(), "local" | "shm" | "net" | "net-tls" | "mux")
        && !against.iter().any(|b| b.name() == p.backend())
}

/// Print Ferry / baseline ratios of the medians, per round, for every pair
/// of points measured under the same conditions; for times (lower is
/// better) the ratios of the 99th percentiles too.
pub fn print_ratios(ctx: &Ctx<'_>) {
    let pts: Vec<&Point> = ctx
        .points
        .iter()
        // fbufs-table: the per-page rows are the table; the per-size rows are the figure.
        .filter(|p| !ctx.args.experiment.is_fbufs() || p.unit() == "us/page")
        .collect();
    // (ferry label, baseline label, unit, size, stages) → per-round ratios.
    type Row = (String, String, String, usize, i64);
    // Per row: ratios of medians, ratios of p99s.
    let mut rows: Vec<(Row, Vec<f64>, Vec<f64>)> = Vec::new();
    // With --backend mux and no --against, net is still the baseline.
    let against: Vec<Backend> = if ctx.args.backend() == Backend::Mux && ctx.args.against.is_empty() {
        vec![Backend::Net]
    } else {
        ctx.args.against.clone()
    };
    for f in pts.iter().filter(|p| is_ferry(p, &against)) {
        let (unit, size, stages, rnd) = key(f);
        for b in pts.iter().filter(|p| !is_ferry(p, &against)) {
            let (bu, bs, bst, brnd) = key(b);
            if bu != unit || bst != stages || brnd != rnd || (bs != size && bs != 0) {
                continue;
            }
            // Ferry against Ferry (a session against a connection): wait mode against the same mode.
            if b.0.get("wait").is_some() && f.0.get("wait") != b.0.get("wait") {
                continue;
            }
            let (fq, bq) = (f.quantiles(), b.quantiles());
            let (fm, bm) = (fq[0], bq[0]);
            if !(fm > 0.0 && bm > 0.0) {
                continue;
            }
            let p99 = fq[3] / bq[3];
            let row = (label(f), label(b), unit.clone(), size, stages);
            match rows.iter_mut().find(|(r, _, _)| *r == row) {
                Some((_, v, w)) => {
                    v.push(fm / bm);
                    w.push(p99);
                }
                None => rows.push((row, vec![fm / bm], vec![p99])),
            }
        }
    }
    if rows.is_empty() {
        return;
    }
    if !ctx.args.json {
        println!("\nratios of medians, Ferry / baseline (one per round):");
    }
    for ((ferry, base, unit, size, stages), ratios, p99s) in rows {
        let mid = median(&ratios);
        let p99 = lower_is_better(&unit) && p99s.iter().all(|r| r.is_finite() && *r > 0.0);
        let faster = if lower_is_better(&unit) { 1.0 / mid } else { mid };
        let what = if stages >= 0 { format!("{stages} stages") } else { format!("{size} B") };
        if ctx.args.json {
            let mut v = json!({
                "kind": "ratio", "experiment": ctx.args.experiment.name(), "unit": unit, "size": size,
                "ferry": ferry, "baseline": base, "ratios": ratios.iter().map(|r| round(*r)).collect::<Vec<_>>(),
                "median_ratio": round(mid), "ferry_faster_by": round(faster),
            });
            if stages >= 0 {
                v["stages"] = json!(stages);
            }
            if p99 {
                v["p99_ratios"] = json!(p99s.iter().map(|r| round(*r)).collect::<Vec<_>>());
                v["median_p99_ratio"] = json!(round(median(&p99s)));
            }
            println!("{v}");
        } else {
            let rs: Vec<String> = ratios.iter().map(|r| format!("{}", round(*r))).collect();
            // Ferry against Ferry (a session against a connection): named by backend.
            let ferry_against_ferry =
                matches!(base.split(' ').next(), Some("local" | "shm" | "net" | "net-tls" | "mux"));
            let who = if ferry_against_ferry { &ferry } else { "Ferry" };
            let verdict = if faster >= 1.0 {
                format!("{who} {}× faster", round(faster))
            } else {
                format!("{who} {}× slower", round(1.0 / faster))
            };
            let unit = super::point::unit_text(&unit);
            let tail = if p99 {
                let ps: Vec<String> = p99s.iter().map(|r| format!("{}", round(*r))).collect();
                format!("; p99 {}", ps.join(", "))
            } else {
                String::new()
            };
            println!(
                "  {:<11} {what:>10} {unit:<7} {ferry} / {base}: {}  → {verdict}{tail}",
                ctx.args.experiment.name(),
                rs.join(", ")
            );
        }
    }
}

/// The median of a few ratios (the mean of the middle two for an even count).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let k = s.len();
    if k % 2 == 1 {
        s[k / 2]
    } else {
        (s[k / 2 - 1] + s[k / 2]) / 2.0
    }
}
