/*
 * A destroyed channel end that waits for its peer wakes the program's own
 * event loop: what the peer passes back after the destroy (sent before it
 * saw the teardown) reaches the pool, although the program dispatches only
 * when bulk_waitset_fd is readable.
 *
 *   linger_epoll local|sm|net
 *
 * Both ends live in this thread, each on its own waitset; the source's fd
 * is in the program's epoll set. The source moves COUNT buffers and the
 * echo keeps them all. The source's channel is destroyed and its waitset
 * drained: the destroy's continuation runs and the fd goes quiet. Then the
 * echo passes every buffer back (it has not dispatched since, so it has not
 * seen the teardown) and only then dispatches, sees the teardown and closes.
 * Checked at the source:
 *
 *  - its fd wakes for the passes back, and again for the echo's closing;
 *  - then the allocator holds every buffer;
 *  - once drained, the fd is quiet.
 *
 * Ends with "linger_epoll: ok"; under the sanitizers nothing leaks.
 */
#define _GNU_SOURCE
#include "pair.h"

#include <bulk_transfer/bulk_allocator.h>

#include <errno.h>
#include <sys/epoll.h>
#include <unistd.h>

#define COUNT 16
#define SIZE 4096
#define META_SIZE 8

static struct waitset *source_ws, *echo_ws;
static struct bulk_channel source, echo;
static struct bulk_allocator alloc;
static struct bulk_buffer *held[COUNT];
static unsigned held_n, echo_torn_down;
static int bound, pool_ok, destroyed;
static int epfd;

static errval_t source_bind_received(struct bulk_channel *ch)
{
    (void)ch;
    bound = 1;
    return BULK_OK;
}

static void echo_move_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)ch;
    (void)meta;
    CHECK(held_n < COUNT, "more moves than buffers");
    held[held_n++] = b;
}

static void echo_teardown(struct bulk_channel *ch)
{
    (void)ch;
    echo_torn_down++;
}

static void flag_done(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)ch;
    CHECK(err == BULK_OK, "a continuation got %s", bulk_strerror(err));
    *(int *)arg = 1;
}

/** Whether the source's fd is readable within `timeout_ms`. */
static int source_readable(int timeout_ms)
{
    struct epoll_event ev;
    int n;
    do {
        n = epoll_wait(epfd, &ev, 1, timeout_ms);
    } while (n < 0 && errno == EINTR);
    CHECK(n >= 0, "epoll_wait: %s", strerror(errno));
    return n == 1;
}

/** How many buffers the allocator can hand out now (all given back). */
static unsigned allocatable(void)
{
    struct bulk_buffer *all[COUNT];
    unsigned n = 0;
    while (n < COUNT && (all[n] = bulk_alloc_new_buffer(&alloc)) != NULL) {
        n++;
    }
    for (unsigned i = 0; i < n; i++) {
        EXPECT_OK(bulk_alloc_return_buffer(&alloc, all[i]));
    }
    return n;
}

int main(int argc, char **argv)
{
    enum pair_kind kind = pair_kind_of(argc, argv);
    EXPECT_OK(bulk_waitset_create(&source_ws));
    EXPECT_OK(bulk_waitset_create(&echo_ws));
    static struct bulk_channel_callbacks source_cbs = { .bind_received = source_bind_received };
    static struct bulk_channel_callbacks echo_cbs = {
        .move_received = echo_move_received,
        .teardown_received = echo_teardown,
    };
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_TX,
        .role = BULK_ROLE_MASTER,
        .trust = BULK_TRUST_FULL,
        .meta_size = META_SIZE,
        .waitset = source_ws,
    };
    struct bulk_channel_bind_params params = { .role = BULK_ROLE_GENERIC, .trust = BULK_TRUST_FULL, .waitset = echo_ws };
    struct pair_endpoints eps;
    pair_connect(&eps, kind, "linger-epoll", &source, &source_cbs, &setup, &echo, &echo_cbs, &params, BULK_CONT_NOP);

    /* The source's fd in the program's own epoll set. */
    epfd = epoll_create1(EPOLL_CLOEXEC);
    CHECK(epfd >= 0, "epoll_create1: %s", strerror(errno));
    struct epoll_event ev = { .events = EPOLLIN };
    CHECK(epoll_ctl(epfd, EPOLL_CTL_ADD, bulk_waitset_fd(source_ws), &ev) == 0, "epoll_ctl: %s", strerror(errno));

    uint64_t deadline = now_ns() + TEST_DEADLINE_NS;
    while (!bound) {
        drain(echo_ws);
        drain(source_ws);
        CHECK(now_ns() < deadline, "no bind");
    }
    struct bulk_pool_constraints pc = { .trust = BULK_TRUST_FULL };
    EXPECT_OK(bulk_alloc_init(&alloc, COUNT, SIZE, &pc));
    EXPECT_OK(bulk_channel_assign_pool(&source, alloc.pool, MK_BULK_CONT(flag_done, &pool_ok)));
    while (!pool_ok) {
        drain(echo_ws);
        drain(source_ws);
        CHECK(now_ns() < deadline, "no pool assignment");
    }

    /* Every buffer to the echo, which keeps them. */
    for (uint64_t i = 0; i < COUNT; i++) {
        struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
        CHECK(b != NULL, "buffer %" PRIu64 " of %d", i, COUNT);
        EXPECT_OK(bulk_channel_move(&source, b, &i, BULK_CONT_NOP));
    }
    while (held_n < COUNT) {
        drain(echo_ws);
        CHECK(now_ns() < deadline, "the echo got %u of %d moves", held_n, COUNT);
    }
    drain(source_ws);

    /* The source goes; its end lingers, armed. */
    EXPECT_OK(bulk_channel_destroy(&source, MK_BULK_CONT(flag_done, &destroyed)));
    while (!destroyed) {
        CHECK(source_readable(10000), "the destroy's continuation did not wake the fd");
        drain(source_ws);
    }
    CHECK(!source_readable(20), "the fd is readable after the destroy with nothing come");

    /* The echo gives everything back before it sees the teardown. */
    CHECK(echo_torn_down == 0, "the echo saw the teardown before it dispatched");
    for (unsigned i = 0; i < held_n; i++) {
        uint64_t meta = i;
        EXPECT_OK(bulk_channel_pass(&echo, held[i], &meta, BULK_CONT_NOP));
    }
    CHECK(source_readable(10000), "the passes back to the destroyed end did not wake the fd");
    drain(source_ws);

    /* The echo sees the teardown and closes; the source's end goes. */
    while (echo_torn_down == 0) {
        drain(echo_ws);
        CHECK(now_ns() < deadline, "the echo never saw the teardown");
    }
    CHECK(source_readable(10000), "the echo's closing did not wake the fd");
    drain(source_ws);
    unsigned n = allocatable();
    CHECK(n == COUNT, "after the destroy %u of %d buffers can be allocated", n, COUNT);
    CHECK(!source_readable(20), "the fd is readable with nothing due after the end went");

    EXPECT_OK(bulk_channel_destroy(&echo, BULK_CONT_NOP));
    drain(echo_ws);
    drain(source_ws);
    EXPECT_OK(bulk_alloc_free(&alloc));
    close(epfd);
    EXPECT_OK(bulk_waitset_destroy(source_ws));
    EXPECT_OK(bulk_waitset_destroy(echo_ws));
    pair_destroy_endpoints(&eps);
    printf("linger_epoll: ok (%s)\n", argv[1]);
    return 0;
}
