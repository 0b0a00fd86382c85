/*
 * Trust HALF protects a C program over a local channel (threads of one
 * process) too: each mode does one access that must kill the program by
 * SIGSEGV/SIGBUS, after printing "touching" (the harness checks both).
 *
 *   local_protect write-moved    the source writes a buffer it moved, before
 *                                the move was dispatched to the sink
 *   local_protect write-copied   the owner writes a buffer while a copy of
 *                                it is out
 *   local_protect write-copy     the sink writes the copy it received
 *   local_protect write-owned    control: the owner writes its own buffer
 *                                (must not fault; exits 0)
 */
#define _GNU_SOURCE
#include <bulk_transfer/bulk_transfer.h>
#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_local.h>

#include "common.h"

static struct waitset *ws;
static struct bulk_channel rx, tx;
static struct bulk_buffer *got_copy;
static int bound, assigned;

static void on_copy(struct bulk_channel *ch, struct bulk_buffer *b, void *meta)
{
    (void)ch;
    (void)meta;
    got_copy = b;
}

static void flag_cont(void *arg, errval_t err, struct bulk_channel *ch)
{
    (void)ch;
    CHECK(err == BULK_OK, "continuation: %s", bulk_strerror(err));
    *(int *)arg = 1;
}

static void touch(struct bulk_buffer *b)
{
    printf("touching buffer %u in state %d\n", b->bufferid, (int)b->state);
    fflush(stdout);
    ((volatile unsigned char *)b->address)[0] = 0x42;
    printf("wrote it without a fault\n");
    fflush(stdout);
}

int main(int argc, char **argv)
{
    CHECK(argc == 2, "usage: local_protect write-moved|write-copied|write-copy|write-owned");
    const char *mode = argv[1];
    EXPECT_OK(bulk_waitset_create(&ws));
    static struct bulk_channel_callbacks rx_cbs = { .copy_received = on_copy };
    static struct bulk_channel_callbacks tx_cbs;
    struct bulk_local_endpoint rx_ep, tx_ep;
    struct bulk_channel_setup setup = {
        .direction = BULK_DIRECTION_RX,
        .trust = BULK_TRUST_HALF,
        .meta_size = 8,
        .waitset = ws,
    };
    bulk_local_init_endpoint(&rx_ep, NULL);
    EXPECT_OK(bulk_channel_create(&rx, &rx_ep.generic, &rx_cbs, &setup));
    bulk_local_init_endpoint(&tx_ep, &rx);
    struct bulk_channel_bind_params params = { .waitset = ws };
    EXPECT_OK(bulk_channel_bind(&tx, &tx_ep.generic, &tx_cbs, &params, MK_BULK_CONT(flag_cont, &bound)));
    WAIT_FOR(ws, bound, "the bind");
    CHECK(tx.trust == BULK_TRUST_HALF, "bound at trust %d", (int)tx.trust);
    struct bulk_allocator alloc;
    EXPECT_OK(bulk_alloc_init(&alloc, 2, 4096, NULL));
    EXPECT_OK(bulk_channel_assign_pool(&tx, alloc.pool, MK_BULK_CONT(flag_cont, &assigned)));
    WAIT_FOR(ws, assigned, "the assignment");
    struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
    CHECK(b != NULL, "no buffer");
    memset(b->address, 1, 4096);
    uint64_t meta = 1;
    if (strcmp(mode, "write-moved") == 0) {
        EXPECT_OK(bulk_channel_move(&tx, b, &meta, BULK_CONT_NOP));
        touch(b);
    } else if (strcmp(mode, "write-copied") == 0) {
        EXPECT_OK(bulk_channel_copy(&tx, b, &meta, BULK_CONT_NOP));
        WAIT_FOR(ws, got_copy != NULL, "the copy");
        touch(b);
    } else if (strcmp(mode, "write-copy") == 0) {
        EXPECT_OK(bulk_channel_copy(&tx, b, &meta, BULK_CONT_NOP));
        WAIT_FOR(ws, got_copy != NULL, "the copy");
        CHECK(((volatile unsigned char *)got_copy->address)[0] == 1, "the copy reads other bytes");
        touch(got_copy);
    } else if (strcmp(mode, "write-owned") == 0) {
        touch(b);
        EXPECT_OK(bulk_alloc_return_buffer(&alloc, b));
        EXPECT_OK(bulk_channel_destroy(&tx, BULK_CONT_NOP));
        EXPECT_OK(bulk_channel_destroy(&rx, BULK_CONT_NOP));
        drain(ws);
        EXPECT_OK(bulk_alloc_free(&alloc));
        EXPECT_OK(bulk_waitset_destroy(ws));
        return 0;
    } else {
        FATAL("unknown mode %s", mode);
    }
    return 3;
}
