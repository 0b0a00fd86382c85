/*
 * The work of the C interface per round trip, without waiting: one thread
 * holds both ends of a channel on one waitset, moves a buffer, and
 * dispatches until the echo end passed it back (its move_received passes
 * it at once). Nothing spins for a peer, so every instruction counted is
 * work: run it under `valgrind --tool=callgrind` (or `perf stat -e
 * instructions:u`) and divide by the round trips. Busy polling, trust FULL,
 * 4 KiB buffers, one in flight (rtt) or WINDOW in flight (throughput).
 *
 *   bulk_work local|sm ROUND_TRIPS [WINDOW]
 *
 * sm: both ends in this process over a Unix socket path (a pool travels
 * as it does between processes).
 *
 * With a WINDOW above 1 the source sends its next move from its
 * buffer_received callback (published in a batch, as the echo's passes
 * are), like bulk_bench's throughput source and Rust's round_trip_work
 * --batch; the window's first moves come from the main loop.
 */
#define _GNU_SOURCE
#include <bulk_transfer/bulk_transfer.h>
#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_local.h>
#include <bulk_transfer/bulk_sm.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define META_SIZE 16

static struct bulk_channel source, echo;
static struct bulk_allocator alloc;
static unsigned long back, sent, total, window = 1;
static int bound, pool_ok;

static void fail(const char *what, errval_t e)
{
    fprintf(stderr, "bulk_work: %s: %s\n", what, bulk_strerror(e));
    exit(1);
}

static void step(struct waitset *ws)
{
    errval_t e = bulk_waitset_dispatch(ws, 0);
    if (e != BULK_OK && e != BULK_ERR_TIMEOUT) {
        fail("dispatch", e);
    }
}

static void echo_move(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    errval_t e = bulk_channel_pass(ch, b, meta, BULK_CONT_NOP);
    if (e != BULK_OK) {
        fail("pass", e);
    }
}

static void source_back(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)meta;
    errval_t e = bulk_alloc_return_buffer(&alloc, b);
    if (e != BULK_OK) {
        fail("return", e);
    }
    back++;
    if (window > 1 && sent < total) {
        struct bulk_buffer *next = bulk_alloc_new_buffer(&alloc);
        unsigned char m[META_SIZE] = { 0 };
        if (next != NULL) {
            if ((e = bulk_channel_move(ch, next, m, BULK_CONT_NOP)) != BULK_OK) {
                fail("move from the callback", e);
            }
            sent++;
        }
    }
}

static errval_t source_bind(struct bulk_channel *ch)
{
    (void)ch;
    bound = 1;
    return BULK_OK;
}

static void echo_bound(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    (void)ch;
    if (err != BULK_OK) {
        fail("bind", err);
    }
}

static void pool_done(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    (void)ch;
    if (err != BULK_OK) {
        fail("assign", err);
    }
    pool_ok = 1;
}

static struct bulk_channel_callbacks source_cbs = { .bind_received = source_bind, .buffer_received = source_back };
static struct bulk_channel_callbacks echo_cbs = { .move_received = echo_move };

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s local|sm ROUND_TRIPS [WINDOW]\n", argv[0]);
        return 2;
    }
    int sm = strcmp(argv[1], "sm") == 0;
    unsigned long n = strtoul(argv[2], NULL, 0);
    total = n;
    window = argc > 3 ? strtoul(argv[3], NULL, 0) : 1;
    if (window == 0 || window > 512) {
        fprintf(stderr, "bulk_work: WINDOW must be 1 to 512\n");
        return 2;
    }
    struct waitset *ws;
    if (bulk_waitset_create(&ws) != BULK_OK) {
        return 1;
    }
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_TX, .role = BULK_ROLE_MASTER, .trust = BULK_TRUST_FULL,
        .meta_size = META_SIZE, .waitset = ws,
    };
    struct bulk_channel_bind_params params = { .role = BULK_ROLE_GENERIC, .trust = BULK_TRUST_FULL, .waitset = ws };
    struct bulk_local_endpoint lep, lremote;
    struct bulk_sm_endpoint_descriptor sep, sremote;
    char path[108];
    snprintf(path, sizeof path, "/tmp/ferry-bulk-work-%d.sock", (int)getpid());
    errval_t e;
    if (sm) {
        bulk_sm_ep_create(&sep, path);
        bulk_sm_ep_create_remote(&sremote, path);
        if ((e = bulk_channel_create(&source, &sep.ep_generic, &source_cbs, &setup)) != BULK_OK) {
            fail("create", e);
        }
        if ((e = bulk_channel_bind(&echo, &sremote.ep_generic, &echo_cbs, &params, MK_BULK_CONT(echo_bound, NULL)))
            != BULK_OK) {
            fail("bind", e);
        }
    } else {
        bulk_local_init_endpoint(&lep, NULL);
        if ((e = bulk_channel_create(&source, &lep.generic, &source_cbs, &setup)) != BULK_OK) {
            fail("create", e);
        }
        bulk_local_init_endpoint(&lremote, &source);
        if ((e = bulk_channel_bind(&echo, &lremote.generic, &echo_cbs, &params, MK_BULK_CONT(echo_bound, NULL)))
            != BULK_OK) {
            fail("bind", e);
        }
    }
    while (!bound) {
        step(ws);
    }
    struct bulk_pool_constraints pc = { .trust = BULK_TRUST_FULL };
    if ((e = bulk_alloc_init(&alloc, window, 4096, &pc)) != BULK_OK) {
        fail("alloc", e);
    }
    if ((e = bulk_channel_assign_pool(&source, alloc.pool, MK_BULK_CONT(pool_done, NULL))) != BULK_OK) {
        fail("assign", e);
    }
    while (!pool_ok) {
        step(ws);
    }
    unsigned char meta[META_SIZE] = { 0 };
    while (back < n) {
        while (sent < n && sent - back < window) {
            struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
            if (b == NULL) {
                break;
            }
            if ((e = bulk_channel_move(&source, b, meta, BULK_CONT_NOP)) != BULK_OK) {
                fail("move", e);
            }
            sent++;
        }
        step(ws);
    }
    bulk_channel_destroy(&echo, BULK_CONT_NOP);
    bulk_channel_destroy(&source, BULK_CONT_NOP);
    while (bulk_waitset_dispatch(ws, 0) == BULK_OK) {
    }
    bulk_alloc_free(&alloc);
    bulk_waitset_destroy(ws);
    if (sm) {
        unlink(path);
    }
    printf("%lu round trips\n", back);
    return 0;
}
