/*
 * Ferry's C interface: channels between machines over TCP.
 */
#ifndef BULK_TRANSFER_BULK_NET_H
#define BULK_TRANSFER_BULK_NET_H

#include <bulk_transfer/bulk_transfer.h>

#ifdef __cplusplus
extern "C" {
#endif

/** The longest IP address text an endpoint takes (INET6_ADDRSTRLEN - 1). */
#define BULK_NET_IP_MAX 45

/** Where a TCP endpoint is. */
struct bulk_net_ep_setup {
    /** An IPv4 or IPv6 address as text, e.g. "127.0.0.1". */
    const char *ip;
    /** The TCP port; 0 when creating: the kernel chooses (see bulk_net_ep_port). */
    uint16_t port;
};

/** A TCP endpoint. Caller-allocated; written by the functions below and by bulk_channel_create. */
struct bulk_net_endpoint_descriptor {
    struct bulk_endpoint_descriptor ep_generic;
    /** The address, NUL-terminated text. */
    char ip[BULK_NET_IP_MAX + 1];
    /** The port; after bulk_channel_create on a port-0 endpoint, the port the kernel chose. */
    uint16_t port;
};

/** An endpoint to create a channel on: bulk_channel_create listens at ip:port. */
errval_t bulk_net_ep_create(struct bulk_net_endpoint_descriptor *ep,
                            struct bulk_net_ep_setup *setup);

/** An endpoint naming a channel created at ip:port (port not 0), to bind to. */
errval_t bulk_net_ep_create_remote(struct bulk_net_endpoint_descriptor *ep,
                                   struct bulk_net_ep_setup *setup);

/** Marks the descriptor unused (channels made with it are not affected). */
errval_t bulk_net_ep_destroy(struct bulk_net_endpoint_descriptor *ep);

/**
 * The endpoint's port: once bulk_channel_create returned on it, the port
 * it listens on (the kernel's choice for port 0); 0 for an invalid
 * descriptor or a port-0 endpoint no channel was created on yet.
 */
uint16_t bulk_net_ep_port(const struct bulk_net_endpoint_descriptor *ep);

#ifdef __cplusplus
}
#endif

#endif /* BULK_TRANSFER_BULK_NET_H */
