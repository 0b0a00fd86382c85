//! `ferry bench socket-touch` (Container Shipping, Fig. 4) as a user runs
//! it: the real binary forks its sender, and prints one JSON point per
//! variant (read-write, ferry-io, unmapped) and touched fraction, each with a positive rate.

use std::process::{Command, Stdio};

#[test]
fn socket_touch_prints_nine_points() {
    let svg =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("socket-touch-{}.svg", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["bench", "socket-touch", "--runs", "1", "--total", "8388608", "--json", "--plot"])
        .arg(&svg)
        .stdin(Stdio::null())
        .output()
        .expect("run ferry");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status.code());
    let points: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
    assert_eq!(points.len(), 9, "{points:?}");
    let mut seen = Vec::new();
    for p in &points {
        assert_eq!(p["experiment"], "socket-touch");
        assert_eq!(p["size"], 131072);
        assert!(p["median"].as_f64().is_some_and(|m| m > 0.0), "{p}");
        seen.push(format!("{} {}", p["backend"].as_str().unwrap(), p["variant"].as_str().unwrap()));
    }
    let plot = std::fs::read_to_string(&svg).expect("the plot is written");
    assert!(plot.contains("<svg") && plot.contains("touched=half"), "a bar per point");
    std::fs::remove_file(&svg).unwrap();
    for b in ["read-write", "ferry-io", "unmapped"] {
        for t in ["all", "half", "none"] {
            assert!(seen.contains(&format!("{b} touched={t}")), "{b} touched={t} missing: {seen:?}");
        }
    }
}
