//! Pinning benchmark threads and processes to cores.

/// Pin the calling thread to `cpu`. The mask we inherited does not matter
/// (a thread or process started by a pinned thread inherits its single
/// CPU, so counting "available" CPUs would fold every `cpu` onto that one);
/// only if the kernel refuses `cpu` (no such CPU) do we fold it onto the
/// CPUs that exist. Failures are reported and otherwise ignored
/// (containers may forbid pinning).
pub fn to_cpu(cpu: usize) {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    if rustix::thread::sched_setaffinity(None, &set).is_ok() {
        return;
    }
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").ok();
    let n = online
        .as_deref()
        .and_then(|s| s.trim().rsplit(['-', ',']).next())
        .and_then(|last| last.parse::<usize>().ok())
        .map_or(1, |last| last + 1);
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu % n);
    if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
        eprintln!("ferry: could not pin to cpu {cpu}: {e}");
    }
}
