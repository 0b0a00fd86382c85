//! TLS on TCP channels and sessions: data both ways with every byte
//! checked, a man in the middle who flips one byte, clients that must be
//! refused (no certificate, another CA's, plain text) while the listening
//! side goes on serving, a sender whose socket fills while TLS holds
//! ciphertext (woken when it drains), the non-loopback rule, and the
//! configuration loader's errors. Real sockets on loopback, certificates made here.

mod support;

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::tls::{Security, TlsConfig};
use ferry::{
    Allocator, BindParams, Channel, ChannelSetup, Direction, Domain, Endpoint, Error, ErrorKind, Event, MuxListener,
    MuxSession, NetOptions, PoolConstraints, Role, WaitError,
};
use support::fault_proxy::{Fault, FaultProxy};
use support::payload::{check, fill};
use support::tls_pki::{client_without_certificate, write_foreign_client, Pki, TempDir};

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 64 << 10;

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn next(ch: &mut Channel) -> Event {
    ch.wait(Some(T)).unwrap_or_else(|e| panic!("no event within {T:?} (state {:?}): {e}", ch.state()))
}

/// A source channel listening on `at` with `options`.
fn source(domain: &Domain, at: SocketAddr, options: NetOptions) -> (Channel, SocketAddr) {
    let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, ..ChannelSetup::default() };
    let ch = Channel::create(domain, &Endpoint::tcp_with(at, options), setup).expect("create");
    let addr = ch.listen_addr().expect("listening");
    (ch, addr)
}

/// The sink side: takes the pool, checks every buffer it gets (it must
/// hold the pattern of its sequence number), writes `seq + 1` into it and
/// passes it back, until the channel closes or fails. Returns the buffers
/// it checked and the error, if one ended it.
fn echo_sink(mut rx: Channel) -> (u64, Option<Error>) {
    let mut checked = 0;
    loop {
        match rx.wait(Some(T)) {
            Ok(Event::Bound) => {}
            Ok(Event::PoolAssignRequest(req)) => rx.respond_pool(req.pool, true).unwrap(),
            Ok(Event::MoveReceived { mut buffer, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                assert!(check(&buffer, seq), "buffer {seq} arrived with other bytes than were sent");
                checked += 1;
                fill(buffer.as_mut_slice().unwrap(), seq + 1);
                // The channel may have failed meanwhile: the error event says so.
                let _ = rx.pass(buffer, &meta);
            }
            Ok(Event::Closed { .. }) => return (checked, None),
            Ok(Event::Error(e)) => return (checked, Some(e)),
            Ok(ev) => panic!("sink: unexpected {ev:?}"),
            Err(_) => panic!("sink: no event within {T:?}"),
        }
    }
}

fn assign(ch: &mut Channel, alloc: &Allocator) {
    ch.assign_pool(alloc.pool()).unwrap();
    assert!(matches!(next(ch), Event::PoolAssigned(_)));
}

/// Tear a source down in order (the sink sees `Closed`).
fn finish(mut tx: Channel) {
    tx.teardown().unwrap();
    loop {
        match next(&mut tx) {
            Event::Closed { .. } => return,
            Event::BufferPassed { .. } => {}
            ev => panic!("while closing: {ev:?}"),
        }
    }
}

/// Move `total` buffers over a bound source and take each back.
fn round_trips(tx: &mut Channel, domain: &Domain, total: u64) {
    let alloc = Allocator::new(domain, 8, SIZE, PoolConstraints::default()).unwrap();
    assign(tx, &alloc);
    let back = support::payload::move_and_take_back(tx, &alloc, total, |seq| seq + 1);
    assert_eq!(back.len() as u64, total);
}

#[test]
fn a_tls_channel_carries_exact_bytes_both_ways() {
    let pki = Pki::new();
    let src = Domain::new("src");
    let (mut tx, addr) = source(&src, loopback(), pki.options());
    let options = pki.options();
    let sink = std::thread::spawn(move || {
        let rx = Channel::bind(&Domain::new("sink"), &Endpoint::tcp_with(addr, options), BindParams::default());
        echo_sink(rx.unwrap())
    });
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    round_trips(&mut tx, &src, 300);
    let stats = tx.link_stats().expect("TCP keeps counters");
    assert!(stats.payload_sent >= 300 * SIZE as u64, "{stats:?}");
    finish(tx);
    let (checked, error) = sink.join().unwrap();
    assert_eq!((checked, error), (300, None));
}

/// A proxy flips one byte of the encrypted stream from the source to the
/// sink, deep in the payloads: the sink gets a TLS error event, and every
/// buffer it received before holds exactly the bytes sent.
#[test]
fn a_flipped_byte_in_the_stream_is_an_error_never_corrupt_data() {
    let pki = Pki::new();
    let src = Domain::new("src");
    let (mut tx, addr) = source(&src, loopback(), pki.options());
    let proxy = FaultProxy::start(addr).unwrap();
    // The creator is the TLS server: its stream reaches the client past
    // the handshake (a few KiB) and about fifteen 64 KiB payloads.
    proxy.set(Fault::CorruptAt { towards_server: false, offset: 1_000_000, xor: 0x01 });
    let (via, options) = (proxy.addr(), pki.options());
    let sink = std::thread::spawn(move || {
        let rx = Channel::bind(&Domain::new("sink"), &Endpoint::tcp_with(via, options), BindParams::default());
        echo_sink(rx.unwrap())
    });
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    let alloc = Allocator::new(&src, 8, SIZE, PoolConstraints::default()).unwrap();
    assign(&mut tx, &alloc);
    // Move until the channel fails (the sink closes the connection).
    let deadline = Instant::now() + T;
    let mut sent = 0u64;
    loop {
        assert!(Instant::now() < deadline, "the source saw no end of the channel");
        while let Some(mut b) = alloc.alloc() {
            fill(b.as_mut_slice().unwrap(), sent);
            if tx.move_buffer(b, &sent.to_le_bytes()).is_err() {
                break;
            }
            sent += 1;
        }
        match tx.wait(Some(T)) {
            Ok(Event::BufferPassed { buffer, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                assert!(check(&buffer, seq + 1), "buffer {seq} came back with other bytes than the sink wrote");
            }
            Ok(Event::Error(_)) | Ok(Event::Closed { .. }) => break,
            ev => panic!("source: unexpected {ev:?}"),
        }
    }
    let (checked, error) = sink.join().unwrap();
    assert!(
        matches!(error.as_ref().map(|e| e.kind()), Some(ErrorKind::Tls(_))),
        "the sink's channel ended with {error:?}"
    );
    assert!(checked > 5 && checked < sent, "{checked} of {sent} buffers checked before the flipped byte");
}

/// Clients without a certificate, with one another CA signed, and in
/// plain text are refused with a clear error; the listening channel then
/// serves a good client.
#[test]
fn clients_the_ca_did_not_certify_are_refused_and_the_listener_goes_on() {
    let pki = Pki::new();
    let src = Domain::new("src");
    let (mut tx, addr) = source(&src, loopback(), pki.options());
    let foreign_dir = TempDir::new("tls-foreign");
    write_foreign_client(&foreign_dir.0, &pki.dir.0);
    let foreign = Arc::new(TlsConfig::from_dir(&foreign_dir.0, "127.0.0.1").unwrap());
    let bad = [
        ("no certificate", Security::Tls(client_without_certificate(&pki))),
        ("another CA's certificate", Security::Tls(foreign)),
        ("plain text", Security::LoopbackOnly),
    ];
    let clients = std::thread::spawn(move || {
        let d = Domain::new("clients");
        for (what, security) in bad {
            let ep = Endpoint::tcp_with(addr, NetOptions::default().with_security(security));
            match Channel::connect(&d, &ep, BindParams::default(), T) {
                Err(why) if matches!(why.kind(), ErrorKind::Tls(_)) => eprintln!("{what}: refused: {why}"),
                Err(e) => panic!("{what}: refused without a TLS error: {e:?}"),
                Ok(_) => panic!("{what}: accepted"),
            }
        }
    });
    // The creator polls (serving the handshakes) while the bad clients try.
    while !clients.is_finished() {
        assert!(
            matches!(tx.wait(Some(Duration::from_millis(20))), Err(WaitError::TimedOut)),
            "an event before any good client came"
        );
    }
    clients.join().unwrap();
    let options = pki.options();
    let sink = std::thread::spawn(move || {
        let rx = Channel::bind(&Domain::new("sink"), &Endpoint::tcp_with(addr, options), BindParams::default());
        echo_sink(rx.unwrap())
    });
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    round_trips(&mut tx, &src, 20);
    finish(tx);
    assert_eq!(sink.join().unwrap(), (20, None));
}

/// A TLS client against a plain endpoint is refused too, and says why.
#[test]
fn a_tls_client_against_a_plain_endpoint_is_refused() {
    let pki = Pki::new();
    let src = Domain::new("src");
    let (mut tx, addr) = source(&src, loopback(), NetOptions::default());
    let options = pki.options();
    let client = std::thread::spawn(move || {
        Channel::connect(&Domain::new("c"), &Endpoint::tcp_with(addr, options), BindParams::default(), T).err()
    });
    while !client.is_finished() {
        assert!(matches!(tx.wait(Some(Duration::from_millis(20))), Err(WaitError::TimedOut)));
    }
    let e = client.join().unwrap();
    assert!(matches!(e.as_ref().map(|e| e.kind()), Some(ErrorKind::Tls(_))), "{e:?}");
}

/// One multiplexed session over TLS: a channel each way, every byte
/// checked; a client without a certificate is refused first and the
/// listener goes on.
#[test]
fn a_session_over_tls_moves_data_both_ways() {
    let pki = Pki::new();
    let mut listener = MuxListener::bind(loopback(), pki.options()).unwrap();
    let addr = listener.local_addr().unwrap();
    let nocert = NetOptions::default().with_security(Security::Tls(client_without_certificate(&pki)));
    let refused = std::thread::spawn(move || MuxSession::connect(addr, nocert, T).err());
    let e = loop {
        if refused.is_finished() {
            break refused.join().unwrap();
        }
        assert!(matches!(
            listener.accept(Duration::from_millis(20)).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::TimedOut)
        ));
    };
    assert!(
        matches!(e.as_ref().map(|e| e.kind()), Some(ErrorKind::Tls(_))),
        "a client without a certificate got {e:?}"
    );

    let options = pki.options();
    let peer = std::thread::spawn(move || {
        let session = MuxSession::connect(addr, options, T).unwrap();
        let d = Domain::new("b");
        // Channel 1: we are its sink; channel 2: its source.
        let rx = Channel::connect(&d, &session.endpoint(1), BindParams::default(), T).unwrap();
        let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, ..ChannelSetup::default() };
        let mut tx = Channel::accept(&d, &session.endpoint(2), setup, T).unwrap();
        let sink = std::thread::spawn(move || echo_sink(rx));
        round_trips(&mut tx, &d, 50);
        finish(tx);
        sink.join().unwrap()
    });
    let session = listener.accept(T).unwrap();
    let d = Domain::new("a");
    let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, ..ChannelSetup::default() };
    let mut tx = Channel::accept(&d, &session.endpoint(1), setup, T).unwrap();
    let rx = Channel::connect(&d, &session.endpoint(2), BindParams::default(), T).unwrap();
    let sink = std::thread::spawn(move || echo_sink(rx));
    round_trips(&mut tx, &d, 50);
    finish(tx);
    assert_eq!(sink.join().unwrap(), (50, None));
    assert_eq!(peer.join().unwrap(), (50, None));
}

/// Plain TCP off the loopback is refused unless chosen: a channel created
/// on all interfaces, a bind to a non-loopback address, a session
/// listener and a session connect. With `Security::None` or TLS the same
/// calls work (the binds go to the wildcard address, which is this
/// host).
#[test]
fn plain_tcp_off_the_loopback_needs_an_explicit_choice() {
    let any: SocketAddr = "0.0.0.0:0".parse().unwrap();
    let d = Domain::new("d");
    let setup = ChannelSetup::default();
    let e = Channel::create(&d, &Endpoint::tcp(any), setup).unwrap_err();
    assert_eq!(e, ErrorKind::InsecureAddress(any.ip()));
    assert!(e.to_string().contains("0.0.0.0 is not a loopback address"), "{e}");
    assert!(matches!(
        MuxListener::bind(any, NetOptions::default()).as_ref().map_err(|e| e.kind()),
        Err(ErrorKind::InsecureAddress(_))
    ));
    let std_listener = TcpListener::bind(any).unwrap();
    let port = std_listener.local_addr().unwrap().port();
    assert!(matches!(
        MuxSession::accept(&std_listener, NetOptions::default(), Duration::from_millis(1))
            .as_ref()
            .map_err(|e| e.kind()),
        Err(ErrorKind::InsecureAddress(_))
    ));
    // The wildcard address reaches this host; the rule refuses it before
    // any packet goes out.
    let wildcard = SocketAddr::from(([0, 0, 0, 0], port));
    assert!(matches!(
        MuxSession::connect(wildcard, NetOptions::default(), T).as_ref().map_err(|e| e.kind()),
        Err(ErrorKind::InsecureAddress(_))
    ));
    let e = Channel::connect(&d, &Endpoint::tcp(wildcard), BindParams::default(), T).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InsecureAddress(_)), "{e:?}");

    // Chosen on purpose: plain TCP on all interfaces.
    let insecure = NetOptions::default().with_security(Security::None);
    let (mut tx, addr) = source(&d, any, insecure.clone());
    let to = SocketAddr::from(([0, 0, 0, 0], addr.port()));
    let sink = std::thread::spawn(move || {
        echo_sink(Channel::bind(&Domain::new("s"), &Endpoint::tcp_with(to, insecure), BindParams::default()).unwrap())
    });
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    round_trips(&mut tx, &d, 5);
    finish(tx);
    assert_eq!(sink.join().unwrap(), (5, None));

    // TLS on all interfaces.
    let pki = Pki::new();
    let (mut tx, addr) = source(&d, any, pki.options());
    let options = pki.options();
    let sink = std::thread::spawn(move || {
        let to = SocketAddr::from(([127, 0, 0, 1], addr.port()));
        echo_sink(Channel::bind(&Domain::new("s"), &Endpoint::tcp_with(to, options), BindParams::default()).unwrap())
    });
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    round_trips(&mut tx, &d, 5);
    finish(tx);
    assert_eq!(sink.join().unwrap(), (5, None));
}

/// The loader names the file at fault and why.
#[test]
fn tls_files_that_cannot_be_used_are_named() {
    let pki = Pki::new();
    let dir = TempDir::new("tls-bad");
    let err = |dir: &std::path::Path| match TlsConfig::from_dir(dir, "localhost") {
        Err(e) => match e.into_kind() {
            ErrorKind::TlsConfig(e) => e,
            other => panic!("expected a TLS configuration error, got {other:?}"),
        },
        other => panic!("expected a TLS configuration error, got {other:?}"),
    };
    let e = err(&dir.0);
    assert_eq!(e.path(), Some(dir.0.join("ca-cert.pem").as_path()));
    assert!(e.why().contains("missing"), "{e}");

    std::fs::copy(pki.dir.0.join("ca-cert.pem"), dir.0.join("ca-cert.pem")).unwrap();
    let e = err(&dir.0);
    assert!(e.why().contains("holds neither"), "{e}");

    std::fs::copy(pki.dir.0.join("server-cert.pem"), dir.0.join("server-cert.pem")).unwrap();
    let e = err(&dir.0);
    assert_eq!(e.path(), Some(dir.0.join("server-key.pem").as_path()), "{e}");

    std::fs::write(dir.0.join("server-key.pem"), "not a key\n").unwrap();
    let e = err(&dir.0);
    assert_eq!(e.path(), Some(dir.0.join("server-key.pem").as_path()), "{e}");
    assert!(e.why().contains("no private key"), "{e}");

    // A key of another pair.
    std::fs::copy(pki.dir.0.join("client-key.pem"), dir.0.join("server-key.pem")).unwrap();
    let e = err(&dir.0);
    assert_eq!(e.path(), Some(dir.0.join("server-cert.pem").as_path()), "{e}");

    std::fs::write(dir.0.join("ca-cert.pem"), "-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----\n").unwrap();
    let e = err(&dir.0);
    assert_eq!(e.path(), Some(dir.0.join("ca-cert.pem").as_path()), "{e}");

    // A server-only directory cannot connect, and says which file it lacks.
    let server_only = TempDir::new("tls-server-only");
    for f in ["ca-cert.pem", "server-cert.pem", "server-key.pem"] {
        std::fs::copy(pki.dir.0.join(f), server_only.0.join(f)).unwrap();
    }
    let config = Arc::new(TlsConfig::from_dir(&server_only.0, "127.0.0.1").unwrap());
    assert!(config.can_accept() && !config.can_connect());
    let ep =
        Endpoint::tcp_with("127.0.0.1:1".parse().unwrap(), NetOptions::default().with_security(Security::Tls(config)));
    match Channel::connect(&Domain::new("d"), &ep, BindParams::default(), T).map_err(ferry::Error::into_kind) {
        Err(ErrorKind::TlsConfig(e)) => assert_eq!(e.path(), Some(server_only.0.join("client-cert.pem").as_path())),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        TlsConfig::from_dir(&pki.dir.0, "not a name!").as_ref().map_err(|e| e.kind()),
        Err(ErrorKind::TlsConfig(_))
    ));
}

/// Bytes TLS has already taken off the socket are not the socket's to
/// signal: after one of two messages that came in one record, the sink's
/// `arm` must say something is ready (or its fd must be readable), as it
/// would with the second message still in the kernel.
#[test]
fn arm_after_an_event_sees_what_tls_already_decrypted() {
    let pki = Pki::new();
    let src = Domain::new("src");
    let (mut tx, addr) = source(&src, loopback(), pki.options());
    let options = pki.options();
    let mut rx =
        Channel::bind(&Domain::new("sink"), &Endpoint::tcp_with(addr, options), BindParams::default()).unwrap();
    // Both ends drive the handshake.
    let (mut bound, mut requested) = (false, false);
    let until = Instant::now() + T;
    while !(bound && requested) {
        assert!(Instant::now() < until, "no TLS channel within {T:?}");
        requested |= matches!(tx.wait(Some(Duration::from_millis(5))), Ok(Event::BindRequest { .. }));
        bound |= matches!(rx.wait(Some(Duration::from_millis(5))), Ok(Event::Bound));
    }
    let alloc = Allocator::new(&src, 4, 4096, PoolConstraints::default()).unwrap();
    tx.assign_pool(alloc.pool()).unwrap();
    loop {
        match rx.wait(Some(Duration::from_millis(5))) {
            Ok(Event::PoolAssignRequest(req)) => rx.respond_pool(req.pool, true).unwrap(),
            Err(_) => {}
            ev => panic!("sink: {ev:?}"),
        }
        if let Some(ev) = tx.poll() {
            assert!(matches!(ev, Event::PoolAssigned(_)), "{ev:?}");
            break;
        }
    }
    // Two small moves in one send: one TLS record.
    for seq in 0..2u64 {
        let mut b = alloc.alloc().unwrap();
        fill(b.as_mut_slice().unwrap(), seq);
        tx.move_buffer(b, &seq.to_le_bytes()).unwrap();
    }
    tx.flush().unwrap();
    match rx.wait(Some(T)) {
        Ok(Event::MoveReceived { buffer, .. }) => assert!(check(&buffer, 0)),
        ev => panic!("sink: {ev:?}"),
    }
    if rx.arm() {
        let mut fds = [rustix::event::PollFd::new(&rx, rustix::event::PollFlags::IN)];
        let ready = rustix::event::poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 2, tv_nsec: 0 })).unwrap();
        assert_eq!(ready, 1, "the sink armed and its fd stays quiet while the second message waits in TLS");
    }
    match rx.poll() {
        Some(Event::MoveReceived { buffer, .. }) => assert!(check(&buffer, 1)),
        ev => panic!("sink: {ev:?}"),
    }
}

/// Silent connections and ones that stall in the middle of a TLS
/// handshake (more than the creator keeps at once) do not keep a good
/// client out: the creator serves handshakes side by side and sheds the
/// oldest.
#[test]
fn stalled_handshakes_do_not_keep_a_good_client_out() {
    use std::io::Write;
    let pki = Pki::new();
    let src = Domain::new("src");
    let (mut tx, addr) = source(&src, loopback(), pki.options());
    let mut stalled = Vec::new();
    for i in 0..24 {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        if i % 2 == 0 {
            // The start of a TLS record (a handshake message), then nothing.
            s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).unwrap();
        }
        stalled.push(s);
    }
    // The creator takes them in.
    assert!(matches!(tx.wait(Some(Duration::from_millis(100))), Err(WaitError::TimedOut)));
    let options = pki.options();
    let sink = std::thread::spawn(move || {
        let rx = Channel::bind(&Domain::new("sink"), &Endpoint::tcp_with(addr, options), BindParams::default());
        echo_sink(rx.unwrap())
    });
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    round_trips(&mut tx, &src, 3);
    finish(tx);
    assert_eq!(sink.join().unwrap(), (3, None));
    drop(stalled);
}

/// Buffers of the socket-filling tests: more than the kernel's buffers on
/// both sides of the proxy hold, so that the sender's socket fills.
const FILL_BUFFERS: u64 = 96;
const FILL_SIZE: usize = 256 << 10;

/// Options for the socket-filling tests: the peer sends nothing back for a
/// while, which must not count as a dead peer.
fn patient(pki: &Pki) -> NetOptions {
    let mut options = pki.options();
    options.peer_timeout = Duration::from_secs(60);
    options
}

/// The sink of the socket-filling tests: takes the pool, checks and keeps
/// every buffer until it has all `total`, says so on `all_in`, then
/// passes each back with `seq + 1` written into it and runs until the
/// channel closes.
fn hold_then_echo(mut rx: Channel, total: u64, all_in: std::sync::mpsc::Sender<()>) -> (u64, Option<Error>) {
    let mut held = Vec::new();
    loop {
        match rx.wait(Some(Duration::from_secs(60))) {
            Ok(Event::Bound) => {}
            Ok(Event::PoolAssignRequest(req)) => rx.respond_pool(req.pool, true).unwrap(),
            Ok(Event::MoveReceived { buffer, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                assert!(check(&buffer, seq), "buffer {seq} arrived with other bytes than were sent");
                held.push((buffer, meta));
                if held.len() as u64 == total {
                    let _ = all_in.send(());
                    for (mut buffer, meta) in held.drain(..) {
                        let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                        fill(buffer.as_mut_slice().unwrap(), seq + 1);
                        rx.pass(buffer, &meta).unwrap();
                    }
                }
            }
            Ok(Event::Closed { .. }) => return (total, None),
            Ok(Event::Error(e)) => return (held.len() as u64, Some(e)),
            Ok(ev) => panic!("sink: unexpected {ev:?}"),
            Err(_) => panic!("sink: no event within a minute"),
        }
    }
}

/// The next event of `ch` as an event loop gets it: `poll`, and when
/// there is none, `arm` and sleep in poll(2) on the channel's fd until it
/// is readable or `until` (`None`): nothing but the channel's own wake-up
/// ends the sleep.
fn next_from_fd(ch: &mut Channel, until: Instant) -> Option<Event> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    loop {
        if let Some(ev) = ch.poll() {
            return Some(ev);
        }
        if ch.arm() {
            let left = until.checked_duration_since(Instant::now())?;
            let timeout = Timespec { tv_sec: left.as_secs() as _, tv_nsec: left.subsec_nanos() as _ };
            let mut fds = [PollFd::new(&*ch, PollFlags::IN)];
            match poll(&mut fds, Some(&timeout)) {
                Ok(0) => return None,
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => panic!("poll: {e}"),
            }
        }
    }
}

/// The source `tx` (bound through `proxy`, its sink `hold_then_echo`)
/// sends `FILL_BUFFERS` while the proxy does not read what it sends, so
/// the socket fills with ciphertext and TLS holds more; then the proxy
/// reads again, slowly, and passes nothing the other way, so only the
/// socket draining can wake the source, and the last frames are taken by
/// TLS while the socket is still full. Every buffer must reach the sink then
/// (the source asleep in poll(2) on its fd, woken by nothing else), and
/// come back with its bytes.
fn send_into_a_full_socket(
    tx: &mut Channel,
    domain: &Domain,
    proxy: &Arc<FaultProxy>,
    all_in: std::sync::mpsc::Receiver<()>,
) {
    let alloc = Allocator::new(domain, FILL_BUFFERS, FILL_SIZE, PoolConstraints::default()).unwrap();
    assign(tx, &alloc);
    proxy.set(Fault::StopReading { towards_server: false });
    for seq in 0..FILL_BUFFERS {
        let mut b = alloc.alloc().unwrap();
        fill(b.as_mut_slice().unwrap(), seq);
        tx.move_buffer(b, &seq.to_le_bytes()).unwrap();
    }
    let _ = tx.flush();
    let controller = {
        let proxy = proxy.clone();
        std::thread::spawn(move || {
            // The peer reads nothing for a while (the source sleeps meanwhile)...
            std::thread::sleep(Duration::from_millis(300));
            // ... then reads slowly (the socket stays nearly full), and
            // nothing reaches the source.
            proxy.set(Fault::Trickle { towards_server: false, delay: Duration::from_millis(2) });
            let drained = all_in.recv_timeout(Duration::from_secs(20)).is_ok();
            proxy.set(Fault::None);
            drained
        })
    };
    let sent = tx.link_stats().expect("counters").payload_sent;
    assert!(sent < FILL_BUFFERS * FILL_SIZE as u64, "the socket never filled: {sent} bytes went out at once");
    let until = Instant::now() + Duration::from_secs(40);
    let mut back = 0;
    while back < FILL_BUFFERS {
        match next_from_fd(tx, until) {
            Some(Event::BufferPassed { buffer, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                assert!(check(&buffer, seq + 1), "buffer {seq} came back with the wrong bytes");
                back += 1;
            }
            ev => panic!("source: {ev:?} with {back} buffers back (state {:?})", tx.state()),
        }
    }
    assert!(controller.join().unwrap(), "the source stalled: its data did not reach the sink while the socket drained");
}

#[test]
fn ciphertext_held_for_a_full_socket_goes_out_when_it_drains() {
    let pki = Pki::new();
    let src = Domain::new("src");
    let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, ..ChannelSetup::default() };
    let mut tx = Channel::create(&src, &Endpoint::tcp_with(loopback(), patient(&pki)), setup).unwrap();
    let proxy = Arc::new(FaultProxy::start(tx.listen_addr().unwrap()).unwrap());
    let (at, options) = (proxy.addr(), patient(&pki));
    let (all_in, drained) = std::sync::mpsc::channel();
    let sink = std::thread::spawn(move || {
        let rx = Channel::bind(&Domain::new("sink"), &Endpoint::tcp_with(at, options), BindParams::default());
        hold_then_echo(rx.unwrap(), FILL_BUFFERS, all_in)
    });
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    send_into_a_full_socket(&mut tx, &src, &proxy, drained);
    finish(tx);
    assert_eq!(sink.join().unwrap(), (FILL_BUFFERS, None));
}

#[test]
fn ciphertext_held_for_a_full_socket_goes_out_when_it_drains_on_a_session() {
    let pki = Pki::new();
    let mut listener = MuxListener::bind(loopback(), patient(&pki)).unwrap();
    let proxy = Arc::new(FaultProxy::start(listener.local_addr().unwrap()).unwrap());
    let (at, options) = (proxy.addr(), patient(&pki));
    let (all_in, drained) = std::sync::mpsc::channel();
    let sink = std::thread::spawn(move || {
        let session = MuxSession::connect(at, options, T).unwrap();
        let rx = Channel::connect(&Domain::new("sink"), &session.endpoint(1), BindParams::default(), T).unwrap();
        hold_then_echo(rx, FILL_BUFFERS, all_in)
    });
    let session = listener.accept(T).unwrap();
    // The socket, not the peer's read reports, bounds what goes out.
    session.set_bulk_budget(usize::MAX);
    let src = Domain::new("src");
    let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, ..ChannelSetup::default() };
    let mut tx = Channel::accept(&src, &session.endpoint(1), setup, T).unwrap();
    send_into_a_full_socket(&mut tx, &src, &proxy, drained);
    finish(tx);
    assert_eq!(sink.join().unwrap(), (FILL_BUFFERS, None));
}
