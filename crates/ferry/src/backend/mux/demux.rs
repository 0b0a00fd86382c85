//! Early demultiplexing: a complete frame goes to its channel, a
//! message's payload lands in that channel's buffer.

use crate::ErrorKind;
use std::sync::Arc;

use super::codec::{
    MuxHead, FLAG_ABORT, FLAG_PAYLOAD, K_CLOSE, K_CREDIT, K_GOODBYE, K_KEEPALIVE, K_MESSAGE, K_OPEN, K_READ, K_REPLY,
    MSG_HEAD, TYPE_COPY, TYPE_MOVE, TYPE_PASS,
};
use super::session::{Chan, ChanState, Inner, LinkPool, CREDIT_SLACK, MAX_UNCLAIMED};
use super::wire::RxState;
use crate::backend::setup_msg;
use crate::backend::Landing;
use crate::error::Result;
use crate::pool::BufferId;
use crate::proto::{self, Message, Meta};

/// Where the payload of a message being received goes.
#[derive(Clone, Copy)]
pub(super) enum Target {
    Land,
    Discard,
}

/// A message whose payload chunks are arriving.
pub(super) struct Incoming {
    /// `None`: the channel is closed here, the payload is read and dropped.
    pub(super) msg: Option<Message>,
    pub(super) pool: Option<Arc<LinkPool>>,
    pub(super) offset: usize,
    pub(super) len: usize,
    pub(super) got: usize,
    pub(super) target: Target,
    pub(super) copy: bool,
}

impl Inner {
    pub(super) fn chan_of(&mut self, head: &MuxHead) -> Result<&mut Chan> {
        self.chans
            .get_mut(&head.channel)
            .ok_or_else(|| ErrorKind::Protocol(format!("frame for channel {} which is not open", head.channel)).into())
    }

    pub(super) fn start_chunk(&mut self, head: MuxHead) -> Result<()> {
        let chan = self.chan_of(&head)?;
        let inc =
            chan.incoming.as_ref().ok_or_else(|| ErrorKind::Protocol("payload chunk without its message".into()))?;
        let len = head.len as usize;
        if len > inc.len - inc.got {
            return Err(ErrorKind::Protocol("payload chunk beyond the announced length".into()).into());
        }
        if matches!(inc.target, Target::Discard) {
            chan.stats.payload_staged += len as u64;
        } else {
            chan.stats.payload_received += len as u64;
        }
        self.rx = RxState::Chunk { chan: head.channel, have: 0, len };
        Ok(())
    }

    pub(super) fn end_chunk(&mut self, id: u32, len: usize) {
        let chan = self.chans.get_mut(&id).expect("chunk of an open channel");
        let inc = chan.incoming.as_mut().expect("chunk of a message");
        inc.got += len;
        if inc.got == inc.len {
            let inc = chan.incoming.take().expect("present");
            let Some(msg) = inc.msg else { return };
            if let Some(buf) = msg.payload_buffer() {
                // A copy's bytes are in our memory whether they landed or
                // were discarded because this process already reads the
                // buffer (same bytes, same memory): a further copy may come
                // without them. Bytes of a move or pass that landed are
                // not a copy's.
                if inc.copy {
                    chan.copied_in.insert(buf);
                } else if matches!(inc.target, Target::Land) && !chan.copied_in.is_empty() {
                    chan.copied_in.remove(&buf);
                }
            }
            chan.inq.push_back((msg, true));
            chan.wake();
            let priority = chan.priority;
            self.landed = self.landed.max(Some(priority));
        }
    }

    /// A complete frame other than a chunk.
    pub(super) fn frame(&mut self, head: MuxHead) -> Result<()> {
        let body_len = head.len as usize;
        match head.kind {
            K_KEEPALIVE => Ok(()),
            K_GOODBYE => {
                self.goodbye_seen = true;
                Ok(())
            }
            K_READ => {
                let read = self.counters.bytes_reported_read + u64::from(head.credit);
                if read > self.counters.bytes_sent {
                    return Err(ErrorKind::Protocol("a read report beyond the bytes sent".into()).into());
                }
                self.counters.bytes_reported_read = read;
                // The bulk budget has room again: a channel asleep with
                // frames held back must be told (its reader may be us, on
                // another channel's behalf, and the socket will not say so
                // again).
                for chan in self.chans.values_mut() {
                    if chan.has_queued() {
                        chan.wake();
                    }
                }
                Ok(())
            }
            K_OPEN => {
                let body = self.body[..body_len].to_vec();
                match self.chans.get_mut(&head.channel) {
                    Some(chan) if matches!(chan.state, ChanState::Listening { .. }) && chan.setup_in.is_none() => {
                        chan.setup_in = Some(body);
                        chan.wake();
                        Ok(())
                    }
                    Some(_) => {
                        Err(ErrorKind::Protocol(format!("open of channel {} which is taken", head.channel)).into())
                    }
                    // A newer open of the same number replaces the older
                    // (its binder gave up and tried again).
                    None if self.unclaimed.len() < MAX_UNCLAIMED || self.unclaimed.contains_key(&head.channel) => {
                        self.unclaimed.insert(head.channel, body);
                        Ok(())
                    }
                    None => Err(ErrorKind::Protocol("too many opens of channels nobody listens on".into()).into()),
                }
            }
            K_REPLY => {
                let body = self.body[..body_len].to_vec();
                let chan = self.chan_of(&head)?;
                if chan.detached {
                    return Ok(());
                }
                if !matches!(chan.state, ChanState::Binding) || chan.setup_in.is_some() {
                    return Err(ErrorKind::Protocol(format!(
                        "open reply for channel {} which did not ask",
                        head.channel
                    ))
                    .into());
                }
                chan.setup_in = Some(body.clone());
                chan.wake();
                // Accepted: the creator may send at once, before the
                // binder's setup has seen the reply (which it then checks).
                if let Ok((neg, depth)) = setup_msg::parse_reply(&body) {
                    self.open(head.channel, &neg, depth);
                }
                Ok(())
            }
            K_CREDIT => {
                let chan = self.chan_of(&head)?;
                chan.credit = chan.credit.saturating_add(head.credit as usize).min(1 << 24);
                // Its queue can move again: wake it if it sleeps (waiting
                // for room, perhaps), as for the budget above.
                if chan.has_queued() {
                    chan.wake();
                }
                Ok(())
            }
            K_CLOSE => {
                let id = head.channel;
                // A binder that gave up before its open was answered: the
                // close goes back so it can free the number.
                if !self.chans.contains_key(&id) && self.unclaimed.remove(&id).is_some() {
                    return self.queue_ctrl(K_CLOSE, id, Vec::new(), 0);
                }
                let chan = self.chan_of(&head)?;
                if matches!(chan.state, ChanState::Listening { .. }) {
                    chan.setup_in = None;
                    return self.queue_ctrl(K_CLOSE, id, Vec::new(), 0);
                }
                if chan.peer_closed.is_some() || chan.incoming.is_some() {
                    return Err(ErrorKind::Protocol(format!("close of channel {id} out of order")).into());
                }
                chan.peer_closed = Some(head.flags & FLAG_ABORT != 0);
                chan.wake();
                if chan.detached && chan.close_sent {
                    self.chans.remove(&id);
                }
                Ok(())
            }
            K_MESSAGE => self.message(head),
            _ => Err(ErrorKind::Protocol("unexpected frame kind".into()).into()),
        }
    }

    /// A message frame: check it, and queue it (or expect its payload).
    pub(super) fn message(&mut self, head: MuxHead) -> Result<()> {
        let body_len = head.len as usize;
        let h = &self.body[..body_len];
        let id = head.channel;
        let chan = self
            .chans
            .get_mut(&id)
            .ok_or_else(|| ErrorKind::Protocol(format!("message for channel {id} which is not open")))?;
        if chan.peer_closed.is_some() || chan.incoming.is_some() {
            return Err(ErrorKind::Protocol(format!("message for channel {id} out of order")).into());
        }
        if chan.detached {
            // Closed here (or given up while binding) and the peer does not
            // know yet: read and drop, payload included.
            let flags = self.body[1];
            let len = u64::from_le_bytes(self.body[8..16].try_into().expect("8 bytes"));
            if flags & FLAG_PAYLOAD != 0 && len > 0 {
                let len = usize::try_from(len).map_err(|_| ErrorKind::Protocol("payload too long".into()))?;
                let inc =
                    Incoming { msg: None, pool: None, offset: 0, len, got: 0, target: Target::Discard, copy: false };
                self.chans.get_mut(&id).expect("present").incoming = Some(inc);
            }
            return Ok(());
        }
        if !matches!(chan.state, ChanState::Open) {
            return Err(ErrorKind::Protocol(format!("message for channel {id} before it was open")).into());
        }
        if chan.allowed == 0 && chan.inq.len() >= chan.depth + CREDIT_SLACK {
            return Err(ErrorKind::Protocol(format!("channel {id}: message beyond its credit")).into());
        }
        chan.allowed = chan.allowed.saturating_sub(1);
        let head = proto::SlotHead::read(h)
            .ok_or_else(|| ErrorKind::Protocol(format!("channel {id}: message shorter than its header")))?;
        let proto::SlotHead { op: kind, flags, meta_len: meta, index, aux, pool } = head;
        let bad = |what: String| ErrorKind::Protocol(format!("channel {id}, message type {kind}: {what}"));
        if MSG_HEAD + meta != body_len {
            return Err(bad("meta length does not match the frame".into()).into());
        }
        if proto::body_limit(kind, chan.meta_size).is_none() {
            return Err(bad("unknown message type".into()).into());
        }
        let msg = Message::decode(h, chan.meta_size)?;
        let payload = flags & FLAG_PAYLOAD != 0;
        let buf = BufferId { pool, index };
        let gate = chan.gate.as_mut();
        match (kind, payload) {
            (TYPE_MOVE | TYPE_COPY | TYPE_PASS, true) => {
                let p = chan.pools.get(&pool).ok_or_else(|| bad(format!("pool {pool} not on this channel")))?.clone();
                if index >= p.geometry.count() {
                    return Err(bad(format!("buffer index {index} out of range")).into());
                }
                let size = p.geometry.buffer_size();
                if aux != size as u64 {
                    return Err(bad(format!("payload of {aux} bytes for a pool of {size}-byte buffers")).into());
                }
                let gate = gate.ok_or_else(|| bad("payload before the channel was polled".into()))?;
                let probe = head.payload_probe().expect("a move, copy or pass");
                let target = match gate.admit(&probe)? {
                    Landing::Land => Target::Land,
                    Landing::Discard => Target::Discard,
                };
                chan.incoming = Some(Incoming {
                    msg: Some(msg),
                    pool: Some(p),
                    offset: index as usize * size,
                    len: size,
                    got: 0,
                    target,
                    copy: kind == TYPE_COPY,
                });
                chan.stats.frames_received += 1;
                return Ok(());
            }
            (TYPE_COPY, false) => {
                let probe = Message::Copy { buf, meta: Meta::empty() };
                let gate = gate.ok_or_else(|| bad("copy before the channel was polled".into()))?;
                if gate.admit(&probe)? == Landing::Land && !chan.copied_in.contains(&buf) {
                    return Err(bad("copy without payload of a buffer we never received".into()).into());
                }
            }
            (TYPE_MOVE, false) => return Err(bad("move without its payload".into()).into()),
            (_, true) => return Err(bad("payload on a message that carries none".into()).into()),
            (_, false) => {}
        }
        chan.stats.frames_received += 1;
        chan.inq.push_back((msg, false));
        chan.wake();
        let priority = chan.priority;
        self.landed = self.landed.max(Some(priority));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::mux::codec::{K_CHUNK, MUX_HEAD};
    use crate::backend::mux::MuxSession;
    use crate::backend::PayloadGate;
    use crate::pool::{Geometry, PoolId, PoolMemory};
    use crate::sys::Access;
    use std::net::TcpStream;

    /// The fuzz target's entry on a few streams: valid frames for both
    /// channels, a chunk landing in buffer 0, and garbage.
    #[cfg(feature = "fuzzing")]
    #[test]
    fn fuzz_entry_runs_on_sample_streams() {
        let mut stream = vec![8u8];
        let mut msg = [0u8; MSG_HEAD + 8];
        Message::Move { buf: BufferId { pool: PoolId::from_u128(0xf00d), index: 0 }, meta: Meta::empty() }
            .encode(&mut msg);
        msg[1] |= FLAG_PAYLOAD;
        msg[8..16].copy_from_slice(&4096u64.to_le_bytes());
        stream.extend_from_slice(&MuxHead { kind: K_MESSAGE, flags: 0, channel: 1, len: 32, credit: 0 }.encode());
        stream.extend_from_slice(&msg[..32]);
        stream.extend_from_slice(&MuxHead { kind: K_CREDIT, flags: 0, channel: 2, len: 0, credit: 3 }.encode());
        stream.extend_from_slice(&MuxHead { kind: K_CHUNK, flags: 0, channel: 1, len: 4096, credit: 0 }.encode());
        stream.extend_from_slice(&[7u8; 4096]);
        stream.extend_from_slice(&MuxHead { kind: K_CLOSE, flags: 0, channel: 2, len: 0, credit: 0 }.encode());
        crate::fuzzing::mux_stream_from_peer(&stream);
        crate::fuzzing::mux_stream_from_peer(&[3, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]);
        crate::fuzzing::mux_stream_from_peer(&[]);
        let mut reports = vec![0u8];
        reports.extend_from_slice(&MuxHead { kind: K_READ, flags: 0, channel: 0, len: 0, credit: 16 }.encode());
        reports.extend_from_slice(&MuxHead { kind: K_READ, flags: 0, channel: 1, len: 0, credit: 16 }.encode());
        crate::fuzzing::mux_stream_from_peer(&reports);
    }

    struct LandAll;
    impl PayloadGate for LandAll {
        fn admit(&mut self, _: &Message) -> Result<Landing> {
            Ok(Landing::Land)
        }
        fn detach(&self) -> Option<Box<dyn PayloadGate + Send>> {
            Some(Box::new(LandAll))
        }
    }

    /// What [`two_channels`] gives a test: the session, the socket end the
    /// test writes frames into, the two channels' links and their pools.
    type TwoChannels =
        (MuxSession, std::os::unix::net::UnixStream, [Box<dyn crate::backend::Link>; 2], Vec<Arc<PoolMemory>>);

    /// A session over one end of a socket pair (the test writes frames
    /// into the other), channels 1 and 2 open, each with a pool of two
    /// 8 KiB buffers (ids 0x100 and 0x101) where every payload may land.
    fn two_channels() -> TwoChannels {
        use std::os::fd::OwnedFd;
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let session = MuxSession::over(TcpStream::from(OwnedFd::from(ours)));
        let mut links = [session.open_link(1, 8, 8), session.open_link(2, 8, 8)];
        let g = Geometry::new(8192, 2).unwrap();
        let pools: Vec<_> =
            (0..2).map(|i| PoolMemory::mirror(PoolId::from_u128(0x100 + i), g, None).unwrap()).collect();
        for (link, pool) in links.iter_mut().zip(&pools) {
            link.use_pool(pool).unwrap();
            link.set_gate(Box::new(LandAll));
        }
        (session, theirs, links, pools)
    }

    /// The message head of a move of buffer `index` of pool `pool`, with
    /// an 8 KiB payload to follow in chunks.
    fn move_of_8k(pool: u128, index: u32) -> [u8; MSG_HEAD] {
        let mut h = [0u8; MSG_HEAD];
        let buf = BufferId { pool: PoolId::from_u128(pool), index };
        Message::Move { buf, meta: Meta::empty() }.encode(&mut h);
        h[1] |= FLAG_PAYLOAD;
        h[8..16].copy_from_slice(&8192u64.to_le_bytes());
        h
    }

    /// A payload in two chunks with another channel's frames between them
    /// lands whole in the named buffer of the right channel, and each
    /// channel gets its own message, whichever of them reads the socket.
    /// A channel's poll stops reading the connection once a message of a
    /// channel of higher priority is complete (its doorbell rang), instead
    /// of reading on through bulk until its own message comes: the
    /// application gets back to its priority channel first. The next poll
    /// reads on.
    #[test]
    fn a_poll_stops_reading_at_a_message_of_higher_priority() {
        use std::io::Write;
        let (session, mut theirs, mut links, _pools) = two_channels();
        session.lock().chans.get_mut(&2).expect("open").priority = 7;
        let mut stream = MuxHead::new(K_MESSAGE, 2, 0).frame(&move_of_8k(0x101, 0));
        stream.extend(MuxHead::new(K_CHUNK, 2, 0).frame(&[2u8; 8192]));
        stream.extend(MuxHead::new(K_MESSAGE, 1, 0).frame(&move_of_8k(0x100, 1)));
        stream.extend(MuxHead::new(K_CHUNK, 1, 0).frame(&[1u8; 8192]));
        theirs.write_all(&stream).unwrap();
        // The bulk channel polls first: it stops at the priority message.
        assert_eq!(links[0].recv(&mut LandAll).unwrap(), None);
        assert_eq!(links[0].stats().unwrap().payload_received, 0, "read on past the priority message");
        let two = links[1].recv(&mut LandAll).unwrap();
        assert!(matches!(two, Some(Message::Move { buf, .. }) if buf.index == 0));
        let one = links[0].recv(&mut LandAll).unwrap();
        assert!(matches!(one, Some(Message::Move { buf, .. }) if buf.index == 1));
    }

    /// A read report counts what the peer read of our stream; one beyond
    /// the bytes we wrote is a protocol error.
    #[test]
    fn a_read_report_beyond_the_bytes_sent_is_a_protocol_error() {
        use std::io::{Read, Write};
        let (session, mut theirs, mut links, _pools) = two_channels();
        // 16 bytes from us: a credit grant (channel 1 takes two messages).
        session.lock().queue_ctrl(K_CREDIT, 1, Vec::new(), 2).unwrap();
        links[0].flush().unwrap();
        let mut grant = [0u8; MUX_HEAD];
        theirs.read_exact(&mut grant).unwrap();
        assert_eq!(session.stats().bytes_sent, MUX_HEAD as u64);
        theirs.write_all(&MuxHead { credit: 16, ..MuxHead::new(K_READ, 0, 0) }.encode()).unwrap();
        assert_eq!(links[0].recv(&mut LandAll).unwrap(), None);
        assert_eq!(session.stats().bytes_reported_read, MUX_HEAD as u64);
        theirs.write_all(&MuxHead { credit: 1, ..MuxHead::new(K_READ, 0, 0) }.encode()).unwrap();
        assert!(matches!(links[1].recv(&mut LandAll).as_ref().map_err(|e| e.kind()), Err(ErrorKind::Protocol(_))));
        assert!(matches!(links[0].recv(&mut LandAll).as_ref().map_err(|e| e.kind()), Err(ErrorKind::Protocol(_))));
    }

    #[test]
    fn chunks_of_interleaved_channels_land_in_their_buffers() {
        use std::io::Write;
        let (_session, mut theirs, mut links, pools) = two_channels();
        let frame = |kind, channel, body: &[u8]| MuxHead::new(kind, channel, 0).frame(body);
        let mut stream = frame(K_MESSAGE, 1, &move_of_8k(0x100, 1));
        stream.extend(frame(K_CHUNK, 1, &[1u8; 4096]));
        stream.extend(frame(K_MESSAGE, 2, &move_of_8k(0x101, 0)));
        stream.extend(frame(K_CHUNK, 2, &[2u8; 8192]));
        stream.extend(frame(K_CHUNK, 1, &[3u8; 4096]));
        theirs.write_all(&stream).unwrap();
        // Channel 2 polls first: it reads channel 1's frames on the way.
        let two = links[1].recv(&mut LandAll).unwrap();
        assert!(matches!(two, Some(Message::Move { buf, .. }) if buf.index == 0));
        let one = links[0].recv(&mut LandAll).unwrap();
        assert!(matches!(one, Some(Message::Move { buf, .. }) if buf.index == 1));
        let bytes = |pool: &Arc<PoolMemory>, index: usize| {
            let map = pool.map(Access::Read, 1).unwrap();
            // SAFETY: the mapping is live and 2 × 8192 bytes long; nothing
            // writes the pool while the test reads it.
            unsafe { std::slice::from_raw_parts(map.as_ptr().add(index * 8192), 8192) }.to_vec()
        };
        let got = bytes(&pools[0], 1);
        assert!(got[..4096].iter().all(|&b| b == 1) && got[4096..].iter().all(|&b| b == 3));
        assert!(bytes(&pools[1], 0).iter().all(|&b| b == 2));
        assert!(bytes(&pools[0], 0).iter().all(|&b| b == 0), "the other buffer is untouched");
        assert_eq!(links[0].stats().unwrap().payload_received, 8192);
        assert_eq!(links[0].recv(&mut LandAll).unwrap(), None);
    }
}
