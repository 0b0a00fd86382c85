//! Pinning benchmark threads to cores.

use std::sync::OnceLock;

static CPUS: OnceLock<usize> = OnceLock::new();

/// Remember how many CPUs the process may use. Call before pinning any
/// thread: `available_parallelism` follows the *calling thread's* affinity,
/// so once a thread is pinned, threads it spawns would see one CPU.
pub fn init() {
    CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
}

/// Pin the calling thread to `cpu` (modulo the number of CPUs); a failure
/// is reported on stderr and otherwise ignored (containers may forbid it).
pub fn to_cpu(cpu: usize) {
    init();
    let n = *CPUS.get().expect("initialised");
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu % n);
    if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
        eprintln!("ferry: could not pin to cpu {cpu}: {e}");
    }
}
