/*
 * The few names of the original bulk-transfer implementation's operating
 * system that its programs use, mapped onto Ferry's C interface, so that
 * such programs build on Linux with few changes. New programs need not
 * include it: everything here is a name for something in bulk_transfer.h
 * or the C library.
 */
#ifndef BULK_TRANSFER_BARRELFISH_COMPAT_H
#define BULK_TRANSFER_BARRELFISH_COMPAT_H

#include <bulk_transfer/bulk_transfer.h>

#include <assert.h>
#include <sched.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Success. */
#define SYS_ERR_OK BULK_OK

/** Whether `err` is success. */
static inline int err_is_ok(errval_t err)
{
    return err == BULK_OK;
}

/** Whether `err` is an error. */
static inline int err_is_fail(errval_t err)
{
    return err != BULK_OK;
}

/** A sentence describing `err`. */
static inline const char *err_getstring(errval_t err)
{
    return bulk_strerror(err);
}

/** The default waitset. */
static inline struct waitset *get_default_waitset(void)
{
    return bulk_waitset_default();
}

/** Waits for and runs the next callback or continuation of `ws`. */
static inline errval_t event_dispatch(struct waitset *ws)
{
    return bulk_waitset_dispatch(ws, BULK_WAIT_FOREVER);
}

/** Lets another thread run. */
static inline void thread_yield(void)
{
    sched_yield();
}

/** The process id, standing for the original's domain id. */
static inline unsigned disp_get_domain_id(void)
{
    return (unsigned)getpid();
}

/** printf to stderr, prefixed with the process id. */
#define debug_printf(...)                                    \
    do {                                                     \
        fprintf(stderr, "[%u] ", (unsigned)getpid());        \
        fprintf(stderr, __VA_ARGS__);                        \
    } while (0)

/** Prints an error with a message to stderr. */
#define DEBUG_ERR(err, ...)                                  \
    do {                                                     \
        errval_t debug_err_value_ = (err);                   \
        fprintf(stderr, "[%u] ", (unsigned)getpid());        \
        fprintf(stderr, __VA_ARGS__);                        \
        fprintf(stderr, ": %s\n", bulk_strerror(debug_err_value_)); \
    } while (0)

/** Prints an error with a message to stderr and aborts. */
#define USER_PANIC_ERR(err, ...)                             \
    do {                                                     \
        DEBUG_ERR(err, __VA_ARGS__);                         \
        abort();                                             \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif /* BULK_TRANSFER_BARRELFISH_COMPAT_H */
