"""Ferry from Python: zero-copy bulk transfer between threads, processes
and machines, with the ownership semantics of the Rust library (move,
pass, copy, release).

A :class:`Domain` owns :class:`Buffer` objects that live in pools made by
an :class:`Allocator`; a :class:`Channel` joins two endpoints
(:class:`Endpoint`); a pool is assigned to a channel before its buffers
travel on it. ``Channel.move`` gives a buffer away, ``Channel.pass_``
gives it back, ``Channel.copy`` lends a read-only copy, ``Channel.release``
returns it. A buffer exports the pool memory itself through the buffer
protocol: ``memoryview(buf)`` and ``numpy.frombuffer(buf, dtype)`` read and
write it in place.

Events (:class:`MoveReceived`, :class:`BufferPassed`, ...) come from
``Channel.poll``, ``Channel.wait``, iteration and asyncio
(``await channel.next_event()``). Errors are exceptions derived from
:class:`Error`.
"""

from ._errors import (
    BindRefused,
    BufferError,
    BufferGone,
    CopyError,
    EndpointInUse,
    EndpointNotListening,
    Error,
    ForeignBuffer,
    InvalidArgument,
    LimitExceeded,
    NotConnected,
    OsError,
    PeerGone,
    PoolError,
    PoolVetoed,
    ProtocolError,
    QueueFull,
    TimedOut,
    WrongDirection,
)
from ._ferry import (
    DEFAULT_META_SIZE,
    MAX_META_SIZE,
    AggregateReceived,
    Allocator,
    BindRequest,
    Bound,
    Buffer,
    BufferPassed,
    Channel,
    Closed,
    CopyReceived,
    CopyReleased,
    Domain,
    Endpoint,
    MoveReceived,
    Pool,
    PoolAssigned,
    PoolAssignRequest,
    PoolOfferRefused,
    PoolRemoved,
    PoolRemoveRefused,
    PoolAssignVetoed,
    Selector,
)
from . import _aio  # noqa: F401  (Channel.next_event uses it)

__all__ = [
    "DEFAULT_META_SIZE",
    "MAX_META_SIZE",
    "AggregateReceived",
    "Allocator",
    "BindRefused",
    "BindRequest",
    "Bound",
    "Buffer",
    "BufferError",
    "BufferGone",
    "BufferPassed",
    "Channel",
    "Closed",
    "CopyError",
    "CopyReceived",
    "CopyReleased",
    "Domain",
    "Endpoint",
    "EndpointInUse",
    "EndpointNotListening",
    "Error",
    "ForeignBuffer",
    "InvalidArgument",
    "LimitExceeded",
    "MoveReceived",
    "NotConnected",
    "OsError",
    "PeerGone",
    "Pool",
    "PoolAssignRequest",
    "PoolAssigned",
    "PoolError",
    "PoolOfferRefused",
    "PoolRemoveRefused",
    "PoolRemoved",
    "PoolVetoed",
    "PoolAssignVetoed",
    "ProtocolError",
    "QueueFull",
    "Selector",
    "TimedOut",
    "WrongDirection",
]
