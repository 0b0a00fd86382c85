/*
 * A sink process that leaves in the middle of a stream, holding buffers.
 *
 *   sink_leaves
 *
 * The source (this process) moves buffers from its own loop as fast as it
 * can; the sink (a child process, forked before the library is used) keeps
 * the first KEEP buffers it receives and passes every other one back.
 * After MOVES moves the sink destroys its channel while the source is still
 * moving, dispatches a little longer, and exits with the KEEP buffers in
 * its hands. Checked at the source:
 *
 *  - every move returns OK or, once the sink is gone, that the channel is
 *    closed; a refused buffer goes back to the allocator;
 *  - the teardown reaches it, and the sink exits cleanly;
 *  - then every buffer of the pool can be allocated again: those the sink
 *    held, and those in flight to it when it left, come back once its
 *    process has exited.
 *
 * Over shared memory only: a TCP peer's process cannot be watched, and what
 * it held or was sent when it closed stays lost to the source (see "When a
 * peer process dies" in docs/SEMANTICS.md).
 *
 * Ends with "sink_leaves: ok"; under the sanitizers nothing leaks.
 */
#define _GNU_SOURCE
#include "common.h"

#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_sm.h>

#include <sys/wait.h>
#include <unistd.h>

#define COUNT 32
#define KEEP 5
#define MOVES 2000

static struct bulk_channel channel;
static struct bulk_allocator alloc;
static int bound, pool_ok, torn_down;
static unsigned long received;

/* Sink ------------------------------------------------------------------------ */

static void sink_move_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    if (++received <= KEEP) {
        return; /* held until the process exits */
    }
    EXPECT_OK(bulk_channel_pass(ch, b, meta, BULK_CONT_NOP));
}

static void sink_bound(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    (void)ch;
    if (err != BULK_OK) {
        FATAL("sink: bind: %s", bulk_strerror(err));
    }
}

/** The child: binds to `ep`, takes MOVES moves, destroys its end, leaves. */
static void sink(struct bulk_endpoint_descriptor *ep)
{
    struct waitset *ws;
    EXPECT_OK(bulk_waitset_create(&ws));
    static struct bulk_channel_callbacks cbs = { .move_received = sink_move_received };
    struct bulk_channel_bind_params params = { .role = BULK_ROLE_GENERIC, .trust = BULK_TRUST_FULL, .waitset = ws };
    EXPECT_OK(bulk_channel_bind(&channel, ep, &cbs, &params, MK_BULK_CONT(sink_bound, NULL)));
    WAIT_FOR(ws, received >= MOVES, "the sink's moves");
    EXPECT_OK(bulk_channel_destroy(&channel, BULK_CONT_NOP));
    /* A little dispatching, as a program's loop does after a destroy. */
    for (int i = 0; i < 50; i++) {
        errval_t e = bulk_waitset_dispatch(ws, 1000000);
        CHECK(e == BULK_OK || e == BULK_ERR_TIMEOUT, "sink: dispatch: %s", bulk_strerror(e));
    }
    /* Leaves with KEEP buffers in its hands (and its waitset: the process ends). */
    fflush(stdout);
    _exit(0);
}

/* Source ---------------------------------------------------------------------- */

static errval_t source_bind_received(struct bulk_channel *ch)
{
    (void)ch;
    bound = 1;
    return BULK_OK;
}

static void source_buffer_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)ch;
    (void)meta;
    EXPECT_OK(bulk_alloc_return_buffer(&alloc, b));
}

static void source_teardown(struct bulk_channel *ch)
{
    (void)ch;
    torn_down = 1;
}

static void pool_done(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    (void)ch;
    if (err != BULK_OK) {
        FATAL("assign the pool: %s", bulk_strerror(err));
    }
    pool_ok = 1;
}

int main(void)
{
    char path[108];
    snprintf(path, sizeof path, "/tmp/ferry-c-sink-leaves-%d.sock", (int)getpid());
    /* The child binds once the source listens (a byte on the pipe). */
    int ready[2];
    if (pipe(ready) != 0) {
        FATAL("pipe");
    }
    fflush(stdout);
    pid_t child = fork();
    if (child < 0) {
        FATAL("fork");
    }
    if (child == 0) {
        close(ready[1]);
        char c;
        if (read(ready[0], &c, 1) != 1) {
            _exit(1);
        }
        struct bulk_sm_endpoint_descriptor ep;
        EXPECT_OK(bulk_sm_ep_create_remote(&ep, path));
        sink(&ep.ep_generic);
    }
    close(ready[0]);

    struct waitset *ws;
    EXPECT_OK(bulk_waitset_create(&ws));
    static struct bulk_channel_callbacks cbs = {
        .bind_received = source_bind_received,
        .buffer_received = source_buffer_received,
        .teardown_received = source_teardown,
    };
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_TX,
        .role = BULK_ROLE_MASTER,
        .trust = BULK_TRUST_FULL,
        .meta_size = 8,
        .waitset = ws,
    };
    struct bulk_sm_endpoint_descriptor ep;
    EXPECT_OK(bulk_sm_ep_create(&ep, path));
    EXPECT_OK(bulk_channel_create(&channel, &ep.ep_generic, &cbs, &setup));
    if (write(ready[1], "x", 1) != 1) {
        FATAL("cannot tell the sink to bind");
    }
    close(ready[1]);
    WAIT_FOR(ws, bound, "the sink's bind");
    struct bulk_pool_constraints pc = { .trust = BULK_TRUST_FULL };
    EXPECT_OK(bulk_alloc_init(&alloc, COUNT, 4096, &pc));
    EXPECT_OK(bulk_channel_assign_pool(&channel, alloc.pool, MK_BULK_CONT(pool_done, NULL)));
    WAIT_FOR(ws, pool_ok, "the pool's assignment");

    /* Move from the loop until the sink has gone. */
    unsigned long sent = 0, refused = 0;
    uint64_t deadline = now_ns() + TEST_DEADLINE_NS;
    while (!torn_down) {
        if (now_ns() > deadline) {
            FATAL("no teardown within the deadline (%lu moves made)", sent);
        }
        struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
        if (b != NULL) {
            uint64_t meta = sent;
            errval_t e = bulk_channel_move(&channel, b, &meta, BULK_CONT_NOP);
            if (e == BULK_OK) {
                sent++;
            } else {
                CHECK(e == BULK_ERR_QUEUE_FULL || e == BULK_ERR_CHANNEL_CLOSED || e == BULK_ERR_PEER_GONE,
                      "a move while the sink leaves: %s", bulk_strerror(e));
                EXPECT_OK(bulk_alloc_return_buffer(&alloc, b));
                refused += e != BULK_ERR_QUEUE_FULL;
            }
        }
        errval_t e = bulk_waitset_dispatch(ws, 0);
        CHECK(e == BULK_OK || e == BULK_ERR_TIMEOUT, "dispatch: %s", bulk_strerror(e));
    }
    int status = 0;
    CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "the sink did not end cleanly (status %d)", status);
    CHECK(sent >= MOVES, "only %lu moves made", sent);

    /* What can be allocated now (an allocation that finds the pool empty
     * looks at the processes that held its buffers). */
    struct bulk_buffer *all[COUNT];
    size_t got = 0;
    while (got < COUNT && (all[got] = bulk_alloc_new_buffer(&alloc)) != NULL) {
        got++;
    }
    CHECK(got == COUNT, "%zu of %d buffers can be allocated after the sink left", got, COUNT);
    for (size_t i = 0; i < got; i++) {
        EXPECT_OK(bulk_alloc_return_buffer(&alloc, all[i]));
    }

    EXPECT_OK(bulk_channel_destroy(&channel, BULK_CONT_NOP));
    drain(ws);
    EXPECT_OK(bulk_alloc_free(&alloc));
    EXPECT_OK(bulk_waitset_destroy(ws));
    EXPECT_OK(bulk_sm_ep_destroy(&ep));
    unlink(path);
    printf("sink_leaves: ok (%lu moves, %lu refused once the sink had gone, %zu buffers back)\n", sent, refused, got);
    return 0;
}
