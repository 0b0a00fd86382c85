#!/usr/bin/env bash
# Runs the loom models of the SPSC rings (crates/ferry/src/ring/: the byte
# ring and the ring of values of the local backend,
# mod ring::loom_tests) and of the C interface's lock (crates/ferry-c/src/lock.rs).
# --cfg loom changes the build of every crate, so it
# gets its own target dir. Takes well under a minute after the build.
set -euo pipefail
cd "$(dirname "$0")/.."
export RUSTFLAGS="${RUSTFLAGS:-} --cfg loom"
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/loom"
cargo test -p ferry --release --lib ring::loom_tests -- --test-threads=1 --nocapture "$@"
cargo test -p ferry-c --release --lib lock::loom_tests -- --test-threads=1 --nocapture "$@"
