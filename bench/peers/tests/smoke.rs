//! End-to-end: every peer measures a tiny point and prints one valid JSON
//! line; an echo process that dies makes the source fail quickly.

use std::process::Command;
use std::time::{Duration, Instant};

/// One benchmark at a time: they pin to the same two CPUs, and iceoryx2 runs take a lock.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn run(args: &[&str]) -> (bool, String, String, Duration) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let t0 = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_ferry-peers")).args(args).output().expect("run ferry-peers");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        t0.elapsed(),
    )
}

fn json_line(stdout: &str) -> serde_json::Value {
    let line = stdout.lines().next().expect("one line");
    serde_json::from_str(line).expect("valid JSON")
}

#[test]
fn every_peer_measures() {
    let cases: &[(&[&str], &str, &str)] = &[
        (&["uds-copy", "rtt"], "uds-copy", "blocking"),
        (&["tcp-copy", "throughput", "--touch"], "tcp-copy", "blocking"),
        (&["pipe-copy", "throughput"], "pipe-copy", "blocking"),
        (&["eventfd", "rtt"], "eventfd", "blocking"),
        (&["eventfd", "rtt", "--busy-poll"], "memfd-spin", "busy-poll"),
        (&["iceoryx2", "rtt", "--touch"], "iceoryx2", "busy-poll"),
        (&["iceoryx2", "throughput", "--blocking"], "iceoryx2", "blocking"),
    ];
    for (args, backend, mode) in cases {
        if args[0] == "iceoryx2" && !cfg!(feature = "iceoryx2") {
            continue;
        }
        let mut a = args.to_vec();
        a.extend(["--runs", "1", "--moves", "600", "--size", "4096", "--json"]);
        if args[0] == "eventfd" {
            a.truncate(a.len() - 3);
            a.push("--json");
        }
        let (ok, out, err, _) = run(&a);
        assert!(ok, "{args:?} failed: {err}");
        let v = json_line(&out);
        assert_eq!(v["backend"].as_str(), Some(*backend), "{out}");
        assert_eq!(v["mode"].as_str(), Some(*mode), "{out}");
        assert!(v["median"].as_f64().is_some_and(|m| m > 0.0), "{out}");
        let samples = if args[1] == "rtt" { 250 } else { 1 };
        assert_eq!(v["samples"].as_u64(), Some(samples), "{out}");
    }
}

#[test]
fn a_dead_echo_is_an_error() {
    for args in [
        &["uds-copy", "throughput"][..],
        &["eventfd", "rtt"],
        &["eventfd", "rtt", "--busy-poll"],
        &["iceoryx2", "throughput"],
    ] {
        if args[0] == "iceoryx2" && !cfg!(feature = "iceoryx2") {
            continue;
        }
        let mut a = args.to_vec();
        a.extend(["--runs", "2", "--die-after", "300"]);
        if args[0] != "eventfd" {
            a.extend(["--moves", "600"]);
        }
        let (ok, out, err, took) = run(&a);
        assert!(!ok, "{args:?} succeeded: {out}");
        assert!(out.is_empty(), "{args:?} printed a result: {out}");
        assert!(err.contains("--die-after"), "{err}");
        assert!(took < Duration::from_secs(5), "{args:?} took {took:?}");
    }
}

#[test]
fn bad_arguments_are_refused() {
    let (ok, _, err, _) = run(&["tcp-copy", "rtt", "--size", "12"]);
    assert!(!ok && err.contains("multiple of 8"), "{err}");
}

#[test]
fn fbufs_transfers_report_run_medians() {
    let (ok, out, err, _) = run(&["uds-copy", "fbufs", "--size", "4096", "--size", "65536", "--runs", "3", "--json"]);
    assert!(ok, "{err}");
    let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2, "{out}");
    for v in &lines {
        assert_eq!((v["experiment"].as_str(), v["unit"].as_str()), (Some("fbufs"), Some("us")), "{v}");
        assert_eq!(v["run_medians"].as_array().map(Vec::len), Some(3), "{v}");
        assert_eq!(v["samples"].as_u64(), Some(75), "{v}");
    }
    let (ok, _, err, _) = run(&["iceoryx2", "fbufs"]);
    assert!(!ok && !err.is_empty());
}

#[test]
fn idle_gap_before_round_trips() {
    let (ok, out, err, took) = run(&["eventfd", "rtt", "--runs", "1", "--idle-us", "1000", "--json"]);
    assert!(ok, "{err}");
    let v = json_line(&out);
    assert_eq!(v["idle_us"].as_u64(), Some(1000), "{out}");
    // 500 round trips (warm-up included), each after at least 1 ms idle.
    assert!(took >= Duration::from_millis(500), "{took:?}");
    let (ok, _, err, _) = run(&["uds-copy", "throughput", "--idle-us", "10"]);
    assert!(!ok && err.contains("rtt only"), "{err}");
}

#[test]
fn features_lists_optional_peers() {
    let (ok, out, _, _) = run(&["features"]);
    assert!(ok);
    assert_eq!(out.contains("iceoryx2"), cfg!(feature = "iceoryx2"), "{out}");
}
