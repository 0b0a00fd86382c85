//! Pinning benchmark threads and processes to cores.

use rustix::thread::CpuSet;

/// How many CPUs this machine has (the highest online CPU number plus
/// one, as `/sys` lists them; at most what a CPU set can name).
pub fn cpus() -> usize {
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").ok();
    online
        .as_deref()
        .and_then(|s| s.trim().rsplit(['-', ',']).next())
        .and_then(|last| last.parse::<usize>().ok())
        .map(|last| last + 1)
        .or_else(|| std::thread::available_parallelism().ok().map(usize::from))
        .unwrap_or(1)
        .clamp(1, CpuSet::MAX_CPU)
}

/// Pin the calling thread to `cpu`. The mask we inherited does not matter
/// (a thread or process started by a pinned thread inherits its single
/// CPU, so counting "available" CPUs would fold every `cpu` onto that one);
/// only if the kernel refuses `cpu` (no such CPU) do we fold it onto the
/// CPUs that exist. Failures are reported and otherwise ignored
/// (containers may forbid pinning).
pub fn to_cpu(cpu: usize) {
    if cpu < CpuSet::MAX_CPU {
        let mut set = CpuSet::new();
        set.set(cpu);
        if rustix::thread::sched_setaffinity(None, &set).is_ok() {
            return;
        }
    }
    let mut set = CpuSet::new();
    set.set(cpu % cpus());
    if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
        eprintln!("ferry: could not pin to CPU {cpu} ({e}); running unpinned, so figures may vary more");
    }
}
