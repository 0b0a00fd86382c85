//! `ferry bench layers` (the layered protocol stack of fbufs §2) as a user
//! runs it: the real binary starts its router and receiver processes, and
//! in quick mode prints, for every size, one JSON point per stack (with the
//! receiver's verification count and the per-layer costs) and one ratio
//! line. Bad input is a usage error.

mod common;

#[test]
fn layers_quick_reports_every_size_verified() {
    let lines = common::json_lines(["bench", "layers", "--quick", "--json"]);
    let sizes = [65536u64, 262144, 1048576, 4194304];
    for size in sizes {
        for (stack, copies) in [("aggregate", 0), ("copying", 9)] {
            let p = lines
                .iter()
                .find(|p| p["size"] == size && p["variant"] == stack)
                .unwrap_or_else(|| panic!("no {stack} point for {size}: {lines:?}"));
            assert_eq!(p["experiment"], "layers");
            assert_eq!(p["copies_user"], copies, "{p}");
            // Quick mode: one run of 4 messages, every one verified by the receiver.
            assert_eq!(p["verified"], 4, "{p}");
            assert!(p["median"].as_f64().is_some_and(|m| m > 0.0), "{p}");
            for k in ["a_app_ns", "a_transport_ns", "a_network_ns", "a_fragment_ns", "c_reassemble_ns", "c_app_ns"] {
                assert!(p[k].as_f64().is_some_and(|v| v > 0.0), "{k} missing in {p}");
            }
        }
        let r = lines
            .iter()
            .find(|p| p["size"] == size && p.get("ratio").is_some())
            .unwrap_or_else(|| panic!("no ratio for {size}: {lines:?}"));
        assert!(r["ratio"].as_f64().is_some_and(|x| x > 0.0), "{r}");
        assert_eq!(r["verified"], 8, "{r}");
    }
}

#[test]
fn layers_bad_input_is_a_usage_error() {
    for bad in [
        &["bench", "layers", "--backend", "local"][..],
        &["bench", "layers", "--size", "4096"],
        &["bench", "layers", "--size", "1073741824"],
        &["bench", "rtt", "--quick"],
        &["bench", "layers", "--quick", "--compare"],
    ] {
        common::refused(bad);
    }
}
