//! Block stores: where the blocks of the block service live.
//!
//! A [`Store`] is a range of bytes of fixed size that can be read, written,
//! flushed to stable storage, trimmed and asked which parts are allocated.
//! Every operation takes `&self`: one store is shared by all connections
//! (and all threads) of a server, which is what lets the server offer
//! several connections to one export (NBD multi-conn).
//!
//! Two stores exist: [`MemStore`] (`mem:SIZE`, sparse memory) and
//! [`FileStore`] (`file:PATH`, a regular file or block device read and
//! written with `pread`/`pwrite` straight from and into the caller's
//! memory, which for the server is pool buffer memory).

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::hash::{BuildHasherDefault, Hasher};
use std::io::{self, IoSlice, IoSliceMut};
use std::num::NonZeroU64;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use rustix::fs::{FallocateFlags, OFlags, SeekFrom};

use crate::Error;

/// A run of bytes with one allocation status (the answer of
/// [`Store::extents`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes (never zero).
    pub len: u64,
    /// Not allocated in the backing storage.
    pub hole: bool,
    /// Reads as zeroes.
    pub zero: bool,
}

/// A range of bytes of fixed size, shared by every connection of a server.
///
/// Offsets and lengths passed in are within [`Store::size`] (the server
/// checks them); a store may still refuse an out-of-range request with
/// `EINVAL`.
pub trait Store: Send + Sync {
    /// Size in bytes.
    fn size(&self) -> u64;

    /// Fill `buf` with the bytes from `offset` (holes read as zeroes).
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;

    /// Write `buf` at `offset`; with `fua`, the data is on stable storage
    /// when this returns.
    fn write_at(&self, offset: u64, buf: &[u8], fua: bool) -> io::Result<()>;

    /// Put every write that has returned on stable storage.
    fn flush(&self) -> io::Result<()>;

    /// The range is no longer needed: the store may free it (it then reads
    /// as zeroes).
    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()>;

    /// Make the range read as zeroes; `may_trim` allows freeing it.
    fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool, fua: bool) -> io::Result<()>;

    /// The allocation status of the range from `offset`: consecutive extents
    /// starting at `offset`, together at most `len` bytes and at most
    /// `max_extents` of them (at least one when `len > 0`).
    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>>;

    /// Hand the store's own memory for `[offset, offset+len)` to `fill`,
    /// which must fill every byte of the slices (say, with one `readv`
    /// from a socket): the write then costs no copy. The range is locked
    /// against other requests while `fill` runs, so `fill` must not wait
    /// long (have the bytes at hand). `None`, without calling `fill`, if
    /// the store cannot (the caller then uses [`Store::write_at`]); else
    /// what `fill` returned (on an error the range holds some of the new
    /// bytes). A store that keeps data in memory implements it;
    /// the default says `None`. An empty range (`len` 0) makes nothing
    /// ready and tells whether the store takes direct writes at all.
    fn write_direct(
        &self,
        _offset: u64,
        _len: usize,
        _fill: &mut dyn FnMut(&mut [IoSliceMut<'_>]) -> io::Result<()>,
    ) -> Option<io::Result<()>> {
        None
    }

    /// Show `send` the bytes of `[offset, offset+len)` where they live
    /// (holes as zeroes), for one vectored send without a copy; the range
    /// is locked against writes while `send` runs, so `send` must not
    /// wait long. `None`, without calling `send`, if the store cannot
    /// (the caller then uses [`Store::read_at`]); else what `send`
    /// returned. The default says `None`.
    fn read_direct(
        &self,
        _offset: u64,
        _len: usize,
        _send: &mut dyn FnMut(&[IoSlice<'_>]) -> io::Result<()>,
    ) -> Option<io::Result<()>> {
        None
    }

    /// A hint that the range will be read soon.
    fn cache(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }

    /// One line for people: what the store is.
    fn describe(&self) -> String;
}

/// Where the blocks live, as given on a command line: `mem:SIZE` or
/// `file:PATH`.
///
/// ```
/// use ferry_block::StoreSpec;
/// assert_eq!("mem:64M".parse::<StoreSpec>()?, StoreSpec::Memory { size: 64 << 20 });
/// assert!(matches!("file:/tmp/disk.img".parse::<StoreSpec>()?, StoreSpec::File { .. }));
/// assert!("disk:1G".parse::<StoreSpec>().is_err());
/// # Ok::<(), ferry_block::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// Sparse memory of this many bytes.
    Memory {
        /// Size in bytes.
        size: u64,
    },
    /// A file (created if a size is given when it is opened).
    File {
        /// The file's path.
        path: PathBuf,
    },
}

impl std::str::FromStr for StoreSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = |why: &str| Error::BadSpec(format!("{s}: {why}; give mem:SIZE (e.g. mem:1G) or file:PATH"));
        if let Some(size) = s.strip_prefix("mem:") {
            let size = parse_size(size).map_err(|why| bad(&why))?;
            return Ok(StoreSpec::Memory { size });
        }
        if let Some(path) = s.strip_prefix("file:") {
            if path.is_empty() {
                return Err(bad("no path"));
            }
            return Ok(StoreSpec::File { path: PathBuf::from(path) });
        }
        Err(bad("not a store"))
    }
}

/// The largest store: 2^60 bytes (sizes and offsets stay far from `u64`
/// overflow).
pub const MAX_STORE_SIZE: u64 = 1 << 60;

/// Parse a size in bytes: a whole number with an optional binary unit
/// `K`, `M`, `G`, `T` (`KiB`… and `KB`… mean the same), from 1 byte to
/// [`MAX_STORE_SIZE`].
///
/// ```
/// use ferry_block::parse_size;
/// assert_eq!(parse_size("1G"), Ok(1 << 30));
/// assert_eq!(parse_size("64MiB"), Ok(64 << 20));
/// assert_eq!(parse_size("4096"), Ok(4096));
/// assert!(parse_size("0").is_err() && parse_size("1.5G").is_err() && parse_size("9999999T").is_err());
/// ```
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(digits);
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return Err("not a size; give a whole number of bytes with an optional unit K, M, G or T".into()),
    };
    let n: u64 = num.parse().map_err(|_| "not a size; give a whole number of bytes, e.g. 64M or 1G".to_string())?;
    let bytes = n.checked_shl(shift).filter(|b| b >> shift == n).unwrap_or(u64::MAX);
    if bytes == 0 {
        return Err("a store needs at least one byte".into());
    }
    if bytes > MAX_STORE_SIZE {
        return Err(format!("too large; at most {MAX_STORE_SIZE} bytes"));
    }
    Ok(bytes)
}

/// Open the store a spec names. `size` is the size of a file store (it
/// creates the file or extends it); a memory store takes its size from
/// the spec and refuses another. `direct` opens a file store for
/// `O_DIRECT` as well (used for aligned requests where the file system
/// allows it).
pub fn open_store(spec: &StoreSpec, size: Option<u64>, direct: bool) -> Result<Box<dyn Store>, Error> {
    match spec {
        StoreSpec::Memory { size: mem } => {
            if size.is_some_and(|s| s != *mem) {
                return Err(Error::BadSpec("a memory store takes its size from mem:SIZE; leave out --size".into()));
            }
            if direct {
                return Err(Error::BadSpec("direct I/O is for file stores; leave out --direct".into()));
            }
            Ok(Box::new(MemStore::new(*mem)?))
        }
        StoreSpec::File { path } => Ok(Box::new(FileStore::open(path, size, direct)?)),
    }
}

/// Chunk size of a [`MemStore`]: the unit of allocation.
pub const MEM_CHUNK: u64 = 64 << 10;

/// Sparse memory: a map of allocated 64 KiB chunks. Untouched chunks cost
/// nothing and read as zeroes; trimming or zeroing a whole chunk frees it.
///
/// Every chunk has a lock of its own, so [`Store::write_direct`] and
/// [`Store::read_direct`] can hand the chunks' memory to a socket call
/// (a write's payload received straight into the store, a read's reply
/// sent straight from it) while requests on other chunks go on.
///
/// ```
/// use ferry_block::{MemStore, Store};
/// let s = MemStore::new(1 << 30)?;            // 1 GiB, nothing allocated
/// s.write_at(4096, b"hello", false)?;
/// let mut b = [0u8; 8];
/// s.read_at(4093, &mut b)?;
/// assert_eq!(&b, b"\0\0\0hello");
/// assert_eq!(s.allocated_bytes(), 64 << 10);  // one chunk
/// s.trim(0, 1 << 20, false)?;
/// assert_eq!(s.allocated_bytes(), 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct MemStore {
    size: u64,
    /// Lock order: the map, then chunks in ascending order.
    chunks: RwLock<ChunkMap>,
}

/// One allocated chunk of a [`MemStore`].
type Chunk = RwLock<Box<[u8]>>;

/// The allocated chunks by index. A hash map, not an ordered one: a
/// random 4 KiB request then finds its chunk with one or two cache misses
/// instead of one per level of a tree (in a server doing random 4 KiB
/// writes the tree walk took a sixth of its time).
type ChunkMap = HashMap<u64, Chunk, BuildHasherDefault<ChunkHasher>>;

/// Hashes a chunk index with a 64-bit finalizer (two multiplications):
/// neighbouring indices land far apart, without the cost of a keyed
/// string hash.
#[derive(Default)]
struct ChunkHasher(u64);

impl Hasher for ChunkHasher {
    fn finish(&self) -> u64 {
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// What a hole reads as: one chunk of zeroes.
static ZERO_CHUNK: [u8; MEM_CHUNK as usize] = [0; MEM_CHUNK as usize];

fn new_chunk() -> Chunk {
    RwLock::new(vec![0u8; MEM_CHUNK as usize].into_boxed_slice())
}

impl MemStore {
    /// A memory store of `size` bytes (1 to [`MAX_STORE_SIZE`]).
    pub fn new(size: u64) -> Result<Self, Error> {
        if size == 0 || size > MAX_STORE_SIZE {
            return Err(Error::BadSpec(format!("mem:{size}: give a size from 1 to {MAX_STORE_SIZE} bytes")));
        }
        Ok(MemStore { size, chunks: RwLock::new(ChunkMap::default()) })
    }

    /// Bytes of memory the allocated chunks take.
    pub fn allocated_bytes(&self) -> u64 {
        self.chunks.read().unwrap_or_else(|e| e.into_inner()).len() as u64 * MEM_CHUNK
    }

    fn check(&self, offset: u64, len: u64) -> io::Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(io::Error::from_raw_os_error(libc_einval()));
        }
        Ok(())
    }

    /// Zero `[offset, offset+len)`: whole chunks are freed (or, without
    /// `may_free`, allocated and zeroed), parts of chunks zeroed in place.
    fn zero(&self, offset: u64, len: u64, may_free: bool) -> io::Result<()> {
        self.check(offset, len)?;
        let mut chunks = self.chunks.write().unwrap_or_else(|e| e.into_inner());
        for (index, at, n) in pieces(offset, len) {
            let whole = at == 0 && n as u64 == MEM_CHUNK;
            if whole && may_free {
                chunks.remove(&index);
            } else if let Some(chunk) = chunks.get_mut(&index) {
                chunk.get_mut().unwrap_or_else(|e| e.into_inner())[at..at + n].fill(0);
            } else if !may_free {
                chunks.insert(index, new_chunk());
            }
        }
        Ok(())
    }

    /// The map, read-locked, with every chunk of `[offset, offset+len)`
    /// allocated.
    fn allocated(&self, offset: u64, len: u64) -> std::sync::RwLockReadGuard<'_, ChunkMap> {
        loop {
            let chunks = self.chunks.read().unwrap_or_else(|e| e.into_inner());
            if pieces(offset, len).all(|(index, _, _)| chunks.contains_key(&index)) {
                return chunks;
            }
            drop(chunks);
            let mut chunks = self.chunks.write().unwrap_or_else(|e| e.into_inner());
            for (index, _, _) in pieces(offset, len) {
                chunks.entry(index).or_insert_with(new_chunk);
            }
            // A trim may free some again between the two locks: look again.
        }
    }
}

/// The chunks a byte range touches: (chunk index, offset in chunk, bytes).
fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize)> {
    let end = offset + len;
    let mut pos = offset;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let index = pos / MEM_CHUNK;
        let at = pos % MEM_CHUNK;
        let n = (MEM_CHUNK - at).min(end - pos);
        pos += n;
        Some((index, at as usize, n as usize))
    })
}

fn libc_einval() -> i32 {
    rustix::io::Errno::INVAL.raw_os_error()
}

impl Store for MemStore {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        let chunks = self.chunks.read().unwrap_or_else(|e| e.into_inner());
        let mut done = 0;
        for (index, at, n) in pieces(offset, buf.len() as u64) {
            let out = &mut buf[done..done + n];
            match chunks.get(&index) {
                Some(chunk) => out.copy_from_slice(&chunk.read().unwrap_or_else(|e| e.into_inner())[at..at + n]),
                None => out.fill(0),
            }
            done += n;
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8], _fua: bool) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        let chunks = self.allocated(offset, buf.len() as u64);
        let mut done = 0;
        for (index, at, n) in pieces(offset, buf.len() as u64) {
            let mut chunk = chunks[&index].write().unwrap_or_else(|e| e.into_inner());
            chunk[at..at + n].copy_from_slice(&buf[done..done + n]);
            done += n;
        }
        Ok(())
    }

    fn write_direct(
        &self,
        offset: u64,
        len: usize,
        fill: &mut dyn FnMut(&mut [IoSliceMut<'_>]) -> io::Result<()>,
    ) -> Option<io::Result<()>> {
        self.check(offset, len as u64).ok()?;
        let chunks = self.allocated(offset, len as u64);
        // Ascending order, as every other holder of several chunks.
        let mut guards: Vec<_> = pieces(offset, len as u64)
            .map(|(index, _, _)| chunks[&index].write().unwrap_or_else(|e| e.into_inner()))
            .collect();
        let mut parts: Vec<IoSliceMut<'_>> = guards
            .iter_mut()
            .zip(pieces(offset, len as u64))
            .map(|(chunk, (_, at, n))| IoSliceMut::new(&mut chunk[at..at + n]))
            .collect();
        Some(fill(&mut parts))
    }

    fn read_direct(
        &self,
        offset: u64,
        len: usize,
        send: &mut dyn FnMut(&[IoSlice<'_>]) -> io::Result<()>,
    ) -> Option<io::Result<()>> {
        self.check(offset, len as u64).ok()?;
        let chunks = self.chunks.read().unwrap_or_else(|e| e.into_inner());
        let guards: Vec<_> = pieces(offset, len as u64)
            .map(|(index, _, _)| chunks.get(&index).map(|c| c.read().unwrap_or_else(|e| e.into_inner())))
            .collect();
        let parts: Vec<IoSlice<'_>> = guards
            .iter()
            .zip(pieces(offset, len as u64))
            .map(|(chunk, (_, at, n))| match chunk {
                Some(chunk) => IoSlice::new(&chunk[at..at + n]),
                None => IoSlice::new(&ZERO_CHUNK[at..at + n]),
            })
            .collect();
        Some(send(&parts))
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, _fua: bool) -> io::Result<()> {
        self.zero(offset, len, true)
    }

    fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool, _fua: bool) -> io::Result<()> {
        self.zero(offset, len, may_trim)
    }

    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>> {
        self.check(offset, len)?;
        let chunks = self.chunks.read().unwrap_or_else(|e| e.into_inner());
        let mut out = Extents::new(max_extents);
        for (index, _, n) in pieces(offset, len) {
            let hole = !chunks.contains_key(&index);
            if !out.push(n as u64, hole, hole) {
                break;
            }
        }
        Ok(out.into_vec())
    }

    fn describe(&self) -> String {
        format!("memory, {} bytes, sparse", self.size)
    }
}

/// Builds a list of extents, merging neighbours of one status, up to a
/// number of them.
struct Extents {
    list: Vec<Extent>,
    max: usize,
}

impl Extents {
    fn new(max: usize) -> Self {
        Extents { list: Vec::new(), max: max.max(1) }
    }

    /// Add a run; false once the list is full (the run was not added).
    fn push(&mut self, len: u64, hole: bool, zero: bool) -> bool {
        if let Some(last) = self.list.last_mut() {
            if last.hole == hole && last.zero == zero {
                last.len += len;
                return true;
            }
        }
        if self.list.len() == self.max {
            return false;
        }
        self.list.push(Extent { len, hole, zero });
        true
    }

    fn into_vec(self) -> Vec<Extent> {
        self.list
    }
}

/// Alignment `O_DIRECT` needs here (offset, length and memory address).
const DIRECT_ALIGN: u64 = 4096;

/// A file (or block device): reads and writes are `pread`/`pwrite` from and
/// into the caller's memory, FLUSH and FUA are `fdatasync`, trim punches
/// holes, allocation comes from `SEEK_DATA`/`SEEK_HOLE`.
///
/// ```
/// use ferry_block::{FileStore, Store};
/// let dir = std::env::temp_dir().join(format!("ferry-doc-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let path = dir.join("disk.img");
/// let s = FileStore::open(&path, Some(1 << 20), false)?; // created, sparse
/// s.write_at(8192, b"block", true)?;                      // FUA: on disk now
/// let mut b = [0u8; 5];
/// s.read_at(8192, &mut b)?;
/// assert_eq!(&b, b"block");
/// # drop(s); std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct FileStore {
    path: PathBuf,
    fd: OwnedFd,
    /// The same file opened with `O_DIRECT`, when asked for and allowed.
    direct: Option<OwnedFd>,
    size: u64,
}

impl FileStore {
    /// Open `path` read-write. With `size`, a missing file is created with
    /// that size and a smaller one extended (a larger one is refused:
    /// nothing is cut off); without, the file must exist and not be empty.
    /// `direct` also opens it with `O_DIRECT` for aligned requests (where
    /// the file system refuses `O_DIRECT`, every request goes through the
    /// page cache).
    pub fn open(path: &Path, size: Option<u64>, direct: bool) -> Result<Self, Error> {
        let io_err = |what: &str, e: io::Error| Error::Io { what: format!("{what} {}", path.display()), source: e };
        if let Some(s) = size {
            if s == 0 || s > MAX_STORE_SIZE {
                return Err(Error::BadSpec(format!("--size {s}: give a size from 1 to {MAX_STORE_SIZE} bytes")));
            }
        }
        let file =
            OpenOptions::new().read(true).write(true).create(size.is_some()).truncate(false).open(path).map_err(
                |e| {
                    if e.kind() == io::ErrorKind::NotFound && size.is_none() {
                        Error::BadSpec(format!("{}: no such file; give --size to create it", path.display()))
                    } else {
                        io_err("cannot open", e)
                    }
                },
            )?;
        let fd: OwnedFd = file.into();
        let current = rustix::fs::seek(&fd, SeekFrom::End(0)).map_err(|e| io_err("cannot size", e.into()))?;
        let size = match size {
            Some(s) if s < current => {
                return Err(Error::BadSpec(format!(
                    "{} is {current} bytes, more than --size {s}; give at least {current} (nothing is cut off)",
                    path.display()
                )))
            }
            Some(s) if s > current => {
                rustix::fs::ftruncate(&fd, s).map_err(|e| io_err("cannot extend", e.into()))?;
                s
            }
            Some(s) => s,
            None if current == 0 => {
                return Err(Error::BadSpec(format!("{} is empty; give --size to extend it", path.display())))
            }
            None => current,
        };
        let direct = if direct {
            rustix::fs::open(path, OFlags::RDWR | OFlags::DIRECT | OFlags::CLOEXEC, rustix::fs::Mode::empty()).ok()
        } else {
            None
        };
        Ok(FileStore { path: path.to_path_buf(), fd, direct, size })
    }

    /// Whether aligned requests go around the page cache (`O_DIRECT`).
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// The fd for a request: the `O_DIRECT` one when everything is aligned.
    fn fd_for(&self, offset: u64, ptr: *const u8, len: usize) -> std::os::fd::BorrowedFd<'_> {
        match &self.direct {
            Some(d)
                if offset % DIRECT_ALIGN == 0 && len as u64 % DIRECT_ALIGN == 0 && ptr as u64 % DIRECT_ALIGN == 0 =>
            {
                d.as_fd()
            }
            _ => self.fd.as_fd(),
        }
    }

    fn sync(&self) -> io::Result<()> {
        rustix::fs::fdatasync(&self.fd)?;
        Ok(())
    }

    fn check(&self, offset: u64, len: u64) -> io::Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(io::Error::from_raw_os_error(libc_einval()));
        }
        Ok(())
    }
}

impl Store for FileStore {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        let fd = self.fd_for(offset, buf.as_ptr(), buf.len());
        let mut done = 0;
        while done < buf.len() {
            match rustix::io::pread(fd, &mut buf[done..], offset + done as u64) {
                // The file shrank under us: what is gone reads as zeroes.
                Ok(0) => {
                    buf[done..].fill(0);
                    break;
                }
                Ok(n) => done += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8], fua: bool) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        let fd = self.fd_for(offset, buf.as_ptr(), buf.len());
        let mut done = 0;
        while done < buf.len() {
            match rustix::io::pwrite(fd, &buf[done..], offset + done as u64) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(n) => done += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if fua {
            self.sync()?;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.sync()
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        match rustix::fs::fallocate(&self.fd, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, len) {
            // Trim is a hint: a file system without holes keeps the data.
            Ok(()) | Err(rustix::io::Errno::OPNOTSUPP) => {}
            Err(e) => return Err(e.into()),
        }
        if fua {
            self.sync()?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool, fua: bool) -> io::Result<()> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let mode = if may_trim {
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE
        } else {
            FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE
        };
        match rustix::fs::fallocate(&self.fd, mode, offset, len) {
            Ok(()) => {}
            Err(rustix::io::Errno::OPNOTSUPP) => {
                // Write the zeroes: 64 KiB at a time from one zeroed block.
                let zeros = vec![0u8; 64 << 10];
                let mut pos = offset;
                while pos < offset + len {
                    let n = (offset + len - pos).min(zeros.len() as u64) as usize;
                    self.write_at(pos, &zeros[..n], false)?;
                    pos += n as u64;
                }
            }
            Err(e) => return Err(e.into()),
        }
        if fua {
            self.sync()?;
        }
        Ok(())
    }

    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>> {
        self.check(offset, len)?;
        let end = offset + len;
        let mut out = Extents::new(max_extents);
        let mut pos = offset;
        while pos < end {
            let data = match rustix::fs::seek(&self.fd, SeekFrom::Data(pos)) {
                Ok(d) => d.min(end),
                // No data from here to the end of the file.
                Err(rustix::io::Errno::NXIO) => end,
                // No SEEK_DATA here: say "allocated" (status 0 is always allowed).
                Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::OPNOTSUPP) => {
                    out.push(end - pos, false, false);
                    break;
                }
                Err(e) => return Err(e.into()),
            };
            if data > pos {
                if !out.push(data - pos, true, true) {
                    break;
                }
                pos = data;
                continue;
            }
            let hole = match rustix::fs::seek(&self.fd, SeekFrom::Hole(pos)) {
                Ok(h) => h.min(end),
                Err(rustix::io::Errno::NXIO) => end,
                Err(e) => return Err(e.into()),
            };
            // Data at pos by one call and a hole there by the other: the
            // file changed in between; say "allocated" for the rest.
            if hole <= pos {
                out.push(end - pos, false, false);
                break;
            }
            if !out.push(hole - pos, false, false) {
                break;
            }
            pos = hole;
        }
        Ok(out.into_vec())
    }

    fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)?;
        rustix::fs::fadvise(&self.fd, offset, NonZeroU64::new(len), rustix::fs::Advice::WillNeed)?;
        Ok(())
    }

    fn describe(&self) -> String {
        let direct = if self.direct.is_some() { ", O_DIRECT for aligned requests" } else { "" };
        format!("file {}, {} bytes{direct}", self.path.display(), self.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ferry-store-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn memory_is_sparse_and_zeroes_free_or_keep_chunks() {
        let s = MemStore::new(1 << 20).unwrap();
        let mut b = vec![1u8; 100_000];
        s.read_at(0, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0), "holes read as zeroes");
        s.write_at(MEM_CHUNK - 2, b"spans", false).unwrap();
        assert_eq!(s.allocated_bytes(), 2 * MEM_CHUNK);
        assert_eq!(
            s.extents(0, 4 * MEM_CHUNK, 16).unwrap(),
            vec![
                Extent { len: 2 * MEM_CHUNK, hole: false, zero: false },
                Extent { len: 2 * MEM_CHUNK, hole: true, zero: true }
            ]
        );
        assert_eq!(s.extents(0, 4 * MEM_CHUNK, 1).unwrap().len(), 1);
        // Zeroing part of a chunk keeps it; NO_HOLE allocates.
        s.write_zeroes(MEM_CHUNK - 2, 1, true, false).unwrap();
        let mut b = [0u8; 5];
        s.read_at(MEM_CHUNK - 2, &mut b).unwrap();
        assert_eq!(&b, b"\0pans");
        s.write_zeroes(4 * MEM_CHUNK, MEM_CHUNK, false, false).unwrap();
        assert_eq!(s.allocated_bytes(), 3 * MEM_CHUNK);
        s.trim(0, 1 << 20, false).unwrap();
        assert_eq!(s.allocated_bytes(), 0);
        assert!(s.read_at((1 << 20) - 1, &mut b).is_err(), "past the end");
        assert!(s.write_at(u64::MAX, b"x", false).is_err(), "overflowing offset");
        assert!(MemStore::new(0).is_err() && MemStore::new(MAX_STORE_SIZE + 1).is_err());
    }

    #[test]
    fn file_holes_come_from_seek_data_and_trim_punches_them() {
        let dir = scratch("holes");
        let path = dir.join("d.img");
        let s = FileStore::open(&path, Some(8 << 20), false).unwrap();
        assert_eq!(s.extents(0, 8 << 20, 64).unwrap(), vec![Extent { len: 8 << 20, hole: true, zero: true }]);
        s.write_at(1 << 20, &vec![9u8; 1 << 20], false).unwrap();
        s.flush().unwrap();
        let x = s.extents(0, 8 << 20, 64).unwrap();
        // Where the file system tracks holes (tmpfs, ext4, xfs, btrfs): data exactly where written.
        if x.len() > 1 {
            assert_eq!(
                x,
                vec![
                    Extent { len: 1 << 20, hole: true, zero: true },
                    Extent { len: 1 << 20, hole: false, zero: false },
                    Extent { len: 6 << 20, hole: true, zero: true }
                ]
            );
            s.trim(1 << 20, 1 << 20, true).unwrap();
            assert_eq!(s.extents(0, 8 << 20, 64).unwrap().len(), 1, "trim punched the hole");
        }
        s.write_at(100, b"kept", true).unwrap();
        s.write_zeroes(102, 1, false, false).unwrap();
        let mut b = [0u8; 4];
        s.read_at(100, &mut b).unwrap();
        assert_eq!(&b, b"ke\0t");
        drop(s);
        // Reopened: the size is the file's; a smaller --size is refused.
        let s = FileStore::open(&path, None, false).unwrap();
        assert_eq!(s.size(), 8 << 20);
        drop(s);
        assert!(matches!(FileStore::open(&path, Some(4 << 20), false), Err(Error::BadSpec(_))));
        assert!(matches!(FileStore::open(&dir.join("none"), None, false), Err(Error::BadSpec(_))));
        let s = FileStore::open(&path, Some(16 << 20), true).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 16 << 20, "extended");
        // With O_DIRECT (where the file system allows it) aligned requests
        // go around the page cache and read the same bytes.
        let mut page = vec![0u8; 8192];
        let at = page.as_ptr().align_offset(4096);
        s.read_at(0, &mut page[at..at + 4096]).unwrap();
        assert_eq!(&page[at + 100..at + 104], b"ke\0t");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn memory_hands_out_its_chunks_for_direct_writes_and_reads() {
        let s = MemStore::new(4 * MEM_CHUNK + 100).unwrap();
        // A write across three chunks, filled in place through the slices.
        let at = MEM_CHUNK - 10;
        let len = MEM_CHUNK as usize + 20;
        let data: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8).collect();
        let mut lens = Vec::new();
        let r = s.write_direct(at, len, &mut |parts| {
            let mut done = 0;
            for p in parts.iter_mut() {
                let n = p.len();
                lens.push(n);
                p.copy_from_slice(&data[done..done + n]);
                done += n;
            }
            Ok(())
        });
        assert!(matches!(r, Some(Ok(()))));
        assert_eq!(lens, vec![10, MEM_CHUNK as usize, 10], "the store's own chunks, one slice each");
        assert_eq!(s.allocated_bytes(), 3 * MEM_CHUNK);
        let mut back = vec![0u8; len];
        s.read_at(at, &mut back).unwrap();
        assert!(back == data);
        // A read over data and a hole: the chunks' bytes, zeroes for the hole,
        // nothing allocated by reading.
        let mut seen = Vec::new();
        let r = s.read_direct(2 * MEM_CHUNK, 2 * MEM_CHUNK as usize + 50, &mut |parts| {
            for p in parts {
                seen.extend_from_slice(p);
            }
            Ok(())
        });
        assert!(matches!(r, Some(Ok(()))));
        assert_eq!(seen.len(), 2 * MEM_CHUNK as usize + 50);
        assert_eq!(&seen[..10], &data[len - 10..]);
        assert!(seen[10..].iter().all(|&b| b == 0));
        assert_eq!(s.allocated_bytes(), 3 * MEM_CHUNK);
        // The error of the caller's I/O comes back; past the end: None,
        // without calling the caller.
        let r = s.write_direct(0, 5, &mut |_| Err(io::Error::other("socket gone")));
        assert_eq!(r.map(|r| r.is_err()), Some(true));
        assert!(s.write_direct(4 * MEM_CHUNK, 101, &mut |_| panic!("called")).is_none());
        assert!(s.read_direct(u64::MAX, 1, &mut |_| panic!("called")).is_none());
        // A file store does not hand out memory: callers use read_at/write_at.
        let dir = scratch("direct");
        let f = FileStore::open(&dir.join("d.img"), Some(1 << 20), false).unwrap();
        assert!(f.write_direct(0, 5, &mut |_| panic!("called")).is_none());
        assert!(f.read_direct(0, 5, &mut |_| panic!("called")).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn specs_and_sizes() {
        assert_eq!("mem:1G".parse::<StoreSpec>().unwrap(), StoreSpec::Memory { size: 1 << 30 });
        assert_eq!(parse_size("2t"), Ok(2 << 40));
        for bad in ["", "G", "-1", "1Q", "1.0", "99999999999999999999"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        for bad in ["mem:", "file:", "mem", "tmp:1"] {
            assert!(bad.parse::<StoreSpec>().is_err(), "{bad}");
        }
        assert!(open_store(&StoreSpec::Memory { size: 4096 }, Some(8192), false).is_err());
    }
}
