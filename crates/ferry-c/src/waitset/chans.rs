//! A waitset's channel ends: where each is, what the C side gave with it,
//! and what calls and polls use to find it.

use std::collections::{HashMap, VecDeque};

use ferry::{Channel, PoolId, Selector};

use super::work::Cont;

/// Where a channel end is.
pub(super) enum Link {
    /// In the selector, under this key.
    Attached(usize),
    /// Out of the selector because it closed (kept until destroyed).
    Detached(Box<Channel>),
}

/// A channel end created or bound through the C interface.
pub struct Chan {
    /// Its token (the `impl_data` of the program's struct).
    pub(super) token: usize,
    /// Address of the program's `struct bulk_channel`.
    pub(super) c_addr: usize,
    /// Address of the program's callbacks.
    pub(super) callbacks: usize,
    pub(super) link: Link,
    pub(super) bind_cont: Option<Cont>,
    /// Our pool assignments and removals waiting for the peer's answer.
    pub(super) assigning: Vec<(PoolId, Option<Cont>)>,
    pub(super) removing: Vec<(PoolId, Option<Cont>)>,
    /// Bound once: its end is reported by teardown_received.
    pub(super) connected_once: bool,
    /// Payload bytes this end gave a network link to send, in all.
    pub(super) queued_payload: u64,
    /// Continuations of sends over a network link whose bytes are not all
    /// written to the socket yet: they run once the link's count of payload
    /// bytes sent reaches the number.
    pub(super) unsent: VecDeque<(u64, Cont)>,
}

/// An attached channel end as the direct poll sees it: what a buffer
/// event needs to become its callback.
#[derive(Clone, Copy)]
pub(super) struct Polled {
    /// Its key in the selector.
    pub(super) key: usize,
    /// Its token.
    pub(super) token: usize,
    /// Address of the program's `struct bulk_channel`.
    pub(super) c_addr: usize,
    /// Address of the program's callbacks.
    pub(super) callbacks: usize,
    /// A local channel, whose sends held back are published only by a
    /// flush or a poll that finds nothing (a shared-memory end publishes
    /// an answer at once when it has caught up with its arrivals).
    pub(super) local: bool,
}

/// A channel end as calls name it: its token, and its place among its
/// waitset's channel ends (found without hashing the token; checked
/// against the token, so a stale place finds nothing).
#[derive(Clone, Copy, Debug)]
pub struct ChanId {
    /// The channel's token (never reused).
    pub token: usize,
    /// Where [`Waitset::insert`](super::Waitset::insert) put it.
    pub place: usize,
}

/// A waitset's channel ends: at their places (a call finds its end by
/// the place it was given, no hashing), and by token (the rarer lookups).
#[derive(Default)]
pub(super) struct Chans {
    /// The ends at their places; a destroyed end leaves a hole, which the
    /// next end takes.
    at: Vec<Option<Chan>>,
    /// The holes in `at`.
    holes: Vec<usize>,
    /// Token → place.
    places: IdMap<usize>,
}

impl Chans {
    /// Adds an end; its place.
    pub(super) fn insert(&mut self, chan: Chan) -> usize {
        let token = chan.token;
        let place = match self.holes.pop() {
            Some(p) => {
                self.at[p] = Some(chan);
                p
            }
            None => {
                self.at.push(Some(chan));
                self.at.len() - 1
            }
        };
        self.places.insert(token, place);
        place
    }

    /// The end `id` names, if it is still there.
    pub(super) fn at_mut(&mut self, id: ChanId) -> Option<&mut Chan> {
        self.at.get_mut(id.place)?.as_mut().filter(|c| c.token == id.token)
    }

    /// The end of `token`.
    pub(super) fn get_mut(&mut self, token: &usize) -> Option<&mut Chan> {
        let place = *self.places.get(token)?;
        self.at.get_mut(place)?.as_mut()
    }

    /// Takes the end of `token` out.
    pub(super) fn remove(&mut self, token: &usize) -> Option<Chan> {
        let place = self.places.remove(token)?;
        let chan = self.at.get_mut(place)?.take();
        self.holes.push(place);
        chan
    }

    pub(super) fn is_empty(&self) -> bool {
        self.places.is_empty()
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut Chan> {
        self.at.iter_mut().flatten()
    }
}

/// Hashes the small integers a waitset's maps are keyed by (selector keys,
/// channel tokens) with one multiplication: no SipHash on the data path.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, v: usize) {
        self.0 = (v as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A map keyed by small integers.
pub type IdMap<V> = HashMap<usize, V, std::hash::BuildHasherDefault<IdHasher>>;

/// The channel of `chan`, wherever it is.
pub(super) fn channel_of<'a>(selector: &'a mut Selector, chan: &'a mut Chan) -> Option<&'a mut Channel> {
    match &mut chan.link {
        Link::Attached(key) => selector.get_mut(*key),
        Link::Detached(c) => Some(c),
    }
}
