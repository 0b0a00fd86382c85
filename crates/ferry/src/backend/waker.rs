//! Parking a thread until a peer thread wakes it, without lost wake-ups.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::thread::{self, Thread};
use std::time::Duration;

/// One sleeper, any number of wakers.
#[derive(Debug, Default)]
pub(crate) struct Waker {
    sleeper: Mutex<Option<Thread>>,
    notified: AtomicBool,
}

impl Waker {
    /// Remember the calling thread as the one to wake. Call before
    /// declaring sleep to the peer, so a wake-up in between is not lost.
    pub(crate) fn register(&self) {
        let mut s = self.sleeper.lock().unwrap_or_else(|p| p.into_inner());
        let me = thread::current();
        if s.as_ref().map(Thread::id) != Some(me.id()) {
            *s = Some(me);
        }
    }

    /// Park the registered (calling) thread until `wake` or `timeout`.
    pub(crate) fn park(&self, timeout: Duration) {
        // `notified` catches a wake that came before the park; the thread's
        // own unpark token catches one that comes between the check and it.
        if self.notified.swap(false, Ordering::AcqRel) {
            return;
        }
        thread::park_timeout(timeout);
        self.notified.store(false, Ordering::Release);
    }

    /// Wake the sleeper, if any.
    pub(crate) fn wake(&self) {
        self.notified.store(true, Ordering::Release);
        if let Some(t) = self.sleeper.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            t.unpark();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn wake_before_park_is_not_lost() {
        let w = Waker::default();
        w.register();
        w.wake();
        let t = Instant::now();
        w.park(Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(4));
    }

    #[test]
    fn wakes_a_parked_thread() {
        let w = Arc::new(Waker::default());
        let w2 = w.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let h = thread::spawn(move || {
            w2.register();
            ready_tx.send(()).unwrap();
            let t = Instant::now();
            // Long park: only a delivered wake-up ends it early.
            w2.park(Duration::from_secs(30));
            t.elapsed()
        });
        ready_rx.recv().unwrap();
        thread::sleep(Duration::from_millis(20));
        w.wake();
        let slept = h.join().unwrap();
        assert!(slept < Duration::from_secs(20), "wake-up lost: parked for {slept:?}");
    }
}
