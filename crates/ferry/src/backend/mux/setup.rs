//! Opening a channel on a session: claiming its number, the bind request
//! and the creator's reply.

use crate::ErrorKind;
use std::os::fd::AsFd;
use std::time::Instant;

use super::codec::{FLAG_ABORT, K_OPEN, K_REPLY, MUX_HEAD};
use super::link::MuxLink;
use super::session::{Chan, ChanState, Inner};
use super::{MuxEndpoint, MuxSession};
use crate::backend::setup_msg;
use crate::backend::{Link, Pending, PendingSetup, SetupDone};
use crate::error::{Error, Result};
use crate::setup::{check_reply, negotiate, BindParams, ChannelSetup};
use crate::wake::{Arm, Interest, WakeSet};

impl MuxEndpoint {
    pub(super) fn claim(&self, state: ChanState) -> Result<()> {
        if self.channel == 0 {
            return Err(ErrorKind::Protocol("channel 0 is the session's".into()).into());
        }
        let mut inner = self.session.lock();
        // What the peer sent so far first: a close that frees the number
        // may be waiting.
        let _ = inner.pump_read(None);
        let _ = inner.pump_write();
        inner.check()?;
        if inner.chans.contains_key(&self.channel) {
            return Err(ErrorKind::EndpointInUse.into());
        }
        let chan = Chan::new(state, self.priority)?;
        inner.chans.insert(self.channel, chan);
        Ok(())
    }

    pub(crate) fn listen(&self, setup: &ChannelSetup) -> Result<Pending> {
        self.claim(ChanState::Listening { setup: *setup })?;
        Ok(Box::new(MuxPending { session: Some(self.session.clone()), id: self.channel, params: None, deadline: None }))
    }

    pub(crate) fn connect(&self, params: &BindParams) -> Result<Pending> {
        self.claim(ChanState::Binding)?;
        let mut inner = self.session.lock();
        let body = setup_msg::encode_bind(params);
        // Our own opens never make the peer's backlog: past the control
        // limit the bind is refused here, and the session goes on.
        if !inner.ctrl_room(MUX_HEAD + body.len()) {
            inner.chans.remove(&self.channel);
            return Err(ErrorKind::QueueFull.into());
        }
        inner.queue_ctrl(K_OPEN, self.channel, body, 0)?;
        let _ = inner.pump_write();
        drop(inner);
        Ok(Box::new(MuxPending {
            session: Some(self.session.clone()),
            id: self.channel,
            params: Some(*params),
            deadline: Some(Instant::now() + params.timeout),
        }))
    }
}

pub(super) struct MuxPending {
    pub(super) session: Option<MuxSession>,
    pub(super) id: u32,
    /// The binder's request (`None`: the creator).
    pub(super) params: Option<BindParams>,
    pub(super) deadline: Option<Instant>,
}

impl MuxPending {
    pub(super) fn give_up(&mut self, e: Error) -> Option<Result<SetupDone>> {
        if let Some(s) = self.session.take() {
            MuxPending::release(&mut s.lock(), self.id, self.params.is_some());
        }
        Some(Err(e))
    }

    /// The setup ends without a channel. A binder's open is out: it says
    /// close and keeps the number until the peer's close (or reply) comes,
    /// dropping what the creator may send meanwhile.
    pub(super) fn release(inner: &mut Inner, id: u32, binder: bool) {
        let Some(chan) = inner.chans.get_mut(&id) else { return };
        if !binder || inner.gone.is_some() || chan.peer_closed.is_some() {
            inner.chans.remove(&id);
            return;
        }
        chan.detached = true;
        chan.close_queued = Some(FLAG_ABORT);
        let _ = inner.pump_write();
    }
}

impl PendingSetup for MuxPending {
    fn poll(&mut self) -> Option<Result<SetupDone>> {
        let session = self.session.as_ref()?;
        let mut inner = session.lock();
        let _ = inner.pump_write();
        let read = inner.pump_read(None);
        if let Err(e) = read.and_then(|()| inner.check()) {
            drop(inner);
            return self.give_up(e);
        }
        let id = self.id;
        let Some(chan) = inner.chans.get_mut(&id) else { return Some(Err(ErrorKind::PeerGone.into())) };
        let listening = match chan.state {
            ChanState::Listening { setup } => Some(setup),
            _ => None,
        };
        let arrived = chan.setup_in.take();
        match (listening, self.params) {
            (Some(setup), None) => {
                let request = arrived.or_else(|| inner.unclaimed.remove(&id))?;
                let params = match setup_msg::parse_bind(&request) {
                    Ok(p) => p,
                    Err(e) => {
                        inner.fail(e.clone(), false);
                        drop(inner);
                        return self.give_up(e);
                    }
                };
                match negotiate(&setup, &params) {
                    Err(why) => {
                        if let Err(e) = inner.queue_ctrl(K_REPLY, id, setup_msg::encode_refuse(why), 0) {
                            drop(inner);
                            return self.give_up(e);
                        }
                        let _ = inner.pump_write();
                        None
                    }
                    Ok(neg) => {
                        let depth = setup.queue_depth;
                        if let Err(e) = inner.queue_ctrl(K_REPLY, id, setup_msg::encode_accept(&neg, depth), 0) {
                            drop(inner);
                            return self.give_up(e);
                        }
                        inner.open(id, &neg, depth);
                        let _ = inner.pump_write();
                        drop(inner);
                        let session = self.session.take().expect("present");
                        Some(Ok((Box::new(MuxLink::new(session, id)) as Box<dyn Link>, neg, true)))
                    }
                }
            }
            (None, Some(params)) => {
                let Some(reply) = arrived else {
                    drop(inner);
                    if self.deadline.is_some_and(|d| Instant::now() >= d) {
                        return self.give_up(ErrorKind::TimedOut.into());
                    }
                    return None;
                };
                match setup_msg::parse_reply(&reply)
                    .and_then(|(neg, depth)| check_reply(&params, &neg).map(|()| (neg, depth)))
                {
                    Ok((neg, _)) => {
                        drop(inner);
                        let session = self.session.take().expect("present");
                        Some(Ok((Box::new(MuxLink::new(session, id)) as Box<dyn Link>, neg, false)))
                    }
                    Err(e) => {
                        drop(inner);
                        self.give_up(e)
                    }
                }
            }
            _ => {
                drop(inner);
                self.give_up(ErrorKind::Protocol("channel setup out of order".into()).into())
            }
        }
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        let Some(session) = &self.session else { return Arm::SLEEP };
        let mut inner = session.lock();
        let Some(chan) = inner.chans.get(&self.id) else { return Arm::Ready };
        if chan.setup_in.is_some() || inner.unclaimed.contains_key(&self.id) || inner.gone.is_some() {
            return Arm::Ready;
        }
        let _ = chan.bell.reset();
        if wake.watch(chan.bell.fd().as_fd(), Interest::Read).is_err() {
            return Arm::Ready;
        }
        let chan = inner.chans.get_mut(&self.id).expect("present");
        chan.rung = false;
        chan.armed = true;
        match inner.arm_socket(wake, &mut None) {
            Some(until) => Arm::Sleep { until: Some(self.deadline.map_or(until, |d| d.min(until))) },
            None => Arm::Ready,
        }
    }
}

impl Drop for MuxPending {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            MuxPending::release(&mut s.lock(), self.id, self.params.is_some());
        }
    }
}
