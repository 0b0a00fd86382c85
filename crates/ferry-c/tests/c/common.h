/*
 * Helpers shared by the C test programs of Ferry's C interface: failing
 * with a message, checking returned codes, dispatching a waitset until a
 * condition holds (with a deadline), and the payload pattern and checksum
 * both ends of a transfer compute.
 *
 * Every program defines _GNU_SOURCE before including it.
 */
#ifndef FERRY_C_TESTS_COMMON_H
#define FERRY_C_TESTS_COMMON_H

#include <bulk_transfer/bulk_transfer.h>

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/** How long a program waits for any one thing before it fails. */
#define TEST_DEADLINE_NS (60ull * 1000 * 1000 * 1000)

/** Ends the program with a message (a failure later checks cannot
 *  survive: a missed deadline, a dispatch error). */
#define FATAL(...)                                                         \
    do {                                                                   \
        fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);               \
        fprintf(stderr, __VA_ARGS__);                                      \
        fprintf(stderr, "\n");                                             \
        fflush(stdout);                                                    \
        exit(1);                                                           \
    } while (0)

/* A program that defines SOFT_CHECKS before including this header goes on
 * after a failed check (each of its checks is one call, independent of the
 * others), counts the failures in `check_failures` and reports them all;
 * it must end with `return check_failures ? 1 : 0`. Otherwise a failed
 * check ends the program. */
#ifdef SOFT_CHECKS
static unsigned check_failures;
#define FAIL(...)                                                          \
    do {                                                                   \
        fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);               \
        fprintf(stderr, __VA_ARGS__);                                      \
        fprintf(stderr, "\n");                                             \
        check_failures++;                                                  \
    } while (0)
#else
#define FAIL(...) FATAL(__VA_ARGS__)
#endif

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "check failed: %s\n", #cond);                  \
            FAIL(__VA_ARGS__);                                             \
        }                                                                  \
    } while (0)

/** `call` must return exactly `code`. */
#define EXPECT_CODE(call, code)                                            \
    do {                                                                   \
        errval_t got_ = (call);                                            \
        if (got_ != (errval_t)(code)) {                                    \
            FAIL("%s returned %" PRIuPTR " (%s), expected %s (%" PRIuPTR ")", \
                 #call, (uintptr_t)got_, bulk_strerror(got_), #code,       \
                 (uintptr_t)(code));                                       \
        }                                                                  \
    } while (0)

#define EXPECT_OK(call) EXPECT_CODE(call, BULK_OK)

/** `call` must return one of the two codes. */
#define EXPECT_CODE2(call, code1, code2)                                   \
    do {                                                                   \
        errval_t got_ = (call);                                            \
        if (got_ != (errval_t)(code1) && got_ != (errval_t)(code2)) {      \
            FAIL("%s returned %" PRIuPTR " (%s), expected %s or %s",       \
                 #call, (uintptr_t)got_, bulk_strerror(got_), #code1,      \
                 #code2);                                                  \
        }                                                                  \
    } while (0)

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/** Dispatches `ws` until `cond` holds; fails on a dispatch error or after
 *  TEST_DEADLINE_NS. */
#define WAIT_FOR(ws, cond, what)                                           \
    do {                                                                   \
        uint64_t deadline_ = now_ns() + TEST_DEADLINE_NS;                  \
        while (!(cond)) {                                                  \
            errval_t e_ = bulk_waitset_dispatch((ws), 100000000);          \
            if (e_ != BULK_OK && e_ != BULK_ERR_TIMEOUT) {                 \
                FATAL("dispatch while waiting for %s: %s", (what),         \
                     bulk_strerror(e_));                                   \
            }                                                              \
            if (now_ns() > deadline_) {                                    \
                FATAL("no %s within the deadline", (what));                \
            }                                                              \
        }                                                                  \
    } while (0)

/** Runs everything that is due on `ws` (dispatch(ws, 0) until TIMEOUT);
 *  returns how many callbacks ran. */
static inline unsigned drain(struct waitset *ws)
{
    unsigned ran = 0;
    for (;;) {
        errval_t e = bulk_waitset_dispatch(ws, 0);
        if (e == BULK_ERR_TIMEOUT) {
            return ran;
        }
        if (e != BULK_OK) {
            FATAL("bulk_waitset_dispatch(ws, 0): %s", bulk_strerror(e));
        }
        ran++;
        if (ran > 1000000) {
            FATAL("bulk_waitset_dispatch(ws, 0) never returned BULK_ERR_TIMEOUT");
        }
    }
}

/** One step of the checksum both ends compute: FNV-1a over 64-bit words. */
static inline uint64_t hash_step(uint64_t h, uint64_t word)
{
    return (h ^ word) * 0x100000001b3ull;
}

#define HASH_START 0xcbf29ce484222325ull

/** Fills `len` bytes (a multiple of 8) with a pseudo-random pattern
 *  seeded by `seed`; returns their checksum. */
static inline uint64_t fill_pattern(void *p, size_t len, uint64_t seed)
{
    uint64_t *w = p;
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    uint64_t h = HASH_START;
    for (size_t i = 0; i < len / 8; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w[i] = x;
        h = hash_step(h, x);
    }
    return h;
}

/** The checksum of `len` bytes (a multiple of 8). */
static inline uint64_t hash_bytes(const void *p, size_t len)
{
    const uint64_t *w = p;
    uint64_t h = HASH_START;
    for (size_t i = 0; i < len / 8; i++) {
        h = hash_step(h, w[i]);
    }
    return h;
}

/** Folds one buffer's checksum into a transfer's (order matters). */
static inline uint64_t hash_fold(uint64_t total, uint64_t buffer_hash)
{
    return hash_step(total, buffer_hash);
}

#endif /* FERRY_C_TESTS_COMMON_H */
