"""Ferry's exceptions: one class per kind of failure of the library.

Every exception is a :class:`ferry.Error`; its ``kind`` attribute names the
library's error precisely (``"QueueFull"``, ``"PoolNotAssigned"``, ...),
and its message says what failed, where, and what to do. An operation that
was refused changed nothing; when it took a buffer, the exception's
``buffer`` attribute is that buffer, still usable.
"""

import builtins

__all__ = [
    "Error",
    "InvalidArgument",
    "OsError",
    "EndpointInUse",
    "EndpointNotListening",
    "BindRefused",
    "NotConnected",
    "WrongDirection",
    "ForeignBuffer",
    "PoolError",
    "PoolVetoed",
    "CopyError",
    "QueueFull",
    "PeerGone",
    "ProtocolError",
    "TimedOut",
    "LimitExceeded",
    "BufferError",
    "BufferGone",
]


class Error(Exception):
    """Base class of every Ferry exception.

    ``kind`` names the library's error (the variant of Rust's
    ``ferry::Error``); ``buffer`` is set on refused operations that took a
    buffer (the buffer is unchanged and still yours).
    """

    kind: str = "Error"


class InvalidArgument(Error, ValueError):
    """A bad argument: a buffer size that is not a power of two of at least
    a page, meta data longer than the channel's meta size, an unknown trust
    level, a negative timeout, ..."""


class OsError(Error, OSError):
    """The operating system refused a call (memory, file descriptors,
    mappings)."""


class EndpointInUse(Error):
    """The endpoint already has a channel created on it."""


class EndpointNotListening(Error):
    """Bind to an endpoint nobody created a channel on (``Channel.connect``
    retries until its timeout instead)."""


class BindRefused(Error):
    """The channel's creator refused the bind (trust level or meta size the
    binder cannot take)."""


class NotConnected(Error):
    """The channel is not connected: still binding, tearing down, or
    closed."""


class WrongDirection(Error):
    """Move and copy belong to the source ("tx") end, pass and release to
    the sink ("rx") end."""


class ForeignBuffer(Error):
    """The buffer or pool belongs to another domain."""


class PoolError(Error):
    """A pool is not assigned to the channel, is being removed, is unknown,
    is assigned already, has another trust level, or is in use."""


class PoolVetoed(PoolError):
    """The peer vetoed the assignment of a pool."""


class CopyError(Error):
    """Read-only copies are in the way: copies of the buffer are still out,
    the copy was not received over this channel, a copy forwarded from it is
    still out, or a copy was given where an owned buffer is needed (and the
    reverse)."""


class QueueFull(Error):
    """The channel's queue is full: poll or wait, so the peer can take
    messages, then try again."""


class PeerGone(Error, ConnectionError):
    """The peer went away (closed, crashed, killed or unreachable) or went
    silent for too long. Raised once by ``poll``/``wait``/``next_event`` of
    the failed channel; the buffers lent to the peer are back in their
    allocator by then."""


class ProtocolError(Error):
    """The peer sent something malformed or impossible; the channel is
    closed."""


class TimedOut(Error, TimeoutError):
    """A wait with a timeout (connect, accept, assign_pool_and_wait) ran
    out of time."""


class LimitExceeded(Error):
    """The peer asked for more than this end's limits allow."""


class BufferError(Error, builtins.BufferError):
    """A buffer cannot do what was asked in its state: moved, passed,
    copied, released or freed while a view of it (a memoryview, a numpy
    array, a slice) is still exported, or written while it is read-only."""


class BufferGone(BufferError):
    """The buffer left this object: it was moved or passed away, released
    or freed, and the object gives no access any more."""

# Shown as ferry.PeerGone (the names the package exports), not ferry._errors.PeerGone.
for _name in __all__:
    globals()[_name].__module__ = "ferry"
del _name
