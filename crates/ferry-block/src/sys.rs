//! The few system calls the block service makes that `rustix` does not
//! wrap, each behind a safe function.

use std::io;

/// Put the calling thread under `SCHED_BATCH`: woken when a request
/// arrives or its socket has room again, it does not preempt the thread
/// running on that core (often the client itself, on the same machine); it
/// runs when that one sleeps or its time slice ends, or at once on an idle
/// core. A server sending a large read as fast as the client takes it is
/// woken every time the client has taken a third of the socket's buffer;
/// as a normal thread it preempted the client each time. Any user may
/// choose this policy for their own threads.
pub(crate) fn batch_scheduling() -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `sched_setscheduler` on the calling thread (pid 0) only reads
    // the `sched_param` it is given, for the duration of the call.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_thread_becomes_a_batch_thread() {
        std::thread::spawn(|| {
            super::batch_scheduling().expect("SCHED_BATCH is open to any user");
            // SAFETY: sched_getscheduler takes no pointers.
            let policy = unsafe { libc::sched_getscheduler(0) };
            assert_eq!(policy, libc::SCHED_BATCH);
        })
        .join()
        .unwrap();
    }
}
