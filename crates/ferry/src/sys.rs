//! Safe wrappers over the few syscalls Ferry's pools need: `memfd_create`,
//! shared mappings of a memfd, `mprotect` of a range of such a mapping, and
//! random pool ids. All `unsafe` of the pool layer lives in this module.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};

/// The system page size.
pub(crate) fn page_size() -> usize {
    rustix::param::page_size()
}

/// 128 random bits from the kernel: pool ids are unique across processes
/// and machines by construction (the chance of a collision among 2^32 pools
/// is about 2^-64).
pub(crate) fn random_u128() -> u128 {
    let mut bytes = [0u8; 16];
    let mut filled = 0;
    while filled < bytes.len() {
        match rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => continue,
            // getrandom(2) cannot fail on Linux ≥ 3.17 once the pool is seeded; if
            // it ever does, a time-and-address mix is still unique in practice.
            Err(_) => {
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0);
                let addr = &bytes as *const _ as usize as u128;
                return t ^ (addr << 64) ^ u128::from(std::process::id());
            }
        }
    }
    u128::from_le_bytes(bytes)
}

/// Create an anonymous memory file of `len` bytes that can be sealed.
pub(crate) fn memfd(name: &str, len: usize) -> io::Result<OwnedFd> {
    use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
    let fd = memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    ftruncate(&fd, len as u64)?;
    Ok(fd)
}

/// Seal a memfd's size (no shrink, no grow).
pub(crate) fn seal_size(fd: &OwnedFd) -> io::Result<()> {
    use rustix::fs::SealFlags;
    rustix::fs::fcntl_add_seals(fd, SealFlags::SHRINK | SealFlags::GROW)?;
    Ok(())
}

/// Check that `fd` is a memfd of `len` bytes whose size is sealed: only
/// then can a mapping of it never fault beyond the end of the file.
pub(crate) fn check_sealed_size(fd: &OwnedFd, len: usize) -> Result<(), &'static str> {
    use rustix::fs::SealFlags;
    let seals = rustix::fs::fcntl_get_seals(fd).map_err(|_| "not a sealable memfd")?;
    if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
        return Err("size not sealed");
    }
    let st = rustix::fs::fstat(fd).map_err(|_| "fstat failed")?;
    if u64::try_from(st.st_size).ok() != Some(len as u64) {
        return Err("size differs from the announced geometry");
    }
    Ok(())
}

/// Whether two fds name the same file (the same memory, for memfds).
pub(crate) fn same_file(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> bool {
    match (rustix::fs::fstat(a), rustix::fs::fstat(b)) {
        (Ok(x), Ok(y)) => x.st_dev == y.st_dev && x.st_ino == y.st_ino,
        _ => false,
    }
}

/// Copy buffer `index` (of `size` bytes) from one mapping of a pool to
/// another mapping of the same geometry: how bytes cross between two
/// memories of one pool that the ends of a channel do not share. `Err` if
/// the range is not inside both mappings.
///
/// The caller guarantees that no handle of this process reads or writes
/// the buffer in `to` meanwhile (the buffer-state layer: whoever gives the
/// buffer away or receives it is the only one who may touch it now). `from`
/// may be written concurrently by another process (a peer we do not
/// trust): the bytes are copied as they are, never interpreted.
pub(crate) fn copy_buffer(from: &Mapping, to: &Mapping, index: u32, size: usize) -> io::Result<()> {
    let offset = (index as usize).checked_mul(size).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let end = offset.checked_add(size).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    if end > from.len() || end > to.len() {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: [offset, end) lies inside both mappings (checked above), and
    // two distinct mappings never overlap in our address space (a mapping
    // of the same file at another address is another range). Raw pointer
    // copies create no Rust references, so concurrent writes by another
    // process to `from` cannot invalidate one; any byte is a valid `u8`.
    // The destination range is not in use by this process (caller's
    // guarantee above).
    unsafe { std::ptr::copy_nonoverlapping(from.as_ptr().add(offset), to.as_ptr().add(offset), size) };
    Ok(())
}

/// Seal a memfd against every new way of writing it — writable mappings,
/// `write`, hole punching — whoever holds an fd of it, root included
/// (`F_SEAL_FUTURE_WRITE`), and against further seals. Mappings that are
/// writable already stay so: the owner keeps one and duplicates it
/// ([`Mapping::duplicate`]) for every writable view it makes later.
pub(crate) fn seal_future_writes(fd: &OwnedFd) -> io::Result<()> {
    use rustix::fs::SealFlags;
    rustix::fs::fcntl_add_seals(fd, SealFlags::FUTURE_WRITE | SealFlags::SEAL)?;
    Ok(())
}

/// A read-only fd of the same file, for a peer that may only read it
/// (reopened through `/proc/self/fd`). A read-only fd alone does not stop
/// its holder from reopening it read-write the same way: the file must also
/// be sealed with [`seal_future_writes`].
pub(crate) fn reopen_read_only(fd: &OwnedFd) -> io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    use std::os::fd::AsRawFd;
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    Ok(rustix::fs::open(path.as_str(), OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?)
}

/// A `MAP_SHARED` mapping of `len` bytes of `fd`, read-write; for segments
/// shared with a peer.
pub(crate) fn map_segment(fd: &OwnedFd, len: usize) -> io::Result<Mapping> {
    Mapping::map_shared(fd.as_fd(), len, Access::ReadWrite, 1)
}

/// Access a range of a mapping may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// No access: touching the range faults.
    None,
    /// Read only.
    Read,
    /// Read and write.
    ReadWrite,
}

impl Access {
    fn prot(self) -> MprotectFlags {
        match self {
            Access::None => MprotectFlags::empty(),
            Access::Read => MprotectFlags::READ,
            Access::ReadWrite => MprotectFlags::READ | MprotectFlags::WRITE,
        }
    }
}

/// A `MAP_SHARED` mapping of a file, unmapped on drop.
///
/// The mapping is plain memory shared with other views of the same file;
/// which part anyone may touch is decided by the layers above (buffer states),
/// so this type hands out raw pointers, never references.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `Mapping` is an address range owned by this value; the raw
// pointer is never dereferenced here, and unmapping happens once, in drop.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only exposes the address and `mprotect`,
// which the kernel serialises.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map `len` bytes of `fd` from offset 0, shared, with the base address
    /// aligned to `align` (a power of two; at most the page size means no
    /// extra alignment).
    pub(crate) fn map_shared(fd: BorrowedFd<'_>, len: usize, access: Access, align: usize) -> io::Result<Self> {
        if len == 0 || !align.is_power_of_two() {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let prot = match access {
            Access::None => ProtFlags::empty(),
            Access::Read => ProtFlags::READ,
            Access::ReadWrite => ProtFlags::READ | ProtFlags::WRITE,
        };
        let ptr = place(len, align, |at| {
            let (addr, flags) = match at {
                Some(a) => (a, MapFlags::SHARED | MapFlags::FIXED),
                None => (std::ptr::null_mut(), MapFlags::SHARED),
            };
            // SAFETY: either a kernel-chosen address, or (MAP_FIXED) a range
            // inside a reservation `place` owns and nothing else uses: no
            // existing Rust object is replaced.
            unsafe { rustix::mm::mmap(addr, len, prot, flags, fd, 0) }
        })?;
        Ok(Mapping { ptr, len })
    }

    /// A second mapping of the same pages (`mremap` with old size 0), with
    /// `access` and the base aligned to `align`. Works after the file was
    /// sealed against new writable mappings (`seal_future_writes`): the
    /// duplicate inherits this mapping's right to write. `self` must be one
    /// whole mapping never split by `protect`.
    pub(crate) fn duplicate(&self, access: Access, align: usize) -> io::Result<Self> {
        use rustix::mm::MremapFlags;
        if !align.is_power_of_two() {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let (src, len) = (self.ptr.as_ptr().cast(), self.len);
        let ptr = place(len, align, |at| match at {
            // SAFETY: old size 0 leaves `self` in place and only creates a
            // new mapping: at a kernel-chosen address, or over a range inside
            // the reservation `place` owns (MREMAP_FIXED).
            Some(a) => unsafe { rustix::mm::mremap_fixed(src, 0, len, MremapFlags::MAYMOVE, a) },
            None => unsafe { rustix::mm::mremap(src, 0, len, MremapFlags::MAYMOVE) },
        })?;
        let dup = Mapping { ptr, len };
        if access != Access::ReadWrite {
            dup.protect(0, len, access)?;
        }
        Ok(dup)
    }

    /// Base address of the mapping.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Change the protection of `[offset, offset + len)`, which must be page
    /// aligned and inside the mapping.
    pub(crate) fn protect(&self, offset: usize, len: usize, access: Access) -> io::Result<()> {
        let page = page_size();
        if offset % page != 0 || len % page != 0 || offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        // SAFETY: the range lies inside our own mapping (checked above).
        // Removing access can make later accesses fault, which is the point:
        // the buffer-state layer guarantees no Rust reference into a range is
        // alive when its access is reduced (handles are consumed first).
        unsafe { rustix::mm::mprotect(self.ptr.as_ptr().add(offset).cast(), len, access.prot())? };
        Ok(())
    }
}

/// Put a new mapping of `len` bytes at a base aligned to `align`. `map`
/// makes it: at a kernel-chosen address (`None`) when the page alignment is
/// enough, else at the given address (`Some`), the first aligned one inside a
/// `len + align` reservation of inaccessible address space whose slack is
/// given back afterwards.
fn place(
    len: usize,
    align: usize,
    map: impl FnOnce(Option<*mut std::ffi::c_void>) -> rustix::io::Result<*mut std::ffi::c_void>,
) -> io::Result<NonNull<u8>> {
    if align <= page_size() {
        let ptr = map(None)?;
        return NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::from(io::ErrorKind::Other));
    }
    let reserve = len.checked_add(align).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: an anonymous PROT_NONE reservation at a kernel-chosen address.
    let base = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            reserve,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::NORESERVE,
        )?
    } as usize;
    let aligned = (base + align - 1) & !(align - 1);
    let mapped = map(Some(aligned as *mut _));
    let head = aligned - base;
    let tail = reserve - head - len;
    // SAFETY: the slack ranges are parts of our reservation that nothing
    // else uses; unmapping them cannot affect other objects.
    unsafe {
        if head > 0 {
            let _ = rustix::mm::munmap(base as *mut _, head);
        }
        if tail > 0 {
            let _ = rustix::mm::munmap((aligned + len) as *mut _, tail);
        }
    }
    let ptr = match mapped {
        Ok(p) => p,
        Err(e) => {
            // SAFETY: the aligned part of the reservation is still ours.
            unsafe {
                let _ = rustix::mm::munmap(aligned as *mut _, len);
            }
            return Err(e.into());
        }
    };
    NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::from(io::ErrorKind::Other))
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we own the mapping; every handle that could point into it
        // holds an `Arc` of the view that owns this `Mapping`, so none is left.
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// A range of memory that a vectored socket receive may write: part of a
/// pool mapping (a buffer's payload lands straight in it) or an ordinary
/// slice (frame headers). Borrowing the mapping keeps it mapped.
pub(crate) struct RecvPart<'a> {
    ptr: *mut u8,
    len: usize,
    _life: std::marker::PhantomData<&'a mut [u8]>,
}

/// A range of memory that a vectored socket send reads.
pub(crate) struct SendPart<'a> {
    ptr: *const u8,
    len: usize,
    _life: std::marker::PhantomData<&'a [u8]>,
}

impl<'a> RecvPart<'a> {
    pub(crate) fn slice(s: &'a mut [u8]) -> Self {
        RecvPart { ptr: s.as_mut_ptr(), len: s.len(), _life: std::marker::PhantomData }
    }

    /// `[offset, offset + len)` of `map`, if inside it.
    pub(crate) fn mapping(map: &'a Mapping, offset: usize, len: usize) -> Option<Self> {
        let end = offset.checked_add(len)?;
        (end <= map.len).then(|| RecvPart {
            // In bounds (checked above), so the offset stays inside the mapping.
            ptr: map.ptr.as_ptr().wrapping_add(offset),
            len,
            _life: std::marker::PhantomData,
        })
    }

    /// The range as a slice, for a user-space writer (TLS decrypting into
    /// a buffer) instead of the kernel.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `recv_parts`: a live, writable range for `'a` (a
        // slice borrowed mutably, or a checked range of a borrowed
        // mapping); `&mut self` keeps this the only slice made from it
        // while it lives. No domain of this process owns or reads a buffer
        // while its payload lands (the channel's payload gate).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<'a> SendPart<'a> {
    /// The range as a slice, for a user-space reader (TLS encrypting from
    /// a buffer) instead of the kernel.
    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: as in `send_parts`: a live, readable range for `'a`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub(crate) fn slice(s: &'a [u8]) -> Self {
        SendPart { ptr: s.as_ptr(), len: s.len(), _life: std::marker::PhantomData }
    }

    /// `[offset, offset + len)` of `map`, if inside it.
    pub(crate) fn mapping(map: &'a Mapping, offset: usize, len: usize) -> Option<Self> {
        let end = offset.checked_add(len)?;
        (end <= map.len).then(|| SendPart {
            ptr: map.ptr.as_ptr().wrapping_add(offset).cast_const(),
            len,
            _life: std::marker::PhantomData,
        })
    }
}

/// Receive into `parts` in order, without blocking (`WouldBlock` when
/// nothing is there; `Ok(0)` at end of stream).
pub(crate) fn recv_parts(fd: BorrowedFd<'_>, parts: &[RecvPart<'_>]) -> io::Result<usize> {
    use rustix::net::{RecvAncillaryBuffer, RecvFlags};
    let slice = |p: &RecvPart<'_>| {
        // SAFETY: each part is a live, writable range for its lifetime
        // (a slice we borrow mutably, or a checked range of a mapping we
        // borrow). The slice exists only for this call and only the
        // kernel writes through it. Pool memory is shared with other
        // views; the buffer-state layer guarantees that no domain of
        // this process owns or reads a buffer while its payload lands
        // (the channel's payload gate).
        io::IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(p.ptr, p.len) })
    };
    let mut control = RecvAncillaryBuffer::default();
    // A few parts (the usual case: meta, payload, the next header) need
    // no allocation.
    let r = if parts.len() <= 4 {
        let mut slices: [io::IoSliceMut<'_>; 4] = std::array::from_fn(|_| io::IoSliceMut::new(&mut []));
        for (s, p) in slices.iter_mut().zip(parts) {
            *s = slice(p);
        }
        rustix::net::recvmsg(fd, &mut slices[..parts.len()], &mut control, RecvFlags::DONTWAIT)?
    } else {
        let mut slices: Vec<io::IoSliceMut<'_>> = parts.iter().map(slice).collect();
        rustix::net::recvmsg(fd, &mut slices, &mut control, RecvFlags::DONTWAIT)?
    };
    Ok(r.bytes)
}

/// Copy what the socket `fd` holds into `buf` without taking it off the
/// socket, without blocking.
pub(crate) fn peek(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    use rustix::net::RecvFlags;
    Ok(rustix::net::recv(fd, buf, RecvFlags::PEEK | RecvFlags::DONTWAIT)?.0)
}

/// Send from `parts` in order, without blocking and without `SIGPIPE`.
pub(crate) fn send_parts(fd: BorrowedFd<'_>, parts: &[SendPart<'_>]) -> io::Result<usize> {
    use rustix::net::{SendAncillaryBuffer, SendFlags};
    let slices: Vec<io::IoSlice<'_>> = parts
        .iter()
        // SAFETY: each part is a live, readable range for its lifetime; the
        // kernel only reads it during this call.
        .map(|p| io::IoSlice::new(unsafe { std::slice::from_raw_parts(p.ptr, p.len) }))
        .collect();
    let mut control = SendAncillaryBuffer::default();
    Ok(rustix::net::sendmsg(fd, &slices, &mut control, SendFlags::DONTWAIT | SendFlags::NOSIGNAL)?)
}

/// Ask the kernel to report the socket writable (and to take more bytes)
/// only while fewer than `bytes` of what was written are unsent.
pub(crate) fn set_unsent_low_water(stream: &std::net::TcpStream, bytes: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: the descriptor is the live socket `stream` owns; the option
    // value is a c_int on our stack whose size we pass.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_NOTSENT_LOWAT,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Bytes written to the socket that the kernel has not sent yet
/// (`SIOCOUTQNSD`).
#[cfg(test)]
pub(crate) fn unsent_bytes(stream: &std::net::TcpStream) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    const SIOCOUTQNSD: libc::c_ulong = 0x894B;
    let mut value: libc::c_int = 0;
    // SAFETY: the descriptor is the live socket `stream` owns; the ioctl
    // writes one c_int into `value`.
    let rc = unsafe { libc::ioctl(stream.as_raw_fd(), SIOCOUTQNSD as _, &mut value) };
    if rc == 0 {
        Ok(value.max(0) as usize)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// What kind of file `fd` is, as `/proc/self/fd` shows it: a path for a
/// file, `anon_inode:[eventfd]` for an eventfd, `pipe:[…]`, `socket:[…]`.
pub(crate) fn fd_kind(fd: BorrowedFd<'_>) -> io::Result<std::path::PathBuf> {
    use std::os::fd::AsRawFd;
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Borrow an fd (re-exported helper so callers need not import `AsFd`).
pub(crate) fn borrow(fd: &OwnedFd) -> BorrowedFd<'_> {
    fd.as_fd()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_mapping_is_shared_between_views() {
        let fd = memfd("t", 8192).unwrap();
        let a = Mapping::map_shared(borrow(&fd), 8192, Access::ReadWrite, 1).unwrap();
        let b = Mapping::map_shared(borrow(&fd), 8192, Access::ReadWrite, 1).unwrap();
        assert_ne!(a.as_ptr(), b.as_ptr());
        // SAFETY: test-only raw access inside both mappings.
        unsafe {
            a.as_ptr().add(4100).write(42);
            assert_eq!(b.as_ptr().add(4100).read(), 42);
        }
    }

    #[test]
    fn aligned_mapping_honours_alignment() {
        let fd = memfd("t", 1 << 16).unwrap();
        let m = Mapping::map_shared(borrow(&fd), 1 << 16, Access::ReadWrite, 1 << 21).unwrap();
        assert_eq!(m.as_ptr() as usize % (1 << 21), 0);
    }

    #[test]
    fn protect_checks_range() {
        let fd = memfd("t", 8192).unwrap();
        let m = Mapping::map_shared(borrow(&fd), 8192, Access::ReadWrite, 1).unwrap();
        assert!(m.protect(1, 4096, Access::Read).is_err());
        assert!(m.protect(4096, 8192, Access::Read).is_err());
        m.protect(4096, 4096, Access::Read).unwrap();
        m.protect(4096, 4096, Access::ReadWrite).unwrap();
    }

    /// The kernel facts trust NONE rests on: after `seal_future_writes`
    /// nobody can make the memory writable again — not through a read-only
    /// fd, not through a read-write reopening of it, not by `mprotect` of a
    /// read-only mapping — while the owner's duplicates of its writable
    /// mapping still write, at any alignment.
    #[test]
    fn future_write_seal_leaves_only_the_owners_mappings_writable() {
        use rustix::fs::{Mode, OFlags};
        use std::os::fd::AsRawFd;
        let fd = memfd("t", 8192).unwrap();
        seal_size(&fd).unwrap();
        let owner = Mapping::map_shared(borrow(&fd), 8192, Access::ReadWrite, 1).unwrap();
        seal_future_writes(&fd).unwrap();
        let ro = reopen_read_only(&fd).unwrap();
        assert!(Mapping::map_shared(borrow(&ro), 8192, Access::ReadWrite, 1).is_err());
        let reader = Mapping::map_shared(borrow(&ro), 8192, Access::Read, 1).unwrap();
        assert!(reader.protect(0, 4096, Access::ReadWrite).is_err());
        let path = format!("/proc/self/fd/{}", ro.as_raw_fd());
        let rw = rustix::fs::open(path.as_str(), OFlags::RDWR, Mode::empty()).unwrap();
        assert!(Mapping::map_shared(borrow(&rw), 8192, Access::ReadWrite, 1).is_err());
        assert!(rustix::io::pwrite(&rw, b"x", 0).is_err());
        assert!(Mapping::map_shared(borrow(&fd), 8192, Access::ReadWrite, 1).is_err());
        let dup = owner.duplicate(Access::None, 1).unwrap();
        dup.protect(0, 8192, Access::ReadWrite).unwrap();
        let aligned = owner.duplicate(Access::ReadWrite, 1 << 21).unwrap();
        assert_eq!(aligned.as_ptr() as usize % (1 << 21), 0);
        // SAFETY: test-only raw access inside the mappings.
        unsafe {
            dup.as_ptr().add(10).write(7);
            aligned.as_ptr().add(11).write(8);
            assert_eq!(reader.as_ptr().add(10).read(), 7);
            assert_eq!(reader.as_ptr().add(11).read(), 8);
        }
    }

    #[test]
    fn random_ids_differ() {
        assert_ne!(random_u128(), random_u128());
    }
}
