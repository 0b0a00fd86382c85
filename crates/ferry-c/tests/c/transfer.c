/*
 * Two processes moving data over Ferry's C interface, over shared memory
 * (sm) or TCP (net), checksummed at both ends.
 *
 *   transfer sm|net create ADDR BYTES BUFSZ TRUST MODE   (the sink, RX)
 *   transfer sm|net bind   ADDR BYTES BUFSZ TRUST MODE   (the source, TX)
 *
 * ADDR: sm: the socket path; net: create: the IP address (port 0: the
 * kernel chooses), bind: the port the creator printed. TRUST: full, half or
 * none. MODE:
 *   stream: the source assigns a pool that the sink vetoes (its
 *     continuation must get an error, and a move of one of its buffers
 *     must be refused and leave the buffer usable), then a pool the sink
 *     accepts; then it copies one buffer (RO_OWNED at the source and
 *     READ_ONLY at the sink until the sink releases it, the bytes the
 *     same), then it moves BYTES in buffers of BUFSZ, each filled with a
 *     pattern, and the sink passes each back. Both print
 *     "checksum=HEX bytes=N buffers=N"; the harness compares. Checked on
 *     the way: every continuation runs exactly once; buffers arrive in
 *     order; bufferid is the buffer's index in its pool and the same in
 *     both processes; buffer states after each step; teardown reaches the
 *     sink; every channel, endpoint, allocator and waitset is freed (the
 *     sanitizer build checks for leaks).
 *   fault-read: the source moves one buffer, then reads it: at trust NONE
 *     that must kill it by SIGSEGV/SIGBUS (after it printed
 *     "reading a moved buffer").
 *   fault-write: as fault-read, but writes (trust HALF or NONE).
 *   die: the source moves four buffers and ends its process without
 *     destroying the channel; the sink, holding them, must hear of it as a
 *     teardown and end cleanly (leaks included).
 *
 * The creator prints "listening" (net: "listening port=N") once
 * bulk_channel_create returned; the binder may be started then.
 */
#define _GNU_SOURCE
#include <unistd.h>

#include <bulk_transfer/bulk_transfer.h>
#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_sm.h>
#include <bulk_transfer/bulk_net.h>

#include "common.h"

/** Buffers of the accepted pool (moves in flight at most). */
#define WINDOW 16

struct meta {
    uint64_t seq;
    uint32_t bufferid;
    uint32_t magic;
};
#define META_MAGIC 0xfe771c0du

static int is_net;
static uint64_t total_buffers;
static size_t buffer_size;
static enum bulk_trust_level trust;
static struct waitset *ws;
static struct bulk_channel channel;

/* Continuations ---------------------------------------------------------- */

/** A continuation's record: how often it ran and with which error. */
struct done {
    unsigned runs;
    errval_t err;
};

static void done_cont(void *arg, errval_t err, struct bulk_channel *ch)
{
    struct done *d = arg;
    CHECK(ch == &channel, "continuation with channel %p, not %p", (void *)ch, (void *)&channel);
    d->runs++;
    d->err = err;
}

/** Per-transfer continuation counters (one per move or pass). */
static unsigned *cont_runs;
static errval_t *cont_errs;
static uint64_t conts_ran;

static void transfer_cont(void *arg, errval_t err, struct bulk_channel *ch)
{
    uint64_t seq = (uint64_t)(uintptr_t)arg;
    CHECK(ch == &channel, "transfer continuation with a foreign channel");
    CHECK(seq < total_buffers, "continuation arg %" PRIu64 " out of range", seq);
    cont_runs[seq]++;
    cont_errs[seq] = err;
    conts_ran++;
}

static unsigned release_runs;
static void release_cont(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    CHECK(ch == &channel, "release continuation with a foreign channel");
    CHECK(err == BULK_OK, "release: %s", bulk_strerror(err));
    release_runs++;
}

static unsigned never_ran;
static void never_cont(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    (void)ch;
    fprintf(stderr, "a refused call's continuation ran (err %s)\n", bulk_strerror(err));
    never_ran++;
}

/** The address of each bufferid as first seen, to check that ids are indices. */
static void check_index(struct bulk_buffer *b)
{
    struct bulk_pool *p = b->pool;
    CHECK(p != NULL, "buffer without a pool");
    CHECK(b->bufferid < p->num_buffers, "bufferid %u of a pool of %zu", b->bufferid, p->num_buffers);
    CHECK(p->buffers != NULL && p->buffers[b->bufferid] == b, "pool->buffers[%u] is not the buffer", b->bufferid);
    CHECK((uintptr_t)b->address == p->base_address + (uintptr_t)b->bufferid * p->buffer_size,
          "buffer %u at %p, not at base %#" PRIxPTR " + id * %zu", b->bufferid, b->address,
          p->base_address, p->buffer_size);
}

/* Sink (creator, RX) ----------------------------------------------------- */

static int sink_bound, sink_torn;
static unsigned pools_offered;
static uint64_t received;
static uint64_t sink_hash = HASH_START;
/* Buffers to pass back, oldest first (a pass may find the queue full). */
static struct bulk_buffer *to_pass[WINDOW * 4];
static struct meta to_pass_meta[WINDOW * 4];
static unsigned pass_head, pass_len;

static errval_t sink_bind_received(struct bulk_channel *ch)
{
    CHECK(ch == &channel, "bind_received on a foreign channel");
    CHECK(ch->state == BULK_STATE_CONNECTED, "bind_received in state %d", (int)ch->state);
    sink_bound++;
    return BULK_OK;
}

static errval_t sink_pool_assigned(struct bulk_channel *ch, struct bulk_pool *pool)
{
    (void)ch;
    pools_offered++;
    printf("pool offered: %zu buffers of %zu bytes, trust %d\n", pool->num_buffers, pool->buffer_size,
           (int)pool->trust);
    if (pools_offered == 1) {
        /* Any non-zero code vetoes. */
        return (errval_t)4242;
    }
    CHECK(pool->buffer_size == buffer_size, "offered pool's buffer size %zu", pool->buffer_size);
    CHECK(pool->num_buffers == WINDOW, "offered pool has %zu buffers", pool->num_buffers);
    return BULK_OK;
}

static void sink_move_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    struct meta m;
    CHECK(ch == &channel, "move_received on a foreign channel");
    CHECK(meta != NULL, "move_received without meta");
    memcpy(&m, meta, sizeof m);
    CHECK(m.magic == META_MAGIC, "meta garbled");
    CHECK(b->state == BULK_BUFFER_READ_WRITE, "received buffer in state %d", (int)b->state);
    CHECK(b->bufferid == m.bufferid, "bufferid %u here, %u at the source", b->bufferid, m.bufferid);
    check_index(b);
    CHECK(m.seq == received, "buffer %" PRIu64 " arrived as number %" PRIu64, m.seq, received);
    sink_hash = hash_fold(sink_hash, hash_bytes(b->address, b->pool->buffer_size));
    received++;
    CHECK(pass_len < sizeof to_pass / sizeof to_pass[0], "more buffers held than the pool has");
    unsigned slot = (pass_head + pass_len) % (sizeof to_pass / sizeof to_pass[0]);
    to_pass[slot] = b;
    to_pass_meta[slot] = m;
    pass_len++;
}

#define COPY_SEQ UINT64_MAX
#define COPY_SEED 0xc0c0
static unsigned sink_copies;

static void sink_copy_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    struct meta m;
    CHECK(ch == &channel, "copy_received on a foreign channel");
    CHECK(meta != NULL, "copy_received without meta");
    memcpy(&m, meta, sizeof m);
    CHECK(m.magic == META_MAGIC && m.seq == COPY_SEQ, "copy's meta garbled");
    CHECK(b->state == BULK_BUFFER_READ_ONLY, "received copy in state %d", (int)b->state);
    CHECK(b->bufferid == m.bufferid, "copy's bufferid %u here, %u at the source", b->bufferid, m.bufferid);
    check_index(b);
    void *expected = malloc(b->pool->buffer_size);
    CHECK(expected != NULL, "out of memory");
    uint64_t want = fill_pattern(expected, b->pool->buffer_size, COPY_SEED);
    free(expected);
    CHECK(hash_bytes(b->address, b->pool->buffer_size) == want, "the copy has other bytes than the source wrote");
    sink_copies++;
    EXPECT_OK(bulk_channel_release(&channel, b, MK_BULK_CONT(release_cont, NULL)));
}

static void sink_teardown_received(struct bulk_channel *ch)
{
    CHECK(ch == &channel, "teardown_received on a foreign channel");
    sink_torn++;
}

/** Passes back what was received, oldest first, until the queue is full. */
static void sink_pass_pending(void)
{
    while (pass_len > 0) {
        struct bulk_buffer *b = to_pass[pass_head];
        struct meta *m = &to_pass_meta[pass_head];
        errval_t e = bulk_channel_pass(&channel, b, m, MK_BULK_CONT(transfer_cont, (void *)(uintptr_t)m->seq));
        if (e == BULK_ERR_QUEUE_FULL) {
            return;
        }
        if (e != BULK_OK) {
            FAIL("bulk_channel_pass: %s", bulk_strerror(e));
        }
        CHECK(b->state == BULK_BUFFER_INVALID, "passed buffer in state %d", (int)b->state);
        pass_head = (pass_head + 1) % (sizeof to_pass / sizeof to_pass[0]);
        pass_len--;
    }
}

static int run_sink(const char *addr, const char *mode)
{
    struct bulk_sm_endpoint_descriptor sm_ep;
    struct bulk_net_endpoint_descriptor net_ep;
    struct bulk_endpoint_descriptor *ep;
    if (is_net) {
        struct bulk_net_ep_setup s = { .ip = addr, .port = 0 };
        EXPECT_OK(bulk_net_ep_create(&net_ep, &s));
        ep = &net_ep.ep_generic;
    } else {
        EXPECT_OK(bulk_sm_ep_create(&sm_ep, addr));
        ep = &sm_ep.ep_generic;
    }
    struct bulk_channel_callbacks cbs = {
        .bind_received = sink_bind_received,
        .teardown_received = sink_teardown_received,
        .pool_assigned = sink_pool_assigned,
        .move_received = sink_move_received,
        .copy_received = sink_copy_received,
    };
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_RX,
        .role = BULK_ROLE_GENERIC,
        .trust = trust,
        .meta_size = sizeof(struct meta),
        .waitset = ws,
    };
    EXPECT_OK(bulk_channel_create(&channel, ep, &cbs, &setup));
    CHECK(channel.state == BULK_STATE_INITIALIZED, "created channel in state %d", (int)channel.state);
    CHECK(channel.waitset == ws, "channel.waitset is not the setup's");
    if (is_net) {
        uint16_t port = bulk_net_ep_port(&net_ep);
        CHECK(port != 0, "bulk_net_ep_port after create is 0");
        printf("listening port=%u\n", (unsigned)port);
    } else {
        printf("listening\n");
    }
    fflush(stdout);

    WAIT_FOR(ws, sink_bound, "the binder");
    CHECK(sink_bound == 1, "bind_received ran %d times", sink_bound);
    uint64_t deadline = now_ns() + TEST_DEADLINE_NS;
    while (!sink_torn) {
        errval_t e = bulk_waitset_dispatch(ws, 100000000);
        if (e != BULK_OK && e != BULK_ERR_TIMEOUT) {
            FAIL("dispatch: %s", bulk_strerror(e));
        }
        if (e == BULK_OK) {
            deadline = now_ns() + TEST_DEADLINE_NS;
        } else if (now_ns() > deadline) {
            FAIL("nothing happened for a minute (%" PRIu64 " buffers received)", received);
        }
        if (strcmp(mode, "stream") == 0 && !sink_torn) {
            sink_pass_pending();
        }
    }
    CHECK(channel.state == BULK_STATE_CLOSED, "torn-down channel in state %d", (int)channel.state);
    if (strcmp(mode, "stream") == 0) {
        CHECK(received == total_buffers, "%" PRIu64 " of %" PRIu64 " buffers arrived", received, total_buffers);
        CHECK(pools_offered == 2, "%u pools offered, expected the vetoed one and the accepted one", pools_offered);
        CHECK(sink_copies == 1 && release_runs == 1, "%u copies received, %u release continuations", sink_copies,
              release_runs);
        CHECK(pass_len == 0, "%u buffers were not passed back", pass_len);
    }
    struct done destroyed = { 0, 0 };
    EXPECT_OK(bulk_channel_destroy(&channel, MK_BULK_CONT(done_cont, &destroyed)));
    WAIT_FOR(ws, destroyed.runs > 0, "the destroy continuation");
    drain(ws);
    CHECK(destroyed.runs == 1 && destroyed.err == BULK_OK, "destroy continuation ran %u times, err %s",
          destroyed.runs, bulk_strerror(destroyed.err));
    if (strcmp(mode, "stream") == 0) {
        for (uint64_t i = 0; i < total_buffers; i++) {
            CHECK(cont_runs[i] == 1, "the continuation of pass %" PRIu64 " ran %u times", i, cont_runs[i]);
            CHECK(cont_errs[i] == BULK_OK, "pass %" PRIu64 ": %s", i, bulk_strerror(cont_errs[i]));
        }
    }
    EXPECT_OK(is_net ? bulk_net_ep_destroy(&net_ep) : bulk_sm_ep_destroy(&sm_ep));
    printf("sink: checksum=%016" PRIx64 " bytes=%" PRIu64 " buffers=%" PRIu64 "\n", sink_hash,
           received * (uint64_t)buffer_size, received);
    return 0;
}

/* Source (binder, TX) ---------------------------------------------------- */

static uint64_t returned;
static uint64_t source_hash = HASH_START;
static struct bulk_allocator alloc;

static void source_buffer_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    struct meta m;
    CHECK(ch == &channel, "buffer_received on a foreign channel");
    CHECK(meta != NULL, "buffer_received without meta");
    memcpy(&m, meta, sizeof m);
    CHECK(m.magic == META_MAGIC, "meta garbled");
    CHECK(m.seq == returned, "buffer %" PRIu64 " came back as number %" PRIu64, m.seq, returned);
    CHECK(b->bufferid == m.bufferid, "bufferid %u back here, %u at the sink", b->bufferid, m.bufferid);
    CHECK(b->pool == alloc.pool, "a buffer of another pool came back");
    CHECK(b->state == BULK_BUFFER_READ_WRITE, "returned buffer in state %d", (int)b->state);
    check_index(b);
    returned++;
    EXPECT_OK(bulk_alloc_return_buffer(&alloc, b));
}

static struct bulk_buffer *copied_buffer;
static unsigned copies_released;

static void source_copy_released(struct bulk_channel *ch, struct bulk_buffer *b)
{
    CHECK(ch == &channel, "copy_released on a foreign channel");
    CHECK(b == copied_buffer, "copy_released for another buffer");
    copies_released++;
}

static void source_teardown_received(struct bulk_channel *ch)
{
    (void)ch;
    FAIL("the sink tore the channel down");
}

static int run_source(const char *addr, const char *mode)
{
    struct bulk_sm_endpoint_descriptor sm_ep;
    struct bulk_net_endpoint_descriptor net_ep;
    struct bulk_endpoint_descriptor *ep;
    if (is_net) {
        struct bulk_net_ep_setup s = { .ip = "127.0.0.1", .port = (uint16_t)atoi(addr) };
        EXPECT_OK(bulk_net_ep_create_remote(&net_ep, &s));
        ep = &net_ep.ep_generic;
    } else {
        EXPECT_OK(bulk_sm_ep_create_remote(&sm_ep, addr));
        ep = &sm_ep.ep_generic;
    }
    struct bulk_channel_callbacks cbs = {
        .buffer_received = source_buffer_received,
        .copy_released = source_copy_released,
        .teardown_received = source_teardown_received,
    };
    struct bulk_channel_bind_params params = {
        .role = BULK_ROLE_GENERIC,
        .trust = trust,
        .waitset = ws,
    };
    struct done bound = { 0, 0 };
    EXPECT_OK(bulk_channel_bind(&channel, ep, &cbs, &params, MK_BULK_CONT(done_cont, &bound)));
    WAIT_FOR(ws, bound.runs > 0, "the bind continuation");
    CHECK(bound.err == BULK_OK, "bind: %s", bulk_strerror(bound.err));
    CHECK(channel.state == BULK_STATE_CONNECTED, "bound channel in state %d", (int)channel.state);
    CHECK(channel.direction == BULK_DIRECTION_TX, "binder of an RX creator has direction %d", (int)channel.direction);
    CHECK(channel.trust == trust, "bound channel has trust %d", (int)channel.trust);
    CHECK(channel.meta_size == sizeof(struct meta), "bound channel has meta_size %zu", channel.meta_size);

    struct bulk_pool_constraints pc = { .trust = trust };
    struct bulk_allocator vetoed;
    EXPECT_OK(bulk_alloc_init(&vetoed, 2, buffer_size, &pc));
    EXPECT_OK(bulk_alloc_init(&alloc, WINDOW, buffer_size, &pc));

    /* A pool the sink vetoes. */
    struct done veto = { 0, 0 };
    EXPECT_OK(bulk_channel_assign_pool(&channel, vetoed.pool, MK_BULK_CONT(done_cont, &veto)));
    WAIT_FOR(ws, veto.runs > 0, "the continuation of the vetoed assignment");
    CHECK(veto.err != BULK_OK, "the vetoed assignment's continuation got BULK_OK");
    printf("veto: continuation err=%" PRIuPTR " (%s)\n", (uintptr_t)veto.err, bulk_strerror(veto.err));
    struct bulk_buffer *vb = bulk_alloc_new_buffer(&vetoed);
    CHECK(vb != NULL, "no buffer from the vetoed pool's allocator");
    memset(vb->address, 0x5a, vb->pool->buffer_size);
    struct meta vm = { .seq = 0, .bufferid = vb->bufferid, .magic = META_MAGIC };
    EXPECT_CODE(bulk_channel_move(&channel, vb, &vm, MK_BULK_CONT(never_cont, NULL)), BULK_ERR_POOL_NOT_ASSIGNED);
    CHECK(vb->state == BULK_BUFFER_READ_WRITE, "refused move left the buffer in state %d", (int)vb->state);
    memset(vb->address, 0xa5, vb->pool->buffer_size);
    CHECK(((unsigned char *)vb->address)[vb->pool->buffer_size - 1] == 0xa5, "buffer not writable after a refused move");
    EXPECT_OK(bulk_alloc_return_buffer(&vetoed, vb));

    /* The pool the sink accepts. */
    struct done accept = { 0, 0 };
    EXPECT_OK(bulk_channel_assign_pool(&channel, alloc.pool, MK_BULK_CONT(done_cont, &accept)));
    WAIT_FOR(ws, accept.runs > 0, "the continuation of the accepted assignment");
    CHECK(accept.err == BULK_OK, "accepted assignment: %s", bulk_strerror(accept.err));
    CHECK(alloc.pool->trust == trust, "assigned pool has trust %d", (int)alloc.pool->trust);

    if (strcmp(mode, "die") == 0) {
        for (uint64_t i = 0; i < 4; i++) {
            struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
            CHECK(b != NULL, "no buffer");
            fill_pattern(b->address, buffer_size, i);
            struct meta m = { .seq = i, .bufferid = b->bufferid, .magic = META_MAGIC };
            EXPECT_OK(bulk_channel_move(&channel, b, &m, MK_BULK_CONT(transfer_cont, (void *)(uintptr_t)i)));
        }
        WAIT_FOR(ws, conts_ran == 4, "the move continuations");
        printf("source: ending without a teardown\n");
        fflush(stdout);
        _exit(0);
    }
    if (strcmp(mode, "stream") != 0) {
        struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
        CHECK(b != NULL, "no buffer");
        fill_pattern(b->address, buffer_size, 1);
        struct meta m = { .seq = 0, .bufferid = b->bufferid, .magic = META_MAGIC };
        EXPECT_OK(bulk_channel_move(&channel, b, &m, MK_BULK_CONT(transfer_cont, (void *)(uintptr_t)0)));
        WAIT_FOR(ws, conts_ran == 1, "the move continuation");
        CHECK(b->state == BULK_BUFFER_INVALID, "moved buffer in state %d", (int)b->state);
        volatile unsigned char *p = b->address;
        if (strcmp(mode, "fault-read") == 0) {
            printf("reading a moved buffer\n");
            fflush(stdout);
            unsigned char c = p[0];
            printf("read a moved buffer without a fault: %u\n", c);
        } else {
            printf("writing a moved buffer\n");
            fflush(stdout);
            p[0] = 1;
            printf("wrote a moved buffer without a fault\n");
        }
        fflush(stdout);
        return 3;
    }

    /* A copy: read-only at both ends until the sink releases it. */
    copied_buffer = bulk_alloc_new_buffer(&alloc);
    CHECK(copied_buffer != NULL, "no buffer to copy");
    uint64_t copy_hash = fill_pattern(copied_buffer->address, buffer_size, COPY_SEED);
    struct meta cm = { .seq = COPY_SEQ, .bufferid = copied_buffer->bufferid, .magic = META_MAGIC };
    struct done copied = { 0, 0 };
    EXPECT_OK(bulk_channel_copy(&channel, copied_buffer, &cm, MK_BULK_CONT(done_cont, &copied)));
    CHECK(copied_buffer->state == BULK_BUFFER_RO_OWNED, "copied buffer in state %d at its owner",
          (int)copied_buffer->state);
    CHECK(hash_bytes(copied_buffer->address, buffer_size) == copy_hash, "the owner cannot read its copied buffer");
    WAIT_FOR(ws, copied.runs > 0 && copies_released > 0, "the copy's release");
    CHECK(copied.runs == 1 && copied.err == BULK_OK, "copy continuation: %u runs, %s", copied.runs,
          bulk_strerror(copied.err));
    CHECK(copied_buffer->state == BULK_BUFFER_READ_WRITE, "released buffer in state %d at its owner",
          (int)copied_buffer->state);
    memset(copied_buffer->address, 0, buffer_size);
    EXPECT_OK(bulk_alloc_return_buffer(&alloc, copied_buffer));

    uint64_t sent = 0;
    struct bulk_buffer *pending = NULL;
    uint64_t deadline = now_ns() + TEST_DEADLINE_NS;
    while (returned < total_buffers) {
        while (sent < total_buffers) {
            struct bulk_buffer *b = pending;
            if (b == NULL) {
                b = bulk_alloc_new_buffer(&alloc);
                if (b == NULL) {
                    break;
                }
                CHECK(b->state == BULK_BUFFER_READ_WRITE, "new buffer in state %d", (int)b->state);
                check_index(b);
                source_hash = hash_fold(source_hash, fill_pattern(b->address, buffer_size, sent));
            }
            struct meta m = { .seq = sent, .bufferid = b->bufferid, .magic = META_MAGIC };
            errval_t e = bulk_channel_move(&channel, b, &m, MK_BULK_CONT(transfer_cont, (void *)(uintptr_t)sent));
            if (e == BULK_ERR_QUEUE_FULL) {
                pending = b;
                break;
            }
            if (e != BULK_OK) {
                FAIL("bulk_channel_move of buffer %" PRIu64 ": %s", sent, bulk_strerror(e));
            }
            CHECK(b->state == BULK_BUFFER_INVALID, "moved buffer in state %d", (int)b->state);
            pending = NULL;
            sent++;
        }
        errval_t e = bulk_waitset_dispatch(ws, 100000000);
        if (e != BULK_OK && e != BULK_ERR_TIMEOUT) {
            FAIL("dispatch: %s", bulk_strerror(e));
        }
        if (e == BULK_OK) {
            deadline = now_ns() + TEST_DEADLINE_NS;
        } else if (now_ns() > deadline) {
            FAIL("nothing happened for a minute (%" PRIu64 " sent, %" PRIu64 " back)", sent, returned);
        }
    }
    WAIT_FOR(ws, conts_ran >= total_buffers, "the move continuations");
    drain(ws);
    for (uint64_t i = 0; i < total_buffers; i++) {
        CHECK(cont_runs[i] == 1, "the continuation of move %" PRIu64 " ran %u times", i, cont_runs[i]);
        CHECK(cont_errs[i] == BULK_OK, "move %" PRIu64 ": %s", i, bulk_strerror(cont_errs[i]));
    }
    CHECK(alloc.num_free == WINDOW, "%zu of %d buffers free after the transfer", alloc.num_free, WINDOW);
    printf("source: checksum=%016" PRIx64 " bytes=%" PRIu64 " buffers=%" PRIu64 "\n", source_hash,
           returned * (uint64_t)buffer_size, returned);
    fflush(stdout);

    struct done destroyed = { 0, 0 };
    EXPECT_OK(bulk_channel_destroy(&channel, MK_BULK_CONT(done_cont, &destroyed)));
    WAIT_FOR(ws, destroyed.runs > 0, "the destroy continuation");
    drain(ws);
    CHECK(destroyed.runs == 1 && destroyed.err == BULK_OK, "destroy continuation ran %u times, err %s",
          destroyed.runs, bulk_strerror(destroyed.err));
    CHECK(bound.runs == 1 && veto.runs == 1 && accept.runs == 1, "a continuation ran twice");
    CHECK(never_ran == 0, "the continuation of a refused call ran");
    for (uint64_t i = 0; i < total_buffers; i++) {
        CHECK(cont_runs[i] == 1, "the continuation of move %" PRIu64 " ran %u times", i, cont_runs[i]);
    }
    EXPECT_OK(bulk_alloc_free(&alloc));
    EXPECT_OK(bulk_alloc_free(&vetoed));
    EXPECT_OK(is_net ? bulk_net_ep_destroy(&net_ep) : bulk_sm_ep_destroy(&sm_ep));
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 8) {
        fprintf(stderr, "usage: %s sm|net create|bind ADDR BYTES BUFSZ full|half|none stream|fault-read|fault-write|die\n",
                argv[0]);
        return 2;
    }
    is_net = strcmp(argv[1], "net") == 0;
    int creator = strcmp(argv[2], "create") == 0;
    const char *addr = argv[3];
    uint64_t bytes = strtoull(argv[4], NULL, 0);
    buffer_size = (size_t)strtoull(argv[5], NULL, 0);
    trust = strcmp(argv[6], "none") == 0   ? BULK_TRUST_NONE
            : strcmp(argv[6], "half") == 0 ? BULK_TRUST_HALF
                                           : BULK_TRUST_FULL;
    const char *mode = argv[7];
    CHECK(buffer_size >= 4096 && bytes >= buffer_size, "bad sizes");
    total_buffers = strcmp(mode, "stream") == 0 ? bytes / buffer_size : strcmp(mode, "die") == 0 ? 4 : 1;
    cont_runs = calloc(total_buffers, sizeof *cont_runs);
    cont_errs = calloc(total_buffers, sizeof *cont_errs);
    CHECK(cont_runs != NULL && cont_errs != NULL, "out of memory");

    EXPECT_OK(bulk_waitset_create(&ws));
    int rc = creator ? run_sink(addr, mode) : run_source(addr, mode);
    drain(ws);
    EXPECT_OK(bulk_waitset_destroy(ws));
    free(cont_runs);
    free(cont_errs);
    return rc;
}
