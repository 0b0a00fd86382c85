//! Data paths across processes and machines' sockets: A → B → C, where B
//! forwards every pool it is offered to C (`forward_pool`) and every buffer
//! after it; C checks and passes back, B passes back to A. Over shm, B is a
//! real child process (this test binary run again, `path_child`); over TCP
//! the three domains are threads joined by loopback sockets. A path whose
//! far end never gives buffers back stops at its quota, alone.

mod support;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{
    BindParams, Channel, ChannelSetup, DataPath, Direction, Domain, Endpoint, ErrorKind, Event, PathConfig, PathQuota,
    PoolPolicy, Role,
};
use support::payload::{check, fill};

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 64 << 10;
const ROUNDS: u64 = 20;

/// B, the middle of the path: forward pools and buffers from `ab` to `bc`,
/// pass buffers coming back from `bc` back on `ab`; `hold` keeps every
/// buffer instead (a domain that never frees). Until `ab` closes.
fn middle(mut ab: Channel, mut bc: Channel, hold: bool) {
    let mut kept = Vec::new();
    loop {
        let Ok((i, ev)) = ferry::wait_any(&mut [&mut ab, &mut bc], Some(Duration::from_secs(30))) else {
            panic!("middle: nothing happened for 30 s")
        };
        match (i, ev) {
            (0, Event::PoolAssignRequest(req)) => {
                ferry::forward_pool(&mut ab, req.pool, &mut [&mut bc], T).expect("forward the pool")
            }
            (0, Event::MoveReceived { buffer, meta }) if hold => {
                let _ = meta;
                kept.push(buffer)
            }
            (0, Event::MoveReceived { buffer, meta }) => bc.move_buffer(buffer, &meta).expect("forward"),
            (1, Event::BufferPassed { buffer, meta }) => ab.pass(buffer, &meta).expect("back to A"),
            (0, Event::Closed { .. }) => break,
            (0, Event::Error(err)) if err == ErrorKind::PeerGone => break,
            (_, Event::BindRequest { .. } | Event::Bound | Event::PoolAssigned(_) | Event::PoolRemoved(_)) => {}
            (i, ev) => panic!("middle: channel {i}: {ev:?}"),
        }
    }
    drop(kept);
}

/// C, the end of the path: accept pools, check each buffer, pass it back.
fn end_of_path(mut bc: Channel) -> u64 {
    bc.set_pool_policy(PoolPolicy::AcceptAll);
    let mut n = 0;
    loop {
        match bc.wait(Some(Duration::from_secs(30))) {
            Ok(Event::MoveReceived { buffer, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                assert!(check(&buffer, seq), "sink: buffer {seq} arrived corrupted");
                bc.pass(buffer, &meta).unwrap();
                n += 1;
            }
            Ok(Event::BindRequest { .. } | Event::Bound | Event::PoolAssignRequest(_) | Event::PoolRemoved(_)) => {}
            Err(_) => return n,
            Ok(Event::Closed { .. }) => return n,
            Ok(Event::Error(err)) if err == ErrorKind::PeerGone => return n,
            other => panic!("sink: {other:?}"),
        }
    }
}

/// The middle process: binds to A's endpoint and to C's.
#[test]
#[ignore = "run as a child process by the other tests"]
fn path_child() {
    let (Ok(ab), Ok(bc), Ok(role)) =
        (std::env::var("FERRY_PATH_AB"), std::env::var("FERRY_PATH_BC"), std::env::var("FERRY_PATH_ROLE"))
    else {
        return;
    };
    let b = Domain::new("b");
    let ab = Channel::connect(&b, &Endpoint::shm_abstract(&ab), BindParams::default(), T).expect("bind to a");
    let bc = Channel::connect(&b, &Endpoint::shm_abstract(&bc), BindParams::default(), T).expect("bind to c");
    middle(ab, bc, role == "hold");
}

fn spawn_middle(ab: &str, bc: &str, role: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "path_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env("FERRY_PATH_AB", ab)
        .env("FERRY_PATH_BC", bc)
        .env("FERRY_PATH_ROLE", role)
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn the middle")
}

/// A: `rounds` buffers along the path and back, each checked; the path
/// makes one pool and never another.
fn originate(path: &mut DataPath<Channel>, rounds: u64) {
    for seq in 0..rounds {
        let mut buf = path.alloc().unwrap();
        fill(buf.as_mut_slice().unwrap(), seq);
        path.channel_mut(0).move_buffer(buf, &seq.to_le_bytes()).unwrap();
        let deadline = Instant::now() + T;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match path.channel_mut(0).wait(Some(left)) {
                Ok(Event::BufferPassed { buffer, meta }) => {
                    assert_eq!(meta[..8], seq.to_le_bytes());
                    assert!(check(&buffer, seq));
                    break;
                }
                Ok(Event::PoolAssigned(_)) => {}
                other => panic!("originator: {other:?}"),
            }
        }
    }
    assert_eq!(path.pool_ids().len(), 1, "one pool, reused: nothing mapped after the first transfer");
}

fn config(max_pools: u32) -> PathConfig {
    PathConfig::new(SIZE, 2, PathQuota { max_pools, max_bytes: 64 << 20 })
}

fn shm_setup(direction: Direction, role: Role) -> ChannelSetup {
    ChannelSetup { direction, role, ..ChannelSetup::default() }
}

/// A (this process) → B (a child process) → C (this process, another
/// domain): A's pool reaches C through B's forwarding (the memfd travels
/// on), and buffers go the whole way and back.
#[test]
fn a_path_through_another_process_shm() {
    let (ab, bc) = (support::unique_name("path-ab"), support::unique_name("path-bc"));
    let a = Domain::new("a");
    let c = Domain::new("c");
    let tx = Channel::create(&a, &Endpoint::shm_abstract(&ab), shm_setup(Direction::Tx, Role::Master)).unwrap();
    let rx = Channel::create(&c, &Endpoint::shm_abstract(&bc), shm_setup(Direction::Rx, Role::Slave)).unwrap();
    let mut child = spawn_middle(&ab, &bc, "forward");
    let sink = std::thread::spawn(move || end_of_path(rx));
    let mut tx = tx;
    tx.wait_connected(T).unwrap();
    let mut path = DataPath::new(&a, vec![tx], config(2)).unwrap();
    originate(&mut path, ROUNDS);
    let pool = path.pool_ids()[0];
    assert!(c.pools().contains(&pool), "the pool reached C through B");
    drop(path);
    assert!(support::payload::wait_exit(&mut child, T).success());
    assert_eq!(sink.join().unwrap(), ROUNDS);
}

/// The same path over TCP, each hop its own socket: B forwards the pool
/// (its mirror) to C, which makes a mirror of its own.
#[test]
fn a_path_over_tcp() {
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let (b, c) = (Domain::new("b"), Domain::new("c"));
    let a = Domain::new("a");
    let a_tx = Channel::create(&a, &Endpoint::tcp(loopback), shm_setup(Direction::Tx, Role::Master)).unwrap();
    let c_rx = Channel::create(&c, &Endpoint::tcp(loopback), shm_setup(Direction::Rx, Role::Slave)).unwrap();
    let (ab, bc) = (a_tx.listen_addr().unwrap(), c_rx.listen_addr().unwrap());
    let mid = std::thread::spawn(move || {
        let ab = Channel::connect(&b, &Endpoint::tcp(ab), BindParams::default(), T).unwrap();
        let bc = Channel::connect(&b, &Endpoint::tcp(bc), BindParams::default(), T).unwrap();
        middle(ab, bc, false);
    });
    let sink = std::thread::spawn(move || end_of_path(c_rx));
    let mut a_tx = a_tx;
    a_tx.wait_connected(T).unwrap();
    let mut path = DataPath::new(&a, vec![a_tx], config(2)).unwrap();
    originate(&mut path, ROUNDS);
    assert!(c.pools().contains(&path.pool_ids()[0]), "the pool reached C through B");
    drop(path);
    mid.join().unwrap();
    assert_eq!(sink.join().unwrap(), ROUNDS);
}

/// B never gives a buffer back: A's path grows to its quota (2 pools of 2
/// buffers), then refuses with QuotaExceeded — while another path of the
/// same domain, over a local channel, goes on working.
#[test]
fn a_domain_that_never_frees_exhausts_only_its_path_quota() {
    let (ab, bc) = (support::unique_name("quota-ab"), support::unique_name("quota-bc"));
    let a = Domain::new("a");
    let c = Domain::new("c");
    let tx = Channel::create(&a, &Endpoint::shm_abstract(&ab), shm_setup(Direction::Tx, Role::Master)).unwrap();
    let rx = Channel::create(&c, &Endpoint::shm_abstract(&bc), shm_setup(Direction::Rx, Role::Slave)).unwrap();
    let mut child = spawn_middle(&ab, &bc, "hold");
    let sink = std::thread::spawn(move || end_of_path(rx));
    let mut tx = tx;
    tx.wait_connected(T).unwrap();
    let mut path = DataPath::new(&a, vec![tx], config(2)).unwrap();
    for seq in 0..4u64 {
        let mut buf = path.alloc().unwrap();
        fill(buf.as_mut_slice().unwrap(), seq);
        path.channel_mut(0).move_buffer(buf, &seq.to_le_bytes()).unwrap();
    }
    let e = path.alloc().unwrap_err();
    assert_eq!(e, ErrorKind::QuotaExceeded { pools: 2, max_pools: 2, max_bytes: 64 << 20 });
    assert_eq!((path.pool_ids().len(), path.bytes()), (2, 2 * 2 * SIZE as u64));

    // Another path of the same domain is not affected.
    let ep = Endpoint::local();
    let other_sink = {
        let ep = ep.clone();
        std::thread::spawn(move || {
            let rx = Channel::connect(&Domain::new("d"), &ep, BindParams::default(), T).unwrap();
            end_of_path(rx)
        })
    };
    let local = Channel::accept(&a, &ep, ChannelSetup::default(), T).unwrap();
    let mut other = DataPath::new(&a, vec![local], config(1)).unwrap();
    originate(&mut other, 5);
    drop(other);
    assert_eq!(other_sink.join().unwrap(), 5);
    assert!(
        matches!(path.alloc().as_ref().map_err(|e| e.kind()), Err(ErrorKind::QuotaExceeded { .. })),
        "still refused: nothing came back"
    );
    drop(path);
    assert!(support::payload::wait_exit(&mut child, T).success());
    assert_eq!(sink.join().unwrap(), 0);
}
