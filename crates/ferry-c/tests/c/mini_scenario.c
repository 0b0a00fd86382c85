/*
 * mini_scenario: two ends of a local channel in one process, served by one
 * waitset, going through the scenario of "bulk_mini", the smallest of the
 * bulk-transfer test programs of the Barrelfish operating system: a sender
 * binds to a receiver, offers it a pool, then, four times over, moves a
 * filled buffer that the receiver checks and passes back, and copies a
 * filled buffer that the receiver checks and releases.
 *
 * This is an independent program written for Ferry's tests, not a copy of
 * that one: it reproduces its scenario through the same interface (the
 * bulk_* calls and callbacks, the default waitset and its blocking
 * dispatch loop, and the names of <bulk_transfer/barrelfish_compat.h>),
 * and checks more on the way: every continuation succeeds and runs exactly
 * once, meta data arrives as sent, buffer states follow the contract, and
 * at the end both channel ends are destroyed and the allocator freed.
 *
 * Success: exit status 0 after "mini_scenario: round N of 4 complete" for
 * N = 1..4 and "mini_scenario: all 4 rounds complete". A failed check
 * prints "mini_scenario: CHECK FAILED" and aborts.
 */
#include <bulk_transfer/barrelfish_compat.h>
#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_local.h>
#include <bulk_transfer/bulk_transfer.h>

#include <stdint.h>

/** Rounds of (move, pass back, copy, release). */
#define ROUNDS 4u
/** Buffers in the sender's pool, and their size. */
#define POOL_BUFFERS 4u
#define BUFFER_BYTES 4096u
/** What the sender writes into a buffer it moves, and into one it copies. */
#define MOVE_FILL 0x5a
#define COPY_FILL 0xc3
/** Meta data of a move (the receiver passes the buffer back with it + 1)
 *  and of a copy, 16 apart from one round to the next. */
#define MOVE_TAG 0x4d00u
#define COPY_TAG 0x4300u

#define REQUIRE(cond, what)                                                \
    do {                                                                   \
        if (!(cond)) {                                                     \
            debug_printf("mini_scenario: CHECK FAILED: %s (%s, line %d)\n", \
                         (what), #cond, __LINE__);                         \
            abort();                                                       \
        }                                                                  \
    } while (0)

#define REQUIRE_OK(expr, what)                                             \
    do {                                                                   \
        errval_t require_err_ = (expr);                                    \
        if (err_is_fail(require_err_)) {                                   \
            DEBUG_ERR(require_err_, "mini_scenario: CHECK FAILED: %s (line %d)", \
                      (what), __LINE__);                                   \
            abort();                                                       \
        }                                                                  \
    } while (0)

/** Where the sender is in the current round. */
enum sender_step {
    SENDER_BINDING,       /* waiting for its bind to complete */
    SENDER_OFFERING_POOL, /* waiting for the receiver to accept the pool */
    SENDER_MOVE_NEXT,     /* ready to fill and move a buffer */
    SENDER_AWAIT_PASS,    /* waiting for the moved buffer to come back */
    SENDER_COPY_NEXT,     /* ready to fill and copy a buffer */
    SENDER_AWAIT_RELEASE, /* waiting for the copy to be released */
    SENDER_ROUND_OVER,    /* the round's buffers are all back */
};

static struct bulk_channel receiver; /* creates the channel, RX */
static struct bulk_channel sender;   /* binds to it, TX */
static struct bulk_allocator sender_buffers;

static volatile enum sender_step step = SENDER_BINDING;
static unsigned rounds_done;
/** Continuations of moves, passes, copies, releases and destroys that ran. */
static unsigned completions;

/** The meta data of this round's move and copy. */
static uint32_t move_tag(void)
{
    return MOVE_TAG + 16 * rounds_done;
}

static uint32_t copy_tag(void)
{
    return COPY_TAG + 16 * rounds_done;
}

/** Whether every byte of `buffer` is `value`. */
static int filled_with(const struct bulk_buffer *buffer, unsigned char value)
{
    const volatile unsigned char *bytes = buffer->address;
    for (size_t i = 0; i < buffer->pool->buffer_size; i++) {
        if (bytes[i] != value) {
            return 0;
        }
    }
    return 1;
}

/** The continuation of every call but bind and assign_pool: it must
 *  succeed; `arg` names the call. */
static void count_completion(void *arg, errval_t err, struct bulk_channel *channel)
{
    REQUIRE(channel == &sender || channel == &receiver, "a continuation names one of our channels");
    REQUIRE_OK(err, (const char *)arg);
    completions++;
}

/* --- the receiving end ------------------------------------------------ */

static errval_t receiver_bound(struct bulk_channel *channel)
{
    REQUIRE(channel == &receiver, "bind_received on the receiving end");
    debug_printf("mini_scenario: receiver: the sender bound\n");
    return SYS_ERR_OK;
}

static errval_t receiver_pool_offered(struct bulk_channel *channel, struct bulk_pool *pool)
{
    REQUIRE(channel == &receiver, "pool_assigned on the receiving end");
    REQUIRE(pool->buffer_size == BUFFER_BYTES && pool->num_buffers == POOL_BUFFERS,
            "the offered pool has the sender's shape");
    debug_printf("mini_scenario: receiver: accepting a pool of %zu buffers\n", pool->num_buffers);
    return SYS_ERR_OK;
}

static void receiver_got_move(struct bulk_channel *channel, struct bulk_buffer *buffer, void *meta)
{
    uint32_t tag;
    memcpy(&tag, meta, sizeof tag);
    debug_printf("mini_scenario: receiver: buffer %u moved in, meta %#x\n",
                 (unsigned)buffer->bufferid, (unsigned)tag);
    REQUIRE(channel == &receiver, "move_received on the receiving end");
    REQUIRE(tag == move_tag(), "the move's meta data");
    REQUIRE(buffer->state == BULK_BUFFER_READ_WRITE, "a moved-in buffer is ours to write");
    REQUIRE(filled_with(buffer, MOVE_FILL), "the moved buffer holds what the sender wrote");

    uint32_t reply = tag + 1;
    REQUIRE_OK(bulk_channel_pass(channel, buffer, &reply, MK_BULK_CONT(count_completion, "pass")),
               "pass the buffer back");
}

static void receiver_got_copy(struct bulk_channel *channel, struct bulk_buffer *buffer, void *meta)
{
    uint32_t tag;
    memcpy(&tag, meta, sizeof tag);
    debug_printf("mini_scenario: receiver: copy of buffer %u in, meta %#x\n",
                 (unsigned)buffer->bufferid, (unsigned)tag);
    REQUIRE(channel == &receiver, "copy_received on the receiving end");
    REQUIRE(tag == copy_tag(), "the copy's meta data");
    REQUIRE(buffer->state == BULK_BUFFER_READ_ONLY, "a received copy is read-only");
    REQUIRE(filled_with(buffer, COPY_FILL), "the copy holds what the sender wrote");

    REQUIRE_OK(bulk_channel_release(channel, buffer, MK_BULK_CONT(count_completion, "release")),
               "release the copy");
}

static struct bulk_channel_callbacks receiver_callbacks = {
    .bind_received = receiver_bound,
    .pool_assigned = receiver_pool_offered,
    .move_received = receiver_got_move,
    .copy_received = receiver_got_copy,
};

static void open_receiver(struct waitset *ws)
{
    static struct bulk_local_endpoint endpoint;
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_RX,
        .role = BULK_ROLE_SLAVE,
        .trust = BULK_TRUST_FULL,
        .meta_size = sizeof(uint32_t),
        .waitset = ws,
    };
    bulk_local_init_endpoint(&endpoint, NULL);
    REQUIRE_OK(bulk_channel_create(&receiver, &endpoint.generic, &receiver_callbacks, &setup),
               "create the receiving end");
}

/* --- the sending end -------------------------------------------------- */

static void sender_pool_accepted(void *arg, errval_t err, struct bulk_channel *channel)
{
    REQUIRE_OK(err, "the receiver accepts the pool");
    REQUIRE(channel == &sender, "assign_pool's continuation names the sending end");
    /* Given no argument of its own, the continuation gets the pool. */
    REQUIRE(arg == sender_buffers.pool, "assign_pool's continuation gets the pool");
    debug_printf("mini_scenario: sender: pool accepted\n");
    step = SENDER_MOVE_NEXT;
}

static void sender_bound(void *arg, errval_t err, struct bulk_channel *channel)
{
    (void)arg;
    REQUIRE_OK(err, "bind");
    REQUIRE(channel == &sender, "bind's continuation names the sending end");
    REQUIRE(channel->meta_size == sizeof(uint32_t), "the binder learns the creator's meta size");
    debug_printf("mini_scenario: sender: bound; offering the pool\n");
    step = SENDER_OFFERING_POOL;
    REQUIRE_OK(bulk_channel_assign_pool(channel, sender_buffers.pool,
                                        MK_BULK_CONT(sender_pool_accepted, NULL)),
               "assign the pool");
}

static errval_t sender_pool_offered(struct bulk_channel *channel, struct bulk_pool *pool)
{
    (void)channel;
    (void)pool;
    debug_printf("mini_scenario: sender: offered a pool (accepted)\n");
    return SYS_ERR_OK;
}

static void sender_got_buffer_back(struct bulk_channel *channel, struct bulk_buffer *buffer, void *meta)
{
    uint32_t tag;
    memcpy(&tag, meta, sizeof tag);
    debug_printf("mini_scenario: sender: buffer %u passed back, meta %#x\n",
                 (unsigned)buffer->bufferid, (unsigned)tag);
    REQUIRE(channel == &sender, "buffer_received on the sending end");
    REQUIRE(step == SENDER_AWAIT_PASS, "a buffer comes back only after a move");
    REQUIRE(tag == move_tag() + 1, "the pass carries the receiver's meta data");
    REQUIRE_OK(bulk_alloc_return_buffer(&sender_buffers, buffer), "return the passed-back buffer");
    step = SENDER_COPY_NEXT;
}

static void sender_copy_released(struct bulk_channel *channel, struct bulk_buffer *buffer)
{
    debug_printf("mini_scenario: sender: copy of buffer %u released\n", (unsigned)buffer->bufferid);
    REQUIRE(channel == &sender, "copy_released on the sending end");
    REQUIRE(step == SENDER_AWAIT_RELEASE, "a copy is released only after it was sent");
    REQUIRE(buffer->state == BULK_BUFFER_READ_WRITE, "a released buffer is writable again");
    REQUIRE_OK(bulk_alloc_return_buffer(&sender_buffers, buffer), "return the released buffer");
    step = SENDER_ROUND_OVER;
}

static struct bulk_channel_callbacks sender_callbacks = {
    .pool_assigned = sender_pool_offered,
    .buffer_received = sender_got_buffer_back,
    .copy_released = sender_copy_released,
};

static void open_sender(struct waitset *ws)
{
    static struct bulk_local_endpoint endpoint;
    struct bulk_channel_bind_params params = {
        .trust = BULK_TRUST_FULL,
        .waitset = ws,
    };
    REQUIRE_OK(bulk_alloc_init(&sender_buffers, POOL_BUFFERS, BUFFER_BYTES, NULL), "make the sender's pool");
    bulk_local_init_endpoint(&endpoint, &receiver);
    REQUIRE_OK(bulk_channel_bind(&sender, &endpoint.generic, &sender_callbacks, &params,
                                 MK_BULK_CONT(sender_bound, NULL)),
               "bind the sending end");
}

/** A fresh buffer of the sender's pool, every byte `fill`. */
static struct bulk_buffer *fresh_buffer(unsigned char fill)
{
    struct bulk_buffer *buffer = bulk_alloc_new_buffer(&sender_buffers);
    REQUIRE(buffer != NULL, "the pool has a free buffer");
    REQUIRE(buffer->state == BULK_BUFFER_READ_WRITE, "a new buffer is the program's to write");
    memset(buffer->address, fill, buffer->pool->buffer_size);
    return buffer;
}

/** Does the sender's next step if it has one to do; returns whether it
 *  did (if not, it waits for an event). */
static int sender_act(void)
{
    uint32_t tag;
    switch (step) {
    case SENDER_MOVE_NEXT:
        tag = move_tag();
        step = SENDER_AWAIT_PASS;
        debug_printf("mini_scenario: sender: round %u: moving a buffer, meta %#x\n", rounds_done + 1,
                     (unsigned)tag);
        REQUIRE_OK(bulk_channel_move(&sender, fresh_buffer(MOVE_FILL), &tag,
                                     MK_BULK_CONT(count_completion, "move")),
                   "move");
        return 1;
    case SENDER_COPY_NEXT: {
        struct bulk_buffer *buffer = fresh_buffer(COPY_FILL);
        tag = copy_tag();
        step = SENDER_AWAIT_RELEASE;
        debug_printf("mini_scenario: sender: round %u: copying a buffer, meta %#x\n", rounds_done + 1,
                     (unsigned)tag);
        REQUIRE_OK(bulk_channel_copy(&sender, buffer, &tag, MK_BULK_CONT(count_completion, "copy")),
                   "copy");
        REQUIRE(buffer->state == BULK_BUFFER_RO_OWNED, "the owner of a copied buffer may only read it");
        return 1;
    }
    case SENDER_ROUND_OVER:
        rounds_done++;
        debug_printf("mini_scenario: round %u of %u complete\n", rounds_done, ROUNDS);
        step = SENDER_MOVE_NEXT;
        return 1;
    default:
        return 0;
    }
}

/** Dispatches until `completions` reaches `want`, failing if nothing
 *  happens for ten seconds. */
static void await_completions(struct waitset *ws, unsigned want)
{
    while (completions < want) {
        errval_t err = bulk_waitset_dispatch(ws, 10ll * 1000 * 1000 * 1000);
        REQUIRE(err != BULK_ERR_TIMEOUT, "the outstanding continuations run");
        REQUIRE_OK(err, "dispatch");
    }
}

int main(void)
{
    struct waitset *ws = get_default_waitset();
    REQUIRE(ws != NULL, "the default waitset");
    debug_printf("mini_scenario: process %u: two local channel ends, %u rounds\n", disp_get_domain_id(),
                 ROUNDS);
    open_receiver(ws);
    open_sender(ws);

    /* Act while there is something to do; otherwise block for the next
     * event, which is certain to come: every step waited for is an
     * answer to something already sent. */
    while (rounds_done < ROUNDS) {
        if (!sender_act()) {
            REQUIRE_OK(event_dispatch(ws), "event_dispatch");
        }
    }

    /* Each round's move, pass, copy and release ran its continuation once. */
    await_completions(ws, 4 * ROUNDS);
    while (bulk_waitset_dispatch(ws, 0) == BULK_OK) {
    }
    REQUIRE(completions == 4 * ROUNDS, "no continuation ran twice");
    REQUIRE(sender_buffers.num_free == POOL_BUFFERS, "every buffer is back in the pool");

    REQUIRE_OK(bulk_channel_destroy(&sender, MK_BULK_CONT(count_completion, "destroy the sending end")),
               "destroy the sending end");
    REQUIRE_OK(bulk_channel_destroy(&receiver, MK_BULK_CONT(count_completion, "destroy the receiving end")),
               "destroy the receiving end");
    await_completions(ws, 4 * ROUNDS + 2);
    REQUIRE_OK(bulk_alloc_free(&sender_buffers), "free the sender's allocator");

    debug_printf("mini_scenario: all %u rounds complete\n", ROUNDS);
    return 0;
}
