//! Order statistics of a set of samples (the same definition as
//! `crates/ferry-cli/src/stats.rs`, so peers and Ferry are summarised alike).

/// Summary of samples: median and percentiles (nearest rank).
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub n: usize,
    pub median: f64,
    pub p5: f64,
    pub p95: f64,
    pub p99: f64,
}

impl Summary {
    /// Summarise `samples` (need not be sorted). `None` if empty.
    pub fn of(samples: &[f64]) -> Option<Summary> {
        if samples.is_empty() {
            return None;
        }
        let mut s = samples.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        let pct = |p: f64| {
            let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
            s[rank.clamp(1, s.len()) - 1]
        };
        Some(Summary { n: s.len(), median: pct(50.0), p5: pct(5.0), p95: pct(95.0), p99: pct(99.0) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = Summary::of(&v).unwrap();
        assert_eq!((s.n, s.median, s.p5, s.p95, s.p99), (100, 50.0, 5.0, 95.0, 99.0));
        let one = Summary::of(&[3.0]).unwrap();
        assert_eq!((one.median, one.p5, one.p99), (3.0, 3.0, 3.0));
        // 10 samples: rank ceil(0.5*10)=5, ceil(0.05*10)=1, ceil(0.95*10)=10.
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        let t = Summary::of(&ten).unwrap();
        assert_eq!((t.median, t.p5, t.p95, t.p99), (5.0, 1.0, 10.0, 10.0));
        assert!(Summary::of(&[]).is_none());
    }
}
