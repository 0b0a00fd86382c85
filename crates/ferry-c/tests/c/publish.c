/*
 * When the messages of sends reach the peer (docs/C-API.md, "Publishing"):
 *
 *   publish local|sm outside: the source moves K buffers from its own loop
 *     (not from a callback) and then does not dispatch again until the echo
 *     reported that all K arrived: a send made outside a callback is
 *     published before the call returns.
 *   publish local|sm exit: the echo passes every buffer back from its
 *     move_received callback (sends that are published in batches) and,
 *     right after the K-th callback returned, destroys its channel and
 *     ends without dispatching again: all K passes reach the source
 *     before its teardown_received.
 *   publish local|sm beside: while the source's main thread runs a
 *     continuation of the source's waitset (and does not dispatch until
 *     the echo reported), a second thread of the source moves the K
 *     buffers from its own loop: sends of a thread that runs no callback
 *     of the channel's waitset are published at once, whatever another
 *     thread's dispatch of that waitset is running.
 *
 * local: the echo is a thread with a waitset of its own; sm: a child
 * process (forked before the library is used). Prints "publish: ok".
 */
#define _GNU_SOURCE
#include "common.h"

#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_local.h>
#include <bulk_transfer/bulk_sm.h>

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <unistd.h>

#define K 8
/* How long the source waits for the echo's report (it takes milliseconds). */
#define REPORT_DEADLINE_MS 20000

static int exit_case, beside_case;
static int report_fd = -1; /* sm: the echo's end of the report pipe */
static int source_report_fd = -1; /* sm: the source's end of it */
static atomic_int echo_got;

/* Echo ---------------------------------------------------------------------- */

static struct bulk_channel echo;
static int echo_bound_ok, echo_torn_down;

static void echo_move_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    if (exit_case) {
        EXPECT_OK(bulk_channel_pass(ch, b, meta, BULK_CONT_NOP));
    }
    atomic_fetch_add(&echo_got, 1);
}

static void echo_teardown(struct bulk_channel *ch)
{
    (void)ch;
    echo_torn_down = 1;
}

static void echo_bound(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    (void)ch;
    if (err != BULK_OK) {
        FATAL("echo: bind: %s", bulk_strerror(err));
    }
    echo_bound_ok = 1;
}

static struct bulk_channel_callbacks echo_cbs = {
    .move_received = echo_move_received,
    .teardown_received = echo_teardown,
};

/** Binds to `ep`, then serves the case. */
static void echo_run(struct bulk_endpoint_descriptor *ep)
{
    struct waitset *ws;
    EXPECT_OK(bulk_waitset_create(&ws));
    struct bulk_channel_bind_params params = { .role = BULK_ROLE_GENERIC, .trust = BULK_TRUST_FULL, .waitset = ws };
    EXPECT_OK(bulk_channel_bind(&echo, ep, &echo_cbs, &params, MK_BULK_CONT(echo_bound, NULL)));
    WAIT_FOR(ws, echo_bound_ok, "the bind");
    WAIT_FOR(ws, atomic_load(&echo_got) == K, "the source's moves");
    if (exit_case) {
        /* The K passes were sent from callbacks; no dispatch after the last. */
        EXPECT_OK(bulk_channel_destroy(&echo, BULK_CONT_NOP));
        return;
    }
    if (report_fd >= 0 && write(report_fd, "k", 1) != 1) {
        FATAL("echo: cannot report");
    }
    WAIT_FOR(ws, echo_torn_down, "the source's teardown");
    EXPECT_OK(bulk_channel_destroy(&echo, BULK_CONT_NOP));
    drain(ws);
    EXPECT_OK(bulk_waitset_destroy(ws));
}

static void *echo_thread(void *arg)
{
    struct bulk_local_endpoint ep;
    bulk_local_init_endpoint(&ep, arg);
    echo_run(&ep.generic);
    return NULL;
}

/* Source -------------------------------------------------------------------- */

static struct bulk_channel source;
static struct bulk_allocator alloc;
static int bound_in, pool_ok, torn_down;
static unsigned back, back_at_teardown;

static errval_t source_bind_received(struct bulk_channel *ch)
{
    (void)ch;
    bound_in = 1;
    return BULK_OK;
}

static void source_buffer_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)ch;
    (void)meta;
    EXPECT_OK(bulk_alloc_return_buffer(&alloc, b));
    back++;
}

static void source_teardown(struct bulk_channel *ch)
{
    (void)ch;
    back_at_teardown = back;
    torn_down = 1;
}

static void await_report(int fd);
static void move_all(void);

static void *mover_thread(void *arg)
{
    (void)arg;
    move_all();
    return NULL;
}

static void pool_done(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    (void)ch;
    EXPECT_OK(err);
    pool_ok = 1;
    if (beside_case) {
        /* This thread runs a continuation of the source's waitset until the
         * echo got what another thread moves meanwhile. */
        pthread_t mover;
        if (pthread_create(&mover, NULL, mover_thread, NULL) != 0) {
            FATAL("pthread_create");
        }
        await_report(source_report_fd);
        pthread_join(mover, NULL);
    }
}

static struct bulk_channel_callbacks source_cbs = {
    .bind_received = source_bind_received,
    .buffer_received = source_buffer_received,
    .teardown_received = source_teardown,
};

/** Moves the K buffers, outside any callback of this thread. */
static void move_all(void)
{
    for (uint64_t i = 0; i < K; i++) {
        struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
        CHECK(b != NULL, "buffer %" PRIu64 ": the pool is exhausted", i);
        EXPECT_OK(bulk_channel_move(&source, b, &i, BULK_CONT_NOP));
    }
}

/** Waits for the echo's report without dispatching. */
static void await_report(int fd)
{
    uint64_t deadline = now_ns() + (uint64_t)REPORT_DEADLINE_MS * 1000000ull;
    for (;;) {
        if (fd < 0 ? atomic_load(&echo_got) == K : 0) {
            return;
        }
        if (fd >= 0) {
            struct pollfd p = { .fd = fd, .events = POLLIN };
            if (poll(&p, 1, 10) == 1) {
                char c;
                if (read(fd, &c, 1) == 1) {
                    return;
                }
            }
        } else {
            usleep(1000);
        }
        if (now_ns() > deadline) {
            FATAL("the echo did not get the %d moves sent outside a callback (got %d) while the source did not "
                  "dispatch%s", K, fd < 0 ? atomic_load(&echo_got) : -1,
                  beside_case ? " (the main thread was in a continuation of the source's waitset)" : "");
        }
    }
}

int main(int argc, char **argv)
{
    if (argc != 3 || (strcmp(argv[1], "local") != 0 && strcmp(argv[1], "sm") != 0)
        || (strcmp(argv[2], "outside") != 0 && strcmp(argv[2], "exit") != 0 && strcmp(argv[2], "beside") != 0)) {
        fprintf(stderr, "usage: %s local|sm outside|exit|beside\n", argv[0]);
        return 2;
    }
    int sm = strcmp(argv[1], "sm") == 0;
    exit_case = strcmp(argv[2], "exit") == 0;
    beside_case = strcmp(argv[2], "beside") == 0;
    char path[108];
    snprintf(path, sizeof path, "/tmp/ferry-c-publish-%d.sock", (int)getpid());
    int ready[2] = { -1, -1 }, report[2] = { -1, -1 };
    pid_t child = -1;
    if (sm) {
        if (pipe(ready) != 0 || pipe(report) != 0) {
            FATAL("pipe");
        }
        child = fork();
        if (child < 0) {
            FATAL("fork");
        }
        if (child == 0) {
            close(ready[1]);
            close(report[0]);
            char c;
            if (read(ready[0], &c, 1) != 1) {
                _exit(1);
            }
            report_fd = report[1];
            struct bulk_sm_endpoint_descriptor ep;
            EXPECT_OK(bulk_sm_ep_create_remote(&ep, path));
            echo_run(&ep.ep_generic);
            EXPECT_OK(bulk_sm_ep_destroy(&ep));
            exit(0);
        }
        close(ready[0]);
        close(report[1]);
        source_report_fd = report[0];
    }

    struct waitset *ws;
    EXPECT_OK(bulk_waitset_create(&ws));
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_TX,
        .role = BULK_ROLE_MASTER,
        .trust = BULK_TRUST_FULL,
        .meta_size = 8,
        .waitset = ws,
    };
    struct bulk_sm_endpoint_descriptor sm_ep;
    struct bulk_local_endpoint local_ep;
    pthread_t thread;
    if (sm) {
        EXPECT_OK(bulk_sm_ep_create(&sm_ep, path));
        EXPECT_OK(bulk_channel_create(&source, &sm_ep.ep_generic, &source_cbs, &setup));
        if (write(ready[1], "r", 1) != 1) {
            FATAL("write");
        }
        close(ready[1]);
    } else {
        bulk_local_init_endpoint(&local_ep, NULL);
        EXPECT_OK(bulk_channel_create(&source, &local_ep.generic, &source_cbs, &setup));
        if (pthread_create(&thread, NULL, echo_thread, &source) != 0) {
            FATAL("pthread_create");
        }
    }
    WAIT_FOR(ws, bound_in, "the echo's bind");
    struct bulk_pool_constraints pc = { .trust = BULK_TRUST_FULL };
    EXPECT_OK(bulk_alloc_init(&alloc, K, 4096, &pc));
    EXPECT_OK(bulk_channel_assign_pool(&source, alloc.pool, MK_BULK_CONT(pool_done, NULL)));
    WAIT_FOR(ws, pool_ok, "the pool assignment");
    /* beside: pool_done had the moves made and got the report. */
    if (exit_case) {
        /* Outside any callback: published before each call returns. */
        move_all();
        WAIT_FOR(ws, torn_down, "the echo's teardown");
        CHECK(back_at_teardown == K, "%u of %d passes arrived before the echo's teardown", back_at_teardown, K);
    } else if (!beside_case) {
        move_all();
        await_report(source_report_fd);
    }
    EXPECT_OK(bulk_channel_destroy(&source, BULK_CONT_NOP));
    drain(ws);
    if (sm) {
        int status = 0;
        waitpid(child, &status, 0);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the echo process ended with status %d", status);
        EXPECT_OK(bulk_sm_ep_destroy(&sm_ep));
    } else {
        pthread_join(thread, NULL);
    }
    EXPECT_OK(bulk_alloc_free(&alloc));
    EXPECT_OK(bulk_waitset_destroy(ws));
    printf("publish: ok\n");
    return 0;
}
