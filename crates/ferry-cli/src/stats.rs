//! Order statistics of a set of samples, and the rounding of reported
//! figures (the same definitions as bench/peers/src/stats.rs and
//! report.rs, so Ferry and its peers are summarised alike).

/// Summary of samples: median and percentiles (nearest rank).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// 50th percentile.
    pub median: f64,
    /// 5th percentile.
    pub p5: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
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

/// Three decimals, but at least three significant digits (a copying peer
/// moves 0.00313 M messages of 1 MiB per second).
pub fn round(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let decimals = (2 - x.abs().log10().floor() as i32).max(3);
    let f = 10f64.powi(decimals);
    (x * f).round() / f
}

/// Least-squares line through `(x, y)` points: `(intercept, slope)`;
/// `None` with fewer than two distinct x.
pub fn fit_line(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    if sxx == 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let slope = sxy / sxx;
    Some((my - slope * mx, slope))
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

    #[test]
    fn rounding_keeps_three_significant_digits() {
        assert_eq!(
            (round(0.0031274), round(2.79349), round(502.8204), round(0.12), round(0.0)),
            (0.00313, 2.793, 502.82, 0.12, 0.0)
        );
    }

    #[test]
    fn line_fit() {
        let (a, b) = fit_line(&[(1.0, 3.0), (2.0, 5.0), (4.0, 9.0)]).unwrap();
        assert!((a - 1.0).abs() < 1e-9 && (b - 2.0).abs() < 1e-9, "{a} {b}");
        assert!(fit_line(&[(1.0, 1.0)]).is_none());
        assert!(fit_line(&[(1.0, 1.0), (1.0, 2.0)]).is_none());
    }
}
