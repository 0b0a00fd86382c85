//! The setup messages that backends between processes exchange before a
//! channel's data path starts: the binder's request, the creator's answer,
//! and (shared memory) a pool's announcement. One encoding for every
//! backend, so a bind negotiates the same way whatever carries it.
//!
//! | message | bytes after `FRY1` and the kind |
//! |---|---|
//! | 1 bind request | role, trust (255: any), max meta u16, alignment u64, min size u64, max size u64 |
//! | 2 bind accepted | binder direction, binder role, creator role, trust, meta u16, queue depth u32, alignment u64, min u64, max u64 |
//! | 3 bind refused | reason code |
//! | 4 pool | pool id u128, buffer size u64, buffer count u32 |
//! | 5 pool ledger | as 4 |
//!
//! All integers little endian. How a message is framed (a seqpacket
//! datagram, a length prefix on a stream) is the backend's business.

use crate::error::{Error, Result};
use crate::pool::{Geometry, PoolId, TrustLevel};
use crate::proto;
use crate::setup::{BindParams, ChannelConstraints, Direction, Negotiated, Role};
use crate::ErrorKind;

const MAGIC: &[u8; 4] = b"FRY1";
pub(crate) const KIND_BIND: u8 = 1;
pub(crate) const KIND_ACCEPT: u8 = 2;
pub(crate) const KIND_REFUSE: u8 = 3;
pub(crate) const KIND_POOL: u8 = 4;
pub(crate) const KIND_LEDGER: u8 = 5;

/// Longest setup message (a bind reply).
pub(crate) const MAX_LEN: usize = 64;

/// Why a creator refused a bind: the strings of `negotiate`, and
/// [`REFUSE_DOORBELL`], by code.
const REASONS: [&str; 4] = [
    "the binder requires another trust level",
    "the binder cannot take the channel's meta size",
    "both ends want the same role",
    REFUSE_DOORBELL,
];

/// The creator's refusal of a bind request whose doorbell is not an eventfd.
pub(crate) const REFUSE_DOORBELL: &str = "the binder's doorbell is not an eventfd";

/// A setup message being written.
pub(crate) struct Wire(pub(crate) Vec<u8>);

impl Wire {
    pub(crate) fn new(kind: u8) -> Wire {
        let mut v = MAGIC.to_vec();
        v.push(kind);
        Wire(v)
    }
    pub(crate) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u128(&mut self, v: u128) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn constraints(&mut self, c: &ChannelConstraints) {
        self.u64(c.alignment as u64);
        self.u64(c.min_buffer_size as u64);
        self.u64(c.max_buffer_size as u64);
    }
}

/// A setup message from the peer; every shortfall is a protocol error.
pub(crate) struct Reader<'a>(&'a [u8]);

pub(crate) fn bad(what: &str) -> Error {
    ErrorKind::Protocol(format!("setup message: {what}")).into()
}

impl<'a> Reader<'a> {
    /// Check the magic; the message kind and a reader for the rest.
    pub(crate) fn open(buf: &'a [u8]) -> Result<(u8, Reader<'a>)> {
        if buf.len() < 5 || &buf[..4] != MAGIC {
            return Err(bad("bad magic or version"));
        }
        Ok((buf[4], Reader(&buf[5..])))
    }
    fn take<const N: usize>(&mut self) -> Result<[u8; N]> {
        if self.0.len() < N {
            return Err(bad("truncated"));
        }
        let (a, b) = self.0.split_at(N);
        self.0 = b;
        Ok(a.try_into().expect("N bytes"))
    }
    pub(crate) fn u8(&mut self) -> Result<u8> {
        Ok(self.take::<1>()?[0])
    }
    pub(crate) fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    pub(crate) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    pub(crate) fn usize(&mut self) -> Result<usize> {
        usize::try_from(self.u64()?).map_err(|_| bad("value out of range"))
    }
    pub(crate) fn u128(&mut self) -> Result<u128> {
        Ok(u128::from_le_bytes(self.take()?))
    }
    fn constraints(&mut self) -> Result<ChannelConstraints> {
        let c = ChannelConstraints {
            alignment: self.usize()?,
            min_buffer_size: self.usize()?,
            max_buffer_size: self.usize()?,
        };
        if c.alignment != 0 && !c.alignment.is_power_of_two() {
            return Err(bad("alignment not a power of two"));
        }
        Ok(c)
    }
    fn role(&mut self) -> Result<Role> {
        Ok(match self.u8()? {
            0 => Role::Generic,
            1 => Role::Master,
            2 => Role::Slave,
            _ => return Err(bad("bad role")),
        })
    }
    fn direction(&mut self) -> Result<Direction> {
        Ok(match self.u8()? {
            0 => Direction::Tx,
            1 => Direction::Rx,
            _ => return Err(bad("bad direction")),
        })
    }
    fn trust(&mut self) -> Result<TrustLevel> {
        TrustLevel::from_u8(self.u8()?).filter(|t| *t != TrustLevel::Uninitialized).ok_or_else(|| bad("bad trust"))
    }
}

fn role_code(r: Role) -> u8 {
    match r {
        Role::Generic => 0,
        Role::Master => 1,
        Role::Slave => 2,
    }
}

fn direction_code(d: Direction) -> u8 {
    match d {
        Direction::Tx => 0,
        Direction::Rx => 1,
    }
}

/// The binder's request.
pub(crate) fn encode_bind(params: &BindParams) -> Vec<u8> {
    let mut w = Wire::new(KIND_BIND);
    w.u8(role_code(params.role));
    w.u8(params.trust.map_or(255, TrustLevel::to_u8));
    w.u16(params.max_meta_size.min(usize::from(u16::MAX)) as u16);
    w.constraints(&params.constraints);
    w.0
}

pub(crate) fn parse_bind(buf: &[u8]) -> Result<BindParams> {
    let (kind, mut r) = Reader::open(buf)?;
    if kind != KIND_BIND {
        return Err(bad("expected a bind request"));
    }
    let role = r.role()?;
    let trust = match r.u8()? {
        255 => None,
        t => Some(TrustLevel::from_u8(t).ok_or_else(|| bad("bad trust"))?),
    };
    let max_meta_size = usize::from(r.u16()?);
    let constraints = r.constraints()?;
    Ok(BindParams { role, trust, max_meta_size, constraints, ..BindParams::default() })
}

/// The creator's acceptance, with the queue depth of both directions.
pub(crate) fn encode_accept(neg: &Negotiated, depth: u32) -> Vec<u8> {
    let mut w = Wire::new(KIND_ACCEPT);
    w.u8(direction_code(neg.binder_direction));
    w.u8(role_code(neg.binder_role));
    w.u8(role_code(neg.creator_role));
    w.u8(neg.trust.to_u8());
    w.u16(neg.meta_size as u16);
    w.u32(depth);
    w.constraints(&neg.constraints);
    w.0
}

/// The creator's refusal; `why` is one of `negotiate`'s reasons.
pub(crate) fn encode_refuse(why: &str) -> Vec<u8> {
    let mut w = Wire::new(KIND_REFUSE);
    w.u8(REASONS.iter().position(|r| *r == why).map_or(255, |i| i as u8));
    w.0
}

/// The binder reads the creator's answer: what was negotiated and the queue
/// depth, or [`ErrorKind::BindRefused`].
pub(crate) fn parse_reply(buf: &[u8]) -> Result<(Negotiated, u32)> {
    let (kind, mut r) = Reader::open(buf)?;
    match kind {
        KIND_REFUSE => {
            let why = REASONS.get(usize::from(r.u8()?)).copied().unwrap_or("refused by the creator");
            return Err(ErrorKind::BindRefused(why).into());
        }
        KIND_ACCEPT => {}
        _ => return Err(bad("expected a bind reply")),
    }
    let binder_direction = r.direction()?;
    let binder_role = r.role()?;
    let creator_role = r.role()?;
    let trust = r.trust()?;
    let meta_size = usize::from(r.u16()?);
    let depth = r.u32()?;
    let constraints = r.constraints()?;
    if meta_size > proto::MAX_META_SIZE {
        return Err(bad("meta size too large"));
    }
    if !depth.is_power_of_two() || !(2..=65536).contains(&depth) {
        return Err(bad("queue depth out of range"));
    }
    Ok((Negotiated { binder_direction, binder_role, creator_role, trust, meta_size, constraints }, depth))
}

/// Which file of a pool travels beside its announcement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PoolFile {
    /// The pool's memory (with its ledger, if a second fd comes).
    Memory,
    /// Only its custody ledger (trust NONE: the memory comes later).
    Ledger,
}

/// A pool's announcement (its file travels beside it).
pub(crate) fn encode_pool(file: PoolFile, id: PoolId, g: Geometry) -> Vec<u8> {
    let mut w = Wire::new(match file {
        PoolFile::Memory => KIND_POOL,
        PoolFile::Ledger => KIND_LEDGER,
    });
    w.u128(id.as_u128());
    w.u64(g.buffer_size() as u64);
    w.u32(g.count());
    w.0
}

pub(crate) fn parse_pool(buf: &[u8]) -> Result<(PoolFile, PoolId, Geometry)> {
    let (kind, mut r) = Reader::open(buf)?;
    let file = match kind {
        KIND_POOL => PoolFile::Memory,
        KIND_LEDGER => PoolFile::Ledger,
        _ => return Err(bad("unexpected message after setup")),
    };
    let id = PoolId::from_u128(r.u128()?);
    let size = r.usize()?;
    let count = r.u32()?;
    let geometry = Geometry::new(size, u64::from(count)).map_err(|e| bad(&e.to_string()))?;
    Ok((file, id, geometry))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_and_reply_roundtrip() {
        let params = BindParams {
            role: Role::Slave,
            trust: Some(TrustLevel::Half),
            max_meta_size: 64,
            constraints: ChannelConstraints { alignment: 4096, min_buffer_size: 4096, max_buffer_size: 1 << 20 },
            ..BindParams::default()
        };
        assert_eq!(parse_bind(&encode_bind(&params)).unwrap(), params);
        let neg = Negotiated {
            binder_direction: Direction::Rx,
            binder_role: Role::Slave,
            creator_role: Role::Master,
            trust: TrustLevel::Half,
            meta_size: 16,
            constraints: params.constraints,
        };
        let (back, depth) = parse_reply(&encode_accept(&neg, 512)).unwrap();
        assert_eq!((back, depth), (neg, 512));
        assert_eq!(parse_reply(&encode_refuse(REASONS[2])).unwrap_err(), ErrorKind::BindRefused(REASONS[2]));
        let g = Geometry::new(4096, 3).unwrap();
        let id = PoolId::from_u128(77);
        assert_eq!(parse_pool(&encode_pool(PoolFile::Memory, id, g)).unwrap(), (PoolFile::Memory, id, g));
        assert_eq!(parse_pool(&encode_pool(PoolFile::Ledger, id, g)).unwrap(), (PoolFile::Ledger, id, g));
    }

    #[test]
    fn malformed_messages_are_errors() {
        assert!(parse_bind(b"FRY2\x01").is_err());
        assert!(parse_bind(b"FRY1\x01\x00").is_err(), "truncated");
        assert!(parse_reply(b"FRY1\x01").is_err(), "a request is not a reply");
        let mut bad_align = encode_bind(&BindParams::default());
        bad_align[9..17].copy_from_slice(&3u64.to_le_bytes());
        assert!(parse_bind(&bad_align).is_err());
        for n in 0..encode_pool(PoolFile::Memory, PoolId::from_u128(1), Geometry::new(4096, 1).unwrap()).len() {
            assert!(parse_pool(
                &encode_pool(PoolFile::Memory, PoolId::from_u128(1), Geometry::new(4096, 1).unwrap())[..n]
            )
            .is_err());
        }
    }
    #[test]
    fn a_reply_must_settle_what_the_binder_asked_for() {
        use crate::setup::{negotiate, ChannelSetup};
        let params = BindParams {
            role: Role::Slave,
            trust: Some(TrustLevel::Half),
            max_meta_size: 32,
            constraints: ChannelConstraints { alignment: 8192, min_buffer_size: 0, max_buffer_size: 0 },
            ..BindParams::default()
        };
        let s = ChannelSetup { trust: TrustLevel::Half, meta_size: 32, ..ChannelSetup::default() };
        let good = negotiate(&s, &params).unwrap();
        crate::setup::check_reply(&params, &good).unwrap();
        let lies = [
            Negotiated { trust: TrustLevel::Full, ..good },
            Negotiated { meta_size: 64, ..good },
            Negotiated { binder_role: Role::Master, creator_role: Role::Slave, ..good },
            Negotiated { creator_role: Role::Slave, ..good },
            Negotiated { constraints: ChannelConstraints::default(), ..good },
        ];
        for lie in lies {
            assert!(
                matches!(
                    crate::setup::check_reply(&params, &lie).as_ref().map_err(|e| e.kind()),
                    Err(ErrorKind::Protocol(_))
                ),
                "{lie:?}"
            );
        }
    }

    #[test]
    fn limits_count_pools_and_bytes() {
        let l = crate::setup::ChannelLimits { max_peer_pools: 2, max_peer_bytes: 1 << 20 };
        let g = Geometry::new(4096, 16).unwrap();
        l.admit(1, 0, g).unwrap();
        assert!(matches!(
            l.admit(2, 0, g).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::LimitExceeded { limit: 2, .. })
        ));
        assert!(matches!(
            l.admit(0, (1 << 20) - 4096, g).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::LimitExceeded { limit: 1_048_576, .. })
        ));
        assert!(
            matches!(l.admit(0, usize::MAX, g).as_ref().map_err(|e| e.kind()), Err(ErrorKind::LimitExceeded { .. })),
            "no overflow"
        );
    }
}
