/*
 * shm_scenario: two processes ("agents") joined by a shared-memory channel,
 * going through the scenario of "bulk_shm", the shared-memory test program
 * among the bulk-transfer test programs of the Barrelfish operating system,
 * with its test numbers 0 to 6 and their meaning.
 *
 * This is an independent program written for Ferry's tests, not a copy of
 * that one: it reproduces its scenario through the same interface (the
 * bulk_* calls and callbacks, the default waitset and its blocking
 * dispatch loop, and the names of <bulk_transfer/barrelfish_compat.h>).
 * Where the original found its peer through its operating system's name
 * service, the agents here meet at the Unix socket path named by the
 * environment variable SHM_SCENARIO_SOCKET.
 *
 * Usage: SHM_SCENARIO_SOCKET=PATH shm_scenario AGENT TEST
 * Agent 1 creates the channel (the source: TX) and prints
 * "agent 1: channel created; waiting for agent 2" once agent 2 can bind;
 * agent 2 then binds to it. The exchange:
 *   1. agent 2 offers a pool and passes one of its buffers to agent 1;
 *   2. agent 1 writes a text into it and moves it back; agent 2 checks the
 *      text and overwrites the buffer, which is its own again;
 *   3. agent 1 offers a pool of its own and copies a filled buffer to
 *      agent 2, which checks it and releases it; agent 1 then writes to
 *      that buffer again.
 * The channel's trust is FULL in test 0 and NONE in every other test.
 *   0, 1  the exchange runs to its end; both agents exit with status 0;
 *   2     agent 2 reads the buffer it passed: it must fault;
 *   3     agent 1 reads the buffer it moved: it must fault (agent 2 exits
 *         with status 0 once the buffer arrived);
 *   4     agent 1 writes the buffer it copied out: it must fault;
 *   5     agent 2 writes the copy it received: it must fault;
 *   6     agent 2 reads the copy it released: it must fault (agent 1 exits
 *         with status 0 once the copy came back).
 * Before an access that must fault an agent prints
 * "agent N, test T: ...; this access must fault"; should it survive the
 * access it prints "agent N, test T: FAILED: no fault" and aborts. In tests
 * 2, 4 and 5 the other agent serves the channel until it is killed.
 */
#include <bulk_transfer/barrelfish_compat.h>
#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_sm.h>
#include <bulk_transfer/bulk_transfer.h>

#include <stdarg.h>
#include <stdint.h>

/** The text agent 1 writes into the buffer agent 2 passed to it. */
static const char GREETING[] = "Ferry shm scenario: moved text, 0123456789";
/** What agent 1 writes into the buffer it copies, and after the release. */
#define COPY_FILL 0x21
#define REWRITE_FILL 0x22
/** Each agent's pool. */
#define POOL_BUFFERS 5u
#define BUFFER_BYTES 4096u

/** Things an agent waits for, one bit each. */
enum milestone {
    BOUND = 1u << 0,           /* agent 2: its bind completed */
    POOL_ACCEPTED = 1u << 1,   /* the peer accepted our pool */
    PASS_DONE = 1u << 2,       /* agent 2: its pass completed */
    BUFFER_ARRIVED = 1u << 3,  /* agent 1: the passed buffer is here */
    MOVE_DONE = 1u << 4,       /* agent 1: its move completed */
    MOVE_ARRIVED = 1u << 5,    /* agent 2: the moved buffer is here */
    COPY_DONE = 1u << 6,       /* agent 1: its copy completed */
    COPY_ARRIVED = 1u << 7,    /* agent 2: the copy is here */
    RELEASE_DONE = 1u << 8,    /* agent 2: its release completed */
    COPY_RETURNED = 1u << 9,   /* agent 1: agent 2 released the copy */
};

static volatile unsigned reached;
static int agent;
static int test;
static struct bulk_channel channel;
static struct bulk_allocator buffers;
/** The buffer each callback handed over last. */
static struct bulk_buffer *passed_in;
static struct bulk_buffer *moved_in;
static struct bulk_buffer *copy_in;

/** debug_printf, the line prefixed with "agent N: ". */
static void say(const char *format, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *format, ...)
{
    char line[512];
    va_list args;
    va_start(args, format);
    vsnprintf(line, sizeof line, format, args);
    va_end(args);
    debug_printf("agent %d: %s", agent, line);
}

/** Ends the agent with a message if `cond` does not hold. */
#define REQUIRE(cond, what)                                                \
    do {                                                                   \
        if (!(cond)) {                                                     \
            debug_printf("agent %d: CHECK FAILED: %s (%s, line %d)\n",     \
                         agent, (what), #cond, __LINE__);                  \
            abort();                                                       \
        }                                                                  \
    } while (0)

/** Ends the agent with the error if `expr` fails. */
#define REQUIRE_OK(expr, what)                                             \
    do {                                                                   \
        errval_t require_err_ = (expr);                                    \
        if (err_is_fail(require_err_)) {                                   \
            USER_PANIC_ERR(require_err_, "agent %d: %s failed", agent, (what)); \
        }                                                                  \
    } while (0)

/** Dispatches the default waitset until `milestone` is reached. */
static void await(unsigned milestone, const char *what)
{
    struct waitset *ws = get_default_waitset();
    while (!(reached & milestone)) {
        errval_t err = event_dispatch(ws);
        if (err_is_fail(err)) {
            USER_PANIC_ERR(err, "agent %d: dispatch while waiting for %s", agent, what);
        }
    }
}

/** The other agent is about to fault: keep its channel served (it may be
 *  waiting for an answer from us) until this agent is killed. Once the
 *  other agent is gone dispatch says nothing can happen any more; then the
 *  agent just waits for its signal. */
static _Noreturn void serve_until_killed(void)
{
    say("test %d is the other agent's to fail; serving the channel until stopped\n", test);
    for (;;) {
        errval_t err = event_dispatch(channel.waitset);
        if (err_is_fail(err)) {
            DEBUG_ERR(err, "agent %d: nothing left to serve", agent);
            for (;;) {
                pause();
            }
        }
    }
}

/** Touches `where`, which must fault; returns only to abort. */
static _Noreturn void must_fault(const char *what, volatile char *where, int write)
{
    say("test %d: %s; this access must fault\n", test, what);
    if (write) {
        *where = 'x';
    } else {
        char seen = *where;
        say("test %d: read %d\n", test, seen);
    }
    say("test %d: FAILED: no fault\n", test);
    abort();
}

/** Gives the other agent time to act while this one is in a state it
 *  might test. */
static void let_peer_run(void)
{
    for (int i = 0; i < 5000; i++) {
        thread_yield();
    }
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

/** The continuation of every call: it must succeed; `arg` is the
 *  milestone it marks. */
static void mark_done(void *arg, errval_t err, struct bulk_channel *ch)
{
    unsigned milestone = (unsigned)(uintptr_t)arg;
    say("continuation %#x: %s\n", milestone, err_getstring(err));
    REQUIRE(ch == &channel, "a continuation names our channel");
    REQUIRE_OK(err, "an asynchronous call");
    reached |= milestone;
}

#define MARK(milestone) MK_BULK_CONT(mark_done, (void *)(uintptr_t)(milestone))

static errval_t accept_pool(struct bulk_channel *ch, struct bulk_pool *pool)
{
    REQUIRE(ch == &channel, "pool_assigned names our channel");
    say("accepting the other agent's pool of %zu buffers\n", pool->num_buffers);
    return SYS_ERR_OK;
}

static void peer_left(struct bulk_channel *ch)
{
    (void)ch;
    say("the other agent left\n");
}

/** Makes this agent's pool, with the channel's trust from the start, and
 *  offers it to the other agent. */
static void offer_pool(void)
{
    struct bulk_pool_constraints constraints = { .trust = channel.trust };
    REQUIRE_OK(bulk_alloc_init(&buffers, POOL_BUFFERS, BUFFER_BYTES, &constraints), "bulk_alloc_init");
    say("offering a pool\n");
    REQUIRE_OK(bulk_channel_assign_pool(&channel, buffers.pool, MARK(POOL_ACCEPTED)),
               "bulk_channel_assign_pool");
    await(POOL_ACCEPTED, "the pool's acceptance");
}

/* --- agent 1: creates the channel, the source ------------------------- */

static void agent1_buffer_arrived(struct bulk_channel *ch, struct bulk_buffer *buffer, void *meta)
{
    (void)meta;
    REQUIRE(ch == &channel, "buffer_received names our channel");
    say("buffer %u passed in\n", (unsigned)buffer->bufferid);
    passed_in = buffer;
    reached |= BUFFER_ARRIVED;
}

static void agent1_copy_returned(struct bulk_channel *ch, struct bulk_buffer *buffer)
{
    REQUIRE(ch == &channel, "copy_released names our channel");
    say("copy of buffer %u released\n", (unsigned)buffer->bufferid);
    reached |= COPY_RETURNED;
}

static struct bulk_channel_callbacks agent1_callbacks = {
    .teardown_received = peer_left,
    .pool_assigned = accept_pool,
    .buffer_received = agent1_buffer_arrived,
    .copy_released = agent1_copy_returned,
};

static void run_agent1(const char *path, enum bulk_trust_level trust)
{
    struct bulk_sm_endpoint_descriptor endpoint;
    REQUIRE_OK(bulk_sm_ep_create(&endpoint, path), "bulk_sm_ep_create");
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_TX,
        .role = BULK_ROLE_SLAVE,
        .trust = trust,
        .waitset = get_default_waitset(),
    };
    REQUIRE_OK(bulk_channel_create(&channel, (struct bulk_endpoint_descriptor *)&endpoint, &agent1_callbacks,
                                   &setup),
               "bulk_channel_create");
    say("channel created; waiting for agent 2\n");

    /* 1. The buffer agent 2 passes. */
    await(BUFFER_ARRIVED, "the passed buffer");
    if (test == 2) {
        serve_until_killed();
    }

    /* 2. Write the text and move the buffer back. */
    REQUIRE(passed_in->state == BULK_BUFFER_READ_WRITE, "a passed-in buffer is ours to write");
    memcpy(passed_in->address, GREETING, sizeof GREETING);
    say("wrote \"%s\"\n", (const char *)passed_in->address);
    let_peer_run();
    say("moving the buffer to agent 2\n");
    REQUIRE_OK(bulk_channel_move(&channel, passed_in, NULL, MARK(MOVE_DONE)), "bulk_channel_move");
    await(MOVE_DONE, "the move");
    if (test == 3) {
        must_fault("reading the buffer it moved", passed_in->address, 0);
    }

    /* 3. A pool of our own; copy a filled buffer out. */
    offer_pool();
    struct bulk_buffer *buffer = bulk_alloc_new_buffer(&buffers);
    REQUIRE(buffer != NULL, "a free buffer in our pool");
    memset(buffer->address, COPY_FILL, buffer->pool->buffer_size);
    say("copying buffer %u to agent 2\n", (unsigned)buffer->bufferid);
    REQUIRE_OK(bulk_channel_copy(&channel, buffer, NULL, MARK(COPY_DONE)), "bulk_channel_copy");
    await(COPY_DONE, "the copy");
    REQUIRE(buffer->state == BULK_BUFFER_RO_OWNED, "a buffer with a copy out is read-only to its owner");
    REQUIRE(filled_with(buffer, COPY_FILL), "a buffer with a copy out stays readable");
    say("the copied buffer is still readable\n");
    if (test == 4) {
        must_fault("writing the buffer it copied out", buffer->address, 1);
    }
    if (test == 5) {
        serve_until_killed();
    }

    /* Once the copy is released the buffer is ours to write again. */
    await(COPY_RETURNED, "the copy's release");
    REQUIRE(buffer->state == BULK_BUFFER_READ_WRITE, "a released buffer is ours to write again");
    memset(buffer->address, REWRITE_FILL, buffer->pool->buffer_size);
    REQUIRE(filled_with(buffer, REWRITE_FILL), "the rewritten buffer");
    say("copied buffer writable again after the release\n");
    say("finished\n");
}

/* --- agent 2: binds to the channel, the sink -------------------------- */

static void agent2_move_arrived(struct bulk_channel *ch, struct bulk_buffer *buffer, void *meta)
{
    (void)meta;
    REQUIRE(ch == &channel, "move_received names our channel");
    say("buffer %u moved in\n", (unsigned)buffer->bufferid);
    moved_in = buffer;
    reached |= MOVE_ARRIVED;
}

static void agent2_copy_arrived(struct bulk_channel *ch, struct bulk_buffer *buffer, void *meta)
{
    (void)meta;
    REQUIRE(ch == &channel, "copy_received names our channel");
    say("copy of buffer %u in\n", (unsigned)buffer->bufferid);
    copy_in = buffer;
    reached |= COPY_ARRIVED;
}

static struct bulk_channel_callbacks agent2_callbacks = {
    .teardown_received = peer_left,
    .pool_assigned = accept_pool,
    .move_received = agent2_move_arrived,
    .copy_received = agent2_copy_arrived,
};

static void run_agent2(const char *path, enum bulk_trust_level trust)
{
    struct bulk_sm_endpoint_descriptor endpoint;
    REQUIRE_OK(bulk_sm_ep_create_remote(&endpoint, path), "bulk_sm_ep_create_remote");
    struct bulk_channel_bind_params params = {
        .role = BULK_ROLE_MASTER,
        .trust = trust,
        .waitset = get_default_waitset(),
    };
    say("binding\n");
    REQUIRE_OK(bulk_channel_bind(&channel, (struct bulk_endpoint_descriptor *)&endpoint, &agent2_callbacks,
                                 &params, MARK(BOUND)),
               "bulk_channel_bind");
    await(BOUND, "the bind");
    REQUIRE(channel.direction == BULK_DIRECTION_RX, "the binder of a TX channel receives");
    REQUIRE(channel.trust == trust, "the bound channel's trust");

    /* 1. Offer a pool and pass one of its buffers to agent 1. */
    offer_pool();
    struct bulk_buffer *buffer = bulk_alloc_new_buffer(&buffers);
    REQUIRE(buffer != NULL, "a free buffer in our pool");
    say("passing buffer %u to agent 1\n", (unsigned)buffer->bufferid);
    REQUIRE_OK(bulk_channel_pass(&channel, buffer, NULL, MARK(PASS_DONE)), "bulk_channel_pass");
    await(PASS_DONE, "the pass");
    if (test == 2) {
        must_fault("reading the buffer it passed", buffer->address, 0);
    }

    /* 2. The buffer comes back with agent 1's text; it is ours again. */
    await(MOVE_ARRIVED, "the moved buffer");
    if (test == 3) {
        say("test 3 leaves the fault to agent 1; exiting\n");
        return;
    }
    REQUIRE(moved_in->bufferid == buffer->bufferid, "the moved buffer is the one we passed");
    REQUIRE(moved_in->state == BULK_BUFFER_READ_WRITE, "a moved-in buffer is ours to write");
    say("moved buffer reads \"%s\"\n", (const char *)moved_in->address);
    REQUIRE(memcmp(moved_in->address, GREETING, sizeof GREETING) == 0, "the moved text");
    say("moved data verified\n");
    memset(moved_in->address, 0, moved_in->pool->buffer_size);
    say("moved buffer overwritten\n");

    /* 3. A read-only copy arrives; check it and release it. */
    await(COPY_ARRIVED, "the copy");
    if (test == 4) {
        serve_until_killed();
    }
    REQUIRE(copy_in->state == BULK_BUFFER_READ_ONLY, "a received copy is read-only");
    REQUIRE(filled_with(copy_in, COPY_FILL), "the copy's contents");
    say("copied data verified\n");
    if (test == 5) {
        must_fault("writing the copy it received", copy_in->address, 1);
    }
    let_peer_run();
    say("releasing the copy\n");
    REQUIRE_OK(bulk_channel_release(&channel, copy_in, MARK(RELEASE_DONE)), "bulk_channel_release");
    await(RELEASE_DONE, "the release");
    if (test == 6) {
        must_fault("reading the copy it released", copy_in->address, 0);
    }
    say("finished\n");
}

static int usage(const char *program)
{
    fprintf(stderr,
            "usage: SHM_SCENARIO_SOCKET=PATH %s AGENT TEST\n"
            "  AGENT 1 creates the channel at PATH, AGENT 2 binds to it;\n"
            "  TEST 0 to 6 (see the head of shm_scenario.c)\n",
            program);
    return 2;
}

/** `text` as a whole number from `min` to `max`, or -1. */
static int parse_number(const char *text, int min, int max)
{
    char *end;
    long value = strtol(text, &end, 10);
    if (end == text || *end != '\0' || value < min || value > max) {
        return -1;
    }
    return (int)value;
}

int main(int argc, char *argv[])
{
    const char *path = getenv("SHM_SCENARIO_SOCKET");
    if (argc != 3 || path == NULL || path[0] == '\0') {
        return usage(argv[0]);
    }
    agent = parse_number(argv[1], 1, 2);
    test = parse_number(argv[2], 0, 6);
    if (agent < 0 || test < 0) {
        return usage(argv[0]);
    }
    enum bulk_trust_level trust = test == 0 ? BULK_TRUST_FULL : BULK_TRUST_NONE;
    say("process %u, test %d, trust %s\n", disp_get_domain_id(), test, test == 0 ? "FULL" : "NONE");
    if (agent == 1) {
        run_agent1(path, trust);
    } else {
        run_agent2(path, trust);
    }
    return 0;
}
