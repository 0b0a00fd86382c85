//! The exported functions of the C interface. Each checks its arguments
//! (NULL first), then works on the library state; a panic never crosses into C
//! (it becomes `BULK_ERR_INTERNAL`). Nothing here touches C memory
//! itself: that is the `boundary` module's.

// `#[no_mangle]` (exporting the C names) is all this lint finds here: the
// module has no unsafe block.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use ferry::Direction;

use crate::boundary;
use crate::codes::*;
use crate::ffi::*;
use crate::state::{self, Res};
use crate::table::{self, pool_id_of};
use crate::waitset::Cont;

/// Runs `f`, turning its result and any panic into an error code.
fn guard(f: impl FnOnce() -> Res<()>) -> Errval {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => OK,
        Ok(Err(e)) => e,
        Err(_) => ERR_INTERNAL,
    }
}

/// Runs `f` for a pointer result (NULL on error or panic).
fn guard_ptr<T>(f: impl FnOnce() -> Option<*mut T>) -> *mut T {
    catch_unwind(AssertUnwindSafe(f)).ok().flatten().unwrap_or(std::ptr::null_mut())
}

fn nonnull<T>(p: *const T) -> Res<()> {
    if p.is_null() {
        Err(ERR_NULL_ARGUMENT)
    } else {
        Ok(())
    }
}

/// `bulk_strerror`.
#[no_mangle]
pub extern "C" fn bulk_strerror(err: Errval) -> *const c_char {
    strerror(err).as_ptr()
}

// ---------------------------------------------------------------------- channels

/// `bulk_channel_create`.
#[no_mangle]
pub extern "C" fn bulk_channel_create(
    channel: *mut BulkChannel,
    ep_desc: *mut BulkEndpointDescriptor,
    callbacks: *mut BulkChannelCallbacks,
    setup: *mut BulkChannelSetup,
) -> Errval {
    guard(|| {
        nonnull(channel)?;
        nonnull(ep_desc)?;
        nonnull(callbacks)?;
        let setup = boundary::read(setup).ok_or(ERR_NULL_ARGUMENT)?;
        state::channel_create(channel, ep_desc, callbacks, setup)
    })
}

/// `bulk_channel_bind`.
#[no_mangle]
pub extern "C" fn bulk_channel_bind(
    channel: *mut BulkChannel,
    remote_ep_desc: *mut BulkEndpointDescriptor,
    callbacks: *mut BulkChannelCallbacks,
    params: *mut BulkChannelBindParams,
    cont: BulkContinuation,
) -> Errval {
    guard(|| {
        nonnull(channel)?;
        nonnull(remote_ep_desc)?;
        nonnull(callbacks)?;
        let params = boundary::read(params).ok_or(ERR_NULL_ARGUMENT)?;
        state::channel_bind(channel, remote_ep_desc, callbacks, params, Cont::of(cont))
    })
}

/// `bulk_channel_assign_pool`.
#[no_mangle]
pub extern "C" fn bulk_channel_assign_pool(
    channel: *mut BulkChannel,
    pool: *mut BulkPool,
    cont: BulkContinuation,
) -> Errval {
    guard(|| {
        nonnull(channel)?;
        nonnull(pool)?;
        state::channel_pool(channel, pool as usize, Cont::of(cont), true)
    })
}

/// `bulk_channel_remove_pool`.
#[no_mangle]
pub extern "C" fn bulk_channel_remove_pool(
    channel: *mut BulkChannel,
    pool: *mut BulkPool,
    cont: BulkContinuation,
) -> Errval {
    guard(|| {
        nonnull(channel)?;
        nonnull(pool)?;
        state::channel_pool(channel, pool as usize, Cont::of(cont), false)
    })
}

/// `bulk_channel_destroy`.
#[no_mangle]
pub extern "C" fn bulk_channel_destroy(channel: *mut BulkChannel, cont: BulkContinuation) -> Errval {
    guard(|| {
        nonnull(channel)?;
        state::channel_destroy(channel, Cont::of(cont))
    })
}

/// `bulk_channel_move`.
#[no_mangle]
pub extern "C" fn bulk_channel_move(
    channel: *mut BulkChannel,
    buffer: *mut BulkBuffer,
    meta: *mut c_void,
    cont: BulkContinuation,
) -> Errval {
    guard(|| {
        nonnull(channel)?;
        nonnull(buffer)?;
        state::channel_send(channel, buffer as usize, meta, Cont::of(cont), Direction::Tx)
    })
}

/// `bulk_channel_pass`.
#[no_mangle]
pub extern "C" fn bulk_channel_pass(
    channel: *mut BulkChannel,
    buffer: *mut BulkBuffer,
    meta: *mut c_void,
    cont: BulkContinuation,
) -> Errval {
    guard(|| {
        nonnull(channel)?;
        nonnull(buffer)?;
        state::channel_send(channel, buffer as usize, meta, Cont::of(cont), Direction::Rx)
    })
}

/// `bulk_channel_copy`.
#[no_mangle]
pub extern "C" fn bulk_channel_copy(
    channel: *mut BulkChannel,
    buffer: *mut BulkBuffer,
    meta: *mut c_void,
    cont: BulkContinuation,
) -> Errval {
    guard(|| {
        nonnull(channel)?;
        nonnull(buffer)?;
        state::channel_copy(channel, buffer as usize, meta, Cont::of(cont))
    })
}

/// `bulk_channel_release`.
#[no_mangle]
pub extern "C" fn bulk_channel_release(
    channel: *mut BulkChannel,
    buffer: *mut BulkBuffer,
    cont: BulkContinuation,
) -> Errval {
    guard(|| {
        nonnull(channel)?;
        nonnull(buffer)?;
        state::channel_release(channel, buffer as usize, Cont::of(cont))
    })
}

// ---------------------------------------------------------------------- pools, buffers

/// `bulk_pool_domain_list_get`.
#[no_mangle]
pub extern "C" fn bulk_pool_domain_list_get(id: *mut BulkPoolId) -> *mut BulkPool {
    guard_ptr(|| {
        let id = boundary::read(id)?;
        table::pool_by_id(pool_id_of(id)).map(|p| p as *mut BulkPool)
    })
}

/// `bulk_buffer_change_state`.
#[no_mangle]
pub extern "C" fn bulk_buffer_change_state(buffer: *mut BulkBuffer, state: u32) -> Errval {
    guard(|| {
        nonnull(buffer)?;
        table::buffer_change_state(buffer as usize, state)
    })
}

/// `bulk_alloc_init`.
#[no_mangle]
pub extern "C" fn bulk_alloc_init(
    alloc: *mut BulkAllocator,
    buffer_count: usize,
    buffer_size: usize,
    constraints: *mut BulkPoolConstraints,
) -> Errval {
    guard(|| {
        nonnull(alloc)?;
        table::alloc_init(alloc, buffer_count, buffer_size, boundary::read(constraints))
    })
}

/// `bulk_alloc_free`.
#[no_mangle]
pub extern "C" fn bulk_alloc_free(alloc: *mut BulkAllocator) -> Errval {
    guard(|| {
        nonnull(alloc)?;
        state::alloc_free(alloc)
    })
}

/// `bulk_alloc_new_buffer`.
#[no_mangle]
pub extern "C" fn bulk_alloc_new_buffer(alloc: *mut BulkAllocator) -> *mut BulkBuffer {
    guard_ptr(|| {
        if alloc.is_null() {
            return None;
        }
        table::alloc_new_buffer(alloc).ok().map(|p| p as *mut BulkBuffer)
    })
}

/// `bulk_alloc_return_buffer`.
#[no_mangle]
pub extern "C" fn bulk_alloc_return_buffer(alloc: *mut BulkAllocator, buffer: *mut BulkBuffer) -> Errval {
    guard(|| {
        nonnull(alloc)?;
        nonnull(buffer)?;
        table::alloc_return_buffer(alloc, buffer as usize)
    })
}

// ---------------------------------------------------------------------- waitsets

/// `bulk_waitset_create`.
#[no_mangle]
pub extern "C" fn bulk_waitset_create(ws: *mut *mut c_void) -> Errval {
    guard(|| {
        nonnull(ws)?;
        let key = state::waitset_create()?;
        boundary::write_out(ws, key as *mut c_void);
        Ok(())
    })
}

/// `bulk_waitset_destroy`.
#[no_mangle]
pub extern "C" fn bulk_waitset_destroy(ws: *mut c_void) -> Errval {
    guard(|| {
        nonnull(ws)?;
        state::waitset_destroy(ws as usize)
    })
}

/// `bulk_waitset_default`.
#[no_mangle]
pub extern "C" fn bulk_waitset_default() -> *mut c_void {
    guard_ptr(|| state::waitset_default().ok().map(|k| k as *mut c_void))
}

/// `bulk_waitset_set_spin`.
#[no_mangle]
pub extern "C" fn bulk_waitset_set_spin(ws: *mut c_void, spin_ns: u64) -> Errval {
    guard(|| {
        nonnull(ws)?;
        state::waitset_set_spin(ws as usize, Duration::from_nanos(spin_ns))
    })
}

/// `bulk_waitset_fd`.
#[no_mangle]
pub extern "C" fn bulk_waitset_fd(ws: *mut c_void) -> c_int {
    catch_unwind(|| state::waitset_fd(ws as usize).unwrap_or(-1)).unwrap_or(-1)
}

/// `bulk_waitset_dispatch`.
#[no_mangle]
pub extern "C" fn bulk_waitset_dispatch(ws: *mut c_void, timeout_ns: i64) -> Errval {
    guard(|| {
        nonnull(ws)?;
        state::dispatch(ws as usize, u64::try_from(timeout_ns).ok().map(Duration::from_nanos))
    })
}

// ---------------------------------------------------------------------- endpoints

fn descriptor(backend: u32, remote: bool) -> BulkEndpointDescriptor {
    BulkEndpointDescriptor { magic: EP_MAGIC, backend, remote: u32::from(remote), reserved: 0 }
}

/// `bulk_local_init_endpoint`.
#[no_mangle]
pub extern "C" fn bulk_local_init_endpoint(endpoint: *mut BulkLocalEndpoint, other_channel: *mut BulkChannel) {
    let _ = catch_unwind(|| {
        if !endpoint.is_null() {
            boundary::init_local(endpoint, descriptor(BACKEND_LOCAL, !other_channel.is_null()), other_channel);
        }
    });
}

fn sm_create(ep: *mut BulkSmEndpointDescriptor, path: *const c_char, remote: bool) -> Errval {
    guard(|| {
        nonnull(ep)?;
        nonnull(path)?;
        let path = boundary::c_string(path, SM_PATH_CAP - 1).ok_or(ERR_INVALID_ARGUMENT)?;
        if path.is_empty() {
            return Err(ERR_INVALID_ARGUMENT);
        }
        boundary::init_sm(ep, descriptor(BACKEND_SM, remote), &path);
        Ok(())
    })
}

/// `bulk_sm_ep_create`.
#[no_mangle]
pub extern "C" fn bulk_sm_ep_create(ep: *mut BulkSmEndpointDescriptor, path: *const c_char) -> Errval {
    sm_create(ep, path, false)
}

/// `bulk_sm_ep_create_remote`.
#[no_mangle]
pub extern "C" fn bulk_sm_ep_create_remote(ep: *mut BulkSmEndpointDescriptor, path: *const c_char) -> Errval {
    sm_create(ep, path, true)
}

/// Marks a descriptor of `backend` unused.
fn ep_destroy(ep: *mut BulkEndpointDescriptor, backend: u32) -> Errval {
    guard(|| {
        nonnull(ep)?;
        let d = boundary::read_endpoint(ep);
        if d.magic != EP_MAGIC || d.backend != backend {
            return Err(ERR_INVALID_ENDPOINT);
        }
        boundary::clear_endpoint(ep);
        Ok(())
    })
}

/// `bulk_sm_ep_destroy`.
#[no_mangle]
pub extern "C" fn bulk_sm_ep_destroy(ep: *mut BulkSmEndpointDescriptor) -> Errval {
    ep_destroy(ep as *mut BulkEndpointDescriptor, BACKEND_SM)
}

fn net_create(ep: *mut BulkNetEndpointDescriptor, setup: *mut BulkNetEpSetup, remote: bool) -> Errval {
    guard(|| {
        nonnull(ep)?;
        nonnull(setup)?;
        let (ip, port) = boundary::net_setup(setup);
        let ip = boundary::c_string(ip, NET_IP_CAP - 1).ok_or(ERR_NULL_ARGUMENT)?;
        let parsed = std::str::from_utf8(&ip).ok().and_then(|s| s.parse::<std::net::IpAddr>().ok());
        if parsed.is_none() || (remote && port == 0) {
            return Err(ERR_INVALID_ARGUMENT);
        }
        boundary::init_net(ep, descriptor(BACKEND_NET, remote), &ip, port);
        Ok(())
    })
}

/// `bulk_net_ep_create`.
#[no_mangle]
pub extern "C" fn bulk_net_ep_create(ep: *mut BulkNetEndpointDescriptor, setup: *mut BulkNetEpSetup) -> Errval {
    net_create(ep, setup, false)
}

/// `bulk_net_ep_create_remote`.
#[no_mangle]
pub extern "C" fn bulk_net_ep_create_remote(ep: *mut BulkNetEndpointDescriptor, setup: *mut BulkNetEpSetup) -> Errval {
    net_create(ep, setup, true)
}

/// `bulk_net_ep_destroy`.
#[no_mangle]
pub extern "C" fn bulk_net_ep_destroy(ep: *mut BulkNetEndpointDescriptor) -> Errval {
    ep_destroy(ep as *mut BulkEndpointDescriptor, BACKEND_NET)
}

/// `bulk_net_ep_port`.
#[no_mangle]
pub extern "C" fn bulk_net_ep_port(ep: *const BulkNetEndpointDescriptor) -> u16 {
    catch_unwind(|| {
        if ep.is_null() {
            return 0;
        }
        let d = boundary::read_endpoint(ep as *const BulkEndpointDescriptor);
        if d.magic != EP_MAGIC || d.backend != BACKEND_NET {
            return 0;
        }
        boundary::net_addr(ep as *const BulkEndpointDescriptor).1
    })
    .unwrap_or(0)
}
