//! Ferry: zero-copy bulk transfer of large buffers between threads,
//! processes and machines, with one set of ownership semantics (move, pass,
//! copy, release) whatever carries the data.
//!
//! The vocabulary is that of the ETH bulk-transfer specification ([ETH-BT] in docs/REFERENCES.md):
//! a [`Domain`] owns [`Buffer`]s that live in [`Pool`]s made by an
//! [`Allocator`]; a [`Channel`] joins two endpoints; a pool is assigned to a
//! channel before its buffers travel on it; [`Channel::move_buffer`] gives a
//! buffer away, [`Channel::pass`] gives it back, [`Channel::copy`] lends a
//! read-only [`BufferCopy`], [`Channel::release`] returns it.
//!
//! # Getting started
//!
//! Ferry is not published on a registry: depend on it by path, from a
//! checkout of its repository (Linux, Rust stable):
//!
//! ```toml
//! [dependencies]
//! ferry = { path = "path/to/ferry/crates/ferry" }
//! ```
//!
//! The shortest path to a first move: the sink connects (retrying until the
//! channel exists) and lets the library accept the pools it is offered; the
//! source creates the channel, waits for the sink, assigns a pool and waits
//! for the answer, then moves a buffer. Every wait has a timeout and fails
//! with a typed [`Error`].
//!
//! ```
//! use std::time::Duration;
//! use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints, PoolPolicy};
//!
//! let t = Duration::from_secs(10);
//! let ep = Endpoint::local(); // threads; Endpoint::shm(path) for processes, Endpoint::tcp(addr) for machines
//!
//! let sink = {
//!     let ep = ep.clone();
//!     std::thread::spawn(move || -> ferry::Result<u64> {
//!         let mut rx = Channel::connect(&Domain::new("sink"), &ep, BindParams::default(), t)?;
//!         rx.set_pool_policy(PoolPolicy::AcceptAll);
//!         match rx.wait(Some(t)) { // the pool is accepted quietly on the way
//!             Ok(Event::MoveReceived { buffer, .. }) => Ok(buffer.as_slice_of::<u64>()?[0]),
//!             other => panic!("unexpected {other:?}"),
//!         }
//!     })
//! };
//!
//! let app = Domain::new("app");
//! let mut tx = Channel::accept(&app, &ep, ChannelSetup::default(), t)?;
//! let alloc = Allocator::new(&app, 16, 64 << 10, PoolConstraints::default())?; // 16 × 64 KiB
//! tx.assign_pool_and_wait(alloc.pool(), t)?;
//! let mut buf = alloc.alloc().expect("a free buffer");
//! buf.as_mut_slice_of::<u64>()?[0] = 42; // or as_mut_slice() for bytes
//! tx.move_buffer(buf, &[])?;
//! assert_eq!(sink.join().unwrap()?, 42);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The common paths have short forms too: [`Allocator::alloc_wait`] gives
//! a producer a free buffer or waits for one to be passed back;
//! [`FanOut`] publishes each buffer to many sinks as read-only copies and
//! hands it back once all are released; `#[derive(ferry::Pod,
//! ferry::Zeroable)]` and [`Buffer::view`] put the application's own
//! `#[repr(C)]` structs in buffer memory; with the `tokio` feature,
//! `AsyncChannel::accept` and `AsyncChannel::connect` set channels up
//! without blocking.
//!
//! Runnable programs are in `crates/ferry/examples/`: `threads` (local
//! backend), `processes_shm` and `processes_tcp` (two processes; without
//! arguments each starts its receiver as a child process). Each moves 16 MiB
//! and checks every byte: `cargo run -p ferry --release --example threads`.
//!
//! # The explicit steps
//!
//! The helpers above are shorthands. Spelled out, a channel is set up with
//! its events, and a pool request answered by the application:
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

//!
//! # Data paths and secured buffers
//!
//! After fbufs (Druschel and Peterson, SOSP 1993): a [`DataPath`] is an
//! allocator whose pools are assigned along a path of channels when they
//! are made, so transfers map nothing; it reuses the most recently freed
//! buffer, never clears one, and stops at its [`PathQuota`] with
//! [`ErrorKind::QuotaExceeded`]. A domain along the path passes the pools on
//! with [`forward_pool`]. A received buffer is volatile (its sender may
//! still write it); [`Buffer::secure`] (and [`BufferCopy::secure`],
//! [`Aggregate::secure`]) gives bytes no other domain can change, in place
//! where the memory is the receiver's alone, else by a private copy.

#![deny(unsafe_op_in_unsafe_fn)]
// On docs.rs (`--cfg docsrs`, a nightly rustdoc): feature-gated items say
// which feature they need.
#![cfg_attr(docsrs, feature(doc_cfg))]
// `loom` is a test build of the ring, never a user's: no "non-loom" labels.
#![cfg_attr(docsrs, doc(auto_cfg(hide(loom))))]

// `::ferry::…` paths (those the derives emit) work inside the crate too.
extern crate self as ferry;

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;

mod aggregate;
mod alloc;
pub mod backend;
mod buffer;
mod channel;
mod datapath;
mod domain;
mod error;
#[cfg(not(loom))]
mod fanout;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod inspect;
mod ledger;
mod pool;
mod proto;
mod ring;
mod secure;
#[cfg(not(loom))]
mod select;
mod setup;
mod sys;
pub mod tls;
#[cfg(feature = "tokio")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
pub mod tokio;
mod wake;

pub use aggregate::{Aggregate, Fragment, Member, Unit, Units};
pub use alloc::Allocator;
pub use backend::{Endpoint, LinkStats, LocalEndpoint};
#[cfg(all(feature = "fabric", not(loom)))]
pub use backend::{FabricEndpoint, FabricOptions};
#[cfg(not(loom))]
pub use backend::{MuxEndpoint, MuxListener, MuxSession, NetEndpoint, NetOptions, ShmEndpoint};
pub use buffer::{Buffer, BufferCopy, BufferId, BufferState, CopySource};
pub use channel::{Channel, Event, PoolPolicy, PoolRequest, DEFAULT_SPIN};
pub use datapath::{forward_pool, DataPath, PathConfig, PathQuota};
pub use domain::{Domain, Pool};
pub use error::{Error, ErrorKind, Refused, Result, ViewMismatch, WaitError};
#[cfg(not(loom))]
pub use fanout::{FanOut, FanOutEvent};
pub use inspect::{ChannelStats, DomainStats, OpCounts, PoolStats};
pub use pool::{Geometry, PoolConstraints, PoolId, TrustLevel};
pub use proto::{Meta, MAX_META_SIZE, META_INLINE};
pub use secure::{SecureSource, Secured};
#[cfg(not(loom))]
pub use select::{wait_any, Selector};
pub use setup::{
    BindParams, ChannelConstraints, ChannelLimits, ChannelSetup, ChannelState, Direction, Role, DEFAULT_BIND_TIMEOUT,
};

/// The [`bytemuck`](https://docs.rs/bytemuck) crate, for the typed views of
/// buffer memory ([`Buffer::as_slice_of`] and friends): no extra dependency
/// line is needed to name its traits or implement them for your own types.
pub use bytemuck;
/// The derives `#[derive(ferry::Pod, ferry::Zeroable)]`, with the checks of
/// bytemuck's own (a `#[repr(C)]` or `#[repr(transparent)]` struct, every
/// field plain old data, no padding; see [`Buffer::view`]); they name the
/// traits through
/// [`ferry::bytemuck`](crate::bytemuck), so a crate using Ferry needs no
/// bytemuck dependency of its own.
pub use ferry_derive::{Pod, Zeroable};
/// The plain-old-data traits, through a glob: an explicit import of the
/// derives above takes the macro namespace, whether or not bytemuck's own
/// derives (its `derive` feature, which another crate may turn on) are
/// there too.
mod pod_traits {
    pub use bytemuck::{Pod, Zeroable};
}
pub use pod_traits::*;
