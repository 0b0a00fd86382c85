//! The headers must describe the library exactly: this test writes a C
//! file of static assertions from the Rust definitions (the size and every
//! field offset of each struct, every enum and error value, and the type of
//! every exported function) and compiles it against the checked-in headers
//! with the system's C compiler. A header that drifts fails the build of
//! that file, naming the assertion.

use std::fmt::Write as _;
use std::mem::{offset_of, size_of};
use std::process::Command;

use ferry::{BufferState, ChannelState, Direction, Role, TrustLevel};

use crate::api::*;
use crate::codes::*;
use crate::ffi::*;

/// Asserts `sizeof` and every field's `offsetof` of a struct.
macro_rules! layout {
    ($out:ident, $c:literal, $rust:ty { $($field:ident),* $(,)? }) => {{
        writeln!($out, "_Static_assert(sizeof(struct {}) == {}, \"size of struct {}\");", $c, size_of::<$rust>(), $c).unwrap();
        $(
            writeln!(
                $out,
                "_Static_assert(offsetof(struct {}, {}) == {}, \"offset of {}.{}\");",
                $c, stringify!($field), offset_of!($rust, $field), $c, stringify!($field)
            ).unwrap();
        )*
    }};
}

/// Asserts the type of an exported function (the Rust side is checked by
/// the compiler: the function must have exactly the Rust type given).
macro_rules! function {
    ($out:ident, $name:ident, $rust:ty, $c:literal) => {{
        let _: $rust = $name;
        writeln!(
            $out,
            "_Static_assert(__builtin_types_compatible_p(__typeof__(&{}), {}), \"type of {}\");",
            stringify!($name),
            $c,
            stringify!($name)
        )
        .unwrap();
    }};
}

fn value(out: &mut String, c: &str, v: impl std::fmt::Display) {
    writeln!(out, "_Static_assert({c} == {v}, \"value of {c}\");").unwrap();
}

fn assertions() -> String {
    let mut o = String::new();
    o.push_str(
        "#include <stddef.h>\n#include <bulk_transfer/bulk_transfer.h>\n#include <bulk_transfer/bulk_allocator.h>\n\
         #include <bulk_transfer/bulk_local.h>\n#include <bulk_transfer/bulk_sm.h>\n#include <bulk_transfer/bulk_net.h>\n\
         #include <bulk_transfer/barrelfish_compat.h>\n",
    );
    writeln!(o, "_Static_assert(sizeof(errval_t) == {}, \"errval_t\");", size_of::<Errval>()).unwrap();
    writeln!(o, "_Static_assert(sizeof(enum bulk_channel_state) == 4, \"enum size\");").unwrap();
    layout!(o, "bulk_continuation", BulkContinuation { handler, arg });
    layout!(o, "bulk_endpoint_descriptor", BulkEndpointDescriptor { magic, backend, remote, reserved });
    layout!(o, "bulk_local_endpoint", BulkLocalEndpoint { generic, other_channel });
    layout!(o, "bulk_sm_endpoint_descriptor", BulkSmEndpointDescriptor { ep_generic, path });
    layout!(o, "bulk_net_ep_setup", BulkNetEpSetup { ip, port });
    layout!(o, "bulk_net_endpoint_descriptor", BulkNetEndpointDescriptor { ep_generic, ip, port });
    layout!(o, "bulk_channel_constraints", BulkChannelConstraints { mem_range_min, mem_range_max, men_align });
    layout!(
        o,
        "bulk_channel_callbacks",
        BulkChannelCallbacks {
            bind_received,
            teardown_received,
            pool_assigned,
            pool_removed,
            move_received,
            buffer_received,
            copy_received,
            copy_released,
            request_received,
        }
    );
    layout!(
        o,
        "bulk_channel",
        BulkChannel {
            callbacks,
            ep,
            state,
            pools,
            direction,
            role,
            trust,
            constraints,
            meta_size,
            waitset,
            user_state,
            impl_data,
        }
    );
    layout!(
        o,
        "bulk_channel_setup",
        BulkChannelSetup { direction, role, trust, constraints, meta_size, waitset, user_state }
    );
    layout!(o, "bulk_channel_bind_params", BulkChannelBindParams { role, trust, constraints, waitset, user_state });
    layout!(o, "bulk_pool_id", BulkPoolId { machine, dom, local, tag });
    layout!(o, "bulk_pool", BulkPool { id, base_address, buffer_size, trust, num_buffers, buffers });
    layout!(o, "bulk_buffer", BulkBuffer { address, pool, bufferid, state, local_ref_count, reserved });
    layout!(o, "bulk_allocator", BulkAllocator { pool, num_free, impl_data });
    layout!(o, "bulk_pool_constraints", BulkPoolConstraints { range_min, range_max, alignment, trust });

    value(&mut o, "BULK_SM_PATH_MAX + 1", SM_PATH_CAP);
    value(&mut o, "BULK_NET_IP_MAX + 1", NET_IP_CAP);
    value(&mut o, "BULK_MAX_META_SIZE", ferry::MAX_META_SIZE);
    value(&mut o, "BULK_OK", OK);
    value(&mut o, "SYS_ERR_OK", OK);
    for (name, v) in ALL {
        value(&mut o, &format!("BULK_{name}"), v);
    }
    value(&mut o, "BULK_ERR_COUNT", ERR_COUNT);
    value(&mut o, "BULK_WAIT_FOREVER", -1);
    value(&mut o, "BULK_DIRECTION_TX", direction_to(Direction::Tx));
    value(&mut o, "BULK_DIRECTION_RX", direction_to(Direction::Rx));
    value(&mut o, "BULK_ROLE_GENERIC", role_to(Role::Generic));
    value(&mut o, "BULK_ROLE_MASTER", role_to(Role::Master));
    value(&mut o, "BULK_ROLE_SLAVE", role_to(Role::Slave));
    for (c, t) in [
        ("UNINITIALIZED", TrustLevel::Uninitialized),
        ("NONE", TrustLevel::None),
        ("HALF", TrustLevel::Half),
        ("FULL", TrustLevel::Full),
    ] {
        value(&mut o, &format!("BULK_TRUST_{c}"), trust_to(t));
    }
    for (c, s) in [
        ("UNINITIALIZED", ChannelState::Uninitialized),
        ("INITIALIZED", ChannelState::Initialized),
        ("BINDING", ChannelState::Binding),
        ("BIND_NEGOTIATE", ChannelState::BindNegotiate),
        ("CONNECTED", ChannelState::Connected),
        ("TEARDOWN", ChannelState::Teardown),
        ("CLOSED", ChannelState::Closed),
    ] {
        value(&mut o, &format!("BULK_STATE_{c}"), state_to(s));
    }
    for (c, s) in [
        ("INVALID", BufferState::Invalid),
        ("READ_ONLY", BufferState::ReadOnly),
        ("RO_OWNED", BufferState::ReadOnlyOwned),
        ("READ_WRITE", BufferState::ReadWrite),
    ] {
        value(&mut o, &format!("BULK_BUFFER_{c}"), buffer_state_to(s));
    }
    value(&mut o, "BULK_BACKEND_LOCAL", BACKEND_LOCAL);
    value(&mut o, "BULK_BACKEND_SM", BACKEND_SM);
    value(&mut o, "BULK_BACKEND_NET", BACKEND_NET);

    type Ch = *mut BulkChannel;
    type Buf = *mut BulkBuffer;
    type Void = *mut std::ffi::c_void;
    function!(o, bulk_strerror, extern "C" fn(Errval) -> *const std::ffi::c_char, "const char *(*)(errval_t)");
    function!(
        o,
        bulk_channel_create,
        extern "C" fn(Ch, *mut BulkEndpointDescriptor, *mut BulkChannelCallbacks, *mut BulkChannelSetup) -> Errval,
        "errval_t (*)(struct bulk_channel *, struct bulk_endpoint_descriptor *, struct bulk_channel_callbacks *, struct bulk_channel_setup *)"
    );
    function!(
        o,
        bulk_channel_bind,
        extern "C" fn(Ch, *mut BulkEndpointDescriptor, *mut BulkChannelCallbacks, *mut BulkChannelBindParams, BulkContinuation) -> Errval,
        "errval_t (*)(struct bulk_channel *, struct bulk_endpoint_descriptor *, struct bulk_channel_callbacks *, struct bulk_channel_bind_params *, struct bulk_continuation)"
    );
    function!(
        o,
        bulk_channel_assign_pool,
        extern "C" fn(Ch, *mut BulkPool, BulkContinuation) -> Errval,
        "errval_t (*)(struct bulk_channel *, struct bulk_pool *, struct bulk_continuation)"
    );
    function!(
        o,
        bulk_channel_remove_pool,
        extern "C" fn(Ch, *mut BulkPool, BulkContinuation) -> Errval,
        "errval_t (*)(struct bulk_channel *, struct bulk_pool *, struct bulk_continuation)"
    );
    function!(
        o,
        bulk_channel_destroy,
        extern "C" fn(Ch, BulkContinuation) -> Errval,
        "errval_t (*)(struct bulk_channel *, struct bulk_continuation)"
    );
    for name in ["move", "pass", "copy"] {
        writeln!(o, "_Static_assert(__builtin_types_compatible_p(__typeof__(&bulk_channel_{name}), errval_t (*)(struct bulk_channel *, struct bulk_buffer *, void *, struct bulk_continuation)), \"type of bulk_channel_{name}\");").unwrap();
    }
    let _: extern "C" fn(Ch, Buf, Void, BulkContinuation) -> Errval = bulk_channel_move;
    let _: extern "C" fn(Ch, Buf, Void, BulkContinuation) -> Errval = bulk_channel_pass;
    let _: extern "C" fn(Ch, Buf, Void, BulkContinuation) -> Errval = bulk_channel_copy;
    function!(
        o,
        bulk_channel_release,
        extern "C" fn(Ch, Buf, BulkContinuation) -> Errval,
        "errval_t (*)(struct bulk_channel *, struct bulk_buffer *, struct bulk_continuation)"
    );
    function!(
        o,
        bulk_pool_domain_list_get,
        extern "C" fn(*mut BulkPoolId) -> *mut BulkPool,
        "struct bulk_pool *(*)(struct bulk_pool_id *)"
    );
    function!(
        o,
        bulk_buffer_change_state,
        extern "C" fn(Buf, u32) -> Errval,
        "errval_t (*)(struct bulk_buffer *, enum bulk_buffer_state)"
    );
    function!(
        o,
        bulk_alloc_init,
        extern "C" fn(*mut BulkAllocator, usize, usize, *mut BulkPoolConstraints) -> Errval,
        "errval_t (*)(struct bulk_allocator *, size_t, size_t, struct bulk_pool_constraints *)"
    );
    function!(o, bulk_alloc_free, extern "C" fn(*mut BulkAllocator) -> Errval, "errval_t (*)(struct bulk_allocator *)");
    function!(
        o,
        bulk_alloc_new_buffer,
        extern "C" fn(*mut BulkAllocator) -> Buf,
        "struct bulk_buffer *(*)(struct bulk_allocator *)"
    );
    function!(
        o,
        bulk_alloc_return_buffer,
        extern "C" fn(*mut BulkAllocator, Buf) -> Errval,
        "errval_t (*)(struct bulk_allocator *, struct bulk_buffer *)"
    );
    function!(o, bulk_waitset_create, extern "C" fn(*mut Void) -> Errval, "errval_t (*)(struct waitset **)");
    function!(o, bulk_waitset_destroy, extern "C" fn(Void) -> Errval, "errval_t (*)(struct waitset *)");
    function!(o, bulk_waitset_default, extern "C" fn() -> Void, "struct waitset *(*)(void)");
    function!(o, bulk_waitset_dispatch, extern "C" fn(Void, i64) -> Errval, "errval_t (*)(struct waitset *, int64_t)");
    function!(o, bulk_waitset_set_spin, extern "C" fn(Void, u64) -> Errval, "errval_t (*)(struct waitset *, uint64_t)");
    function!(o, bulk_waitset_fd, extern "C" fn(Void) -> std::ffi::c_int, "int (*)(struct waitset *)");
    function!(
        o,
        bulk_local_init_endpoint,
        extern "C" fn(*mut BulkLocalEndpoint, Ch),
        "void (*)(struct bulk_local_endpoint *, struct bulk_channel *)"
    );
    function!(
        o,
        bulk_sm_ep_create,
        extern "C" fn(*mut BulkSmEndpointDescriptor, *const std::ffi::c_char) -> Errval,
        "errval_t (*)(struct bulk_sm_endpoint_descriptor *, const char *)"
    );
    function!(
        o,
        bulk_sm_ep_create_remote,
        extern "C" fn(*mut BulkSmEndpointDescriptor, *const std::ffi::c_char) -> Errval,
        "errval_t (*)(struct bulk_sm_endpoint_descriptor *, const char *)"
    );
    function!(
        o,
        bulk_sm_ep_destroy,
        extern "C" fn(*mut BulkSmEndpointDescriptor) -> Errval,
        "errval_t (*)(struct bulk_sm_endpoint_descriptor *)"
    );
    function!(
        o,
        bulk_net_ep_create,
        extern "C" fn(*mut BulkNetEndpointDescriptor, *mut BulkNetEpSetup) -> Errval,
        "errval_t (*)(struct bulk_net_endpoint_descriptor *, struct bulk_net_ep_setup *)"
    );
    function!(
        o,
        bulk_net_ep_create_remote,
        extern "C" fn(*mut BulkNetEndpointDescriptor, *mut BulkNetEpSetup) -> Errval,
        "errval_t (*)(struct bulk_net_endpoint_descriptor *, struct bulk_net_ep_setup *)"
    );
    function!(
        o,
        bulk_net_ep_destroy,
        extern "C" fn(*mut BulkNetEndpointDescriptor) -> Errval,
        "errval_t (*)(struct bulk_net_endpoint_descriptor *)"
    );
    function!(
        o,
        bulk_net_ep_port,
        extern "C" fn(*const BulkNetEndpointDescriptor) -> u16,
        "uint16_t (*)(const struct bulk_net_endpoint_descriptor *)"
    );
    o
}

/// Compiles `source` (C11, all warnings as errors) against the headers.
fn compile(source: &str) -> std::process::Output {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ferry-c-layout-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("layout.c");
    std::fs::write(&file, source).unwrap();
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let out = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-I", include])
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc} (scripts/setup installs it): {e}"));
    let _ = std::fs::remove_dir_all(&dir);
    out
}

#[test]
fn the_headers_match_the_library() {
    let out = compile(&assertions());
    assert!(out.status.success(), "the headers differ from the library:\n{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_drifted_header_is_caught() {
    // The check itself can fail: one changed number is reported.
    let wrong = assertions().replacen("== 4, \"value of BULK_ERR_TIMEOUT\"", "== 5, \"value of BULK_ERR_TIMEOUT\"", 1);
    assert_ne!(wrong, assertions());
    let out = compile(&wrong);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("value of BULK_ERR_TIMEOUT"));
}

#[test]
fn the_readme_shows_the_example_the_tests_build() {
    let readme = include_str!("../../../README.md");
    let section = &readme[readme.find("## Using Ferry from C").expect("the README's C section")..];
    let start = section.find("```c\n").expect("a C block") + "```c\n".len();
    let block = &section[start..start + section[start..].find("```").expect("its end")];
    assert_eq!(block, include_str!("../examples/hello.c"), "README's program differs from examples/hello.c");
}
