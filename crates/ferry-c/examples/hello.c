/* Two channel ends in one process: a buffer moved from the source to the
 * sink and passed back. Every callback runs inside bulk_waitset_dispatch. */
#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_local.h>
#include <stdio.h>
#include <string.h>

static struct bulk_channel sink, source;
static struct bulk_allocator alloc;
static int done;

static void on_move(struct bulk_channel *ch, struct bulk_buffer *buf, void *meta)
{   /* sink: read the buffer, pass it back */
    printf("sink got \"%s\" (meta %u)\n", (char *)buf->address, *(unsigned *)meta);
    bulk_channel_pass(ch, buf, meta, BULK_CONT_NOP);
}

static void on_passed(struct bulk_channel *ch, struct bulk_buffer *buf, void *meta)
{   /* source: the buffer is back */
    (void)ch, (void)meta;
    bulk_alloc_return_buffer(&alloc, buf);
    done = 1;
}

static void on_assigned(void *arg, errval_t err, struct bulk_channel *ch)
{   /* source: the sink accepted the pool; fill a buffer and move it */
    (void)arg;
    struct bulk_buffer *buf = bulk_alloc_new_buffer(&alloc);
    unsigned meta = 42;
    if (err == BULK_OK && buf) {
        strcpy(buf->address, "hello from C");
        err = bulk_channel_move(ch, buf, &meta, BULK_CONT_NOP);
    }
    if (err != BULK_OK) { fprintf(stderr, "%s\n", bulk_strerror(err)); done = -1; }
}

static void on_bound(void *arg, errval_t err, struct bulk_channel *ch)
{   /* source: bound; assign the pool (the sink may veto) */
    (void)arg;
    if (err == BULK_OK) err = bulk_channel_assign_pool(ch, alloc.pool, MK_BULK_CONT(on_assigned, NULL));
    if (err != BULK_OK) { fprintf(stderr, "%s\n", bulk_strerror(err)); done = -1; }
}

int main(void)
{
    static struct bulk_channel_callbacks sink_cb = { .move_received = on_move };
    static struct bulk_channel_callbacks source_cb = { .buffer_received = on_passed };
    struct bulk_local_endpoint sink_ep, source_ep;
    struct bulk_channel_setup setup = { .direction = BULK_DIRECTION_RX, .trust = BULK_TRUST_FULL,
                                        .meta_size = sizeof(unsigned) }; /* NULL waitset: the default one */
    struct bulk_channel_bind_params params = { .trust = BULK_TRUST_FULL };

    bulk_local_init_endpoint(&sink_ep, NULL);       /* the sink creates the channel ... */
    bulk_local_init_endpoint(&source_ep, &sink);    /* ... the source binds to it */
    errval_t err = bulk_channel_create(&sink, &sink_ep.generic, &sink_cb, &setup);
    if (err == BULK_OK) err = bulk_alloc_init(&alloc, 4, 4096, NULL);   /* 4 buffers of 4 KiB */
    if (err == BULK_OK)
        err = bulk_channel_bind(&source, &source_ep.generic, &source_cb, &params, MK_BULK_CONT(on_bound, NULL));
    while (err == BULK_OK && done == 0)
        err = bulk_waitset_dispatch(bulk_waitset_default(), 10000000000LL); /* up to 10 s */
    if (err != BULK_OK) { fprintf(stderr, "%s\n", bulk_strerror(err)); return 1; }

    bulk_channel_destroy(&source, BULK_CONT_NOP);
    bulk_channel_destroy(&sink, BULK_CONT_NOP);
    while (bulk_waitset_dispatch(bulk_waitset_default(), 0) == BULK_OK) {} /* what is left */
    bulk_alloc_free(&alloc);
    bulk_waitset_destroy(bulk_waitset_default());
    return done == 1 ? 0 : 1;
}
