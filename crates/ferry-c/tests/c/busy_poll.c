/*
 * A program that busy-polls bulk_waitset_dispatch(ws, 0) and never asked
 * for the waitset's fd makes no system call while nothing is due: nobody
 * can sleep on the fd, so dispatch has no reason to arm the channels (the
 * doorbells, whose reads are the system calls counted here). Once the
 * program takes the fd, the fd contract holds: it is readable at once (the
 * program's loop then dispatches until BULK_ERR_TIMEOUT), and after
 * BULK_ERR_TIMEOUT it is quiet and the channels are armed: a buffer moved
 * from another thread makes it readable.
 *
 * The read system calls of this thread are counted by the kernel
 * (/proc/thread-self/io, "syscr").
 *
 * Then both ends of a channel on one waitset with a spin of 0: the echo
 * passes each buffer back from its move_received (a send held back for
 * batching); the next bulk_waitset_dispatch(ws, 0) delivers it
 * (buffer_received) rather than returning BULK_ERR_TIMEOUT while it is due.
 * Prints "busy_poll: ok".
 */
#define _GNU_SOURCE
#include <bulk_transfer/bulk_transfer.h>
#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_local.h>

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>

#include "common.h"

#define POLLS 2000

static struct waitset *ws, *src_ws;
static struct bulk_channel echo, source;
static struct bulk_allocator alloc;
static int bound, pool_ok, moved_in;

static errval_t on_bind(struct bulk_channel *ch)
{
    (void)ch;
    bound = 1;
    return BULK_OK;
}

static void on_pool_done(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    (void)ch;
    EXPECT_OK(err);
    pool_ok = 1;
}

static void on_move(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)ch;
    (void)meta;
    (void)b;
    moved_in++;
}

static struct bulk_channel_callbacks echo_cbs = { .move_received = on_move };

static struct bulk_channel echo2, source2;
static int bound2, pool2_ok, back2;

static errval_t on_bind2(struct bulk_channel *ch)
{
    (void)ch;
    bound2 = 1;
    return BULK_OK;
}

static void on_pool2_done(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    (void)ch;
    EXPECT_OK(err);
    pool2_ok = 1;
}

static void on_move2(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    EXPECT_OK(bulk_channel_pass(ch, b, meta, BULK_CONT_NOP));
}

static void on_back2(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)ch;
    (void)meta;
    (void)b;
    back2++;
}

static struct bulk_channel_callbacks echo2_cbs = { .move_received = on_move2 };
static struct bulk_channel_callbacks source2_cbs = { .bind_received = on_bind2, .buffer_received = on_back2 };

/** Round trips between two ends on one waitset, each in two dispatches. */
static void one_waitset_round_trips(void)
{
    struct waitset *w;
    struct bulk_allocator a2;
    EXPECT_OK(bulk_waitset_create(&w));
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_TX, .role = BULK_ROLE_MASTER, .trust = BULK_TRUST_FULL,
        .meta_size = 8, .waitset = w,
    };
    struct bulk_channel_bind_params params = { .role = BULK_ROLE_GENERIC, .trust = BULK_TRUST_FULL, .waitset = w };
    struct bulk_local_endpoint lep, lremote;
    bulk_local_init_endpoint(&lep, NULL);
    EXPECT_OK(bulk_channel_create(&source2, &lep.generic, &source2_cbs, &setup));
    bulk_local_init_endpoint(&lremote, &source2);
    EXPECT_OK(bulk_channel_bind(&echo2, &lremote.generic, &echo2_cbs, &params, BULK_CONT_NOP));
    WAIT_FOR(w, bound2, "bind");
    EXPECT_OK(bulk_alloc_init(&a2, 1, 4096, NULL));
    EXPECT_OK(bulk_channel_assign_pool(&source2, a2.pool, MK_BULK_CONT(on_pool2_done, NULL)));
    WAIT_FOR(w, pool2_ok, "pool");
    drain(w);
    EXPECT_OK(bulk_waitset_set_spin(w, 0));
    for (int i = 1; i <= 10; i++) {
        struct bulk_buffer *b = bulk_alloc_new_buffer(&a2);
        CHECK(b != NULL, "no buffer");
        EXPECT_OK(bulk_channel_move(&source2, b, NULL, BULK_CONT_NOP));
        EXPECT_OK(bulk_waitset_dispatch(w, 0)); /* move_received, which passes back */
        EXPECT_OK(bulk_waitset_dispatch(w, 0)); /* buffer_received */
        CHECK(back2 == i, "round trip %d: %d buffers back", i, back2);
        EXPECT_OK(bulk_alloc_return_buffer(&a2, b));
    }
    EXPECT_OK(bulk_channel_destroy(&echo2, BULK_CONT_NOP));
    EXPECT_OK(bulk_channel_destroy(&source2, BULK_CONT_NOP));
    drain(w);
    EXPECT_OK(bulk_alloc_free(&a2));
    EXPECT_OK(bulk_waitset_destroy(w));
}
static struct bulk_channel_callbacks source_cbs = { .bind_received = on_bind };

/** The read system calls this thread made so far. */
static unsigned long long reads_so_far(void)
{
    char text[512];
    int fd = open("/proc/thread-self/io", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        FATAL("open /proc/thread-self/io");
    }
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0) {
        FATAL("read /proc/thread-self/io");
    }
    text[n] = 0;
    const char *at = strstr(text, "syscr: ");
    if (at == NULL) {
        FATAL("no syscr in /proc/thread-self/io");
    }
    return strtoull(at + 7, NULL, 10);
}

static void *move_one(void *arg)
{
    (void)arg;
    struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
    CHECK(b != NULL, "no buffer");
    EXPECT_OK(bulk_channel_move(&source, b, NULL, BULK_CONT_NOP));
    return NULL;
}

static int readable(int fd, int ms)
{
    struct pollfd p = { .fd = fd, .events = POLLIN };
    return poll(&p, 1, ms) == 1 && (p.revents & POLLIN);
}

int main(void)
{
    /* The source on a waitset of its own: only the echo's is measured. */
    EXPECT_OK(bulk_waitset_create(&ws));
    EXPECT_OK(bulk_waitset_create(&src_ws));
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_TX, .role = BULK_ROLE_MASTER, .trust = BULK_TRUST_FULL,
        .meta_size = 8, .waitset = src_ws,
    };
    struct bulk_channel_bind_params params = { .role = BULK_ROLE_GENERIC, .trust = BULK_TRUST_FULL, .waitset = ws };
    struct bulk_local_endpoint lep, lremote;
    bulk_local_init_endpoint(&lep, NULL);
    EXPECT_OK(bulk_channel_create(&source, &lep.generic, &source_cbs, &setup));
    bulk_local_init_endpoint(&lremote, &source);
    EXPECT_OK(bulk_channel_bind(&echo, &lremote.generic, &echo_cbs, &params, BULK_CONT_NOP));
    uint64_t deadline = now_ns() + TEST_DEADLINE_NS;
    while (!bound) {
        bulk_waitset_dispatch(ws, 0);
        bulk_waitset_dispatch(src_ws, 0);
        CHECK(now_ns() < deadline, "no bind");
    }
    struct bulk_pool_constraints pc = { .trust = BULK_TRUST_FULL };
    EXPECT_OK(bulk_alloc_init(&alloc, 4, 4096, &pc));
    EXPECT_OK(bulk_channel_assign_pool(&source, alloc.pool, MK_BULK_CONT(on_pool_done, NULL)));
    while (!pool_ok) {
        bulk_waitset_dispatch(ws, 0);
        bulk_waitset_dispatch(src_ws, 0);
        CHECK(now_ns() < deadline, "no pool");
    }
    drain(ws);

    /* Idle and never asked for its fd: polls only. A spin of 0 makes every
     * dispatch end where it would arm. */
    EXPECT_OK(bulk_waitset_set_spin(ws, 0));
    unsigned long long base = reads_so_far();
    unsigned long long calibrate = reads_so_far() - base; /* the count's own reads */
    base = reads_so_far();
    for (int i = 0; i < POLLS; i++) {
        EXPECT_CODE(bulk_waitset_dispatch(ws, 0), BULK_ERR_TIMEOUT);
    }
    unsigned long long reads = reads_so_far() - base - calibrate;
    CHECK(reads == 0, "%llu read system calls in %d polls of an idle waitset", reads, POLLS);

    /* Taken now, the fd is readable at once; dispatch until
     * BULK_ERR_TIMEOUT arms the channels and quiets it. */
    int fd = bulk_waitset_fd(ws);
    CHECK(fd >= 0, "no fd");
    CHECK(readable(fd, 0), "the fd just handed out is not readable");
    drain(ws);
    CHECK(!readable(fd, 0), "the fd is readable after BULK_ERR_TIMEOUT");
    pthread_t t;
    CHECK(pthread_create(&t, NULL, move_one, NULL) == 0, "pthread_create");
    pthread_join(t, NULL);
    CHECK(readable(fd, 60000), "a buffer moved to an armed waitset left its fd quiet");
    drain(ws);
    CHECK(moved_in == 1, "%d moves arrived", moved_in);

    EXPECT_OK(bulk_channel_destroy(&echo, BULK_CONT_NOP));
    EXPECT_OK(bulk_channel_destroy(&source, BULK_CONT_NOP));
    drain(ws);
    drain(src_ws);
    EXPECT_OK(bulk_alloc_free(&alloc));
    EXPECT_OK(bulk_waitset_destroy(ws));
    EXPECT_OK(bulk_waitset_destroy(src_ws));
    one_waitset_round_trips();
    printf("busy_poll: ok\n");
    return 0;
}
