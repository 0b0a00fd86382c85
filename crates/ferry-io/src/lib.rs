//! Container-shipping I/O for Ferry: reads *produce* buffers of a
//! [`ferry::Allocator`] filled by the kernel, writes *consume* buffers (or
//! byte ranges of them) and return each to its allocator once the kernel
//! is done with it — one API for regular files (buffered or `O_DIRECT`),
//! pipes, stream and datagram sockets, devices and standard input/output.
//! The design follows Container Shipping: operating system support for
//! I/O-intensive applications (Pasquale, Anderson and Muller): the data
//! travels from the device to the processes that handle it without a copy
//! in memory made by the application.
//!
//! * [`Port`]: one fd; [`Port::read`] / [`Port::read_exact`] give
//!   [`Filled`] buffers, [`Port::write`] takes [`Chunk`]s (or `Filled`, or
//!   whole `Buffer`s).
//! * [`IoError`]: a typed error naming the file and the offset.
//! * [`Ring`]: many requests in flight on one io_uring queue (the pool
//!   registered as fixed buffers), its completions signalled on an eventfd
//!   that an event loop waits on beside Ferry channels.

mod error;
mod port;
mod ring;

pub use error::IoError;
pub use port::{Chunk, Filled, Kind, Port};
pub use ring::{Completion, Done, Mode, Ring};
