//! `ferry inspect` against real processes: this test process is the source
//! of a shared-memory channel to a `ferry echo` process, and `ferry
//! inspect` (another process) reads both registry files while they run.
//!
//! Every Ferry process of this test binary (the binary itself and the
//! processes it starts) publishes in one directory of its own, named by
//! FERRY_INSPECT_DIR, set once before the first domain exists.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ferry::{Allocator, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints};
use serde_json::Value;

const T: Duration = Duration::from_secs(20);

/// The registry directory of this test binary (set in the environment
/// before anything of Ferry runs here; the children inherit it).
fn registry() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
        // The directories of earlier runs whose process is gone.
        for entry in std::fs::read_dir(base).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("inspect-").and_then(|p| p.parse::<u32>().ok()) {
                if !Path::new(&format!("/proc/{pid}")).exists() {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
        }
        let dir = base.join(format!("inspect-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // Only Rust code reads the environment in this binary, through
        // std, which serializes it with this write.
        std::env::set_var("FERRY_INSPECT_DIR", &dir);
        dir
    })
}

fn ferry_cmd() -> Command {
    registry();
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.stdin(Stdio::null());
    c
}

/// `ferry inspect --json ARGS…`, which must succeed.
fn inspect_json(args: &[&str]) -> Value {
    let out = ferry_cmd().arg("inspect").arg("--json").args(args).output().expect("run ferry inspect");
    assert!(out.status.success(), "ferry inspect {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON from ferry inspect")
}

/// The process `pid` in an inspection, if listed.
fn process(v: &Value, pid: u32) -> Option<&Value> {
    v["processes"].as_array()?.iter().find(|p| p["pid"] == pid)
}

/// The first channel end of domain `domain` of process `pid`.
fn channel(v: &Value, pid: u32, domain: &str) -> Option<Value> {
    let p = process(v, pid)?;
    let d = p["domains"].as_array()?.iter().find(|d| d["name"] == domain)?;
    d["channels"].as_array()?.first().cloned()
}

/// Inspect until `check` accepts what it sees (or fail after `T`).
fn inspect_until(args: &[&str], what: &str, mut check: impl FnMut(&Value) -> bool) -> Value {
    let end = Instant::now() + T;
    loop {
        let v = inspect_json(args);
        if check(&v) {
            return v;
        }
        assert!(Instant::now() < end, "ferry inspect never showed {what}; last:\n{v:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A shared-memory channel from a domain of this process to a `ferry echo`
/// process, its pool assigned.
struct Pipeline {
    tx: Channel,
    alloc: Allocator,
    echo: Child,
    _domain: Domain,
}

impl Pipeline {
    fn start(name: &str, queue_depth: u32, env: &[(&str, &str)]) -> Pipeline {
        registry();
        let domain = Domain::new(name);
        let sock = format!("ferry-inspect-{}-{name}", std::process::id());
        let setup = ChannelSetup { queue_depth, ..ChannelSetup::default() };
        let mut tx = Channel::create(&domain, &Endpoint::shm_abstract(&sock), setup).expect("create");
        let echo = ferry_cmd()
            .args(["echo", "--endpoint", &format!("shm@{sock}")])
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start ferry echo");
        tx.wait_connected(T).expect("the echo binds");
        let alloc = Allocator::new(&domain, 64, 4096, PoolConstraints::default()).expect("pool");
        tx.assign_pool_and_wait(alloc.pool(), T).expect("the echo accepts the pool");
        Pipeline { tx, alloc, echo, _domain: domain }
    }

    /// Move `n` buffers and take every one back.
    fn round_trips(&mut self, n: u64) {
        let (mut sent, mut back) = (0, 0);
        while back < n {
            while sent < n {
                let Some(buf) = self.alloc.alloc() else { break };
                match self.tx.move_buffer(buf, &[]) {
                    Ok(()) => sent += 1,
                    Err(r) if r.error == ferry::ErrorKind::QueueFull => break,
                    Err(r) => panic!("move: {}", r.error),
                }
            }
            match self.tx.wait(Some(T)) {
                Ok(Event::BufferPassed { .. }) => back += 1,
                other => panic!("expected a buffer back, got {other:?}"),
            }
        }
    }

    /// Close the channel; the echo's exit status and what it printed.
    fn finish(self) -> (std::process::ExitStatus, String) {
        let (status, out, _) = self.finish_with_stderr();
        (status, out)
    }

    /// [`finish`](Self::finish), with what the echo printed on stderr.
    fn finish_with_stderr(mut self) -> (std::process::ExitStatus, String, String) {
        self.tx.teardown().expect("teardown");
        while let Ok(ev) = self.tx.wait(Some(T)) {
            if matches!(ev, Event::Closed { .. }) {
                break;
            }
        }
        let out = self.echo.wait_with_output().expect("echo exits");
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

fn file_of(pid: u32) -> PathBuf {
    registry().join(format!("{pid}.ferry"))
}

#[test]
fn counts_seen_while_running_match_what_the_processes_report() {
    const N: u64 = 1000;
    let mut p = Pipeline::start("counting", 1024, &[]);
    let (me, echo) = (std::process::id(), p.echo.id());
    p.round_trips(N);
    let mine = p.tx.stats();
    assert_eq!((mine.sent.moves, mine.received.passes, mine.bytes_sent), (N, N, N * 4096));

    // While both run: the echo's counters, and ours as published.
    let v = inspect_until(&[], "every move and pass on both ends", |v| {
        let ours = channel(v, me, "counting");
        let theirs = channel(v, echo, "echo");
        ours.is_some_and(|c| c["sent"]["moves"] == N && c["received"]["passes"] == N)
            && theirs.is_some_and(|c| c["received"]["moves"] == N && c["sent"]["passes"] == N)
    });
    let ours = channel(&v, me, "counting").unwrap();
    let theirs = channel(&v, echo, "echo").unwrap();
    assert_eq!((ours["backend"].as_str(), ours["direction"].as_str()), (Some("shm"), Some("Tx")));
    assert_eq!(ours["peer"], format!("pid {echo}"));
    assert_eq!(theirs["peer"], format!("pid {me}"));
    assert_eq!((theirs["direction"].as_str(), theirs["state"].as_str()), (Some("Rx"), Some("Connected")));
    assert_eq!(ours["bytes_sent"], N * 4096);
    assert_eq!(theirs["bytes_received"], N * 4096);
    assert_eq!(ours["sent"]["pool_assigns"], 1);
    assert_eq!(theirs["received"]["pool_assigns"], 1);
    assert_eq!((ours["waiting"].as_u64(), theirs["waiting"].as_u64()), (Some(0), Some(0)));
    // Every buffer is back: the pool is all free here, held nowhere there.
    let pool = |pid: u32, domain: &str| {
        let p = process(&v, pid).unwrap();
        let d = p["domains"].as_array().unwrap().iter().find(|d| d["name"] == domain).unwrap();
        d["pools"][0].clone()
    };
    let (here, there) = (pool(me, "counting"), pool(echo, "echo"));
    assert_eq!(
        (here["free"].as_u64(), here["lent"].as_u64(), here["created_here"].as_bool()),
        (Some(64), Some(0), Some(true))
    );
    assert_eq!((there["in_use"].as_u64(), there["created_here"].as_bool()), (Some(0), Some(false)));
    assert_eq!(here["id"], there["id"]);
    assert_eq!(p.alloc.pool().stats().free, 64);

    // What the echo says at exit is what was inspected; its file is gone.
    let (status, out) = p.finish();
    assert!(status.success(), "{out}");
    assert_eq!(out.trim(), format!("echoed {}", theirs["sent"]["passes"]));
    assert!(!file_of(echo).exists(), "the echo's registry file outlived it");
    let v = inspect_json(&[]);
    assert!(process(&v, echo).is_none(), "{v:#}");
}

#[test]
fn a_killed_process_is_gone_from_the_inspection_within_a_second() {
    let mut p = Pipeline::start("killing", 1024, &[]);
    let echo = p.echo.id();
    p.round_trips(10);
    inspect_until(&[], "the echo", |v| channel(v, echo, "echo").is_some());
    // SIGKILL, and not reaped yet: a zombie counts as gone.
    p.echo.kill().expect("SIGKILL");
    let killed = Instant::now();
    let end = killed + Duration::from_secs(1);
    loop {
        let v = inspect_json(&[]);
        if process(&v, echo).is_none() {
            break;
        }
        assert!(Instant::now() < end, "killed process {echo} still listed after 1 s:\n{v:#}");
    }
    assert!(!file_of(echo).exists(), "the dead process's file was not swept");
    let out = ferry_cmd().args(["inspect", &echo.to_string()]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "inspecting a dead pid fails");
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("no Ferry process {echo}")));
    let _ = p.echo.wait();
    // Our end learns the echo died: an error event, counted.
    let end = Instant::now() + T;
    while p.tx.stats().errors == 0 && Instant::now() < end {
        let _ = p.tx.wait(Some(Duration::from_millis(100)));
    }
    assert_eq!(p.tx.stats().errors, 1);
}

fn signal(child: &Child, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    rustix::process::kill_process(pid, sig).expect("signal");
}

/// Stop the echo and fill the queue to it: our end is blocked, the echo
/// stops publishing, and both are flagged.
fn stall(p: &mut Pipeline) {
    // Published with what it received before it stops.
    let (echo, moved) = (p.echo.id(), p.tx.stats().sent.moves);
    inspect_until(&[], "the echo's channel", |v| {
        channel(v, echo, "echo").is_some_and(|c| c["received"]["moves"] == moved)
    });
    signal(&p.echo, rustix::process::Signal::STOP);
    let mut held = Vec::new();
    loop {
        let buf = p.alloc.alloc().expect("more buffers than the queue holds");
        match p.tx.move_buffer(buf, &[]) {
            Ok(()) => {}
            Err(r) if r.error == ferry::ErrorKind::QueueFull => {
                held.push(r.into_inner());
                break;
            }
            Err(r) => panic!("move: {}", r.error),
        }
    }
    assert!(p.tx.stats().blocked);
}

fn unstall(mut p: Pipeline) {
    signal(&p.echo, rustix::process::Signal::CONT);
    let end = Instant::now() + T;
    while p.alloc.available() < 64 && Instant::now() < end {
        let _ = p.tx.wait(Some(Duration::from_millis(100)));
    }
    let (status, _) = p.finish();
    assert!(status.success());
}

#[test]
fn a_stalled_sink_is_flagged() {
    let mut p = Pipeline::start("stalling", 8, &[]);
    let (me, echo) = (std::process::id(), p.echo.id());
    p.round_trips(20);
    stall(&mut p);
    let v = inspect_until(&[], "both ends stalled", |v| {
        let ours = channel(v, me, "stalling");
        let theirs = channel(v, echo, "echo");
        ours.is_some_and(|c| c["stalled"] == true) && theirs.is_some_and(|c| c["stalled"] == true)
    });
    let ours = channel(&v, me, "stalling").unwrap();
    assert_eq!(ours["blocked"], true);
    assert!(ours["stalled_why"].as_str().unwrap().contains("queue full"), "{ours:#}");
    assert_eq!((ours["queue_capacity"].as_u64(), ours["queue_high_water"].as_u64()), (Some(8), Some(8)));
    assert!(ours["queue_full"].as_u64().unwrap() >= 1);
    let theirs = channel(&v, echo, "echo").unwrap();
    assert!(theirs["stalled_why"].as_str().unwrap().contains("process stopped or hung"), "{theirs:#}");
    assert_eq!(process(&v, echo).unwrap()["publishing"], false);
    // The table says so too.
    let out = ferry_cmd().args(["inspect", &me.to_string()]).output().unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("STALLED: queue full"), "{table}");
    unstall(p);
    // Running again: nothing stalled any more.
    inspect_until(&[&me.to_string()], "the closed channel gone", |v| channel(v, me, "stalling").is_none());
}

#[test]
fn a_source_waiting_on_a_stopped_sink_is_flagged() {
    let mut p = Pipeline::start("waiting", 64, &[]);
    let (me, echo) = (std::process::id(), p.echo.id());
    p.round_trips(10);
    inspect_until(&[], "the echo's channel", |v| {
        channel(v, echo, "echo").is_some_and(|c| c["received"]["moves"] == 10)
    });
    signal(&p.echo, rustix::process::Signal::STOP);
    // A few moves, far from filling the queue: nothing is refused.
    for _ in 0..5 {
        p.tx.move_buffer(p.alloc.alloc().unwrap(), &[]).unwrap();
    }
    assert!(!p.tx.stats().blocked);
    let v = inspect_until(&[], "our end flagged", |v| channel(v, me, "waiting").is_some_and(|c| c["stalled"] == true));
    let ours = channel(&v, me, "waiting").unwrap();
    assert_eq!(ours["stalled_why"], "peer stopped or hung", "{ours:#}");
    assert_eq!(channel(&v, echo, "echo").unwrap()["waiting"], 5);
    // Shown alone, our process still has its peer looked at.
    let v = inspect_json(&[&me.to_string()]);
    assert!(process(&v, echo).is_none());
    assert_eq!(channel(&v, me, "waiting").unwrap()["stalled_why"], "peer stopped or hung", "{v:#}");
    unstall(p);
}

/// The screen shows a stalled row of ours in bold red (tmux renders the
/// attributes as separate sequences).
fn stalled_in_red(screen: &str) -> bool {
    screen.lines().any(|l| l.contains("watched") && l.contains("STALLED: queue full") && l.contains("31m"))
}

#[test]
fn watch_redraws_in_a_terminal_with_rates_and_stalled_rows() {
    if Command::new("tmux").arg("-V").output().is_err() {
        panic!("tmux is needed for this test (apt-get install tmux)");
    }
    let mut p = Pipeline::start("watched", 8, &[]);
    let me = std::process::id();
    p.round_trips(100);
    stall(&mut p);
    let session = format!("ferry-inspect-{me}");
    let cmd = format!(
        "FERRY_INSPECT_DIR={} {} inspect --watch --interval 0.3 {me}",
        registry().display(),
        env!("CARGO_BIN_EXE_ferry")
    );
    // A tmux server of the test's own, not the user's.
    let tmux = |args: &[&str]| Command::new("tmux").args(["-L", &session]).args(args).output().expect("tmux");
    let started = tmux(&["new-session", "-d", "-s", &session, "-x", "220", "-y", "30", &cmd]);
    assert!(started.status.success(), "{}", String::from_utf8_lossy(&started.stderr));
    let end = Instant::now() + T;
    let mut screen = String::new();
    let mut seen_rates = false;
    while Instant::now() < end {
        let cap = tmux(&["capture-pane", "-p", "-e", "-t", &session]);
        screen = String::from_utf8_lossy(&cap.stdout).into_owned();
        // The second redraw has rates (a number, not "-", in GB/s) and
        // the stalled row in bold red.
        seen_rates = screen.lines().any(|l| l.contains("watched") && l.contains(" 0.00 "));
        if seen_rates && stalled_in_red(&screen) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = tmux(&["kill-session", "-t", &session]);
    assert!(screen.contains("MOVES/s") && screen.contains("GB/s"), "{screen}");
    assert!(seen_rates, "no rates on the screen:\n{screen}");
    assert!(stalled_in_red(&screen), "{screen}");
    // Redrawn, not scrolled: the header is on the screen once.
    assert_eq!(screen.matches("ferry inspect:").count(), 1, "{screen}");
    unstall(p);
}

#[test]
fn garbage_registry_files_do_not_crash_the_inspector() {
    // A live process that is not Ferry, so its files are not swept.
    let mut sleeper = Command::new("sleep").arg("60").spawn().expect("sleep");
    let pid = sleeper.id();
    std::fs::create_dir_all(registry()).unwrap();
    let path = file_of(pid);
    let valid_header = |body_len: u32, gen: u64| {
        let mut h = vec![0u8; 64];
        h[..8].copy_from_slice(b"FERRYIN\0");
        h[8..12].copy_from_slice(&1u32.to_le_bytes());
        h[12..16].copy_from_slice(&64u32.to_le_bytes());
        h[16..24].copy_from_slice(&gen.to_le_bytes());
        h[24..28].copy_from_slice(&body_len.to_le_bytes());
        h[40..44].copy_from_slice(&pid.to_le_bytes());
        h
    };
    let mut huge = valid_header(u32::MAX, 2);
    huge.extend_from_slice(&[0xff; 100]);
    // A body whose checksum is right but whose counts are lies.
    let body = [0u8, 0, 250, 0, 0, 0, 0xff, 0xff, 1, 2, 3];
    let mut sum: u64 = 0xcbf2_9ce4_8422_2325;
    for b in body {
        sum = (sum ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let mut lying = valid_header(body.len() as u32, 2);
    lying[32..40].copy_from_slice(&sum.to_le_bytes());
    lying.extend_from_slice(&body);
    let mut short = valid_header(1000, 2);
    short.extend_from_slice(&[0; 100]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("text", b"hello, this is not a registry file\n".repeat(50)),
        ("random", (0..4096u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect()),
        ("truncated header", valid_header(0, 2)[..30].to_vec()),
        ("huge body length", huge),
        ("forever odd generation", valid_header(0, 3)),
        ("lying counts", lying),
        ("body shorter than its header says", short),
    ];
    for (what, bytes) in cases {
        std::fs::write(&path, &bytes).unwrap();
        let v = inspect_json(&[]);
        let listed = process(&v, pid).unwrap_or_else(|| panic!("{what}: not listed:\n{v:#}"));
        assert!(listed["error"].is_string(), "{what}: {listed:#}");
        for args in [vec!["inspect"], vec!["inspect", "--watch", "--count", "1", "--interval", "0.1"]] {
            let out = ferry_cmd().args(&args).output().unwrap();
            assert!(out.status.success(), "{what} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
            assert!(String::from_utf8_lossy(&out.stdout).contains("unreadable registry file"), "{what}");
        }
    }
    // A symbolic link in place of a file is not followed, even to a file
    // that would read well.
    let body = [1u8, 0, b'x', 250, 0, 0, 0, 0, 0];
    let mut sum: u64 = 0xcbf2_9ce4_8422_2325;
    for b in body {
        sum = (sum ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let mut valid = valid_header(body.len() as u32, 2);
    valid[32..40].copy_from_slice(&sum.to_le_bytes());
    valid.extend_from_slice(&body);
    std::fs::write(&path, &valid).unwrap();
    assert_eq!(process(&inspect_json(&[]), pid).unwrap()["name"], "x", "the well-formed file reads");
    let elsewhere = registry().join(format!("{pid}.elsewhere"));
    std::fs::rename(&path, &elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
    let v = inspect_json(&[]);
    assert!(process(&v, pid).unwrap()["error"].is_string(), "{v:#}");
    std::fs::remove_file(&elsewhere).unwrap();
    // Written by an earlier process with the same pid (another start
    // time): stale, swept although the pid runs.
    std::fs::remove_file(&path).unwrap();
    let mut earlier = valid.clone();
    earlier[48..56].copy_from_slice(&1u64.to_le_bytes());
    std::fs::write(&path, &earlier).unwrap();
    let v = inspect_json(&[]);
    assert!(process(&v, pid).is_none(), "{v:#}");
    assert!(!path.exists(), "a file of an earlier process with this pid was not swept");
    // Once its process is gone, the file is swept.
    std::fs::write(&path, b"garbage").unwrap();
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    let v = inspect_json(&[]);
    assert!(process(&v, pid).is_none());
    assert!(!path.exists(), "a dead process's garbage file was not swept");
}

#[test]
fn ferry_inspect_0_writes_nothing() {
    for (on, env) in [(true, "1"), (false, "0")] {
        let dir = registry().with_file_name(format!("inspect-off-{}-{on}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let d = dir.to_str().unwrap();
        let mut p = Pipeline::start(
            if on { "publishing" } else { "quiet" },
            64,
            &[("FERRY_INSPECT", env), ("FERRY_INSPECT_DIR", d)],
        );
        p.round_trips(10);
        let echo = p.echo.id();
        let file = dir.join(format!("{echo}.ferry"));
        if on {
            // The echo publishes within a few of its intervals.
            let end = Instant::now() + T;
            while !file.exists() {
                assert!(Instant::now() < end, "FERRY_INSPECT=1: no file in {d}");
                std::thread::sleep(Duration::from_millis(20));
            }
        } else {
            // Give it the time of several publications: still nothing.
            std::thread::sleep(Duration::from_millis(1200));
            assert!(!dir.exists(), "FERRY_INSPECT=0 made {d}");
        }
        let (status, out) = p.finish();
        assert!(status.success());
        assert_eq!(out.trim(), "echoed 10");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn an_unusable_registry_directory_does_not_stop_the_process() {
    // Readable by others: not a directory Ferry publishes in.
    let open = registry().with_file_name(format!("inspect-open-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&open);
    std::fs::create_dir_all(&open).unwrap();
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    // A file where the directory should be.
    let file = registry().with_file_name(format!("inspect-file-{}", std::process::id()));
    std::fs::write(&file, b"").unwrap();
    for dir in [&open, &file] {
        let d = dir.to_str().unwrap();
        let mut p = Pipeline::start("unpublished", 64, &[("FERRY_INSPECT_DIR", d)]);
        p.round_trips(50);
        let (status, out, err) = p.finish_with_stderr();
        assert!(status.success(), "{d}: {err}");
        assert_eq!(out.trim(), "echoed 50");
        // Said once, however many domains and channels the process made.
        assert_eq!(err.matches("inspection registry is off").count(), 1, "{d}: {err}");
    }
    assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0, "published in a directory others can read");
    let _ = std::fs::remove_dir_all(&open);
    let _ = std::fs::remove_file(&file);
}

#[test]
fn extreme_but_well_formed_snapshots_do_not_crash_the_inspector() {
    use ferry::inspect::{encode, ChannelSnapshot, DomainSnapshot, PoolSnapshot, ProcessSnapshot};
    use ferry::{ChannelStats, OpCounts, PoolStats};
    // Two live processes that are not Ferry, naming each other as peers.
    let a = Command::new("sleep").arg("60").spawn().expect("sleep");
    let b = Command::new("sleep").arg("60").spawn().expect("sleep");
    std::fs::create_dir_all(registry()).unwrap();
    let max = OpCounts {
        moves: u64::MAX,
        passes: u64::MAX,
        copies: u64::MAX,
        releases: u64::MAX,
        pool_assigns: u64::MAX,
        pool_removes: u64::MAX,
        aggregates: u64::MAX,
    };
    let stats = ChannelStats {
        sent: max,
        received: max,
        bytes_sent: u64::MAX,
        bytes_received: u64::MAX,
        queue_capacity: u32::MAX,
        queue_depth: u32::MAX,
        queue_high_water: u32::MAX,
        queue_full: u64::MAX,
        blocked: true,
        wakeups: u64::MAX,
        errors: u64::MAX,
    };
    for (me, peer) in [(&a, &b), (&b, &a)] {
        let chan = ChannelSnapshot {
            key: u64::MAX,
            backend: "shm".into(),
            endpoint: "\u{1b}[2J\u{7f}é".repeat(100),
            peer: format!("pid {}", peer.id()),
            role: String::new(),
            direction: "Sideways".into(),
            trust: "?".into(),
            state: "Connected".into(),
            stats,
        };
        let pool = PoolSnapshot {
            id: u128::MAX,
            buffers: u32::MAX,
            buffer_size: u64::MAX,
            created_here: true,
            trust: String::new(),
            stats: PoolStats { free: u32::MAX, in_use: u32::MAX, lent: u32::MAX, copies_held: 0, copies_out: u32::MAX },
        };
        let snap = ProcessSnapshot {
            pid: me.id(),
            start_time: 0,
            taken_at_ms: u64::MAX,
            generation: u64::MAX,
            name: "x".repeat(1000),
            interval_ms: u32::MAX,
            domains: vec![DomainSnapshot {
                id: 0,
                name: String::new(),
                pools: vec![pool],
                channels: vec![chan.clone(), chan],
            }],
        };
        std::fs::write(file_of(me.id()), encode(&snap)).unwrap();
    }
    let v = inspect_json(&[]);
    for p in [&a, &b] {
        let listed = process(&v, p.id()).unwrap_or_else(|| panic!("{} not listed:\n{v:#}", p.id()));
        assert_eq!(listed["domains"][0]["channels"].as_array().unwrap().len(), 2, "{listed:#}");
    }
    for args in [
        vec!["inspect".to_string()],
        vec!["inspect".into(), a.id().to_string()],
        vec!["inspect".into(), "--watch".into(), "--count".into(), "2".into(), "--interval".into(), "0.1".into()],
        vec![
            "inspect".into(),
            "--watch".into(),
            "--json".into(),
            "--count".into(),
            "2".into(),
            "--interval".into(),
            "0.1".into(),
        ],
    ] {
        let out = ferry_cmd().args(&args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    for mut p in [a, b] {
        p.kill().unwrap();
        p.wait().unwrap();
        let _ = std::fs::remove_file(file_of(p.id()));
    }
}
