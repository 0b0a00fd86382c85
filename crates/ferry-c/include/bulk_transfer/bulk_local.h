/*
 * Ferry's C interface: channels between threads of one process.
 */
#ifndef BULK_TRANSFER_BULK_LOCAL_H
#define BULK_TRANSFER_BULK_LOCAL_H

#include <bulk_transfer/bulk_transfer.h>

#ifdef __cplusplus
extern "C" {
#endif

/** A local endpoint. Caller-allocated; written by bulk_local_init_endpoint. */
struct bulk_local_endpoint {
    struct bulk_endpoint_descriptor generic;
    /** NULL: an endpoint to create a channel on; else the created channel to bind to. */
    struct bulk_channel *other_channel;
};

/**
 * Initializes a local endpoint: with other_channel NULL, one to create a
 * channel on; else one to bind to other_channel (created on an endpoint
 * initialized with NULL, not bound yet). Local channels take trust FULL or
 * HALF (NONE needs two processes).
 */
void bulk_local_init_endpoint(struct bulk_local_endpoint *endpoint,
                              struct bulk_channel *other_channel);

#ifdef __cplusplus
}
#endif

#endif /* BULK_TRANSFER_BULK_LOCAL_H */
