// A C++17 program using Ferry's C interface: every header together, the
// continuation macros, and calls that must link (the declarations are
// extern "C").
#include <bulk_transfer/bulk_transfer.h>
#include <bulk_transfer/bulk_allocator.h>
#include <bulk_transfer/bulk_local.h>
#include <bulk_transfer/bulk_sm.h>
#include <bulk_transfer/bulk_net.h>
#include <bulk_transfer/barrelfish_compat.h>

#include <cstdio>
#include <cstring>

static void never(void *, errval_t, struct bulk_channel *) {}

int main()
{
    struct bulk_continuation cont = MK_BULK_CONT(never, nullptr);
    struct bulk_continuation nop = BULK_CONT_NOP;
    if (cont.handler != never || nop.handler != nullptr) {
        std::printf("cpp_links: continuation macros wrong\n");
        return 1;
    }
    const char *s = bulk_strerror(BULK_ERR_TIMEOUT);
    if (s == nullptr || std::strlen(s) == 0) {
        std::printf("cpp_links: empty bulk_strerror\n");
        return 1;
    }
    struct bulk_allocator alloc;
    std::memset(&alloc, 0, sizeof alloc);
    errval_t err = bulk_alloc_init(&alloc, 2, 4096, nullptr);
    if (err_is_fail(err)) {
        std::printf("cpp_links: bulk_alloc_init: %s\n", bulk_strerror(err));
        return 1;
    }
    struct bulk_buffer *b = bulk_alloc_new_buffer(&alloc);
    if (b == nullptr || b->pool != alloc.pool || b->state != BULK_BUFFER_READ_WRITE) {
        std::printf("cpp_links: bulk_alloc_new_buffer gave no usable buffer\n");
        return 1;
    }
    std::memset(b->address, 7, b->pool->buffer_size);
    err = bulk_alloc_return_buffer(&alloc, b);
    if (err_is_fail(err)) {
        std::printf("cpp_links: bulk_alloc_return_buffer: %s\n", bulk_strerror(err));
        return 1;
    }
    err = bulk_alloc_free(&alloc);
    if (err_is_fail(err)) {
        std::printf("cpp_links: bulk_alloc_free: %s\n", bulk_strerror(err));
        return 1;
    }
    std::printf("cpp_links: ok\n");
    return 0;
}
