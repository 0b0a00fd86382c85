#!/usr/bin/env bash
# Runs every fuzz target for a bounded time (FUZZ_SECONDS each, default 30).
# Needs the nightly toolchain (installed on the CI machine) and cargo-fuzz,
# which it installs from crates.io when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${FUZZ_SECONDS:-30}"
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked -q
fi
for target in $(cargo +nightly fuzz list); do
  echo "fuzzing $target for ${secs}s"
  # Hand-written valid inputs (fuzz/seeds/TARGET) start the search inside
  # the format; the corpus grows in fuzz/corpus/TARGET (not committed).
  dirs=("fuzz/corpus/$target")
  mkdir -p "${dirs[0]}"
  [ -d "fuzz/seeds/$target" ] && dirs+=("fuzz/seeds/$target")
  cargo +nightly fuzz run "$target" "${dirs[@]}" -- -max_total_time="$secs" -rss_limit_mb=2048 2>&1 | tail -n 3
done
