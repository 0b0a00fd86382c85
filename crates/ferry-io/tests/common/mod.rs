//! What the ferry-io tests share: test data and scratch directories.

use std::path::{Path, PathBuf};

/// Deterministic, non-repeating test data (xorshift).
pub fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A fresh directory on a disk file system (O_DIRECT works there), named
/// after the test binary's `kind` and `name`.
pub fn dir(kind: &str, name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ferry-{kind}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
