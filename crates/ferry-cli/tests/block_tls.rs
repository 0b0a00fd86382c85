//! `ferry block serve --tls=off|on|require --tls-certificates DIR` used by
//! unmodified NBD clients over TLS (`NBD_OPT_STARTTLS`): nbdinfo and
//! nbdcopy (libnbd-bin) with `nbds://` URIs, qemu-img and qemu-io
//! (qemu-utils) with a `tls-creds-x509` object; clients without a
//! certificate, with one of another CA, and in plain text against
//! `--tls=require` are refused while the server goes on serving. The
//! certificates come from `ferry tls gen`, the tools from `scripts/setup`
//! (a test fails, saying so, where one is missing).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod block_support;
use block_support::{run, Server, LIMIT};

/// `ferry block serve --store mem:16M --nbd tcp:127.0.0.1:0` and `args`.
fn serve(args: &[&str]) -> Server {
    Server::start(&[&["--store", "mem:16M", "--nbd", "tcp:127.0.0.1:0"], args].concat())
}

impl Server {
    /// `IP:PORT` of the first NBD address.
    fn at(&self) -> &str {
        self.listening[0].strip_prefix("tcp:").expect("a TCP listener")
    }

    /// The next line that starts with `client` (one per NBD connection).
    fn client_line(&self) -> String {
        let t0 = Instant::now();
        while t0.elapsed() < LIMIT {
            match self.next_line() {
                Some(l) if l.starts_with("client ") => return l,
                Some(_) => {}
                None => break,
            }
        }
        panic!("no line for a client within {LIMIT:?}");
    }

    fn port(&self) -> &str {
        self.at().rsplit_once(':').expect("IP:PORT").1
    }

    /// The libnbd URI over TLS with the certificates in `dir`, naming the
    /// server `host`.
    fn nbds(&self, host: &str, dir: &Path) -> String {
        format!("nbds://{host}:{}/?tls-certificates={}", self.port(), dir.display())
    }
}

fn text(out: &Output) -> String {
    format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Run a tool and insist it succeeds; its stdout.
fn ok(program: &str, args: &[&str]) -> String {
    let out = run(program, args);
    assert!(out.status.success(), "{program} {args:?} failed ({}):\n{}", out.status, text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Run a tool and insist it fails; its output.
fn refused(program: &str, args: &[&str]) -> String {
    let out = run(program, args);
    assert!(!out.status.success(), "{program} {args:?} succeeded:\n{}", text(&out));
    text(&out)
}

/// A fresh directory for one test, removed when the test ends, passed or
/// failed.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("ferry-block-tls-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    Scratch(dir)
}

/// `ferry tls gen DIR` for a server called 127.0.0.1 and localhost.
fn certificates(dir: &Path) -> PathBuf {
    let d = dir.to_str().expect("utf-8 path");
    ok(env!("CARGO_BIN_EXE_ferry"), &["tls", "gen", d, "--host", "127.0.0.1", "--host", "localhost"]);
    dir.to_owned()
}

/// A file of `len` bytes that are not all alike.
fn pattern_file(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut data = Vec::with_capacity(len);
    while data.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.extend_from_slice(&x.to_le_bytes());
    }
    data.truncate(len);
    std::fs::write(path, &data).expect("write pattern file");
    data
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// nbdinfo sees a TLS connection; nbdcopy writes a file through
/// `nbds://` and reads it back byte for byte.
#[test]
fn nbdinfo_and_nbdcopy_over_tls() {
    let dir = scratch("libnbd");
    let pki = certificates(&dir.join("pki"));
    let server = serve(&["--tls=require", "--tls-certificates", s(&pki)]);
    let info = ok("nbdinfo", &[&server.nbds("127.0.0.1", &pki)]);
    assert!(info.contains("with TLS"), "{info}");
    assert!(info.contains("export-size: 16777216"), "{info}");
    assert!(server.client_line().contains("(TLS)"));
    // The certificate names localhost too.
    assert_eq!(ok("nbdinfo", &["--size", &server.nbds("localhost", &pki)]).trim(), "16777216");
    server.client_line();

    let src = dir.join("src.bin");
    let data = pattern_file(&src, 5 << 20, 0x7f1e);
    ok("nbdcopy", &[s(&src), &server.nbds("127.0.0.1", &pki)]);
    let back = dir.join("back.bin");
    ok("nbdcopy", &[&server.nbds("127.0.0.1", &pki), s(&back)]);
    let back = std::fs::read(&back).expect("read back");
    assert_eq!(back.len(), 16 << 20);
    assert!(back[..data.len()] == data[..], "nbdcopy reads back what it wrote through TLS");
    assert!(back[data.len()..].iter().all(|&b| b == 0));
}

/// qemu-img writes and reads through a `tls-creds-x509` object, in both
/// forms qemu takes (`--image-opts` and `json:`), and qemu-io checks a
/// pattern.
#[test]
fn qemu_img_over_tls() {
    let dir = scratch("qemu");
    let pki = certificates(&dir.join("pki"));
    let server = serve(&["--tls=require", "--tls-certificates", s(&pki)]);
    let object = format!("tls-creds-x509,id=tls0,dir={},endpoint=client", pki.display());
    let opts = format!("driver=nbd,host=127.0.0.1,port={},tls-creds=tls0", server.port());
    let src = dir.join("src.bin");
    let data = pattern_file(&src, 3 << 20, 0x51c3);
    ok("qemu-img", &["convert", "-n", "-f", "raw", "--object", &object, s(&src), "--target-image-opts", &opts]);
    let back = dir.join("back.bin");
    let json = format!(
        r#"json:{{"driver":"nbd","server":{{"type":"inet","host":"127.0.0.1","port":"{}"}},"tls-creds":"tls0"}}"#,
        server.port()
    );
    ok("qemu-img", &["convert", "-O", "raw", "--object", &object, &json, s(&back)]);
    let back = std::fs::read(&back).expect("read back");
    assert!(back[..data.len()] == data[..], "qemu-img reads back what it wrote through TLS");
    let io = ok(
        "qemu-io",
        &["--object", &object, "--image-opts", &opts, "-c", "write -P 0x5a 8M 192k", "-c", "read -P 0x5a 8M 192k"],
    );
    assert!(!io.contains("Pattern verification failed") && io.contains("read 196608/196608"), "{io}");
    // One connection each.
    for _ in 0..3 {
        assert!(server.client_line().contains("(TLS)"));
    }
}

/// Read the server's greeting and send the client flags (fixed newstyle,
/// no zeroes).
fn plain_hello(at: &str) -> TcpStream {
    let mut c = TcpStream::connect(at).expect("connect");
    c.set_read_timeout(Some(LIMIT)).unwrap();
    let mut hello = [0u8; 18];
    c.read_exact(&mut hello).expect("greeting");
    assert_eq!(&hello[..8], b"NBDMAGIC");
    c.write_all(&3u32.to_be_bytes()).unwrap();
    c
}

/// Send option `option` with `data`.
fn send_option(c: &mut TcpStream, option: u32, data: &[u8]) {
    let mut m = b"IHAVEOPT".to_vec();
    m.extend_from_slice(&option.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    c.write_all(&m).unwrap();
}

/// The reply to `option`: its type (its data skipped).
fn option_reply(c: &mut TcpStream, option: u32) -> u32 {
    let mut head = [0u8; 20];
    c.read_exact(&mut head).expect("an option reply");
    assert_eq!(u64::from_be_bytes(head[..8].try_into().unwrap()), 0x0003_e889_0455_65a9);
    assert_eq!(u32::from_be_bytes(head[8..12].try_into().unwrap()), option);
    let len = u32::from_be_bytes(head[16..].try_into().unwrap());
    let mut data = vec![0u8; len as usize];
    c.read_exact(&mut data).unwrap();
    u32::from_be_bytes(head[12..16].try_into().unwrap())
}

const OPT_EXPORT_NAME: u32 = 1;
const OPT_LIST: u32 = 3;
const OPT_STARTTLS: u32 = 5;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_ERR_POLICY: u32 = (1 << 31) + 2;
const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;

/// The option data of NBD_OPT_GO for the default export.
const GO_DEFAULT: [u8; 6] = [0; 6];

/// Against `--tls=require`: a client without a certificate, one whose
/// certificate another CA signed, and clients that stay in plain text
/// (libnbd, qemu, and one that asks for the export with
/// NBD_OPT_EXPORT_NAME) never get the export; a good client is served
/// after each.
#[test]
fn require_refuses_plain_text_and_strangers_and_goes_on_serving() {
    let dir = scratch("refuse");
    let pki = certificates(&dir.join("pki"));
    let other = certificates(&dir.join("other"));
    // No client certificate: only the CA, so the client can check the server.
    let anonymous = dir.join("anonymous");
    std::fs::create_dir_all(&anonymous).unwrap();
    std::fs::copy(pki.join("ca-cert.pem"), anonymous.join("ca-cert.pem")).unwrap();
    // A client certificate of another CA (the server's is checked as it should be).
    let stranger = dir.join("stranger");
    std::fs::create_dir_all(&stranger).unwrap();
    std::fs::copy(pki.join("ca-cert.pem"), stranger.join("ca-cert.pem")).unwrap();
    for f in ["client-cert.pem", "client-key.pem"] {
        std::fs::copy(other.join(f), stranger.join(f)).unwrap();
    }
    let server = serve(&["--tls=require", "--tls-certificates", s(&pki)]);
    let good = |server: &Server| {
        assert_eq!(ok("nbdinfo", &["--size", &server.nbds("127.0.0.1", &pki)]).trim(), "16777216");
        assert!(server.client_line().contains("(TLS) disconnected"));
    };

    refused("nbdinfo", &[&server.nbds("127.0.0.1", &anonymous)]);
    let line = server.client_line();
    assert!(line.contains("dropped: TLS handshake failed"), "{line}");
    good(&server);

    refused("nbdinfo", &[&server.nbds("127.0.0.1", &stranger)]);
    let line = server.client_line();
    assert!(line.contains("dropped: TLS handshake failed"), "{line}");
    good(&server);

    // A client that does not trust the server's CA gives up itself.
    refused("nbdinfo", &[&server.nbds("127.0.0.1", &other)]);
    let line = server.client_line();
    assert!(line.contains("(TLS) dropped") && line.contains("handshake only"), "{line}");
    good(&server);

    refused("nbdinfo", &[&format!("nbd://{}/", server.at())]);
    let line = server.client_line();
    assert!(line.contains("handshake only") && !line.contains("(TLS)"), "{line}");
    good(&server);

    let plain = format!("driver=nbd,host=127.0.0.1,port={}", server.port());
    refused("qemu-img", &["info", "--image-opts", &plain]);
    assert!(server.client_line().contains("handshake only"));
    good(&server);

    // Every option but STARTTLS is refused with NBD_REP_ERR_TLS_REQD...
    let mut c = plain_hello(server.at());
    send_option(&mut c, OPT_LIST, &[]);
    assert_eq!(option_reply(&mut c, OPT_LIST), REP_ERR_TLS_REQD);
    send_option(&mut c, OPT_GO, &GO_DEFAULT);
    assert_eq!(option_reply(&mut c, OPT_GO), REP_ERR_TLS_REQD);
    // ...and the export asked for in plain text ends the connection: not
    // one byte of it (size, flags) comes.
    send_option(&mut c, OPT_EXPORT_NAME, &[]);
    let mut rest = Vec::new();
    let _ = c.read_to_end(&mut rest);
    assert!(rest.is_empty(), "the server sent {} bytes to a plain-text client", rest.len());
    let line = server.client_line();
    assert!(line.contains("in plain text; this server requires TLS"), "{line}");
    good(&server);
}

/// `--tls=off` (the default) refuses NBD_OPT_STARTTLS with
/// NBD_REP_ERR_POLICY (so `nbds://` fails) and serves plain text;
/// `--tls=on` serves both.
#[test]
fn off_refuses_starttls_on_serves_both() {
    let dir = scratch("modes");
    let pki = certificates(&dir.join("pki"));
    let off = serve(&[]);
    let mut c = plain_hello(off.at());
    send_option(&mut c, OPT_STARTTLS, &[]);
    assert_eq!(option_reply(&mut c, OPT_STARTTLS), REP_ERR_POLICY);
    drop(c);
    off.client_line();
    refused("nbdinfo", &[&off.nbds("127.0.0.1", &pki)]);
    off.client_line();
    assert!(ok("nbdinfo", &[&format!("nbd://{}/", off.at())]).contains("without TLS"));

    let on = serve(&["--tls=on", "--tls-certificates", s(&pki)]);
    assert!(ok("nbdinfo", &[&format!("nbd://{}/", on.at())]).contains("without TLS"));
    assert!(!on.client_line().contains("(TLS)"));
    assert!(ok("nbdinfo", &[&on.nbds("127.0.0.1", &pki)]).contains("with TLS"));
    assert!(on.client_line().contains("(TLS)"));
    // STARTTLS once only: the second is refused inside TLS (libnbd does
    // not send it; checked here by the first reply only).
    let mut c = plain_hello(on.at());
    send_option(&mut c, OPT_STARTTLS, &[1]);
    assert_ne!(option_reply(&mut c, OPT_STARTTLS), REP_ACK, "STARTTLS with data is invalid");
}

/// A client that sends NBD_OPT_STARTTLS and then nothing (no TLS
/// handshake) is closed at the handshake deadline like any other.
#[test]
fn tls_handshake_has_the_handshake_deadline() {
    let dir = scratch("deadline");
    let pki = certificates(&dir.join("pki"));
    let server = serve(&["--tls=require", "--tls-certificates", s(&pki), "--handshake-timeout", "0.5"]);
    let mut c = plain_hello(server.at());
    send_option(&mut c, OPT_STARTTLS, &[]);
    assert_eq!(option_reply(&mut c, OPT_STARTTLS), REP_ACK);
    let mut rest = Vec::new();
    let _ = c.read_to_end(&mut rest);
    assert!(rest.is_empty());
    let line = server.client_line();
    assert!(line.contains("(TLS) dropped: no handshake within 0.5 s"), "{line}");
    assert_eq!(ok("nbdinfo", &["--size", &server.nbds("127.0.0.1", &pki)]).trim(), "16777216");
}

/// Off the loopback, plain text needs --insecure (and `on`, which serves
/// plain text too, needs --tls=require instead); TLS flags that cannot work
/// are refused with one line.
#[test]
fn plain_text_off_the_loopback_and_bad_tls_flags_are_refused() {
    let dir = scratch("flags");
    let pki = certificates(&dir.join("pki"));
    let serve = |args: &[&str]| {
        let out = run(env!("CARGO_BIN_EXE_ferry"), &[&["block", "serve", "--store", "mem:1M"], args].concat());
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = serve(&["--nbd", "tcp:192.0.2.1:10809"]);
    assert!(err.contains("not a loopback address") && err.contains("--insecure"), "{err}");
    let err = serve(&["--nbd", "tcp:192.0.2.1:10809", "--tls=on", "--tls-certificates", s(&pki)]);
    assert!(err.contains("--tls=require") && err.contains("--insecure"), "{err}");
    // Plain text beside TLS off the loopback is not a choice: --insecure is
    // for plain text without certificates.
    let err = serve(&["--nbd", "tcp:192.0.2.1:10809", "--tls=on", "--tls-certificates", s(&pki), "--insecure"]);
    assert!(err.contains("--insecure") && err.contains("drop one of them"), "{err}");
    let err = serve(&["--nbd", "tcp:127.0.0.1:0", "--ferry", "tcp:192.0.2.1:7000"]);
    assert!(err.contains("--ferry tcp:192.0.2.1:7000: 192.0.2.1 is not a loopback address"), "{err}");
    let err = serve(&["--nbd", "tcp:127.0.0.1:0", "--tls=require"]);
    assert!(err.contains("--tls=require needs certificates; give --tls-certificates DIR"), "{err}");
    let err = serve(&["--nbd", "tcp:127.0.0.1:0", "--tls=off", "--tls-certificates", s(&pki)]);
    assert!(err.contains("not used with --tls=off"), "{err}");
    let err = serve(&["--nbd", "tcp:127.0.0.1:0", "--tls=on", "--tls-certificates", s(&dir)]);
    assert!(err.contains("ca-cert.pem") && err.contains("missing"), "{err}");
}

/// Ferry's own block protocol over TLS: a user domain talks to
/// `ferry block proxy --tls=require` over shared memory, the proxy to
/// `ferry block serve --ferry tcp: --tls=require` over TLS (request and
/// read-data channels), and an NBD client over TLS sees the data. A
/// proxy without TLS gets nothing from that server.
#[test]
fn ferry_protocol_over_tls_through_the_proxy() {
    use ferry_block::BlockClient;
    let dir = scratch("proxy");
    let pki = certificates(&dir.join("pki"));
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let remote = format!("tcp:127.0.0.1:{port}");
    let server = serve(&["--ferry", &remote, "--tls=require", "--tls-certificates", s(&pki)]);

    // A direct client with the certificates (both channels through TLS).
    let tls = std::sync::Arc::new(ferry::tls::TlsConfig::from_dir(&pki, "127.0.0.1").unwrap());
    let options = ferry::NetOptions::default().with_security(ferry::tls::Security::Tls(tls));
    let addr = format!("127.0.0.1:{port}").parse().unwrap();
    let t0 = Instant::now();
    let mut direct = loop {
        match BlockClient::connect_tcp(&ferry::Domain::new("app"), addr, options.clone(), 4, 64 << 10, LIMIT) {
            Ok(c) => break c,
            Err(e) if t0.elapsed() < LIMIT => {
                // The server's Ferry endpoint may not listen yet.
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("a TLS client connects: {e}"),
        }
    };
    assert!(direct.has_data_channel());
    direct.write(1 << 20, &vec![0x3cu8; 128 << 10]).unwrap();
    let mut back = vec![0u8; 128 << 10];
    direct.read(1 << 20, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x3c), "reads come back through the TLS read-data channel");
    drop(direct);

    // A plain client is refused: the server speaks TLS only.
    let plain = BlockClient::connect_tcp(
        &ferry::Domain::new("plain"),
        addr,
        ferry::NetOptions::with_peer_timeout(Duration::from_secs(2)),
        4,
        64 << 10,
        Duration::from_secs(5),
    );
    assert!(plain.is_err(), "a client without TLS reaches a TLS-only server");

    let sock = dir.join("proxy.sock");
    let mut proxy = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["block", "proxy", "--listen", &format!("shm:{}", sock.display()), "--server", &remote])
        .args(["--tls=require", "--tls-certificates", s(&pki)])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start ferry block proxy");
    let mut user = BlockClient::connect(&ferry::Domain::new("user"), &ferry::Endpoint::shm(&sock), 4, 64 << 10, LIMIT)
        .expect("the user domain reaches the proxy");
    assert_eq!(user.size(), 16 << 20);
    user.write(3 << 20, &vec![0x6bu8; 100 << 10]).unwrap();
    user.flush().unwrap();
    let object = format!("tls-creds-x509,id=tls0,dir={},endpoint=client", pki.display());
    let opts = format!("driver=nbd,host=127.0.0.1,port={},tls-creds=tls0", server.port());
    let io = ok(
        "qemu-io",
        &["--object", &object, "--image-opts", &opts, "-c", "read -P 0x6b 3M 100k", "-c", "write -P 0x2d 5M 4k"],
    );
    assert!(!io.contains("Pattern verification failed"), "{io}");
    let mut back = vec![0u8; 4096];
    user.read(5 << 20, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x2d));
    drop(user);
    let _ = proxy.kill();
    let _ = proxy.wait();
}

/// Inside TLS (a client of its own, rustls with the certificates of
/// `ferry tls gen`): what was negotiated in plain text before
/// NBD_OPT_STARTTLS is forgotten (structured replies asked for in plain
/// text do not hold: a READ is answered with a simple reply), a second
/// STARTTLS is invalid, and the export is served through TLS.
#[test]
fn state_from_before_starttls_is_forgotten_and_starttls_is_once() {
    use ferry::tls::rustls;
    const OPT_STRUCTURED_REPLY: u32 = 8;
    const REP_ERR_INVALID: u32 = (1 << 31) + 3;
    let dir = scratch("raw");
    let pki = certificates(&dir.join("pki"));
    let server = serve(&["--tls=on", "--tls-certificates", s(&pki)]);
    let mut c = plain_hello(server.at());
    send_option(&mut c, OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(option_reply(&mut c, OPT_STRUCTURED_REPLY), REP_ACK);
    send_option(&mut c, OPT_STARTTLS, &[]);
    assert_eq!(option_reply(&mut c, OPT_STARTTLS), REP_ACK);
    let config = ferry::tls::TlsConfig::from_dir(&pki, "127.0.0.1").unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let conn = rustls::ClientConnection::new(config.client_config().unwrap(), name).unwrap();
    let mut t = rustls::StreamOwned::new(conn, c);
    // Option replies through TLS: the same helpers on the TLS stream.
    let reply = |t: &mut rustls::StreamOwned<rustls::ClientConnection, TcpStream>, option: u32| {
        let mut head = [0u8; 20];
        t.read_exact(&mut head).expect("an option reply through TLS");
        assert_eq!(u32::from_be_bytes(head[8..12].try_into().unwrap()), option);
        let mut data = vec![0u8; u32::from_be_bytes(head[16..].try_into().unwrap()) as usize];
        t.read_exact(&mut data).unwrap();
        u32::from_be_bytes(head[12..16].try_into().unwrap())
    };
    let option = |t: &mut rustls::StreamOwned<rustls::ClientConnection, TcpStream>, option: u32, data: &[u8]| {
        let mut m = b"IHAVEOPT".to_vec();
        m.extend_from_slice(&option.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        t.write_all(&m).unwrap();
    };
    option(&mut t, OPT_STARTTLS, &[]);
    assert_eq!(reply(&mut t, OPT_STARTTLS), REP_ERR_INVALID, "TLS is on already");
    option(&mut t, OPT_GO, &GO_DEFAULT);
    loop {
        match reply(&mut t, OPT_GO) {
            REP_ACK => break,
            3 => {} // NBD_REP_INFO
            other => panic!("NBD_OPT_GO answered {other:#x}"),
        }
    }
    // READ 8 bytes at 0 (handle 7): a simple reply, since structured
    // replies were asked for only in plain text.
    let mut req = Vec::new();
    req.extend_from_slice(&0x2560_9513u32.to_be_bytes());
    req.extend_from_slice(&0u16.to_be_bytes());
    req.extend_from_slice(&0u16.to_be_bytes());
    req.extend_from_slice(&7u64.to_be_bytes());
    req.extend_from_slice(&0u64.to_be_bytes());
    req.extend_from_slice(&8u32.to_be_bytes());
    t.write_all(&req).unwrap();
    let mut answer = [0u8; 24];
    t.read_exact(&mut answer).unwrap();
    assert_eq!(u32::from_be_bytes(answer[..4].try_into().unwrap()), 0x6744_6698, "a simple reply");
    assert_eq!(u32::from_be_bytes(answer[4..8].try_into().unwrap()), 0, "no error");
    assert_eq!(u64::from_be_bytes(answer[8..16].try_into().unwrap()), 7);
    // NBD_CMD_DISC: the server ends the TLS session.
    let mut disc = req.clone();
    disc[6..8].copy_from_slice(&2u16.to_be_bytes());
    t.write_all(&disc).unwrap();
    let line = server.client_line();
    assert!(line.contains("(TLS) disconnected (NBD_CMD_DISC)") && line.contains("1 reads"), "{line}");
    let mut rest = Vec::new();
    assert!(t.read_to_end(&mut rest).is_ok() && rest.is_empty(), "close_notify ends the TLS session cleanly");
}

/// Many requests pipelined in one go through TLS (writes and reads of
/// distinct ranges): every one is answered, the reads with the bytes the
/// writes put there, while the server holds replies for the requests it
/// has already decrypted.
#[test]
fn pipelined_requests_through_tls_are_all_answered() {
    use ferry::tls::rustls;
    let dir = scratch("pipeline");
    let pki = certificates(&dir.join("pki"));
    let server = serve(&["--tls=require", "--tls-certificates", s(&pki)]);
    let mut c = plain_hello(server.at());
    send_option(&mut c, OPT_STARTTLS, &[]);
    assert_eq!(option_reply(&mut c, OPT_STARTTLS), REP_ACK);
    let config = ferry::tls::TlsConfig::from_dir(&pki, "127.0.0.1").unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let conn = rustls::ClientConnection::new(config.client_config().unwrap(), name).unwrap();
    let mut t = rustls::StreamOwned::new(conn, c);
    // NBD_OPT_EXPORT_NAME inside TLS: size (8), flags (2), no zeroes.
    t.write_all(b"IHAVEOPT").unwrap();
    t.write_all(&OPT_EXPORT_NAME.to_be_bytes()).unwrap();
    t.write_all(&0u32.to_be_bytes()).unwrap();
    let mut export = [0u8; 10];
    t.read_exact(&mut export).unwrap();
    assert_eq!(u64::from_be_bytes(export[..8].try_into().unwrap()), 16 << 20);
    let request = |kind: u16, handle: u64, offset: u64, len: u32| {
        let mut r = Vec::with_capacity(28);
        r.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        r.extend_from_slice(&0u16.to_be_bytes());
        r.extend_from_slice(&kind.to_be_bytes());
        r.extend_from_slice(&handle.to_be_bytes());
        r.extend_from_slice(&offset.to_be_bytes());
        r.extend_from_slice(&len.to_be_bytes());
        r
    };
    const N: u64 = 200;
    let mut all = Vec::new();
    for i in 0..N {
        all.extend(request(1, i, i * 4096, 512));
        all.extend(std::iter::repeat_n(i as u8, 512));
    }
    for i in 0..N {
        all.extend(request(0, N + i, i * 4096, 512));
    }
    t.write_all(&all).unwrap();
    for i in 0..2 * N {
        let mut head = [0u8; 16];
        t.read_exact(&mut head).unwrap();
        assert_eq!(u32::from_be_bytes(head[..4].try_into().unwrap()), 0x6744_6698);
        assert_eq!(u32::from_be_bytes(head[4..8].try_into().unwrap()), 0, "request {i} failed");
        let handle = u64::from_be_bytes(head[8..].try_into().unwrap());
        assert_eq!(handle, i, "replies in order");
        if handle >= N {
            let mut data = [0u8; 512];
            t.read_exact(&mut data).unwrap();
            assert!(data.iter().all(|&b| b == (handle - N) as u8), "read {handle} sees its write");
        }
    }
    t.write_all(&request(2, 0, 0, 0)).unwrap();
    let line = server.client_line();
    assert!(line.contains("(TLS) disconnected (NBD_CMD_DISC)") && line.contains("200 reads"), "{line}");
}

/// Ferry's own block protocol with TLS given in a TCP endpoint alone
/// (`serve_endpoint`, `BlockClient::connect`): both sides take the
/// endpoint's security for the read-data channel too. Each of them is
/// also paired with the form that is given its options
/// (`serve_tcp`, `BlockClient::connect_tcp`), whose read-data channel is
/// TLS whatever the other side does: a plain read-data channel on the
/// endpoint side would not connect to it, so reads coming back prove
/// that channel encrypted.
#[test]
fn tls_endpoints_give_the_read_data_channel_their_security() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use ferry::tls::{Security, TlsConfig};
    use ferry::{Domain, Endpoint, NetOptions};
    use ferry_block::{BlockClient, MemStore};

    let dir = scratch("endpoint");
    let pki = certificates(&dir.join("pki"));
    let tls = Arc::new(TlsConfig::from_dir(&pki, "127.0.0.1").unwrap());
    let options = NetOptions::default().with_security(Security::Tls(tls));
    let limit = Duration::from_secs(20);
    for (server_by_endpoint, client_by_endpoint) in [(true, true), (true, false), (false, true)] {
        let case = format!("server by endpoint {server_by_endpoint}, client by endpoint {client_by_endpoint}");
        let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let server = {
            let (stop, options) = (stop.clone(), options.clone());
            std::thread::spawn(move || {
                let store = MemStore::new(8 << 20).unwrap();
                let domain = Domain::new("server");
                let stop = || stop.load(Ordering::Relaxed);
                if server_by_endpoint {
                    let ep = Endpoint::tcp_with(addr, options);
                    ferry_block::serve_endpoint(&domain, &ep, &store, &stop, &mut |_| {})
                } else {
                    ferry_block::serve_tcp(&domain, addr, options, &store, &stop, &mut |_| {})
                }
            })
        };
        let t0 = Instant::now();
        let mut client = loop {
            let domain = Domain::new("app");
            let c = if client_by_endpoint {
                BlockClient::connect(&domain, &Endpoint::tcp_with(addr, options.clone()), 4, 64 << 10, limit)
            } else {
                BlockClient::connect_tcp(&domain, addr, options.clone(), 4, 64 << 10, limit)
            };
            match c {
                Ok(c) => break c,
                // The server thread may not listen yet.
                Err(ferry_block::Error::Ferry(e))
                    if e == ferry::ErrorKind::EndpointNotListening && t0.elapsed() < limit =>
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("{case}: the TLS client does not connect: {e}"),
            }
        };
        assert!(client.has_data_channel(), "{case}");
        let data: Vec<u8> = (0..256u32 << 10).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        client.write(1 << 20, &data).unwrap_or_else(|e| panic!("{case}: write: {e}"));
        let mut back = vec![0u8; data.len()];
        client.read(1 << 20, &mut back).unwrap_or_else(|e| panic!("{case}: read: {e}"));
        assert!(back == data, "{case}: reads come back through the read-data channel as written");
        drop(client);
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap().unwrap_or_else(|e| panic!("{case}: the server failed: {e}"));
    }
}
