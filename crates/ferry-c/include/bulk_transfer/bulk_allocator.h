/*
 * Ferry's C interface: an allocator of buffers from one pool (optional: a
 * program may manage the buffers of pools it knows itself).
 */
#ifndef BULK_TRANSFER_BULK_ALLOCATOR_H
#define BULK_TRANSFER_BULK_ALLOCATOR_H

#include <bulk_transfer/bulk_transfer.h>

#ifdef __cplusplus
extern "C" {
#endif

/**
 * An allocator. Caller-allocated; `pool` and `num_free` are set by the
 * library and read-only to the program; `impl_data` is private.
 */
struct bulk_allocator {
    /** The allocator's pool (NULL before init and after free). */
    struct bulk_pool *pool;
    /** Buffers of the pool free in this process right now. */
    size_t num_free;
    /** Private to the library. */
    void *impl_data;
};

/** Requirements on a new pool. */
struct bulk_pool_constraints {
    /** Recorded, not enforced on Linux (any address is fine). */
    uintptr_t range_min;
    uintptr_t range_max;
    /** Alignment of every buffer (a power of two up to the buffer size; 0: a page). */
    uintptr_t alignment;
    /** The pool's trust level from the start; UNINITIALIZED: that of the first channel it is assigned to. */
    enum bulk_trust_level trust;
};

/**
 * Makes a pool of buffer_count buffers of buffer_size bytes (a power of
 * two, at least a page) and an allocator over it. `constraints` may be NULL.
 */
errval_t bulk_alloc_init(struct bulk_allocator *alloc,
                         size_t buffer_count,
                         size_t buffer_size,
                         struct bulk_pool_constraints *constraints);

/**
 * Frees the allocator. Buffers of its pool that the program still holds
 * are given back and must not be used any more; the pool itself stays
 * while a channel lists it.
 */
errval_t bulk_alloc_free(struct bulk_allocator *alloc);

/** A free buffer of the pool, now owned by the program (READ_WRITE), or NULL if none is free. */
struct bulk_buffer *bulk_alloc_new_buffer(struct bulk_allocator *alloc);

/** Gives an owned buffer of the allocator's pool back. */
errval_t bulk_alloc_return_buffer(struct bulk_allocator *alloc,
                                  struct bulk_buffer *buffer);

#ifdef __cplusplus
}
#endif

#endif /* BULK_TRANSFER_BULK_ALLOCATOR_H */
