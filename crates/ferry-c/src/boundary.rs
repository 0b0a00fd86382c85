//! Every access to memory the C program owns, and every call into C code.
//! The interface's rules (bulk_transfer.h) are the contract that makes
//! these accesses sound: pointers given to the library point to live
//! objects of the declared type, a channel or allocator struct stays at its
//! address and is not changed by the program while the library uses it,
//! callbacks are functions of the declared signature.
//!
//! Pointers that name library-owned objects (pools, buffers, waitsets) are
//! never dereferenced here: they are looked up by address in the library state.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_void, CStr};
use std::ptr;

use crate::ffi::*;
use ferry::MAX_META_SIZE;

/// Reads a caller's struct (NULL: `None`).
pub fn read<T: Copy>(p: *const T) -> Option<T> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-NULL pointers given to the library point to a live `T`
    // (interface contract); `read_unaligned` copes with any placement.
    Some(unsafe { ptr::read_unaligned(p) })
}

/// The token the library keeps in a channel's `impl_data`.
pub fn channel_token(ch: *const BulkChannel) -> usize {
    // SAFETY: `ch` is a non-NULL pointer to a channel struct (checked by
    // the caller; interface contract); a field read of plain data.
    unsafe { ptr::addr_of!((*ch).impl_data).read_unaligned() as usize }
}

/// Fills a channel struct at create or bind.
pub fn init_channel(ch: *mut BulkChannel, value: BulkChannel) {
    // SAFETY: `ch` is a live, non-NULL channel struct given to create or
    // bind (checked by the caller; interface contract).
    unsafe { ptr::write_unaligned(ch, value) }
}

/// The channel fields that follow the channel's state.
pub struct ChannelFields {
    /// `state`.
    pub state: u32,
    /// `direction`.
    pub direction: u32,
    /// `role`.
    pub role: u32,
    /// `trust`.
    pub trust: u32,
    /// `meta_size`.
    pub meta_size: usize,
}

/// Writes the fields that follow the channel's state, one by one (the
/// program's `user_state` and the rest are left alone).
pub fn write_channel_fields(ch: *mut BulkChannel, f: &ChannelFields) {
    // SAFETY: `ch` is a live channel struct registered with the library
    // (it stays at its address until destroyed: interface contract); we
    // hold its waitset's lock, so no other library code writes it now.
    unsafe {
        ptr::addr_of_mut!((*ch).state).write_unaligned(f.state);
        ptr::addr_of_mut!((*ch).direction).write_unaligned(f.direction);
        ptr::addr_of_mut!((*ch).role).write_unaligned(f.role);
        ptr::addr_of_mut!((*ch).trust).write_unaligned(f.trust);
        ptr::addr_of_mut!((*ch).meta_size).write_unaligned(f.meta_size);
    }
}

/// Marks a channel struct destroyed: CLOSED, no library state.
pub fn clear_channel(ch: *mut BulkChannel, state: u32) {
    // SAFETY: as in `write_channel_fields`.
    unsafe {
        ptr::addr_of_mut!((*ch).state).write_unaligned(state);
        ptr::addr_of_mut!((*ch).impl_data).write_unaligned(ptr::null_mut());
    }
}

/// Marks an allocator struct freed.
pub fn clear_allocator(a: *mut BulkAllocator) {
    write_allocator(a, ptr::null_mut(), 0, 0)
}

/// The token the library keeps in an allocator's `impl_data`.
pub fn allocator_token(a: *const BulkAllocator) -> usize {
    // SAFETY: non-NULL (checked by the caller), an allocator struct.
    unsafe { ptr::addr_of!((*a).impl_data).read_unaligned() as usize }
}

/// Updates an allocator's `num_free`. Two threads' calls on one allocator
/// may write it at once (an allocator call holds only its buffer's lock),
/// so the write is an atomic store: a plain store on the machine.
pub fn set_num_free(a: *mut BulkAllocator, n: usize) {
    // SAFETY: a live allocator struct registered with the library.
    let field = unsafe { ptr::addr_of_mut!((*a).num_free) };
    if field.is_aligned() {
        // SAFETY: aligned (checked) and valid for the struct's life; the
        // library's other write of the field (`write_allocator`) runs when
        // no allocator call writes it: at init before the allocator is
        // registered, at free after every buffer's lock was passed.
        unsafe { std::sync::atomic::AtomicUsize::from_ptr(field) }.store(n, std::sync::atomic::Ordering::Relaxed);
    } else {
        // SAFETY: as above; a struct out of its C alignment (a packed
        // copy) gets the plain write.
        unsafe { field.write_unaligned(n) }
    }
}

/// Writes the fields the library maintains in an allocator struct.
pub fn write_allocator(a: *mut BulkAllocator, pool: *mut BulkPool, num_free: usize, token: usize) {
    // SAFETY: `a` is a live, non-NULL allocator struct (checked by the
    // caller; interface contract).
    unsafe {
        ptr::write_unaligned(a, BulkAllocator { pool, num_free, impl_data: token as *mut c_void });
    }
}

/// Reads an endpoint descriptor's generic part.
pub fn read_endpoint(ep: *const BulkEndpointDescriptor) -> BulkEndpointDescriptor {
    // SAFETY: non-NULL (checked by the caller) and the first member of
    // every endpoint struct (interface contract).
    unsafe { ptr::read_unaligned(ep) }
}

/// A local endpoint's `other_channel` (the descriptor says it is local).
pub fn local_other_channel(ep: *const BulkEndpointDescriptor) -> *mut BulkChannel {
    // SAFETY: a descriptor of backend LOCAL is the `generic` member at
    // offset 0 of a `struct bulk_local_endpoint` (bulk_local_init_endpoint
    // made it so).
    unsafe { ptr::addr_of!((*(ep as *const BulkLocalEndpoint)).other_channel).read_unaligned() }
}

/// A shared-memory endpoint's path.
pub fn sm_path(ep: *const BulkEndpointDescriptor) -> Vec<u8> {
    // SAFETY: a descriptor of backend SM is the first member of a
    // `struct bulk_sm_endpoint_descriptor`, whose path the library wrote
    // NUL-terminated within its capacity.
    let path: [c_char; SM_PATH_CAP] =
        unsafe { ptr::addr_of!((*(ep as *const BulkSmEndpointDescriptor)).path).read_unaligned() };
    until_nul(&path)
}

/// A TCP endpoint's address text and port.
pub fn net_addr(ep: *const BulkEndpointDescriptor) -> (Vec<u8>, u16) {
    // SAFETY: a descriptor of backend NET is the first member of a
    // `struct bulk_net_endpoint_descriptor`, written by the library.
    unsafe {
        let net = ep as *const BulkNetEndpointDescriptor;
        let ip: [c_char; NET_IP_CAP] = ptr::addr_of!((*net).ip).read_unaligned();
        (until_nul(&ip), ptr::addr_of!((*net).port).read_unaligned())
    }
}

/// A TCP endpoint setup's address pointer and port.
pub fn net_setup(s: *const BulkNetEpSetup) -> (*const c_char, u16) {
    // SAFETY: non-NULL (checked by the caller), a `struct bulk_net_ep_setup`.
    unsafe { (ptr::addr_of!((*s).ip).read_unaligned(), ptr::addr_of!((*s).port).read_unaligned()) }
}

/// Records the port a TCP endpoint listens on.
pub fn set_net_port(ep: *mut BulkEndpointDescriptor, port: u16) {
    // SAFETY: as in `net_addr`; the program does not touch the descriptor
    // during the call.
    unsafe { ptr::addr_of_mut!((*(ep as *mut BulkNetEndpointDescriptor)).port).write_unaligned(port) }
}

/// Initializes a local endpoint struct.
pub fn init_local(ep: *mut BulkLocalEndpoint, generic: BulkEndpointDescriptor, other: *mut BulkChannel) {
    // SAFETY: non-NULL (checked by the caller), a caller-allocated
    // `struct bulk_local_endpoint`.
    unsafe { ptr::write_unaligned(ep, BulkLocalEndpoint { generic, other_channel: other }) }
}

/// Initializes a shared-memory endpoint struct.
pub fn init_sm(ep: *mut BulkSmEndpointDescriptor, generic: BulkEndpointDescriptor, path: &[u8]) {
    let mut p = [0 as c_char; SM_PATH_CAP];
    for (d, s) in p.iter_mut().zip(path) {
        *d = *s as c_char;
    }
    // SAFETY: non-NULL (checked by the caller), a caller-allocated
    // `struct bulk_sm_endpoint_descriptor`.
    unsafe { ptr::write_unaligned(ep, BulkSmEndpointDescriptor { ep_generic: generic, path: p }) }
}

/// Initializes a TCP endpoint struct.
pub fn init_net(ep: *mut BulkNetEndpointDescriptor, generic: BulkEndpointDescriptor, ip: &[u8], port: u16) {
    let mut t = [0 as c_char; NET_IP_CAP];
    for (d, s) in t.iter_mut().zip(ip) {
        *d = *s as c_char;
    }
    // SAFETY: non-NULL (checked by the caller), a caller-allocated
    // `struct bulk_net_endpoint_descriptor`.
    unsafe { ptr::write_unaligned(ep, BulkNetEndpointDescriptor { ep_generic: generic, ip: t, port }) }
}

/// Marks an endpoint descriptor unused.
pub fn clear_endpoint(ep: *mut BulkEndpointDescriptor) {
    // SAFETY: non-NULL (checked by the caller), an endpoint descriptor.
    unsafe { ptr::addr_of_mut!((*ep).magic).write_unaligned(0) }
}

/// Stores a pointer in the program's `*out`.
pub fn write_out<T>(out: *mut *mut T, value: *mut T) {
    // SAFETY: non-NULL (checked by the caller), a pointer-sized out
    // parameter (interface contract).
    unsafe { ptr::write_unaligned(out, value) }
}

/// A C string's bytes (without the NUL); `None` for NULL or longer than `max`.
pub fn c_string(s: *const c_char, max: usize) -> Option<Vec<u8>> {
    if s.is_null() {
        return None;
    }
    // SAFETY: a non-NULL string argument is NUL-terminated (interface
    // contract); we stop at the first NUL.
    let bytes = unsafe { CStr::from_ptr(s) }.to_bytes();
    (bytes.len() <= max).then(|| bytes.to_vec())
}

/// Runs `f` on `meta_size` bytes (at most [`MAX_META_SIZE`]) of the
/// program's meta data, zeros for NULL, read where they are: no copy.
pub fn with_meta<R>(meta: *const c_void, meta_size: usize, f: impl FnOnce(&[u8]) -> R) -> R {
    static ZEROS: [u8; MAX_META_SIZE] = [0; MAX_META_SIZE];
    let n = meta_size.min(MAX_META_SIZE);
    if meta.is_null() || n == 0 {
        return f(&ZEROS[..n]);
    }
    // SAFETY: non-NULL meta data points to the channel's meta_size bytes,
    // which the program does not change during the call (interface
    // contract); the slice covers at most that many and lives only for
    // `f`, within the call.
    f(unsafe { std::slice::from_raw_parts(meta as *const u8, n) })
}

/// The `move_received` (`passed` false) or `buffer_received` callback of
/// a callbacks struct (NULL struct: `None`), read alone.
pub fn buffer_callback(p: *const BulkChannelCallbacks, passed: bool) -> Option<Option<BufferCallback>> {
    if p.is_null() {
        return None;
    }
    // SAFETY: as in `read`: a non-NULL callbacks struct given with a
    // channel stays valid while it lives (interface contract); one
    // field is read.
    Some(unsafe {
        if passed {
            ptr::addr_of!((*p).buffer_received).read_unaligned()
        } else {
            ptr::addr_of!((*p).move_received).read_unaligned()
        }
    })
}

fn until_nul(chars: &[c_char]) -> Vec<u8> {
    chars.iter().take_while(|c| **c != 0).map(|c| *c as u8).collect()
}

/// The calls into the program's code. Each runs without any library
/// lock held, so the program may call the library from it.
pub mod call {
    use super::*;

    /// A continuation.
    pub fn cont(h: ContHandler, arg: usize, err: Errval, ch: usize) {
        // SAFETY: the program gave this handler with this argument for a
        // call on this channel (interface contract for continuations).
        unsafe { h(arg as *mut c_void, err, ch as *mut BulkChannel) }
    }

    /// `bind_received` (its return value is not used).
    pub fn channel_only_errval(f: unsafe extern "C" fn(*mut BulkChannel) -> Errval, ch: usize) {
        // SAFETY: a callback of the declared signature (interface contract).
        unsafe { f(ch as *mut BulkChannel) };
    }

    /// `teardown_received`.
    pub fn channel_only(f: unsafe extern "C" fn(*mut BulkChannel), ch: usize) {
        // SAFETY: as above.
        unsafe { f(ch as *mut BulkChannel) }
    }

    /// `pool_assigned` and `pool_removed`.
    pub fn pool(f: unsafe extern "C" fn(*mut BulkChannel, *mut BulkPool) -> Errval, ch: usize, pool: usize) -> Errval {
        // SAFETY: as above; `pool` is a library-owned pool struct.
        unsafe { f(ch as *mut BulkChannel, pool as *mut BulkPool) }
    }

    /// `move_received`, `buffer_received`, `copy_received`.
    pub fn buffer_meta(f: BufferCallback, ch: usize, buffer: usize, meta: &mut [u8]) {
        // SAFETY: as above; `buffer` is a library-owned buffer struct,
        // `meta` lives until the callback returns.
        unsafe { f(ch as *mut BulkChannel, buffer as *mut BulkBuffer, meta.as_mut_ptr() as *mut c_void) }
    }

    /// `copy_released`.
    pub fn buffer(f: unsafe extern "C" fn(*mut BulkChannel, *mut BulkBuffer), ch: usize, buffer: usize) {
        // SAFETY: as above.
        unsafe { f(ch as *mut BulkChannel, buffer as *mut BulkBuffer) }
    }

    /// Waits until `fd` is readable or `timeout` passed (`None`: no limit).
    pub fn poll_readable(fd: i32, timeout: Option<std::time::Duration>) {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: libc::c_long::from(t.subsec_nanos() as i32),
        });
        let tsp = ts.as_ref().map_or(ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: one valid pollfd and a valid (or NULL) timespec that live
        // across the call; an fd closed meanwhile gives POLLNVAL, not
        // undefined behaviour.
        unsafe { libc::ppoll(&mut p, 1, tsp, ptr::null()) };
    }
}
