//! Ferry's network block service.
//!
//! A server domain holds the blocks — a [`Store`] in memory or in a file —
//! and serves them to block clients, as the network block service of "An
//! Efficient and Portable Bulk Transfer Service" (the ETH bulk-transfer
//! specification, chapter 7) describes. The front end here speaks the NBD
//! protocol ([`nbd`]), so unmodified NBD clients (qemu-img, qemu-io,
//! nbdcopy, nbdinfo, fio, the Linux nbd driver) use it; a payload goes
//! through the buffers of a Ferry pool, read from the socket into a buffer
//! and written to the store from it, read from the store into a buffer and
//! sent from it — except where the store keeps its blocks in memory: then
//! a large payload is received straight into the store and sent straight
//! from it, one copy fewer per byte.
//!
//! Between machines the NBD server speaks TLS 1.3 the protocol's own way
//! (`NBD_OPT_STARTTLS`, [`NbdTls`]: off, on or require, as nbdkit and
//! qemu-nbd mean them), with mutual certificate authentication through
//! the library's [`TlsConfig`](ferry::tls::TlsConfig); a plain-text
//! server off the loopback is a choice made on purpose
//! ([`ServerConfig::insecure`]). Ferry's own block protocol takes the
//! [`Security`](ferry::tls::Security) of its TCP endpoint's options, for
//! the request and the read-data channel alike ([`serve_endpoint`] and
//! [`BlockClient::connect`] with a TCP endpoint, [`serve_tcp`] and
//! [`BlockClient::connect_tcp`]). Under TLS payloads are decrypted into
//! (and encrypted from) the server's buffers by rustls: the zero-copy
//! receive into a memory store is a plain-text path.
//!
//! The crate sits above the library: it uses `ferry`, `ferry` knows
//! nothing of it. `ferry block serve` (in `ferry-cli`) is its command.
//!
//! Applications that use Ferry reach the same stores without NBD through
//! [`BlockClient`] ([`native`]): requests as meta data, write data moved in
//! the client's buffers, reads returned in buffers the server fills (over
//! TCP buffers of the server's own pool, so a read's bytes cross the
//! network once). One thread serves all of an endpoint's clients
//! ([`server`], [`serve_endpoint`]).
//!
//! ```no_run
//! use std::sync::Arc;
//! use ferry_block::{open_store, NbdServer, ServerConfig};
//! let store = open_store(&"mem:1G".parse()?, None, false)?;
//! let server = NbdServer::bind(&"tcp:127.0.0.1:10809".parse()?, Arc::from(store), ServerConfig::default())?;
//! server.run(|client| eprintln!("{client}"))?;
//! # Ok::<(), ferry_block::Error>(())
//! ```

mod conns;
pub mod native;
pub mod nbd;
pub mod server;
pub mod store;
mod sys;

pub use native::{run_proxy, BlockClient, Completion, Op};
pub use nbd::{
    serve_connection, ConnSummary, Listen, NbdServer, NbdTls, ServerConfig, DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
};
pub use server::{accept_client, serve_channel, serve_client, serve_endpoint, serve_tcp, ChannelSummary, ClientReport};
pub use store::{open_store, parse_size, Extent, FileStore, MemStore, Store, StoreSpec, MAX_STORE_SIZE, MEM_CHUNK};

/// What can go wrong setting up the block service (requests that fail are
/// answered to the client, not returned here).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A store, size or address that cannot be used; the message says what
    /// is allowed.
    #[error("{0}")]
    BadSpec(String),
    /// A system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The Ferry library refused or failed (channel, pool, buffer).
    #[error(transparent)]
    Ferry(#[from] ferry::Error),
    /// The block server answered the request with this errno value
    /// (22 EINVAL: outside the store or malformed; 28 ENOSPC: a write past
    /// the end; 5 EIO: the store failed).
    #[error("the block server refused the request (errno {0})")]
    Remote(u32),
    /// Every buffer of the client's pool is in flight or held.
    #[error("no free buffer: every buffer of the client's pool is in flight or held")]
    NoBuffer,
    /// No reply within the client's timeout.
    #[error("no reply from the block server in time")]
    TimedOut,
    /// The peer broke the block service's protocol or closed the channel.
    #[error("{0}")]
    Protocol(String),
}
