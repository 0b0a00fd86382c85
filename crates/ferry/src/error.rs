//! Errors. Every operation checks its preconditions before it changes
//! anything; a failed check is an [`Error`] of some [`ErrorKind`], and
//! operations that consume a buffer hand it back inside [`Refused`] so
//! nothing is lost.
//!
//! An [`Error`] is the kind (what went wrong, to match on) plus, once it
//! leaves the library through a public operation, the context: what that
//! operation was and what it worked on (the endpoint, the buffer, the
//! pool). The context is attached in one place per public operation, on
//! the error path only, so the many places that find a fault stay plain.

use std::borrow::Cow;

use crate::pool::{PoolId, TrustLevel};
use crate::setup::ChannelState;

/// Why an operation of Ferry failed: its [`kind`](Error::kind), to match
/// on, and what the operation was doing and on what (the endpoint, the
/// buffer, the pool), for people.
///
/// Every operation checks its preconditions before it changes anything, so
/// an error leaves everything as it was; match on the kind to react.
/// `Display` is one sentence: the operation and its subject, what went
/// wrong, then after a semicolon what to do. `Debug` is the same sentence
/// followed by the kind, so a `main` that returns `Result<(), ferry::Error>`
/// prints something a user can act on.
///
/// ```
/// use ferry::{Allocator, Domain, ErrorKind, PoolConstraints};
/// let d = Domain::new("d");
/// let e = Allocator::new(&d, 4, 1000, PoolConstraints::default()).unwrap_err();
/// match e.kind() {
///     ErrorKind::BadBufferSize { size, page } => assert_eq!((*size, page % 4096), (1000, 0)),
///     other => panic!("{other:?}"),
/// }
/// assert_eq!(e, ErrorKind::BadBufferSize { size: 1000, page: 4096 }); // compares the kind
/// // Errors print as a sentence and work with `?`, `Box<dyn Error + Send + Sync>`
/// // and threads.
/// fn pool(d: &Domain) -> Result<Allocator, Box<dyn std::error::Error + Send + Sync>> {
///     Ok(Allocator::new(d, 4, 1000, PoolConstraints::default())?)
/// }
/// let e = std::thread::scope(|s| s.spawn(|| pool(&d)).join().unwrap()).unwrap_err();
/// assert!(e.to_string().contains("buffer size 1000 is not a power of two"), "{e}");
/// ```
#[derive(Clone)]
pub struct Error {
    repr: Repr,
}

/// An error without context costs nothing more than its kind; with one,
/// a pointer (the kind's unused tag values tell the two apart, so an
/// `Error` is no larger than an `ErrorKind`).
#[derive(Clone)]
enum Repr {
    Bare(ErrorKind),
    Detailed(Box<Detailed>),
}

#[derive(Clone)]
struct Detailed {
    kind: ErrorKind,
    /// The operation and its subject, outermost first:
    /// `bind to the TCP endpoint 127.0.0.1:9`.
    context: Cow<'static, str>,
}

impl Error {
    /// What went wrong, to match on.
    ///
    /// ```
    /// use ferry::{BindParams, Channel, Domain, Endpoint, ErrorKind};
    /// let ep = Endpoint::shm("/run/nobody-listens-here.sock");
    /// let e = Channel::bind(&Domain::new("b"), &ep, BindParams::default()).unwrap_err();
    /// assert!(matches!(e.kind(), ErrorKind::EndpointNotListening));
    /// assert_eq!(e.context(), Some("bind to the shm endpoint /run/nobody-listens-here.sock"));
    /// ```
    pub fn kind(&self) -> &ErrorKind {
        match &self.repr {
            Repr::Bare(kind) => kind,
            Repr::Detailed(d) => &d.kind,
        }
    }

    /// The kind, without the context.
    pub fn into_kind(self) -> ErrorKind {
        match self.repr {
            Repr::Bare(kind) => kind,
            Repr::Detailed(d) => d.kind,
        }
    }

    /// What the failed operation was and what it worked on (`move buffer 3
    /// of pool 00000000000000a1`), if the operation said; `Display` puts it
    /// in front of the kind's sentence.
    pub fn context(&self) -> Option<&str> {
        match &self.repr {
            Repr::Bare(_) => None,
            Repr::Detailed(d) => Some(&d.context),
        }
    }

    /// The same error, done while doing `context` (outer contexts go in
    /// front: `connect to …: assign pool …`).
    pub(crate) fn with_context(self, context: impl Into<Cow<'static, str>>) -> Error {
        let context = context.into();
        match self.repr {
            Repr::Bare(kind) => Error { repr: Repr::Detailed(Box::new(Detailed { kind, context })) },
            Repr::Detailed(mut d) => {
                d.context = format!("{context}: {}", d.context).into();
                Error { repr: Repr::Detailed(d) }
            }
        }
    }

    /// A failed system call of `rustix`, as an [`ErrorKind::Os`]: the
    /// `rustix` error type stays out of the public API.
    #[allow(dead_code)]
    pub(crate) fn from_errno(e: rustix::io::Errno) -> Self {
        ErrorKind::Os(std::io::Error::from(e).to_string()).into()
    }
}

impl From<ErrorKind> for Error {
    fn from(kind: ErrorKind) -> Self {
        Error { repr: Repr::Bare(kind) }
    }
}

/// Errors compare by kind: the context is for people, the kind for code
/// (`assert_eq!(result, Err(ErrorKind::QueueFull.into()))` holds whatever
/// the operation said about itself).
impl PartialEq for Error {
    fn eq(&self, other: &Error) -> bool {
        self.kind() == other.kind()
    }
}

impl Eq for Error {}

impl PartialEq<ErrorKind> for Error {
    fn eq(&self, other: &ErrorKind) -> bool {
        self.kind() == other
    }
}

impl PartialEq<Error> for ErrorKind {
    fn eq(&self, other: &Error) -> bool {
        self == other.kind()
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.repr {
            Repr::Bare(kind) => kind.fmt(f),
            Repr::Detailed(d) => write!(f, "{}: {}", d.context, d.kind),
        }
    }
}

/// The sentence, then the kind in brackets: what `main` prints when it
/// returns the error. `{:#?}` gives the parts.
impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if f.alternate() {
            f.debug_struct("Error").field("kind", self.kind()).field("context", &self.context()).finish()
        } else {
            write!(f, "{self} [{:?}]", self.kind())
        }
    }
}

impl std::error::Error for Error {}

/// Attach the context of a public operation to its error, on the error
/// path only (the closure runs only on failure).
pub(crate) trait ResultExt {
    /// The result, its error (if any) done while doing `context()`.
    fn context<C: Into<Cow<'static, str>>>(self, context: impl FnOnce() -> C) -> Self;
}

// Inlined, with the error path out of line: on success the caller only
// tests the result (a call that took and gave back the whole `Result`, a
// refused buffer's room included, cost 22 instructions per move or pass).
impl<T> ResultExt for std::result::Result<T, Error> {
    #[inline]
    fn context<C: Into<Cow<'static, str>>>(self, context: impl FnOnce() -> C) -> Self {
        match self {
            Ok(v) => Ok(v),
            Err(e) => Err(add_context(e, context)),
        }
    }
}

impl<T, V> ResultExt for std::result::Result<T, Refused<V>> {
    #[inline]
    fn context<C: Into<Cow<'static, str>>>(self, context: impl FnOnce() -> C) -> Self {
        match self {
            Ok(v) => Ok(v),
            Err(r) => Err(Refused { error: add_context(r.error, context), value: r.value }),
        }
    }
}

/// The error path of [`ResultExt::context`].
#[cold]
#[inline(never)]
fn add_context<C: Into<Cow<'static, str>>>(e: Error, context: impl FnOnce() -> C) -> Error {
    e.with_context(context())
}

/// What went wrong: the part of an [`Error`] to match on.
///
/// Each kind prints as a sentence of its own: what happened, then after a
/// semicolon what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ErrorKind {
    // --- pool geometry and setup -------------------------------------------------
    /// Buffer size must be a power of two and a multiple of the page size.
    #[error("buffer size {size} is not a power of two of at least the page size ({page} bytes); choose one such as {page}, 65536 or 1048576")]
    BadBufferSize {
        /// The size asked for.
        size: usize,
        /// The page size.
        page: usize,
    },
    /// A pool needs at least one buffer, and must fit in the address space.
    #[error("a pool of {count} buffers of this size is not possible (1 to {max}, at most 1 TiB in all); ask for fewer or smaller buffers")]
    BadBufferCount {
        /// The count asked for.
        count: u64,
        /// The largest count allowed for this buffer size.
        max: u64,
    },
    /// An alignment that is not a power of two, or larger than the buffer size.
    #[error("alignment {0} is not a power of two no larger than the buffer size; give such a power of two")]
    BadAlignment(usize),
    /// A setup parameter is invalid (the message says which).
    #[error("a setup parameter is invalid: {0}; correct it and try again")]
    InvalidArgument(&'static str),
    /// The trust level is not supported by this backend.
    #[error("trust level {} is not supported by the {backend} backend; choose another trust level or backend", trust_name(.trust))]
    TrustNotSupported {
        /// The level asked for.
        trust: TrustLevel,
        /// The backend.
        backend: &'static str,
    },
    /// A system call failed.
    #[error("the operating system refused a call ({0}); check memory, open-file and mapping limits and permissions")]
    Os(String),

    // --- endpoints and binding ---------------------------------------------------
    /// The endpoint already has a channel created on it.
    #[error(
        "the endpoint already has a channel created on it; create the channel on another endpoint, or bind to this one"
    )]
    EndpointInUse,
    /// Bind to an endpoint that nobody created a channel on.
    #[error("no channel is listening on that endpoint; create a channel there first, or check the endpoint's name or address")]
    EndpointNotListening,
    /// The creator refused the bind (the message says why).
    #[error("the channel's creator refused the bind: {0}; bind with parameters it accepts")]
    BindRefused(&'static str),

    // --- channel-level preconditions (checked first) -------------------------------
    /// The channel is not connected (still binding, or closed).
    #[error("the channel is not connected ({}); wait until it is bound, or open a new channel if it closed", state_words(.0))]
    NotConnected(ChannelState),
    /// The channel is tearing down: no new messages may be sent.
    #[error("the channel is tearing down and takes no new messages; open a new channel to send more")]
    TearingDown,
    /// Move/copy need the local side to be the source (TX); pass/release the sink (RX).
    #[error("this operation belongs to the other end of the channel (move and copy to the source, pass and release to the sink); call it there")]
    WrongDirection,

    // --- buffer preconditions -----------------------------------------------------
    /// The buffer (or pool) handle belongs to another domain.
    #[error("the buffer or pool belongs to another domain; use it only in the domain that holds it")]
    ForeignBuffer,
    /// The buffer's pool is not assigned to this channel.
    #[error("pool {0} is not assigned to this channel; assign it and wait for the peer's acceptance first")]
    PoolNotAssigned(PoolId),
    /// A removal of the pool from this channel is pending.
    #[error("pool {0} is being removed from this channel; wait until it is removed, then assign it again")]
    PoolRemovalPending(PoolId),
    /// Move and pass need read-write ownership; read-only copies are still out.
    #[error("read-only copies of the buffer are still out; wait until every copy is released before writing, moving or passing it")]
    CopiesOutstanding,
    /// Release of a copy that was not received over this channel.
    #[error("this copy was not received over this channel; release it on the channel it arrived on")]
    NotCopyHolder,
    /// Releasing this copy would strand a copy forwarded from it.
    #[error("a copy forwarded from this one is still out; release this one after that copy has come back")]
    CopiesForwarded,
    /// Full copy into its own source.
    #[error("the source and the destination of the full copy are the same buffer; copy into another buffer")]
    SameBuffer,
    /// Meta data longer than the channel's meta size.
    #[error("meta data of {len} bytes exceeds the channel's meta size of {max} bytes; send at most {max} bytes, or create the channel with a larger meta size")]
    MetaTooLarge {
        /// Length given.
        len: usize,
        /// The channel's meta size.
        max: usize,
    },

    // --- pool assignment -----------------------------------------------------------
    /// The pool handle does not belong to this domain's pool list.
    #[error("pool {0} is not known to this domain; use a pool this domain made or accepted")]
    UnknownPool(PoolId),
    /// The pool is already assigned to (or pending on) this channel.
    #[error("pool {0} is already assigned to this channel (or its assignment is pending); use it as it is")]
    PoolAlreadyAssigned(PoolId),
    /// The pool's trust level differs from the channel's.
    #[error("the pool's trust level {} differs from the channel's {}; use a pool made with the channel's trust level", trust_name(.pool), trust_name(.channel))]
    TrustMismatch {
        /// The pool's trust.
        pool: TrustLevel,
        /// The channel's trust.
        channel: TrustLevel,
    },
    /// The pool still has copies out over this channel.
    #[error("pool {0} still has copies out over this channel; remove it after they are released")]
    PoolInUse(PoolId),
    /// No pool-assignment request for that pool is waiting for an answer.
    #[error("no assignment request for pool {0} is waiting for an answer; answer only pool-assignment requests that arrived")]
    NoPendingRequest(PoolId),

    // --- backend ---------------------------------------------------------------------
    /// The backend's queue is full; try again after polling the channel.
    #[error("the channel's queue is full; poll the channel so the peer can take messages, then try again")]
    QueueFull,
    /// An aggregate's run of slots (header, one per distinct buffer,
    /// fragment table) could never fit in the channel's queue.
    #[error("an aggregate needs {slots} queue slots in a row but the channel's queue holds {capacity}; send fewer buffers or fragments, or create the channel with a deeper queue")]
    AggregateTooLarge {
        /// Slots the aggregate needs.
        slots: usize,
        /// Slots the queue holds.
        capacity: usize,
    },
    /// The peer went away (closed, crashed or unreachable).
    #[error("the peer went away (closed, crashed or unreachable); open a new channel to go on")]
    PeerGone,
    /// The peer sent nothing (not even a keep-alive) or took none of our
    /// data for this long: it is treated as dead.
    #[error("the peer sent nothing and took no data for {:.1} s, so it is treated as dead; check the peer and the network, then open a new channel", .0.as_secs_f64())]
    PeerUnresponsive(std::time::Duration),
    /// The peer sent something malformed or impossible; the channel is closed.
    #[error("the peer sent something malformed or impossible ({0}), so the channel was closed; check that both sides run the same version of Ferry")]
    Protocol(String),
    /// Waiting timed out.
    #[error("waiting timed out; wait longer, or check that the peer is still working")]
    TimedOut,

    // --- security ------------------------------------------------------------------------
    /// A TLS certificate, key or setting cannot be used (the message names
    /// the file and what is wrong with it).
    #[error(
        "the TLS configuration cannot be used: {0}; fix the file (`ferry tls gen DIR` writes a test set) and try again"
    )]
    TlsConfig(Box<crate::tls::TlsConfigError>),
    /// The TLS handshake or a TLS record failed: the peer's certificate was
    /// refused (or ours by the peer), the peer does not speak TLS, or a
    /// record failed its authentication (the stream was altered on its
    /// way). The connection is closed; nothing of a failed record landed.
    #[error("the TLS connection failed ({0}), so it was closed; check that both ends use TLS with certificates from the same CA and that the server's certificate names the host connected to")]
    Tls(String),
    /// Plain TCP on an address that is not a loopback address, without
    /// saying so: give the endpoint or session `Security::Tls`, or
    /// `Security::None` on purpose.
    #[error("{0} is not a loopback address, and plain TCP leaves this machine only when chosen on purpose; give the endpoint's NetOptions the security Tls with a TLS configuration, or None on a network you trust")]
    InsecureAddress(std::net::IpAddr),

    // --- helpers -----------------------------------------------------------------------
    /// [`Channel::assign_pool_and_wait`](crate::Channel::assign_pool_and_wait):
    /// the peer (or its library, for a pool outside the channel's
    /// constraints) vetoed the assignment.
    #[error("the peer vetoed the assignment of pool {0}; check the pool against the channel's constraints and the peer's policy")]
    PoolVetoed(PoolId),
    /// A typed view of buffer memory ([`Buffer::as_slice_of`](crate::Buffer::as_slice_of)
    /// and friends) does not fit: the byte range leaves the buffer, is not a
    /// whole number of elements, or is not aligned for the element type.
    #[error("cannot view {} bytes at offset {} of a buffer as elements of {} (size {}, alignment {}): {}; choose an offset and a length that fit the buffer and the type", .0.bytes, .0.offset, .0.ty, .0.size, .0.align, .0.why)]
    BadView(Box<ViewMismatch>),
    /// A byte range that does not lie inside the buffer or
    /// [`Aggregate`](crate::Aggregate) it names (an offset past the end, or
    /// a start after the end).
    #[error(
        "the byte range {start}..{end} does not lie inside the {len} bytes it names; give a range within 0..{len}"
    )]
    BadRange {
        /// First byte of the range asked for.
        start: usize,
        /// One past its last byte.
        end: usize,
        /// The length of the buffer or aggregate.
        len: usize,
    },

    // --- limits ------------------------------------------------------------------------
    /// The peer asked for more than one of this end's limits allows (see
    /// [`crate::ChannelLimits`]); nothing of the request was taken on.
    #[error("the peer asked for more than this end allows: at most {limit} {what}; raise the channel's limits (ChannelLimits) if the peer is trusted to ask for that much")]
    LimitExceeded {
        /// Which limit.
        what: &'static str,
        /// Its value.
        limit: u64,
    },
    /// The peer made this end queue more than one of its bounds allows
    /// and read none of it: a [`MuxSession`](crate::MuxSession) whose
    /// peer provokes control frames (replies to its opens and closes,
    /// credit, read reports) faster than it reads them (see
    /// [`MuxSession::set_control_limit`](crate::MuxSession::set_control_limit)).
    /// The session is cut off as if the peer had died: every channel on it
    /// fails with this error and what was lent over it comes back.
    #[error("the peer made this end queue more than {limit} bytes of {what} without reading them and was cut off; raise the session's control limit if the peer is trusted and only slow")]
    PeerBacklog {
        /// What was queued.
        what: &'static str,
        /// The bound, in bytes.
        limit: u64,
    },
    /// A [`DataPath`](crate::DataPath) needs another pool for its next
    /// buffer, and one more would exceed its quota
    /// ([`PathQuota`](crate::PathQuota)); its buffers are all in use. Only
    /// this path is refused: other paths and allocators go on.
    #[error("the data path's {pools} pools are all in use and one more would exceed its quota of {max_pools} pools, {max_bytes} bytes; give buffers of the path back, or build it with a larger quota")]
    QuotaExceeded {
        /// Pools the path has.
        pools: u32,
        /// The quota's pool limit.
        max_pools: u32,
        /// The quota's byte limit.
        max_bytes: u64,
    },

    // --- fabric ------------------------------------------------------------------------
    /// libfabric refused or failed (the fabric backend): no provider offers
    /// what the backend needs, opening or registering memory failed, or an
    /// operation completed with an error. The message names the step and
    /// libfabric's reason. On a channel, what was lent over it comes back.
    #[error("the fabric failed: {0}; check the provider (FI_PROVIDER, `fi_info`), its memory-registration limits (`ulimit -l`) and the peer")]
    Fabric(String),
    /// libfabric could not be loaded (the fabric backend loads it when the
    /// first fabric endpoint opens): it is not installed, or the file that
    /// `FERRY_LIBFABRIC` names is not a libfabric. The message is the
    /// loader's.
    #[error("libfabric could not be loaded: {0}; install it (Debian: libfabric1) or name its file in FERRY_LIBFABRIC")]
    FabricUnavailable(String),
}

/// A trust level in words (the library's spelling of [ETH-BT]'s levels).
fn trust_name(t: &TrustLevel) -> &'static str {
    match t {
        TrustLevel::Uninitialized => "UNINITIALIZED",
        TrustLevel::None => "NONE",
        TrustLevel::Half => "HALF",
        TrustLevel::Full => "FULL",
    }
}

/// What a channel in `state` is doing, in words.
fn state_words(state: &ChannelState) -> &'static str {
    match state {
        ChannelState::Uninitialized => "it was never set up",
        ChannelState::Initialized => "it is waiting for a peer to bind",
        ChannelState::Binding => "it is waiting for the answer to its bind",
        ChannelState::BindNegotiate => "its properties are still being negotiated",
        ChannelState::Connected => "it is connected",
        ChannelState::Teardown => "it is tearing down",
        ChannelState::Closed => "it is closed",
    }
}

/// What does not fit in a typed view of buffer memory ([`ErrorKind::BadView`];
/// boxed, so that every `Result` of the library stays small).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewMismatch {
    /// The element type.
    pub ty: &'static str,
    /// Its size in bytes.
    pub size: usize,
    /// Its alignment in bytes.
    pub align: usize,
    /// Offset of the view in the buffer.
    pub offset: usize,
    /// Length of the view in bytes.
    pub bytes: usize,
    /// What does not fit.
    pub why: &'static str,
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        ErrorKind::Os(e.to_string()).into()
    }
}

/// An operation that consumed a value (a buffer) was refused: the value
/// comes back unchanged with the reason.
///
/// A `Refused` is an error of its own (`Send + Sync + 'static` whenever the
/// value is `Send`, whatever else the value is), so `?` takes it into a
/// `Box<dyn Error + Send + Sync>`, and it becomes its [`Error`] (dropping
/// the value) in a function that returns [`ferry::Result`](crate::Result).
///
/// ```
/// use ferry::{Allocator, Domain, ErrorKind, PoolConstraints};
/// let (d1, d2) = (Domain::new("d1"), Domain::new("d2"));
/// let a1 = Allocator::new(&d1, 1, 4096, PoolConstraints::default())?;
/// let a2 = Allocator::new(&d2, 1, 4096, PoolConstraints::default())?;
/// let refused = a1.free(a2.alloc().unwrap()).unwrap_err(); // not d1's buffer
/// assert_eq!(refused.error, ErrorKind::ForeignBuffer);
/// assert!(refused.to_string().starts_with("free buffer 0 of pool "), "{refused}");
/// assert!(refused.to_string().contains(r#"into an allocator of domain "d1""#), "{refused}");
/// let buf = refused.into_inner(); // nothing lost
/// assert_eq!(buf.id().pool, a2.pool().id());
/// // With `?`, a `Refused` becomes its `Error` (the value is dropped).
/// fn give_back(a: &Allocator, b: ferry::Buffer) -> ferry::Result<()> {
///     a.free(b)?;
///     Ok(())
/// }
/// assert_eq!(give_back(&a1, buf).unwrap_err(), ErrorKind::ForeignBuffer);
/// # Ok::<(), ferry::Error>(())
/// ```
pub struct Refused<T> {
    /// Why it was refused.
    pub error: Error,
    /// The value given to the operation, unchanged. Private: a shared
    /// `Refused` never lends it out unless it may be shared (see the `Sync`
    /// impl below).
    value: T,
}

impl<T> Refused<T> {
    pub(crate) fn new(error: impl Into<Error>, value: T) -> Self {
        Refused { error: error.into(), value }
    }

    /// The value back.
    pub fn into_inner(self) -> T {
        self.value
    }

    /// The reason and the value back.
    pub fn into_parts(self) -> (Error, T) {
        (self.error, self.value)
    }

    /// The value, to look at (a value that may be shared between threads).
    pub fn value(&self) -> &T
    where
        T: Sync,
    {
        &self.value
    }

    /// The value, to change in place.
    pub fn value_mut(&mut self) -> &mut T {
        &mut self.value
    }
}

// SAFETY: a `&Refused<T>` reaches the value only through `value()`, which
// needs `T: Sync`; everything else it reaches (`error`, the type's name) is
// `Sync`. The value itself is reached through `&mut` or by move, which need
// only `T: Send` to cross threads. So sharing a `Refused<T>` shares no `&T`
// unless `T` allows it (the `std::sync::Exclusive` argument).
unsafe impl<T: Send> Sync for Refused<T> {}

/// The reason, and the type of the value (not the value: it may not be
/// safe to look at from a shared reference).
impl<T> std::fmt::Debug for Refused<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Refused").field("error", &self.error).field("value", &std::any::type_name::<T>()).finish()
    }
}

impl<T> std::fmt::Display for Refused<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl<T> std::error::Error for Refused<T> {}

impl<T> From<Refused<T>> for Error {
    fn from(r: Refused<T>) -> Self {
        r.error
    }
}

/// Why a wait ([`Channel::wait`](crate::Channel::wait),
/// [`Selector::wait`](crate::Selector::wait), [`wait_any`](crate::wait_any))
/// returned no event: time ran out (wait again), or nothing is left to
/// wait for (stop).
///
/// ```
/// use std::time::Duration;
/// use ferry::{BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, WaitError};
/// let t = Duration::from_secs(10);
/// let ep = Endpoint::local();
/// let mut tx = Channel::create(&Domain::new("a"), &ep, ChannelSetup::default())?;
/// let mut rx = Channel::bind(&Domain::new("b"), &ep, BindParams::default())?;
/// tx.wait_connected(t)?;
/// rx.wait_connected(t)?;
/// assert_eq!(rx.wait(Some(Duration::from_millis(1))).unwrap_err(), WaitError::TimedOut);
/// tx.teardown()?;
/// loop {
///     match rx.wait(Some(t)) {
///         Ok(Event::Closed { by_peer }) => assert!(by_peer),
///         Ok(other) => panic!("{other:?}"),
///         Err(WaitError::Closed) => break, // its last event was delivered
///         Err(WaitError::TimedOut) => panic!("no close within {t:?}"),
///     }
/// }
/// // With `?`, a `WaitError` becomes an `Error` (`TimedOut`, or `NotConnected`).
/// fn next(ch: &mut Channel) -> ferry::Result<Event> {
///     Ok(ch.wait(Some(Duration::from_millis(1)))?)
/// }
/// assert!(next(&mut rx).is_err());
/// # Ok::<(), ferry::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum WaitError {
    /// The timeout passed and no event came; the channel (or some channel
    /// of the selector) is still open.
    #[error("no event came within the timeout; wait again, or check that the peer is still working")]
    TimedOut,
    /// Nothing more will come: the channel is closed and its last event
    /// ([`Event::Closed`](crate::Event::Closed) or
    /// [`Event::Error`](crate::Event::Error)) was delivered; for a selector
    /// or [`wait_any`](crate::wait_any), every channel is (or there is none).
    #[error(
        "the channel is closed and its last event was delivered, so no event will come; open a new channel to go on"
    )]
    Closed,
}

impl From<WaitError> for Error {
    fn from(e: WaitError) -> Self {
        match e {
            WaitError::TimedOut => ErrorKind::TimedOut.into(),
            WaitError::Closed => ErrorKind::NotConnected(ChannelState::Closed).into(),
        }
    }
}

/// Result alias for the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Every `Result` of the library carries an `Error`: it stays small
    /// (a large variant made each move and pass measurably slower), context
    /// or not.
    #[test]
    fn errors_stay_small() {
        assert!(std::mem::size_of::<ErrorKind>() <= 32, "{}", std::mem::size_of::<ErrorKind>());
        assert_eq!(std::mem::size_of::<Error>(), std::mem::size_of::<ErrorKind>());
        assert_eq!(std::mem::size_of::<Result<()>>(), std::mem::size_of::<Error>());
    }

    /// Every form of error a user holds crosses threads and goes into
    /// `Box<dyn Error + Send + Sync>` and `anyhow::Error` (checked when
    /// this compiles).
    #[allow(dead_code)]
    fn errors_are_send_sync_static() {
        fn error<E: std::error::Error + Send + Sync + 'static>() {}
        error::<Error>();
        error::<ErrorKind>();
        error::<Refused<crate::Buffer>>();
        error::<Refused<crate::BufferCopy>>();
        error::<Refused<crate::Aggregate>>();
        // A channel is Send but not Sync; refused, it is an error all the same.
        error::<Refused<crate::Channel>>();
        fn into_boxed<E: Into<Box<dyn std::error::Error + Send + Sync>>>() {}
        into_boxed::<Error>();
        into_boxed::<Refused<crate::Channel>>();
    }

    /// One value of every variant.
    fn every_variant() -> Vec<ErrorKind> {
        let pool = PoolId::from_u128(3);
        vec![
            ErrorKind::BadBufferSize { size: 1000, page: 4096 },
            ErrorKind::BadBufferCount { count: 16, max: 1 },
            ErrorKind::BadAlignment(3),
            ErrorKind::InvalidArgument("queue depth must be a power of two in 2..=65536"),
            ErrorKind::TrustNotSupported { trust: TrustLevel::None, backend: "local" },
            ErrorKind::Os(std::io::Error::from_raw_os_error(12).to_string()),
            ErrorKind::EndpointInUse,
            ErrorKind::EndpointNotListening,
            ErrorKind::BindRefused("trust level mismatch"),
            ErrorKind::NotConnected(ChannelState::BindNegotiate),
            ErrorKind::TearingDown,
            ErrorKind::WrongDirection,
            ErrorKind::ForeignBuffer,
            ErrorKind::PoolNotAssigned(pool),
            ErrorKind::PoolRemovalPending(pool),
            ErrorKind::CopiesOutstanding,
            ErrorKind::NotCopyHolder,
            ErrorKind::CopiesForwarded,
            ErrorKind::SameBuffer,
            ErrorKind::MetaTooLarge { len: 50, max: 16 },
            ErrorKind::UnknownPool(pool),
            ErrorKind::PoolAlreadyAssigned(pool),
            ErrorKind::TrustMismatch { pool: TrustLevel::Half, channel: TrustLevel::Full },
            ErrorKind::PoolInUse(pool),
            ErrorKind::NoPendingRequest(pool),
            ErrorKind::QueueFull,
            ErrorKind::AggregateTooLarge { slots: 70, capacity: 64 },
            ErrorKind::PeerGone,
            ErrorKind::TlsConfig(Box::new(crate::tls::TlsConfigError::for_tests())),
            ErrorKind::Tls("decrypt error".into()),
            ErrorKind::InsecureAddress([192, 0, 2, 1].into()),
            ErrorKind::PeerUnresponsive(Duration::from_millis(5200)),
            ErrorKind::Protocol("frame type 122: unknown".into()),
            ErrorKind::TimedOut,
            ErrorKind::PoolVetoed(pool),
            ErrorKind::BadView(Box::new(ViewMismatch {
                ty: "u64",
                size: 8,
                align: 8,
                offset: 4,
                bytes: 16,
                why: "the offset is not aligned",
            })),
            ErrorKind::LimitExceeded { what: "pools assigned by the peer", limit: 256 },
            ErrorKind::PeerBacklog { what: "control frames", limit: 1 << 20 },
            ErrorKind::QuotaExceeded { pools: 2, max_pools: 2, max_bytes: 1 << 20 },
            ErrorKind::Fabric("fi_getinfo: no data available".into()),
            ErrorKind::FabricUnavailable("libfabric.so.1: cannot open shared object file".into()),
        ]
    }

    /// Every message is one lowercase sentence (it follows a program's name
    /// or another message's colon) that says what happened, then after a
    /// semicolon what to do; no Rust syntax or type names leak into it.
    #[test]
    fn every_message_says_what_happened_and_what_to_do() {
        for e in every_variant() {
            let text = e.to_string();
            let first = text.chars().next().expect("not empty");
            assert!(first.is_lowercase() || first.is_ascii_digit(), "not lowercase: {text}");
            assert!(!text.ends_with('.') && !text.contains('\n'), "not one sentence: {text}");
            let (what, todo) = text.split_once("; ").unwrap_or_else(|| panic!("no advice: {text}"));
            assert!(what.len() > 10 && todo.len() > 10, "{text}");
            for debug in
                ["Some(", "None)", "Error(", "PoolId(", "{", "}", "\"", "::", "BindNegotiate", "Half", "Full", "5.2s"]
            {
                assert!(!text.contains(debug), "{debug:?} in {text}");
            }
        }
    }

    #[test]
    fn values_are_named_in_words() {
        let s = ErrorKind::NotConnected(ChannelState::Closed).to_string();
        assert!(s.contains("it is closed"), "{s}");
        let s = ErrorKind::TrustMismatch { pool: TrustLevel::Half, channel: TrustLevel::Full }.to_string();
        assert!(s.contains("HALF") && s.contains("FULL"), "{s}");
        let s = ErrorKind::PeerUnresponsive(Duration::from_millis(5200)).to_string();
        assert!(s.contains("5.2 s"), "{s}");
        let s = ErrorKind::PoolNotAssigned(PoolId::from_u128(3)).to_string();
        assert!(s.contains("pool 0000000000000003 "), "{s}");
        assert_ne!(
            ErrorKind::UnknownPool(PoolId::from_u128(1)).to_string(),
            ErrorKind::UnknownPool(PoolId::from_u128(2)).to_string()
        );
        // Ids whose halves fold to zero still print something that tells them apart.
        let same_halves = PoolId::from_u128((5 << 64) | 5).to_string();
        assert_eq!(same_halves, format!("{:032x}", (5u128 << 64) | 5));
    }

    /// The context goes in front of the kind's sentence, outer contexts
    /// first; matching and comparing see only the kind.
    #[test]
    fn context_reads_as_one_sentence() {
        let bare: Error = ErrorKind::EndpointNotListening.into();
        assert_eq!(bare.context(), None);
        assert_eq!(bare.to_string(), ErrorKind::EndpointNotListening.to_string());
        let e = bare.with_context("bind to the TCP endpoint 127.0.0.1:9");
        assert_eq!(
            e.to_string(),
            "bind to the TCP endpoint 127.0.0.1:9: no channel is listening on that endpoint; \
             create a channel there first, or check the endpoint's name or address"
        );
        assert_eq!(e, ErrorKind::EndpointNotListening);
        assert!(matches!(e.kind(), ErrorKind::EndpointNotListening));
        let e = e.with_context("start the block client");
        assert_eq!(e.context(), Some("start the block client: bind to the TCP endpoint 127.0.0.1:9"));
        assert_eq!(e.clone().into_kind(), ErrorKind::EndpointNotListening);
        // Context on the error path only: `ResultExt` leaves `Ok` alone.
        let ok: Result<u8> = Ok(1);
        assert_eq!(ok.context(|| -> String { unreachable!("built only on failure") }), Ok(1));
    }

    /// What `fn main() -> Result<(), ferry::Error>` prints after `Error: `:
    /// the sentence, then the kind; `{:#?}` the parts.
    #[test]
    fn debug_is_the_sentence_and_the_kind() {
        let e = Error::from(ErrorKind::PoolNotAssigned(PoolId::from_u128(3))).with_context("move buffer 1 of pool 3");
        let debug = format!("{e:?}");
        assert!(debug.starts_with(&format!("{e} [PoolNotAssigned(")), "{debug}");
        let parts = format!("{e:#?}");
        assert!(parts.contains("kind: PoolNotAssigned(") && parts.contains("context: Some("), "{parts}");
        // A refused value is named by its type, not printed.
        let r = Refused::new(e, vec![1u8, 2, 3]);
        let debug = format!("{r:?}");
        assert!(debug.contains("Vec<u8>") && !debug.contains("[1, 2, 3]"), "{debug}");
        assert_eq!(r.to_string(), r.error.to_string());
    }

    #[test]
    fn os_errors_keep_the_reason() {
        let e = Error::from_errno(rustix::io::Errno::NOMEM);
        assert!(matches!(e.kind(), ErrorKind::Os(why) if why.contains("os error 12")), "{e}");
    }
}
