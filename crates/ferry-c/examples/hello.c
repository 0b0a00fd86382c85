/*
 * The shortest Ferry program in C: two threads' worth of channel ends in
 * one process (the local backend), one buffer moved from the source to the
 * sink and passed back. Build it against an installed Ferry:
 *
 *   scripts/install-c ~/.local
 *   cc -std=c11 hello.c $(PKG_CONFIG_PATH=~/.local/lib/pkgconfig pkg-config --cflags --libs ferry)
 */
#include <stdio.h>
#include <string.h>

#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_local.h>
#include <bulk_transfer/bulk_transfer.h>

static struct bulk_channel sink, source;
static struct bulk_allocator alloc;
static int done;

/* Sink: a buffer arrived; read it and pass it back. */
static void on_move(struct bulk_channel *ch, struct bulk_buffer *buf, void *meta)
{
    printf("sink got \"%s\" (meta %u)\n", (char *)buf->address, *(unsigned *)meta);
    errval_t err = bulk_channel_pass(ch, buf, meta, BULK_CONT_NOP);
    if (err != BULK_OK) {
        fprintf(stderr, "pass: %s\n", bulk_strerror(err));
    }
}

/* Source: the buffer came back; return it to the allocator. */
static void on_passed(struct bulk_channel *ch, struct bulk_buffer *buf, void *meta)
{
    (void)ch;
    (void)meta;
    bulk_alloc_return_buffer(&alloc, buf);
    done = 1;
}

/* Source: the pool is assigned; fill a buffer and move it. */
static void on_pool_assigned(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    if (err != BULK_OK) {
        fprintf(stderr, "assign: %s\n", bulk_strerror(err));
        done = -1;
        return;
    }
    struct bulk_buffer *buf = bulk_alloc_new_buffer(&alloc);
    strcpy(buf->address, "hello from C");
    unsigned meta = 42;
    err = bulk_channel_move(ch, buf, &meta, BULK_CONT_NOP);
    if (err != BULK_OK) {
        fprintf(stderr, "move: %s\n", bulk_strerror(err));
        done = -1;
    }
}

/* Source: bound; assign the pool (the sink may veto). */
static void on_bound(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)arg;
    if (err == BULK_OK) {
        err = bulk_channel_assign_pool(ch, alloc.pool, MK_BULK_CONT(on_pool_assigned, NULL));
    }
    if (err != BULK_OK) {
        fprintf(stderr, "bind/assign: %s\n", bulk_strerror(err));
        done = -1;
    }
}

int main(void)
{
    struct waitset *ws = bulk_waitset_default();
    static struct bulk_channel_callbacks sink_cb = { .move_received = on_move };
    static struct bulk_channel_callbacks source_cb = { .buffer_received = on_passed };

    /* The sink creates the channel, the source binds to it. */
    struct bulk_local_endpoint sink_ep, source_ep;
    bulk_local_init_endpoint(&sink_ep, NULL);
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_RX,
        .role = BULK_ROLE_SLAVE,
        .trust = BULK_TRUST_FULL,
        .meta_size = sizeof(unsigned),
        .waitset = ws,
    };
    errval_t err = bulk_channel_create(&sink, &sink_ep.generic, &sink_cb, &setup);
    if (err == BULK_OK) {
        err = bulk_alloc_init(&alloc, 4, 4096, NULL);
    }
    if (err == BULK_OK) {
        bulk_local_init_endpoint(&source_ep, &sink);
        struct bulk_channel_bind_params params = { .trust = BULK_TRUST_FULL, .waitset = ws };
        err = bulk_channel_bind(&source, &source_ep.generic, &source_cb, &params,
                                MK_BULK_CONT(on_bound, NULL));
    }
    if (err != BULK_OK) {
        fprintf(stderr, "setup: %s\n", bulk_strerror(err));
        return 1;
    }

    /* Every callback runs from here, on this thread. */
    while (done == 0) {
        err = bulk_waitset_dispatch(ws, 10 * 1000 * 1000 * 1000LL);
        if (err != BULK_OK) {
            fprintf(stderr, "dispatch: %s\n", bulk_strerror(err));
            return 1;
        }
    }

    /* Tear down; then run what is left (the peer's teardown) and free everything. */
    bulk_channel_destroy(&source, BULK_CONT_NOP);
    bulk_channel_destroy(&sink, BULK_CONT_NOP);
    while (bulk_waitset_dispatch(ws, 0) == BULK_OK) {
    }
    bulk_alloc_free(&alloc);
    bulk_waitset_destroy(ws);
    return done == 1 ? 0 : 1;
}
