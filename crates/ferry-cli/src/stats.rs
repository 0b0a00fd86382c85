//! Order statistics of a set of samples.

/// Summary of samples: median and percentiles (nearest rank).
#[derive(Debug, Clone, Copy)]
#[allow(dead_code)] // min/max kept for reports and tests
pub struct Summary {
    pub n: usize,
    pub median: f64,
    pub p5: f64,
    pub p95: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
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
        Some(Summary {
            n: s.len(),
            median: pct(50.0),
            p5: pct(5.0),
            p95: pct(95.0),
            p99: pct(99.0),
            min: s[0],
            max: s[s.len() - 1],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&v).unwrap();
        assert_eq!((s.median, s.p5, s.p95, s.p99, s.min, s.max), (50.0, 5.0, 95.0, 99.0, 1.0, 100.0));
        let one = Summary::of(&[3.0]).unwrap();
        assert_eq!((one.median, one.p99), (3.0, 3.0));
        assert!(Summary::of(&[]).is_none());
    }
}
