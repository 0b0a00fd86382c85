//! Pools on a channel: assignment, the answer to a peer's offer, removal,
//! and each end's own view of which pools are listed.

use super::{ChanPool, Channel, Event, PoolRequest};
use crate::domain::Pool;
use crate::error::{Result, ResultExt};
use crate::inspect::Op;
use crate::pool::{Geometry, PoolId, PoolView, TrustLevel};
use crate::proto::Message;
use crate::sys::Access;
use crate::ErrorKind;
use std::sync::Arc;

impl Channel {
    /// Start assigning a pool to this channel ([ETH-BT] Algorithm 6,
    /// two-phase): completion is [`Event::PoolAssigned`] or
    /// [`Event::PoolVetoed`]. [`Channel::assign_pool_and_wait`] waits for
    /// it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints};
    /// let t = Duration::from_secs(10);
    /// let (a, b) = (Domain::new("a"), Domain::new("b"));
    /// let ep = Endpoint::local();
    /// let mut tx = Channel::create(&a, &ep, ChannelSetup::default())?;
    /// let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
    /// tx.wait_connected(t)?;
    /// rx.wait_connected(t)?;
    /// let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default())?;
    /// tx.assign_pool(alloc.pool())?;
    /// let Ok(Event::PoolAssignRequest(req)) = rx.wait(Some(t)) else { panic!() };
    /// assert_eq!(req.geometry, alloc.pool().geometry());
    /// rx.respond_pool(req.pool, true)?; // or false: a veto
    /// assert!(matches!(tx.wait(Some(t)), Ok(Event::PoolAssigned(p)) if p == alloc.pool().id()));
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn assign_pool(&mut self, pool: &Pool) -> Result<()> {
        self.assign_pool_bare(pool).context(|| format!("assign pool {} to {}", pool.id(), self.name))
    }

    /// [`Channel::assign_pool`], its errors without context.
    pub(crate) fn assign_pool_bare(&mut self, pool: &Pool) -> Result<()> {
        self.flush_deferred();
        self.check_sendable_any()?;
        let id = pool.id();
        // Only a pool this domain created or accepted can be offered: a pool
        // merely offered to us cannot be passed on before we accept it.
        if pool.domain.id != self.domain.id() || !self.domain.lock().entry(id).is_some_and(|e| e.permanent) {
            return Err(ErrorKind::UnknownPool(id).into());
        }
        let busy = self.pools.iter().any(|p| p.id == id && (p.listed || p.assigning));
        if busy || self.requests.iter().any(|r| r.pool == id) {
            return Err(ErrorKind::PoolAlreadyAssigned(id).into());
        }
        let (pool_trust, geometry, memory) = {
            let st = self.domain.lock();
            let e = st.entry(id).expect("checked");
            (e.trust, e.view.geometry(), e.view.memory().clone())
        };
        if pool_trust != TrustLevel::Uninitialized && pool_trust != self.trust {
            return Err(ErrorKind::TrustMismatch { pool: pool_trust, channel: self.trust }.into());
        }
        self.check_room()?;
        let link = self.link.as_mut().expect("connected");
        link.export_pool(&memory)?;
        link.send(&Message::AssignRequest { pool: id, geometry, trust: self.trust })?;
        self.count_sent(Op::PoolAssign, 0);
        self.domain.lock().entry_mut(id).expect("checked").trust = self.trust;
        self.chan_pool(id).assigning = true;
        Ok(())
    }

    /// Answer a [`Event::PoolAssignRequest`]: accept or veto.
    pub fn respond_pool(&mut self, pool: PoolId, accept: bool) -> Result<()> {
        let answer = if accept { "accept" } else { "veto" };
        self.respond_pool_bare(pool, accept).context(|| format!("{answer} pool {pool} on {}", self.name))
    }

    /// [`Channel::respond_pool`], its errors without context.
    fn respond_pool_bare(&mut self, pool: PoolId, accept: bool) -> Result<()> {
        self.flush_deferred();
        self.check_sendable_any()?;
        let pos = self.requests.iter().position(|r| r.pool == pool).ok_or(ErrorKind::NoPendingRequest(pool))?;
        self.check_room()?;
        self.link_mut().send(&Message::AssignReply { pool, accepted: accept })?;
        self.settle_request(pos, accept);
        Ok(())
    }

    /// The answer to `self.requests[pos]` is sent (or queued): forget the
    /// request, and list the pool if it was accepted.
    pub(super) fn settle_request(&mut self, pos: usize, accept: bool) {
        let pool = self.requests.remove(pos).pool;
        if accept {
            // Listed first: the request's relation goes after the record's
            // is counted, so the pool never looks unused in between.
            let p = self.chan_pool(pool);
            p.listed = true;
            p.by_peer = true;
            self.fix_pool(pool);
        }
        self.detach(pool);
    }

    /// Start removing a pool from this channel; completion is
    /// [`Event::PoolRemoved`] or [`Event::PoolRemoveRefused`]. Refused with
    /// [`ErrorKind::PoolInUse`] while copies of its buffers are out over this
    /// channel in either direction. Buffers keep their owners.
    pub fn remove_pool(&mut self, pool: PoolId) -> Result<()> {
        self.remove_pool_bare(pool).context(|| format!("remove pool {pool} from {}", self.name))
    }

    /// [`Channel::remove_pool`], its errors without context.
    fn remove_pool_bare(&mut self, pool: PoolId) -> Result<()> {
        self.flush_deferred();
        self.check_sendable_any()?;
        self.check_pool(pool)?;
        if self.domain.lock().entry(pool).is_some_and(|e| e.copies_on(self.key)) {
            return Err(ErrorKind::PoolInUse(pool).into());
        }
        self.check_room()?;
        self.link_mut().send(&Message::RemoveRequest { pool })?;
        self.count_sent(Op::PoolRemove, 0);
        self.chan_pool(pool).removing = true;
        Ok(())
    }

    /// Our record of `id` on this channel, created (and counted in the
    /// domain's pool entry) if absent.
    pub(super) fn chan_pool(&mut self, id: PoolId) -> &mut ChanPool {
        let pos = match self.pools.iter().position(|p| p.id == id) {
            Some(pos) => pos,
            None => {
                self.attach(id);
                self.pools.push(ChanPool { id, listed: false, assigning: false, removing: false, by_peer: false });
                self.pools.len() - 1
            }
        };
        &mut self.pools[pos]
    }

    /// Forget our record of `id` if nothing is left in it.
    pub(super) fn tidy_pool(&mut self, id: PoolId) {
        if let Some(pos) = self.pools.iter().position(|p| p.id == id) {
            let p = &self.pools[pos];
            if !(p.listed || p.assigning || p.removing) {
                self.pools.remove(pos);
                self.detach(id);
            }
        }
    }

    fn attach(&self, pool: PoolId) {
        if let Some(e) = self.domain.lock().entry_mut(pool) {
            e.channels += 1;
        }
    }

    /// One relation of this end to `pool` (a record or a request, already
    /// taken out) is gone. With its last one, the link and the spares drop
    /// what they keep of the pool; the domain drops the pool if nothing
    /// else refers to it.
    fn detach(&mut self, pool: PoolId) {
        let related = self.pools.iter().any(|p| p.id == pool) || self.requests.iter().any(|r| r.pool == pool);
        if !related {
            if let Some(link) = self.link.as_mut() {
                link.forget_pool(pool);
            }
            self.spares.forget_pool(pool);
        }
        let mut st = self.domain.lock();
        if let Some(e) = st.entry_mut(pool) {
            e.channels -= 1;
        }
        let gone = st.release_if_unused(pool);
        let listed = st.entry(pool).is_some();
        drop(st);
        drop(gone);
        if let (false, Some(lent)) = (related, &mut self.lent) {
            // Buffers lent on this channel come back if the peer dies, to
            // a domain that still has their pool: kept only for that.
            lent.forget_pool(pool, !listed);
        }
    }

    /// An assignment of `pool` was accepted: our entry is permanent and the
    /// pool's trust level fixed.
    pub(super) fn fix_pool(&self, pool: PoolId) {
        if let Some(e) = self.domain.lock().entry_mut(pool) {
            e.permanent = true;
            e.trust_fixed = true;
        }
    }

    pub(super) fn deliver_assign(&mut self, pool: PoolId, geometry: Geometry, trust: TrustLevel) -> Result<Event> {
        if trust != self.trust {
            return Err(ErrorKind::Protocol(format!(
                "pool {pool} offered with trust {trust:?} on a {:?} channel",
                self.trust
            ))
            .into());
        }
        // Offering a pool we list, or one already offered, is a protocol
        // error; a concurrent offer of a pool we are offering ourselves is not
        // (it is vetoed below).
        if self.pools.iter().any(|p| p.id == pool && p.listed) || self.requests.iter().any(|r| r.pool == pool) {
            return Err(ErrorKind::Protocol(format!("pool {pool} offered twice")).into());
        }
        // Both ends offered this pool at once: veto the peer's offer (ours is
        // out, and the peer vetoes it likewise), so the two ends agree that
        // the pool is not assigned; either may offer it again.
        if !self.sent_teardown && self.pools.iter().any(|p| p.id == pool && p.assigning) {
            self.reply(Message::AssignReply { pool, accepted: false });
            self.link_mut().discard_pool(pool);
            return Ok(Event::PoolVetoed(pool));
        }
        // From here until an unknown pool is in the list, no other channel
        // of the domain may import the same pool.
        let shared = Arc::clone(&self.domain.shared);
        let _importing = shared.importing();
        // A known pool's request relation is counted under the lock that
        // finds it, so the pool cannot leave the list while we answer.
        // A pool only offered to us so far (never created nor accepted
        // here) has the trust of the last offer, which binds nothing: its
        // owner may have set it back and offer it again at another.
        let known = self.domain.lock().entry_mut(pool).map(|e| {
            e.channels += 1;
            (e.view.geometry(), if e.permanent { e.trust } else { TrustLevel::Uninitialized })
        });
        let acceptable = match known {
            Some((g, t)) => g == geometry && (t == TrustLevel::Uninitialized || t == trust),
            None => true,
        } && self.constraints.admits(geometry);
        if !acceptable {
            // The library vetoes by itself: wrong geometry for a known id, a
            // trust conflict, or the channel's constraints.
            if known.is_some() {
                self.detach(pool);
            }
            self.reply(Message::AssignReply { pool, accepted: false });
            self.link_mut().discard_pool(pool);
            return Ok(Event::PoolVetoed(pool));
        }
        // The channel's limits, before anything of the pool is mapped.
        if let Err(reason) = self.peer_pools_admit(geometry) {
            if known.is_some() {
                self.detach(pool);
            }
            // (Nothing goes out after our teardown marker.)
            if !self.sent_teardown {
                self.reply(Message::AssignReply { pool, accepted: false });
            }
            self.link_mut().discard_pool(pool);
            return Ok(Event::PoolOfferRefused { pool, reason });
        }
        if known.is_some() {
            let memory = self.domain.lock().entry(pool).expect("counted").view.memory().clone();
            if let Err(e) = self.link_mut().use_pool(&memory) {
                self.detach(pool);
                return Err(e);
            }
        } else {
            let memory = self.link_mut().import_pool(pool, geometry)?;
            let initial = if trust.protects() { Access::None } else { Access::ReadWrite };
            let view = PoolView::map(memory, initial, self.constraints.alignment)?;
            let mut st = self.domain.lock();
            st.insert_received(view, trust)?;
            st.entry_mut(pool).expect("inserted").channels += 1;
        }
        self.domain.lock().entry_mut(pool).expect("counted").trust = trust;
        let req = PoolRequest { pool, geometry, trust };
        self.requests.push(req);
        Ok(Event::PoolAssignRequest(req))
    }

    /// Whether one more pool from the peer, of `geometry`, stays within the
    /// channel's limits (the peer's pools: accepted, or waiting for an answer).
    fn peer_pools_admit(&self, geometry: Geometry) -> Result<()> {
        let st = self.domain.lock();
        let accepted = self.pools.iter().filter(|p| p.listed && p.by_peer).map(|p| p.id);
        let (mut count, mut bytes) = (self.requests.len(), 0usize);
        for r in &self.requests {
            bytes = bytes.saturating_add(r.geometry.len());
        }
        for id in accepted {
            count += 1;
            bytes = bytes.saturating_add(st.entry(id).map_or(0, |e| e.view.geometry().len()));
        }
        self.limits.admit(count, bytes, geometry)
    }
}
