/*
 * Calls on one channel from several threads at once, and its destruction
 * in the middle of them. "Every function may be called from any thread":
 * this program holds the library to it.
 *
 *   threads local|sm|net
 *
 * Both ends of a channel live in this process, each on its own waitset,
 * each waitset dispatched by its own thread: the echo passes every buffer
 * back from move_received, the source's buffer_received checks it and
 * returns it to the allocator. Three worker threads, none of them a
 * dispatcher, allocate buffers, write a pattern that names the move, and
 * move them (each send from a worker is published before the call
 * returns).
 *
 *  1. The workers make WORKER_MOVES moves each: every one comes back with
 *     its bytes intact, and the allocator holds every buffer again.
 *  2. The workers move without end while the main thread destroys the
 *     source channel: every call of a worker returns OK, QUEUE_FULL or
 *     says that the channel is gone (destroyed, closed); a buffer whose
 *     move was refused goes back to the allocator (a worker stops at its
 *     first refusal); the echo hears of the
 *     teardown; and once the destroy completed and the buffers the echo
 *     was holding went back too, the allocator holds every buffer: none
 *     was lost in flight.
 *
 * Ends with "threads: ok"; under the sanitizers nothing leaks.
 */
#define _GNU_SOURCE
#include "pair.h"

#include <bulk_transfer/bulk_allocator.h>

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>

#define COUNT 64
#define SIZE 4096
#define WORKERS 3
#define WORKER_MOVES 3000
/* Phase 2 destroys the source once this many more moves came back. */
#define BEFORE_DESTROY 2000
#define META_SIZE 16

static struct bulk_channel source, echo;
static struct bulk_allocator alloc;
static struct waitset *source_ws, *echo_ws;

static atomic_uint_fast64_t next_seq, sent, back, refused_after_destroy;
static atomic_int source_bound, pool_ok, destroyed, echo_torn_down;
static atomic_int stop_source_thread, stop_echo_thread, stop_workers;

/* Buffers the echo could not pass back (its queue full, or the channel
 * gone); only the echo thread touches them while it runs. */
static struct bulk_buffer *echo_held[COUNT];
static uint64_t echo_held_meta[COUNT][2];
static size_t echo_held_n;
/* The last thing that happened to each buffer (for the report of a buffer
 * that did not come back). */
enum last_event { LAST_NONE, LAST_MOVED, LAST_PASSED, LAST_RETURNED, LAST_PASS_REFUSED };
static const char *const last_event_name[] = { "nothing", "moved by a worker", "passed back by the echo",
                                               "returned by the source", "held by the echo (pass refused)" };
static _Atomic int last_event[COUNT];

/** The pattern of move `seq`: its first and last words. */
static void stamp(struct bulk_buffer *b, uint64_t seq)
{
    uint64_t *w = b->address;
    w[0] = seq;
    w[SIZE / sizeof *w - 1] = ~seq;
}

/** Checks that `b` carries the pattern that `meta` names. */
static void check_stamp(const char *who, struct bulk_buffer *b, const void *meta)
{
    uint64_t m[2];
    memcpy(m, meta, sizeof m);
    const uint64_t *w = b->address;
    CHECK(w[0] == m[0] && w[SIZE / sizeof *w - 1] == ~m[0] && m[1] == (m[0] ^ 0x5eed),
          "%s: buffer %u carries move %" PRIu64 "/%" PRIu64 ", its meta data says %" PRIu64, who, b->bufferid, w[0],
          ~w[SIZE / sizeof *w - 1], m[0]);
}

/* Source --------------------------------------------------------------------- */

static errval_t source_bind_received(struct bulk_channel *ch)
{
    (void)ch;
    atomic_store(&source_bound, 1);
    return BULK_OK;
}

static void source_buffer_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)ch;
    check_stamp("source", b, meta);
    atomic_store(&last_event[b->bufferid], LAST_RETURNED);
    EXPECT_OK(bulk_alloc_return_buffer(&alloc, b));
    atomic_fetch_add(&back, 1);
}

static struct bulk_channel_callbacks source_cbs = {
    .bind_received = source_bind_received,
    .buffer_received = source_buffer_received,
};

static void pool_done(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    (void)ch;
    if (err != BULK_OK) {
        FATAL("assign the pool: %s", bulk_strerror(err));
    }
    atomic_store(&pool_ok, 1);
}

static void source_destroyed(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    (void)ch;
    CHECK(err == BULK_OK, "the source's destroy completed with %s", bulk_strerror(err));
    atomic_store(&destroyed, 1);
}

/* Echo ----------------------------------------------------------------------- */

static void echo_keep(struct bulk_buffer *b, const void *meta)
{
    if (echo_held_n == COUNT) {
        FATAL("echo: holds more buffers than the pool has");
    }
    echo_held[echo_held_n] = b;
    memcpy(echo_held_meta[echo_held_n], meta, sizeof echo_held_meta[0]);
    echo_held_n++;
}

/** Passes `b` back; keeps it if the queue is full or the channel is gone. */
static void echo_pass(struct bulk_buffer *b, void *meta)
{
    uint32_t id = b->bufferid;
    errval_t e = bulk_channel_pass(&echo, b, meta, BULK_CONT_NOP);
    if (e == BULK_OK) {
        atomic_store(&last_event[id], LAST_PASSED);
        return;
    }
    atomic_store(&last_event[id], LAST_PASS_REFUSED);
    CHECK(e == BULK_ERR_QUEUE_FULL || e == BULK_ERR_CHANNEL_CLOSED || e == BULK_ERR_PEER_GONE,
          "echo: bulk_channel_pass: %s", bulk_strerror(e));
    echo_keep(b, meta);
}

static void echo_move_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)ch;
    check_stamp("echo", b, meta);
    if (echo_held_n > 0) {
        echo_keep(b, meta); /* behind the ones that wait: keep the order */
        return;
    }
    echo_pass(b, meta);
}

static void echo_teardown(struct bulk_channel *ch)
{
    (void)ch;
    atomic_store(&echo_torn_down, 1);
}

static void echo_bound(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    (void)ch;
    if (err != BULK_OK) {
        FATAL("echo: bind: %s", bulk_strerror(err));
    }
}

static struct bulk_channel_callbacks echo_cbs = {
    .move_received = echo_move_received,
    .teardown_received = echo_teardown,
};

/* Threads -------------------------------------------------------------------- */

static void dispatch_step(struct waitset *ws, const char *who)
{
    errval_t e = bulk_waitset_dispatch(ws, 1000000);
    if (e != BULK_OK && e != BULK_ERR_TIMEOUT) {
        FATAL("%s: dispatch: %s", who, bulk_strerror(e));
    }
}

static void *source_thread(void *arg)
{
    (void)arg;
    while (!atomic_load(&stop_source_thread)) {
        dispatch_step(source_ws, "source");
    }
    return NULL;
}

static void *echo_thread(void *arg)
{
    (void)arg;
    while (!atomic_load(&stop_echo_thread)) {
        dispatch_step(echo_ws, "echo");
        /* Retry the buffers held back while the channel lives. */
        size_t n = echo_held_n;
        if (n > 0 && !atomic_load(&echo_torn_down)) {
            struct bulk_buffer *held[COUNT];
            uint64_t meta[COUNT][2];
            memcpy(held, echo_held, n * sizeof held[0]);
            memcpy(meta, echo_held_meta, n * sizeof meta[0]);
            echo_held_n = 0;
            for (size_t i = 0; i < n; i++) {
                if (echo_held_n > 0) {
                    echo_keep(held[i], meta[i]);
                } else {
                    echo_pass(held[i], meta[i]);
                }
            }
        }
    }
    return NULL;
}

/** A worker: moves buffers until its quota is met (0: no quota) or the
 *  channel is gone. */
static void *worker(void *arg)
{
    uint64_t quota = *(uint64_t *)arg, made = 0;
    while (!atomic_load(&stop_workers) && (quota == 0 || made < quota)) {
        struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
        if (b == NULL) {
            sched_yield();
            continue;
        }
        uint64_t seq = atomic_fetch_add(&next_seq, 1);
        uint64_t meta[2] = { seq, seq ^ 0x5eed };
        stamp(b, seq);
        uint32_t id = b->bufferid;
        errval_t e = bulk_channel_move(&source, b, meta, BULK_CONT_NOP);
        if (e == BULK_OK) {
            atomic_store(&last_event[id], LAST_MOVED);
            atomic_fetch_add(&sent, 1);
            made++;
            continue;
        }
        EXPECT_OK(bulk_alloc_return_buffer(&alloc, b));
        if (e == BULK_ERR_QUEUE_FULL) {
            sched_yield();
            continue;
        }
        if (atomic_load(&destroyed) || quota == 0) {
            CHECK(e == BULK_ERR_INVALID_CHANNEL || e == BULK_ERR_CHANNEL_CLOSED || e == BULK_ERR_CHANNEL_DESTROYED,
                  "a move racing the destroy: %s", bulk_strerror(e));
            atomic_fetch_add(&refused_after_destroy, 1);
            return NULL;
        }
        FATAL("bulk_channel_move: %s", bulk_strerror(e));
    }
    return NULL;
}

static void run_workers(uint64_t quota, pthread_t *t)
{
    static uint64_t q;
    q = quota;
    for (int i = 0; i < WORKERS; i++) {
        if (pthread_create(&t[i], NULL, worker, &q) != 0) {
            FATAL("cannot start a worker thread");
        }
    }
}

static void join(pthread_t *t, int n)
{
    for (int i = 0; i < n; i++) {
        pthread_join(t[i], NULL);
    }
}

/** Sleeps until `cond` holds (other threads make it true), or fails. */
#define AWAIT(cond, what)                                                  \
    do {                                                                   \
        uint64_t deadline_ = now_ns() + TEST_DEADLINE_NS;                  \
        while (!(cond)) {                                                  \
            if (now_ns() > deadline_) {                                    \
                FATAL("no %s within the deadline", (what));                \
            }                                                              \
            usleep(200);                                                   \
        }                                                                  \
    } while (0)

/* Main ----------------------------------------------------------------------- */

int main(int argc, char **argv)
{
    enum pair_kind kind = pair_kind_of(argc, argv);
    EXPECT_OK(bulk_waitset_create(&source_ws));
    EXPECT_OK(bulk_waitset_create(&echo_ws));
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_TX,
        .role = BULK_ROLE_MASTER,
        .trust = BULK_TRUST_FULL,
        .meta_size = META_SIZE,
        .waitset = source_ws,
    };
    struct bulk_channel_bind_params params = { .role = BULK_ROLE_GENERIC, .trust = BULK_TRUST_FULL, .waitset = echo_ws };
    struct pair_endpoints eps;
    pair_connect(&eps, kind, "threads", &source, &source_cbs, &setup, &echo, &echo_cbs, &params,
                 MK_BULK_CONT(echo_bound, NULL));
    pthread_t source_t, echo_t, workers[WORKERS];
    if (pthread_create(&source_t, NULL, source_thread, NULL) != 0
        || pthread_create(&echo_t, NULL, echo_thread, NULL) != 0) {
        FATAL("cannot start the dispatching threads");
    }
    AWAIT(atomic_load(&source_bound), "bind");
    struct bulk_pool_constraints pc = { .trust = BULK_TRUST_FULL };
    EXPECT_OK(bulk_alloc_init(&alloc, COUNT, SIZE, &pc));
    EXPECT_OK(bulk_channel_assign_pool(&source, alloc.pool, MK_BULK_CONT(pool_done, NULL)));
    AWAIT(atomic_load(&pool_ok), "pool assignment");

    /* 1. Quotas: everything comes back. */
    run_workers(WORKER_MOVES, workers);
    join(workers, WORKERS);
    CHECK(atomic_load(&sent) == (uint64_t)WORKERS * WORKER_MOVES, "%" PRIu64 " moves made", atomic_load(&sent));
    AWAIT(atomic_load(&back) == atomic_load(&sent), "return of every move");
    CHECK(alloc.num_free == COUNT, "after phase 1 the allocator holds %zu of %d buffers", (size_t)alloc.num_free,
          COUNT);

    /* 2. The source is destroyed while the workers move. */
    uint64_t back_before = atomic_load(&back);
    run_workers(0, workers);
    AWAIT(atomic_load(&back) >= back_before + BEFORE_DESTROY, "moves before the destroy");
    EXPECT_OK(bulk_channel_destroy(&source, MK_BULK_CONT(source_destroyed, NULL)));
    AWAIT(atomic_load(&destroyed), "completion of the destroy");
    AWAIT(atomic_load(&echo_torn_down), "teardown at the echo");
    /* A worker ends at its first refused move, or now (it may be waiting
     * for a buffer: the echo holds some until the program returns them). */
    atomic_store(&stop_workers, 1);
    join(workers, WORKERS);
    atomic_store(&stop_echo_thread, 1);
    pthread_join(echo_t, NULL);
    EXPECT_OK(bulk_channel_destroy(&echo, BULK_CONT_NOP));
    drain(echo_ws);
    for (size_t i = 0; i < echo_held_n; i++) {
        EXPECT_OK(bulk_alloc_return_buffer(&alloc, echo_held[i]));
    }
    atomic_store(&stop_source_thread, 1);
    pthread_join(source_t, NULL);
    drain(source_ws);
    /* Every buffer can be allocated again; the ones that cannot are named,
     * with what last happened to them. */
    struct bulk_buffer *all[COUNT];
    size_t got = 0;
    while (got < COUNT && (all[got] = bulk_alloc_new_buffer(&alloc)) != NULL) {
        got++;
    }
    if (got < COUNT) {
        int found[COUNT] = { 0 };
        for (size_t i = 0; i < got; i++) {
            found[all[i]->bufferid] = 1;
        }
        for (int i = 0; i < COUNT; i++) {
            if (!found[i]) {
                fprintf(stderr, "buffer %d did not come back; last %s\n", i, last_event_name[atomic_load(&last_event[i])]);
            }
        }
        FAIL("after the destroy %zu of %d buffers can be allocated (%zu were with the echo)", got, COUNT, echo_held_n);
    }
    for (size_t i = 0; i < got; i++) {
        EXPECT_OK(bulk_alloc_return_buffer(&alloc, all[i]));
    }
    CHECK(alloc.num_free == COUNT, "the allocator says %zu of %d buffers are free", (size_t)alloc.num_free, COUNT);

    EXPECT_OK(bulk_alloc_free(&alloc));
    EXPECT_OK(bulk_waitset_destroy(source_ws));
    EXPECT_OK(bulk_waitset_destroy(echo_ws));
    pair_destroy_endpoints(&eps);
    printf("threads: ok (%" PRIu64 " moves; at the destroy %zu buffers with the echo, %" PRIu64
           " moves refused)\n",
           atomic_load(&sent), echo_held_n, atomic_load(&refused_after_destroy));
    return 0;
}
