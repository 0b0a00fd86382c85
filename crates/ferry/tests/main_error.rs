//! What a user sees when a program whose `main` returns
//! `Result<(), ferry::Error>` fails: the example `shm_receiver`, run as a
//! process of its own against a path nobody listens on, must print the
//! error's sentence (the operation, the endpoint, what went wrong, what to
//! do) on stderr, not a bare variant name, and exit with status 1.
//!
//! A test without the libtest harness, so that this binary's own `main`
//! returns `Result<(), ferry::Error>` exactly as the example's does: run
//! with `FERRY_RUN_EXAMPLE` set, it is the example.

#[path = "../examples/shm_receiver.rs"]
mod shm_receiver;

use std::process::{Command, Stdio};

fn main() -> Result<(), ferry::Error> {
    if std::env::var_os("FERRY_RUN_EXAMPLE").is_some() {
        return shm_receiver::main();
    }
    let dir = std::env::temp_dir().join(format!("ferry-main-error-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("nobody-listens.sock");
    let run = Command::new(std::env::current_exe().expect("own path"))
        .args([path.to_str().expect("utf-8 path"), "200"])
        .env("FERRY_RUN_EXAMPLE", "1")
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .output();
    let _ = std::fs::remove_dir_all(&dir);
    let out = run.expect("run the example");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit status; stderr:\n{stderr}");
    let line = stderr.trim_end();
    assert_eq!(line.lines().count(), 1, "one line:\n{stderr}");
    let expected = format!(
        "Error: connect to the shm endpoint {}: no channel is listening on that endpoint; \
         create a channel there first, or check the endpoint's name or address [EndpointNotListening]",
        path.display()
    );
    assert_eq!(line, expected);
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
    println!("main_error: the example's failure reads as a sentence");
    Ok(())
}
