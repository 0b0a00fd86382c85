//! Setup against hostile or stalled peers, written here with raw sockets and
//! fds: doorbells that are not eventfds, connections that never ask or never
//! answer, and peers that announce more pools (or larger ones) than a
//! channel's limits allow. Nothing may hang: every wait is bounded, and a
//! legitimate peer must still get through.

mod support;

use std::io::{Read, Write};
use std::mem::MaybeUninit;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ferry::{
    BindParams, Channel, ChannelLimits, ChannelSetup, ChannelState, Direction, Domain, Endpoint, ErrorKind, Event,
    Role, TrustLevel, WaitError,
};
use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

const T: Duration = Duration::from_secs(10);

// ------------------------------------------------------------ raw helpers

/// Run `body` on a thread of its own and fail if it does not finish within
/// `within`: a hang (a ring blocked on a peer's fd, a setup waiting for a
/// silent peer) is a failure, not a stuck test. The stuck thread is left
/// behind; the test process ends anyway.
fn bounded(within: Duration, body: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        body();
        let _ = tx.send(());
    });
    match rx.recv_timeout(within) {
        Ok(()) => h.join().unwrap(),
        // The body panicked: report its panic.
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(e) = h.join() {
                std::panic::resume_unwind(e);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("hung: not done within {within:?}"),
    }
}

/// A bind request as a binder sends it: generic role, any trust, the
/// largest meta size, no constraints.
fn bind_request() -> Vec<u8> {
    let mut v = b"FRY1".to_vec();
    v.extend_from_slice(&[1, 0, 255]);
    v.extend_from_slice(&224u16.to_le_bytes());
    v.extend_from_slice(&[0u8; 24]);
    v
}

/// A creator's acceptance: the binder is an RX slave of a trust FULL
/// channel with 16 bytes of meta and queues of `depth`.
fn bind_accept(depth: u32) -> Vec<u8> {
    let mut v = b"FRY1".to_vec();
    v.extend_from_slice(&[2, 1, 2, 1, 3]);
    v.extend_from_slice(&16u16.to_le_bytes());
    v.extend_from_slice(&depth.to_le_bytes());
    v.extend_from_slice(&[0u8; 24]);
    v
}

/// A setup message as TCP carries it: its length (with the peer timeout),
/// the message, and a peer timeout of 10 s.
fn tcp_framed(msg: &[u8]) -> Vec<u8> {
    let mut v = ((msg.len() + 4) as u16).to_le_bytes().to_vec();
    v.extend_from_slice(msg);
    v.extend_from_slice(&10_000u32.to_le_bytes());
    v
}

fn seqpacket() -> OwnedFd {
    rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap()
}

fn raw_connect(name: &str) -> OwnedFd {
    use rustix::net::sockopt::{set_socket_timeout, Timeout};
    let fd = seqpacket();
    // A listener whose queue is full makes connect wait: not forever.
    set_socket_timeout(&fd, Timeout::Send, Some(T)).unwrap();
    rustix::net::connect(&fd, &SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap()).unwrap();
    fd
}

fn raw_listen(name: &str) -> OwnedFd {
    raw_listen_queue(name, 16)
}

/// A listener whose queue takes `backlog` + 1 connections.
fn raw_listen_queue(name: &str, backlog: i32) -> OwnedFd {
    let fd = seqpacket();
    rustix::net::bind(&fd, &SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap()).unwrap();
    rustix::net::listen(&fd, backlog).unwrap();
    fd
}

fn readable(fd: BorrowedFd<'_>, within: Duration) -> bool {
    let mut pfd = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    let ts = Timespec { tv_sec: within.as_secs() as i64, tv_nsec: i64::from(within.subsec_nanos()) };
    matches!(rustix::event::poll(&mut pfd, Some(&ts)), Ok(n) if n > 0)
}

fn raw_accept(listener: &OwnedFd) -> OwnedFd {
    assert!(readable(listener.as_fd(), T), "nobody connected");
    rustix::net::accept_with(listener, SocketFlags::CLOEXEC).unwrap()
}

fn send_msg(fd: &OwnedFd, data: &[u8], fds: &[BorrowedFd<'_>]) {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    }
    rustix::net::sendmsg(fd, &[std::io::IoSlice::new(data)], &mut control, SendFlags::NOSIGNAL).unwrap();
}

/// One message and its fds, within `within`.
fn recv_msg(fd: &OwnedFd, within: Duration) -> Option<(Vec<u8>, Vec<OwnedFd>)> {
    if !readable(fd.as_fd(), within) {
        return None;
    }
    let mut buf = [0u8; 256];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = rustix::net::recvmsg(
        fd,
        &mut [std::io::IoSliceMut::new(&mut buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
    )
    .ok()?;
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(r) = m {
            fds.extend(r);
        }
    }
    Some((buf[..msg.bytes].to_vec(), fds))
}

/// The write end of a pipe that is full and blocking: a write to it waits
/// until someone reads (the read end is returned too, and nobody does).
fn full_pipe() -> (OwnedFd, OwnedFd) {
    use rustix::fs::{fcntl_getfl, fcntl_setfl, OFlags};
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK).unwrap();
    let chunk = [0u8; 4096];
    while rustix::io::write(&w, &chunk).is_ok() {}
    let flags = fcntl_getfl(&w).unwrap();
    fcntl_setfl(&w, flags - OFlags::NONBLOCK).unwrap();
    (r, w)
}

/// Open fds of pool memory (other tests of this binary open sockets at
/// the same time).
fn pool_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().contains("memfd:ferry-pool"))
        .count()
}

fn unique(tag: &str) -> String {
    support::unique_name(&format!("hostile-{tag}"))
}

fn shm_creator(domain: &Domain, name: &str) -> Channel {
    let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, ..ChannelSetup::default() };
    Channel::create(domain, &Endpoint::shm_abstract(name), setup).expect("create")
}

/// Bind `binder` to `creator` (both in this thread) and check both connect.
fn complete_bind(creator: &mut Channel, binder: &mut Channel) {
    match creator.wait(Some(T)) {
        Ok(Event::BindRequest { .. }) => {}
        ev => panic!("the creator should serve the legitimate binder, got {ev:?}"),
    }
    match binder.wait(Some(T)) {
        Ok(Event::Bound) => {}
        ev => panic!("the legitimate binder should be bound, got {ev:?}"),
    }
    assert_eq!((creator.state(), binder.state()), (ChannelState::Connected, ChannelState::Connected));
}

// -------------------------------------------------------- shm: doorbells

/// A binder whose doorbell is a full pipe, a regular file or a socket is
/// refused (it sees why); the creator does not hang on it and serves the
/// legitimate binder that comes next.
#[test]
fn creator_refuses_doorbells_that_are_not_eventfds() {
    bounded(3 * T, || {
        let (pipe_r, pipe_w) = full_pipe();
        let file_path = std::env::temp_dir().join(unique("bell-file"));
        let file = OwnedFd::from(std::fs::File::create(&file_path).unwrap());
        let (sock_a, _sock_b) = std::os::unix::net::UnixStream::pair().unwrap();
        let sock = OwnedFd::from(sock_a);
        for (what, bell) in [("full pipe", &pipe_w), ("regular file", &file), ("socket", &sock)] {
            let (a, b) = (Domain::new("creator"), Domain::new("binder"));
            let name = unique("bell");
            let mut creator = shm_creator(&a, &name);
            let hostile = raw_connect(&name);
            send_msg(&hostile, &bind_request(), &[bell.as_fd()]);
            // Drive the creator until the hostile binder has its answer.
            let deadline = Instant::now() + T;
            let reply = loop {
                if let Ok(ev) = creator.wait(Some(Duration::from_millis(20))) {
                    panic!("{what}: the creator accepted a binder whose doorbell is a {what}: {ev:?}");
                }
                if let Some(reply) = recv_msg(&hostile, Duration::ZERO) {
                    break reply.0;
                }
                assert!(Instant::now() < deadline, "{what}: no answer to the bind request");
            };
            assert_eq!(&reply[..5], b"FRY1\x03", "{what}: a refusal, not {reply:?}");
            let mut binder = Channel::bind(&b, &Endpoint::shm_abstract(&name), BindParams::default()).unwrap();
            complete_bind(&mut creator, &mut binder);
        }
        drop(pipe_r);
        let _ = std::fs::remove_file(file_path);
    });
}

/// Runs a raw seqpacket proxy between a binder and a real creator that
/// replaces the creator's doorbell in its acceptance with `bell`.
fn doorbell_swapping_proxy(front: String, back: String, bell: OwnedFd) -> std::thread::JoinHandle<()> {
    let listener = raw_listen(&front);
    std::thread::spawn(move || {
        let from_binder = raw_accept(&listener);
        let (request, fds) = recv_msg(&from_binder, T).expect("bind request");
        let to_creator = raw_connect(&back);
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        send_msg(&to_creator, &request, &borrowed);
        let (reply, fds) = recv_msg(&to_creator, T).expect("creator's reply");
        assert_eq!(fds.len(), 2, "segment and doorbell");
        send_msg(&from_binder, &reply, &[fds[0].as_fd(), bell.as_fd()]);
        // Keep both connections open until the binder has its answer.
        let _ = readable(from_binder.as_fd(), T);
    })
}

/// A creator whose doorbell is a full pipe: the binder refuses the channel
/// with a protocol error instead of binding (and later hanging on a ring).
#[test]
fn binder_refuses_a_creator_doorbell_that_is_a_full_pipe() {
    bounded(3 * T, || {
        let (a, b) = (Domain::new("creator"), Domain::new("binder"));
        let (back, front) = (unique("real"), unique("proxy"));
        let mut creator = shm_creator(&a, &back);
        let (_pipe_r, pipe_w) = full_pipe();
        let proxy = doorbell_swapping_proxy(front.clone(), back, pipe_w);
        let mut binder = Channel::bind(&b, &Endpoint::shm_abstract(&front), BindParams::default()).unwrap();
        match creator.wait(Some(T)) {
            Ok(Event::BindRequest { .. }) => {}
            ev => panic!("the request reaches the creator through the proxy, got {ev:?}"),
        }
        match binder.wait(Some(T)) {
            Ok(Event::Error(why)) if matches!(why.kind(), ErrorKind::Protocol(_)) => {
                assert!(why.to_string().contains("doorbell"), "{why}")
            }
            ev => panic!("expected the binder to refuse the doorbell, got {ev:?}"),
        }
        drop(binder);
        proxy.join().unwrap();
    });
}

// --------------------------------------------------- shm: silent peers

/// Connections that never send their bind request do not keep a
/// legitimate binder out (more of them than the creator keeps at once).
#[test]
fn silent_shm_connections_do_not_block_a_binder() {
    bounded(3 * T, || {
        let (a, b) = (Domain::new("creator"), Domain::new("binder"));
        let name = unique("silent");
        let mut creator = shm_creator(&a, &name);
        let mut silent = Vec::new();
        for _ in 0..12 {
            silent.push(raw_connect(&name));
            assert!(creator.poll().is_none());
        }
        let mut binder = Channel::bind(&b, &Endpoint::shm_abstract(&name), BindParams::default()).unwrap();
        complete_bind(&mut creator, &mut binder);
    });
}

/// A creator that accepts the connection and never answers: the binder
/// gives up with `TimedOut` after its bind timeout.
#[test]
fn silent_shm_creator_times_out() {
    bounded(3 * T, || {
        let b = Domain::new("binder");
        let name = unique("mute-creator");
        let listener = raw_listen(&name);
        let params = BindParams { timeout: Duration::from_millis(300), ..BindParams::default() };
        let mut binder = Channel::bind(&b, &Endpoint::shm_abstract(&name), params).unwrap();
        let _conn = raw_accept(&listener);
        match binder.wait(Some(T)) {
            Ok(Event::Error(err)) if matches!(err.kind(), ErrorKind::TimedOut) => {}
            ev => panic!("expected the bind to time out, got {ev:?}"),
        }
    });
}

/// A creator that never accepts, its queue full: the bind itself gives up
/// with `TimedOut` after the bind timeout instead of waiting in `connect`.
#[test]
fn shm_creator_with_a_full_queue_times_out() {
    bounded(3 * T, || {
        let b = Domain::new("binder");
        let name = unique("full-queue");
        let _listener = raw_listen_queue(&name, 0);
        let _first = raw_connect(&name);
        let params = BindParams { timeout: Duration::from_millis(300), ..BindParams::default() };
        match Channel::bind(&b, &Endpoint::shm_abstract(&name), params) {
            Err(err) if matches!(err.kind(), ErrorKind::TimedOut) => {}
            other => panic!("expected the bind to time out, got {other:?}"),
        }
    });
}

// ------------------------------------------------------- tcp: stalled peers

fn tcp_creator(domain: &Domain) -> (Channel, SocketAddr) {
    let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, ..ChannelSetup::default() };
    let ch = Channel::create(domain, &Endpoint::tcp("127.0.0.1:0".parse().unwrap()), setup).expect("create");
    let addr = ch.listen_addr().unwrap();
    (ch, addr)
}

/// Two connections that send half a bind request each and stall: a
/// legitimate binder behind them is served at once.
#[test]
fn half_open_tcp_bind_requests_do_not_block_a_binder() {
    bounded(3 * T, || {
        let (a, b) = (Domain::new("creator"), Domain::new("binder"));
        let (mut creator, addr) = tcp_creator(&a);
        let mut stalled = Vec::new();
        for _ in 0..2 {
            let mut s = TcpStream::connect(addr).unwrap();
            let req = tcp_framed(&bind_request());
            s.write_all(&req[..9]).unwrap();
            stalled.push(s);
            assert!(matches!(creator.wait(Some(Duration::from_millis(50))), Err(WaitError::TimedOut)));
        }
        let mut binder = Channel::bind(&b, &Endpoint::tcp(addr), BindParams::default()).unwrap();
        complete_bind(&mut creator, &mut binder);
    });
}

/// 200 idle connections (more than the listen backlog): a legitimate binder
/// coming after them is served.
#[test]
fn idle_tcp_connections_do_not_block_a_binder() {
    bounded(3 * T, || {
        let (a, b) = (Domain::new("creator"), Domain::new("binder"));
        let (creator, addr) = tcp_creator(&a);
        let (tx, rx) = mpsc::channel();
        let driver = std::thread::spawn(move || {
            let mut creator = creator;
            let deadline = Instant::now() + 3 * T;
            while Instant::now() < deadline {
                if let Ok(ev) = creator.wait(Some(Duration::from_millis(100))) {
                    let _ = tx.send(format!("{ev:?}"));
                    return creator;
                }
            }
            let _ = tx.send("nothing".to_string());
            creator
        });
        let idle: Vec<TcpStream> =
            (0..200).filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()).collect();
        assert!(idle.len() > 128, "only {} idle connections got in", idle.len());
        let mut binder = Channel::bind(&b, &Endpoint::tcp(addr), BindParams::default()).unwrap();
        match binder.wait(Some(T)) {
            Ok(Event::Bound) => {}
            ev => panic!("the legitimate binder should be bound, got {ev:?}"),
        }
        let ev = rx.recv_timeout(3 * T).expect("the creator's driver answers");
        assert!(ev.starts_with("BindRequest"), "{ev}");
        assert_eq!(driver.join().unwrap().state(), ChannelState::Connected);
    });
}

// ------------------------------------------------------------- limits

/// A hostile TCP creator: accepts one binder, then sends `frames` (pool
/// offers) and reads whatever comes back until the binder closes.
fn hostile_tcp_creator(frames: Vec<[u8; 32]>) -> (SocketAddr, std::thread::JoinHandle<()>) {
    hostile_tcp_creator_answering(bind_accept(1024), frames)
}

/// A hostile TCP creator that answers the bind with `acc`.
fn hostile_tcp_creator_answering(acc: Vec<u8>, frames: Vec<[u8; 32]>) -> (SocketAddr, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let peer = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        let mut req = [0u8; 2 + 33 + 4];
        s.read_exact(&mut req).unwrap();
        s.write_all(&tcp_framed(&acc)).unwrap();
        let mut reader = s.try_clone().unwrap();
        let drain = std::thread::spawn(move || {
            let mut sink = [0u8; 65536];
            while matches!(reader.read(&mut sink), Ok(n) if n > 0) {}
        });
        for f in &frames {
            if s.write_all(f).is_err() {
                break;
            }
        }
        drain.join().unwrap();
    });
    (addr, peer)
}

/// A pool offer frame: trust FULL, `count` buffers of `size` bytes.
fn offer(id: u128, size: u64, count: u32) -> [u8; 32] {
    let mut f = [0u8; 32];
    f[0] = 5;
    f[1] = 3 << 4;
    f[4..8].copy_from_slice(&count.to_le_bytes());
    f[8..16].copy_from_slice(&size.to_le_bytes());
    f[16..32].copy_from_slice(&id.to_le_bytes());
    f
}

fn bound_to(addr: SocketAddr, domain: &Domain) -> Channel {
    let mut ch = Channel::bind(domain, &Endpoint::tcp(addr), BindParams::default()).unwrap();
    match ch.wait(Some(T)) {
        Ok(Event::Bound) => ch,
        ev => panic!("expected to bind to the hostile creator, got {ev:?}"),
    }
}

/// 5000 pool offers: the first `max_peer_pools` are put to the application,
/// the rest are vetoed with `LimitExceeded` before any memory is made for
/// them, and the fds of pool memory stay bounded.
#[test]
fn five_thousand_pool_offers_stay_within_the_limit() {
    bounded(3 * T, || {
        const OFFERS: u32 = 5000;
        let limit = ChannelLimits::default().max_peer_pools;
        let frames = (0..OFFERS).map(|i| offer(u128::from(i) + 1, 4096, 1)).collect();
        let (addr, peer) = hostile_tcp_creator(frames);
        let b = Domain::new("binder");
        let mut ch = bound_to(addr, &b);
        let (mut asked, mut refused, mut most_fds) = (0usize, 0usize, 0usize);
        while asked + refused < OFFERS as usize {
            match ch.wait(Some(T)) {
                Ok(Event::PoolAssignRequest(_)) => asked += 1,
                Ok(Event::PoolOfferRefused { reason, .. })
                    if matches!(reason.kind(), ErrorKind::LimitExceeded { .. }) =>
                {
                    let ErrorKind::LimitExceeded { what, limit: l } = *reason.kind() else { unreachable!() };
                    assert_eq!((what, l), ("pools assigned by the peer", limit as u64));
                    refused += 1;
                }
                ev => panic!("after {asked} requests and {refused} refusals: {ev:?}"),
            }
            most_fds = most_fds.max(pool_fds());
        }
        assert_eq!((asked, refused), (limit, OFFERS as usize - limit));
        assert!(most_fds <= limit + 4, "{most_fds} fds of pool memory open");
        assert_eq!(ch.state(), ChannelState::Connected);
        drop(ch);
        peer.join().unwrap();
    });
}

/// The largest mapping in this process, from /proc/self/maps.
fn largest_mapping() -> u64 {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| {
            let range = l.split_whitespace().next()?;
            let (a, b) = range.split_once('-')?;
            Some(u64::from_str_radix(b, 16).ok()? - u64::from_str_radix(a, 16).ok()?)
        })
        .max()
        .unwrap_or(0)
}

/// A 1 TiB pool offer is vetoed with `LimitExceeded` without being mapped;
/// the channel goes on, and a small pool offered next is put to the
/// application.
#[test]
fn a_terabyte_pool_offer_is_refused_unmapped() {
    bounded(3 * T, || {
        let huge = offer(1, 1 << 30, 1024);
        let small = offer(2, 4096, 4);
        let (addr, peer) = hostile_tcp_creator(vec![huge, small]);
        let b = Domain::new("binder");
        let mut ch = bound_to(addr, &b);
        match ch.wait(Some(T)) {
            Ok(Event::PoolOfferRefused { reason, .. }) if matches!(reason.kind(), ErrorKind::LimitExceeded { .. }) => {
                let ErrorKind::LimitExceeded { what, limit } = *reason.kind() else { unreachable!() };
                assert_eq!((what, limit), ("bytes of pools assigned by the peer", 16 << 30));
            }
            ev => panic!("expected the terabyte pool refused, got {ev:?}"),
        }
        assert!(largest_mapping() < 1 << 40, "a mapping of {} bytes", largest_mapping());
        match ch.wait(Some(T)) {
            Ok(Event::PoolAssignRequest(req)) => assert_eq!(req.geometry.count(), 4),
            ev => panic!("expected the small pool offered, got {ev:?}"),
        }
        assert!(largest_mapping() < 1 << 40);
        assert_eq!(ch.state(), ChannelState::Connected);
        assert_eq!(ch.trust(), TrustLevel::Full);
        drop(ch);
        peer.join().unwrap();
    });
}

/// A creator's answer that settles what the binder did not ask for — a
/// trust level it refused, a queue depth out of range — fails the bind with
/// a protocol error.
#[test]
fn a_creator_answer_outside_the_request_is_refused() {
    bounded(3 * T, || {
        let huge_depth = bind_accept(1 << 20);
        for (acc, trust, what) in [(bind_accept(1024), Some(TrustLevel::Half), "trust"), (huge_depth, None, "depth")] {
            let (addr, peer) = hostile_tcp_creator_answering(acc, Vec::new());
            let b = Domain::new("binder");
            let params = BindParams { trust, ..BindParams::default() };
            let mut ch = Channel::bind(&b, &Endpoint::tcp(addr), params).unwrap();
            match ch.wait(Some(T)) {
                Ok(Event::Error(why)) if matches!(why.kind(), ErrorKind::Protocol(_)) => {
                    assert!(why.to_string().contains(what), "{why}")
                }
                ev => panic!("{what}: expected the answer refused, got {ev:?}"),
            }
            drop(ch);
            peer.join().unwrap();
        }
    });
}

/// A sealed memfd of one 4 KiB buffer, as a pool's memory travels.
fn small_pool_file() -> OwnedFd {
    use rustix::fs::{fcntl_add_seals, ftruncate, memfd_create, MemfdFlags, SealFlags};
    let fd = memfd_create("hostile-pool", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    ftruncate(&fd, 4096).unwrap();
    fcntl_add_seals(&fd, SealFlags::GROW | SealFlags::SHRINK).unwrap();
    fd
}

/// A pool announcement (its memory file travels beside it).
fn pool_message(id: u128) -> Vec<u8> {
    let mut v = b"FRY1\x04".to_vec();
    v.extend_from_slice(&id.to_le_bytes());
    v.extend_from_slice(&4096u64.to_le_bytes());
    v.extend_from_slice(&1u32.to_le_bytes());
    v
}

/// Open fds of memory files named `name`.
fn files_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().contains(name))
        .count()
}

/// Over shared memory, pool files come on the socket ahead of their offers.
/// A peer that sends 5000 of them, never offered, does not make the binder
/// hold 5000 fds: it holds at most `max_peer_pools`, and the pool offered
/// behind them fails the channel with `LimitExceeded`.
#[test]
fn five_thousand_pool_files_over_shm_stay_within_the_limit() {
    bounded(3 * T, || {
        const FILES: u128 = 5000;
        let (a, b) = (Domain::new("creator"), Domain::new("binder"));
        let (back, front) = (unique("real-files"), unique("proxy-files"));
        let mut creator = shm_creator(&a, &back);
        let listener = raw_listen(&front);
        let proxy = std::thread::spawn(move || {
            let from_binder = raw_accept(&listener);
            let (request, fds) = recv_msg(&from_binder, T).expect("bind request");
            let to_creator = raw_connect(&back);
            send_msg(&to_creator, &request, &fds.iter().map(|f| f.as_fd()).collect::<Vec<_>>());
            let (reply, fds) = recv_msg(&to_creator, T).expect("creator's reply");
            send_msg(&from_binder, &reply, &fds.iter().map(|f| f.as_fd()).collect::<Vec<_>>());
            // The hostile part: pool files nobody offers.
            let file = small_pool_file();
            for id in 0..FILES {
                send_msg(&from_binder, &pool_message(1_000_000 + id), &[file.as_fd()]);
            }
            // Then relay what the creator sends (the real pool's file).
            let deadline = Instant::now() + 2 * T;
            while Instant::now() < deadline && !readable(from_binder.as_fd(), Duration::ZERO) {
                if let Some((msg, fds)) = recv_msg(&to_creator, Duration::from_millis(50)) {
                    send_msg(&from_binder, &msg, &fds.iter().map(|f| f.as_fd()).collect::<Vec<_>>());
                }
            }
        });
        let mut binder = Channel::bind(&b, &Endpoint::shm_abstract(&front), BindParams::default()).unwrap();
        complete_bind(&mut creator, &mut binder);
        let alloc = ferry::Allocator::new(&a, 2, 4096, ferry::PoolConstraints::default()).unwrap();
        creator.assign_pool(alloc.pool()).unwrap();
        let limit = ChannelLimits::default().max_peer_pools;
        match binder.wait(Some(2 * T)) {
            Ok(Event::Error(err)) if matches!(err.kind(), ErrorKind::LimitExceeded { .. }) => {
                let ErrorKind::LimitExceeded { what, limit: l } = *err.kind() else { unreachable!() };
                assert_eq!((what, l), ("pools assigned by the peer", limit as u64));
            }
            ev => panic!("expected the offer behind the junk to fail the channel, got {ev:?}"),
        }
        let held = files_named("hostile-pool");
        assert!(held <= limit + 1, "{held} pool files held");
        drop(binder);
        proxy.join().unwrap();
    });
}
