/*
 * A channel whose two ends live in this process, over the endpoint a
 * program's argument names: "local" (threads of one process), "sm" (shared
 * memory, a Unix socket path) or "net" (TCP on loopback, a port the kernel
 * chooses). The source end creates the channel, the echo end binds to it.
 *
 * Every program defines _GNU_SOURCE before including it.
 */
#ifndef FERRY_C_TESTS_PAIR_H
#define FERRY_C_TESTS_PAIR_H

#include "common.h"

#include <bulk_transfer/bulk_local.h>
#include <bulk_transfer/bulk_net.h>
#include <bulk_transfer/bulk_sm.h>

#include <unistd.h>

enum pair_kind { PAIR_LOCAL, PAIR_SM, PAIR_NET };

/** The endpoints of a pair (only those of its kind are used). */
struct pair_endpoints {
    enum pair_kind kind;
    struct bulk_local_endpoint local, local_remote;
    struct bulk_sm_endpoint_descriptor sm, sm_remote;
    struct bulk_net_endpoint_descriptor net, net_remote;
    char path[108];
};

/** The kind `argv[1]` names; exits with a usage line if it names none. */
static inline enum pair_kind pair_kind_of(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "local") == 0) {
        return PAIR_LOCAL;
    }
    if (argc == 2 && strcmp(argv[1], "sm") == 0) {
        return PAIR_SM;
    }
    if (argc == 2 && strcmp(argv[1], "net") == 0) {
        return PAIR_NET;
    }
    fprintf(stderr, "usage: %s local|sm|net\n", argv[0]);
    exit(2);
}

/** Creates `source` (with `source_cbs`, `setup`) on a new endpoint of
 *  `kind` and binds `echo` (with `echo_cbs`, `params`, `bound` for the
 *  bind's continuation) to it. `tag` names the socket path of "sm". */
static inline void pair_connect(struct pair_endpoints *eps, enum pair_kind kind, const char *tag,
                                struct bulk_channel *source, struct bulk_channel_callbacks *source_cbs,
                                struct bulk_channel_setup *setup, struct bulk_channel *echo,
                                struct bulk_channel_callbacks *echo_cbs, struct bulk_channel_bind_params *params,
                                struct bulk_continuation bound)
{
    eps->kind = kind;
    switch (kind) {
    case PAIR_SM:
        snprintf(eps->path, sizeof eps->path, "/tmp/ferry-c-%s-%d.sock", tag, (int)getpid());
        EXPECT_OK(bulk_sm_ep_create(&eps->sm, eps->path));
        EXPECT_OK(bulk_sm_ep_create_remote(&eps->sm_remote, eps->path));
        EXPECT_OK(bulk_channel_create(source, &eps->sm.ep_generic, source_cbs, setup));
        EXPECT_OK(bulk_channel_bind(echo, &eps->sm_remote.ep_generic, echo_cbs, params, bound));
        break;
    case PAIR_NET: {
        struct bulk_net_ep_setup listen = { .ip = "127.0.0.1", .port = 0 };
        EXPECT_OK(bulk_net_ep_create(&eps->net, &listen));
        EXPECT_OK(bulk_channel_create(source, &eps->net.ep_generic, source_cbs, setup));
        struct bulk_net_ep_setup connect = { .ip = "127.0.0.1", .port = bulk_net_ep_port(&eps->net) };
        EXPECT_OK(bulk_net_ep_create_remote(&eps->net_remote, &connect));
        EXPECT_OK(bulk_channel_bind(echo, &eps->net_remote.ep_generic, echo_cbs, params, bound));
        break;
    }
    case PAIR_LOCAL:
        bulk_local_init_endpoint(&eps->local, NULL);
        EXPECT_OK(bulk_channel_create(source, &eps->local.generic, source_cbs, setup));
        bulk_local_init_endpoint(&eps->local_remote, source);
        EXPECT_OK(bulk_channel_bind(echo, &eps->local_remote.generic, echo_cbs, params, bound));
        break;
    }
}

/** Destroys the pair's endpoints (after its channels). */
static inline void pair_destroy_endpoints(struct pair_endpoints *eps)
{
    switch (eps->kind) {
    case PAIR_SM:
        EXPECT_OK(bulk_sm_ep_destroy(&eps->sm));
        EXPECT_OK(bulk_sm_ep_destroy(&eps->sm_remote));
        unlink(eps->path);
        break;
    case PAIR_NET:
        EXPECT_OK(bulk_net_ep_destroy(&eps->net));
        EXPECT_OK(bulk_net_ep_destroy(&eps->net_remote));
        break;
    case PAIR_LOCAL:
        break;
    }
}

#endif /* FERRY_C_TESTS_PAIR_H */
