//! `ferry bench throughput --one-way` as a user runs it over TCP: the echo
//! process checks every payload and gives the buffers back unfilled, and
//! iperf3 runs beside it on loopback with the same message size. Smoke
//! runs: tiny sizes and counts, no assertion on speed.

mod common;

use std::process::{Command, Stdio};

fn iperf3_installed() -> bool {
    Command::new("iperf3")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

const ONE_WAY: [&str; 15] = [
    "bench",
    "throughput",
    "--backend",
    "net",
    "--one-way",
    "--touch",
    "--blocking",
    "--size",
    "4096",
    "--runs",
    "2",
    "--moves",
    "400",
    "--inflight",
    "32",
];

/// Ferry's rate in GB/s with every payload verified by the echo, iperf3's
/// rate beside it, and the ratio of the round.
#[test]
fn one_way_throughput_runs_beside_iperf3() {
    let args = ONE_WAY.iter().chain(&["--compare", "--against", "iperf3", "--rounds", "1"]);
    if !iperf3_installed() {
        // Without iperf3 the comparison is refused, saying how to get it.
        let out = common::ferry(args);
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("scripts/setup iperf3"));
        panic!("iperf3 is not installed: run `scripts/setup iperf3` to run this test");
    }
    let out = common::ferry(args);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "exit {:?}\nstdout: {stdout}\nstderr: {stderr}", out.status.code());
    let line = |backend: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with("throughput") && l.split_whitespace().nth(1) == Some(backend))
            .unwrap_or_else(|| panic!("no {backend} line in:\n{stdout}"))
    };
    let rate = |l: &str| -> f64 {
        let after = l.split("median").nth(1).expect("a median");
        after.split_whitespace().next().and_then(|m| m.parse().ok()).expect("a number")
    };
    let ferry = line("net");
    assert!(ferry.contains("one-way") && ferry.contains(" GB/s "), "{ferry}");
    assert!(ferry.contains("1200 payloads verified by the receiver"), "400 moves × (2 runs + warm-up): {ferry}");
    assert!(rate(ferry) > 0.0, "{ferry}");
    let iperf = line("iperf3");
    assert!(iperf.contains(" GB/s ") && rate(iperf) > 0.0, "{iperf}");
    let ratio = stdout.lines().find(|l| l.contains("net one-way / iperf3:")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(ratio.contains("4096 B") && ratio.contains("Ferry"), "{ratio}");
}

/// iperf3 sends one way: compared with a Ferry that does too, over TCP.
#[test]
fn iperf3_is_compared_one_way_over_tcp_only() {
    common::refused(["bench", "throughput", "--backend", "net", "--compare", "--against", "iperf3"]);
    common::refused(["bench", "throughput", "--backend", "shm", "--one-way", "--compare", "--against", "iperf3"]);
    common::refused(["bench", "rtt", "--one-way"]);
    common::refused(["bench", "throughput", "--backend", "tcp-copy", "--one-way"]);
}
