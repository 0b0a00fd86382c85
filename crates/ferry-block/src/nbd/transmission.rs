//! The transmission phase: requests served, replies sent.

use super::*;

impl<'a, S: Read + Write> Session<'a, S> {
    /// The connection's buffer ([`connection_buffer`]): made before the
    /// connection was accepted when [`NbdServer::run`] serves it, else on
    /// first use.
    pub(super) fn buffer(&mut self) -> Step<&mut Buffer> {
        if self.buffer.is_none() {
            self.buffer = Some(connection_buffer(self.config.max_payload).map_err(End::Hard)?);
        }
        Ok(&mut self.buffer.as_mut().expect("made just now").1)
    }

    pub(super) fn transmission(&mut self) -> Step<()> {
        loop {
            let head = match self.next_header() {
                Ok(h) => h,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    return Err(End::Hard("closed the connection without NBD_CMD_DISC".into()))
                }
                Err(e) => return Err(e.into()),
            };
            let magic = u32::from_be_bytes(head[..4].try_into().expect("4 bytes"));
            if magic != REQUEST_MAGIC {
                return Err(End::Hard(format!("sent a request with magic {magic:#x}")));
            }
            let flags = u16::from_be_bytes(head[4..6].try_into().expect("2 bytes"));
            let kind = u16::from_be_bytes(head[6..8].try_into().expect("2 bytes"));
            let handle = u64::from_be_bytes(head[8..16].try_into().expect("8 bytes"));
            let offset = u64::from_be_bytes(head[16..24].try_into().expect("8 bytes"));
            let len = u32::from_be_bytes(head[24..].try_into().expect("4 bytes"));
            let req = Request { flags, handle, offset, len };
            // After a write that lands in the store, the next header is
            // looked at before it is taken (another such write can land
            // too); after anything else, what waits is received ahead.
            self.small = !(kind == CMD_WRITE && len as usize >= LAND_MIN);
            if kind == CMD_WRITE && self.cursor > 0 {
                // A write's payload goes to the start of the connection's
                // buffer, where queued read replies have their data. (Every
                // other request sends the queued replies before its own.)
                self.flush_replies()?;
            }
            match kind {
                CMD_READ => self.read(req)?,
                CMD_WRITE => self.write(req)?,
                CMD_DISC => {
                    self.flush_replies()?;
                    return Err(End::Soft("NBD_CMD_DISC"));
                }
                CMD_FLUSH => self.simple_op(req, CMD_FLAG_FUA, |s| s.flush(), |c| c.flushes += 1)?,
                CMD_TRIM => {
                    let fua = flags & CMD_FLAG_FUA != 0;
                    self.range_op(
                        req,
                        CMD_FLAG_FUA,
                        true,
                        EINVAL,
                        |s| s.trim(offset, len as u64, fua),
                        |c| c.trims += 1,
                    )?
                }
                CMD_CACHE => {
                    self.range_op(req, CMD_FLAG_FUA, false, EINVAL, |s| s.cache(offset, len as u64), |c| c.caches += 1)?
                }
                CMD_WRITE_ZEROES => {
                    let fua = flags & CMD_FLAG_FUA != 0;
                    let may_trim = flags & CMD_FLAG_NO_HOLE == 0;
                    self.range_op(
                        req,
                        CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
                        true,
                        ENOSPC,
                        |s| s.write_zeroes(offset, len as u64, may_trim, fua),
                        |c| c.zeroes += 1,
                    )?
                }
                CMD_BLOCK_STATUS => self.block_status(req)?,
                _ => self.error(req.handle, EINVAL, &format!("unknown command {kind}"))?,
            }
        }
    }

    /// The next request header: a staged one, else the headers waiting
    /// on the socket — every one up to and including the first with a
    /// payload, so that a payload is still read straight into the
    /// connection's buffer — else (replies sent first) wait for one.
    pub(super) fn next_header(&mut self) -> io::Result<[u8; 28]> {
        if let Some(h) = self.staged.pop_front() {
            return Ok(h);
        }
        if self.in_at < self.in_end || (self.small && self.socket.is_some()) {
            if let Some(head) = self.next_header_ahead()? {
                return Ok(head);
            }
        }
        let mut look = [0u8; 28 * 64];
        let mut seen = self.socket.as_ref().map_or(0, |s| s.peek(&mut look));
        if seen == 0 && self.socket.is_some() {
            // Nothing is waiting: the replies go, then wait until
            // something is, and look at it (a write seen whole can land in
            // the store). Nothing after the wait: the stream says why (end
            // of file, error).
            self.flush_replies()?;
            let socket = self.socket.as_ref().expect("checked above");
            socket.wait_readable();
            seen = socket.peek(&mut look);
        }
        let mut whole = 0;
        while whole + 28 <= seen {
            let h = &look[whole..whole + 28];
            whole += 28;
            if u32::from_be_bytes(h[..4].try_into().expect("4 bytes")) != REQUEST_MAGIC
                || u16::from_be_bytes(h[6..8].try_into().expect("2 bytes")) == CMD_WRITE
            {
                break;
            }
        }
        if whole == 28 && u16::from_be_bytes(look[6..8].try_into().expect("2 bytes")) == CMD_WRITE {
            // A write is next: its header and its payload (straight into
            // the connection's buffer) in one read.
            let len = u32::from_be_bytes(look[24..28].try_into().expect("4 bytes")) as usize;
            if u32::from_be_bytes(look[..4].try_into().expect("4 bytes")) == REQUEST_MAGIC
                && len > 0
                && len <= self.config.max_payload as usize
            {
                if self.cursor > 0 {
                    self.flush_replies()?;
                }
                let head: [u8; 28] = look[..28].try_into().expect("28 bytes");
                if let Some(head) = self.land_write(&head)? {
                    self.payload_read = true;
                    self.landed = true;
                    return Ok(head);
                }
                self.buffer().map_err(|e| match e {
                    End::Hard(why) => io::Error::other(why),
                    End::Soft(why) => io::Error::other(why),
                })?;
                // Its payload may still be on its way: the replies go first.
                self.flush_replies()?;
                let mut head = [0u8; 28];
                let (_, buf) = self.buffer.as_mut().expect("made just now");
                let mem = buf.as_mut_slice().map_err(|e| io::Error::other(e.to_string()))?;
                let read = read_parts_counted(
                    &mut self.stream,
                    &mut [IoSliceMut::new(&mut head), IoSliceMut::new(&mut mem[..len])],
                );
                if let Err((arrived, e)) = read {
                    if arrived > 28 {
                        self.apply_cut_write(&head, arrived - 28);
                    }
                    return Err(e);
                }
                self.payload_read = true;
                return Ok(head);
            }
        }
        if whole > 28 {
            self.stream.read_exact(&mut look[..whole])?;
            for h in look[..whole].chunks_exact(28) {
                self.staged.push_back(h.try_into().expect("28 bytes"));
            }
            return Ok(self.staged.pop_front().expect("staged"));
        }
        // Under TLS a whole header already decrypted is read without
        // waiting: the replies stay queued, to leave together.
        let decrypted = self.decrypted.map_or(0, |held| held(&mut self.stream));
        if whole == 0 && decrypted < 28 {
            // Nothing more is waiting: the replies go before we wait.
            self.flush_replies()?;
        }
        let mut head = [0u8; 28];
        self.stream.read_exact(&mut head)?;
        Ok(head)
    }

    /// The next request header from the requests received ahead, after
    /// receiving what waits if none is left (without waiting: if nothing
    /// waits, the replies go first, then the server waits). A write's
    /// payload goes to the connection's buffer: what was received ahead is
    /// copied there, the rest is read straight into it. `None` if nothing
    /// is buffered and the socket has no request waiting right now and
    /// nothing was received (the caller's peek path then goes on: never
    /// with bytes buffered here).
    pub(super) fn next_header_ahead(&mut self) -> io::Result<Option<[u8; 28]>> {
        if self.in_at == self.in_end {
            let Some(socket) = &self.socket else { return Ok(None) };
            if self.inbuf.is_empty() {
                self.inbuf = vec![0u8; IN_BUF];
            }
            self.in_at = 0;
            self.in_end = 0;
            let mut got = socket.recv_now(&mut [IoSliceMut::new(&mut self.inbuf)])?;
            if got.is_none() {
                // Nothing waits: the replies go, then wait for more.
                self.flush_replies()?;
                let socket = self.socket.as_ref().expect("checked above");
                socket.wait_readable();
                got = socket.recv_now(&mut [IoSliceMut::new(&mut self.inbuf)])?;
            }
            match got {
                Some(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Some(n) => self.in_end = n,
                // Woken without data (an error the stream will report).
                None => return Ok(None),
            }
        }
        // A header cut short: the rest of it is on its way (the replies
        // go before the server waits for it).
        if self.in_end - self.in_at < 28 {
            self.flush_replies()?;
            self.inbuf.copy_within(self.in_at..self.in_end, 0);
            self.in_end -= self.in_at;
            self.in_at = 0;
            while self.in_end < 28 {
                match self.stream.read(&mut self.inbuf[self.in_end..]) {
                    Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => self.in_end += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
        let head: [u8; 28] = self.inbuf[self.in_at..self.in_at + 28].try_into().expect("28 bytes");
        self.in_at += 28;
        let magic = u32::from_be_bytes(head[..4].try_into().expect("4 bytes"));
        let kind = u16::from_be_bytes(head[6..8].try_into().expect("2 bytes"));
        let len = u32::from_be_bytes(head[24..28].try_into().expect("4 bytes")) as usize;
        if magic != REQUEST_MAGIC || kind != CMD_WRITE || len == 0 {
            return Ok(Some(head));
        }
        // The payload: what was received ahead, then the rest from the
        // stream. One larger than the connection's buffer is taken and
        // dropped here (the write is answered with an error).
        if self.cursor > 0 || self.in_end - self.in_at < len {
            // Read replies have their data where the payload goes; and a
            // payload not all received ahead may still be on its way: the
            // queued replies go before the server waits for it.
            self.flush_replies()?;
        }
        self.buffer().map_err(|e| match e {
            End::Hard(why) => io::Error::other(why),
            End::Soft(why) => io::Error::other(why),
        })?;
        let Session { stream, buffer, inbuf, in_at, in_end, .. } = self;
        let (_, buf) = buffer.as_mut().expect("made just now");
        let mem = buf.as_mut_slice().map_err(|e| io::Error::other(e.to_string()))?;
        let room = mem.len();
        let mut done = 0;
        let mut cut = None;
        while done < len {
            let at = done % room;
            let n = (len - done).min(room - at);
            let ahead = (*in_end - *in_at).min(n);
            mem[at..at + ahead].copy_from_slice(&inbuf[*in_at..*in_at + ahead]);
            *in_at += ahead;
            if let Err((arrived, e)) = read_parts_counted(stream, &mut [IoSliceMut::new(&mut mem[at + ahead..at + n])])
            {
                cut = Some((done + ahead + arrived, e));
                break;
            }
            done += n;
        }
        if let Some((arrived, e)) = cut {
            self.apply_cut_write(&head, arrived);
            return Err(e);
        }
        self.payload_read = true;
        Ok(Some(head))
    }

    /// Receive a write whose header `head` waits on the socket straight
    /// into the store, if the store hands out its memory and the request
    /// is valid: then the header read, else `None` and nothing read. The
    /// payload is taken as it arrives, with receives that do not wait
    /// (header and payload in one when they wait together), each of the
    /// bytes that wait: the store's memory is made ready for those only,
    /// so a payload announced and not sent costs nothing. Between them
    /// the server waits for more with the store let go, so a client that
    /// sends slowly holds no part of it. The store gets whole sectors of
    /// the export (see [`SECTOR`]): bytes that do not yet complete one
    /// wait here, and are dropped if the client goes away. (A concurrent
    /// read of the range may see part of the new sectors, as NBD allows
    /// for overlapping requests in flight.)
    pub(super) fn land_write(&mut self, head: &[u8; 28]) -> io::Result<Option<[u8; 28]>> {
        if self.socket.is_none() {
            return Ok(None);
        }
        let flags = u16::from_be_bytes(head[4..6].try_into().expect("2 bytes"));
        let offset = u64::from_be_bytes(head[16..24].try_into().expect("8 bytes"));
        let len = u32::from_be_bytes(head[24..].try_into().expect("4 bytes")) as usize;
        if flags & !CMD_FLAG_FUA != 0
            || self.config.read_only
            || len < LAND_MIN
            || len > self.config.max_payload as usize
            || !self.in_bounds(offset, len as u32)
        {
            return Ok(None);
        }
        let store = self.store;
        // An empty range tells whether the store takes direct writes.
        if store.write_direct(offset, 0, &mut |_| Ok(())).is_none() {
            return Ok(None);
        }
        let mut got = [0u8; 28];
        let mut head_have = 0;
        // Payload bytes in the store, and bytes taken after them that do
        // not complete a sector yet.
        let mut applied = 0;
        let mut carry = [0u8; SECTOR];
        let mut carried = 0;
        while head_have < 28 || applied < len {
            let mut waiting = self.socket.as_ref().expect("checked above").waiting();
            if waiting == 0 {
                // The replies go before the server waits for more.
                self.flush_replies()?;
                let socket = self.socket.as_ref().expect("checked above");
                socket.wait_readable();
                waiting = socket.waiting();
            }
            let socket = self.socket.as_ref().expect("checked above");
            let head_want = 28 - head_have;
            let taken = applied + carried;
            let coming = waiting.saturating_sub(head_want).min(len - taken);
            let reach = taken + coming;
            let upto = if reach == len { len } else { whole_sectors(offset, reach) };
            if upto > applied {
                // Whole sectors: straight into the store's memory, the
                // carried bytes first, then what waits on the socket.
                let want = head_want + (upto - taken);
                let mut arrived = 0;
                let landed = store.write_direct(offset + applied as u64, upto - applied, &mut |parts| {
                    let mut all: Vec<IoSliceMut<'_>> = Vec::with_capacity(parts.len() + 1);
                    all.push(IoSliceMut::new(&mut got[head_have..]));
                    let mut skip = carried;
                    for p in parts.iter_mut() {
                        let n = skip.min(p.len());
                        p[..n].copy_from_slice(&carry[carried - skip..carried - skip + n]);
                        skip -= n;
                        all.push(IoSliceMut::new(&mut p[n..]));
                    }
                    // The kernel hands over every byte it counts as
                    // waiting; a second receive only if the first stops
                    // short all the same.
                    let mut rest = &mut all[..];
                    while arrived < want {
                        match socket.recv_now(rest)? {
                            Some(0) | None => break,
                            Some(n) => {
                                arrived += n;
                                IoSliceMut::advance_slices(&mut rest, n);
                            }
                        }
                    }
                    Ok(())
                });
                match landed {
                    Some(r) => r?,
                    None => return Err(io::Error::other("the store no longer takes the write's payload")),
                }
                let from_head = arrived.min(head_want);
                head_have += from_head;
                let now = taken + arrived - from_head;
                self.summary.landed_bytes += (now - taken) as u64;
                if now == upto {
                    applied = upto;
                    carried = 0;
                } else {
                    // Short of what waited: the bytes past the last whole
                    // sector are carried (and the sector completed with
                    // them) like any others.
                    let whole = whole_sectors(offset, now).max(applied);
                    carried = now - whole;
                    applied = whole;
                    store.read_at(offset + applied as u64, &mut carry[..carried])?;
                    if arrived == 0 {
                        return Err(io::Error::other("the socket counts bytes that cannot be received"));
                    }
                }
            } else {
                // Fewer bytes than complete a sector (or none: the end of
                // the stream or an error, which a receive tells): they
                // wait here.
                let to_boundary = SECTOR - ((offset + taken as u64) % SECTOR as u64) as usize;
                let room = if coming > 0 { coming } else { to_boundary.min(len - taken) };
                let mut parts =
                    [IoSliceMut::new(&mut got[head_have..]), IoSliceMut::new(&mut carry[carried..carried + room])];
                match socket.recv_now(&mut parts)? {
                    Some(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Some(n) => {
                        let from_head = n.min(head_want);
                        head_have += from_head;
                        carried += n - from_head;
                    }
                    None if waiting > 0 => {
                        return Err(io::Error::other("the socket counts bytes that cannot be received"))
                    }
                    // Woken without data: wait again.
                    None => {}
                }
                if carried > 0 && (applied + carried == len || whole_sectors(offset, applied + carried) > applied) {
                    store.write_at(offset + applied as u64, &carry[..carried], false)?;
                    applied += carried;
                    carried = 0;
                }
            }
        }
        Ok(Some(got))
    }

    /// Send a read reply (header `head`, then the store's bytes of the
    /// range) straight from the store's memory, as far as the socket takes
    /// it at once; the rest is copied into the connection's buffer and
    /// sent from there once the store is let go. False if the store cannot
    /// hand out its memory (nothing sent).
    pub(super) fn send_direct(&mut self, head: &[u8], offset: u64, len: usize) -> Step<bool> {
        if self.socket.is_none() {
            return Ok(false);
        }
        self.flush_replies()?;
        self.buffer()?;
        let Session { socket, buffer, store, .. } = self;
        let socket = socket.as_ref().expect("checked above");
        let (_, buf) = buffer.as_mut().expect("made above");
        let mem = buf.as_mut_slice().map_err(|e| End::Hard(format!("connection buffer not writable ({e})")))?;
        // Of the reply, the bytes sent at once.
        let mut sent = 0;
        let done = store.read_direct(offset, len, &mut |parts| {
            let mut all: Vec<IoSlice<'_>> = Vec::with_capacity(parts.len() + 1);
            all.push(IoSlice::new(head));
            all.extend_from_slice(parts);
            sent = socket.send_now(&all)?;
            // What did not go: into the connection's buffer.
            let mut skip = sent.saturating_sub(head.len());
            let mut at = 0;
            for p in parts {
                let from = skip.min(p.len());
                skip -= from;
                let n = p.len() - from;
                mem[at..at + n].copy_from_slice(&p[from..]);
                at += n;
            }
            Ok(())
        });
        match done {
            None => return Ok(false),
            Some(r) => r?,
        }
        let data_sent = sent.saturating_sub(head.len());
        self.summary.sent_direct_bytes += data_sent as u64;
        if sent < head.len() + len {
            let head_rest = &head[sent.min(head.len())..];
            let (_, buf) = self.buffer.as_ref().expect("made above");
            write_all_parts(&mut self.stream, &mut [IoSlice::new(head_rest), IoSlice::new(&buf[..len - data_sent])])?;
        }
        Ok(true)
    }

    /// Send the queued read replies, in one write.
    pub(super) fn flush_replies(&mut self) -> io::Result<()> {
        if self.replies.is_empty() {
            return Ok(());
        }
        let replies = std::mem::take(&mut self.replies);
        self.cursor = 0;
        self.written = 0;
        let buf: &[u8] = self.buffer.as_ref().map_or(&[], |(_, b)| &b[..]);
        let mut parts: Vec<IoSlice<'_>> = Vec::with_capacity(replies.len() * 2);
        for (head, hlen, at, n) in &replies {
            parts.push(IoSlice::new(&head[..*hlen]));
            if *n > 0 {
                parts.push(IoSlice::new(&buf[*at..*at + *n]));
            }
        }
        write_all_parts(&mut self.stream, &mut parts)
    }

    /// A write whose header is `head` was cut off after `arrived` bytes of
    /// its payload, which are at the start of the connection's buffer:
    /// apply its whole sectors (see [`SECTOR`]) if the write is one the
    /// server would have carried out.
    pub(super) fn apply_cut_write(&mut self, head: &[u8; 28], arrived: usize) {
        let flags = u16::from_be_bytes(head[4..6].try_into().expect("2 bytes"));
        let offset = u64::from_be_bytes(head[16..24].try_into().expect("8 bytes"));
        let len = u32::from_be_bytes(head[24..].try_into().expect("4 bytes"));
        if flags & !CMD_FLAG_FUA != 0
            || self.config.read_only
            || len > self.config.max_payload
            || arrived >= len as usize
            || !self.in_bounds(offset, len)
        {
            return;
        }
        let keep = whole_sectors(offset, arrived);
        if let (Some((_, buf)), true) = (&self.buffer, keep > 0) {
            // The client is gone: nobody to tell if the store fails.
            let _ = self.store.write_at(offset, &buf[..keep], false);
        }
    }

    pub(super) fn in_bounds(&self, offset: u64, len: u32) -> bool {
        offset.checked_add(len as u64).is_some_and(|end| end <= self.store.size())
    }

    /// Answer a request with an error (structured if negotiated).
    pub(super) fn error(&mut self, handle: u64, errno: u32, message: &str) -> io::Result<()> {
        self.summary.errors += 1;
        if self.structured {
            let msg = &message.as_bytes()[..message.len().min(4096)];
            let mut payload = Vec::with_capacity(6 + msg.len());
            payload.extend_from_slice(&errno.to_be_bytes());
            payload.extend_from_slice(&(msg.len() as u16).to_be_bytes());
            payload.extend_from_slice(msg);
            self.chunk(handle, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, &[&payload])
        } else {
            self.simple(handle, errno, &[])
        }
    }

    /// A simple reply, with `data` after the header.
    pub(super) fn simple(&mut self, handle: u64, errno: u32, data: &[&[u8]]) -> io::Result<()> {
        self.flush_replies()?;
        let mut head = [0u8; 16];
        head[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        head[4..8].copy_from_slice(&errno.to_be_bytes());
        head[8..].copy_from_slice(&handle.to_be_bytes());
        let mut parts: Vec<IoSlice<'_>> =
            std::iter::once(IoSlice::new(&head)).chain(data.iter().map(|d| IoSlice::new(d))).collect();
        write_all_parts(&mut self.stream, &mut parts)
    }

    /// One structured reply chunk whose payload is `payload` (in parts).
    pub(super) fn chunk(&mut self, handle: u64, flags: u16, kind: u16, payload: &[&[u8]]) -> io::Result<()> {
        self.flush_replies()?;
        let len: usize = payload.iter().map(|p| p.len()).sum();
        let mut head = [0u8; 20];
        head[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        head[4..6].copy_from_slice(&flags.to_be_bytes());
        head[6..8].copy_from_slice(&kind.to_be_bytes());
        head[8..16].copy_from_slice(&handle.to_be_bytes());
        head[16..].copy_from_slice(&(len as u32).to_be_bytes());
        let mut parts: Vec<IoSlice<'_>> =
            std::iter::once(IoSlice::new(&head)).chain(payload.iter().map(|d| IoSlice::new(d))).collect();
        write_all_parts(&mut self.stream, &mut parts)
    }

    /// Success without data, for any request but a read: a simple reply
    /// even where structured replies were negotiated (the protocol allows
    /// it for replies without data), so the client takes 16 bytes instead
    /// of a 20-byte chunk header it reads in two parts. It is queued with
    /// the replies of reads and writes (the request is done: a flush's
    /// data is on stable storage) and leaves with them.
    pub(super) fn done(&mut self, handle: u64) -> io::Result<()> {
        self.queue_done(handle);
        if self.replies.len() >= MAX_QUEUED_REPLIES {
            self.flush_replies()?;
        }
        Ok(())
    }

    /// Queue the simple reply of a success without data.
    pub(super) fn queue_done(&mut self, handle: u64) {
        let mut head = [0u8; 28];
        head[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        head[8..16].copy_from_slice(&handle.to_be_bytes());
        self.replies.push((head, 16, 0, 0));
    }

    pub(super) fn read(&mut self, req: Request) -> Step<()> {
        let allowed = if self.structured { CMD_FLAG_FUA | CMD_FLAG_DF } else { CMD_FLAG_FUA };
        if req.flags & !allowed != 0 {
            return Ok(self.error(req.handle, EINVAL, "flag not valid for NBD_CMD_READ")?);
        }
        if req.len > self.config.max_payload {
            return Ok(self.error(req.handle, EINVAL, "read larger than the maximum block size")?);
        }
        if !self.in_bounds(req.offset, req.len) {
            return Ok(self.error(req.handle, EINVAL, "read past the end of the export")?);
        }
        if req.len == 0 {
            self.summary.reads += 1;
            // A read is never answered with a simple reply once structured
            // replies were negotiated.
            if self.structured {
                return Ok(self.chunk(req.handle, REPLY_FLAG_DONE, REPLY_TYPE_NONE, &[])?);
            }
            return Ok(self.simple(req.handle, 0, &[])?);
        }
        let len = req.len as usize;
        let store = self.store;
        if self.structured && req.flags & CMD_FLAG_DF == 0 && req.len >= SPARSE_READ_MIN {
            if let Ok(extents) = store.extents(req.offset, req.len as u64, 64) {
                let covered: u64 = extents.iter().map(|e| e.len).sum();
                if covered == req.len as u64 && extents.iter().any(|e| e.zero) {
                    self.flush_replies()?;
                    return self.read_sparse(req, &extents);
                }
            }
        }
        if len >= DIRECT_READ_MIN && self.socket.is_some() {
            let (head, hlen) = self.read_reply_head(req, len);
            if self.send_direct(&head[..hlen], req.offset, len)? {
                self.summary.reads += 1;
                self.summary.read_bytes += len as u64;
                return Ok(());
            }
        }
        // The data goes after the data of the replies queued before it (if
        // it fits; else those leave first).
        if self.cursor + len > (self.config.max_payload as usize).min(MAX_QUEUED_BYTES.max(len)) {
            self.flush_replies()?;
        }
        let at = self.cursor;
        let buf = self.buffer()?;
        let filled = match buf.as_mut_slice() {
            Ok(mem) => store.read_at(req.offset, &mut mem[at..at + len]),
            Err(e) => Err(io::Error::other(e.to_string())),
        };
        if let Err(e) = filled {
            return Ok(self.error(req.handle, nbd_errno(&e), &format!("read failed: {e}"))?);
        }
        self.summary.reads += 1;
        self.summary.read_bytes += len as u64;
        let (head, hlen) = self.read_reply_head(req, len);
        self.replies.push((head, hlen, at, len));
        self.cursor = at + len;
        // Sent with the replies that follow, once no request waits (or the
        // queue is full).
        if self.replies.len() >= MAX_QUEUED_REPLIES || self.cursor >= MAX_QUEUED_BYTES {
            self.flush_replies()?;
        }
        Ok(())
    }

    /// The header of a successful read's reply (`len` bytes of data) and
    /// its length.
    pub(super) fn read_reply_head(&self, req: Request, len: usize) -> ([u8; 28], usize) {
        let mut head = [0u8; 28];
        let hlen = if self.structured {
            head[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
            head[4..6].copy_from_slice(&REPLY_FLAG_DONE.to_be_bytes());
            head[6..8].copy_from_slice(&REPLY_TYPE_OFFSET_DATA.to_be_bytes());
            head[8..16].copy_from_slice(&req.handle.to_be_bytes());
            head[16..20].copy_from_slice(&(8 + len as u32).to_be_bytes());
            head[20..28].copy_from_slice(&req.offset.to_be_bytes());
            28
        } else {
            head[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
            head[8..16].copy_from_slice(&req.handle.to_be_bytes());
            16
        };
        (head, hlen)
    }

    /// A structured read of a range with zero extents: an
    /// `NBD_REPLY_TYPE_OFFSET_HOLE` chunk for each, an `OFFSET_DATA` chunk
    /// (from the connection's buffer) for the rest, then a final `NONE`.
    pub(super) fn read_sparse(&mut self, req: Request, extents: &[Extent]) -> Step<()> {
        let store = self.store;
        let mut at = req.offset;
        for x in extents {
            if x.zero {
                let mut payload = [0u8; 12];
                payload[..8].copy_from_slice(&at.to_be_bytes());
                payload[8..].copy_from_slice(&(x.len as u32).to_be_bytes());
                self.chunk(req.handle, 0, REPLY_TYPE_OFFSET_HOLE, &[&payload])?;
            } else {
                let n = x.len as usize;
                let buf = self.buffer()?;
                let filled = match buf.as_mut_slice() {
                    Ok(mem) => store.read_at(at, &mut mem[..n]),
                    Err(e) => Err(io::Error::other(e.to_string())),
                };
                if let Err(e) = filled {
                    return Ok(self.error(req.handle, nbd_errno(&e), &format!("read failed: {e}"))?);
                }
                let offset = at.to_be_bytes();
                let mut head = [0u8; 20];
                head[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
                head[6..8].copy_from_slice(&REPLY_TYPE_OFFSET_DATA.to_be_bytes());
                head[8..16].copy_from_slice(&req.handle.to_be_bytes());
                head[16..].copy_from_slice(&(8 + n as u32).to_be_bytes());
                let (_, buf) = self.buffer.as_ref().expect("made above");
                write_all_parts(
                    &mut self.stream,
                    &mut [IoSlice::new(&head), IoSlice::new(&offset), IoSlice::new(&buf[..n])],
                )?;
            }
            at += x.len;
        }
        self.summary.reads += 1;
        self.summary.read_bytes += req.len as u64;
        Ok(self.chunk(req.handle, REPLY_FLAG_DONE, REPLY_TYPE_NONE, &[])?)
    }

    pub(super) fn write(&mut self, req: Request) -> Step<()> {
        let len = req.len as usize;
        let max = self.config.max_payload as usize;
        // The payload is read in any case: what follows it is the next request.
        self.buffer()?;
        let payload_read = std::mem::take(&mut self.payload_read);
        if !payload_read {
            // It may still be on its way: the queued replies go first.
            self.flush_replies()?;
        }
        let landed = std::mem::take(&mut self.landed);
        let Session { stream, buffer, .. } = self;
        let (_, buf) = buffer.as_mut().expect("made just now");
        let mem = buf.as_mut_slice().map_err(|e| End::Hard(format!("connection buffer not writable ({e})")))?;
        if len > max {
            let mut left = if payload_read { 0 } else { len };
            while left > 0 {
                let n = left.min(max);
                stream.read_exact(&mut mem[..n])?;
                left -= n;
            }
            return Ok(self.error(req.handle, EINVAL, "write larger than the maximum block size")?);
        }
        if !payload_read {
            if let Err((arrived, e)) = read_parts_counted(stream, &mut [IoSliceMut::new(&mut mem[..len])]) {
                let mut head = [0u8; 28];
                head[4..6].copy_from_slice(&req.flags.to_be_bytes());
                head[16..24].copy_from_slice(&req.offset.to_be_bytes());
                head[24..].copy_from_slice(&req.len.to_be_bytes());
                self.apply_cut_write(&head, arrived);
                return Err(e.into());
            }
        }
        if req.flags & !CMD_FLAG_FUA != 0 {
            return Ok(self.error(req.handle, EINVAL, "flag not valid for NBD_CMD_WRITE")?);
        }
        if self.config.read_only {
            return Ok(self.error(req.handle, EPERM, "the export is read-only")?);
        }
        if !self.in_bounds(req.offset, req.len) {
            return Ok(self.error(req.handle, ENOSPC, "write past the end of the export")?);
        }
        let fua = req.flags & CMD_FLAG_FUA != 0;
        let (_, buf) = self.buffer.as_ref().expect("made above");
        let stored = if landed {
            // The payload is in the store already.
            if fua {
                self.store.flush()
            } else {
                Ok(())
            }
        } else {
            self.store.write_at(req.offset, &buf[..len], fua)
        };
        if let Err(e) = stored {
            return Ok(self.error(req.handle, nbd_errno(&e), &format!("write failed: {e}"))?);
        }
        self.summary.writes += 1;
        self.summary.write_bytes += len as u64;
        // The reply waits for the replies that follow, like a read's; a
        // simple one, as for every success without data (see `done`).
        self.queue_done(req.handle);
        // Large writes are answered at once, so the client can send the
        // next while this one's reply would otherwise wait.
        self.written += len;
        if self.replies.len() >= MAX_QUEUED_REPLIES || self.written >= MAX_QUEUED_BYTES {
            self.flush_replies()?;
        }
        Ok(())
    }

    /// A request without a range (FLUSH).
    pub(super) fn simple_op(
        &mut self,
        req: Request,
        allowed: u16,
        op: impl FnOnce(&dyn Store) -> io::Result<()>,
        count: impl FnOnce(&mut ConnSummary),
    ) -> Step<()> {
        if req.flags & !allowed != 0 {
            return Ok(self.error(req.handle, EINVAL, "flag not valid for this command")?);
        }
        if let Err(e) = op(self.store) {
            return Ok(self.error(req.handle, nbd_errno(&e), &format!("failed: {e}"))?);
        }
        count(&mut self.summary);
        Ok(self.done(req.handle)?)
    }

    /// A request on a range without payload (TRIM, CACHE, WRITE_ZEROES):
    /// flags checked, then the range (`past_end` if it leaves the export),
    /// then `op`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn range_op(
        &mut self,
        req: Request,
        allowed: u16,
        writes: bool,
        past_end: u32,
        op: impl FnOnce(&dyn Store) -> io::Result<()>,
        count: impl FnOnce(&mut ConnSummary),
    ) -> Step<()> {
        if req.flags & !allowed != 0 {
            return Ok(self.error(req.handle, EINVAL, "flag not valid for this command")?);
        }
        if writes && self.config.read_only {
            return Ok(self.error(req.handle, EPERM, "the export is read-only")?);
        }
        if !self.in_bounds(req.offset, req.len) {
            return Ok(self.error(req.handle, past_end, "request past the end of the export")?);
        }
        if let Err(e) = op(self.store) {
            return Ok(self.error(req.handle, nbd_errno(&e), &format!("failed: {e}"))?);
        }
        count(&mut self.summary);
        Ok(self.done(req.handle)?)
    }

    pub(super) fn block_status(&mut self, req: Request) -> Step<()> {
        if req.flags & !(CMD_FLAG_REQ_ONE | CMD_FLAG_FUA) != 0 {
            return Ok(self.error(req.handle, EINVAL, "flag not valid for NBD_CMD_BLOCK_STATUS")?);
        }
        if !self.structured || !self.meta {
            return Ok(self.error(req.handle, EINVAL, "no metadata context was selected")?);
        }
        if req.len == 0 || !self.in_bounds(req.offset, req.len) {
            return Ok(self.error(req.handle, EINVAL, "block status past the end of the export or empty")?);
        }
        let max = if req.flags & CMD_FLAG_REQ_ONE != 0 { 1 } else { MAX_EXTENTS };
        let extents = match self.store.extents(req.offset, req.len as u64, max) {
            Ok(x) if !x.is_empty() => x,
            // Status 0 ("allocated, contents unknown") is always true.
            Ok(_) => vec![Extent { len: req.len as u64, hole: false, zero: false }],
            Err(e) => return Ok(self.error(req.handle, nbd_errno(&e), &format!("block status failed: {e}"))?),
        };
        let mut payload = Vec::with_capacity(4 + 8 * extents.len());
        payload.extend_from_slice(&BASE_ALLOCATION_ID.to_be_bytes());
        let mut total = 0u64;
        for x in extents.iter().take(max) {
            let len = x.len.min(req.len as u64 - total);
            if len == 0 {
                break;
            }
            total += len;
            let state = if x.hole { STATE_HOLE } else { 0 } | if x.zero { STATE_ZERO } else { 0 };
            payload.extend_from_slice(&(len as u32).to_be_bytes());
            payload.extend_from_slice(&state.to_be_bytes());
        }
        self.summary.block_status += 1;
        Ok(self.chunk(req.handle, REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, &[&payload])?)
    }
}
