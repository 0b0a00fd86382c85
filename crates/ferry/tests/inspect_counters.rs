//! `Channel::stats`, `Pool::stats` and `Domain::stats` after each kind of
//! operation, and the registry file of this process read back.

use std::time::Duration;

use ferry::inspect;
use ferry::{
    Aggregate, Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, ErrorKind, Event, OpCounts,
    PoolConstraints, PoolPolicy, PoolStats,
};

const T: Duration = Duration::from_secs(10);

fn pair(a: &Domain, b: &Domain, depth: u32) -> (Channel, Channel) {
    let ep = Endpoint::local();
    let setup = ChannelSetup { queue_depth: depth, ..ChannelSetup::default() };
    let mut tx = Channel::create(a, &ep, setup).unwrap();
    let mut rx = Channel::bind(b, &ep, BindParams::default()).unwrap();
    tx.wait_connected(T).unwrap();
    rx.wait_connected(T).unwrap();
    rx.set_pool_policy(PoolPolicy::AcceptAndReport);
    (tx, rx)
}

/// Assign `alloc`'s pool from `tx` (one thread plays both ends).
fn assign(tx: &mut Channel, rx: &mut Channel, alloc: &Allocator) {
    tx.assign_pool(alloc.pool()).unwrap();
    assert!(matches!(next(rx), Event::PoolAssignRequest(_)));
    assert!(matches!(next(tx), Event::PoolAssigned(_)));
}

fn next(ch: &mut Channel) -> Event {
    ch.wait(Some(T)).expect("an event")
}

#[test]
fn every_kind_of_operation_is_counted_on_both_ends() {
    let (a, b) = (Domain::new("counting-a"), Domain::new("counting-b"));
    let (mut tx, mut rx) = pair(&a, &b, 4);
    let alloc = Allocator::new(&a, 8, 4096, PoolConstraints::default()).unwrap();
    assign(&mut tx, &mut rx, &alloc);
    let pool = alloc.pool().id();

    // A move: lent by a, in use at b.
    tx.move_buffer(alloc.alloc().unwrap(), &[]).unwrap();
    let Event::MoveReceived { buffer, .. } = next(&mut rx) else { panic!() };
    assert_eq!(alloc.pool().stats(), PoolStats { free: 7, in_use: 0, lent: 1, copies_held: 0, copies_out: 0 });
    let at_b = b.stats().pools.into_iter().find(|p| p.0 == pool).unwrap().2;
    assert_eq!(at_b, PoolStats { free: 0, in_use: 1, lent: 0, copies_held: 0, copies_out: 0 });
    rx.pass(buffer, &[]).unwrap();
    let Event::BufferPassed { buffer, .. } = next(&mut tx) else { panic!() };
    drop(buffer);

    // A copy and its release.
    let kept = alloc.alloc().unwrap();
    tx.copy(&kept, &[]).unwrap();
    let Event::CopyReceived { copy, .. } = next(&mut rx) else { panic!() };
    assert_eq!(alloc.pool().stats(), PoolStats { free: 7, in_use: 1, lent: 0, copies_held: 0, copies_out: 1 });
    let at_b = b.stats().pools.into_iter().find(|p| p.0 == pool).unwrap().2;
    assert_eq!(at_b.copies_held, 1);
    rx.release(copy).unwrap();
    assert!(matches!(next(&mut tx), Event::CopyReleased { writable: true, .. }));
    assert_eq!(alloc.pool().stats().copies_out, 0);
    drop(kept);

    // An aggregate of one moved member.
    let agg = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"abc").unwrap();
    tx.send_aggregate(agg, &[]).unwrap();
    let Event::Aggregate { agg, .. } = next(&mut rx) else { panic!() };
    drop(agg);

    // A full queue: refused, counted, blocked until a send goes.
    let mut refused = None;
    for _ in 0..5 {
        match tx.move_buffer(alloc.alloc().unwrap(), &[]) {
            Ok(()) => {}
            Err(r) => {
                assert_eq!(r.error, ErrorKind::QueueFull);
                refused = Some(r.into_inner());
                break;
            }
        }
    }
    let refused = refused.expect("a queue of 4 refuses the fifth move");
    let s = tx.stats();
    assert!(s.blocked);
    assert_eq!((s.queue_full, s.queue_capacity, s.queue_depth, s.queue_high_water), (1, 4, 4, 4));
    while let Some(ev) = rx.poll() {
        if let Event::MoveReceived { buffer, .. } = ev {
            rx.pass(buffer, &[]).unwrap();
        }
    }
    tx.move_buffer(refused, &[]).unwrap();
    assert!(!tx.stats().blocked);
    assert!(matches!(next(&mut rx), Event::MoveReceived { .. }));

    let s = tx.stats();
    // Moves: one, the aggregate's member, four, the refused one again.
    assert_eq!(s.sent, OpCounts { moves: 7, copies: 1, pool_assigns: 1, aggregates: 1, ..OpCounts::default() });
    assert_eq!(s.received, OpCounts { passes: 1, releases: 1, ..OpCounts::default() });
    assert_eq!(s.bytes_sent, 8 * 4096);
    let r = rx.stats();
    assert_eq!(r.received, OpCounts { moves: 7, copies: 1, pool_assigns: 1, aggregates: 1, ..OpCounts::default() });
    assert_eq!(r.sent, OpCounts { passes: 1 + 4, releases: 1, ..OpCounts::default() });
    assert_eq!(r.bytes_received, 8 * 4096);
    assert_eq!((s.errors, r.errors), (0, 0));

    // Waiting with nothing to come: one sleep, counted.
    let before = rx.stats().wakeups;
    assert_eq!(rx.wait(Some(Duration::from_millis(20))).unwrap_err(), ferry::WaitError::TimedOut);
    assert!(rx.stats().wakeups > before);
}

#[test]
fn pool_removal_and_errors_are_counted() {
    let (a, b) = (Domain::new("removing-a"), Domain::new("removing-b"));
    let (mut tx, mut rx) = pair(&a, &b, 16);
    let alloc = Allocator::new(&a, 2, 4096, PoolConstraints::default()).unwrap();
    assign(&mut tx, &mut rx, &alloc);
    tx.remove_pool(alloc.pool().id()).unwrap();
    assert!(matches!(next(&mut rx), Event::PoolRemoved(_)));
    assert!(matches!(next(&mut tx), Event::PoolRemoved(_)));
    assert_eq!((tx.stats().sent.pool_removes, rx.stats().received.pool_removes), (1, 1));
    // The peer goes away mid-channel: an error event, counted.
    drop(rx);
    drop(b);
    assert_eq!(tx.stats().errors, 0);
    assert!(matches!(next(&mut tx), Event::Error(e) if e == ErrorKind::PeerGone));
    assert_eq!(tx.stats().errors, 1);
}

#[test]
fn this_process_registry_file_holds_its_channels() {
    if std::env::var_os("FERRY_INSPECT").is_some_and(|v| v == "0") {
        return;
    }
    let (a, b) = (Domain::new("registry-a"), Domain::new("registry-b"));
    let (mut tx, mut rx) = pair(&a, &b, 8);
    let alloc = Allocator::new(&a, 4, 8192, PoolConstraints::default()).unwrap();
    assign(&mut tx, &mut rx, &alloc);
    tx.move_buffer(alloc.alloc().unwrap(), b"").unwrap();
    assert!(matches!(next(&mut rx), Event::MoveReceived { .. }));
    assert!(inspect::publish_now());
    let path = inspect::registry_dir().join(format!("{}.ferry", std::process::id()));
    let snap = inspect::read_file(&path).expect("our registry file");
    assert_eq!(snap.pid, std::process::id());
    let d = snap.domains.iter().find(|d| d.name == "registry-a").expect("domain a");
    assert_eq!(d.channels.len(), 1);
    let c = &d.channels[0];
    assert_eq!((c.backend.as_str(), c.direction.as_str(), c.state.as_str()), ("local", "Tx", "Connected"));
    assert_eq!(c.stats, tx.stats());
    assert_eq!(d.pools.len(), 1);
    assert_eq!(d.pools[0].id, alloc.pool().id().as_u128());
    assert_eq!((d.pools[0].buffers, d.pools[0].buffer_size), (4, 8192));
    assert_eq!(d.pools[0].stats, alloc.pool().stats());
    // A dropped channel leaves the next snapshot.
    drop(tx);
    assert!(inspect::publish_now());
    let snap = inspect::read_file(&path).unwrap();
    let d = snap.domains.iter().find(|d| d.name == "registry-a").unwrap();
    assert!(d.channels.is_empty());
}

// ------------------------------------------- the registry in processes of its own

/// Run the ignored test `name` of this binary as a process of its own,
/// publishing in a fresh registry directory, and check that it succeeds
/// within `limit` (killed and failed after).
fn run_alone(name: &str, limit: Duration) {
    let dir = std::env::temp_dir().join(format!("ferry-inspect-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--ignored", "--nocapture", "--test-threads=1"])
        .env("FERRY_INSPECT_DIR", &dir)
        .env_remove("FERRY_INSPECT")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("run the test binary again");
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_dir_all(&dir);
            panic!("{name} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "{name}: {status}");
}

/// Whether a thread of this process is the registry's.
fn registry_thread_runs() -> bool {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .any(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).is_ok_and(|c| c.trim_end() == "ferry-inspect"))
}

#[test]
fn the_registry_starts_with_the_first_channel_not_with_buffers() {
    if std::env::var_os("FERRY_INSPECT").is_some_and(|v| v == "0") {
        return;
    }
    run_alone("registry_start_child", Duration::from_secs(120));
}

/// A process that only uses domains, pools and buffers runs no registry
/// thread and writes no file; its first channel starts both.
#[test]
#[ignore = "run as a process of its own by the_registry_starts_with_the_first_channel_not_with_buffers"]
fn registry_start_child() {
    let path = inspect::registry_dir().join(format!("{}.ferry", std::process::id()));
    let (a, b) = (Domain::new("buffers-a"), Domain::new("buffers-b"));
    let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default()).unwrap();
    let mut buf = alloc.alloc().unwrap();
    buf.as_mut_slice().unwrap()[0] = 1;
    drop(buf);
    assert_eq!(alloc.pool().stats().free, 4);
    assert!(!registry_thread_runs(), "a registry thread without a channel");
    assert!(!path.exists(), "a registry file without a channel");
    assert!(!inspect::publish_now());

    let (mut tx, mut rx) = pair(&a, &b, 4);
    assign(&mut tx, &mut rx, &alloc);
    // The thread names itself once it runs.
    let deadline = std::time::Instant::now() + T;
    while !registry_thread_runs() {
        assert!(std::time::Instant::now() < deadline, "no registry thread after the first channel");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(inspect::publish_now());
    let snap = inspect::read_file(&path).expect("the registry file");
    let names: Vec<&str> = snap.domains.iter().map(|d| d.name.as_str()).collect();
    assert!(names.contains(&"buffers-a") && names.contains(&"buffers-b"), "{names:?}");
}

#[test]
fn a_forked_child_is_not_held_by_the_registry_of_its_parent() {
    if std::env::var_os("FERRY_INSPECT").is_some_and(|v| v == "0") {
        return;
    }
    run_alone("fork_child", Duration::from_secs(300));
}

/// Forks while the registry's thread and another thread publish without
/// pause (each holds the registry's locks much of the time): every child
/// makes a domain and a channel, which must not wait on a lock a thread of
/// its parent held at the fork (the child has no such thread to release
/// it).
#[test]
#[ignore = "run as a process of its own by a_forked_child_is_not_held_by_the_registry_of_its_parent"]
fn fork_child() {
    const FORKS: usize = 100;
    const CHILD_LIMIT: Duration = Duration::from_secs(20);
    let (a, b) = (Domain::new("parent-a"), Domain::new("parent-b"));
    let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default()).unwrap();
    let mut pairs: Vec<(Channel, Channel)> = (0..20).map(|_| pair(&a, &b, 4)).collect();
    let (tx, rx) = &mut pairs[0];
    assign(tx, rx, &alloc);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                assert!(inspect::publish_now());
            }
        })
    };
    for n in 0..FORKS {
        // SAFETY: the child runs only `forked_work` (no lock it shares
        // with the parent's threads is the point of the test) and leaves
        // with `_exit`, without the parent's exit handlers or unwinding.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let ok = std::panic::catch_unwind(forked_work).unwrap_or(false);
            // SAFETY: ends the forked child at once, as it must.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let deadline = std::time::Instant::now() + CHILD_LIMIT;
        let mut status = 0;
        loop {
            // SAFETY: a plain waitpid on our own child, status into a local.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            assert!(r >= 0, "waitpid: {}", std::io::Error::last_os_error());
            if r == pid {
                break;
            }
            if std::time::Instant::now() > deadline {
                // SAFETY: kill and reap our own child, which is stuck.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                panic!("forked child {n} did not make its domain and channel within {CHILD_LIMIT:?}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "forked child {n}: status {status:#x}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    busy.join().unwrap();
    drop(pairs);
}

/// What a forked child does: a domain, a channel to itself, its own
/// registry file with them.
fn forked_work() -> bool {
    let (c, d) = (Domain::new("forked-c"), Domain::new("forked-d"));
    let (tx, _rx) = pair(&c, &d, 4);
    if !inspect::publish_now() {
        return false;
    }
    let path = inspect::registry_dir().join(format!("{}.ferry", std::process::id()));
    let Ok(snap) = inspect::read_file(&path) else { return false };
    let channels: usize = snap.domains.iter().map(|d| d.channels.len()).sum();
    drop(tx);
    snap.pid == std::process::id() && channels == 2 && snap.domains.iter().all(|d| d.name.starts_with("forked-"))
}
