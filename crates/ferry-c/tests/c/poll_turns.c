/*
 * Every channel of a waitset gets its turn (docs/C-API.md, "The waitset"):
 * a channel whose callbacks always send (an echo that passes every buffer
 * back, its passes held back for batching) does not keep another channel
 * of the same waitset waiting while it has more to deliver.
 *
 * One thread, one waitset, two local channels, both ends of each on the
 * waitset: A (its echo passes every buffer back from move_received) and B
 * (its echo keeps what it gets). The source of A moves A_MOVES buffers,
 * A's echo takes the first, then the source of B moves one. The echo of B
 * must get its buffer after at most MAX_BEFORE_B callbacks of A's echo,
 * not after all of them; then every buffer comes back to A's source.
 * Prints "poll_turns: ok".
 */
#define _GNU_SOURCE
#include "common.h"

#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_local.h>

#define A_MOVES 16
/* With the rotation of polls, A's echo runs at most three times before B's. */
#define MAX_BEFORE_B 3
#define META_SIZE 8

struct pair {
    struct bulk_channel source, echo;
    struct bulk_allocator alloc;
    struct bulk_local_endpoint ep, remote;
    int bound, pool_ok;
};

static struct pair a, b;
static unsigned a_echoed, a_back, b_got, a_echoed_before_b = ~0u;

static void a_echo_move(struct bulk_channel *ch, struct bulk_buffer *buf, void *meta)
{
    a_echoed++;
    EXPECT_OK(bulk_channel_pass(ch, buf, meta, BULK_CONT_NOP));
}

static void a_source_back(struct bulk_channel *ch, struct bulk_buffer *buf, void *meta)
{
    (void)ch;
    (void)meta;
    a_back++;
    EXPECT_OK(bulk_alloc_return_buffer(&a.alloc, buf));
}

static void b_echo_move(struct bulk_channel *ch, struct bulk_buffer *buf, void *meta)
{
    (void)ch;
    (void)buf;
    (void)meta;
    if (b_got++ == 0) {
        a_echoed_before_b = a_echoed;
    }
}

static errval_t source_bound(struct bulk_channel *ch)
{
    (ch == &a.source ? &a : &b)->bound = 1;
    return BULK_OK;
}

static void pool_assigned(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    if (err != BULK_OK) {
        FATAL("assign: %s", bulk_strerror(err));
    }
    (ch == &a.source ? &a : &b)->pool_ok = 1;
}

static struct bulk_channel_callbacks a_source_cbs = { .bind_received = source_bound, .buffer_received = a_source_back };
static struct bulk_channel_callbacks a_echo_cbs = { .move_received = a_echo_move };
static struct bulk_channel_callbacks b_source_cbs = { .bind_received = source_bound };
static struct bulk_channel_callbacks b_echo_cbs = { .move_received = b_echo_move };

/** Connects the pair's two ends on `ws` and assigns it a pool of `count`. */
static void connect_pair(struct pair *p, struct waitset *ws, struct bulk_channel_callbacks *source_cbs,
                         struct bulk_channel_callbacks *echo_cbs, size_t count)
{
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_TX, .role = BULK_ROLE_MASTER, .trust = BULK_TRUST_FULL,
        .meta_size = META_SIZE, .waitset = ws,
    };
    struct bulk_channel_bind_params params = { .role = BULK_ROLE_GENERIC, .trust = BULK_TRUST_FULL, .waitset = ws };
    bulk_local_init_endpoint(&p->ep, NULL);
    EXPECT_OK(bulk_channel_create(&p->source, &p->ep.generic, source_cbs, &setup));
    bulk_local_init_endpoint(&p->remote, &p->source);
    EXPECT_OK(bulk_channel_bind(&p->echo, &p->remote.generic, echo_cbs, &params, BULK_CONT_NOP));
    WAIT_FOR(ws, p->bound, "the bind");
    struct bulk_pool_constraints pc = { .trust = BULK_TRUST_FULL };
    EXPECT_OK(bulk_alloc_init(&p->alloc, count, 4096, &pc));
    EXPECT_OK(bulk_channel_assign_pool(&p->source, p->alloc.pool, MK_BULK_CONT(pool_assigned, NULL)));
    WAIT_FOR(ws, p->pool_ok, "the pool");
}

static void move_one(struct pair *p, uint64_t tag)
{
    struct bulk_buffer *buf = bulk_alloc_new_buffer(&p->alloc);
    CHECK(buf != NULL, "no buffer left");
    EXPECT_OK(bulk_channel_move(&p->source, buf, &tag, BULK_CONT_NOP));
}

int main(void)
{
    struct waitset *ws;
    EXPECT_OK(bulk_waitset_create(&ws));
    connect_pair(&a, ws, &a_source_cbs, &a_echo_cbs, A_MOVES);
    connect_pair(&b, ws, &b_source_cbs, &b_echo_cbs, 1);
    drain(ws);

    for (uint64_t i = 0; i < A_MOVES; i++) {
        move_one(&a, i);
    }
    /* A's echo first (nothing else is due), then B's move comes. */
    WAIT_FOR(ws, a_echoed == 1, "A's first move");
    move_one(&b, 0);
    WAIT_FOR(ws, b_got == 1, "B's move");
    CHECK(a_echoed_before_b <= MAX_BEFORE_B, "B's echo waited for %u of A's %d callbacks", a_echoed_before_b,
          A_MOVES);
    WAIT_FOR(ws, a_back == A_MOVES, "A's buffers back");
    CHECK(a_echoed == A_MOVES, "A's echo ran %u times", a_echoed);

    EXPECT_OK(bulk_channel_destroy(&a.echo, BULK_CONT_NOP));
    EXPECT_OK(bulk_channel_destroy(&a.source, BULK_CONT_NOP));
    EXPECT_OK(bulk_channel_destroy(&b.echo, BULK_CONT_NOP));
    EXPECT_OK(bulk_channel_destroy(&b.source, BULK_CONT_NOP));
    drain(ws);
    EXPECT_OK(bulk_alloc_free(&a.alloc));
    EXPECT_OK(bulk_alloc_free(&b.alloc));
    EXPECT_OK(bulk_waitset_destroy(ws));
    printf("poll_turns: ok (A's echo ran %u times before B's)\n", a_echoed_before_b);
    return 0;
}
