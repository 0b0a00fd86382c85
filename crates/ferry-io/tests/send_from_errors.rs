//! `Port::send_from` to a socket whose peer stops taking bytes: the error
//! comes back as it happens, never as a short count that looks like the
//! file ending, and the bytes that did move count in both ports' offsets.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use ferry_io::{IoError, Port};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferry-io-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_send_that_stalls_past_the_socket_timeout_is_an_error_with_what_moved() {
    let d = dir("send-from-stall");
    // Far more than loopback socket buffers hold (sparse: no time to write).
    let len = 256u64 << 20;
    std::fs::File::create(d.join("src")).unwrap().set_len(len).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (_peer, _) = l.accept().unwrap(); // accepted, never read
    s.set_write_timeout(Some(Duration::from_millis(300))).unwrap();
    let mut sock = Port::from_fd(s, "tcp:peer").unwrap();
    let mut src = Port::open(d.join("src")).unwrap();
    match sock.send_from(&mut src, len) {
        Err(e @ IoError::Os { op: "sendfile", .. }) => {
            assert!(e.to_string().contains("tcp:peer"), "{e}");
            assert!(src.offset() > 0 && src.offset() < len, "some bytes moved: {}", src.offset());
            assert_eq!(sock.offset(), src.offset(), "both offsets count what moved");
            assert_eq!(e.offset(), Some(sock.offset()), "and so does the error");
        }
        other => panic!("a stalled send is an error, not {other:?}"),
    }
    std::fs::remove_dir_all(d).unwrap();
}
