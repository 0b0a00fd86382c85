//! Ferry: zero-copy bulk transfer of large buffers between threads,
//! processes and machines, with one set of ownership semantics (move, pass,
//! copy, release) whatever carries the data.
//!
//! The vocabulary is that of the ETH bulk-transfer specification (seed 003):
//! a [`Domain`] owns [`Buffer`]s that live in [`Pool`]s made by an
//! [`Allocator`]; a [`Channel`] joins two endpoints; a pool is assigned to a
//! channel before its buffers travel on it; [`Channel::move_buffer`] gives a
//! buffer away, [`Channel::pass`] gives it back, [`Channel::copy`] lends a
//! read-only [`BufferCopy`], [`Channel::release`] returns it.
//!
//! ```
//! use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints};
//!
//! let (a, b) = (Domain::new("sender"), Domain::new("receiver"));
//! let ep = Endpoint::local();
//! let mut tx = Channel::create(&a, &ep, ChannelSetup::default())?;   // TX, trust FULL
//! let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
//! assert!(matches!(tx.poll(), Some(Event::BindRequest { .. })));
//! assert!(matches!(rx.poll(), Some(Event::Bound)));
//!
//! // Pools are assigned in two phases: the peer may veto.
//! let alloc = Allocator::new(&a, 8, 4096, PoolConstraints::default())?;
//! tx.assign_pool(alloc.pool())?;
//! let Some(Event::PoolAssignRequest(req)) = rx.poll() else { panic!() };
//! rx.respond_pool(req.pool, true)?;
//! assert!(matches!(tx.poll(), Some(Event::PoolAssigned(_))));
//!
//! // Move a buffer: the sender loses it, the receiver owns it, no byte is copied.
//! let mut buf = alloc.alloc().unwrap();
//! buf.as_mut_slice()?[..5].copy_from_slice(b"hello");
//! tx.move_buffer(buf, b"meta")?;
//! let Some(Event::MoveReceived { buffer, meta }) = rx.poll() else { panic!() };
//! assert_eq!((&buffer[..5], &meta[..]), (&b"hello"[..], &b"meta"[..]));
//!
//! // Pass it back; it returns to the sender's free list when dropped.
//! rx.pass(buffer, &[])?;
//! let Some(Event::BufferPassed { buffer, .. }) = tx.poll() else { panic!() };
//! drop(buffer);
//! assert_eq!(alloc.available(), 8);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(unsafe_op_in_unsafe_fn)]

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;

mod alloc;
pub mod backend;
mod buffer;
mod channel;
mod domain;
mod error;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod ledger;
mod pool;
mod proto;
mod ring;
mod sys;

pub use alloc::Allocator;
pub use backend::{Endpoint, LinkStats, LocalEndpoint};
#[cfg(not(loom))]
pub use backend::{NetEndpoint, NetOptions, ShmEndpoint};
pub use buffer::{Buffer, BufferCopy, BufferId, BufferState, CopySource};
pub use channel::{
    BindParams, Channel, ChannelConstraints, ChannelLimits, ChannelSetup, ChannelState, Direction, Event, PoolRequest,
    Role, DEFAULT_BIND_TIMEOUT,
};
pub use domain::Domain;
pub use error::{Error, Refused, Result};
pub use pool::{Geometry, Pool, PoolConstraints, PoolId, TrustLevel};
pub use proto::{Meta, MAX_META_SIZE, META_INLINE};
