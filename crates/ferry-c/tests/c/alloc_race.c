/*
 * Allocator calls from several threads at once: an allocator call takes
 * only the lock of the buffer it hands out or takes back, so these races
 * are what keeps it honest.
 *
 *  1. Two threads return the same buffers at the same moment: for every
 *     buffer exactly one return succeeds, the other is refused
 *     (BULK_ERR_BUFFER_NOT_OWNED).
 *  2. Two threads allocate and return as fast as they can while the main
 *     thread frees the allocator in the middle: no buffer is held by two
 *     threads at once, every call made after the free returned is
 *     refused, and nothing else than OK or "freed" comes back.
 *
 * Buffers are tracked by their position among the pool's objects (taken
 * before the race), never read through: after the free their objects may
 * be gone.
 */
#define _GNU_SOURCE
#include "common.h"

#include <bulk_transfer/bulk_allocator.h>

#include <pthread.h>
#include <stdatomic.h>

#define COUNT 8
#define SIZE 4096
#define DOUBLE_RETURN_ROUNDS 200
#define FREE_ROUNDS 200

static struct bulk_allocator alloc;
static struct bulk_buffer *first;
static atomic_int holder[COUNT];
static atomic_int go, freed;
static struct bulk_buffer *held[COUNT];
static atomic_int returned_ok[COUNT];

static void wait_go(void)
{
    while (!atomic_load(&go)) {
    }
}

static void *return_all(void *arg)
{
    (void)arg;
    wait_go();
    for (int i = 0; i < COUNT; i++) {
        errval_t e = bulk_alloc_return_buffer(&alloc, held[i]);
        if (e == BULK_OK) {
            atomic_fetch_add(&returned_ok[i], 1);
        } else {
            CHECK(e == BULK_ERR_BUFFER_NOT_OWNED, "second return of buffer %d: %s", i, bulk_strerror(e));
        }
    }
    return NULL;
}

static void double_returns(void)
{
    for (int round = 0; round < DOUBLE_RETURN_ROUNDS; round++) {
        EXPECT_OK(bulk_alloc_init(&alloc, COUNT, SIZE, NULL));
        for (int i = 0; i < COUNT; i++) {
            held[i] = bulk_alloc_new_buffer(&alloc);
            CHECK(held[i] != NULL, "allocation %d", i);
            atomic_store(&returned_ok[i], 0);
        }
        atomic_store(&go, 0);
        pthread_t t[2];
        for (int k = 0; k < 2; k++) {
            CHECK(pthread_create(&t[k], NULL, return_all, NULL) == 0, "pthread_create");
        }
        atomic_store(&go, 1);
        for (int k = 0; k < 2; k++) {
            pthread_join(t[k], NULL);
        }
        for (int i = 0; i < COUNT; i++) {
            CHECK(atomic_load(&returned_ok[i]) == 1, "buffer %d returned %d times", i, atomic_load(&returned_ok[i]));
        }
        /* Racing calls leave num_free as of one of them; the next call
         * sets it right. */
        struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
        CHECK(b != NULL, "allocation after the race");
        EXPECT_OK(bulk_alloc_return_buffer(&alloc, b));
        CHECK(alloc.num_free == COUNT, "num_free %zu after every buffer came back", alloc.num_free);
        EXPECT_OK(bulk_alloc_free(&alloc));
    }
}

static void *churn(void *arg)
{
    int me = (int)(intptr_t)arg;
    wait_go();
    for (;;) {
        int after_free = atomic_load(&freed);
        struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
        if (after_free) {
            CHECK(b == NULL, "a buffer handed out after bulk_alloc_free returned");
            EXPECT_CODE(bulk_alloc_return_buffer(&alloc, first), BULK_ERR_INVALID_ALLOCATOR);
            return NULL;
        }
        if (b == NULL) {
            continue; /* none free just now, or freed meanwhile */
        }
        ptrdiff_t i = b - first;
        CHECK(i >= 0 && i < COUNT, "buffer %td is none of the pool's", i);
        int none = 0;
        CHECK(atomic_compare_exchange_strong(&holder[i], &none, me), "buffer %td handed to thread %d while thread %d holds it", i, me, none);
        atomic_store(&holder[i], 0);
        errval_t e = bulk_alloc_return_buffer(&alloc, b);
        CHECK(e == BULK_OK || e == BULK_ERR_INVALID_ALLOCATOR, "return: %s", bulk_strerror(e));
    }
}

static void free_while_busy(void)
{
    for (int round = 0; round < FREE_ROUNDS; round++) {
        EXPECT_OK(bulk_alloc_init(&alloc, COUNT, SIZE, NULL));
        first = alloc.pool->buffers[0];
        atomic_store(&go, 0);
        atomic_store(&freed, 0);
        pthread_t t[2];
        for (int k = 0; k < 2; k++) {
            CHECK(pthread_create(&t[k], NULL, churn, (void *)(intptr_t)(k + 1)) == 0, "pthread_create");
        }
        atomic_store(&go, 1);
        /* Let them run a varying while: the free lands at a different
         * point of their calls each round. */
        for (volatile int spin = 0; spin < (round % 50) * 200; spin++) {
        }
        EXPECT_OK(bulk_alloc_free(&alloc));
        atomic_store(&freed, 1);
        for (int k = 0; k < 2; k++) {
            pthread_join(t[k], NULL);
        }
        EXPECT_CODE(bulk_alloc_free(&alloc), BULK_ERR_INVALID_ALLOCATOR);
        CHECK(bulk_alloc_new_buffer(&alloc) == NULL, "allocation from a freed allocator");
    }
}

int main(void)
{
    double_returns();
    free_while_busy();
    printf("alloc_race: ok\n");
    return 0;
}
