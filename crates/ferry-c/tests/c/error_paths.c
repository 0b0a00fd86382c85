/*
 * Every error path of Ferry's C interface, one call each: the returned code,
 * and that the call changed nothing (the channel's state, the allocator's
 * count, the buffer's state, and the buffer still usable: written and later
 * moved for real). A refused call's continuation never runs; an accepted
 * call's runs exactly once. Also: buffer states after a copy (RO_OWNED at
 * the owner, READ_ONLY at the receiver), a veto, destroy in every state,
 * calls on a destroyed channel, and a non-empty sentence from bulk_strerror
 * for every code.
 *
 * One process, local channels at trust HALF (a write to a buffer the
 * program does not own would fault, so "still usable" is checked by the
 * page protections too).
 */
#define _GNU_SOURCE
#define SOFT_CHECKS
#include <bulk_transfer/bulk_transfer.h>
#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_local.h>
#include <bulk_transfer/bulk_sm.h>
#include <bulk_transfer/bulk_net.h>

#include <dirent.h>
#include <unistd.h>

#include "common.h"

static struct waitset *ws;
static struct bulk_channel rx, tx;

/* How often the continuations ran. */
static unsigned never_ran;
static void never_cont(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)ch;
    fprintf(stderr, "continuation of a refused call ran (arg %p, err %s)\n", arg, bulk_strerror(err));
    never_ran++;
}
#define NEVER MK_BULK_CONT(never_cont, NULL)

struct done {
    unsigned runs;
    errval_t err;
    struct bulk_channel *channel;
};
static void done_cont(void *arg, errval_t err, struct bulk_channel *ch)
{
    struct done *d = arg;
    d->runs++;
    d->err = err;
    d->channel = ch;
}
#define DONE(d) MK_BULK_CONT(done_cont, &(d))

/* Callbacks of rx (the sink) and tx (the source). */
static unsigned rx_bound, rx_teardown, tx_teardown;
static struct bulk_pool *veto_pool;
static struct bulk_buffer *rx_moved, *rx_copy, *tx_back, *tx_released;
static unsigned rx_moves, rx_copies, tx_backs, tx_releases;

static errval_t rx_bind_received(struct bulk_channel *ch)
{
    CHECK(ch == &rx, "bind_received on a foreign channel");
    rx_bound++;
    return BULK_OK;
}
static errval_t rx_pool_assigned(struct bulk_channel *ch, struct bulk_pool *pool)
{
    (void)ch;
    if (veto_pool != NULL && pool->id.local == veto_pool->id.local && pool->id.dom == veto_pool->id.dom &&
        pool->id.machine == veto_pool->id.machine && pool->id.tag == veto_pool->id.tag) {
        return BULK_ERR_INVALID_ARGUMENT;
    }
    return BULK_OK;
}
static void rx_move_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)ch;
    (void)meta;
    rx_moved = b;
    rx_moves++;
}
static void rx_copy_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)ch;
    (void)meta;
    rx_copy = b;
    rx_copies++;
}
static unsigned rx_pools_removed;
static errval_t rx_pool_removed(struct bulk_channel *ch, struct bulk_pool *pool)
{
    (void)pool;
    CHECK(ch == &rx, "pool_removed on a foreign channel");
    rx_pools_removed++;
    return BULK_OK;
}
static void rx_teardown_received(struct bulk_channel *ch)
{
    CHECK(ch == &rx, "teardown_received on a foreign channel");
    rx_teardown++;
}
static void tx_buffer_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)ch;
    (void)meta;
    tx_back = b;
    tx_backs++;
}
static void tx_copy_released(struct bulk_channel *ch, struct bulk_buffer *b)
{
    (void)ch;
    tx_released = b;
    tx_releases++;
}
static void tx_teardown_received(struct bulk_channel *ch)
{
    (void)ch;
    tx_teardown++;
}

static struct bulk_channel_callbacks rx_cbs = {
    .bind_received = rx_bind_received,
    .teardown_received = rx_teardown_received,
    .pool_assigned = rx_pool_assigned,
    .pool_removed = rx_pool_removed,
    .move_received = rx_move_received,
    .copy_received = rx_copy_received,
};
static struct bulk_channel_callbacks tx_cbs = {
    .teardown_received = tx_teardown_received,
    .buffer_received = tx_buffer_received,
    .copy_released = tx_copy_released,
};

/** Writes the whole buffer (faults if the program may not write it). */
static void scribble(struct bulk_buffer *b, int value)
{
    memset(b->address, value, b->pool->buffer_size);
    CHECK(((volatile unsigned char *)b->address)[b->pool->buffer_size - 1] == (unsigned char)value,
          "buffer not written");
}

/** The channel's public fields, to check a refused call left them alone. */
struct chan_snapshot {
    enum bulk_channel_state state;
    enum bulk_channel_direction direction;
    enum bulk_trust_level trust;
    size_t meta_size;
};
static struct chan_snapshot snap(const struct bulk_channel *c)
{
    struct chan_snapshot s = { c->state, c->direction, c->trust, c->meta_size };
    return s;
}
#define SAME_CHANNEL(c, s)                                                              \
    CHECK((c)->state == (s).state && (c)->direction == (s).direction &&                 \
              (c)->trust == (s).trust && (c)->meta_size == (s).meta_size,               \
          "a refused call changed the channel")

static void test_strerror(void)
{
    for (errval_t e = 0; e < (errval_t)BULK_ERR_COUNT + 3; e++) {
        const char *s = bulk_strerror(e);
        CHECK(s != NULL, "bulk_strerror(%" PRIuPTR ") is NULL", (uintptr_t)e);
        CHECK(strlen(s) >= 4, "bulk_strerror(%" PRIuPTR ") is %s", (uintptr_t)e, s);
        for (errval_t f = 0; f < e && e < (errval_t)BULK_ERR_COUNT; f++) {
            CHECK(strcmp(s, bulk_strerror(f)) != 0, "codes %" PRIuPTR " and %" PRIuPTR " share the sentence %s",
                  (uintptr_t)f, (uintptr_t)e, s);
        }
    }
    CHECK(bulk_strerror((errval_t)-1) != NULL && bulk_strerror((errval_t)-1)[0] != 0,
          "bulk_strerror of an unknown code");
    printf("strerror: %d codes, each a sentence\n", BULK_ERR_COUNT);
}

static void test_allocator(struct bulk_allocator *a, struct bulk_allocator *b, struct bulk_allocator *c)
{
    struct bulk_allocator z;
    memset(&z, 0, sizeof z);
    EXPECT_CODE(bulk_alloc_init(NULL, 4, 4096, NULL), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_alloc_init(&z, 0, 4096, NULL), BULK_ERR_BAD_BUFFER_SIZE);
    EXPECT_CODE(bulk_alloc_init(&z, 4, 0, NULL), BULK_ERR_BAD_BUFFER_SIZE);
    EXPECT_CODE(bulk_alloc_init(&z, 4, 1000, NULL), BULK_ERR_BAD_BUFFER_SIZE);
    EXPECT_CODE(bulk_alloc_init(&z, 4, 6000, NULL), BULK_ERR_BAD_BUFFER_SIZE);
    CHECK(z.pool == NULL && z.num_free == 0, "a refused bulk_alloc_init wrote the allocator");
    EXPECT_CODE(bulk_alloc_free(NULL), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_alloc_free(&z), BULK_ERR_INVALID_ALLOCATOR);
    CHECK(bulk_alloc_new_buffer(NULL) == NULL, "bulk_alloc_new_buffer(NULL)");
    CHECK(bulk_alloc_new_buffer(&z) == NULL, "bulk_alloc_new_buffer of an uninitialized allocator");

    struct bulk_pool_constraints half = { .trust = BULK_TRUST_HALF };
    EXPECT_OK(bulk_alloc_init(a, 4, 4096, &half));
    EXPECT_OK(bulk_alloc_init(b, 2, 4096, &half));
    EXPECT_OK(bulk_alloc_init(c, 2, 4096, &half));
    CHECK(a->pool != NULL && a->num_free == 4, "fresh allocator: pool %p, %zu free", (void *)a->pool, a->num_free);
    CHECK(a->pool->num_buffers == 4 && a->pool->buffer_size == 4096, "pool shape");
    CHECK(a->pool->trust == BULK_TRUST_HALF, "pool trust %d", (int)a->pool->trust);
    struct bulk_pool *ap = a->pool;
    EXPECT_CODE(bulk_alloc_init(a, 8, 4096, NULL), BULK_ERR_ALLOCATOR_IN_USE);
    CHECK(a->pool == ap && a->num_free == 4, "a refused re-init changed the allocator");
    CHECK(bulk_pool_domain_list_get(&ap->id) == ap, "bulk_pool_domain_list_get of the pool's id");
    CHECK(bulk_pool_domain_list_get(NULL) == NULL, "bulk_pool_domain_list_get(NULL)");
    struct bulk_pool_id unknown = ap->id;
    unknown.local ^= 0x5a5a5a5a;
    unknown.tag ^= 0xa5a5a5a5;
    CHECK(bulk_pool_domain_list_get(&unknown) == NULL, "bulk_pool_domain_list_get of an unknown id");

    /* Exhaustion. */
    struct bulk_buffer *b1 = bulk_alloc_new_buffer(b), *b2 = bulk_alloc_new_buffer(b);
    CHECK(b1 && b2 && b1 != b2, "two buffers");
    CHECK(b->num_free == 0 && bulk_alloc_new_buffer(b) == NULL, "a third buffer from a pool of two");
    CHECK(b1->state == BULK_BUFFER_READ_WRITE && b1->pool == b->pool, "new buffer");
    scribble(b1, 1);

    EXPECT_CODE(bulk_alloc_return_buffer(NULL, b1), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_alloc_return_buffer(b, NULL), BULK_ERR_NULL_ARGUMENT);
    /* Foreign pool: b1 belongs to b, not a. */
    EXPECT_CODE(bulk_alloc_return_buffer(a, b1), BULK_ERR_FOREIGN_POOL);
    CHECK(a->num_free == 4 && b->num_free == 0 && b1->state == BULK_BUFFER_READ_WRITE,
          "a refused return changed something");
    scribble(b1, 2);
    /* Not a buffer at all: a copy of a buffer's struct. */
    struct bulk_buffer fake = *b1;
    EXPECT_CODE(bulk_alloc_return_buffer(b, &fake), BULK_ERR_INVALID_BUFFER);
    CHECK(b->num_free == 0, "a refused return changed the count");
    /* Double return. */
    EXPECT_OK(bulk_alloc_return_buffer(b, b1));
    CHECK(b->num_free == 1, "count after a return");
    EXPECT_CODE(bulk_alloc_return_buffer(b, b1), BULK_ERR_BUFFER_NOT_OWNED);
    CHECK(b->num_free == 1, "a double return changed the count");
    EXPECT_OK(bulk_alloc_return_buffer(b, b2));
    /* A buffer state changes only through transfers. */
    EXPECT_CODE(bulk_buffer_change_state(NULL, BULK_BUFFER_READ_WRITE), BULK_ERR_NULL_ARGUMENT);
    struct bulk_buffer *b3 = bulk_alloc_new_buffer(c);
    EXPECT_OK(bulk_buffer_change_state(b3, BULK_BUFFER_READ_WRITE));
    EXPECT_CODE(bulk_buffer_change_state(b3, BULK_BUFFER_READ_ONLY), BULK_ERR_BUFFER_STATE);
    CHECK(b3->state == BULK_BUFFER_READ_WRITE, "a refused state change changed the state");
    scribble(b3, 3);
    EXPECT_OK(bulk_alloc_return_buffer(c, b3));
    printf("allocator: errors checked\n");
}

/** The fds this process has open. */
static int open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    CHECK(d != NULL, "opendir /proc/self/fd");
    if (d == NULL) {
        return -1;
    }
    int n = 0;
    while (readdir(d) != NULL) {
        n++;
    }
    closedir(d);
    return n;
}

/*
 * A waitset this thread dispatched (the library remembers it for the next
 * dispatch) and then destroyed: its fds are closed at once, and calls on
 * it say it is gone.
 */
static void test_destroyed_waitset(void)
{
    int before = open_fds();
    struct waitset *w;
    EXPECT_OK(bulk_waitset_create(&w));
    CHECK(open_fds() > before, "a new waitset holds no fd");
    EXPECT_CODE(bulk_waitset_dispatch(w, 0), BULK_ERR_TIMEOUT);
    EXPECT_OK(bulk_waitset_destroy(w));
    CHECK(open_fds() == before, "a destroyed waitset left %d fds open", open_fds() - before);
    EXPECT_CODE(bulk_waitset_dispatch(w, 0), BULK_ERR_INVALID_WAITSET);
    EXPECT_CODE(bulk_waitset_set_spin(w, 0), BULK_ERR_INVALID_WAITSET);
    CHECK(bulk_waitset_fd(w) == -1, "bulk_waitset_fd of a destroyed waitset");
    EXPECT_CODE(bulk_waitset_destroy(w), BULK_ERR_INVALID_WAITSET);
    /* The waitset dispatched before is served again. */
    EXPECT_CODE(bulk_waitset_dispatch(ws, 0), BULK_ERR_TIMEOUT);
    printf("destroyed waitset: fds closed, calls refused\n");
}

static void test_waitset_and_endpoints(void)
{
    EXPECT_CODE2(bulk_waitset_dispatch(NULL, 0), BULK_ERR_NULL_ARGUMENT, BULK_ERR_INVALID_WAITSET);
    CHECK(bulk_waitset_fd(NULL) == -1, "bulk_waitset_fd(NULL)");
    EXPECT_CODE2(bulk_waitset_destroy(NULL), BULK_ERR_NULL_ARGUMENT, BULK_ERR_INVALID_WAITSET);
    EXPECT_CODE(bulk_waitset_create(NULL), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_waitset_dispatch(ws, 0), BULK_ERR_TIMEOUT);
    /* Waiting forever on a waitset on which nothing can happen. */
    EXPECT_CODE(bulk_waitset_dispatch(ws, BULK_WAIT_FOREVER), BULK_ERR_WAITSET_EMPTY);

    struct bulk_sm_endpoint_descriptor sm;
    char long_path[300];
    memset(long_path, 'x', sizeof long_path - 1);
    long_path[0] = '/';
    long_path[sizeof long_path - 1] = 0;
    EXPECT_CODE(bulk_sm_ep_create(NULL, "/tmp/x"), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_sm_ep_create(&sm, NULL), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_sm_ep_create(&sm, long_path), BULK_ERR_INVALID_ARGUMENT);
    EXPECT_CODE(bulk_sm_ep_create_remote(&sm, long_path), BULK_ERR_INVALID_ARGUMENT);
    EXPECT_CODE(bulk_sm_ep_destroy(NULL), BULK_ERR_NULL_ARGUMENT);

    struct bulk_net_endpoint_descriptor net;
    struct bulk_net_ep_setup no_ip = { .ip = NULL, .port = 0 };
    struct bulk_net_ep_setup bad_ip = { .ip = "not an address", .port = 0 };
    struct bulk_net_ep_setup no_port = { .ip = "127.0.0.1", .port = 0 };
    EXPECT_CODE(bulk_net_ep_create(NULL, &no_port), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_net_ep_create(&net, NULL), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_net_ep_create(&net, &no_ip), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_net_ep_create(&net, &bad_ip), BULK_ERR_INVALID_ARGUMENT);
    EXPECT_CODE(bulk_net_ep_create_remote(&net, &no_port), BULK_ERR_INVALID_ARGUMENT);
    EXPECT_CODE(bulk_net_ep_destroy(NULL), BULK_ERR_NULL_ARGUMENT);
    CHECK(bulk_net_ep_port(NULL) == 0, "bulk_net_ep_port(NULL)");

    /* Binding to a path nobody listens at: refused at once, or the
     * continuation says so; either way the channel can be destroyed. */
    char path[128];
    snprintf(path, sizeof path, "/tmp/ferry-c-nobody-%d.sock", (int)getpid());
    EXPECT_OK(bulk_sm_ep_create_remote(&sm, path));
    struct bulk_channel lonely;
    struct bulk_channel_bind_params params = { .waitset = ws };
    struct done bound = { 0, 0, NULL };
    errval_t e = bulk_channel_bind(&lonely, &sm.ep_generic, &tx_cbs, &params, DONE(bound));
    if (e == BULK_OK) {
        WAIT_FOR(ws, bound.runs > 0, "the continuation of a bind to nobody");
        CHECK(bound.err != BULK_OK, "a bind to a path nobody listens at succeeded");
        struct done destroyed = { 0, 0, NULL };
        EXPECT_OK(bulk_channel_destroy(&lonely, DONE(destroyed)));
        WAIT_FOR(ws, destroyed.runs > 0, "destroy of a failed binding");
        printf("bind to nobody: continuation got %s\n", bulk_strerror(bound.err));
    } else {
        CHECK(e == BULK_ERR_ENDPOINT_NOT_LISTENING, "bind to nobody returned %s", bulk_strerror(e));
        drain(ws);
        CHECK(bound.runs == 0, "the continuation of a refused bind ran");
    }
    EXPECT_OK(bulk_sm_ep_destroy(&sm));
    printf("waitset and endpoints: errors checked\n");
}

static void test_channels(struct bulk_allocator *a, struct bulk_allocator *b, struct bulk_allocator *c)
{
    struct bulk_local_endpoint rx_ep, tx_ep, zero_ep;
    memset(&zero_ep, 0, sizeof zero_ep);
    bulk_local_init_endpoint(&rx_ep, NULL);
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_RX,
        .role = BULK_ROLE_SLAVE,
        .trust = BULK_TRUST_HALF,
        .meta_size = 8,
        .waitset = ws,
    };
    struct bulk_channel z;
    memset(&z, 0, sizeof z);
    EXPECT_CODE(bulk_channel_create(NULL, &rx_ep.generic, &rx_cbs, &setup), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_create(&z, NULL, &rx_cbs, &setup), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_create(&z, &rx_ep.generic, NULL, &setup), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_create(&z, &rx_ep.generic, &rx_cbs, NULL), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_create(&z, &zero_ep.generic, &rx_cbs, &setup), BULK_ERR_INVALID_ENDPOINT);
    struct bulk_channel_setup bad = setup;
    bad.trust = BULK_TRUST_NONE;
    EXPECT_CODE(bulk_channel_create(&z, &rx_ep.generic, &rx_cbs, &bad), BULK_ERR_TRUST_NOT_SUPPORTED);
    bad = setup;
    bad.meta_size = BULK_MAX_META_SIZE + 1;
    EXPECT_CODE(bulk_channel_create(&z, &rx_ep.generic, &rx_cbs, &bad), BULK_ERR_INVALID_ARGUMENT);
    bad = setup;
    bad.direction = (enum bulk_channel_direction)7;
    EXPECT_CODE(bulk_channel_create(&z, &rx_ep.generic, &rx_cbs, &bad), BULK_ERR_INVALID_ARGUMENT);
    CHECK(z.state == BULK_STATE_UNINITIALIZED && z.impl_data == NULL, "a refused create wrote the channel");
    /* A channel that never was: every call refuses it. */
    struct bulk_buffer *ab = bulk_alloc_new_buffer(a);
    uint64_t meta = 7;
    EXPECT_CODE(bulk_channel_move(&z, ab, &meta, NEVER), BULK_ERR_INVALID_CHANNEL);
    EXPECT_CODE(bulk_channel_assign_pool(&z, a->pool, NEVER), BULK_ERR_INVALID_CHANNEL);
    EXPECT_CODE(bulk_channel_destroy(&z, NEVER), BULK_ERR_INVALID_CHANNEL);

    EXPECT_OK(bulk_channel_create(&rx, &rx_ep.generic, &rx_cbs, &setup));
    CHECK(rx.state == BULK_STATE_INITIALIZED && rx.direction == BULK_DIRECTION_RX && rx.meta_size == 8 &&
              rx.trust == BULK_TRUST_HALF && rx.callbacks == &rx_cbs && rx.waitset == ws,
          "created channel's fields");
    struct chan_snapshot rs = snap(&rx);
    EXPECT_CODE(bulk_channel_create(&rx, &rx_ep.generic, &rx_cbs, &setup), BULK_ERR_CHANNEL_IN_USE);
    SAME_CHANNEL(&rx, rs);
    /* Not connected yet. */
    EXPECT_CODE(bulk_channel_pass(&rx, ab, &meta, NEVER), BULK_ERR_CHANNEL_STATE);
    SAME_CHANNEL(&rx, rs);

    /* Bind. */
    bulk_local_init_endpoint(&tx_ep, &rx);
    struct bulk_channel_bind_params params = { .waitset = ws, .trust = BULK_TRUST_HALF };
    struct done bound = { 0, 0, NULL };
    EXPECT_CODE(bulk_channel_bind(NULL, &tx_ep.generic, &tx_cbs, &params, NEVER), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_bind(&tx, NULL, &tx_cbs, &params, NEVER), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_bind(&tx, &tx_ep.generic, NULL, &params, NEVER), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_bind(&tx, &tx_ep.generic, &tx_cbs, NULL, NEVER), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_bind(&tx, &zero_ep.generic, &tx_cbs, &params, NEVER), BULK_ERR_INVALID_ENDPOINT);
    CHECK(tx.state == BULK_STATE_UNINITIALIZED, "a refused bind wrote the channel");
    EXPECT_OK(bulk_channel_bind(&tx, &tx_ep.generic, &tx_cbs, &params, DONE(bound)));
    CHECK(bound.runs == 0, "the bind continuation ran outside dispatch");
    WAIT_FOR(ws, bound.runs > 0 && rx_bound > 0, "the bind");
    CHECK(bound.err == BULK_OK && bound.channel == &tx, "bind continuation: %s", bulk_strerror(bound.err));
    CHECK(tx.state == BULK_STATE_CONNECTED && rx.state == BULK_STATE_CONNECTED, "states after bind: %d, %d",
          (int)tx.state, (int)rx.state);
    CHECK(tx.direction == BULK_DIRECTION_TX && tx.meta_size == 8 && tx.trust == BULK_TRUST_HALF,
          "bound channel's fields");
    /* A second binder for a bound channel. */
    struct bulk_channel tx2;
    struct bulk_local_endpoint tx2_ep;
    bulk_local_init_endpoint(&tx2_ep, &rx);
    struct done bound2 = { 0, 0, NULL };
    errval_t e = bulk_channel_bind(&tx2, &tx2_ep.generic, &tx_cbs, &params, DONE(bound2));
    if (e == BULK_OK) {
        WAIT_FOR(ws, bound2.runs > 0, "the second binder's continuation");
        CHECK(bound2.err != BULK_OK, "a second binder bound a bound channel");
        struct done d2 = { 0, 0, NULL };
        EXPECT_OK(bulk_channel_destroy(&tx2, DONE(d2)));
        WAIT_FOR(ws, d2.runs > 0, "the second binder's destroy");
    } else {
        CHECK(e == BULK_ERR_ENDPOINT_IN_USE, "second binder: %s", bulk_strerror(e));
    }
    CHECK(rx.state == BULK_STATE_CONNECTED && rx_bound == 1, "a second binder disturbed the channel");
    struct chan_snapshot ts = snap(&tx);
    rs = snap(&rx);

    /* Pools. */
    struct bulk_pool fake_pool = *a->pool;
    EXPECT_CODE(bulk_channel_assign_pool(NULL, a->pool, NEVER), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_assign_pool(&tx, NULL, NEVER), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_assign_pool(&tx, &fake_pool, NEVER), BULK_ERR_INVALID_POOL);
    /* The buffer's pool is not assigned yet. */
    EXPECT_CODE(bulk_channel_move(&tx, ab, &meta, NEVER), BULK_ERR_POOL_NOT_ASSIGNED);
    CHECK(ab->state == BULK_BUFFER_READ_WRITE, "refused move changed the buffer's state");
    scribble(ab, 4);
    struct done assigned = { 0, 0, NULL };
    EXPECT_OK(bulk_channel_assign_pool(&tx, a->pool, DONE(assigned)));
    EXPECT_CODE(bulk_channel_assign_pool(&tx, a->pool, NEVER), BULK_ERR_POOL_ALREADY_ASSIGNED);
    WAIT_FOR(ws, assigned.runs > 0, "the assignment");
    CHECK(assigned.err == BULK_OK, "assign: %s", bulk_strerror(assigned.err));
    EXPECT_CODE(bulk_channel_assign_pool(&tx, a->pool, NEVER), BULK_ERR_POOL_ALREADY_ASSIGNED);
    EXPECT_CODE(bulk_channel_remove_pool(&tx, c->pool, NEVER), BULK_ERR_POOL_NOT_ASSIGNED);
    SAME_CHANNEL(&tx, ts);

    /* Veto: the continuation gets an error, the pool's buffers cannot move. */
    veto_pool = b->pool;
    struct done vetoed = { 0, 0, NULL };
    EXPECT_OK(bulk_channel_assign_pool(&tx, b->pool, DONE(vetoed)));
    WAIT_FOR(ws, vetoed.runs > 0, "the vetoed assignment");
    CHECK(vetoed.err != BULK_OK, "a vetoed assignment's continuation got BULK_OK");
    CHECK(vetoed.err == BULK_ERR_POOL_VETOED, "vetoed assignment: %s", bulk_strerror(vetoed.err));
    struct bulk_buffer *bb = bulk_alloc_new_buffer(b);
    EXPECT_CODE(bulk_channel_move(&tx, bb, &meta, NEVER), BULK_ERR_POOL_NOT_ASSIGNED);
    EXPECT_CODE(bulk_channel_copy(&tx, bb, &meta, NEVER), BULK_ERR_POOL_NOT_ASSIGNED);
    CHECK(bb->state == BULK_BUFFER_READ_WRITE, "refused move of a vetoed pool's buffer changed its state");
    scribble(bb, 5);
    EXPECT_OK(bulk_alloc_return_buffer(b, bb));

    /* Arguments and direction. */
    EXPECT_CODE(bulk_channel_move(NULL, ab, &meta, NEVER), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_move(&tx, NULL, &meta, NEVER), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_pass(&rx, NULL, &meta, NEVER), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_copy(&tx, NULL, &meta, NEVER), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_release(&rx, NULL, NEVER), BULK_ERR_NULL_ARGUMENT);
    EXPECT_CODE(bulk_channel_move(&rx, ab, &meta, NEVER), BULK_ERR_WRONG_DIRECTION);
    EXPECT_CODE(bulk_channel_copy(&rx, ab, &meta, NEVER), BULK_ERR_WRONG_DIRECTION);
    EXPECT_CODE(bulk_channel_pass(&tx, ab, &meta, NEVER), BULK_ERR_WRONG_DIRECTION);
    EXPECT_CODE(bulk_channel_release(&tx, ab, NEVER), BULK_ERR_WRONG_DIRECTION);
    struct bulk_buffer fake = *ab;
    EXPECT_CODE(bulk_channel_move(&tx, &fake, &meta, NEVER), BULK_ERR_INVALID_BUFFER);
    CHECK(ab->state == BULK_BUFFER_READ_WRITE, "refused calls changed the buffer's state");
    scribble(ab, 6);
    /* Pool not assigned (c's pool never was). */
    struct bulk_buffer *cb = bulk_alloc_new_buffer(c);
    EXPECT_CODE(bulk_channel_move(&tx, cb, &meta, NEVER), BULK_ERR_POOL_NOT_ASSIGNED);
    scribble(cb, 7);
    EXPECT_OK(bulk_alloc_return_buffer(c, cb));
    SAME_CHANNEL(&tx, ts);
    SAME_CHANNEL(&rx, rs);

    /* The buffer is still usable: a real move. */
    struct done moved = { 0, 0, NULL };
    EXPECT_OK(bulk_channel_move(&tx, ab, &meta, DONE(moved)));
    CHECK(ab->state == BULK_BUFFER_INVALID, "moved buffer in state %d", (int)ab->state);
    /* Not owned any more. */
    EXPECT_CODE(bulk_channel_move(&tx, ab, &meta, NEVER), BULK_ERR_BUFFER_NOT_OWNED);
    EXPECT_CODE(bulk_channel_copy(&tx, ab, &meta, NEVER), BULK_ERR_BUFFER_NOT_OWNED);
    EXPECT_CODE(bulk_alloc_return_buffer(a, ab), BULK_ERR_BUFFER_NOT_OWNED);
    WAIT_FOR(ws, moved.runs > 0 && rx_moves > 0, "the move");
    CHECK(moved.err == BULK_OK && rx_moved->bufferid == ab->bufferid, "move");
    CHECK(rx_moved->state == BULK_BUFFER_READ_WRITE, "moved-in buffer in state %d", (int)rx_moved->state);
    CHECK(((unsigned char *)rx_moved->address)[0] == 6, "moved-in buffer has other bytes");
    /* Release of a buffer that is no copy. */
    EXPECT_CODE(bulk_channel_release(&rx, rx_moved, NEVER), BULK_ERR_NOT_A_COPY);
    CHECK(rx_moved->state == BULK_BUFFER_READ_WRITE, "refused release changed the state");
    scribble(rx_moved, 8);
    struct done passed = { 0, 0, NULL };
    EXPECT_OK(bulk_channel_pass(&rx, rx_moved, &meta, DONE(passed)));
    EXPECT_CODE(bulk_channel_pass(&rx, rx_moved, &meta, NEVER), BULK_ERR_BUFFER_NOT_OWNED);
    WAIT_FOR(ws, passed.runs > 0 && tx_backs > 0, "the pass");
    CHECK(tx_back == ab && ab->state == BULK_BUFFER_READ_WRITE, "passed-back buffer");
    CHECK(((unsigned char *)ab->address)[0] == 8, "passed-back buffer has other bytes");

    /* Copy: RO_OWNED at the owner, READ_ONLY at the receiver. */
    struct done copied = { 0, 0, NULL };
    EXPECT_OK(bulk_channel_copy(&tx, ab, &meta, DONE(copied)));
    CHECK(ab->state == BULK_BUFFER_RO_OWNED, "owner's buffer after a copy in state %d", (int)ab->state);
    WAIT_FOR(ws, copied.runs > 0 && rx_copies > 0, "the copy");
    CHECK(rx_copy->state == BULK_BUFFER_READ_ONLY, "received copy in state %d", (int)rx_copy->state);
    CHECK(rx_copy->bufferid == ab->bufferid, "copy's bufferid");
    CHECK(((volatile unsigned char *)rx_copy->address)[0] == 8, "copy readable");
    EXPECT_CODE(bulk_channel_move(&tx, ab, &meta, NEVER), BULK_ERR_COPIES_OUTSTANDING);
    EXPECT_CODE2(bulk_alloc_return_buffer(a, ab), BULK_ERR_COPIES_OUTSTANDING, BULK_ERR_BUFFER_NOT_OWNED);
    EXPECT_CODE(bulk_channel_pass(&rx, rx_copy, &meta, NEVER), BULK_ERR_BUFFER_NOT_OWNED);
    CHECK(ab->state == BULK_BUFFER_RO_OWNED && rx_copy->state == BULK_BUFFER_READ_ONLY,
          "refused calls changed a copy's state");
    struct done released = { 0, 0, NULL };
    struct bulk_buffer *copy = rx_copy;
    EXPECT_OK(bulk_channel_release(&rx, copy, DONE(released)));
    EXPECT_CODE(bulk_channel_release(&rx, copy, NEVER), BULK_ERR_NOT_A_COPY);
    WAIT_FOR(ws, released.runs > 0 && tx_releases > 0, "the release");
    CHECK(tx_released == ab && ab->state == BULK_BUFFER_READ_WRITE, "owner's buffer after release in state %d",
          (int)ab->state);
    scribble(ab, 9);
    SAME_CHANNEL(&tx, ts);
    SAME_CHANNEL(&rx, rs);

    /* Removing a pool: the peer hears of it; its buffers cannot move any more. */
    struct done removed = { 0, 0, NULL };
    EXPECT_OK(bulk_channel_remove_pool(&tx, a->pool, DONE(removed)));
    WAIT_FOR(ws, removed.runs > 0, "the pool's removal");
    CHECK(removed.err == BULK_OK, "remove_pool: %s", bulk_strerror(removed.err));
    WAIT_FOR(ws, rx_pools_removed > 0, "pool_removed at the peer");
    EXPECT_CODE(bulk_channel_move(&tx, ab, &meta, NEVER), BULK_ERR_POOL_NOT_ASSIGNED);
    EXPECT_CODE(bulk_channel_remove_pool(&tx, a->pool, NEVER), BULK_ERR_POOL_NOT_ASSIGNED);
    CHECK(ab->state == BULK_BUFFER_READ_WRITE, "buffer after its pool's removal in state %d", (int)ab->state);
    scribble(ab, 11);
    /* Assigned again, and a move in flight when the channel is destroyed:
     * its continuation runs exactly once, before the destroy's. */
    struct done reassigned = { 0, 0, NULL };
    EXPECT_OK(bulk_channel_assign_pool(&tx, a->pool, DONE(reassigned)));
    WAIT_FOR(ws, reassigned.runs > 0, "the pool's second assignment");
    CHECK(reassigned.err == BULK_OK, "second assignment: %s", bulk_strerror(reassigned.err));

    /* Waitset busy while channels are on it. */
    EXPECT_CODE(bulk_waitset_destroy(ws), BULK_ERR_WAITSET_BUSY);

    /* Destroy: the peer hears of it; later calls are refused. */
    struct done destroyed = { 0, 0, NULL }, in_flight = { 0, 0, NULL };
    struct bulk_buffer *flying = bulk_alloc_new_buffer(a);
    CHECK(flying != NULL, "no buffer for the move in flight");
    EXPECT_OK(bulk_channel_move(&tx, flying, &meta, DONE(in_flight)));
    EXPECT_OK(bulk_channel_destroy(&tx, DONE(destroyed)));
    WAIT_FOR(ws, destroyed.runs > 0 && rx_teardown > 0, "the teardown");
    CHECK(in_flight.runs == 1, "the continuation of a move in flight at destroy ran %u times", in_flight.runs);
    printf("move in flight at destroy: continuation got %s\n", bulk_strerror(in_flight.err));
    CHECK(destroyed.err == BULK_OK, "destroy continuation: %s", bulk_strerror(destroyed.err));
    CHECK(rx.state == BULK_STATE_CLOSED, "peer of a destroyed channel in state %d", (int)rx.state);
    EXPECT_CODE(bulk_channel_move(&tx, ab, &meta, NEVER), BULK_ERR_INVALID_CHANNEL);
    EXPECT_CODE(bulk_channel_copy(&tx, ab, &meta, NEVER), BULK_ERR_INVALID_CHANNEL);
    EXPECT_CODE(bulk_channel_assign_pool(&tx, c->pool, NEVER), BULK_ERR_INVALID_CHANNEL);
    EXPECT_CODE(bulk_channel_remove_pool(&tx, a->pool, NEVER), BULK_ERR_INVALID_CHANNEL);
    EXPECT_CODE(bulk_channel_destroy(&tx, NEVER), BULK_ERR_INVALID_CHANNEL);
    CHECK(ab->state == BULK_BUFFER_READ_WRITE, "the buffer after its channel was destroyed");
    scribble(ab, 10);
    /* The closed peer: transfers are refused; destroy works. */
    struct bulk_buffer *ab2 = bulk_alloc_new_buffer(a);
    EXPECT_CODE(bulk_channel_pass(&rx, ab2, &meta, NEVER), BULK_ERR_CHANNEL_CLOSED);
    EXPECT_OK(bulk_alloc_return_buffer(a, ab2));
    struct done rx_destroyed = { 0, 0, NULL };
    EXPECT_OK(bulk_channel_destroy(&rx, DONE(rx_destroyed)));
    WAIT_FOR(ws, rx_destroyed.runs > 0, "rx's destroy");
    EXPECT_CODE(bulk_channel_pass(&rx, ab, &meta, NEVER), BULK_ERR_INVALID_CHANNEL);
    EXPECT_OK(bulk_alloc_return_buffer(a, ab));
    /* The move in flight at destroy either arrived (the program holds the
     * buffer, here in the same process, and gives it back) or not (it came
     * home by itself). */
    if (rx_moves == 2) {
        CHECK(rx_moved == flying, "the buffer in flight arrived as another object");
        EXPECT_OK(bulk_alloc_return_buffer(a, rx_moved));
    }
    CHECK(a->num_free == 4, "%zu of 4 buffers free at the end (%u moves arrived)", a->num_free, rx_moves);

    /* Destroy in other states: created only; binding not yet dispatched. */
    struct bulk_channel lone, lone_binder;
    struct bulk_local_endpoint lone_ep, lone_bind_ep;
    bulk_local_init_endpoint(&lone_ep, NULL);
    setup.direction = BULK_DIRECTION_TX;
    static struct bulk_channel_callbacks none; /* every member NULL: not interested */
    EXPECT_OK(bulk_channel_create(&lone, &lone_ep.generic, &none, &setup));
    struct done lone_destroyed = { 0, 0, NULL };
    EXPECT_OK(bulk_channel_destroy(&lone, DONE(lone_destroyed)));
    WAIT_FOR(ws, lone_destroyed.runs > 0, "destroy of a created channel");
    CHECK(lone_destroyed.err == BULK_OK, "destroy of a created channel: %s", bulk_strerror(lone_destroyed.err));
    struct bulk_local_endpoint lone_ep2;
    bulk_local_init_endpoint(&lone_ep2, NULL);
    EXPECT_OK(bulk_channel_create(&lone, &lone_ep2.generic, &none, &setup));
    bulk_local_init_endpoint(&lone_bind_ep, &lone);
    struct done lb_bound = { 0, 0, NULL }, lb_destroyed = { 0, 0, NULL }, l_destroyed = { 0, 0, NULL };
    EXPECT_OK(bulk_channel_bind(&lone_binder, &lone_bind_ep.generic, &none, &params, DONE(lb_bound)));
    EXPECT_OK(bulk_channel_destroy(&lone_binder, DONE(lb_destroyed)));
    WAIT_FOR(ws, lb_destroyed.runs > 0 && lb_bound.runs > 0, "destroy of a binding channel");
    EXPECT_OK(bulk_channel_destroy(&lone, DONE(l_destroyed)));
    WAIT_FOR(ws, l_destroyed.runs > 0, "destroy of the created one");
    drain(ws);
    CHECK(lb_bound.runs == 1 && lb_destroyed.runs == 1 && l_destroyed.runs == 1 && lone_destroyed.runs == 1,
          "continuations ran more than once");

    /* Callbacks left NULL: an incoming pool is accepted. A NULL waitset in
     * the setup and bind parameters: the default one. */
    struct bulk_channel quiet_rx, quiet_tx;
    struct bulk_local_endpoint quiet_ep, quiet_bind_ep;
    struct bulk_channel_setup quiet_setup = {
        .direction = BULK_DIRECTION_RX,
        .role = BULK_ROLE_GENERIC,
        .trust = BULK_TRUST_HALF,
        .waitset = NULL,
    };
    struct bulk_channel_bind_params quiet_params = { .waitset = NULL };
    struct waitset *dws = bulk_waitset_default();
    CHECK(dws != NULL && dws != ws, "bulk_waitset_default");
    bulk_local_init_endpoint(&quiet_ep, NULL);
    EXPECT_OK(bulk_channel_create(&quiet_rx, &quiet_ep.generic, &none, &quiet_setup));
    CHECK(quiet_rx.waitset == dws, "a NULL setup.waitset is not the default waitset");
    bulk_local_init_endpoint(&quiet_bind_ep, &quiet_rx);
    struct done q_bound = { 0, 0, NULL }, q_assigned = { 0, 0, NULL };
    struct done q_destroyed_tx = { 0, 0, NULL }, q_destroyed_rx = { 0, 0, NULL };
    EXPECT_OK(bulk_channel_bind(&quiet_tx, &quiet_bind_ep.generic, &none, &quiet_params, DONE(q_bound)));
    CHECK(quiet_tx.waitset == dws, "a NULL params.waitset is not the default waitset");
    WAIT_FOR(dws, q_bound.runs > 0, "the bind on the default waitset");
    CHECK(q_bound.err == BULK_OK, "bind without callbacks: %s", bulk_strerror(q_bound.err));
    EXPECT_OK(bulk_channel_assign_pool(&quiet_tx, c->pool, DONE(q_assigned)));
    WAIT_FOR(dws, q_assigned.runs > 0, "the assignment to a channel without pool_assigned");
    CHECK(q_assigned.err == BULK_OK, "a pool offered to a channel without pool_assigned: %s",
          bulk_strerror(q_assigned.err));
    EXPECT_OK(bulk_channel_destroy(&quiet_tx, DONE(q_destroyed_tx)));
    EXPECT_OK(bulk_channel_destroy(&quiet_rx, DONE(q_destroyed_rx)));
    WAIT_FOR(dws, q_destroyed_tx.runs > 0 && q_destroyed_rx.runs > 0, "destroy on the default waitset");
    drain(dws);
    CHECK(q_bound.runs == 1 && q_assigned.runs == 1 && q_destroyed_tx.runs == 1 && q_destroyed_rx.runs == 1,
          "a continuation on the default waitset ran more than once");

    /* Exactly once, and never for a refused call. */
    CHECK(bound.runs == 1 && assigned.runs == 1 && vetoed.runs == 1 && moved.runs == 1 && passed.runs == 1 &&
              copied.runs == 1 && released.runs == 1 && destroyed.runs == 1 && rx_destroyed.runs == 1 &&
              removed.runs == 1 && reassigned.runs == 1 && in_flight.runs == 1,
          "a continuation ran more than once");
    CHECK(never_ran == 0, "%u continuations of refused calls ran", never_ran);
    printf("channels: errors checked\n");
}

/*
 * A destroyed channel's struct, copied before the destroy and put back at
 * its address after a new channel was created there on the same waitset
 * (the new end takes the destroyed one's place in the waitset, and this
 * thread still remembers the old one from a call): every call refuses it
 * with BULK_ERR_INVALID_CHANNEL, and the new channel is untouched.
 */
static void test_stale_channel_struct(struct bulk_allocator *a)
{
    struct waitset *w;
    EXPECT_OK(bulk_waitset_create(&w));
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_TX,
        .role = BULK_ROLE_MASTER,
        .trust = BULK_TRUST_FULL,
        .meta_size = 8,
        .waitset = w,
    };
    static struct bulk_channel c;
    struct bulk_local_endpoint first_ep, second_ep;
    bulk_local_init_endpoint(&first_ep, NULL);
    EXPECT_OK(bulk_channel_create(&c, &first_ep.generic, &tx_cbs, &setup));
    struct bulk_buffer *buf = bulk_alloc_new_buffer(a);
    CHECK(buf != NULL, "no buffer for the stale struct's test");
    uint64_t meta = 1;
    /* A call on it (not connected yet): this thread remembers the channel. */
    EXPECT_CODE(bulk_channel_move(&c, buf, &meta, NEVER), BULK_ERR_CHANNEL_STATE);
    struct bulk_channel old = c;
    EXPECT_OK(bulk_channel_destroy(&c, BULK_CONT_NOP));
    drain(w);
    bulk_local_init_endpoint(&second_ep, NULL);
    EXPECT_OK(bulk_channel_create(&c, &second_ep.generic, &tx_cbs, &setup));
    struct bulk_channel fresh = c;
    CHECK(fresh.impl_data != old.impl_data, "a new channel got a destroyed one's token");
    c = old;
    EXPECT_CODE(bulk_channel_move(&c, buf, &meta, NEVER), BULK_ERR_INVALID_CHANNEL);
    EXPECT_CODE(bulk_channel_assign_pool(&c, a->pool, NEVER), BULK_ERR_INVALID_CHANNEL);
    EXPECT_CODE(bulk_channel_destroy(&c, NEVER), BULK_ERR_INVALID_CHANNEL);
    CHECK(buf->state == BULK_BUFFER_READ_WRITE, "a call on a stale struct changed the buffer");
    c = fresh;
    CHECK(c.state == BULK_STATE_INITIALIZED, "a call on a stale struct changed the new channel (state %d)",
          (int)c.state);
    EXPECT_CODE(bulk_channel_move(&c, buf, &meta, NEVER), BULK_ERR_CHANNEL_STATE);
    EXPECT_OK(bulk_channel_destroy(&c, BULK_CONT_NOP));
    drain(w);
    EXPECT_OK(bulk_alloc_return_buffer(a, buf));
    EXPECT_OK(bulk_waitset_destroy(w));
    CHECK(never_ran == 0, "a refused call's continuation ran");
    printf("stale channel struct: refused, the new channel untouched\n");
}

int main(void)
{
    test_strerror();
    EXPECT_OK(bulk_waitset_create(&ws));
    struct bulk_allocator a, b, c;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    memset(&c, 0, sizeof c);
    test_allocator(&a, &b, &c);
    test_waitset_and_endpoints();
    test_destroyed_waitset();
    test_channels(&a, &b, &c);
    test_stale_channel_struct(&a);
    EXPECT_OK(bulk_alloc_free(&a));
    EXPECT_OK(bulk_alloc_free(&b));
    EXPECT_OK(bulk_alloc_free(&c));
    EXPECT_CODE(bulk_alloc_free(&a), BULK_ERR_INVALID_ALLOCATOR);
    drain(ws);
    EXPECT_OK(bulk_waitset_destroy(ws));
    if (check_failures > 0) {
        printf("error_paths: %u checks failed\n", check_failures);
        return 1;
    }
    printf("error_paths: ok\n");
    return 0;
}
