//! `ferry bench socket-touch` (Container Shipping, Fig. 4) as a user runs
//! it: the real binary forks its sender (or starts its Ferry sender
//! process), and prints one JSON point per variant (read-write, ferry-io,
//! unmapped, ferry-channel, ferry-channel-prefilled) and touched fraction,
//! each with a positive rate, and each row's ratio to read/write.

mod common;

#[test]
fn socket_touch_prints_fifteen_points_and_the_ratios() {
    let svg =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("socket-touch-{}.svg", std::process::id()));
    let lines = common::json_lines(
        ["bench", "socket-touch", "--runs", "1", "--total", "8388608", "--json", "--plot"]
            .map(std::ffi::OsStr::new)
            .into_iter()
            .chain([svg.as_os_str()]),
    );
    let points: Vec<_> = lines.iter().filter(|p| p.get("kind").is_none()).collect();
    assert_eq!(points.len(), 15, "{points:?}");
    let mut seen = Vec::new();
    for p in &points {
        assert_eq!(p["experiment"], "socket-touch");
        assert_eq!(p["size"], 131072);
        assert!(p["median"].as_f64().is_some_and(|m| m > 0.0), "{p}");
        // Only the rows that carry the bytes through the socket copy them.
        let channel = p["backend"].as_str().unwrap().starts_with("ferry-channel");
        assert_eq!(p["copies_kernel"], if channel { 0 } else { 2 }, "{p}");
        seen.push(format!("{} {}", p["backend"].as_str().unwrap(), p["variant"].as_str().unwrap()));
    }
    let plot = std::fs::read_to_string(&svg).expect("the plot is written");
    assert!(plot.contains("<svg") && plot.contains("touched=half"), "a bar per point");
    std::fs::remove_file(&svg).unwrap();
    for b in ["read-write", "ferry-io", "unmapped", "ferry-channel", "ferry-channel-prefilled"] {
        for t in ["all", "half", "none"] {
            assert!(seen.contains(&format!("{b} touched={t}")), "{b} touched={t} missing: {seen:?}");
        }
    }
    let ratios: Vec<_> = lines.iter().filter(|p| p["kind"] == "ratio").collect();
    assert_eq!(ratios.len(), 12, "{ratios:?}");
    for r in &ratios {
        assert_eq!(r["baseline"], "read-write");
        assert!(r["median_ratio"].as_f64().is_some_and(|m| m > 0.0), "{r}");
    }
    assert!(ratios.iter().any(|r| r["ferry"] == "ferry-channel" && r["touched"] == "none"));
}

/// 33 buffers a run: one more than the Ferry sender's window and its
/// batches of 32 moves, so the run's last move is held back in a batch of
/// one when the sender has sent it. The sender must publish it before it
/// waits for its next control line; the receiver waits for it otherwise.
#[test]
fn socket_touch_delivers_a_run_that_ends_in_a_partial_batch() {
    let total = (33u64 * 131072).to_string();
    let lines = common::json_lines(["bench", "socket-touch", "--runs", "1", "--total", &total, "--json"]);
    let points: Vec<_> = lines.iter().filter(|p| p.get("kind").is_none()).collect();
    assert_eq!(points.len(), 15, "{points:?}");
    for p in &points {
        assert_eq!(p["total"], 33 * 131072, "{p}");
        assert!(p["median"].as_f64().is_some_and(|m| m > 0.0), "{p}");
    }
}

#[test]
fn socket_touch_refuses_a_total_that_is_not_whole_buffers() {
    common::refused(["bench", "socket-touch", "--runs", "1", "--total", "1000000"]);
}
