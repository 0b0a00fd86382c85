//! The libfabric calls of the fabric backend, and the only unsafe code it
//! has. libfabric's calls are inline C functions, so they go through a small
//! C shim (`shim.c`, compiled by build.rs) that hands out opaque handles and
//! flat completions: no libfabric struct layout is repeated here. The shim
//! loads libfabric itself ([`load`]) before the first endpoint opens.
//!
//! The safe API above the calls keeps three promises: a handle is used by
//! one thread at a time (`&mut` or the owner's lock), memory stays mapped
//! for as long as it is registered (a [`Region`] owns its mapping), and the
//! endpoint is closed before anything it may still write into is unmapped
//! ([`Fabric::close_endpoint`], and the drop order of the registrations,
//! which keep the fabric alive).

use std::cell::UnsafeCell;
use std::ffi::{c_char, c_int, c_long, c_void, CStr, CString};
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::sys::Mapping;

#[repr(C)]
struct RawFabric {
    _opaque: [u8; 0],
}

#[repr(C)]
struct RawMr {
    _opaque: [u8; 0],
}

/// One completion as the shim flattens it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Completion {
    /// The context the operation was posted with (an address, see
    /// [`Contexts`]); the peer's writes have none.
    pub(super) ctx: usize,
    /// FI_* flags of the completion.
    pub(super) flags: u64,
    /// Bytes received (receives).
    pub(super) len: u64,
    /// Remote completion data (the peer's writes).
    pub(super) data: u64,
    /// 0, or the libfabric error of a failed operation.
    pub(super) err: i32,
    /// The provider's own code of that error.
    pub(super) prov_errno: i32,
}

extern "C" {
    fn ferry_fi_load(err: *mut c_char, errlen: usize) -> c_int;
    fn ferry_fi_open(
        provider: *const c_char,
        node: *const c_char,
        cq_size: usize,
        out: *mut *mut RawFabric,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn ferry_fi_close(h: *mut RawFabric);
    fn ferry_fi_close_ep(h: *mut RawFabric);
    fn ferry_fi_provider(h: *const RawFabric) -> *const c_char;
    fn ferry_fi_wait_fd(h: *const RawFabric) -> c_int;
    fn ferry_fi_virt_addr(h: *const RawFabric) -> c_int;
    fn ferry_fi_getname(h: *mut RawFabric, buf: *mut c_void, len: *mut usize) -> c_int;
    fn ferry_fi_set_peer(h: *mut RawFabric, addr: *const c_void) -> c_int;
    fn ferry_fi_mr_reg(
        h: *mut RawFabric,
        buf: *mut c_void,
        len: usize,
        remote_write: c_int,
        requested_key: u64,
        mr: *mut *mut RawMr,
        key: *mut u64,
        desc: *mut *mut c_void,
    ) -> c_int;
    fn ferry_fi_mr_close(mr: *mut RawMr) -> c_int;
    fn ferry_fi_recv(h: *mut RawFabric, buf: *mut c_void, len: usize, desc: *mut c_void, ctx: *mut c_void) -> c_long;
    fn ferry_fi_send(h: *mut RawFabric, buf: *const c_void, len: usize, desc: *mut c_void, ctx: *mut c_void) -> c_long;
    fn ferry_fi_writedata(
        h: *mut RawFabric,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        data: u64,
        raddr: u64,
        key: u64,
        ctx: *mut c_void,
    ) -> c_long;
    fn ferry_fi_cq_read(h: *mut RawFabric, out: *mut Completion, n: usize) -> c_long;
    fn ferry_fi_trywait(h: *mut RawFabric) -> c_int;
    fn ferry_fi_strerror(err: c_int) -> *const c_char;
    fn ferry_fi_is_remote_write(flags: u64) -> c_int;
}

/// Load libfabric if it is not loaded yet (once per process; the shim's
/// calls need it). The error is the loader's words.
pub(super) fn load() -> Result<(), String> {
    let mut err = [0 as c_char; 512];
    // SAFETY: err has the room we say it has; the shim serialises loads.
    let rc = unsafe { ferry_fi_load(err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        // SAFETY: the shim wrote a NUL-terminated message into err.
        return Err(unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned());
    }
    Ok(())
}

/// libfabric's `FI_EAGAIN`: the operation cannot be posted now.
pub(super) const EAGAIN: i32 = 11;

/// The words of libfabric error `err` (positive or negative).
pub(super) fn strerror(err: i32) -> String {
    // SAFETY: fi_strerror returns a pointer to a static NUL-terminated
    // string for any code.
    unsafe { CStr::from_ptr(ferry_fi_strerror(err)) }.to_string_lossy().into_owned()
}

/// Whether a completion is the peer's write into our memory: it carries
/// remote completion data (the backend sends no message with data).
pub(super) fn is_remote_write(flags: u64) -> bool {
    // SAFETY: a pure function of its argument.
    unsafe { ferry_fi_is_remote_write(flags) != 0 }
}

struct Handle {
    raw: NonNull<RawFabric>,
    /// The endpoint is closed (nothing more is posted).
    ep_closed: bool,
}

// SAFETY: the handle is used under the mutex only (FI_THREAD_DOMAIN: one
// thread at a time per domain); libfabric objects are not tied to the
// thread that opened them.
unsafe impl Send for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: raw came from ferry_fi_open and is closed once, here;
        // every registration holds the Arc that owns this handle, so none
        // is left.
        unsafe { ferry_fi_close(self.raw.as_ptr()) }
    }
}

/// An open RDM endpoint with its domain, completion queue and address
/// vector (one peer). Clones share it.
#[derive(Clone)]
pub(super) struct Fabric {
    handle: Arc<Mutex<Handle>>,
    provider: String,
    wait_fd: RawFd,
    virt_addr: bool,
}

impl Fabric {
    /// Open an endpoint on `provider` (or the first that fits) with source
    /// address `node` (or any) and a completion queue of `cq_size` entries.
    /// The error says which step failed and why.
    pub(super) fn open(provider: Option<&str>, node: Option<&str>, cq_size: usize) -> Result<Fabric, String> {
        let provider_c = provider.map(CString::new).transpose().map_err(|_| "a provider name with a NUL byte")?;
        let node_c = node.map(CString::new).transpose().map_err(|_| "a node name with a NUL byte")?;
        let mut raw = std::ptr::null_mut();
        let mut err = [0 as c_char; 256];
        // SAFETY: the strings are NUL-terminated and live across the call;
        // err has the room we say it has.
        let rc = unsafe {
            ferry_fi_open(
                provider_c.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
                node_c.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
                cq_size,
                &mut raw,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if rc != 0 {
            // SAFETY: the shim wrote a NUL-terminated message into err
            // (snprintf), and err ends in a zero in any case.
            let what = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
            return Err(what);
        }
        let raw = NonNull::new(raw).ok_or("fi_getinfo gave no endpoint")?;
        // SAFETY: raw is a live handle; the provider name is NUL-terminated
        // and lives as long as the handle (we copy it).
        let (provider, wait_fd, virt_addr) = unsafe {
            (
                CStr::from_ptr(ferry_fi_provider(raw.as_ptr())).to_string_lossy().into_owned(),
                ferry_fi_wait_fd(raw.as_ptr()),
                ferry_fi_virt_addr(raw.as_ptr()) != 0,
            )
        };
        let handle = Arc::new(Mutex::new(Handle { raw, ep_closed: false }));
        Ok(Fabric { handle, provider, wait_fd, virt_addr })
    }

    fn with<R>(&self, f: impl FnOnce(&mut Handle) -> R) -> R {
        let mut h = self.handle.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut h)
    }

    /// The provider's name (e.g. `tcp;ofi_rxm`).
    pub(super) fn provider(&self) -> &str {
        &self.provider
    }

    /// The completion queue's file descriptor: readable when a completion
    /// may be there (after [`trywait`](Fabric::trywait) said so).
    pub(super) fn wait_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd belongs to the completion queue, which lives as
        // long as self (the handle is closed only when the last Arc goes).
        unsafe { BorrowedFd::borrow_raw(self.wait_fd) }
    }

    /// Whether the peer names a place in our memory by its virtual address
    /// (otherwise: by its offset in the registration).
    pub(super) fn virt_addr(&self) -> bool {
        self.virt_addr
    }

    /// This endpoint's fabric address.
    pub(super) fn name(&self) -> Result<Vec<u8>, i32> {
        self.with(|h| {
            let mut buf = vec![0u8; 512];
            let mut len = buf.len();
            // SAFETY: buf has len bytes of room; the handle is live.
            let rc = unsafe { ferry_fi_getname(h.raw.as_ptr(), buf.as_mut_ptr().cast(), &mut len) };
            if rc != 0 {
                return Err(rc);
            }
            buf.truncate(len);
            Ok(buf)
        })
    }

    /// The peer's fabric address. It must be as long as ours (the same
    /// provider's address format): the provider reads that many bytes.
    pub(super) fn set_peer(&self, addr: &[u8]) -> Result<(), String> {
        let ours = self.name().map_err(strerror)?;
        if addr.len() != ours.len() {
            return Err(format!("a fabric address of {} bytes where {} has {}", addr.len(), self.provider, ours.len()));
        }
        // SAFETY: addr holds a full address of the provider's format (its
        // length checked above); the handle is live.
        let rc = self.with(|h| unsafe { ferry_fi_set_peer(h.raw.as_ptr(), addr.as_ptr().cast()) });
        if rc != 0 {
            return Err(strerror(rc));
        }
        Ok(())
    }

    /// Register `map` for sends and receives, and if `remote_write`, for
    /// writes from it and the peer's writes into it. `requested_key` is the
    /// key unless the provider picks its own (unique among this end's
    /// registrations).
    pub(super) fn register(&self, map: Arc<Mapping>, requested_key: u64, remote_write: bool) -> Result<Region, i32> {
        let mut mr = std::ptr::null_mut();
        let mut key = 0;
        let mut desc = std::ptr::null_mut();
        // SAFETY: the mapping is len bytes of read-write memory that stays
        // mapped as long as the Region (which owns an Arc of it) lives,
        // and the Region closes the registration before it lets go.
        let rc = self.with(|h| unsafe {
            ferry_fi_mr_reg(
                h.raw.as_ptr(),
                map.as_ptr().cast(),
                map.len(),
                c_int::from(remote_write),
                requested_key,
                &mut mr,
                &mut key,
                &mut desc,
            )
        });
        if rc != 0 {
            return Err(rc);
        }
        let mr = NonNull::new(mr).ok_or(-EAGAIN)?;
        Ok(Region { handle: self.handle.clone(), mr, key, desc: desc as usize, map })
    }

    /// Post a receive into `len` bytes at `offset` of `region`.
    pub(super) fn recv(
        &self,
        region: &Region,
        offset: usize,
        len: usize,
        ctx: &Contexts,
        slot: usize,
    ) -> Result<(), i32> {
        region.check(offset, len);
        // SAFETY: the range lies inside the registered mapping (checked);
        // ctx.at(slot) is a live context of the size FI_CONTEXT2 asks for,
        // owned by the link for as long as the endpoint is open.
        self.post(|h| unsafe {
            ferry_fi_recv(h, region.map.as_ptr().add(offset).cast(), len, region.desc as *mut c_void, ctx.at(slot))
        })
    }

    /// Send `len` bytes at `offset` of `region` to the peer.
    pub(super) fn send(
        &self,
        region: &Region,
        offset: usize,
        len: usize,
        ctx: &Contexts,
        slot: usize,
    ) -> Result<(), i32> {
        region.check(offset, len);
        // SAFETY: as in recv.
        self.post(|h| unsafe {
            ferry_fi_send(h, region.map.as_ptr().add(offset).cast(), len, region.desc as *mut c_void, ctx.at(slot))
        })
    }

    /// Write `len` bytes at `offset` of `region` into the peer's memory at
    /// `raddr` (registered with `key`), with `data` as the completion data
    /// the peer's queue reports once the bytes are there. A bad remote
    /// address or key fails the write (a completion with an error), never
    /// our memory.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write(
        &self,
        region: &Region,
        offset: usize,
        len: usize,
        raddr: u64,
        key: u64,
        data: u64,
        ctx: &Contexts,
        slot: usize,
    ) -> Result<(), i32> {
        region.check(offset, len);
        // SAFETY: as in recv; the remote side is checked by the peer's
        // provider.
        self.post(|h| unsafe {
            ferry_fi_writedata(
                h,
                region.map.as_ptr().add(offset).cast(),
                len,
                region.desc as *mut c_void,
                data,
                raddr,
                key,
                ctx.at(slot),
            )
        })
    }

    fn post(&self, f: impl FnOnce(*mut RawFabric) -> c_long) -> Result<(), i32> {
        self.with(|h| {
            if h.ep_closed {
                return Err(-EAGAIN);
            }
            match f(h.raw.as_ptr()) {
                0 => Ok(()),
                rc => Err(rc as i32),
            }
        })
    }

    /// Completions into `out` (failed operations too): how many.
    pub(super) fn poll(&self, out: &mut [Completion; 16]) -> Result<usize, i32> {
        self.with(|h| {
            if h.ep_closed {
                return Ok(0);
            }
            // SAFETY: out has room for 16 completions; the handle is live.
            let n = unsafe { ferry_fi_cq_read(h.raw.as_ptr(), out.as_mut_ptr(), out.len()) };
            usize::try_from(n).map_err(|_| n as i32)
        })
    }

    /// Whether the wait fd may be slept on now (`false`: poll first).
    pub(super) fn trywait(&self) -> bool {
        // SAFETY: the handle is live.
        self.with(|h| h.ep_closed || unsafe { ferry_fi_trywait(h.raw.as_ptr()) } == 0)
    }

    /// Close the endpoint: nothing more is received into our memory or
    /// sent from it, so registrations and mappings may go.
    pub(super) fn close_endpoint(&self) {
        self.with(|h| {
            if !h.ep_closed {
                // SAFETY: the handle is live; the endpoint is closed once.
                unsafe { ferry_fi_close_ep(h.raw.as_ptr()) };
                h.ep_closed = true;
            }
        })
    }
}

/// Memory registered with the fabric: the mapping stays until the
/// registration is closed.
pub(super) struct Region {
    handle: Arc<Mutex<Handle>>,
    mr: NonNull<RawMr>,
    key: u64,
    desc: usize,
    map: Arc<Mapping>,
}

// SAFETY: the registration is closed under the fabric's lock; the rest is
// plain data and a Send + Sync mapping.
unsafe impl Send for Region {}
// SAFETY: shared, a region only gives out its key, its mapping (Sync) and
// its descriptor, which the provider reads under the fabric's lock.
unsafe impl Sync for Region {}

impl Region {
    /// The key the peer writes with.
    pub(super) fn key(&self) -> u64 {
        self.key
    }

    /// The registered mapping.
    pub(super) fn map(&self) -> &Mapping {
        &self.map
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(offset.checked_add(len).is_some_and(|end| end <= self.map.len()), "range inside the region");
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let _h = self.handle.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: mr came from ferry_fi_mr_reg and is closed once, here,
        // before the mapping (a field dropped after this) is unmapped.
        unsafe { ferry_fi_mr_close(self.mr.as_ptr()) };
    }
}

/// Operation contexts: one `struct fi_context2` (8 pointers) of scratch
/// space per slot, which providers that ask for FI_CONTEXT2 use while the
/// operation runs; a completion names its slot by the context's address.
pub(super) struct Contexts {
    /// Cells: the provider writes into them behind our back.
    space: Box<[UnsafeCell<[u64; 8]>]>,
}

// SAFETY: we never read or write the cells ourselves: we only hand their
// addresses to the provider, whose use of them the fabric's lock orders.
unsafe impl Sync for Contexts {}

impl Contexts {
    /// `n` contexts.
    pub(super) fn new(n: usize) -> Contexts {
        Contexts { space: (0..n).map(|_| UnsafeCell::new([0u64; 8])).collect() }
    }

    fn at(&self, slot: usize) -> *mut c_void {
        self.space[slot].get().cast()
    }

    /// The slot a completion's context names, if it is one of ours.
    pub(super) fn slot_of(&self, ctx: usize) -> Option<usize> {
        let base = self.space.as_ptr() as usize;
        let size = std::mem::size_of::<[u64; 8]>();
        let off = ctx.checked_sub(base)?;
        (off % size == 0 && off / size < self.space.len()).then_some(off / size)
    }
}
