//! The `ferry` command as a user meets it: the built binary run with bad
//! and good command lines. Bad input is one line on stderr that names the
//! flag, exit code 2, no panic and no Rust debug form; a short real run
//! prints its figures in µs and no debug form either.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What a run of `ferry` gave: exit code, stdout, stderr.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Run `ferry ARGS…`, killed after `limit` (a command that should have
/// been refused must not hang the test).
fn ferry_within(args: &[&str], limit: Duration) -> Run {
    ferry_in_env(args, &[], limit)
}

/// [`ferry_within`] with these environment variables set.
fn ferry_in_env(args: &[&str], env: &[(&str, &str)], limit: Duration) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ferry");
    let (mut out, mut err) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break Some(st);
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut stderr = String::new();
    let _ = err.read_to_string(&mut stderr);
    let stdout = reader.join().expect("reader");
    assert!(status.is_some(), "ferry {args:?} did not finish within {limit:?}\nstderr: {stderr}");
    Run { code: status.and_then(|s| s.code()), stdout, stderr }
}

fn ferry(args: &[&str]) -> Run {
    ferry_within(args, Duration::from_secs(120))
}

/// Rust's debug forms and panic output, which a user must never see.
const NOT_FOR_USERS: [&str; 8] = ["Some(", "None", "Error(", "PoolId(", "panicked", "RUST_BACKTRACE", "{", "::"];

fn assert_for_users(text: &str, args: &[&str]) {
    for bad in NOT_FOR_USERS {
        assert!(!text.contains(bad), "ferry {args:?} printed {bad:?}:\n{text}");
    }
}

/// `args` must be refused: exit code 2, exactly one line on stderr that
/// names `flag` (and `value`, when given), nothing for users to decode.
fn assert_usage(args: &[&str], flag: &str, value: Option<&str>) {
    let r = ferry(args);
    assert_eq!(r.code, Some(2), "ferry {args:?}: exit code\nstdout: {}\nstderr: {}", r.stdout, r.stderr);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "ferry {args:?}: not one line on stderr:\n{}", r.stderr);
    let line = lines[0];
    assert!(line.starts_with("ferry: "), "ferry {args:?}: {line}");
    assert!(line.contains(flag), "ferry {args:?}: {flag} not named: {line}");
    if let Some(v) = value {
        assert!(line.contains(v), "ferry {args:?}: value {v} not named: {line}");
    }
    assert_for_users(&r.stderr, args);
    assert!(r.stdout.is_empty(), "ferry {args:?} ran anyway:\n{}", r.stdout);
}

#[test]
fn echo_cpu_beyond_the_machine_is_a_usage_error() {
    assert_usage(&["echo", "--endpoint", "shm@ferry-cli-test-nobody", "--cpu", "1024"], "--cpu", Some("1024"));
    assert_usage(&["echo", "--endpoint", "shm@ferry-cli-test-nobody", "--cpu", "two"], "--cpu", Some("two"));
    assert_usage(&["echo", "--endpoint", "nowhere"], "--endpoint", Some("nowhere"));
}

#[test]
fn a_size_no_pool_can_have_names_the_flag() {
    assert_usage(&["bench", "rtt", "--size", "1099511627776", "--runs", "1"], "--size", Some("1099511627776"));
    assert_usage(&["bench", "rtt", "--size", "1000", "--runs", "1"], "--size", Some("1000"));
    assert_usage(&["bench", "rtt", "--size", "0", "--runs", "1"], "--size", Some("0"));
    // Fits the flag's range, not the machine's memory (250 buffers in flight).
    assert_usage(&["bench", "throughput", "--size", "1073741824", "--runs", "1"], "--size", Some("1073741824"));
}

#[test]
fn zero_moves_and_zero_bytes_are_refused() {
    assert_usage(&["bench", "throughput", "--moves", "0", "--runs", "1"], "--moves", Some("0"));
    assert_usage(&["bench", "throughput", "--moves", "10", "--runs", "1"], "--moves", Some("10"));
    assert_usage(&["demo", "--bytes", "0"], "--bytes", Some("0"));
    assert_usage(&["demo", "--bytes", "4096"], "--bytes", Some("4096"));
}

#[test]
fn every_flag_out_of_range_is_one_line() {
    for (args, flag, value) in [
        (&["bench", "rtt", "--runs", "0"][..], "--runs", Some("0")),
        (&["bench", "rtt", "--runs", "many"], "--runs", Some("many")),
        (&["bench", "rtt", "--runs", "-1"], "--runs", Some("-1")),
        (&["bench", "rtt", "--runs"], "--runs", None),
        (&["bench", "throughput", "--inflight", "0", "--runs", "1"], "--inflight", Some("0")),
        (&["bench", "throughput", "--inflight", "100000", "--runs", "1"], "--inflight", Some("100000")),
        (&["bench", "rtt", "--rounds", "0", "--runs", "1"], "--rounds", Some("0")),
        (&["bench", "rtt", "--idle-us", "99999999999", "--runs", "1"], "--idle-us", Some("99999999999")),
        (&["bench", "rtt", "--trust", "paranoid"], "--trust", Some("paranoid")),
        (&["bench", "rtt", "--trust", "none", "--runs", "1"], "--trust", Some("none")),
        (&["bench", "rtt", "--backend", "carrier-pigeon"], "--backend", Some("carrier-pigeon")),
        (&["bench", "rtt", "--moves", "100", "--runs", "1"], "--moves", None),
        (&["bench", "rtt", "--runs", "1", "--runs", "2"], "--runs", None),
        (&["bench", "rtt", "--busy-poll", "--blocking"], "--blocking", None),
        (&["bench", "pipeline", "--stages", "9"], "--stages", Some("9")),
        (&["bench", "fbufs-table", "--size", "4096", "--runs", "1"], "--size", Some("4096")),
        (&["bench", "fbufs-table", "--touch"], "--touch", None),
        (&["bench", "pipeline", "--total", "0"], "--total", Some("0")),
        (&["bench", "pipeline", "--total", "5000", "--runs", "1"], "--total", Some("5000")),
        (&["bench", "throughput", "--plot", "/nonexistent-dir/x.svg"], "--plot", Some("/nonexistent-dir/x.svg")),
        (&["bench", "throughput", "--plot", "x.png"], "--plot", Some("x.png")),
        (&["bench", "throughput", "--iperf3-gbit", "-1"], "--iperf3-gbit", Some("-1")),
        (&["bench", "rtt", "--backend", "shm", "--peer", "nowhere"], "--peer", Some("nowhere")),
        (&["bench", "rtt", "--against", "uds-copy"], "--against", None),
        (&["bench", "rtt", "--no-such-flag"], "--no-such-flag", None),
        (&["bench", "no-such-experiment"], "experiment", Some("no-such-experiment")),
        (&["demo", "--buffer-size", "1000"], "--buffer-size", Some("1000")),
        (&["demo", "--buffer-size", "1099511627776"], "--buffer-size", Some("1099511627776")),
        (&["demo", "--bytes", "1099511627776000"], "--bytes", Some("1099511627776000")),
        (&["demo", "--trust", "none"], "--trust", Some("none")),
        (&["demo", "--bytes", "-5"], "--bytes", Some("-5")),
        (&["echo", "--endpoint", "shm@ferry-cli-test-nobody", "--cpu", "-1"], "--cpu", Some("-1")),
        (&["echo"], "--endpoint", None),
    ] {
        assert_usage(args, flag, value);
    }
}

/// The demo's last flow goes over the fabric backend when this ferry has
/// it (libfabric's tcp provider, every byte verified, nothing staged), is
/// skipped with the loader's reason on a machine without libfabric, and
/// otherwise says how to build it in.
#[test]
fn the_demo_moves_data_over_the_fabric_when_built_in() {
    let args = ["demo", "--bytes", "262144"];
    let r = ferry(&args);
    assert_eq!(r.code, Some(0), "{}\n{}", r.stdout, r.stderr);
    assert_for_users(&r.stdout, &args);
    if cfg!(feature = "fabric") {
        let line =
            r.stdout.lines().find(|l| l.starts_with("over the fabric:")).unwrap_or_else(|| panic!("{}", r.stdout));
        assert!(line.contains("4 buffers, 256 KiB moved and verified"), "{line}");
        let counters = r.stdout.lines().find(|l| l.contains("posted sends and RMA writes")).expect("the counters");
        assert!(
            counters
                .contains("256 KiB sent straight from buffers, 256 KiB received straight into buffers, 0 bytes staged"),
            "{counters}"
        );
        let r = ferry_in_env(&args, &[("FERRY_LIBFABRIC", "/nonexistent/libfabric.so.1")], Duration::from_secs(120));
        assert_eq!(r.code, Some(0), "{}\n{}", r.stdout, r.stderr);
        assert!(r.stdout.contains("skipped: ") && r.stdout.contains("libfabric could not be loaded"), "{}", r.stdout);
        assert!(r.stdout.contains("all checks passed"), "{}", r.stdout);
    } else {
        assert!(r.stdout.contains("fabric backend: not built into this ferry (scripts/setup fabric"), "{}", r.stdout);
    }
}

/// A short run prints its figures in µs (never `us`) and nothing in Rust's
/// debug form; an untouched payload is said to be untouched.
#[test]
fn a_short_run_prints_microseconds_in_words() {
    let args = ["bench", "rtt", "--backend", "local", "--size", "4096", "--runs", "1"];
    let r = ferry(&args);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains(" µs "), "{}", r.stdout);
    assert!(!r.stdout.contains(" us ") && !r.stdout.contains("usec"), "{}", r.stdout);
    assert_for_users(&r.stdout, &args);
    assert_for_users(&r.stderr, &args);

    let args = ["bench", "throughput", "--backend", "local", "--size", "65536", "--runs", "1", "--moves", "500"];
    let r = ferry(&args);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains("Gbit/s (payload untouched)"), "{}", r.stdout);
    assert_for_users(&r.stdout, &args);

    let args = ["demo", "--bytes", "65536"];
    let r = ferry(&args);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains(" µs ") && r.stdout.contains("64 KiB moved"), "{}", r.stdout);
    assert!(!r.stdout.contains("0 MiB"), "{}", r.stdout);
    assert_for_users(&r.stdout, &args);
}

/// A peer that speaks garbage: the echo fails with exit code 1 and one
/// sentence that says what happened and what to do, not a debug form.
#[test]
fn a_failure_is_a_sentence_with_advice() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
    let addr = listener.local_addr().expect("address");
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut hello = [0u8; 4096];
        let _ = s.read(&mut hello);
        let _ = s.write_all(&[122u8; 256]);
        std::thread::sleep(Duration::from_millis(500));
    });
    let endpoint = format!("tcp:{addr}");
    let args = ["echo", "--endpoint", endpoint.as_str()];
    let r = ferry_within(&args, Duration::from_secs(60));
    server.join().expect("server");
    assert_eq!(r.code, Some(1), "stdout: {}\nstderr: {}", r.stdout, r.stderr);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{}", r.stderr);
    assert!(lines[0].starts_with("ferry: the peer ") && lines[0].contains("; "), "{}", lines[0]);
    assert_for_users(&r.stderr, &args);

    // Nobody on a shared-memory endpoint: said, with what to do.
    let args = ["echo", "--endpoint", "shm@ferry-cli-test-nobody-listens"];
    let r = ferry_within(&args, Duration::from_secs(60));
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    assert!(r.stderr.contains("; "), "{}", r.stderr);
    assert_for_users(&r.stderr, &args);
}

/// The commands a user may give, as `ferry --help` must list them.
const COMMANDS: [&str; 7] = ["demo", "bench", "echo", "cp", "block", "tls", "inspect"];

/// The lines of `--help` under `Commands:`, as (name, description).
fn listed_commands(help: &str) -> Vec<(String, String)> {
    help.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.trim().split_once(char::is_whitespace))
        .map(|(name, what)| (name.to_string(), what.trim().to_string()))
        .collect()
}

#[test]
fn help_lists_every_command_with_a_line_each() {
    let r = ferry(&["--help"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let listed = listed_commands(&r.stdout);
    for command in COMMANDS {
        let what = listed.iter().find(|(name, _)| name == command).map(|(_, what)| what);
        let what = what.unwrap_or_else(|| panic!("{command} is not listed:\n{}", r.stdout));
        assert!(what.len() > 15, "{command} has no description of its own: {what:?}");
    }
    // Nothing hidden (the benchmark children) is listed.
    assert!(listed.iter().all(|(name, _)| COMMANDS.contains(&name.as_str()) || name == "help"), "{listed:?}");
    // The package description, which crates.io and `cargo install` show,
    // names them too.
    let description = env!("CARGO_PKG_DESCRIPTION");
    for command in COMMANDS {
        assert!(description.contains(command), "{command} is not in the description: {description}");
    }
}

#[test]
fn an_unknown_command_names_every_command() {
    let r = ferry(&["frob"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    let line = r.stderr.trim_end();
    assert!(line.starts_with("ferry: frob: no such command; give "), "{line}");
    for command in COMMANDS {
        assert!(line.contains(command), "{command} is not named: {line}");
    }
    assert!(!line.contains("bench-child"), "{line}");
    assert_for_users(line, &["frob"]);
    // One level down the choices are that command's own.
    let r = ferry(&["tls", "frob"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    let line = r.stderr.trim_end();
    assert!(line.starts_with("ferry: frob: no such command; give gen "), "{line}");
    assert!(!line.contains("demo"), "{line}");
}
