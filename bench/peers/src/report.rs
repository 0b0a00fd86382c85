//! One output line per measured point, in the schema of `ferry bench --json`
//! (crates/ferry-cli/src/bench/mod.rs), plus `copies_kernel`.

use serde_json::json;

use crate::plan::{Experiment, Plan};
use crate::stats::Summary;

pub struct Point<'a> {
    pub plan: &'a Plan,
    pub size: usize,
    pub summary: Summary,
    /// Messages per throughput run (None for rtt).
    pub moves: Option<usize>,
    /// fbufs: the median of each run (µs), for the per-page slope per run.
    pub run_medians: Option<Vec<f64>>,
}

/// Three decimals, as `ferry bench`, but at least three significant digits
/// (a copying peer moves 0.00313 M messages of 1 MiB per second).
fn round(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let decimals = (2 - x.abs().log10().floor() as i32).max(3);
    let f = 10f64.powi(decimals);
    (x * f).round() / f
}

impl Point<'_> {
    pub fn json(&self) -> serde_json::Value {
        let p = self.plan;
        let s = self.summary;
        let (experiment, unit) = match p.experiment {
            Experiment::Rtt => ("rtt", "us"),
            Experiment::Throughput => ("throughput", "Mops/s"),
            Experiment::Fbufs => ("fbufs", "us"),
        };
        let mut v = json!({
            "experiment": experiment, "backend": p.backend(), "size": self.size,
            "trust": "n/a", "mode": p.mode(), "touch": p.touch,
            "runs": p.runs, "samples": s.n,
            "unit": unit, "median": round(s.median), "p5": round(s.p5),
            "p95": round(s.p95), "p99": round(s.p99),
            "copies_user": p.copies_user(), "copies_kernel": p.copies_kernel(),
        });
        if let (Some(m), Some(obj)) = (&self.run_medians, v.as_object_mut()) {
            obj.insert("run_medians".into(), json!(m.iter().map(|x| round(*x)).collect::<Vec<_>>()));
            obj.insert("transfers_per_run".into(), json!(crate::plan::FBUFS_PER_RUN));
        }
        if let (true, Some(obj)) = (p.idle_us > 0, v.as_object_mut()) {
            obj.insert("idle_us".into(), json!(p.idle_us));
        }
        if let (Some(moves), Some(obj)) = (self.moves, v.as_object_mut()) {
            let gbit = round(s.median * 1e6 * self.size as f64 * 8.0 / 1e9);
            obj.insert("inflight".into(), json!(p.inflight));
            obj.insert("moves_per_run".into(), json!(moves));
            obj.insert("gbit_s_median".into(), json!(gbit));
        }
        v
    }

    pub fn print(&self) {
        let p = self.plan;
        let v = self.json();
        if p.json {
            println!("{v}");
        } else {
            let s = self.summary;
            println!(
                "{:<10} {} {:>8} B {:<9}{}: median {:>9.3} {} (p5 {:.3}, p95 {:.3}, p99 {:.3}; {} samples){}",
                v["experiment"].as_str().unwrap_or(""),
                p.backend(),
                self.size,
                p.mode(),
                if p.touch { " touch" } else { "" },
                s.median,
                v["unit"].as_str().unwrap_or(""),
                s.p5,
                s.p95,
                s.p99,
                s.n,
                v.get("gbit_s_median").map_or(String::new(), |g| format!(", {g} Gbit/s")),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Peer, PointPlan};

    #[test]
    fn schema_matches_ferry_bench() {
        let plan = Plan {
            peer: Peer::Tcp,
            experiment: Experiment::Throughput,
            points: vec![PointPlan { size: 4096, moves: 50_000 }],
            runs: 20,
            inflight: 250,
            busy: false,
            touch: false,
            json: true,
            timeout_s: 10,
            idle_us: 0,
            die_after: None,
        };
        let summary = Summary::of(&[1.0, 2.0, 3.0]).unwrap();
        let v = Point { plan: &plan, size: 4096, summary, moves: Some(50_000), run_medians: None }.json();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "backend",
                "copies_kernel",
                "copies_user",
                "experiment",
                "gbit_s_median",
                "inflight",
                "median",
                "mode",
                "moves_per_run",
                "p5",
                "p95",
                "p99",
                "runs",
                "samples",
                "size",
                "touch",
                "trust",
                "unit"
            ]
        );
        assert_eq!(
            (v["backend"].as_str(), v["unit"].as_str(), v["trust"].as_str()),
            (Some("tcp-copy"), Some("Mops/s"), Some("n/a"))
        );
        assert_eq!(
            (round(0.0031274), round(2.79349), round(502.8204), round(0.12), round(0.0)),
            (0.00313, 2.793, 502.82, 0.12, 0.0)
        );
        // 2 Mops/s × 4096 B × 8 = 65.536 Gbit/s
        assert_eq!(v["gbit_s_median"].as_f64(), Some(65.536));
    }
}
