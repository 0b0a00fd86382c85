/*
 * Ferry's C interface measured as `ferry bench rtt` and `ferry bench
 * throughput` measure the Rust API, so that scripts/bench-c can print the
 * two side by side:
 *
 *   rtt: a source moves one buffer to an echo, which passes it straight
 *     back; one sample per round trip (runs of 250, one warm-up run not
 *     recorded), microseconds.
 *   throughput: the source keeps INFLIGHT moves out, the echo passes each
 *     back; one sample per run of MOVES moves, millions of moves per
 *     second (and Gbit/s of buffer size).
 *
 * throughput: the source sends the next move from its buffer_received
 *   callback, as a C program streaming over the interface does: a send
 *   made by a callback of the channel's own waitset is published in a
 *   batch with its neighbours, as ferry bench's source publishes with
 *   Channel::set_batching. --loop-refill: the source's own loop sends
 *   instead (after each dispatch), and every such send is published on
 *   its own before the call returns.
 *
 * Both ends busy-poll bulk_waitset_dispatch(ws, 0); the source is pinned
 * to CPU 0 and the echo to CPU 1, as in ferry bench. local: the echo is a
 * thread of this process; sm: a child process (forked before the library
 * is used), bound over a Unix socket path. Trust FULL; payloads are not
 * touched after each buffer was written once (as without --touch).
 *
 *   bulk_bench rtt|throughput local|sm [--size N] [--runs R]
 *              [--moves M] [--inflight W] [--loop-refill] [--json]
 *              [--peer PATH]
 *   bulk_bench echo sm --peer PATH
 *
 * --peer PATH (sm): the echo is not forked; the source listens at PATH
 *   and waits (30 s at most) for an echo started by hand, which binds
 *   there: `bulk_bench echo sm --peer PATH`, or Rust's `ferry echo
 *   --endpoint shm:PATH --busy-poll --cpu 1`. `bulk_bench echo sm --peer
 *   PATH` is the C echo alone, for a source started first: this
 *   program's, or `ferry bench rtt --backend shm --busy-poll --peer
 *   shm:PATH`. Crossed so, the two interfaces' sources and echoes show
 *   which side of a round trip a difference lies on.
 *
 * Output: one line per point; with --json the same fields as ferry bench
 * --json (experiment, backend, size, trust, mode, touch, runs, samples,
 * unit, median, p5, p95, p99; throughput adds inflight, moves_per_run,
 * gbit_s_median, and refill: callback or loop) and "api": "c".
 */
#define _GNU_SOURCE
#include <bulk_transfer/bulk_transfer.h>
#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_local.h>
#include <bulk_transfer/bulk_sm.h>

#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MOVES_PER_RUN 250
#define RTT_POOL 16
#define META_SIZE 16

static void die(const char *what, errval_t err)
{
    fprintf(stderr, "bulk_bench: %s: %s\n", what, bulk_strerror(err));
    exit(1);
}

#define TRY(call)                                                          \
    do {                                                                   \
        errval_t e_ = (call);                                              \
        if (e_ != BULK_OK) {                                               \
            die(#call, e_);                                                \
        }                                                                  \
    } while (0)

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void pin_to(int cpu)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(n > 0 ? cpu % (int)n : 0, &set);
    sched_setaffinity(0, sizeof set, &set);
}

/** One busy-polled dispatch step: BULK_OK or BULK_ERR_TIMEOUT. */
static void poll_once(struct waitset *ws)
{
    errval_t e = bulk_waitset_dispatch(ws, 0);
    if (e != BULK_OK && e != BULK_ERR_TIMEOUT) {
        die("bulk_waitset_dispatch", e);
    }
}

/* Echo -------------------------------------------------------------------- */

static atomic_int echo_stop;
static struct bulk_channel echo_channel;
/* Buffers whose pass found the queue full, oldest first. */
static struct bulk_buffer *echo_backlog[65536];
static unsigned char echo_backlog_meta[65536][META_SIZE];
static size_t echo_head, echo_len;

static void echo_flush(void)
{
    while (echo_len > 0) {
        size_t i = echo_head % 65536;
        errval_t e = bulk_channel_pass(&echo_channel, echo_backlog[i], echo_backlog_meta[i], BULK_CONT_NOP);
        if (e == BULK_ERR_QUEUE_FULL) {
            return;
        }
        if (e != BULK_OK) {
            die("echo: bulk_channel_pass", e);
        }
        echo_head++;
        echo_len--;
    }
}

static void echo_move_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)ch;
    if (echo_len == 0) {
        errval_t e = bulk_channel_pass(&echo_channel, b, meta, BULK_CONT_NOP);
        if (e == BULK_OK) {
            return;
        }
        if (e != BULK_ERR_QUEUE_FULL) {
            die("echo: bulk_channel_pass", e);
        }
    }
    size_t i = (echo_head + echo_len) % 65536;
    echo_backlog[i] = b;
    memcpy(echo_backlog_meta[i], meta, META_SIZE);
    echo_len++;
}

static void echo_teardown(struct bulk_channel *ch)
{
    (void)ch;
    atomic_store(&echo_stop, 1);
}

static struct bulk_channel_callbacks echo_cbs = {
    .move_received = echo_move_received,
    .teardown_received = echo_teardown,
};

/** Serves the echo channel (bound by the caller on `ws`) until teardown. */
static void echo_serve(struct waitset *ws)
{
    while (!atomic_load(&echo_stop)) {
        poll_once(ws);
        echo_flush();
    }
    struct bulk_continuation nop = BULK_CONT_NOP;
    TRY(bulk_channel_destroy(&echo_channel, nop));
    while (bulk_waitset_dispatch(ws, 0) == BULK_OK) {
    }
}

static void echo_bound(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)ch;
    if (err != BULK_OK) {
        die("echo: bind", err);
    }
    *(int *)arg = 1;
}

static void echo_bind(struct bulk_endpoint_descriptor *ep, struct waitset *ws)
{
    struct bulk_channel_bind_params params = { .role = BULK_ROLE_GENERIC, .trust = BULK_TRUST_FULL, .waitset = ws };
    int bound = 0;
    TRY(bulk_channel_bind(&echo_channel, ep, &echo_cbs, &params, MK_BULK_CONT(echo_bound, &bound)));
    while (!bound) {
        poll_once(ws);
    }
}

/** The sm echo: binds at the socket `path` on CPU 1 and serves until teardown. */
static void sm_echo(const char *path)
{
    pin_to(1);
    struct waitset *ws;
    TRY(bulk_waitset_create(&ws));
    struct bulk_sm_endpoint_descriptor ep;
    TRY(bulk_sm_ep_create_remote(&ep, path));
    echo_bind(&ep.ep_generic, ws);
    echo_serve(ws);
    TRY(bulk_sm_ep_destroy(&ep));
    TRY(bulk_waitset_destroy(ws));
}

struct local_echo {
    struct bulk_channel *source;
    struct waitset *ws;
};

static void *local_echo_thread(void *arg)
{
    struct local_echo *le = arg;
    pin_to(1);
    struct bulk_local_endpoint ep;
    bulk_local_init_endpoint(&ep, le->source);
    echo_bind(&ep.generic, le->ws);
    echo_serve(le->ws);
    return NULL;
}

/* Source ------------------------------------------------------------------ */

static struct bulk_channel source;
static struct bulk_allocator alloc;
static uint64_t back;
static int bound_in, pool_ok;
/* Throughput: moves of the run not sent yet, the next sequence number, and
 * whether buffer_received sends the next one. */
static uint64_t to_send, seq;
static int refill_in_callback;

static void source_buffer_received(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)meta;
    errval_t e = bulk_alloc_return_buffer(&alloc, b);
    if (e != BULK_OK) {
        die("bulk_alloc_return_buffer", e);
    }
    back++;
    if (!refill_in_callback || to_send == 0) {
        return;
    }
    /* The next move, from the callback (published in a batch); if the queue
     * is full the source's loop sends it once there is room. */
    struct bulk_buffer *next = bulk_alloc_new_buffer(&alloc);
    if (next == NULL) {
        return;
    }
    unsigned char m[META_SIZE] = { 0 };
    memcpy(m, &seq, sizeof seq);
    e = bulk_channel_move(ch, next, m, BULK_CONT_NOP);
    if (e == BULK_OK) {
        seq++;
        to_send--;
        return;
    }
    if (e != BULK_ERR_QUEUE_FULL) {
        die("bulk_channel_move", e);
    }
    TRY(bulk_alloc_return_buffer(&alloc, next));
}

static errval_t source_bind_received(struct bulk_channel *ch)
{
    (void)ch;
    bound_in = 1;
    return BULK_OK;
}

static void pool_done(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    (void)ch;
    if (err != BULK_OK) {
        die("assign pool", err);
    }
    pool_ok = 1;
}

static struct bulk_channel_callbacks source_cbs = {
    .bind_received = source_bind_received,
    .buffer_received = source_buffer_received,
};

/** Moves `b`, dispatching while the queue is full. */
static void send(struct waitset *ws, struct bulk_buffer *b, uint64_t seq)
{
    unsigned char meta[META_SIZE] = { 0 };
    memcpy(meta, &seq, sizeof seq);
    for (;;) {
        errval_t e = bulk_channel_move(&source, b, meta, BULK_CONT_NOP);
        if (e == BULK_OK) {
            return;
        }
        if (e != BULK_ERR_QUEUE_FULL) {
            die("bulk_channel_move", e);
        }
        poll_once(ws);
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/** Nearest-rank percentile of sorted samples (as ferry bench). */
static double pct(const double *s, size_t n, double p)
{
    size_t rank = (size_t)((p / 100.0) * (double)n + 0.999999999);
    if (rank < 1) {
        rank = 1;
    }
    if (rank > n) {
        rank = n;
    }
    return s[rank - 1];
}

static double round3(double x)
{
    return (double)(int64_t)(x * 1000.0 + (x >= 0 ? 0.5 : -0.5)) / 1000.0;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr,
                "usage: %s rtt|throughput local|sm [--size N] [--runs R] [--moves M] [--inflight W] [--loop-refill] "
                "[--json] [--peer PATH]\n"
                "       %s echo sm --peer PATH\n",
                argv[0], argv[0]);
        return 2;
    }
    int rtt = strcmp(argv[1], "rtt") == 0;
    int echo_only = strcmp(argv[1], "echo") == 0;
    if (!rtt && !echo_only && strcmp(argv[1], "throughput") != 0) {
        fprintf(stderr, "bulk_bench: experiment %s: give rtt, throughput or echo\n", argv[1]);
        return 2;
    }
    int shm = strcmp(argv[2], "sm") == 0 || strcmp(argv[2], "shm") == 0;
    if (!shm && strcmp(argv[2], "local") != 0) {
        fprintf(stderr, "bulk_bench: backend %s: give local or sm\n", argv[2]);
        return 2;
    }
    size_t size = 4096, runs = rtt ? 100 : 20, moves = 50000, inflight = 250;
    int json = 0, loop_refill = 0;
    const char *peer = NULL;
    for (int i = 3; i < argc; i++) {
        if (i + 1 < argc && strcmp(argv[i], "--peer") == 0) {
            peer = argv[++i];
        } else if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else if (strcmp(argv[i], "--loop-refill") == 0) {
            loop_refill = 1;
        } else if (i + 1 < argc && strcmp(argv[i], "--size") == 0) {
            size = strtoull(argv[++i], NULL, 0);
        } else if (i + 1 < argc && strcmp(argv[i], "--runs") == 0) {
            runs = strtoull(argv[++i], NULL, 0);
        } else if (i + 1 < argc && strcmp(argv[i], "--moves") == 0) {
            moves = strtoull(argv[++i], NULL, 0);
        } else if (i + 1 < argc && strcmp(argv[i], "--inflight") == 0) {
            inflight = strtoull(argv[++i], NULL, 0);
        } else {
            fprintf(stderr, "bulk_bench: unknown argument %s\n", argv[i]);
            return 2;
        }
    }
    if (runs == 0 || moves < inflight || inflight == 0) {
        fprintf(stderr, "bulk_bench: --runs must be at least 1 and --moves at least --inflight\n");
        return 2;
    }

    if (peer != NULL && (!shm || strlen(peer) >= 108)) {
        fprintf(stderr, "bulk_bench: --peer takes the socket path of an sm endpoint (under 108 bytes)\n");
        return 2;
    }
    if (echo_only) {
        if (peer == NULL) {
            fprintf(stderr, "bulk_bench: echo needs --peer PATH (sm)\n");
            return 2;
        }
        sm_echo(peer);
        return 0;
    }

    /* sm: the echo is a child process, forked before the library is used;
     * it binds once the parent's endpoint listens (a byte on the pipe).
     * With --peer it is started by hand and binds at PATH. */
    char path[108];
    if (peer != NULL) {
        snprintf(path, sizeof path, "%s", peer);
    } else {
        snprintf(path, sizeof path, "/tmp/ferry-bulk-bench-%d.sock", (int)getpid());
    }
    int ready[2] = { -1, -1 };
    pid_t child = -1;
    if (shm && peer == NULL) {
        if (pipe(ready) != 0) {
            perror("pipe");
            return 1;
        }
        child = fork();
        if (child < 0) {
            perror("fork");
            return 1;
        }
        if (child == 0) {
            close(ready[1]);
            char c;
            if (read(ready[0], &c, 1) != 1) {
                _exit(1);
            }
            sm_echo(path);
            _exit(0);
        }
        close(ready[0]);
    }
    pin_to(0);

    struct waitset *ws, *echo_ws = NULL;
    TRY(bulk_waitset_create(&ws));
    size_t count = rtt ? RTT_POOL : inflight;
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_TX,
        .role = BULK_ROLE_MASTER,
        .trust = BULK_TRUST_FULL,
        .meta_size = META_SIZE,
        .waitset = ws,
    };
    struct bulk_local_endpoint local_ep;
    struct bulk_sm_endpoint_descriptor sm_ep;
    pthread_t echo_thread;
    struct local_echo le;
    if (shm) {
        TRY(bulk_sm_ep_create(&sm_ep, path));
        TRY(bulk_channel_create(&source, &sm_ep.ep_generic, &source_cbs, &setup));
        if (peer == NULL) {
            if (write(ready[1], "x", 1) != 1) {
                perror("write");
                return 1;
            }
            close(ready[1]);
        }
    } else {
        bulk_local_init_endpoint(&local_ep, NULL);
        TRY(bulk_channel_create(&source, &local_ep.generic, &source_cbs, &setup));
        TRY(bulk_waitset_create(&echo_ws));
        le.source = &source;
        le.ws = echo_ws;
        if (pthread_create(&echo_thread, NULL, local_echo_thread, &le) != 0) {
            fprintf(stderr, "bulk_bench: cannot start the echo thread\n");
            return 1;
        }
    }
    uint64_t limit = now_ns() + 30ull * 1000000000ull;
    while (!bound_in) {
        poll_once(ws);
        if (now_ns() > limit) {
            fprintf(stderr, "bulk_bench: the echo did not bind within 30 s\n");
            return 1;
        }
    }
    struct bulk_pool_constraints pc = { .trust = BULK_TRUST_FULL };
    TRY(bulk_alloc_init(&alloc, count, size, &pc));
    TRY(bulk_channel_assign_pool(&source, alloc.pool, MK_BULK_CONT(pool_done, NULL)));
    while (!pool_ok) {
        poll_once(ws);
    }
    /* Pre-fault every buffer (steady state, not first-touch page faults). */
    {
        struct bulk_buffer **all = calloc(count, sizeof *all);
        for (size_t i = 0; i < count; i++) {
            all[i] = bulk_alloc_new_buffer(&alloc);
            memset(all[i]->address, 1, size);
        }
        for (size_t i = 0; i < count; i++) {
            TRY(bulk_alloc_return_buffer(&alloc, all[i]));
        }
        free(all);
    }

    size_t nsamples = rtt ? runs * MOVES_PER_RUN : runs;
    double *samples = calloc(nsamples, sizeof *samples);
    size_t got = 0;
    for (size_t run = 0; run <= runs; run++) {
        if (rtt) {
            for (size_t i = 0; i < MOVES_PER_RUN; i++) {
                struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
                if (b == NULL) {
                    fprintf(stderr, "bulk_bench: pool exhausted\n");
                    return 1;
                }
                uint64_t want = back + 1;
                uint64_t t0 = now_ns();
                send(ws, b, seq++);
                while (back < want) {
                    poll_once(ws);
                }
                uint64_t dt = now_ns() - t0;
                if (run > 0) {
                    samples[got++] = (double)dt / 1000.0;
                }
            }
        } else {
            uint64_t start_back = back;
            to_send = moves;
            refill_in_callback = !loop_refill;
            uint64_t t0 = now_ns();
            while (back - start_back < moves) {
                /* The window's first moves, and any the callback could not send. */
                while (to_send > 0 && (moves - to_send) - (back - start_back) < inflight) {
                    struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
                    if (b == NULL) {
                        break;
                    }
                    send(ws, b, seq++);
                    to_send--;
                }
                poll_once(ws);
            }
            refill_in_callback = 0;
            double secs = (double)(now_ns() - t0) / 1e9;
            if (run > 0) {
                samples[got++] = (double)moves / secs / 1e6;
            }
        }
    }

    qsort(samples, got, sizeof *samples, cmp_double);
    double median = pct(samples, got, 50), p5 = pct(samples, got, 5), p95 = pct(samples, got, 95),
           p99 = pct(samples, got, 99);
    const char *backend = shm ? "shm" : "local";
    const char *unit = rtt ? "us" : "Mops/s";
    if (json) {
        printf("{\"experiment\":\"%s\",\"backend\":\"%s\",\"api\":\"c\",\"size\":%zu,\"trust\":\"full\","
               "\"mode\":\"busy-poll\",\"touch\":false,\"runs\":%zu,\"samples\":%zu,\"unit\":\"%s\","
               "\"median\":%.3f,\"p5\":%.3f,\"p95\":%.3f,\"p99\":%.3f",
               argv[1], backend, size, runs, got, unit, round3(median), round3(p5), round3(p95), round3(p99));
        if (!rtt) {
            printf(",\"inflight\":%zu,\"moves_per_run\":%zu,\"gbit_s_median\":%.3f,\"refill\":\"%s\"", inflight,
                   moves, round3(median * 1e6 * (double)size * 8.0 / 1e9), loop_refill ? "loop" : "callback");
        }
        printf("}\n");
    } else {
        printf("C %s %s %zu B: median %.3f %s (p5 %.3f, p95 %.3f, p99 %.3f; %zu samples)\n", argv[1], backend,
               size, median, unit, p5, p95, p99, got);
    }
    free(samples);

    struct bulk_continuation nop = BULK_CONT_NOP;
    TRY(bulk_channel_destroy(&source, nop));
    while (bulk_waitset_dispatch(ws, 0) == BULK_OK) {
    }
    if (shm && peer != NULL) {
        TRY(bulk_sm_ep_destroy(&sm_ep));
    } else if (shm) {
        int status = 0;
        waitpid(child, &status, 0);
        TRY(bulk_sm_ep_destroy(&sm_ep));
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "bulk_bench: the echo process failed (status %d)\n", status);
            return 1;
        }
    } else {
        pthread_join(echo_thread, NULL);
        TRY(bulk_waitset_destroy(echo_ws));
    }
    TRY(bulk_alloc_free(&alloc));
    TRY(bulk_waitset_destroy(ws));
    return 0;
}
