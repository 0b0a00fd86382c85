//! The per-process registry file and its readers.
//!
//! One file per process, `PID.ferry`, in a directory of the user's own
//! (mode 0700, the file 0600). A thread of the library ("ferry-inspect")
//! rewrites it every [`INTERVAL`] in place: it marks the generation odd,
//! writes the body, then writes the whole header with the next even
//! generation and the body's checksum. A reader reads header and body in
//! one `pread`, checks the generation is even and the checksum matches,
//! and reads the generation again: unchanged, the snapshot is whole.
//!
//! The file goes at exit (an `atexit` handler); a process killed before
//! leaves it behind, and the next process to start its registry, or any
//! reader, removes files whose process is gone (the pid is not running, is
//! a zombie, or runs a later process: the start time differs).
//!
//! The file and its thread start with the process's first channel end: a
//! process that only makes domains, pools and buffers publishes nothing
//! and runs no thread. A forked child starts a registry of its own at its
//! first domain or channel and never touches its parent's, whose locks the
//! parent's thread may have held at the fork.

use std::fs::File;
use std::io::{self, Read, Seek};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::format::{self, ChannelSnapshot, DomainSnapshot, ProcessSnapshot, ReadError, HEADER_LEN, MAX_BODY};
use super::ChanEntry;
use crate::domain::DomainShared;

/// How often a process rewrites its registry file.
pub const INTERVAL: Duration = Duration::from_millis(250);

/// The file name suffix of registry files.
const SUFFIX: &str = ".ferry";

/// The registry of one process. A forked child makes a registry of its
/// own instead of using its parent's: a lock the parent's registry thread
/// held at the fork stays held in the child forever (the thread is not
/// there to release it), so nothing the child does may take it.
struct Registry {
    /// The process this registry belongs to.
    pid: u32,
    state: Mutex<State>,
    /// Serializes the writers of the file (the thread and `publish_now`),
    /// and holds the last generation written.
    writer: Mutex<u64>,
    /// The file to remove at exit, once there is one.
    exit_path: OnceLock<PathBuf>,
}

/// What a registry knows of its process.
#[derive(Default)]
struct State {
    domains: Vec<Weak<DomainShared>>,
    channels: Vec<Weak<ChanEntry>>,
    /// The file and the thread that rewrites it, once the first channel
    /// started them.
    file: Option<Published>,
    /// The registry could not be started in this process (said once).
    failed: bool,
}

/// The registry file of a process whose registry is started.
struct Published {
    file: Arc<File>,
    start_time: u64,
    name: String,
}

/// The registry of the current process (null until the first domain or
/// channel); registries are never freed, so a pointer read here stays
/// valid for the life of the process.
static CURRENT: AtomicPtr<Registry> = AtomicPtr::new(std::ptr::null_mut());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn enabled() -> bool {
    std::env::var_os("FERRY_INSPECT").is_none_or(|v| v != "0")
}

/// The registry of this process, if it has one (a forked child's parent's
/// registry does not count).
fn existing() -> Option<&'static Registry> {
    let ptr = CURRENT.load(Ordering::Acquire);
    // SAFETY: CURRENT is null or a pointer from `Box::into_raw` in
    // `registry()` that was published there and is never freed.
    let reg = unsafe { ptr.as_ref() }?;
    (reg.pid == std::process::id()).then_some(reg)
}

/// The registry of this process, made at the first call in the process
/// (in a forked child: at its first call, whatever its parent had).
fn registry() -> &'static Registry {
    let pid = std::process::id();
    loop {
        let seen = CURRENT.load(Ordering::Acquire);
        // SAFETY: as in `existing`: null or published and never freed.
        if let Some(reg) = unsafe { seen.as_ref() }.filter(|r| r.pid == pid) {
            return reg;
        }
        let fresh = Box::into_raw(Box::new(Registry {
            pid,
            state: Mutex::new(State::default()),
            writer: Mutex::new(0),
            exit_path: OnceLock::new(),
        }));
        // The registry `seen` (the parent's, in a forked child) is left as
        // it is, locks and all: the child never touches it again.
        match CURRENT.compare_exchange(seen, fresh, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: `fresh` is from `Box::into_raw` above and, now
            // published, is never freed.
            Ok(_) => return unsafe { &*fresh },
            // Another thread of this process made one first: ours was
            // never shared, so it is freed here, and the loop takes theirs.
            // SAFETY: `fresh` is from `Box::into_raw` above and no one
            // else has seen it.
            Err(_) => drop(unsafe { Box::from_raw(fresh) }),
        }
    }
}

/// The directory of the current user's registry files:
/// `$FERRY_INSPECT_DIR` if set, else `$XDG_RUNTIME_DIR/ferry/inspect` if
/// that runtime directory exists, else `/dev/shm/ferry-inspect-UID`.
pub fn registry_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FERRY_INSPECT_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    if let Some(run) = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).filter(|d| d.is_dir()) {
        return run.join("ferry").join("inspect");
    }
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    base.join(format!("ferry-inspect-{}", rustix::process::getuid().as_raw()))
}

/// Create `dir` (0700) if missing, and check that it is a directory of
/// ours that nobody else can write or read.
fn own_dir(dir: &Path) -> io::Result<()> {
    match std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let md = std::fs::symlink_metadata(dir)?;
    let uid = rustix::process::getuid().as_raw();
    if !md.is_dir() || md.uid() != uid || md.mode() & 0o077 != 0 {
        return Err(io::Error::other(format!("{} is not a directory of user {uid} with mode 0700", dir.display())));
    }
    Ok(())
}

/// The state and start time of process `pid` (`/proc/PID/stat`): `None`
/// if it does not exist.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 22 (starttime) is the 20th after the name.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// Whether `pid` runs the process that wrote a file with `start_time`.
fn alive(pid: u32, start_time: u64) -> bool {
    match proc_stat(pid) {
        Some((state, start)) => !matches!(state, 'Z' | 'X') && start == start_time,
        None => false,
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Registry {
    /// Start publishing (the file and its thread) if not yet: whether the
    /// registry is started. Called with the state locked.
    fn start_locked(&'static self, st: &mut State) -> bool {
        if st.file.is_some() {
            return true;
        }
        if st.failed {
            return false;
        }
        match self.start() {
            Ok(published) => {
                st.file = Some(published);
                true
            }
            Err(e) => {
                st.failed = true;
                eprintln!("ferry: the inspection registry is off in this process: {e}");
                false
            }
        }
    }

    fn start(&'static self) -> io::Result<Published> {
        let pid = self.pid;
        let dir = registry_dir();
        own_dir(&dir)?;
        let _ = sweep(&dir);
        let path = dir.join(format!("{pid}{SUFFIX}"));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)?;
        let start_time = proc_stat(pid).map_or(0, |(_, t)| t);
        let name = std::fs::read_to_string("/proc/self/comm").map(|s| s.trim_end().to_owned()).unwrap_or_default();
        let _ = self.exit_path.set(path.clone());
        // A flag, not a `Once`: a child forked while its parent was
        // registering would wait on the `Once` forever.
        static AT_EXIT: AtomicBool = AtomicBool::new(false);
        if !AT_EXIT.swap(true, Ordering::AcqRel) {
            // SAFETY: `remove_at_exit` is an `extern "C" fn()` that never
            // unwinds (it catches everything, takes no lock and only
            // removes a file); atexit only stores the pointer.
            unsafe {
                libc::atexit(remove_at_exit);
            }
        }
        let published = Published { file: Arc::new(file), start_time, name };
        // A first snapshot at once, empty: a reader never finds the file
        // without one.
        self.write_snapshot(&published, &[]);
        let spawned = std::thread::Builder::new().name("ferry-inspect".into()).spawn(move || self.publisher());
        if let Err(e) = spawned {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        Ok(published)
    }

    /// The registry thread: a snapshot now (once the registration that
    /// started it is done) and every [`INTERVAL`], for as long as the
    /// process lives.
    fn publisher(&'static self) {
        while self.publish() {
            std::thread::sleep(until_next_tick());
        }
    }

    /// Take and write one snapshot; false if the registry is not started.
    fn publish(&self) -> bool {
        let (published, domains, channels) = {
            let mut st = lock(&self.state);
            let Some(p) = &st.file else { return false };
            let published = Published { file: p.file.clone(), start_time: p.start_time, name: p.name.clone() };
            st.domains.retain(|d| d.strong_count() > 0);
            st.channels.retain(|c| c.strong_count() > 0);
            (published, st.domains.clone(), st.channels.clone())
        };
        let channels: Vec<Arc<ChanEntry>> = channels.iter().filter_map(Weak::upgrade).collect();
        let mut snaps = Vec::new();
        for d in domains.iter().filter_map(Weak::upgrade) {
            let pools = d.lock().pool_snapshots();
            let chans = channels
                .iter()
                .filter(|c| c.domain == d.id)
                .map(|c| {
                    let info = c.info();
                    ChannelSnapshot {
                        key: c.key,
                        backend: info.backend.to_owned(),
                        endpoint: info.endpoint,
                        peer: info.peer,
                        role: format!("{:?}", info.role),
                        direction: format!("{:?}", info.direction),
                        trust: format!("{:?}", info.trust),
                        state: format!("{:?}", info.state),
                        stats: c.counters.snapshot(),
                    }
                })
                .collect();
            snaps.push(DomainSnapshot { id: d.id, name: d.name().to_owned(), pools, channels: chans });
        }
        self.write_snapshot(&published, &snaps);
        true
    }

    /// Rewrite the file: the generation odd, the body, then the header
    /// with the next even generation and the body's checksum.
    fn write_snapshot(&self, published: &Published, domains: &[DomainSnapshot]) {
        let body = format::encode_body(&published.name, INTERVAL.as_millis() as u32, domains);
        let mut generation = lock(&self.writer);
        let next = generation.wrapping_add(2) & !1;
        let header = format::header(next, &body, self.pid, published.start_time, now_ms());
        let file = &published.file;
        let written = file
            .write_all_at(&(next | 1).to_le_bytes(), format::GENERATION_AT)
            .and_then(|()| file.write_all_at(&body, HEADER_LEN as u64))
            .and_then(|()| file.write_all_at(&header, 0));
        *generation = next;
        // A write that failed (a full file system) is tried again next time.
        let _ = written;
    }
}

extern "C" fn remove_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        // Only this process's own file: a forked child inherits the handler
        // but not the file.
        if let Some(path) = existing().and_then(|r| r.exit_path.get()) {
            let _ = std::fs::remove_file(path);
        }
    });
}

/// The time to the next multiple of [`INTERVAL`] on the wall clock: every
/// process publishes at the same instants, so the snapshots of two ends of
/// a channel compare (what one sent, what the other took) at one moment.
fn until_next_tick() -> Duration {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos();
    let interval = INTERVAL.as_nanos();
    Duration::from_nanos((interval - now % interval) as u64)
}

/// Note a new domain; it is published once the process has a channel.
pub(crate) fn register_domain(domain: &Arc<DomainShared>) {
    if !enabled() {
        return;
    }
    let mut st = lock(&registry().state);
    // (The registry thread drops the dead ones; until it runs, so does
    // every registration, so a process without channels keeps no list.)
    st.domains.retain(|d| d.strong_count() > 0);
    st.domains.push(Arc::downgrade(domain));
}

/// Note a new channel end, and start the registry (its file and thread)
/// at the first one.
pub(crate) fn register_channel(entry: &Arc<ChanEntry>) {
    if !enabled() {
        return;
    }
    let reg = registry();
    let mut st = lock(&reg.state);
    if reg.start_locked(&mut st) {
        st.channels.push(Arc::downgrade(entry));
    }
}

/// Write a snapshot of this process to its registry file now (the
/// registry thread does every quarter of a second). Returns whether one
/// was written: `false` when the registry is off in this process, or not
/// started (it starts with the process's first channel).
pub fn publish_now() -> bool {
    existing().is_some_and(Registry::publish)
}

/// One registry file as a reader found it.
#[derive(Debug)]
pub struct Listing {
    /// The file.
    pub path: PathBuf,
    /// The pid its name gives.
    pub pid: u32,
    /// Its snapshot, or why it could not be read.
    pub snapshot: Result<ProcessSnapshot, ReadError>,
}

/// The pid a registry file's name gives.
fn file_pid(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    name.strip_suffix(SUFFIX)?.parse().ok().filter(|&p| p > 0)
}

/// Read one registry file (`Busy` after a few tries if its writer kept
/// rewriting it). Everything is checked; nothing in the file can make the
/// reader panic, hang or allocate more than the file's size.
pub fn read_file(path: &Path) -> Result<ProcessSnapshot, ReadError> {
    let io_err = |e: io::Error| ReadError::Io(format!("{}: {e}", path.display()));
    let file = open_regular(path).map_err(io_err)?;
    let cap = (HEADER_LEN + MAX_BODY) as u64;
    let mut last = ReadError::Busy;
    for attempt in 0..8 {
        if attempt > 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
        // Up to the end, however far the writer got (the file never
        // shrinks: a body shorter than its header says is damage).
        let mut bytes = Vec::new();
        (&file).rewind().map_err(io_err)?;
        (&file).take(cap).read_to_end(&mut bytes).map_err(io_err)?;
        match format::parse(&bytes) {
            Ok(snap) => {
                let mut again = [0u8; 8];
                let same = file.read_exact_at(&mut again, format::GENERATION_AT).is_ok()
                    && u64::from_le_bytes(again) == snap.generation;
                if !same {
                    last = ReadError::Busy;
                    continue;
                }
                if file_pid(path).is_some_and(|p| p != snap.pid) {
                    return Err(ReadError::Malformed("the pid in the file is not the pid in its name"));
                }
                return Ok(snap);
            }
            Err(ReadError::Busy) => last = ReadError::Busy,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// Open a file to read without following a symbolic link or waiting (a
/// FIFO put in its place); only a regular file will do.
fn open_regular(path: &Path) -> io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    Ok(file)
}

/// Remove the registry files in `dir` whose process is gone; returns how
/// many. Files that are not registry files are left alone.
pub fn sweep(dir: &Path) -> io::Result<usize> {
    let mut removed = 0;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(pid) = file_pid(&path) else { continue };
        if stale(&path, pid) && std::fs::remove_file(&path).is_ok() {
            removed += 1;
        }
    }
    Ok(removed)
}

/// Whether the process of a registry file is gone: no such pid, a
/// zombie, or a later process with the same pid (another start time than
/// the file's, when the file says).
fn stale(path: &Path, pid: u32) -> bool {
    let Some((state, start)) = proc_stat(pid) else { return true };
    if matches!(state, 'Z' | 'X') {
        return true;
    }
    let mut header = [0u8; HEADER_LEN];
    let read = open_regular(path).and_then(|f| f.read_exact_at(&mut header, 0));
    match read.ok().and_then(|()| format::parse_header(&header).ok()) {
        Some(h) => h.start_time != 0 && h.start_time != start,
        // Unreadable or not (yet) a registry file: only the pid tells.
        None => false,
    }
}

/// Every registry file in `dir` whose process is alive (the others are
/// swept), sorted by pid. A file that cannot be read is listed with the
/// reason.
pub fn read_all(dir: &Path) -> io::Result<Vec<Listing>> {
    let _ = sweep(dir);
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(pid) = file_pid(&path) else { continue };
        let snapshot = read_file(&path);
        if let Ok(s) = &snapshot {
            if !alive(s.pid, s.start_time) && s.start_time != 0 {
                continue;
            }
        }
        out.push(Listing { path, pid, snapshot });
    }
    out.sort_by_key(|l| l.pid);
    Ok(out)
}
