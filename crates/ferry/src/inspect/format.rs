//! The registry file: a fixed header, then one snapshot of the process's
//! domains, pools and channels. The writer (one thread per process)
//! rewrites it in place; a reader never trusts it: every length, count and
//! string is checked, and a snapshot caught while being rewritten (the
//! generation is odd, changed while reading, or the checksum does not
//! match) is read again.
//!
//! ```text
//! offset  size  field
//!      0     8  magic "FERRYIN\0"
//!      8     4  version (1)
//!     12     4  header length (64)
//!     16     8  generation: odd while the writer rewrites the body
//!     24     4  body length
//!     28     4  reserved (0)
//!     32     8  FNV-1a 64 of the body
//!     40     4  pid
//!     44     4  reserved (0)
//!     48     8  the process's start time (clock ticks after boot, /proc/PID/stat)
//!     56     8  when the snapshot was taken (ms since the Unix epoch)
//!     64     -  body (little-endian; strings are a u16 length and UTF-8)
//! ```
//!
//! Body: process name (str), publication interval in ms (u32), u16
//! domains, each: id (u64), name (str), u16 pools, u16 channels, the pools
//! (id u128, buffer count u32, buffer size u64, origin u8 (1: created
//! here), trust (str), u16 count of u32 gauges, the gauges in the order of
//! [`PoolStats`]), the channels (key u64, backend, endpoint, peer, role,
//! direction, trust, state (str each), flags u8 (bit 0: blocked on a full
//! queue), u16 count of u64 counters, the counters in the order of
//! [`CHANNEL_FIELDS`]). A reader takes the gauges and counters it knows
//! and skips any a newer writer appended.

use super::{ChannelStats, OpCounts, PoolStats};

/// The first bytes of every registry file.
pub const MAGIC: [u8; 8] = *b"FERRYIN\0";
/// The format version this library writes and reads.
pub const VERSION: u32 = 1;
/// Bytes before the body.
pub const HEADER_LEN: usize = 64;
/// The largest body a reader accepts: room for the most domains and
/// channel ends a snapshot can hold (65535 each).
pub const MAX_BODY: usize = 64 << 20;
/// The longest string written (endpoint paths and names are cut).
const MAX_STR: usize = 1024;

/// Offsets of the header fields the writer updates.
pub(crate) const GENERATION_AT: u64 = 16;

/// Names of a channel's counters, in the order they are stored.
pub const CHANNEL_FIELDS: [&str; 22] = [
    "moves_sent",
    "passes_sent",
    "copies_sent",
    "releases_sent",
    "pool_assigns_sent",
    "pool_removes_sent",
    "aggregates_sent",
    "moves_received",
    "passes_received",
    "copies_received",
    "releases_received",
    "pool_assigns_received",
    "pool_removes_received",
    "aggregates_received",
    "bytes_sent",
    "bytes_received",
    "queue_capacity",
    "queue_depth",
    "queue_high_water",
    "queue_full",
    "wakeups",
    "errors",
];

/// Why a registry file could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// Not a registry file, or one of another version.
    #[error("not a Ferry registry file of version {VERSION}: {0}")]
    Format(&'static str),
    /// The body does not parse.
    #[error("malformed registry snapshot: {0}")]
    Malformed(&'static str),
    /// The writer rewrote the file every time it was read.
    #[error("the snapshot kept changing while it was read")]
    Busy,
    /// Reading the file failed.
    #[error("{0}")]
    Io(String),
}

/// One process as its registry file describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSnapshot {
    /// Process id.
    pub pid: u32,
    /// Start time of the process (clock ticks after boot): with the pid,
    /// tells a live process from a later one that reused its pid.
    pub start_time: u64,
    /// When the snapshot was taken, in ms since the Unix epoch.
    pub taken_at_ms: u64,
    /// Snapshot generation (grows by two per snapshot).
    pub generation: u64,
    /// The process's name (`/proc/PID/comm`).
    pub name: String,
    /// How often the process publishes, in ms.
    pub interval_ms: u32,
    /// Its live domains.
    pub domains: Vec<DomainSnapshot>,
}

/// One domain of a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainSnapshot {
    /// Domain id, unique in its process.
    pub id: u64,
    /// The name given at [`Domain::new`](crate::Domain::new).
    pub name: String,
    /// The pools in its pool list.
    pub pools: Vec<PoolSnapshot>,
    /// Its channel ends that are not dropped.
    pub channels: Vec<ChannelSnapshot>,
}

/// One pool in a domain's pool list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSnapshot {
    /// Pool id (the same in every process that knows the pool).
    pub id: u128,
    /// Buffers in the pool.
    pub buffers: u32,
    /// Bytes per buffer.
    pub buffer_size: u64,
    /// The domain created the pool (it is its buffers' first owner).
    pub created_here: bool,
    /// The pool's trust level as this domain records it.
    pub trust: String,
    /// What the domain holds of the pool.
    pub stats: PoolStats,
}

/// One channel end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelSnapshot {
    /// Identifies the end in its domain.
    pub key: u64,
    /// `local`, `shm`, `tcp` or `mux`.
    pub backend: String,
    /// The endpoint it was created or bound on (socket path, address).
    pub endpoint: String,
    /// The peer: `pid N` for shared memory, `this process` for local
    /// channels, an address for TCP and mux channels, empty
    /// before it is connected.
    pub peer: String,
    /// Role (Generic, Master, Slave).
    pub role: String,
    /// Direction of this end (Tx: source, Rx: sink).
    pub direction: String,
    /// Trust level.
    pub trust: String,
    /// Channel state.
    pub state: String,
    /// Counters.
    pub stats: ChannelStats,
}

/// FNV-1a, 64 bits: catches a body torn by a concurrent rewrite.
pub(crate) fn checksum(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The header of a snapshot whose body is `body`.
pub(crate) fn header(generation: u64, body: &[u8], pid: u32, start_time: u64, taken_at_ms: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
    h[16..24].copy_from_slice(&generation.to_le_bytes());
    h[24..28].copy_from_slice(&(body.len() as u32).to_le_bytes());
    h[32..40].copy_from_slice(&checksum(body).to_le_bytes());
    h[40..44].copy_from_slice(&pid.to_le_bytes());
    h[48..56].copy_from_slice(&start_time.to_le_bytes());
    h[56..64].copy_from_slice(&taken_at_ms.to_le_bytes());
    h
}

/// Appends a snapshot body.
#[derive(Default)]
pub(crate) struct Writer {
    pub(crate) buf: Vec<u8>,
}

impl Writer {
    pub(crate) fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u128(&mut self, v: u128) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn str(&mut self, s: &str) {
        let mut end = s.len().min(MAX_STR);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16);
        self.buf.extend_from_slice(&s.as_bytes()[..end]);
    }

    pub(crate) fn pool(&mut self, p: &PoolSnapshot) {
        self.u128(p.id);
        self.u32(p.buffers);
        self.u64(p.buffer_size);
        self.u8(u8::from(p.created_here));
        self.str(&p.trust);
        let s = &p.stats;
        let gauges = [s.free, s.in_use, s.lent, s.copies_held, s.copies_out];
        self.u16(gauges.len() as u16);
        for g in gauges {
            self.u32(g);
        }
    }

    pub(crate) fn channel(&mut self, c: &ChannelSnapshot) {
        self.u64(c.key);
        for s in [&c.backend, &c.endpoint, &c.peer, &c.role, &c.direction, &c.trust, &c.state] {
            self.str(s);
        }
        self.u8(u8::from(c.stats.blocked));
        let fields = channel_fields(&c.stats);
        self.u16(fields.len() as u16);
        for v in fields {
            self.u64(v);
        }
    }
}

fn ops(o: &OpCounts) -> [u64; 7] {
    [o.moves, o.passes, o.copies, o.releases, o.pool_assigns, o.pool_removes, o.aggregates]
}

fn channel_fields(s: &ChannelStats) -> [u64; CHANNEL_FIELDS.len()] {
    let (a, b) = (ops(&s.sent), ops(&s.received));
    [
        a[0],
        a[1],
        a[2],
        a[3],
        a[4],
        a[5],
        a[6],
        b[0],
        b[1],
        b[2],
        b[3],
        b[4],
        b[5],
        b[6],
        s.bytes_sent,
        s.bytes_received,
        u64::from(s.queue_capacity),
        u64::from(s.queue_depth),
        u64::from(s.queue_high_water),
        s.queue_full,
        s.wakeups,
        s.errors,
    ]
}

/// Reads a snapshot body: every read is bounds-checked.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        if self.rest.len() < n {
            return Err(ReadError::Malformed("truncated"));
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], ReadError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, ReadError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, ReadError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, ReadError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, ReadError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn u128(&mut self) -> Result<u128, ReadError> {
        Ok(u128::from_le_bytes(self.array()?))
    }
    fn str(&mut self) -> Result<String, ReadError> {
        let n = usize::from(self.u16()?);
        if n > MAX_STR {
            return Err(ReadError::Malformed("string too long"));
        }
        let bytes = self.take(n)?;
        std::str::from_utf8(bytes).map(str::to_owned).map_err(|_| ReadError::Malformed("string not UTF-8"))
    }
    /// A count of items of at least `min_size` bytes each, checked against
    /// what is left (so a forged count cannot make a reader allocate).
    fn count(&mut self, min_size: usize) -> Result<usize, ReadError> {
        let n = usize::from(self.u16()?);
        if n.saturating_mul(min_size) > self.rest.len() {
            return Err(ReadError::Malformed("count larger than the snapshot"));
        }
        Ok(n)
    }

    fn pool(&mut self) -> Result<PoolSnapshot, ReadError> {
        let id = self.u128()?;
        let buffers = self.u32()?;
        let buffer_size = self.u64()?;
        let created_here = match self.u8()? {
            0 => false,
            1 => true,
            _ => return Err(ReadError::Malformed("pool origin")),
        };
        let trust = self.str()?;
        let n = self.count(4)?;
        if n < 5 {
            return Err(ReadError::Malformed("too few pool gauges"));
        }
        let mut g = [0u32; 5];
        for (i, v) in (0..n).map(|_| self.u32()).enumerate() {
            if let Some(slot) = g.get_mut(i) {
                *slot = v?;
            } else {
                v?;
            }
        }
        let stats = PoolStats { free: g[0], in_use: g[1], lent: g[2], copies_held: g[3], copies_out: g[4] };
        Ok(PoolSnapshot { id, buffers, buffer_size, created_here, trust, stats })
    }

    fn channel(&mut self) -> Result<ChannelSnapshot, ReadError> {
        let key = self.u64()?;
        let mut s: [String; 7] = Default::default();
        for v in &mut s {
            *v = self.str()?;
        }
        let flags = self.u8()?;
        let n = self.count(8)?;
        if n < CHANNEL_FIELDS.len() {
            return Err(ReadError::Malformed("too few channel counters"));
        }
        let mut f = [0u64; CHANNEL_FIELDS.len()];
        for i in 0..n {
            let v = self.u64()?;
            if let Some(slot) = f.get_mut(i) {
                *slot = v;
            }
        }
        let gauge = |v: u64| u32::try_from(v).map_err(|_| ReadError::Malformed("queue gauge out of range"));
        let ops = |o: &[u64]| OpCounts {
            moves: o[0],
            passes: o[1],
            copies: o[2],
            releases: o[3],
            pool_assigns: o[4],
            pool_removes: o[5],
            aggregates: o[6],
        };
        let stats = ChannelStats {
            sent: ops(&f[0..7]),
            received: ops(&f[7..14]),
            bytes_sent: f[14],
            bytes_received: f[15],
            queue_capacity: gauge(f[16])?,
            queue_depth: gauge(f[17])?,
            queue_high_water: gauge(f[18])?,
            queue_full: f[19],
            wakeups: f[20],
            errors: f[21],
            blocked: flags & 1 != 0,
        };
        let [backend, endpoint, peer, role, direction, trust, state] = s;
        Ok(ChannelSnapshot { key, backend, endpoint, peer, role, direction, trust, state, stats })
    }
}

/// The header fields a reader needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) generation: u64,
    pub(crate) body_len: usize,
    pub(crate) checksum: u64,
    pub(crate) pid: u32,
    pub(crate) start_time: u64,
    pub(crate) taken_at_ms: u64,
}

/// Check and parse a header.
pub(crate) fn parse_header(bytes: &[u8]) -> Result<Header, ReadError> {
    if bytes.len() < HEADER_LEN {
        return Err(ReadError::Format("shorter than its header"));
    }
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    if bytes[0..8] != MAGIC {
        return Err(ReadError::Format("bad magic"));
    }
    if u32_at(8) != VERSION {
        return Err(ReadError::Format("unknown version"));
    }
    if u32_at(12) as usize != HEADER_LEN {
        return Err(ReadError::Format("unknown header length"));
    }
    let body_len = u32_at(24) as usize;
    if body_len > MAX_BODY {
        return Err(ReadError::Format("body too large"));
    }
    Ok(Header {
        generation: u64_at(16),
        body_len,
        checksum: u64_at(32),
        pid: u32_at(40),
        start_time: u64_at(48),
        taken_at_ms: u64_at(56),
    })
}

/// Parse a whole snapshot (header and body) read at once; `Busy` if the
/// writer was in the middle of a rewrite.
pub(crate) fn parse(bytes: &[u8]) -> Result<ProcessSnapshot, ReadError> {
    let h = parse_header(bytes)?;
    if h.generation % 2 == 1 {
        return Err(ReadError::Busy);
    }
    let body = bytes
        .get(HEADER_LEN..HEADER_LEN + h.body_len)
        .ok_or(ReadError::Malformed("body shorter than its header says"))?;
    if checksum(body) != h.checksum {
        // A rewrite under our feet, or a damaged file: the caller reads
        // again and gives up after a few tries.
        return Err(ReadError::Busy);
    }
    let mut r = Reader { rest: body };
    let name = r.str()?;
    let interval_ms = r.u32()?;
    let n_domains = r.count(12)?;
    let mut domains = Vec::with_capacity(n_domains);
    for _ in 0..n_domains {
        let id = r.u64()?;
        let name = r.str()?;
        let n_pools = r.count(0)?;
        let n_channels = r.count(0)?;
        let pools = (0..n_pools).map(|_| r.pool()).collect::<Result<Vec<_>, _>>()?;
        let channels = (0..n_channels).map(|_| r.channel()).collect::<Result<Vec<_>, _>>()?;
        domains.push(DomainSnapshot { id, name, pools, channels });
    }
    if !r.rest.is_empty() {
        return Err(ReadError::Malformed("bytes after the last domain"));
    }
    Ok(ProcessSnapshot {
        pid: h.pid,
        start_time: h.start_time,
        taken_at_ms: h.taken_at_ms,
        generation: h.generation,
        name,
        interval_ms,
        domains,
    })
}

/// A whole registry file holding `snapshot` (header and body), as a
/// process writes it: for tools that make registry files, and tests.
///
/// ```
/// use ferry::inspect::{encode, ProcessSnapshot};
/// let s = ProcessSnapshot { pid: 7, start_time: 1, taken_at_ms: 2, generation: 4, name: "app".into(), interval_ms: 250, domains: vec![] };
/// let dir = std::env::temp_dir().join(format!("ferry-doc-encode-{}", std::process::id()));
/// std::fs::create_dir_all(&dir).unwrap();
/// std::fs::write(dir.join("7.ferry"), encode(&s)).unwrap();
/// let read = ferry::inspect::read_file(&dir.join("7.ferry"));
/// std::fs::remove_dir_all(&dir).unwrap();
/// assert_eq!(read, Ok(s));
/// ```
pub fn encode(snapshot: &ProcessSnapshot) -> Vec<u8> {
    let s = snapshot;
    let body = encode_body(&s.name, s.interval_ms, &s.domains);
    let mut file = header(s.generation & !1, &body, s.pid, s.start_time, s.taken_at_ms).to_vec();
    file.extend_from_slice(&body);
    file
}

/// Encode a snapshot's body (the header comes from [`header`]).
pub(crate) fn encode_body(name: &str, interval_ms: u32, domains: &[DomainSnapshot]) -> Vec<u8> {
    // What does not fit in what a reader accepts is left out (its counts
    // are patched to what was written), never the whole snapshot.
    let budget = MAX_BODY - (64 << 10);
    let patch = |w: &mut Writer, at: usize, n: usize| w.buf[at..at + 2].copy_from_slice(&(n as u16).to_le_bytes());
    let mut w = Writer::default();
    w.str(name);
    w.u32(interval_ms);
    let domains_at = w.buf.len();
    w.u16(0);
    let mut written = 0;
    for d in domains.iter().take(u16::MAX as usize) {
        if w.buf.len() > budget {
            break;
        }
        w.u64(d.id);
        w.str(&d.name);
        let counts_at = w.buf.len();
        w.u16(0);
        w.u16(0);
        let (mut pools, mut chans) = (0, 0);
        for p in d.pools.iter().take(u16::MAX as usize) {
            if w.buf.len() > budget {
                break;
            }
            w.pool(p);
            pools += 1;
        }
        for c in d.channels.iter().take(u16::MAX as usize) {
            if w.buf.len() > budget {
                break;
            }
            w.channel(c);
            chans += 1;
        }
        patch(&mut w, counts_at, pools);
        patch(&mut w, counts_at + 2, chans);
        written += 1;
    }
    patch(&mut w, domains_at, written);
    w.buf
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ProcessSnapshot {
        let stats = ChannelStats {
            sent: OpCounts { moves: 7, passes: 1, ..OpCounts::default() },
            bytes_sent: 7 << 16,
            queue_capacity: 64,
            queue_high_water: 64,
            queue_full: 3,
            blocked: true,
            ..ChannelStats::default()
        };
        let chan = ChannelSnapshot {
            key: 2,
            backend: "shm".into(),
            endpoint: "/tmp/x.sock".into(),
            peer: "pid 42".into(),
            role: "Generic".into(),
            direction: "Tx".into(),
            trust: "Full".into(),
            state: "Connected".into(),
            stats,
        };
        let pool = PoolSnapshot {
            id: 0xdead_beef << 70,
            buffers: 16,
            buffer_size: 65536,
            created_here: true,
            trust: "Full".into(),
            stats: PoolStats { free: 9, in_use: 1, lent: 6, copies_held: 0, copies_out: 2 },
        };
        ProcessSnapshot {
            pid: 1234,
            start_time: 99,
            taken_at_ms: 5,
            generation: 8,
            name: "app".into(),
            interval_ms: 250,
            domains: vec![DomainSnapshot { id: 1, name: "d".into(), pools: vec![pool], channels: vec![chan] }],
        }
    }

    fn file(s: &ProcessSnapshot) -> Vec<u8> {
        let body = encode_body(&s.name, s.interval_ms, &s.domains);
        let mut f = header(s.generation, &body, s.pid, s.start_time, s.taken_at_ms).to_vec();
        f.extend_from_slice(&body);
        f
    }

    #[test]
    fn round_trip() {
        let s = sample();
        assert_eq!(parse(&file(&s)), Ok(s));
    }

    #[test]
    fn a_snapshot_too_large_for_readers_is_cut_not_lost() {
        let mut s = sample();
        let chan = s.domains[0].channels[0].clone();
        let long = ChannelSnapshot { endpoint: "e".repeat(MAX_STR), ..chan };
        // 65535 ends of over 1 KiB each: more than a reader takes.
        s.domains[0].channels = vec![long; u16::MAX as usize];
        let f = file(&s);
        assert!(f.len() <= HEADER_LEN + MAX_BODY);
        let read = parse(&f).expect("a readable snapshot");
        let n = read.domains[0].channels.len();
        assert!(n > 1000 && n < u16::MAX as usize, "{n} channels written");
        assert_eq!(read.domains[0].pools, s.domains[0].pools);
    }

    #[test]
    fn odd_generation_or_torn_body_is_busy() {
        let s = sample();
        let mut f = file(&s);
        f[16] |= 1;
        assert_eq!(parse(&f), Err(ReadError::Busy));
        let mut f = file(&s);
        let last = f.len() - 1;
        f[last] ^= 0xff;
        assert_eq!(parse(&f), Err(ReadError::Busy));
    }

    #[test]
    fn every_truncation_and_bad_header_is_an_error() {
        let f = file(&sample());
        for n in 0..f.len() {
            assert!(parse(&f[..n]).is_err(), "{n} bytes");
        }
        let mut bad = f.clone();
        bad[8] = 2;
        assert_eq!(parse(&bad), Err(ReadError::Format("unknown version")));
    }

    proptest::proptest! {
        /// Garbage with a valid header and checksum (what a reader can be
        /// handed by anyone who can write the directory): errors, never a
        /// panic nor a huge allocation.
        #[test]
        fn garbage_bodies_do_not_panic(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600)) {
            let mut f = header(2, &body, 1, 1, 1).to_vec();
            f.extend_from_slice(&body);
            let _ = parse(&f);
        }

        /// A valid snapshot with bytes flipped and its checksum fixed up.
        #[test]
        fn mutated_snapshots_do_not_panic(at in 0usize..4096, xor in 1u8..) {
            let f = file(&sample());
            let mut body = f[HEADER_LEN..].to_vec();
            let at = at % body.len();
            body[at] ^= xor;
            let mut g = header(2, &body, 1, 1, 1).to_vec();
            g.extend_from_slice(&body);
            let _ = parse(&g);
        }
    }
}
