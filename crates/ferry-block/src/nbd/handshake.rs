//! The handshake: the server's greeting and option haggling.

use super::*;

impl<'a, S: Read + Write> Session<'a, S> {
    pub(super) fn transmission_flags(&self) -> u16 {
        let mut flags = TF_HAS_FLAGS
            | TF_SEND_FLUSH
            | TF_SEND_FUA
            | TF_SEND_TRIM
            | TF_SEND_WRITE_ZEROES
            | TF_CAN_MULTI_CONN
            | TF_SEND_CACHE;
        if self.structured {
            flags |= TF_SEND_DF;
        }
        if self.config.read_only {
            flags |= TF_READ_ONLY;
        }
        flags
    }

    // ----- handshake -----

    /// The server's greeting and the client's flags.
    pub(super) fn hello(&mut self) -> Step<()> {
        let mut hello = [0u8; 18];
        hello[..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
        hello[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
        hello[16..].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        self.stream.write_all(&hello)?;
        let mut cf = [0u8; 4];
        self.stream.read_exact(&mut cf)?;
        let client_flags = u32::from_be_bytes(cf);
        if client_flags & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0 {
            return Err(End::Hard(format!("sent unknown client flags {client_flags:#x}")));
        }
        self.no_zeroes = client_flags & CLIENT_NO_ZEROES != 0;
        Ok(())
    }

    /// Option haggling, until the client picks the export or asks for TLS
    /// (acknowledged).
    pub(super) fn options(&mut self) -> Step<Negotiated> {
        let require = matches!(self.config.tls, NbdTls::Require(_)) && !self.tls_up;
        loop {
            let mut head = [0u8; 16];
            self.stream.read_exact(&mut head)?;
            let magic = u64::from_be_bytes(head[..8].try_into().expect("8 bytes"));
            let option = u32::from_be_bytes(head[8..12].try_into().expect("4 bytes"));
            let len = u32::from_be_bytes(head[12..].try_into().expect("4 bytes"));
            if magic != IHAVEOPT {
                return Err(End::Hard("sent an option without the IHAVEOPT magic".into()));
            }
            if len > MAX_OPTION_DATA {
                return Err(End::Hard(format!("sent option {option} with {len} bytes of data")));
            }
            let mut data = vec![0u8; len as usize];
            self.stream.read_exact(&mut data)?;
            if require && !matches!(option, OPT_STARTTLS | OPT_ABORT) {
                if option == OPT_EXPORT_NAME {
                    // It cannot be refused: the connection ends instead.
                    return Err(End::Hard("asked for the export in plain text; this server requires TLS".into()));
                }
                self.opt_error(option, REP_ERR_TLS_REQD, "this server requires TLS: send NBD_OPT_STARTTLS first")?;
                continue;
            }
            match option {
                OPT_STARTTLS => {
                    if self.config.tls.config().is_none() {
                        self.opt_error(option, REP_ERR_POLICY, "this server does not offer TLS")?;
                    } else if self.tls_up {
                        self.opt_error(option, REP_ERR_INVALID, "TLS is on already")?;
                    } else if !data.is_empty() {
                        self.opt_error(option, REP_ERR_INVALID, "NBD_OPT_STARTTLS takes no data")?;
                    } else {
                        self.opt_reply(option, REP_ACK, &[])?;
                        return Ok(Negotiated::StartTls);
                    }
                }
                OPT_EXPORT_NAME => {
                    let name = std::str::from_utf8(&data).unwrap_or("\u{fffd}");
                    if name != self.config.export_name {
                        return Err(End::Hard(format!("asked for export {name:?}, which does not exist")));
                    }
                    let mut reply = Vec::with_capacity(10 + 124);
                    reply.extend_from_slice(&self.store.size().to_be_bytes());
                    reply.extend_from_slice(&self.transmission_flags().to_be_bytes());
                    if !self.no_zeroes {
                        reply.resize(reply.len() + 124, 0);
                    }
                    self.stream.write_all(&reply)?;
                    return Ok(Negotiated::Transmission);
                }
                OPT_ABORT => {
                    if data.is_empty() {
                        // The client may have gone already: no matter.
                        let _ = self.opt_reply(option, REP_ACK, &[]);
                        return Err(End::Soft("NBD_OPT_ABORT"));
                    }
                    self.opt_error(option, REP_ERR_INVALID, "NBD_OPT_ABORT takes no data")?;
                }
                OPT_LIST => {
                    if !data.is_empty() {
                        self.opt_error(option, REP_ERR_INVALID, "NBD_OPT_LIST takes no data")?;
                        continue;
                    }
                    let name = self.config.export_name.as_bytes();
                    let mut server = Vec::with_capacity(4 + name.len());
                    server.extend_from_slice(&(name.len() as u32).to_be_bytes());
                    server.extend_from_slice(name);
                    self.opt_reply(option, REP_SERVER, &server)?;
                    self.opt_reply(option, REP_ACK, &[])?;
                }
                OPT_INFO | OPT_GO => {
                    if self.info(option, &data)? && option == OPT_GO {
                        return Ok(Negotiated::Transmission);
                    }
                }
                OPT_STRUCTURED_REPLY => {
                    if !data.is_empty() {
                        self.opt_error(option, REP_ERR_INVALID, "NBD_OPT_STRUCTURED_REPLY takes no data")?;
                        continue;
                    }
                    self.structured = true;
                    self.opt_reply(option, REP_ACK, &[])?;
                }
                OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => self.meta_context(option, &data)?,
                _ => self.opt_error(option, REP_ERR_UNSUP, "option not supported by this server")?,
            }
        }
    }

    pub(super) fn opt_reply(&mut self, option: u32, kind: u32, data: &[u8]) -> io::Result<()> {
        let mut head = [0u8; 20];
        head[..8].copy_from_slice(&REPLY_MAGIC.to_be_bytes());
        head[8..12].copy_from_slice(&option.to_be_bytes());
        head[12..16].copy_from_slice(&kind.to_be_bytes());
        head[16..].copy_from_slice(&(data.len() as u32).to_be_bytes());
        write_all_parts(&mut self.stream, &mut [IoSlice::new(&head), IoSlice::new(data)])
    }

    pub(super) fn opt_error(&mut self, option: u32, kind: u32, message: &str) -> io::Result<()> {
        self.opt_reply(option, kind, message.as_bytes())
    }

    /// NBD_OPT_INFO and NBD_OPT_GO; true if the export was described (and
    /// for GO the transmission phase begins).
    pub(super) fn info(&mut self, option: u32, data: &[u8]) -> Step<bool> {
        let mut d = data;
        let parsed = (|| {
            let name_len = take_u32(&mut d)?;
            let name = take_string(&mut d, name_len)?;
            let count = take_u16(&mut d)?;
            let mut wanted = Vec::new();
            for _ in 0..count {
                wanted.push(take_u16(&mut d)?);
            }
            d.is_empty().then_some((name, wanted))
        })();
        let Some((name, wanted)) = parsed else {
            self.opt_error(option, REP_ERR_INVALID, "malformed NBD_OPT_INFO/NBD_OPT_GO data")?;
            return Ok(false);
        };
        if name != self.config.export_name {
            self.opt_error(option, REP_ERR_UNKNOWN, "no such export")?;
            return Ok(false);
        }
        let mut export = INFO_EXPORT.to_be_bytes().to_vec();
        export.extend_from_slice(&self.store.size().to_be_bytes());
        export.extend_from_slice(&self.transmission_flags().to_be_bytes());
        self.opt_reply(option, REP_INFO, &export)?;
        // Block sizes go out whether asked for or not: any byte-aligned
        // request works, 4096 is best, payloads up to max_payload.
        let mut sizes = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [1u32, 4096, self.config.max_payload] {
            sizes.extend_from_slice(&v.to_be_bytes());
        }
        self.opt_reply(option, REP_INFO, &sizes)?;
        if wanted.contains(&INFO_NAME) {
            let mut r = INFO_NAME.to_be_bytes().to_vec();
            r.extend_from_slice(self.config.export_name.as_bytes());
            self.opt_reply(option, REP_INFO, &r)?;
        }
        if wanted.contains(&INFO_DESCRIPTION) {
            let mut r = INFO_DESCRIPTION.to_be_bytes().to_vec();
            let desc = self.config.description.as_bytes();
            r.extend_from_slice(&desc[..desc.len().min(MAX_STRING)]);
            self.opt_reply(option, REP_INFO, &r)?;
        }
        self.opt_reply(option, REP_ACK, &[])?;
        Ok(true)
    }

    /// NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT.
    pub(super) fn meta_context(&mut self, option: u32, data: &[u8]) -> Step<()> {
        let list = option == OPT_LIST_META_CONTEXT;
        if !self.structured {
            self.opt_error(option, REP_ERR_INVALID, "negotiate structured replies first")?;
            return Ok(());
        }
        let mut d = data;
        let parsed = (|| {
            let name_len = take_u32(&mut d)?;
            let name = take_string(&mut d, name_len)?;
            let count = take_u32(&mut d)?;
            let mut queries = Vec::new();
            for _ in 0..count {
                let len = take_u32(&mut d)?;
                queries.push(take_string(&mut d, len)?);
            }
            d.is_empty().then_some((name, queries))
        })();
        let Some((name, queries)) = parsed else {
            self.opt_error(option, REP_ERR_INVALID, "malformed meta context data")?;
            return Ok(());
        };
        if queries.iter().any(|q| !q.contains(':')) {
            self.opt_error(option, REP_ERR_INVALID, "a query starts with a namespace, e.g. base:")?;
            return Ok(());
        }
        if name != self.config.export_name {
            self.opt_error(option, REP_ERR_UNKNOWN, "no such export")?;
            return Ok(());
        }
        let matches = if list {
            queries.is_empty() || queries.iter().any(|q| q == "base:" || q == BASE_ALLOCATION)
        } else {
            queries.iter().any(|q| q == BASE_ALLOCATION)
        };
        if !list {
            self.meta = matches;
        }
        if matches {
            let id = if list { 0u32 } else { BASE_ALLOCATION_ID };
            let mut r = id.to_be_bytes().to_vec();
            r.extend_from_slice(BASE_ALLOCATION.as_bytes());
            self.opt_reply(option, REP_META_CONTEXT, &r)?;
        }
        self.opt_reply(option, REP_ACK, &[])?;
        Ok(())
    }
}
