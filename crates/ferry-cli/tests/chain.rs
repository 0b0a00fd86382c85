//! `ferry bench chain` (Container Shipping, Fig. 7) as a user runs it: real
//! stage processes reading a real file, Ferry channels against pipes and
//! against a `cat | cat | cat` shell chain, every run checked at the sink;
//! one JSON point per chain, the ratios and the cost of one more stage.

mod common;

fn run(args: &[&str]) -> Vec<serde_json::Value> {
    common::json_lines(["bench", "chain", "--runs", "1", "--total", "16777216", "--json"].iter().chain(args))
}

#[test]
fn chain_to_a_file_measures_ferry_pipes_and_cat() {
    let lines = run(&["--sink", "file", "--stages", "3"]);
    let points: Vec<_> = lines.iter().filter(|p| p.get("kind").is_none()).collect();
    // Untouched: ferry, pipes, cat; touched: ferry, pipes (cat never reads).
    assert_eq!(points.len(), 5, "{points:?}");
    for p in &points {
        assert_eq!(p["experiment"], "chain");
        assert_eq!(p["stages"], 3);
        assert_eq!(p["sink"], "file");
        assert_eq!(p["verified"], true);
        assert!(p["median"].as_f64().is_some_and(|m| m > 0.0), "{p}");
    }
    let backends: Vec<&str> = points.iter().map(|p| p["backend"].as_str().unwrap()).collect();
    for b in ["shm", "pipe-copy", "cat"] {
        assert!(backends.contains(&b), "{b} missing: {backends:?}");
    }
    let ratios: Vec<_> = lines.iter().filter(|p| p["kind"] == "ratio").collect();
    assert_eq!(ratios.len(), 3, "{ratios:?}");
}

#[test]
fn chain_to_dev_null_reports_the_cost_of_a_stage() {
    let lines = run(&["--sink", "null", "--stages", "2", "--stages", "4", "--touch"]);
    let costs: Vec<_> = lines.iter().filter(|p| p["kind"] == "stage-cost").collect();
    // --touch: touched stages only, so ferry and pipes (no cat).
    assert_eq!(costs.len(), 2, "{lines:?}");
    assert!(costs.iter().all(|c| c["us_per_buffer_per_stage"].as_f64().is_some() && c["middle"] == "touched"));
    // Measured directly beside the wall-clock difference: the middle stages' own CPU time.
    assert!(costs.iter().all(|c| c["cpu_us_per_buffer_per_stage"].as_f64().is_some_and(|us| us > 0.0)), "{costs:?}");
    let points: Vec<_> = lines.iter().filter(|p| p.get("kind").is_none()).collect();
    for p in points {
        // Two stages have no middle stage to measure; four have two.
        let cpu = p["middle_cpu_us_per_buffer"].as_f64();
        assert_eq!(cpu.is_some(), p["stages"] == 4, "{p}");
    }
}

#[test]
fn chain_refuses_bad_input() {
    for bad in [&["--total", "5000"][..], &["--sink", "disk"], &["--size", "1000"], &["--competitors", "1"]] {
        common::refused(["bench", "chain", "--runs", "1"].iter().chain(bad));
    }
}
