//! Running the `ferry` binary as a user does, shared by the tests of its
//! benchmark experiments.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::process::{Command, Output, Stdio};

/// Run `ferry ARGS…` with no input and wait for it.
pub fn ferry<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry")).args(args).stdin(Stdio::null()).output().expect("run ferry")
}

/// Run `ferry ARGS…`, which must succeed, and parse every line it prints
/// as JSON (the `--json` output of an experiment).
pub fn json_lines<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Vec<serde_json::Value> {
    let out = ferry(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status.code());
    String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
}

/// Run `ferry ARGS…` and check it refuses them as a usage error (exit 2).
pub fn refused<S: AsRef<OsStr> + std::fmt::Debug>(args: impl IntoIterator<Item = S>) {
    let args: Vec<S> = args.into_iter().collect();
    let out = ferry(&args);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}
