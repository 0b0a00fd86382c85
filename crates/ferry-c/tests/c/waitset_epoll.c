/*
 * bulk_waitset_fd in a program's own epoll set, beside a timerfd: the fd is
 * readable when a callback or continuation is due and quiet when nothing is;
 * bulk_waitset_dispatch(ws, 0) returns BULK_ERR_TIMEOUT at once when nothing
 * is due; a transfer of many buffers between two local channels runs to its
 * end driven only by the epoll loop (the fd is never read by the program).
 */
#define _GNU_SOURCE
#include <bulk_transfer/bulk_transfer.h>
#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_local.h>

#include <errno.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include "common.h"

#define TAG_WS 1
#define TAG_TIMER 2
#define ROUNDS 200

static struct waitset *ws;
static int epfd, tfd, wsfd;
static struct bulk_channel rx, tx;
static struct bulk_allocator alloc;

static unsigned bind_received, pool_assigned_rx, moves_in, buffers_back, teardowns;
static unsigned bound_cont, assigned_cont, destroyed_tx, destroyed_rx, move_conts, pass_conts;
static errval_t assign_err = 12345;

static errval_t on_bind_received(struct bulk_channel *ch)
{
    CHECK(ch == &rx, "bind_received on tx");
    bind_received++;
    return BULK_OK;
}

static errval_t on_pool_assigned(struct bulk_channel *ch, struct bulk_pool *pool)
{
    (void)pool;
    CHECK(ch == &rx, "pool_assigned on tx");
    pool_assigned_rx++;
    return BULK_OK;
}

static void count_cont(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)ch;
    CHECK(err == BULK_OK, "a continuation got %s", bulk_strerror(err));
    (*(unsigned *)arg)++;
}

static void on_assigned(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    CHECK(ch == &tx, "assign continuation on rx");
    assign_err = err;
    assigned_cont++;
}

static void on_move_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    CHECK(ch == &rx, "move_received on tx");
    moves_in++;
    EXPECT_OK(bulk_channel_pass(&rx, b, meta, MK_BULK_CONT(count_cont, &pass_conts)));
}

static void on_buffer_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)meta;
    CHECK(ch == &tx, "buffer_received on rx");
    buffers_back++;
    EXPECT_OK(bulk_alloc_return_buffer(&alloc, b));
}

static void on_teardown(struct bulk_channel *ch)
{
    CHECK(ch == &rx, "teardown_received on tx");
    teardowns++;
}

/** Arms the timer to fire once after `ms` milliseconds (0: disarm). */
static void arm_timer(long ms, long interval_ms)
{
    struct itimerspec its = {
        .it_value = { .tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000 },
        .it_interval = { .tv_sec = interval_ms / 1000, .tv_nsec = (interval_ms % 1000) * 1000000 },
    };
    CHECK(timerfd_settime(tfd, 0, &its, NULL) == 0, "timerfd_settime: %s", strerror(errno));
}

/** Reads the timer's expirations (0 if none). */
static uint64_t take_timer(void)
{
    uint64_t n = 0;
    if (read(tfd, &n, sizeof n) != (ssize_t)sizeof n) {
        return 0;
    }
    return n;
}

/** One epoll_wait; returns a bit set of the tags that are ready. */
static unsigned poll_once(int timeout_ms)
{
    struct epoll_event evs[4];
    int n;
    do {
        n = epoll_wait(epfd, evs, 4, timeout_ms);
    } while (n < 0 && errno == EINTR);
    CHECK(n >= 0, "epoll_wait: %s", strerror(errno));
    unsigned ready = 0;
    for (int i = 0; i < n; i++) {
        ready |= 1u << evs[i].data.u32;
    }
    return ready;
}

/** Waits until the waitset's fd is readable, with the timer as a
 *  10-second guard; fails if the guard fires first. Then runs what is due. */
static unsigned wait_readable_and_drain(const char *what)
{
    arm_timer(10000, 0);
    unsigned ready = poll_once(-1);
    CHECK(ready & (1u << TAG_WS), "the waitset's fd did not become readable for %s within 10 s", what);
    arm_timer(0, 0);
    take_timer();
    unsigned ran = drain(ws);
    CHECK(ran > 0, "the fd was readable for %s but nothing was due", what);
    CHECK(poll_once(0) == 0, "the waitset's fd stays readable after dispatch returned BULK_ERR_TIMEOUT");
    return ran;
}

int main(void)
{
    EXPECT_OK(bulk_waitset_create(&ws));
    wsfd = bulk_waitset_fd(ws);
    CHECK(wsfd >= 0, "bulk_waitset_fd gave %d", wsfd);
    CHECK(bulk_waitset_fd(ws) == wsfd, "bulk_waitset_fd changes between calls");
    epfd = epoll_create1(EPOLL_CLOEXEC);
    tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    CHECK(epfd >= 0 && tfd >= 0, "epoll/timerfd: %s", strerror(errno));
    struct epoll_event ev = { .events = EPOLLIN, .data.u32 = TAG_WS };
    CHECK(epoll_ctl(epfd, EPOLL_CTL_ADD, wsfd, &ev) == 0, "epoll_ctl waitset fd: %s", strerror(errno));
    ev.data.u32 = TAG_TIMER;
    CHECK(epoll_ctl(epfd, EPOLL_CTL_ADD, tfd, &ev) == 0, "epoll_ctl timerfd: %s", strerror(errno));

    /* Idle: nothing due, the fd is quiet, dispatch(ws, 0) does not block. */
    uint64_t t0 = now_ns();
    EXPECT_CODE(bulk_waitset_dispatch(ws, 0), BULK_ERR_TIMEOUT);
    CHECK(now_ns() - t0 < 2000000000ull, "bulk_waitset_dispatch(ws, 0) on an idle waitset blocked");
    CHECK(poll_once(0) == 0, "an idle waitset's fd is readable");

    /* Bind: bind_received and the bind continuation become due. */
    struct bulk_local_endpoint rx_ep, tx_ep;
    struct bulk_channel_callbacks rx_cbs = {
        .bind_received = on_bind_received,
        .pool_assigned = on_pool_assigned,
        .move_received = on_move_received,
        .teardown_received = on_teardown,
    };
    struct bulk_channel_callbacks tx_cbs = { .buffer_received = on_buffer_received };
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_RX,
        .role = BULK_ROLE_SLAVE,
        .trust = BULK_TRUST_FULL,
        .meta_size = sizeof(uint64_t),
        .waitset = ws,
    };
    bulk_local_init_endpoint(&rx_ep, NULL);
    EXPECT_OK(bulk_channel_create(&rx, &rx_ep.generic, &rx_cbs, &setup));
    CHECK(rx.waitset == ws, "rx.waitset");
    drain(ws);
    CHECK(poll_once(0) == 0, "the fd is readable with nothing due after create");
    struct bulk_channel_bind_params params = { .waitset = ws };
    bulk_local_init_endpoint(&tx_ep, &rx);
    EXPECT_OK(bulk_channel_bind(&tx, &tx_ep.generic, &tx_cbs, &params, MK_BULK_CONT(count_cont, &bound_cont)));
    /* Continuations run from dispatch only. */
    CHECK(bound_cont == 0 && bind_received == 0, "a callback ran outside dispatch");
    wait_readable_and_drain("the bind");
    CHECK(bound_cont == 1 && bind_received == 1, "bind: continuation ran %u times, bind_received %u times",
          bound_cont, bind_received);

    /* Idle again: only the timer fires. */
    arm_timer(50, 0);
    unsigned ready = poll_once(-1);
    CHECK(ready == (1u << TAG_TIMER), "idle: expected only the timer, got ready set %#x", ready);
    CHECK(take_timer() == 1, "timer");
    EXPECT_CODE(bulk_waitset_dispatch(ws, 0), BULK_ERR_TIMEOUT);

    /* A pool: pool_assigned on rx, then the continuation on tx. */
    EXPECT_OK(bulk_alloc_init(&alloc, 8, 4096, NULL));
    EXPECT_OK(bulk_channel_assign_pool(&tx, alloc.pool, MK_BULK_CONT(on_assigned, NULL)));
    uint64_t deadline = now_ns() + TEST_DEADLINE_NS;
    while (assigned_cont == 0) {
        wait_readable_and_drain("the pool assignment");
        CHECK(now_ns() < deadline, "no assignment continuation");
    }
    CHECK(assigned_cont == 1 && pool_assigned_rx == 1 && assign_err == BULK_OK,
          "assign: continuation %u times (%s), pool_assigned %u times", assigned_cont,
          bulk_strerror(assign_err), pool_assigned_rx);

    /* A transfer driven by the epoll loop alone, a periodic timer beside it. */
    arm_timer(1, 1);
    uint64_t ticks = 0, sent = 0;
    deadline = now_ns() + TEST_DEADLINE_NS;
    while (buffers_back < ROUNDS || ticks < 3) {
        struct bulk_buffer *b;
        while (sent < ROUNDS && (b = bulk_alloc_new_buffer(&alloc)) != NULL) {
            memset(b->address, (int)(sent & 0xff), 4096);
            EXPECT_OK(bulk_channel_move(&tx, b, &sent, MK_BULK_CONT(count_cont, &move_conts)));
            sent++;
        }
        unsigned r = poll_once(-1);
        if (r & (1u << TAG_TIMER)) {
            ticks += take_timer();
        }
        if (r & (1u << TAG_WS)) {
            drain(ws);
        }
        CHECK(now_ns() < deadline, "transfer stalled: %u of %d back", buffers_back, ROUNDS);
    }
    arm_timer(0, 0);
    take_timer();
    CHECK(moves_in == ROUNDS && buffers_back == ROUNDS, "%u moved in, %u back", moves_in, buffers_back);
    CHECK(move_conts == ROUNDS && pass_conts == ROUNDS, "%u move and %u pass continuations for %d transfers",
          move_conts, pass_conts, ROUNDS);
    CHECK(poll_once(0) == 0, "the fd is readable after everything was dispatched");

    /* Teardown through the loop. */
    EXPECT_OK(bulk_channel_destroy(&tx, MK_BULK_CONT(count_cont, &destroyed_tx)));
    deadline = now_ns() + TEST_DEADLINE_NS;
    while (destroyed_tx == 0 || teardowns == 0) {
        wait_readable_and_drain("the teardown");
        CHECK(now_ns() < deadline, "teardown stalled");
    }
    EXPECT_OK(bulk_channel_destroy(&rx, MK_BULK_CONT(count_cont, &destroyed_rx)));
    wait_readable_and_drain("rx's destroy continuation");
    CHECK(destroyed_tx == 1 && destroyed_rx == 1 && teardowns == 1, "destroy: %u, %u, teardown %u",
          destroyed_tx, destroyed_rx, teardowns);
    EXPECT_OK(bulk_alloc_free(&alloc));
    CHECK(poll_once(0) == 0, "the fd of a waitset without channels is readable");
    close(tfd);
    close(epfd);
    EXPECT_OK(bulk_waitset_destroy(ws));
    printf("waitset_epoll: ok (%" PRIu64 " timer ticks in the transfer loop)\n", ticks);
    return 0;
}
