//! Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`). Each
//! feeds bytes a peer could send to one of our decoders; none may panic.

use std::sync::Arc;

use crate::proto::{self, Message};
use crate::ring::{self, RingLayout, RingMemory};

/// One descriptor slot from a peer: decoding must not panic, and whatever
/// decodes must encode back to something that decodes to the same message.
pub fn decode_slot(data: &[u8]) {
    let Some((&meta, slot)) = data.split_first() else { return };
    let meta_size = usize::from(meta) % (proto::MAX_META_SIZE + 1);
    if let Ok(msg) = Message::decode(slot, meta_size) {
        let mut again = vec![0u8; proto::slot_size(meta_size) as usize];
        msg.encode(&mut again);
        assert_eq!(Message::decode(&again, meta_size).as_ref(), Ok(&msg), "codec is not symmetric");
    }
}

/// An aggregate descriptor from a peer: a header slot and fragment-table
/// slots (`proto::decode_descriptor`), over members of sizes the input
/// chooses. Decoding must not panic; what it accepts must be a fragment
/// list inside the members' buffers, using every member, and must encode
/// back to slots that decode to the same list, both folded as a sender
/// folds it and as it came (as a router sends a received aggregate on).
pub fn aggregate_descriptor(data: &[u8]) {
    let [meta, members, rest @ ..] = data else { return };
    let meta_size = usize::from(*meta) % (proto::MAX_META_SIZE + 1);
    let members = usize::from(*members % 9);
    if rest.len() < members * 2 {
        return;
    }
    let (lens, slots) = rest.split_at(members * 2);
    // Member sizes from 1 byte to 64 KiB (real buffers are pages and more;
    // small ones make out-of-range entries easy to hit).
    let lens: Vec<usize> = lens.chunks_exact(2).map(|c| usize::from(u16::from_le_bytes([c[0], c[1]])) + 1).collect();
    let slot = proto::slot_size(meta_size) as usize;
    let Ok((m, entries, came)) = proto::decode_descriptor(slots.chunks(slot), &lens, meta_size) else { return };
    let mut used = vec![false; lens.len()];
    let mut total = 0u64;
    for e in &entries {
        let size = lens[e.member as usize] as u64;
        assert!(e.len > 0 && e.offset + e.len <= size, "entry {e:?} outside a {size}-byte member");
        used[e.member as usize] = true;
        total += e.len;
    }
    let members = used.iter().take_while(|u| **u).count();
    assert!(used[..members].iter().all(|u| *u));
    // Encoded again as a sender would, folded (repeat entries where the
    // fragments continue a group before them).
    for wire in [proto::fold_table(&entries), came] {
        let mut again = Vec::new();
        let header = Message::AggHeader { members: members as u32, frags: wire.len() as u32, total, meta: m.clone() };
        for msg in std::iter::once(header).chain(proto::table_messages(&wire, meta_size)) {
            let mut s = vec![0u8; slot];
            msg.encode(&mut s);
            again.push(s);
        }
        let decoded = proto::decode_descriptor(again.iter().map(Vec::as_slice), &lens[..members], meta_size);
        assert_eq!(
            decoded.map(|(m, e, _)| (m, e)),
            Ok((m.clone(), entries.clone())),
            "descriptor codec is not symmetric"
        );
    }
}

/// A setup message from a peer (bind request, bind reply, pool
/// announcement; `backend/setup_msg.rs`): parsing must not panic, and what
/// parses must encode back to the same value.
pub fn setup_message(data: &[u8]) {
    use crate::backend::setup_msg;
    if let Ok(params) = setup_msg::parse_bind(data) {
        assert_eq!(setup_msg::parse_bind(&setup_msg::encode_bind(&params)), Ok(params), "bind request");
    }
    if let Ok((neg, depth)) = setup_msg::parse_reply(data) {
        assert_eq!(setup_msg::parse_reply(&setup_msg::encode_accept(&neg, depth)), Ok((neg, depth)), "bind reply");
    }
    if let Ok((file, id, geometry)) = setup_msg::parse_pool(data) {
        assert_eq!(setup_msg::parse_pool(&setup_msg::encode_pool(file, id, geometry)), Ok((file, id, geometry)));
    }
}

/// The bytes a TCP peer sends during setup (`backend/net.rs`): a u16
/// length, a setup message and the peer's timeout, read without ever reading past it. The
/// first byte picks the side that reads: the creator reads a bind request
/// (and negotiates with it), the binder the creator's reply (and checks it
/// against its request). Reading and
/// parsing must end in a message or a typed error, never a panic or a hang.
pub fn net_setup_from_peer(data: &[u8]) {
    use std::io::Write;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;
    use std::time::{Duration, Instant};

    use crate::backend::net::SetupConn;
    use crate::backend::setup_msg;
    use crate::setup::{check_reply, negotiate, BindParams, ChannelSetup};

    let Some((&side, bytes)) = data.split_first() else { return };
    let (ours, mut theirs) = UnixStream::pair().expect("socket pair");
    ours.set_nonblocking(true).expect("non-blocking");
    // The stream ends after the bytes: a short message is an error, not a
    // wait (the deadline is never reached here).
    let _ = theirs.write_all(&bytes[..bytes.len().min(64 << 10)]);
    drop(theirs);
    let stream = std::net::TcpStream::from(OwnedFd::from(ours));
    let mut conn = SetupConn::new(stream, None, Instant::now() + Duration::from_secs(3600));
    for _ in 0..bytes.len() + 2 {
        match conn.poll() {
            Ok(Some(body)) => {
                let Ok((msg, _peer_timeout)) = crate::backend::net::unframed(body) else { return };
                if side & 1 == 0 {
                    if let Ok(params) = setup_msg::parse_bind(msg) {
                        let _ = negotiate(&ChannelSetup::default(), &params);
                    }
                } else if let Ok((neg, _)) = setup_msg::parse_reply(msg) {
                    let _ = check_reply(&BindParams::default(), &neg);
                }
                return;
            }
            Ok(None) => {}
            Err(_) => return,
        }
    }
    panic!("setup read neither ended nor gave a message");
}

/// A ring segment written by a hostile peer: attaching and draining it must
/// end in messages or typed errors, never a panic or an endless loop.
pub fn ring_from_peer(data: &[u8]) {
    let Some((&knobs, bytes)) = data.split_first() else { return };
    let layout = RingLayout::new(4 << (knobs % 4), 64 << (knobs / 4 % 3)).expect("valid layout");
    let region = ring::region_written_by_peer(layout, bytes, knobs & 0x80 == 0);
    let mem: Arc<dyn RingMemory> = region;
    // The producer end of the same garbage: staging and publishing in
    // batches (the tail it reads is the peer's) ends in Full or an error.
    if let Ok(mut producer) = ring::attach_producer(mem.clone(), layout) {
        for i in 0..=2 * layout.capacity() + 1 {
            match producer.stage(|slot| Message::Teardown.encode(slot)) {
                Ok(()) if i % 3 == 0 => {
                    let _ = producer.publish();
                }
                Ok(()) => {}
                Err(_) => break,
            }
        }
        assert!(producer.staged() <= layout.capacity());
        let _ = producer.publish();
    }
    let Ok(mut consumer) = ring::attach_consumer(mem, layout) else { return };
    for _ in 0..=layout.capacity() + 1 {
        match consumer.try_pop(|slot| Message::decode(slot, 16).is_ok()) {
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
}

/// A TCP byte stream from a hostile peer, after setup: the frame decoder
/// must turn it into messages, a clean end, or typed errors — never a
/// panic, a hang, or a write outside the buffer the gate admitted. One
/// pool of four 4 KiB buffers is on the channel; the gate admits buffer 0,
/// discards buffer 1 (as if we held a copy), and refuses the others (as if
/// we owned them). The first byte picks the channel's meta size.
pub fn net_stream_from_peer(data: &[u8]) {
    use std::io::Write;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;

    use crate::backend::net::NetLink;
    use crate::backend::Link;
    use crate::pool::{Geometry, PoolId, PoolMemory};

    let Some((&knob, bytes)) = data.split_first() else { return };
    let (ours, theirs) = UnixStream::pair().expect("socket pair");
    let mut link = NetLink::over(std::net::TcpStream::from(OwnedFd::from(ours)), usize::from(knob) % 64);
    let pool = PoolMemory::mirror(PoolId::from_u128(0xf00d), Geometry::new(4096, 4).expect("geometry"), None)
        .expect("pool memory");
    link.use_pool(&pool).expect("pool mapped");
    let mut theirs = theirs;
    // A few KiB fit in the socket buffer at once; the end of the stream
    // follows the bytes.
    let _ = theirs.write_all(&bytes[..bytes.len().min(64 << 10)]);
    drop(theirs);
    for _ in 0..(bytes.len() + 8) {
        match link.recv(&mut PeerStreamGate) {
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
}

/// A multiplexed session's byte stream from a hostile peer
/// (`backend/mux/`): header decoding must not panic and what decodes
/// encodes back; the session's demultiplexer must turn the stream into
/// messages, a clean end, or typed errors — never a panic, a hang, or a
/// write outside the buffer the gate admitted. Channels 1 and 2 are open
/// (the first byte picks their meta size), each with a pool of four 4 KiB
/// buffers; the gate admits buffer 0, discards buffer 1 and refuses the
/// others.
pub fn mux_stream_from_peer(data: &[u8]) {
    use std::io::Write;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;

    use crate::backend::mux::{MuxHead, MuxSession, MUX_HEAD};
    use crate::pool::{Geometry, PoolId, PoolMemory};

    let Some((&knob, bytes)) = data.split_first() else { return };
    if let Ok(head) = bytes
        .get(..MUX_HEAD)
        .unwrap_or(&[])
        .try_into()
        .map_err(|_| ())
        .and_then(|h: [u8; MUX_HEAD]| MuxHead::decode(&h).map_err(|_| ()))
    {
        assert_eq!(MuxHead::decode(&head.encode()), Ok(head), "header codec is not symmetric");
    }
    let (ours, mut theirs) = UnixStream::pair().expect("socket pair");
    let session = MuxSession::over(std::net::TcpStream::from(OwnedFd::from(ours)));
    let meta = usize::from(knob) % 64;
    let mut links = [session.open_link(1, meta, 8), session.open_link(2, meta, 8)];
    for (i, link) in links.iter_mut().enumerate() {
        let pool =
            PoolMemory::mirror(PoolId::from_u128(0xf00d + i as u128), Geometry::new(4096, 4).expect("geometry"), None)
                .expect("pool memory");
        link.use_pool(&pool).expect("pool mapped");
        link.set_gate(Box::new(PeerStreamGate));
    }
    let _ = theirs.write_all(&bytes[..bytes.len().min(64 << 10)]);
    drop(theirs);
    for _ in 0..(bytes.len() + 8) {
        let mut progress = false;
        for link in &mut links {
            if let Ok(Some(_)) = link.recv(&mut PeerStreamGate) {
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
}

/// The payload gate of the peer-stream targets: buffer 0 lands, buffer 1 is
/// discarded (as if we held a copy), any other is refused (as if we owned
/// it); asked about a message without payload, it refuses too.
struct PeerStreamGate;

impl crate::backend::PayloadGate for PeerStreamGate {
    fn admit(&mut self, msg: &Message) -> crate::error::Result<crate::backend::Landing> {
        use crate::backend::Landing;
        use crate::ErrorKind;
        let buf = match msg {
            Message::Move { buf, .. } | Message::Copy { buf, .. } | Message::Pass { buf, .. } => buf,
            _ => return Err(ErrorKind::Protocol("gate asked about a message without payload".into()).into()),
        };
        match buf.index {
            0 => Ok(Landing::Land),
            1 => Ok(Landing::Discard),
            _ => Err(ErrorKind::Protocol("buffer we own".into()).into()),
        }
    }

    fn detach(&self) -> Option<Box<dyn crate::backend::PayloadGate + Send>> {
        Some(Box::new(PeerStreamGate))
    }
}
