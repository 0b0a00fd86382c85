//! The NBD server byte by byte: a client written here from the protocol
//! specification drives a real server on a real socket, through the
//! handshake's options and errors and the transmission phase's malformed
//! requests. Every malformed request is answered as the specification
//! says, and a client that breaks the protocol loses only its own
//! connection.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use std::sync::mpsc;

use ferry_block::{ConnSummary, MemStore, NbdServer, ServerConfig, Store};

const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_META_CONTEXT: u32 = 4;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const REP_ERR_INVALID: u32 = (1 << 31) + 3;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;

/// A server on a kernel-chosen port over a memory store; small payloads
/// (64 KiB) so oversize requests are cheap.
fn server(size: u64) -> (String, Arc<MemStore>) {
    let store = Arc::new(MemStore::new(size).expect("store"));
    let config = ServerConfig { max_payload: 64 << 10, ..ServerConfig::default() };
    let server = NbdServer::bind(&"tcp:127.0.0.1:0".parse().expect("addr"), store.clone(), config).expect("bind");
    let addr = server.local_addr().to_string();
    server.spawn(|_| {}).expect("accept thread");
    (addr.strip_prefix("tcp:").expect("tcp").to_string(), store)
}

/// A server with 1 MiB payloads whose connection summaries come back
/// through the receiver.
fn server_with_summaries(size: u64) -> (String, Arc<MemStore>, mpsc::Receiver<ConnSummary>) {
    let store = Arc::new(MemStore::new(size).expect("store"));
    let config = ServerConfig { max_payload: 1 << 20, ..ServerConfig::default() };
    let server = NbdServer::bind(&"tcp:127.0.0.1:0".parse().expect("addr"), store.clone(), config).expect("bind");
    let addr = server.local_addr().to_string();
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    server
        .spawn(move |summary| {
            let _ = tx.lock().unwrap().send(summary.clone());
        })
        .expect("accept thread");
    (addr.strip_prefix("tcp:").expect("tcp").to_string(), store, rx)
}

struct Client {
    s: TcpStream,
}

/// A request's 28-byte header (magic, flags, type, handle, offset, length).
fn request_header(flags: u16, kind: u16, handle: u64, offset: u64, len: u32) -> Vec<u8> {
    let mut m = 0x2560_9513u32.to_be_bytes().to_vec();
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    m.extend_from_slice(&handle.to_be_bytes());
    m.extend_from_slice(&offset.to_be_bytes());
    m.extend_from_slice(&len.to_be_bytes());
    m
}

impl Client {
    /// Connect and do the greeting (fixed newstyle, no zeroes).
    fn connect(addr: &str) -> Client {
        Client::greet(TcpStream::connect(addr).expect("connect"))
    }

    /// Connect from `from` (a loopback address of the test's choosing, so
    /// the server's connection thread can be told from the others' by its
    /// name) and do the greeting.
    fn connect_from(from: std::net::Ipv4Addr, addr: &str) -> Client {
        use rustix::net::{AddressFamily, SocketType};
        let to: std::net::SocketAddr = addr.parse().expect("server address");
        let fd = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None).expect("socket");
        rustix::net::bind(&fd, &std::net::SocketAddr::from((from, 0))).expect("bind the client's address");
        rustix::net::connect(&fd, &to).expect("connect");
        Client::greet(TcpStream::from(fd))
    }

    fn greet(s: TcpStream) -> Client {
        s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        let mut c = Client { s };
        let mut hello = [0u8; 18];
        c.s.read_exact(&mut hello).expect("greeting");
        assert_eq!(&hello[..8], b"NBDMAGIC");
        assert_eq!(u64::from_be_bytes(hello[8..16].try_into().unwrap()), IHAVEOPT);
        assert_eq!(u16::from_be_bytes(hello[16..].try_into().unwrap()), 0b11, "FIXED_NEWSTYLE | NO_ZEROES");
        c.s.write_all(&3u32.to_be_bytes()).expect("client flags");
        c
    }

    fn option(&mut self, option: u32, data: &[u8]) {
        let mut m = IHAVEOPT.to_be_bytes().to_vec();
        m.extend_from_slice(&option.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        self.s.write_all(&m).expect("send option");
    }

    /// One option reply: (option, type, data).
    fn reply(&mut self) -> (u32, u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).expect("option reply");
        assert_eq!(u64::from_be_bytes(h[..8].try_into().unwrap()), REPLY_MAGIC);
        let len = u32::from_be_bytes(h[16..].try_into().unwrap());
        let mut data = vec![0u8; len as usize];
        self.s.read_exact(&mut data).expect("reply data");
        (u32::from_be_bytes(h[8..12].try_into().unwrap()), u32::from_be_bytes(h[12..16].try_into().unwrap()), data)
    }

    /// NBD_OPT_EXPORT_NAME "": size and transmission flags.
    fn export_name(&mut self) -> (u64, u16) {
        self.option(1, b"");
        let mut r = [0u8; 10];
        self.s.read_exact(&mut r).expect("export reply");
        (u64::from_be_bytes(r[..8].try_into().unwrap()), u16::from_be_bytes(r[8..].try_into().unwrap()))
    }

    fn request(&mut self, flags: u16, kind: u16, handle: u64, offset: u64, len: u32, payload: &[u8]) {
        let mut m = request_header(flags, kind, handle, offset, len);
        m.extend_from_slice(payload);
        self.s.write_all(&m).expect("send request");
    }

    /// A simple reply: (error, handle), then `data` bytes if no error.
    fn simple(&mut self, data: usize) -> (u32, u64, Vec<u8>) {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).expect("simple reply");
        assert_eq!(u32::from_be_bytes(h[..4].try_into().unwrap()), 0x6744_6698, "simple reply magic");
        let err = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let mut d = vec![0u8; if err == 0 { data } else { 0 }];
        self.s.read_exact(&mut d).expect("read data");
        (err, u64::from_be_bytes(h[8..].try_into().unwrap()), d)
    }

    /// One structured chunk: (flags, type, handle, payload).
    fn chunk(&mut self) -> (u16, u16, u64, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).expect("chunk");
        assert_eq!(u32::from_be_bytes(h[..4].try_into().unwrap()), 0x668e_33ef, "structured reply magic");
        let len = u32::from_be_bytes(h[16..].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        self.s.read_exact(&mut d).expect("chunk payload");
        (
            u16::from_be_bytes(h[4..6].try_into().unwrap()),
            u16::from_be_bytes(h[6..8].try_into().unwrap()),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
            d,
        )
    }

    /// Whether the server closed the connection.
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0) | Err(_))
    }
}

fn string(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

#[test]
fn options_unknown_list_info_meta_context_abort() {
    let (addr, _) = server(1 << 20);
    let mut c = Client::connect(&addr);

    c.option(99, b"whatever data");
    assert_eq!(c.reply(), (99, REP_ERR_UNSUP, b"option not supported by this server".to_vec()));
    c.option(5, b""); // STARTTLS: this server offers no TLS (tls off)
    assert_eq!(c.reply(), (5, (1 << 31) + 2, b"this server does not offer TLS".to_vec()), "NBD_REP_ERR_POLICY");

    // LIST: the default export "" and the ACK.
    c.option(3, b"");
    assert_eq!(c.reply(), (3, REP_SERVER, 0u32.to_be_bytes().to_vec()));
    assert_eq!(c.reply(), (3, REP_ACK, vec![]));
    c.option(3, b"x");
    assert_eq!(c.reply().1, REP_ERR_INVALID);

    // INFO: unknown export, malformed data, then the real one.
    let mut info = string("disk7");
    info.extend_from_slice(&0u16.to_be_bytes());
    c.option(6, &info);
    assert_eq!(c.reply().1, REP_ERR_UNKNOWN);
    c.option(6, &string("")[..3]);
    assert_eq!(c.reply().1, REP_ERR_INVALID);
    let mut info = string("");
    info.extend_from_slice(&1u16.to_be_bytes());
    info.extend_from_slice(&3u16.to_be_bytes()); // NBD_INFO_BLOCK_SIZE
    c.option(6, &info);
    let (_, t, export) = c.reply();
    assert_eq!((t, &export[..2]), (REP_INFO, &[0u8, 0][..]));
    assert_eq!(u64::from_be_bytes(export[2..10].try_into().unwrap()), 1 << 20);
    let (_, t, sizes) = c.reply();
    assert_eq!((t, &sizes[..2]), (REP_INFO, &[0u8, 3][..]));
    assert_eq!(sizes[2..], [[0, 0, 0, 1], 4096u32.to_be_bytes(), (64u32 << 10).to_be_bytes()].concat()[..]);
    assert_eq!(c.reply().1, REP_ACK);

    // Meta contexts need structured replies first.
    let mut q = string("");
    q.extend_from_slice(&1u32.to_be_bytes());
    q.extend_from_slice(&string("base:allocation"));
    c.option(10, &q);
    assert_eq!(c.reply().1, REP_ERR_INVALID);
    c.option(8, b"");
    assert_eq!(c.reply().1, REP_ACK);
    let mut all = string("");
    all.extend_from_slice(&0u32.to_be_bytes());
    c.option(9, &all); // LIST with no query: everything there is
    let (_, t, ctx) = c.reply();
    assert_eq!((t, &ctx[4..]), (REP_META_CONTEXT, &b"base:allocation"[..]));
    assert_eq!(c.reply().1, REP_ACK);
    c.option(10, &q); // SET base:allocation
    let (_, t, ctx) = c.reply();
    assert_eq!((t, &ctx[..4], &ctx[4..]), (REP_META_CONTEXT, &1u32.to_be_bytes()[..], &b"base:allocation"[..]));
    assert_eq!(c.reply().1, REP_ACK);

    c.option(2, b""); // ABORT: ACK, then the server closes
    assert_eq!(c.reply(), (2, REP_ACK, vec![]));
    assert!(c.closed());
}

#[test]
fn unknown_client_flags_and_bad_magic_close_only_that_connection() {
    let (addr, _) = server(1 << 20);
    let mut bad = TcpStream::connect(&addr).expect("connect");
    bad.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut hello = [0u8; 18];
    bad.read_exact(&mut hello).unwrap();
    bad.write_all(&0x80u32.to_be_bytes()).unwrap();
    let mut c = Client { s: bad };
    assert!(c.closed(), "unknown client flags must end the connection");

    let mut ok = Client::connect(&addr);
    ok.export_name();
    let mut broken = Client::connect(&addr);
    broken.export_name();
    broken.s.write_all(&[0xde; 28]).unwrap(); // not a request
    assert!(broken.closed());
    ok.request(0, 1, 7, 0, 4, b"live");
    assert_eq!(ok.simple(0).0, 0);
    ok.request(0, 0, 8, 0, 4, b"");
    assert_eq!(ok.simple(4), (0, 8, b"live".to_vec()));
}

#[test]
fn malformed_requests_get_errors_and_the_connection_goes_on() {
    let (addr, store) = server(1 << 20);
    let mut c = Client::connect(&addr);
    let (size, flags) = c.export_name();
    assert_eq!(size, 1 << 20);
    assert_ne!(flags & (1 << 8), 0, "NBD_FLAG_CAN_MULTI_CONN");
    assert_eq!(flags & (1 << 7), 0, "no DF without structured replies");

    c.request(0, 42, 1, 0, 0, b""); // unknown command
    assert_eq!(c.simple(0), (EINVAL, 1, vec![]));
    c.request(1 << 6, 0, 2, 0, 512, b""); // unknown flag on READ
    assert_eq!(c.simple(512).0, EINVAL);
    c.request(0, 0, 3, (1 << 20) - 256, 512, b""); // read past the end
    assert_eq!(c.simple(512).0, EINVAL);
    c.request(0, 0, 4, u64::MAX - 10, 512, b""); // offset + length overflows
    assert_eq!(c.simple(512).0, EINVAL);
    // A write past the end: the payload is read (the next request follows
    // it) and the answer is ENOSPC, not EINVAL. The NBD specification
    // ("Error values") says a server SHOULD return ENOSPC for a write
    // request including sectors beyond the size of the device. nbdkit
    // answers so too (qemu-nbd answers EINVAL to everything past the end),
    // and libnbd refuses such a write itself with ENOSPC before it leaves.
    // Reads, trims and block status past the end get EINVAL (the
    // specification leaves their answer to the server; nbdkit's too).
    c.request(0, 1, 5, (1 << 20) - 2, 4, b"abcd");
    assert_eq!(c.simple(0), (ENOSPC, 5, vec![]));
    c.request(0, 0, 6, 0, 128 << 10, b""); // read over the maximum payload
    assert_eq!(c.simple(0).0, EINVAL);
    let big = vec![0x77u8; 200 << 10];
    c.request(0, 1, 7, 0, big.len() as u32, &big); // write over the maximum: payload skipped
    assert_eq!(c.simple(0), (EINVAL, 7, vec![]));
    c.request(0, 7, 8, 0, 4096, b""); // block status without a context
    assert_eq!(c.simple(0).0, EINVAL);
    c.request(1 << 1, 1, 9, 0, 2, b"no"); // NO_HOLE is not a WRITE flag
    assert_eq!(c.simple(0).0, EINVAL);
    assert_eq!(store.allocated_bytes(), 0, "no refused write reached the store");

    // Still in step: a write, a zero-length read, a read.
    c.request(1, 1, 10, 4096, 5, b"hello"); // FUA
    assert_eq!(c.simple(0), (0, 10, vec![]));
    c.request(0, 0, 11, 0, 0, b"");
    assert_eq!(c.simple(0), (0, 11, vec![]));
    c.request(0, 0, 12, 4094, 8, b"");
    assert_eq!(c.simple(8), (0, 12, b"\0\0hello\0".to_vec()));
    c.request(0, 2, 13, 0, 0, b""); // DISC: no reply, the server closes
    assert!(c.closed());
}

#[test]
fn structured_reads_block_status_and_a_flush_seen_by_every_connection() {
    let (addr, _) = server(4 << 20);
    let mut c = Client::connect(&addr);
    c.option(8, b"");
    assert_eq!(c.reply().1, REP_ACK);
    let mut q = string("");
    q.extend_from_slice(&1u32.to_be_bytes());
    q.extend_from_slice(&string("base:allocation"));
    c.option(10, &q);
    assert_eq!(c.reply().1, REP_META_CONTEXT);
    assert_eq!(c.reply().1, REP_ACK);
    let mut go = string("");
    go.extend_from_slice(&0u16.to_be_bytes());
    c.option(7, &go);
    let (_, t, export) = c.reply();
    assert_eq!(t, REP_INFO);
    let flags = u16::from_be_bytes(export[10..12].try_into().unwrap());
    assert_ne!(flags & (1 << 7), 0, "DF offered with structured replies");
    while c.reply().1 != REP_ACK {}

    // Write through a second connection, flush through the first, read
    // through the first: one store behind every connection.
    let mut other = Client::connect(&addr);
    other.export_name();
    other.request(0, 1, 1, 1 << 20, 6, b"shared");
    assert_eq!(other.simple(0).0, 0);
    c.request(0, 3, 2, 0, 0, b""); // FLUSH
                                   // Successes without data get simple replies even with structured
                                   // replies negotiated (the protocol allows it for all but reads).
    assert_eq!(c.simple(0), (0, 2, vec![]));
    c.request(1 << 2, 0, 3, 1 << 20, 6, b""); // READ with DF
    let (f, t, h, payload) = c.chunk();
    assert_eq!((f, t, h), (1, 1, 3), "one OFFSET_DATA chunk, DONE");
    assert_eq!(&payload[..8], &(1u64 << 20).to_be_bytes());
    assert_eq!(&payload[8..], b"shared");

    // Without DF, a read over holes sends them as OFFSET_HOLE chunks and
    // only the data as OFFSET_DATA, then NONE with DONE.
    c.request(0, 0, 9, (1 << 20) - (32 << 10), 64 << 10, b"");
    let (f, t, _, p) = c.chunk();
    let hole = [((1u64 << 20) - (32 << 10)).to_be_bytes().as_slice(), &(32u32 << 10).to_be_bytes()].concat();
    assert_eq!((f, t, p), (0, 2, hole));
    let (f, t, _, p) = c.chunk();
    assert_eq!((f, t, &p[..8]), (0, 1, &(1u64 << 20).to_be_bytes()[..]));
    assert_eq!(p.len(), 8 + (32 << 10));
    assert_eq!(&p[8..14], b"shared");
    assert!(p[14..].iter().all(|&b| b == 0));
    assert_eq!(c.chunk(), (1, 0, 9, vec![]));

    // Block status: a hole, the 64 KiB chunk written, a hole.
    c.request(0, 7, 4, 0, 4 << 20, b"");
    let (f, t, _, p) = c.chunk();
    assert_eq!((f, t), (1, 5));
    assert_eq!(u32::from_be_bytes(p[..4].try_into().unwrap()), 1, "context id");
    let ext: Vec<(u32, u32)> = p[4..]
        .chunks(8)
        .map(|d| (u32::from_be_bytes(d[..4].try_into().unwrap()), u32::from_be_bytes(d[4..].try_into().unwrap())))
        .collect();
    assert_eq!(ext, vec![(1 << 20, 3), (64 << 10, 0), ((3 << 20) - (64 << 10), 3)]);
    c.request(1 << 3, 7, 5, 0, 4 << 20, b""); // REQ_ONE
    let (_, _, _, p) = c.chunk();
    assert_eq!(p.len(), 12);
    // Errors come as an error chunk with a message.
    c.request(0, 0, 6, 4 << 20, 1, b"");
    let (f, t, h, p) = c.chunk();
    assert_eq!((f, t, h), (1, (1 << 15) + 1, 6));
    assert_eq!(u32::from_be_bytes(p[..4].try_into().unwrap()), EINVAL);
    // Trim frees; status shows the hole again.
    c.request(0, 4, 7, 1 << 20, 64 << 10, b"");
    assert_eq!(c.simple(0), (0, 7, vec![]));
    c.request(0, 7, 8, 0, 4 << 20, b"");
    let (_, _, _, p) = c.chunk();
    assert_eq!(p[4..], [(4u32 << 20).to_be_bytes(), 3u32.to_be_bytes()].concat()[..]);

    // A write on a structured connection, small and large (received
    // straight into the store): simple replies too; an empty read gets a
    // structured NONE chunk, never a simple reply.
    c.request(0, 1, 10, 8 << 10, 4, b"tiny");
    assert_eq!(c.simple(0), (0, 10, vec![]));
    c.request(0, 1, 11, 2 << 20, 64 << 10, &vec![7u8; 64 << 10]);
    assert_eq!(c.simple(0), (0, 11, vec![]));
    c.request(0, 0, 12, 0, 0, b"");
    assert_eq!(c.chunk(), (1, 0, 12, vec![]));
    c.request(0, 4, 13, 8 << 10, 4, b""); // TRIM what was just written
    assert_eq!(c.simple(0), (0, 13, vec![]));
    c.request(0, 4, 14, 2 << 20, 64 << 10, b"");
    assert_eq!(c.simple(0), (0, 14, vec![]));
}

#[test]
fn the_store_behind_the_server_is_the_one_given() {
    let (addr, store) = server(1 << 20);
    let mut c = Client::connect(&addr);
    c.export_name();
    c.request(0, 1, 1, 100, 3, b"abc");
    assert_eq!(c.simple(0).0, 0);
    let mut b = [0u8; 3];
    store.read_at(100, &mut b).unwrap();
    assert_eq!(&b, b"abc");
}

/// Garbage in every phase (random bytes after the greeting, after the
/// handshake, huge option lengths): each such connection ends or is
/// answered, and the server goes on serving a well-behaved client.
#[test]
fn garbage_never_takes_the_server_down() {
    let (addr, _) = server(1 << 20);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    };
    for round in 0..40 {
        let mut c = Client::connect(&addr);
        match round % 4 {
            0 => c.s.write_all(&random(64 + round * 7)).unwrap(),
            1 => {
                // An option claiming 1 GiB of data.
                let mut m = IHAVEOPT.to_be_bytes().to_vec();
                m.extend_from_slice(&7u32.to_be_bytes());
                m.extend_from_slice(&(1u32 << 30).to_be_bytes());
                c.s.write_all(&m).unwrap();
                assert!(c.closed());
                continue;
            }
            2 => {
                c.export_name();
                let mut junk = random(28 * 3);
                junk[..4].copy_from_slice(&0x2560_9513u32.to_be_bytes()); // one valid magic, wild fields
                let _ = c.s.write_all(&junk);
            }
            _ => {
                c.option(8, b"");
                c.reply();
                c.option(7, &random(round));
            }
        }
        let _ = c.s.shutdown(std::net::Shutdown::Write);
        // Drain whatever the server answers until it closes.
        let mut sink = Vec::new();
        let _ = c.s.read_to_end(&mut sink);
    }
    let mut ok = Client::connect(&addr);
    ok.export_name();
    ok.request(0, 1, 1, 0, 2, b"ok");
    assert_eq!(ok.simple(0).0, 0);
    ok.request(0, 0, 2, 0, 2, b"");
    assert_eq!(ok.simple(2), (0, 2, b"ok".to_vec()));
}

/// Requests that arrive together — reads, a write with its payload in the
/// middle, a read past the end, more reads, a flush — are answered in
/// order and correctly: the reads' replies leave together (more of them
/// than fit the connection's 64 KiB buffer at once), the write's payload
/// lands whole, and the error comes where it belongs.
#[test]
fn pipelined_requests_sent_in_one_write_are_answered_in_order() {
    let (addr, store) = server(1 << 20);
    let pattern: Vec<u8> = (0..1 << 20).map(|i: u32| (i.wrapping_mul(7) >> 3) as u8).collect();
    store.write_at(0, &pattern, false).unwrap();
    let mut c = Client::connect(&addr);
    c.export_name();
    let head = |kind: u16, handle: u64, offset: u64, len: u32| request_header(0, kind, handle, offset, len);
    let mut all = Vec::new();
    for i in 0..40u64 {
        all.extend(head(0, i, i * 12288, 4096));
    }
    all.extend(head(1, 100, 8192, 4096));
    all.extend(vec![0xabu8; 4096]);
    all.extend(head(0, 101, 1 << 20, 4096));
    for i in 0..10u64 {
        all.extend(head(0, 200 + i, 4096 * (i + 1), 8192));
    }
    all.extend(head(3, 300, 0, 0));
    // Writes back to back (their replies wait for each other), an empty
    // write, a read of what they wrote, and the disconnect right behind.
    for i in 0..3u64 {
        all.extend(head(1, 400 + i, 65536 + i * 4096, 4096));
        all.extend(vec![0x10 + i as u8; 4096]);
    }
    all.extend(head(1, 403, 0, 0));
    all.extend(head(0, 404, 65536, 3 * 4096));
    all.extend(head(2, 405, 0, 0));
    c.s.write_all(&all).expect("send the pipeline");
    let mut now = pattern.clone();
    for i in 0..40u64 {
        let (err, handle, data) = c.simple(4096);
        assert_eq!((err, handle), (0, i));
        assert!(data[..] == pattern[(i * 12288) as usize..][..4096], "read {i}");
    }
    assert_eq!(c.simple(0), (0, 100, vec![]));
    now[8192..12288].fill(0xab);
    assert_eq!(c.simple(0), (EINVAL, 101, vec![]));
    for i in 0..10u64 {
        let (err, handle, data) = c.simple(8192);
        assert_eq!((err, handle), (0, 200 + i));
        assert!(data[..] == now[(4096 * (i + 1)) as usize..][..8192], "read {}", 200 + i);
    }
    assert_eq!(c.simple(0), (0, 300, vec![]));
    for i in 0..4u64 {
        assert_eq!(c.simple(0), (0, 400 + i, vec![]));
    }
    let (err, handle, data) = c.simple(3 * 4096);
    assert_eq!((err, handle), (0, 404));
    for i in 0..3usize {
        assert!(data[i * 4096..(i + 1) * 4096].iter().all(|&b| b == 0x10 + i as u8), "write {i}");
    }
    assert!(c.closed(), "NBD_CMD_DISC closes the connection after the replies");
}

/// Hundreds of small writes sent in one go, more than the server takes
/// from the socket in one receive: headers and payloads are cut at
/// arbitrary points between receives, a write larger than the maximum
/// payload (answered with an error, its payload skipped) and one large
/// enough to land in the store come in the middle, and every byte ends
/// up where its write said.
#[test]
fn small_writes_cut_anywhere_between_receives_land_whole_and_in_order() {
    let (addr, store) = server(1 << 20);
    let mut c = Client::connect(&addr);
    c.export_name();
    let head = |kind: u16, handle: u64, offset: u64, len: u32| request_header(0, kind, handle, offset, len);
    let mut all = Vec::new();
    let mut want = vec![0u8; 1 << 20];
    let mut replies = Vec::new();
    // 1001 bytes each: 1029 bytes a request, so receives end anywhere.
    let small = |all: &mut Vec<u8>, want: &mut Vec<u8>, replies: &mut Vec<(u32, u64)>, i: u64| {
        let off = i * 1001;
        let byte = (i % 251) as u8 + 1;
        all.extend(head(1, i, off, 1001));
        all.extend(vec![byte; 1001]);
        want[off as usize..off as usize + 1001].fill(byte);
        replies.push((0, i));
    };
    for i in 0..300 {
        small(&mut all, &mut want, &mut replies, i);
    }
    all.extend(head(1, 5000, 0, (64 << 10) + 1));
    all.extend(vec![0xeeu8; (64 << 10) + 1]);
    replies.push((EINVAL, 5000));
    all.extend(head(1, 5001, 512 << 10, 64 << 10));
    all.extend(vec![0x77u8; 64 << 10]);
    want[512 << 10..576 << 10].fill(0x77);
    replies.push((0, 5001));
    for i in 300..500 {
        small(&mut all, &mut want, &mut replies, i);
    }
    let mut sender = c.s.try_clone().expect("clone");
    let send = std::thread::spawn(move || sender.write_all(&all).expect("send the writes"));
    for (i, want) in replies.iter().enumerate() {
        let (err, handle, _) = c.simple(0);
        assert_eq!((err, handle), *want, "reply {i}");
    }
    send.join().expect("sender");
    let mut got = vec![0u8; 1 << 20];
    store.read_at(0, &mut got).unwrap();
    assert!(got == want, "the store holds what the writes said");
}

/// The thread serving a connection runs under `SCHED_BATCH` (3), so it
/// does not preempt its client when woken; with `batch_threads` off it
/// keeps the normal policy (0).
#[test]
fn connection_threads_run_as_batch_threads_unless_told_not_to() {
    assert_eq!(connection_policies(true), [3]);
    assert_eq!(connection_policies(false), [0]);
}

/// The scheduling policies of the threads serving one client of a server
/// with `batch_threads` as given.
fn connection_policies(batch_threads: bool) -> Vec<u32> {
    let store = Arc::new(MemStore::new(1 << 20).expect("store"));
    let config = ServerConfig { batch_threads, ..ServerConfig::default() };
    let server = NbdServer::bind(&"tcp:127.0.0.1:0".parse().expect("addr"), store, config).expect("bind");
    let addr = server.local_addr().to_string().strip_prefix("tcp:").expect("tcp").to_string();
    server.spawn(|_| {}).expect("accept thread");
    // Thread names are cut to 15 bytes ("nbd tcp:127.0.0" for every other
    // test's client): a client address of its own for each case.
    let from = std::net::Ipv4Addr::new(127, if batch_threads { 91 } else { 92 }, 0, 1);
    let mut c = Client::connect_from(from, &addr);
    c.export_name();
    // A request answered: the connection's thread is running by now.
    c.request(0, 3, 1, 0, 0, b"");
    assert_eq!(c.simple(0).0, 0);
    let local = c.s.local_addr().expect("local address").to_string();
    // The thread's name: "nbd tcp:CLIENT", cut to 15 bytes by the kernel.
    let name: String = format!("nbd tcp:{local}").chars().take(15).collect();
    let mut policies = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").expect("tasks") {
        let dir = task.expect("task").path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim_end() != name {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).expect("stat");
        // Field 41 (policy), counted after the command's closing parenthesis.
        let after = stat.rsplit_once(')').expect("stat format").1;
        let policy: u32 = after.split_whitespace().nth(38).expect("policy field").parse().expect("number");
        policies.push(policy);
    }
    assert!(!policies.is_empty(), "no thread named {name:?}");
    policies
}

/// A client on the same machine gets a connection whose send buffer is
/// fixed at a few hundred KiB (the kernel would grow it to megabytes, and
/// the client would copy its replies from memory no longer in the
/// caches). The server's end of the connection is found among this
/// process's descriptors by its peer, the client's address.
#[test]
fn loopback_connections_keep_a_short_send_buffer() {
    use std::os::fd::FromRawFd;
    let (addr, _) = server(1 << 20);
    let mut c = Client::connect(&addr);
    c.export_name();
    c.request(0, 3, 1, 0, 0, b"");
    assert_eq!(c.simple(0).0, 0);
    let client = c.s.local_addr().expect("local address");
    let mut sizes = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").expect("fds") {
        let Some(fd) = entry.expect("fd").file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: the stream is never dropped (so the descriptor, owned
        // elsewhere in this process, is not closed here); on a descriptor
        // that is not a socket, or closed meanwhile, the calls below fail.
        let s = std::mem::ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd) });
        if s.peer_addr().ok() == Some(client) {
            sizes.push(rustix::net::sockopt::socket_send_buffer_size(&*s).expect("SO_SNDBUF"));
        }
    }
    assert_eq!(sizes.len(), 1, "one server socket whose peer is {client}");
    assert!((256 << 10..=512 << 10).contains(&sizes[0]), "send buffer {} bytes", sizes[0]);
}

/// Large writes whose payload waits whole on the socket are received
/// straight into the memory store's chunks, and large reads are sent
/// straight from them: the bytes are the ones written, and the summary
/// says the copies were saved.
#[test]
fn large_writes_land_in_the_store_and_large_reads_leave_from_it() {
    let (addr, store, summaries) = server_with_summaries(8 << 20);
    let mut c = Client::connect(&addr);
    c.export_name();
    let data: Vec<u8> = (0..4u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    // 256 KiB writes at offsets that are not chunk-aligned, one at a time.
    let piece = 256 << 10;
    for (i, part) in data.chunks(piece).enumerate() {
        c.request(0, 1, i as u64, 1000 + (i * piece) as u64, piece as u32, part);
        assert_eq!(c.simple(0), (0, i as u64, vec![]));
    }
    let mut back = vec![0u8; data.len()];
    store.read_at(1000, &mut back).unwrap();
    assert!(back == data, "the store holds the bytes written");
    // Reads of 1 MiB (over data and a hole at the end of the store).
    let mut expect = vec![0u8; 8 << 20];
    expect[1000..1000 + data.len()].copy_from_slice(&data);
    for i in 0..8u64 {
        c.request(0, 0, 100 + i, i << 20, 1 << 20, b"");
        let (err, handle, got) = c.simple(1 << 20);
        assert_eq!((err, handle), (0, 100 + i));
        assert!(got[..] == expect[(i << 20) as usize..][..1 << 20], "read {i}");
    }
    c.request(0, 2, 200, 0, 0, b"");
    assert!(c.closed());
    let summary = summaries.recv_timeout(Duration::from_secs(30)).expect("summary");
    assert_eq!(summary.write_bytes, data.len() as u64);
    // Each write arrives while the server waits for the next request: it
    // looks at what arrived before taking it, so the payload lands too.
    // (Not all of it need: a payload still on its way after a moment goes
    // through the connection's buffer.)
    assert!(summary.landed_bytes >= summary.write_bytes / 2, "writes did not land in the store: {summary}");
    assert!(summary.sent_direct_bytes > 0, "no read left from the store: {summary}");
    assert!(summary.landed_bytes <= summary.write_bytes && summary.sent_direct_bytes <= summary.read_bytes);
}

/// A client that sends a write's header and only part of its payload does
/// not hold the store: another connection reads and writes the same
/// chunks meanwhile, and the write, once its payload is all there, lands
/// whole. A client that does not read its replies does not hold the
/// store either.
#[test]
fn slow_clients_hold_no_part_of_the_store() {
    let (addr, store, _summaries) = server_with_summaries(4 << 20);
    let mut slow = Client::connect(&addr);
    slow.export_name();
    let mut other = Client::connect(&addr);
    other.export_name();
    let payload = vec![0x5au8; 256 << 10];
    let mut head = 0x2560_9513u32.to_be_bytes().to_vec();
    head.extend_from_slice(&0u16.to_be_bytes());
    head.extend_from_slice(&1u16.to_be_bytes());
    head.extend_from_slice(&1u64.to_be_bytes());
    head.extend_from_slice(&0u64.to_be_bytes());
    head.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    slow.s.write_all(&head).unwrap();
    slow.s.write_all(&payload[..1000]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    other.request(0, 1, 2, 64 << 10, 9, b"meanwhile");
    assert_eq!(other.simple(0), (0, 2, vec![]));
    other.request(0, 0, 3, 0, 128 << 10, b"");
    assert_eq!(other.simple(128 << 10).0, 0);
    slow.s.write_all(&payload[1000..]).unwrap();
    assert_eq!(slow.simple(0), (0, 1, vec![]));
    let mut back = vec![0u8; payload.len()];
    store.read_at(0, &mut back).unwrap();
    assert!(back == payload, "the write landed whole");

    // 64 reads of 1 MiB asked for and none of the replies read: the
    // server cannot send them all; the store stays free for the other.
    for i in 0..64u64 {
        slow.request(0, 0, 10 + i, (i % 4) << 20, 1 << 20, b"");
    }
    std::thread::sleep(Duration::from_millis(200));
    for i in 0..4u64 {
        other.request(0, 1, 20 + i, i << 20, 3, b"new");
        assert_eq!(other.simple(0), (0, 20 + i, vec![]));
    }
    // Every reply is whole: each 64 KiB chunk read either before or after
    // the other's write.
    for i in 0..64u64 {
        let (err, handle, got) = slow.simple(1 << 20);
        assert_eq!((err, handle), (0, 10 + i));
        let start = ((i % 4) << 20) as usize;
        let mut was = vec![0u8; 1 << 20];
        if start == 0 {
            was[..payload.len()].copy_from_slice(&payload);
        }
        let mut now = was.clone();
        now[..3].copy_from_slice(b"new");
        assert!(got == was || got == now, "read {i} is the data before or after the write");
    }
}

/// Data segments the kernel has received on `s` so far
/// (`tcpi_data_segs_in` of `TCP_INFO`): how many sends of the server's
/// reached this socket, over loopback where every send the server makes
/// with `TCP_NODELAY` leaves as a segment of its own.
fn data_segments_in(s: &TcpStream) -> u32 {
    use std::os::fd::AsRawFd;
    // SAFETY: all-zero bytes are a valid `tcp_info` (integers only).
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` and `len` are valid for writes for the duration of
    // the call, and `len` holds the size of `info`.
    let rc =
        unsafe { libc::getsockopt(s.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_INFO, (&raw mut info).cast(), &mut len) };
    assert_eq!(rc, 0, "TCP_INFO: {}", std::io::Error::last_os_error());
    info.tcpi_data_segs_in
}

/// Replies without data (trim, write-zeroes, cache, flush) to requests
/// that arrive together leave together, like the replies of reads and
/// writes: the client finds them in a few segments, not one each.
#[test]
fn replies_without_data_to_pipelined_requests_leave_together() {
    let (addr, store) = server(1 << 20);
    store.write_at(0, &[0xffu8; 1 << 16], false).unwrap();
    let mut c = Client::connect(&addr);
    c.export_name();
    // One request first, so the connection's receive-ahead buffer exists.
    c.request(0, 3, 1000, 0, 0, b"");
    assert_eq!(c.simple(0), (0, 1000, vec![]));
    let before = data_segments_in(&c.s);
    let kinds = [4u16, 6, 5, 3]; // TRIM, WRITE_ZEROES, CACHE, FLUSH
    let n = 32u64;
    let mut all = Vec::new();
    for i in 0..n {
        let kind = kinds[i as usize % kinds.len()];
        let len = if kind == 3 { 0 } else { 1024 };
        all.extend(request_header(0, kind, i, i * 1024, len));
    }
    c.s.write_all(&all).expect("send the pipeline");
    for i in 0..n {
        assert_eq!(c.simple(0), (0, i, vec![]), "reply {i}");
    }
    let segments = data_segments_in(&c.s) - before;
    assert!(segments <= n as u32 / 4, "{n} replies came in {segments} segments");
    let mut back = vec![0u8; 1 << 16];
    store.read_at(0, &mut back).unwrap();
    for i in 0..n as usize {
        let want = if kinds[i % kinds.len()] == 4 || kinds[i % kinds.len()] == 6 { 0 } else { 0xff };
        assert!(back[i * 1024..(i + 1) * 1024].iter().all(|&b| b == want), "range {i}");
    }
}

/// A reply waiting to leave with the ones that follow leaves as soon as
/// the server has to wait for the rest of a request: a client that sent a
/// write and only part of the next one's payload gets the first one's
/// reply — whether the next payload goes through the connection's buffer
/// or lands in the store.
#[test]
fn replies_leave_before_the_server_waits_for_the_rest_of_a_payload() {
    let (addr, _store) = server(1 << 20);
    let mut c = Client::connect(&addr);
    c.export_name();
    // The reply that would wait is there within seconds, or never.
    c.s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let whole = |handle: u64, offset: u64, len: usize| {
        let mut m = request_header(0, 1, handle, offset, len as u32);
        m.extend(vec![handle as u8; len]);
        m
    };
    let mut handle = 0;
    // (size of the first write, size of the second, small writes first)
    for (first, second) in [(4096, 4096), (64 << 10, 64 << 10), (64 << 10, 4096)] {
        // A large write alone first: after it the server looks at what
        // waits before taking it (the path where writes land).
        if first >= 64 << 10 {
            handle += 1;
            c.s.write_all(&whole(handle, 0, 64 << 10)).expect("send");
            assert_eq!(c.simple(0), (0, handle, vec![]));
        }
        let mut m = whole(handle + 1, 0, first);
        m.extend(request_header(0, 1, handle + 2, 128 << 10, second as u32));
        m.extend(vec![0x33u8; 1000]);
        c.s.write_all(&m).expect("send");
        let got = {
            let mut h = [0u8; 16];
            c.s.read_exact(&mut h).map(|()| u64::from_be_bytes(h[8..].try_into().unwrap()))
        };
        assert_eq!(
            got.ok(),
            Some(handle + 1),
            "the reply to a {first}-byte write waited for the rest of the next {second}-byte write"
        );
        c.s.write_all(&vec![0x33u8; second - 1000]).expect("send the rest");
        assert_eq!(c.simple(0), (0, handle + 2, vec![]));
        handle += 2;
    }
}

/// A client that sends its requests and shuts its side of the connection
/// down at once gets every reply before the server closes. (The requests
/// go with the handshake's last option, so the end of the stream is
/// there by the time the server takes them.)
#[test]
fn a_client_that_half_closes_gets_its_replies() {
    let (addr, _store) = server(1 << 20);
    let mut c = Client::connect(&addr);
    let mut m = IHAVEOPT.to_be_bytes().to_vec();
    m.extend_from_slice(&1u32.to_be_bytes()); // NBD_OPT_EXPORT_NAME ""
    m.extend_from_slice(&0u32.to_be_bytes());
    for i in 0..5u64 {
        m.extend(request_header(0, 1, i, i * 4096, 4096));
        m.extend(vec![i as u8; 4096]);
    }
    c.s.write_all(&m).expect("send");
    c.s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let mut export = [0u8; 10];
    c.s.read_exact(&mut export).expect("export reply");
    for i in 0..5u64 {
        assert_eq!(c.simple(0), (0, i, vec![]), "reply {i}");
    }
    assert!(c.closed());
}

/// Plain text off the loopback is a choice: without TLS required or
/// `insecure`, binding a TCP address that is not a loopback address is
/// refused before any socket is made; loopback and Unix sockets bind as
/// before.
#[test]
fn plain_text_off_the_loopback_is_refused_unless_chosen() {
    let store: Arc<dyn Store> = Arc::new(MemStore::new(1 << 20).unwrap());
    let off_loopback = "tcp:192.0.2.1:0".parse().unwrap();
    let err = NbdServer::bind(&off_loopback, store.clone(), ServerConfig::default()).err().expect("refused");
    assert!(matches!(&err, ferry_block::Error::BadSpec(m) if m.contains("not a loopback address")), "{err}");
    // Chosen on purpose: the server tries to listen there (this test
    // machine does not have that address).
    let insecure = ServerConfig { insecure: true, ..ServerConfig::default() };
    let err = NbdServer::bind(&off_loopback, store.clone(), insecure).err().expect("no such address here");
    assert!(matches!(err, ferry_block::Error::Io { .. }), "{err}");
    assert!(NbdServer::bind(&"tcp:127.0.0.1:0".parse().unwrap(), store.clone(), ServerConfig::default()).is_ok());
    if std::net::TcpListener::bind("[::1]:0").is_ok() {
        assert!(NbdServer::bind(&"tcp:[::1]:0".parse().unwrap(), store, ServerConfig::default()).is_ok());
    }
}

/// Make `fsync` and `fdatasync` fail with `EIO` in the calling thread and
/// in every thread it starts from now on (a seccomp filter: the kernel
/// answers the real system calls, as a disk whose cache flush fails
/// would). Other threads of the test process are not affected; the filter
/// ends with the threads that carry it.
fn fail_syncs_with_eio() {
    #[cfg(target_arch = "x86_64")]
    const ARCH: u32 = 0xC000_003E; // AUDIT_ARCH_X86_64
    #[cfg(target_arch = "aarch64")]
    const ARCH: u32 = 0xC000_00B7; // AUDIT_ARCH_AARCH64
    const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    let op = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    let eio = libc::SECCOMP_RET_ERRNO | libc::EIO as u32;
    let program = [
        op(LD_W_ABS, 0, 0, 4), // seccomp_data.arch
        op(JEQ_K, 0, 4, ARCH),
        op(LD_W_ABS, 0, 0, 0), // seccomp_data.nr
        op(JEQ_K, 2, 0, libc::SYS_fdatasync as u32),
        op(JEQ_K, 1, 0, libc::SYS_fsync as u32),
        op(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
        op(RET_K, 0, 0, eio),
    ];
    let prog = libc::sock_fprog { len: program.len() as u16, filter: program.as_ptr() as *mut libc::sock_filter };
    // SAFETY: plain prctl calls; `prog` points at `program`, both alive
    // for the call (the kernel copies the filter).
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0, "no_new_privs");
        assert_eq!(
            libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const libc::sock_fprog),
            0,
            "seccomp filter: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// FUA and FLUSH on a file store are `fdatasync`: the client is told its
/// data is on stable storage only once the kernel said so. The sync is
/// observed as the kernel's answer to it: in a thread whose `fdatasync`
/// fails (as a disk's failing cache flush makes it fail), every request
/// that claims durability (a write, a trim and a write of zeroes with FUA,
/// a flush) is answered EIO, while the same requests without FUA, which
/// issue no sync, succeed. A server that skipped the sync would answer a
/// FUA write with success.
#[test]
fn fua_and_flush_are_answered_only_after_the_file_is_synced() {
    const EIO: u32 = 5;
    const FUA: u16 = 1;
    const WRITE: u16 = 1;
    const FLUSH: u16 = 3;
    const TRIM: u16 = 4;
    const WRITE_ZEROES: u16 = 6;
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ferry-block-fua-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = Arc::new(ferry_block::FileStore::open(&dir.join("disk"), Some(1 << 20), false).expect("file store"));
    // The store itself, then the server: this thread and the server's
    // threads (started below, from here) cannot sync any more.
    fail_syncs_with_eio();
    store.write_at(0, b"plain", false).expect("a write without FUA issues no sync");
    let refused = store.write_at(8, b"durable", true).expect_err("a FUA write whose sync failed");
    assert_eq!(refused.raw_os_error(), Some(libc::EIO), "{refused}");
    assert!(store.flush().is_err(), "a flush whose sync failed");
    assert!(store.trim(4096, 4096, true).is_err(), "a FUA trim whose sync failed");
    assert!(store.write_zeroes(8192, 4096, false, true).is_err(), "a FUA write of zeroes whose sync failed");

    let config = ServerConfig { max_payload: 64 << 10, ..ServerConfig::default() };
    let server = NbdServer::bind(&"tcp:127.0.0.1:0".parse().unwrap(), store.clone(), config).expect("bind");
    let addr = server.local_addr().to_string();
    server.spawn(|_| {}).expect("accept thread");
    let mut c = Client::connect(addr.strip_prefix("tcp:").unwrap());
    let (_, flags) = c.export_name();
    assert_ne!(flags & (1 << 3), 0, "NBD_FLAG_SEND_FUA");
    c.request(0, WRITE, 1, 4096, 5, b"first");
    assert_eq!(c.simple(0), (0, 1, vec![]), "a write without FUA");
    c.request(FUA, WRITE, 2, 8192, 6, b"second");
    assert_eq!(c.simple(0), (EIO, 2, vec![]), "a FUA write must not succeed when its sync fails");
    c.request(0, FLUSH, 3, 0, 0, b"");
    assert_eq!(c.simple(0), (EIO, 3, vec![]), "a flush whose sync failed");
    c.request(0, TRIM, 4, 65536, 4096, b"");
    assert_eq!(c.simple(0), (0, 4, vec![]), "a trim without FUA");
    c.request(FUA, TRIM, 5, 65536, 4096, b"");
    assert_eq!(c.simple(0), (EIO, 5, vec![]), "a FUA trim whose sync failed");
    c.request(0, WRITE_ZEROES, 6, 65536, 4096, b"");
    assert_eq!(c.simple(0), (0, 6, vec![]), "a write of zeroes without FUA");
    c.request(FUA, WRITE_ZEROES, 7, 65536, 4096, b"");
    assert_eq!(c.simple(0), (EIO, 7, vec![]), "a FUA write of zeroes whose sync failed");
    // The bytes are in the file all the same (only their durability failed).
    c.request(0, 0, 8, 4096, 5, b"");
    assert_eq!(c.simple(5), (0, 8, b"first".to_vec()));
    drop(c);
    let _ = std::fs::remove_dir_all(dir);
}
