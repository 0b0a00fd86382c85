//! `ferry bench udp-forward` (Container Shipping, Fig. 6) as a user runs
//! it: real UDP sockets on loopback, real competing processes; one JSON
//! point per forwarder and number of competitors, each verified at the sink
//! (sequence numbers rising, every datagram whole), and the ratio between
//! the two forwarders.

mod common;

#[test]
fn udp_forward_prints_verified_points_and_ratios() {
    let lines = common::json_lines([
        "bench",
        "udp-forward",
        "--runs",
        "1",
        "--total",
        "8192000",
        "--competitors",
        "0,1",
        "--json",
    ]);
    let (ratios, points): (Vec<_>, Vec<_>) = lines.iter().partition(|p| p["kind"] == "ratio");
    assert_eq!(points.len(), 4, "{points:?}");
    let mut seen = Vec::new();
    for p in &points {
        assert_eq!(p["experiment"], "udp-forward");
        assert_eq!(p["size"], 4096);
        assert_eq!(p["datagrams"], 2000);
        assert_eq!(p["verified"], true);
        assert!(p["lost"].as_u64().is_some_and(|l| l < 2000), "{p}");
        assert!(p["median"].as_f64().is_some_and(|m| m > 0.0), "{p}");
        seen.push(format!("{} {}", p["backend"].as_str().unwrap(), p["competitors"]));
    }
    for b in ["read-write", "ferry-io"] {
        for k in [0, 1] {
            assert!(seen.contains(&format!("{b} {k}")), "{b} with {k} competing missing: {seen:?}");
        }
    }
    assert_eq!(ratios.len(), 2, "{ratios:?}");
    assert!(ratios.iter().all(|r| r["ferry_faster_by"].as_f64().is_some_and(|x| x > 0.0)), "{ratios:?}");
}

#[test]
fn udp_forward_refuses_bad_input() {
    for bad in [&["--competitors", "17"][..], &["--size", "70000"], &["--stages", "3"]] {
        common::refused(["bench", "udp-forward", "--runs", "1"].iter().chain(bad));
    }
}
