/*
 * Ferry's C interface: channels between processes of one machine over
 * shared memory. The creator and the binder meet at a Unix socket path
 * (in place of the original's name service).
 */
#ifndef BULK_TRANSFER_BULK_SM_H
#define BULK_TRANSFER_BULK_SM_H

#include <bulk_transfer/bulk_transfer.h>

#ifdef __cplusplus
extern "C" {
#endif

/** The longest socket path an endpoint takes, in bytes (without the NUL). */
#define BULK_SM_PATH_MAX 107

/** A shared-memory endpoint. Caller-allocated; written by the functions below. */
struct bulk_sm_endpoint_descriptor {
    struct bulk_endpoint_descriptor ep_generic;
    /** The Unix socket path, NUL-terminated. */
    char path[BULK_SM_PATH_MAX + 1];
};

/**
 * An endpoint to create a channel on: bulk_channel_create listens at
 * `path` (a Unix socket is made there and removed with the channel; a
 * socket left by a process that died is replaced; one that a live channel
 * listens on gives BULK_ERR_ENDPOINT_IN_USE).
 */
errval_t bulk_sm_ep_create(struct bulk_sm_endpoint_descriptor *ep, const char *path);

/** An endpoint naming the channel another process created at `path`, to bind to. */
errval_t bulk_sm_ep_create_remote(struct bulk_sm_endpoint_descriptor *ep, const char *path);

/** Marks the descriptor unused (channels made with it are not affected). */
errval_t bulk_sm_ep_destroy(struct bulk_sm_endpoint_descriptor *ep);

#ifdef __cplusplus
}
#endif

#endif /* BULK_TRANSFER_BULK_SM_H */
