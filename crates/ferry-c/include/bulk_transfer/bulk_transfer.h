/*
 * Ferry's C interface: bulk transfer of buffers between threads, processes
 * and machines, with the names and shapes of the original bulk-transfer
 * interface ([ETH-BT] Listings 6.1-6.13), on Linux.
 *
 * Structs marked "caller-allocated" live in the program's memory; the
 * library keeps its own state behind `impl_data` and writes the fields
 * documented as "set by the library". Structs marked "library-owned"
 * (struct bulk_pool, struct bulk_buffer) are made and freed by the
 * library; every field of them is read-only to the program.
 *
 * Threads: see docs/C-API.md. In short: every function may be called from
 * any thread (calls on the channels of one waitset take turns; threads
 * serving different waitsets do not wait for each other); callbacks and
 * continuations run only inside bulk_waitset_dispatch(), on the thread that
 * calls it, one callback per call, with no library lock held.
 */
#ifndef BULK_TRANSFER_BULK_TRANSFER_H
#define BULK_TRANSFER_BULK_TRANSFER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------
 * Errors
 */

/** An error code: BULK_OK (0) on success, one of BULK_ERR_* otherwise. */
typedef uintptr_t errval_t;

#define BULK_OK                        ((errval_t)0)
/** The library failed internally (a bug in Ferry); nothing was changed. */
#define BULK_ERR_INTERNAL              ((errval_t)1)
/** A pointer argument was NULL. */
#define BULK_ERR_NULL_ARGUMENT         ((errval_t)2)
/** An argument has a value the call does not accept. */
#define BULK_ERR_INVALID_ARGUMENT      ((errval_t)3)
/** Nothing happened within the timeout (bulk_waitset_dispatch). */
#define BULK_ERR_TIMEOUT               ((errval_t)4)
/** The endpoint descriptor was not made by an endpoint function, or was destroyed. */
#define BULK_ERR_INVALID_ENDPOINT      ((errval_t)5)
/** The endpoint already has a channel, or a binder. */
#define BULK_ERR_ENDPOINT_IN_USE       ((errval_t)6)
/** Nobody listens on the endpoint that was named for binding. */
#define BULK_ERR_ENDPOINT_NOT_LISTENING ((errval_t)7)
/** The channel struct is in use already (created or bound, not destroyed). */
#define BULK_ERR_CHANNEL_IN_USE        ((errval_t)8)
/** The channel struct was never created or bound, or was destroyed. */
#define BULK_ERR_INVALID_CHANNEL       ((errval_t)9)
/** The channel is not connected (still binding). */
#define BULK_ERR_CHANNEL_STATE         ((errval_t)10)
/** The channel is torn down or closed. */
#define BULK_ERR_CHANNEL_CLOSED        ((errval_t)11)
/** The call needs the other direction (move/copy: source; pass/release: sink). */
#define BULK_ERR_WRONG_DIRECTION       ((errval_t)12)
/** The pointer is not a buffer of a pool this process knows. */
#define BULK_ERR_INVALID_BUFFER        ((errval_t)13)
/** The program does not own the buffer (moved or passed away, returned, or never had). */
#define BULK_ERR_BUFFER_NOT_OWNED      ((errval_t)14)
/** The buffer belongs to another pool than the allocator's. */
#define BULK_ERR_FOREIGN_POOL          ((errval_t)15)
/** The buffer's pool is not assigned to the channel. */
#define BULK_ERR_POOL_NOT_ASSIGNED     ((errval_t)16)
/** The pool is assigned to the channel already, or its assignment is pending. */
#define BULK_ERR_POOL_ALREADY_ASSIGNED ((errval_t)17)
/** The peer vetoed the pool (continuation of bulk_channel_assign_pool). */
#define BULK_ERR_POOL_VETOED           ((errval_t)18)
/** Copies of the pool's buffers are out, or the pool is in use otherwise. */
#define BULK_ERR_POOL_IN_USE           ((errval_t)19)
/** A removal of the buffer's pool from the channel is pending. */
#define BULK_ERR_POOL_REMOVAL_PENDING  ((errval_t)20)
/** The pointer is not a pool this process knows. */
#define BULK_ERR_INVALID_POOL          ((errval_t)21)
/** The buffer is no copy received over this channel (bulk_channel_release). */
#define BULK_ERR_NOT_A_COPY            ((errval_t)22)
/** Copies of the buffer are out: it is read-only until they are released. */
#define BULK_ERR_COPIES_OUTSTANDING    ((errval_t)23)
/** Copies this domain forwarded of the buffer must be released first. */
#define BULK_ERR_COPIES_FORWARDED      ((errval_t)24)
/** The channel's queue is full: dispatch, then try again. */
#define BULK_ERR_QUEUE_FULL            ((errval_t)25)
/** The pool's trust level differs from the channel's. */
#define BULK_ERR_TRUST_MISMATCH        ((errval_t)26)
/** The endpoint's backend cannot give this trust level (local: NONE). */
#define BULK_ERR_TRUST_NOT_SUPPORTED   ((errval_t)27)
/** The creator refused the binder (trust level or meta size). */
#define BULK_ERR_BIND_REFUSED          ((errval_t)28)
/** The peer is gone (its process exited or the connection broke). */
#define BULK_ERR_PEER_GONE             ((errval_t)29)
/** Buffer size or count not accepted (size: a power of two, at least a page; count >= 1). */
#define BULK_ERR_BAD_BUFFER_SIZE       ((errval_t)30)
/** The system refused memory or a file descriptor. */
#define BULK_ERR_NO_RESOURCES          ((errval_t)31)
/** The allocator struct was never initialized, or was freed. */
#define BULK_ERR_INVALID_ALLOCATOR     ((errval_t)32)
/** The waitset still has channels or continuations to run. */
#define BULK_ERR_WAITSET_BUSY          ((errval_t)33)
/** Waiting forever on a waitset on which nothing can happen. */
#define BULK_ERR_WAITSET_EMPTY         ((errval_t)34)
/** The pointer is not a live waitset. */
#define BULK_ERR_INVALID_WAITSET       ((errval_t)35)
/** The channel was destroyed before the call completed (continuations only). */
#define BULK_ERR_CHANNEL_DESTROYED     ((errval_t)36)
/** A system call failed. */
#define BULK_ERR_IO                    ((errval_t)37)
/** Buffer states change only through the transfer calls. */
#define BULK_ERR_BUFFER_STATE          ((errval_t)38)
/** The peer broke the protocol; the channel is closed. */
#define BULK_ERR_PROTOCOL              ((errval_t)39)
/** The allocator struct is initialized already. */
#define BULK_ERR_ALLOCATOR_IN_USE      ((errval_t)40)
/** The pool is not in this process's pool list. */
#define BULK_ERR_UNKNOWN_POOL          ((errval_t)41)
/** The number of error codes (every code is below it). */
#define BULK_ERR_COUNT                 42

/** A sentence describing `err` (never NULL, never empty; static storage). */
const char *bulk_strerror(errval_t err);

/* ---------------------------------------------------------------------------
 * Channel properties (Listing 6.1)
 */

/** Direction of data flow, as seen from one end of a channel. */
enum bulk_channel_direction {
    BULK_DIRECTION_TX = 0, /**< this end is the source of data */
    BULK_DIRECTION_RX = 1  /**< this end is the sink */
};

/** Role of an end; a GENERIC creator takes the role opposite to the binder's. */
enum bulk_channel_role {
    BULK_ROLE_GENERIC = 0,
    BULK_ROLE_MASTER = 1,
    BULK_ROLE_SLAVE = 2
};

/** Trust between the ends (and the trust a pool was first assigned with). */
enum bulk_trust_level {
    BULK_TRUST_UNINITIALIZED = 0, /**< pools only: not yet assigned */
    BULK_TRUST_NONE = 1,          /**< page protections, separate memory (shm, TCP) */
    BULK_TRUST_HALF = 2,          /**< page protections in the sender against accidents */
    BULK_TRUST_FULL = 3           /**< no protection changes */
};

/** State of one end of a channel. */
enum bulk_channel_state {
    BULK_STATE_UNINITIALIZED = 0,
    BULK_STATE_INITIALIZED = 1,   /**< created, waiting for a binder */
    BULK_STATE_BINDING = 2,       /**< bind in progress */
    BULK_STATE_BIND_NEGOTIATE = 3,
    BULK_STATE_CONNECTED = 4,
    BULK_STATE_TEARDOWN = 5,
    BULK_STATE_CLOSED = 6
};

/** State of a buffer in this process (domain). */
enum bulk_buffer_state {
    BULK_BUFFER_INVALID = 0,    /**< not accessible here (moved away, or unknown) */
    BULK_BUFFER_READ_ONLY = 1,  /**< a copy received, read-only */
    BULK_BUFFER_RO_OWNED = 2,   /**< owned, but copies are out: read-only */
    BULK_BUFFER_READ_WRITE = 3  /**< owned, no copies out */
};

struct bulk_channel;
struct bulk_pool;
struct bulk_pool_list;
struct bulk_buffer;

/**
 * A waitset: the events of every channel created or bound with it are
 * dispatched from it (bulk_waitset_dispatch). Opaque; made by
 * bulk_waitset_create() or bulk_waitset_default().
 */
struct waitset;

/* ---------------------------------------------------------------------------
 * Continuations
 */

/** What runs when an asynchronous call completes (from dispatch). */
struct bulk_continuation {
    void (*handler)(void *arg, errval_t err, struct bulk_channel *channel);
    void *arg;
};

#ifdef __cplusplus
#define MK_BULK_CONT(h, a) (bulk_continuation{ (h), (a) })
#else
#define MK_BULK_CONT(h, a) ((struct bulk_continuation){ .handler = (h), .arg = (a) })
#endif
#define BULK_CONT_NOP MK_BULK_CONT(NULL, NULL)

/** Runs a continuation's handler, if it has one. */
static inline void bulk_continuation_call(struct bulk_continuation cont, errval_t err,
                                          struct bulk_channel *channel)
{
    if (cont.handler) {
        cont.handler(cont.arg, err, channel);
    }
}

/* ---------------------------------------------------------------------------
 * Endpoints
 */

/** Which backend an endpoint descriptor names. */
enum bulk_backend {
    BULK_BACKEND_NONE = 0,
    BULK_BACKEND_LOCAL = 1, /**< threads of one process (bulk_local.h) */
    BULK_BACKEND_SM = 2,    /**< processes of one machine, shared memory (bulk_sm.h) */
    BULK_BACKEND_NET = 3    /**< machines, TCP (bulk_net.h) */
};

/**
 * The generic part of every endpoint descriptor; the first member of
 * struct bulk_local_endpoint, bulk_sm_endpoint_descriptor and
 * bulk_net_endpoint_descriptor. Written by their init/create functions;
 * read-only to the program.
 */
struct bulk_endpoint_descriptor {
    uint32_t magic;   /**< private: marks a descriptor made by the library */
    uint32_t backend; /**< enum bulk_backend */
    uint32_t remote;  /**< nonzero: names another program's endpoint (to bind) */
    uint32_t reserved;
};

/* ---------------------------------------------------------------------------
 * Channels
 */

/** Constraints on a channel's memory (recorded, not enforced on Linux). */
struct bulk_channel_constraints {
    uintptr_t mem_range_min;
    uintptr_t mem_range_max;
    uintptr_t men_align; /* sic: the original's name */
};

/**
 * What the program wants to hear of a channel. A NULL member means "not
 * interested" (an incoming pool with pool_assigned NULL is accepted). Every
 * callback runs from bulk_waitset_dispatch.
 */
struct bulk_channel_callbacks {
    /** Creator: a binder connected; the channel is CONNECTED. The return value is ignored. */
    errval_t (*bind_received)(struct bulk_channel *channel);
    /** The peer destroyed its end (or died): this end is CLOSED; destroy it. */
    void (*teardown_received)(struct bulk_channel *channel);
    /** The peer assigns a pool: return BULK_OK to accept, anything else vetoes. */
    errval_t (*pool_assigned)(struct bulk_channel *channel, struct bulk_pool *pool);
    /** The peer removed a pool from the channel. The return value is ignored. */
    errval_t (*pool_removed)(struct bulk_channel *channel, struct bulk_pool *pool);
    /** Sink: a buffer was moved to us; we own it. `meta` has the channel's meta_size bytes. */
    void (*move_received)(struct bulk_channel *channel, struct bulk_buffer *buffer, void *meta);
    /** Source: a buffer was passed back to us; we own it. */
    void (*buffer_received)(struct bulk_channel *channel, struct bulk_buffer *buffer, void *meta);
    /** Sink: a read-only copy arrived; release it with bulk_channel_release. */
    void (*copy_received)(struct bulk_channel *channel, struct bulk_buffer *buffer, void *meta);
    /** Source: a copy we sent was released. */
    void (*copy_released)(struct bulk_channel *channel, struct bulk_buffer *buffer);
    /** Never called by Ferry (kept so that programs setting it compile). */
    void (*request_received)(struct bulk_channel *channel, size_t count);
};

/**
 * One end of a channel. Caller-allocated; give it to bulk_channel_create
 * or bulk_channel_bind, keep it at the same address until
 * bulk_channel_destroy's continuation ran, and change no field but
 * user_state meanwhile.
 */
struct bulk_channel {
    /** The callbacks given at create/bind (the program keeps them alive). Set by the library. */
    struct bulk_channel_callbacks *callbacks;
    /** The endpoint given at create/bind. Set by the library. */
    struct bulk_endpoint_descriptor *ep;
    /** enum bulk_channel_state. Set by the library as events are dispatched. */
    enum bulk_channel_state state;
    /** Not maintained by Ferry: always NULL. */
    struct bulk_pool_list *pools;
    /** Set by the library (a binder's once bound). */
    enum bulk_channel_direction direction;
    /** Set by the library (a generic creator's once bound). */
    enum bulk_channel_role role;
    /** Set by the library (a binder's once bound). */
    enum bulk_trust_level trust;
    /** As given at create/bind. Set by the library. */
    struct bulk_channel_constraints constraints;
    /** Bytes of meta data per transfer. Set by the library (a binder's once bound). */
    size_t meta_size;
    /** The waitset the channel's events are dispatched from. Set by the library. */
    struct waitset *waitset;
    /** The program's own pointer; set from setup/params, then the program's to change. */
    void *user_state;
    /** Private to the library. */
    void *impl_data;
};

/** Parameters of bulk_channel_create. */
struct bulk_channel_setup {
    enum bulk_channel_direction direction;
    enum bulk_channel_role role;
    /** FULL, HALF or NONE (NONE: shm and TCP only). */
    enum bulk_trust_level trust;
    struct bulk_channel_constraints constraints;
    /** Bytes of meta data per transfer (at most BULK_MAX_META_SIZE). */
    size_t meta_size;
    /** NULL: bulk_waitset_default(). */
    struct waitset *waitset;
    void *user_state;
};

/** Parameters of bulk_channel_bind. */
struct bulk_channel_bind_params {
    /** The role asked for (GENERIC: whatever the creator leaves). */
    enum bulk_channel_role role;
    /** The trust level required; UNINITIALIZED: the creator's. */
    enum bulk_trust_level trust;
    struct bulk_channel_constraints constraints;
    /** NULL: bulk_waitset_default(). */
    struct waitset *waitset;
    void *user_state;
};

/** The largest meta_size a channel may have. */
#define BULK_MAX_META_SIZE 224

/**
 * Creates a channel on a local endpoint (one made with
 * bulk_local_init_endpoint(ep, NULL), bulk_sm_ep_create or
 * bulk_net_ep_create). Returns once the endpoint listens: a binder can
 * connect at once; the binder's arrival is the bind_received callback.
 */
errval_t bulk_channel_create(struct bulk_channel *channel,
                             struct bulk_endpoint_descriptor *ep_desc,
                             struct bulk_channel_callbacks *callbacks,
                             struct bulk_channel_setup *setup);

/**
 * Binds to a channel created elsewhere (remote_ep_desc names it). Returns
 * at once; `cont` runs from dispatch when the binding completed (BULK_OK)
 * or failed.
 */
errval_t bulk_channel_bind(struct bulk_channel *channel,
                           struct bulk_endpoint_descriptor *remote_ep_desc,
                           struct bulk_channel_callbacks *callbacks,
                           struct bulk_channel_bind_params *params,
                           struct bulk_continuation cont);

/**
 * Assigns a pool to a connected channel (two-phase: the peer may veto).
 * `cont` runs with BULK_OK once the peer accepted, BULK_ERR_POOL_VETOED
 * if it vetoed.
 */
errval_t bulk_channel_assign_pool(struct bulk_channel *channel,
                                  struct bulk_pool *pool,
                                  struct bulk_continuation cont);

/** Removes a pool from a channel; `cont` runs once the peer agreed (or with BULK_ERR_POOL_IN_USE). */
errval_t bulk_channel_remove_pool(struct bulk_channel *channel,
                                  struct bulk_pool *pool,
                                  struct bulk_continuation cont);

/**
 * Destroys a channel end in any state after create/bind: its peer gets
 * teardown_received. Returns BULK_OK; `cont` runs from dispatch. The
 * continuations of calls on the channel that had not completed run first,
 * with BULK_ERR_CHANNEL_DESTROYED. What the peer sent before it saw the
 * teardown (buffers passed back, moves) is taken back into the pools by the
 * waitset's dispatch until the peer's end has closed too (at most 2 s).
 */
errval_t bulk_channel_destroy(struct bulk_channel *channel,
                              struct bulk_continuation cont);

/**
 * Moves a buffer (source only): data and ownership go to the peer. `meta`
 * points to the channel's meta_size bytes (may be NULL: zeros are sent).
 * The buffer must be owned, READ_WRITE, of a pool assigned to the channel.
 */
errval_t bulk_channel_move(struct bulk_channel *channel,
                           struct bulk_buffer *buffer,
                           void *meta,
                           struct bulk_continuation cont);

/** Passes an owned buffer back (sink only); like move in the other direction. */
errval_t bulk_channel_pass(struct bulk_channel *channel,
                           struct bulk_buffer *buffer,
                           void *meta,
                           struct bulk_continuation cont);

/**
 * Sends a read-only copy (source only) of a buffer the program owns or
 * holds a copy of. The owner's buffer is RO_OWNED until every copy is
 * released.
 */
errval_t bulk_channel_copy(struct bulk_channel *channel,
                           struct bulk_buffer *buffer,
                           void *meta,
                           struct bulk_continuation cont);

/** Releases a copy received over this channel (sink only). */
errval_t bulk_channel_release(struct bulk_channel *channel,
                              struct bulk_buffer *buffer,
                              struct bulk_continuation cont);

/* ---------------------------------------------------------------------------
 * Pools and buffers (library-owned; every field read-only to the program)
 */

/** A pool's id: the four 32-bit words of Ferry's 128-bit pool id, the same in every process. */
struct bulk_pool_id {
    uint32_t machine;
    uint32_t dom;
    uint32_t local;
    uint32_t tag;
};

/**
 * A pool: num_buffers buffers of buffer_size bytes. Library-owned; its
 * address stays the same while the process knows the pool (it has the
 * allocator, a channel lists the pool, or the program holds one of its
 * buffers).
 */
struct bulk_pool {
    struct bulk_pool_id id;
    /** Where the pool is mapped in this process. */
    uintptr_t base_address;
    size_t buffer_size;
    /** enum bulk_trust_level: the trust of the first channel it was assigned to. */
    enum bulk_trust_level trust;
    size_t num_buffers;
    /** The pool's buffers, by index. */
    struct bulk_buffer **buffers;
};

/** Not maintained by Ferry (struct bulk_channel's `pools` is always NULL). */
struct bulk_pool_list {
    struct bulk_pool_list *next;
    struct bulk_pool *pool;
};

/**
 * A buffer. Library-owned, one per buffer of a pool in this process.
 * `address` points into the pool's mapping: at trust HALF and NONE the
 * pages follow `state` (a write to a moved buffer or to a copy faults; at
 * NONE a buffer that left the process cannot be read either).
 */
struct bulk_buffer {
    void *address;
    struct bulk_pool *pool;
    /** The buffer's index in its pool, the same in every process. */
    uint32_t bufferid;
    /** enum bulk_buffer_state: this process's access. */
    enum bulk_buffer_state state;
    /** Copies of this buffer the program holds (received and not released). */
    uint32_t local_ref_count;
    uint32_t reserved;
};

/** The pool with this id in this process's pool list, or NULL. */
struct bulk_pool *bulk_pool_domain_list_get(struct bulk_pool_id *id);

/**
 * Buffer states change only through the transfer calls: returns BULK_OK if
 * `state` is the buffer's state already, BULK_ERR_BUFFER_STATE otherwise.
 */
errval_t bulk_buffer_change_state(struct bulk_buffer *buffer, enum bulk_buffer_state state);

/* ---------------------------------------------------------------------------
 * Waitsets
 */

/** bulk_waitset_dispatch's timeout that waits as long as it takes. */
#define BULK_WAIT_FOREVER ((int64_t)-1)

/** Makes a waitset. */
errval_t bulk_waitset_create(struct waitset **ws);

/**
 * Frees a waitset (also the default one: a later bulk_waitset_default()
 * makes a new one). BULK_ERR_WAITSET_BUSY while channels are on it or
 * continuations wait to run.
 */
errval_t bulk_waitset_destroy(struct waitset *ws);

/** The process's default waitset (made on first use); NULL only if it cannot be made. */
struct waitset *bulk_waitset_default(void);

/**
 * Runs the next callback or continuation that is due on `ws` (one per
 * call), waiting up to timeout_ns for one (0: never sleeps, though on a
 * busy waitset it polls the channels for up to the waitset's spin, see
 * bulk_waitset_set_spin; BULK_WAIT_FOREVER: no limit). BULK_OK after running one,
 * BULK_ERR_TIMEOUT if none came in time, BULK_ERR_WAITSET_EMPTY when
 * waiting forever on a waitset without channels or continuations.
 */
errval_t bulk_waitset_dispatch(struct waitset *ws, int64_t timeout_ns);

/**
 * How long bulk_waitset_dispatch polls the channels of `ws` before it arms
 * them (so that a peer's next message rings their doorbells) and, with a
 * timeout, sleeps, when `ws` is busy (it ran something within the last
 * millisecond); also when the timeout is 0. Default: 20 us, Ferry's spin
 * before sleeping: a program that busy-polls with timeout 0 then makes no
 * system call and costs its peers none. An idle waitset is armed at once.
 * 0: never poll longer than one round. With timeout 0 the channels are
 * armed only once the program took the waitset's fd (bulk_waitset_fd).
 */
errval_t bulk_waitset_set_spin(struct waitset *ws, uint64_t spin_ns);

/**
 * A file descriptor that is readable when something may be due on `ws`,
 * for the program's own poll/epoll/libuv/libevent loop (-1 for an invalid
 * waitset). Never read it: call bulk_waitset_dispatch(ws, 0) until it
 * returns BULK_ERR_TIMEOUT, which re-arms it (it is readable when first
 * handed out, so that the loop starts with that). Owned by the waitset.
 */
int bulk_waitset_fd(struct waitset *ws);

#ifdef __cplusplus
}
#endif

#endif /* BULK_TRANSFER_BULK_TRANSFER_H */
