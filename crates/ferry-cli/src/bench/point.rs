//! One measured point: the JSON line of `ferry bench --json` (and of
//! `ferry-peers`, whose lines are read back into the same type), its text
//! form, and the accessors the comparison and the plots need.
//!
//! Schema (every line): `experiment`, `backend`, `size`, `trust`, `mode`,
//! `touch`, `runs`, `samples`, `unit`, `median`, `p5`, `p95`, `p99`, and
//! `copies_user` where countable; experiments add their own fields
//! (`gbit_s_median`, `variant`, `stages`, …).

use serde_json::{json, Map, Value};

use crate::stats::{round, Summary};

/// A measured point.
#[derive(Debug, Clone)]
pub struct Point(pub Map<String, Value>);

/// The fields every point has, besides its summary.
pub struct Head<'a> {
    /// `rtt`, `throughput`, `fbufs-table`, `pipeline`.
    pub experiment: &'a str,
    /// The backend or peer (`local`, `shm`, `uds-copy`, …).
    pub backend: &'a str,
    /// Buffer or message size in bytes (0: no payload, or not per size).
    pub size: usize,
    /// `full`, `half`, `none`, or `n/a` for peers.
    pub trust: &'a str,
    /// `busy-poll` or `blocking`.
    pub mode: &'a str,
    /// Whether payload bytes were written and read.
    pub touch: bool,
    /// Recorded runs (warm-up not counted).
    pub runs: usize,
    /// Unit of median and percentiles.
    pub unit: &'a str,
}

impl Point {
    /// A point from its head, summary, user-space payload copies (if
    /// countable) and extra fields (an object; others are ignored).
    pub fn new(head: Head<'_>, s: Summary, copies_user: Option<u64>, extra: Value) -> Point {
        let mut v = json!({
            "experiment": head.experiment, "backend": head.backend, "size": head.size,
            "trust": head.trust, "mode": head.mode, "touch": head.touch,
            "runs": head.runs, "samples": s.n,
            "unit": head.unit, "median": round(s.median), "p5": round(s.p5),
            "p95": round(s.p95), "p99": round(s.p99),
        });
        let obj = v.as_object_mut().expect("object");
        if let Some(c) = copies_user {
            obj.insert("copies_user".into(), json!(c));
        }
        if let Value::Object(extra) = extra {
            obj.extend(extra);
        }
        Point(std::mem::take(obj))
    }

    /// A point from a JSON line (of `ferry-peers`); `None` if it is not one.
    pub fn parse(line: &str) -> Option<Point> {
        match serde_json::from_str::<Value>(line).ok()? {
            Value::Object(m) if m.contains_key("median") && m.contains_key("experiment") => Some(Point(m)),
            _ => None,
        }
    }

    /// A string field ("" if absent).
    pub fn str(&self, key: &str) -> &str {
        self.0.get(key).and_then(Value::as_str).unwrap_or("")
    }

    /// A number field.
    pub fn num(&self, key: &str) -> Option<f64> {
        self.0.get(key).and_then(Value::as_f64)
    }

    /// The backend (or peer) name.
    pub fn backend(&self) -> &str {
        self.str("backend")
    }

    /// The size in bytes.
    pub fn size(&self) -> usize {
        self.num("size").unwrap_or(0.0) as usize
    }

    /// The unit of the summary.
    pub fn unit(&self) -> &str {
        self.str("unit")
    }

    /// Median, p5, p95, p99.
    pub fn quantiles(&self) -> [f64; 4] {
        ["median", "p5", "p95", "p99"].map(|k| self.num(k).unwrap_or(f64::NAN))
    }

    /// The unit as printed for people: the JSON's ASCII `us` is µs.
    pub fn unit_text(&self) -> String {
        unit_text(self.unit())
    }

    /// Set (or replace) a field.
    pub fn set(&mut self, key: &str, v: Value) {
        self.0.insert(key.into(), v);
    }

    /// The text form: what, then the median and percentiles.
    pub fn text(&self) -> String {
        let [m, p5, p95, p99] = self.quantiles();
        let mut what = format!(
            "{:<11} {:<9} {:>8} B trust={:<4} {:<9}",
            self.str("experiment"),
            self.backend(),
            self.size(),
            self.str("trust"),
            self.str("mode")
        );
        for (key, label, unit) in [("variant", "", ""), ("stages", "stages=", ""), ("idle_us", "idle ", " µs")] {
            if let Some(v) = self.0.get(key) {
                let v = v.as_str().map_or_else(|| v.to_string(), str::to_string);
                what.push_str(&format!(" {label}{v}{unit}"));
            }
        }
        if self.0.get("touch").and_then(Value::as_bool) == Some(true) {
            what.push_str(" touch");
        }
        // Say when no payload byte was written or read by the program (the
        // rate is then that of handing buffers over, not of using data);
        // fbufs-table writes and reads one word per page.
        let untouched =
            self.0.get("touch").and_then(Value::as_bool) == Some(false) && !self.str("experiment").starts_with("fbufs");
        let note = match (untouched, self.str("experiment")) {
            (true, "pipeline") => " (payload untouched but an 8-byte tag per buffer)",
            (true, _) => " (payload untouched)",
            _ => "",
        };
        let gbit = self.num("gbit_s_median").map_or(String::new(), |g| format!(", {g} Gbit/s{note}"));
        let n = self.num("samples").unwrap_or(0.0);
        let asym = self.num("asymptotic_gbit_s").map_or(String::new(), |g| format!(", asymptotic {g} Gbit/s"));
        let verified =
            self.num("verified").map_or(String::new(), |v| format!(", {v} payloads verified by the receiver"));
        format!(
            "{what}: median {m:>9.3} {} (p5 {p5:.3}, p95 {p95:.3}, p99 {p99:.3}; {n} sample{}){gbit}{asym}{verified}",
            self.unit_text(),
            if n == 1.0 { "" } else { "s" }
        )
    }
}

/// A JSON unit as printed for people (`us` → `µs`, `us/page` → `µs/page`).
pub fn unit_text(unit: &str) -> String {
    match unit.strip_prefix("us") {
        Some(rest) => format!("µs{rest}"),
        None => unit.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_has_the_required_fields() {
        let s = Summary::of(&[1.0, 2.0, 3.0]).unwrap();
        let head = Head {
            experiment: "rtt",
            backend: "local",
            size: 4096,
            trust: "full",
            mode: "busy-poll",
            touch: false,
            runs: 3,
            unit: "us",
        };
        let p = Point::new(head, s, Some(0), json!({ "idle_us": 100 }));
        for k in [
            "experiment",
            "backend",
            "size",
            "trust",
            "mode",
            "runs",
            "unit",
            "median",
            "p5",
            "p95",
            "p99",
            "copies_user",
        ] {
            assert!(p.0.contains_key(k), "{k} missing");
        }
        assert_eq!((p.size(), p.backend(), p.unit(), p.num("idle_us")), (4096, "local", "us", Some(100.0)));
        let line = serde_json::to_string(&Value::Object(p.0.clone())).unwrap();
        let back = Point::parse(&line).unwrap();
        assert_eq!(back.quantiles(), [2.0, 1.0, 3.0, 3.0]);
        assert!(Point::parse("not json").is_none() && Point::parse("{\"a\":1}").is_none());
        assert!(p.text().contains("idle 100 µs") && p.text().contains(" µs ("), "{}", p.text());
        assert!(!p.text().contains(" us"), "{}", p.text());
        assert_eq!((unit_text("us/page"), unit_text("Mops/s")), ("µs/page".to_string(), "Mops/s".to_string()));
    }
}
