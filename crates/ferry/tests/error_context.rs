//! Errors name what failed: the operation, the endpoint (path, address),
//! the buffer and its pool, the channel's domain, then why and what to do;
//! code still matches on the kind. And every form of error crosses threads
//! with `?`.

use std::net::TcpListener;
use std::time::Duration;

use ferry::{
    Allocator, BindParams, Buffer, Channel, ChannelSetup, Domain, Endpoint, ErrorKind, PoolConstraints, Refused,
};

const T: Duration = Duration::from_secs(10);

/// A connected pair over a local endpoint, in domains `a` (source) and `b`.
fn pair(a: &Domain, b: &Domain) -> (Channel, Channel) {
    let ep = Endpoint::local();
    let mut tx = Channel::create(a, &ep, ChannelSetup::default()).unwrap();
    let mut rx = Channel::bind(b, &ep, BindParams::default()).unwrap();
    tx.wait_connected(T).unwrap();
    rx.wait_connected(T).unwrap();
    (tx, rx)
}

#[test]
fn a_refused_move_names_the_buffer_the_pool_the_channel_and_why() {
    let (a, b) = (Domain::new("app"), Domain::new("sink"));
    let (mut tx, _rx) = pair(&a, &b);
    let alloc = Allocator::new(&a, 2, 4096, PoolConstraints::default()).unwrap();
    let buffer = alloc.alloc().unwrap();
    let id = buffer.id();
    let refused = tx.move_buffer(buffer, b"").unwrap_err();
    assert_eq!(refused.error, ErrorKind::PoolNotAssigned(id.pool));
    let text = refused.to_string();
    let pool = id.pool.to_string();
    assert!(
        text.starts_with(&format!(
            "move buffer {} of pool {pool} over the channel of domain \"app\" on a local endpoint: pool {pool} is not assigned to this channel; ",
            id.index
        )),
        "{text}"
    );
    assert_eq!(refused.into_inner().id(), id, "the buffer comes back");
}

#[test]
fn a_bind_nobody_listens_to_names_the_path() {
    let dir = std::env::temp_dir().join(format!("ferry-error-context-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("nobody.sock");
    let e = Channel::bind(&Domain::new("d"), &Endpoint::shm(&path), BindParams::default()).unwrap_err();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(matches!(e.kind(), ErrorKind::EndpointNotListening), "{e:?}");
    let expected = format!("bind to the shm endpoint {}", path.display());
    assert_eq!(e.context(), Some(expected.as_str()));
    assert!(e.to_string().starts_with(&format!("{expected}: no channel is listening on that endpoint; ")), "{e}");
}

#[test]
fn a_connect_nobody_answers_names_the_address() {
    // A port that was free a moment ago: nobody listens there.
    let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let e = Channel::connect(&Domain::new("d"), &Endpoint::tcp(addr), BindParams::default(), Duration::from_millis(50))
        .unwrap_err();
    assert_eq!(e, ErrorKind::EndpointNotListening, "{e}");
    assert_eq!(e.context(), Some(format!("connect to the TCP endpoint {addr}").as_str()));
}

/// `?` takes a refused buffer into `Box<dyn Error + Send + Sync>`, which
/// a spawned thread hands back: the sentence survives, and the buffer is
/// returned to its pool when the error is dropped.
#[test]
fn refused_values_cross_threads_with_question_mark() {
    let (a, b) = (Domain::new("app"), Domain::new("sink"));
    let alloc = Allocator::new(&a, 1, 4096, PoolConstraints::default()).unwrap();
    let theirs = Allocator::new(&b, 1, 4096, PoolConstraints::default()).unwrap();
    let foreign = theirs.alloc().unwrap();
    let give_back = move |buffer: Buffer| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        alloc.free(buffer)?;
        Ok(())
    };
    let e = std::thread::spawn(move || give_back(foreign)).join().unwrap().unwrap_err();
    let refused = e.downcast_ref::<Refused<Buffer>>().expect("a refused buffer");
    assert_eq!(refused.error, ErrorKind::ForeignBuffer);
    assert!(e.to_string().contains("into an allocator of domain \"app\""), "{e}");
    drop(e);
    assert_eq!(theirs.available(), 1, "the buffer went home with the error");
}
