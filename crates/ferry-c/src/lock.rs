//! A lock for the short critical sections of the data path (a waitset, a
//! buffer's slot): one locked instruction to take it, a
//! plain store to let it go. `std::sync::Mutex` spends a second locked
//! instruction on unlocking (to learn whether to wake a sleeper), and a
//! call into the library takes two or three such locks: on a busy-polled
//! message path the locked instructions cost more than the rest of the
//! call. A thread that finds the lock taken spins briefly, then yields
//! its CPU, then naps between looks (the sections are short: no sleeping,
//! no call into the program; the longest, a channel's destroy, unmaps
//! pools).

#![allow(unsafe_code)]

use std::ops::{Deref, DerefMut};
use std::sync::atomic::Ordering;

use sync::{pause, AtomicBool, UnsafeCell};

/// What the lock is built of: std's atomics, or loom's when the lock's
/// model runs (`.ci/loom.sh`), so that loom explores its orderings.
#[cfg(not(loom))]
mod sync {
    pub use std::cell::UnsafeCell;
    pub use std::sync::atomic::AtomicBool;

    /// A wait between looks at a taken lock, the `spins`-th in a row.
    #[inline]
    pub fn pause(spins: u32) {
        if spins < super::SPINS {
            std::hint::spin_loop();
        } else if spins < super::YIELDS {
            std::thread::yield_now();
        } else {
            std::thread::sleep(super::NAP);
        }
    }
}

#[cfg(loom)]
mod sync {
    pub use loom::sync::atomic::AtomicBool;

    /// loom's cell with std's shape: loom checks the accesses the lock's
    /// model makes through cells of its own, this one only holds the value.
    pub struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        pub fn new(v: T) -> Self {
            UnsafeCell(std::cell::UnsafeCell::new(v))
        }
        pub fn get(&self) -> *mut T {
            self.0.get()
        }
    }

    /// Under loom every wait lets the other threads run.
    pub fn pause(_spins: u32) {
        loom::thread::yield_now();
    }
}

/// Polls of a taken lock before the thread yields between polls.
const SPINS: u32 = 64;
/// Yields before the thread naps between polls (a holder that takes long).
const YIELDS: u32 = SPINS + 100;
/// The nap.
const NAP: std::time::Duration = std::time::Duration::from_micros(50);

/// A value behind a [`SpinLock`]. The flag comes first (`repr(C)`): it
/// shares its cache line with the start of the value, which a user can lay
/// out so that the fields used under the lock sit there too.
#[repr(C)]
pub struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands out access to the value to one thread at a time
// (taken by an acquiring compare-exchange, let go by a releasing store),
// so sharing the lock shares the value only as a Mutex would: `T: Send`
// is enough, as for `std::sync::Mutex`.
unsafe impl<T: Send> Sync for SpinLock<T> {}

/// Access to the value of a taken [`SpinLock`]; lets it go when dropped.
pub struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> SpinLock<T> {
    /// A lock holding `value`.
    pub fn new(value: T) -> SpinLock<T> {
        SpinLock { locked: AtomicBool::new(false), value: UnsafeCell::new(value) }
    }

    /// Takes the lock, waiting for it if another thread holds it.
    #[inline]
    pub fn lock(&self) -> SpinGuard<'_, T> {
        if self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            self.lock_contended();
        }
        SpinGuard { lock: self }
    }

    /// [`lock`](Self::lock) once the first try failed: out of the way of
    /// the usual path.
    #[cold]
    #[inline(never)]
    fn lock_contended(&self) {
        let mut spins = 0u32;
        loop {
            // Wait with plain reads (no locked instruction) until it looks free.
            while self.locked.load(Ordering::Relaxed) {
                pause(spins);
                spins = spins.saturating_add(1);
            }
            if self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return;
            }
        }
    }
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the lock (taken in `lock`, let go only
        // in `drop`), so no other reference to the value exists.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only
        // reference made through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    fn drop(&mut self) {
        // Releasing store: the next holder sees every write made under the lock.
        self.lock.locked.store(false, Ordering::Release);
    }
}

/// A [`SpinLock`] that also guards an object C code reads (a buffer's
/// `struct bulk_buffer`), placed first, before the lock's flag: a user lays
/// the value out so that the fields it changes with the object fill the
/// rest of the object's cache line, and one line then carries all that a
/// thread writes under the lock (another thread that takes it next fetches
/// one line, not two).
///
/// C code is given the object's address ([`c_ptr`](Self::c_ptr)) and only
/// reads it (the interface's contract: library-owned structs are read-only
/// to programs); Rust reads and writes it only through a guard.
#[repr(C)]
pub struct SpinLockWithC<C, T> {
    c: UnsafeCell<C>,
    lock: SpinLock<T>,
}

// SAFETY: Rust reaches `c` only through a guard of `lock`, one thread at a
// time, as `value`; C code only reads it. So sharing the pair shares `c`
// as a Mutex would (its raw pointers are addresses C code reads, which no
// Rust code here dereferences), and `T: Send` is enough for `value`.
unsafe impl<C, T: Send> Sync for SpinLockWithC<C, T> {}
// SAFETY: as above: moving the pair to another thread moves `c` with the
// lock that guards it.
unsafe impl<C, T: Send> Send for SpinLockWithC<C, T> {}

/// Access to the value and the C object of a taken [`SpinLockWithC`]
/// (both let go when dropped).
pub struct GuardWithC<'a, C, T> {
    c: &'a UnsafeCell<C>,
    guard: SpinGuard<'a, T>,
}

impl<C, T> SpinLockWithC<C, T> {
    /// A lock holding `value` and guarding the C object `c`.
    pub fn new(c: C, value: T) -> Self {
        SpinLockWithC { c: UnsafeCell::new(c), lock: SpinLock::new(value) }
    }

    /// The C object's address (for C code, which only reads it).
    pub fn c_ptr(&self) -> *mut C {
        self.c.get()
    }

    /// Takes the lock, waiting for it if another thread holds it.
    #[inline]
    pub fn lock(&self) -> GuardWithC<'_, C, T> {
        GuardWithC { c: &self.c, guard: self.lock.lock() }
    }
}

impl<C, T> GuardWithC<'_, C, T> {
    /// The C object as it is.
    #[inline]
    pub fn c(&self) -> &C {
        // SAFETY: this guard holds the lock, and Rust writes the object only
        // through a guard's `&mut` (`update_c`), which this `&self` borrow
        // excludes: no write overlaps (C code only reads).
        unsafe { &*self.c.get() }
    }

    /// Changes the C object.
    #[inline]
    pub fn update_c(&mut self, f: impl FnOnce(&mut C)) {
        // SAFETY: as in `c`, and `&mut self` makes this the only Rust
        // access made through the guard meanwhile.
        f(unsafe { &mut *self.c.get() })
    }
}

impl<C, T> Deref for GuardWithC<'_, C, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<C, T> DerefMut for GuardWithC<'_, C, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

/// The lock's model: loom runs every interleaving (up to its preemption
/// bound) of threads that take the lock and change a value that loom
/// watches for data races: without the acquiring take or the releasing
/// store, loom finds two threads in the section at once or a write not
/// seen. Run with `.ci/loom.sh`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::SpinLock;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    struct Shared {
        lock: SpinLock<()>,
        count: UnsafeCell<u32>,
    }

    // SAFETY: `count` is only touched with `lock` held (what the model checks).
    unsafe impl Sync for Shared {}

    #[test]
    fn two_threads_take_turns() {
        loom::model(|| {
            let shared = Arc::new(Shared { lock: SpinLock::new(()), count: UnsafeCell::new(0) });
            let other = shared.clone();
            let t = loom::thread::spawn(move || {
                let _g = other.lock.lock();
                // SAFETY: under the lock; loom reports any overlapping access.
                other.count.with_mut(|c| unsafe { *c += 1 });
            });
            {
                let _g = shared.lock.lock();
                // SAFETY: as above.
                shared.count.with_mut(|c| unsafe { *c += 1 });
            }
            t.join().expect("thread");
            let _g = shared.lock.lock();
            // SAFETY: as above.
            assert_eq!(shared.count.with(|c| unsafe { *c }), 2);
        });
    }

    /// A buffer's slot as the allocator's protocol sees it
    /// (`table::PoolEntry::allocator`): the slot's lock, what the slot
    /// holds, and the allocator's liveness word.
    struct AllocSlot {
        lock: SpinLock<()>,
        /// The program owns the buffer (the slot's `owned`).
        owned: UnsafeCell<bool>,
        /// The allocator struct's token; 0 once its free began.
        token: loom::sync::atomic::AtomicUsize,
    }

    // SAFETY: `owned` is only touched with `lock` held (what the model checks).
    unsafe impl Sync for AllocSlot {}

    /// `bulk_alloc_new_buffer` racing `bulk_alloc_free`: the allocation
    /// reads the token under the slot's lock and writes the slot only if
    /// the allocator lives; the free stores 0, then gives back what each
    /// slot holds under its lock. In every interleaving the program owns
    /// nothing once both are done, and the allocation succeeded only if
    /// it came before the free's walk. Reading the token before taking
    /// the slot's lock fails the model (the allocation writes the slot
    /// after the walk passed it).
    #[test]
    fn allocation_racing_free_leaves_nothing_owned() {
        use std::sync::atomic::Ordering;
        loom::model(|| {
            const TOKEN: usize = 7;
            let slot = Arc::new(AllocSlot {
                lock: SpinLock::new(()),
                owned: UnsafeCell::new(false),
                token: loom::sync::atomic::AtomicUsize::new(TOKEN),
            });
            let s = slot.clone();
            let alloc = loom::thread::spawn(move || {
                let _g = s.lock.lock();
                if s.token.load(Ordering::Acquire) != TOKEN {
                    return false;
                }
                // SAFETY: under the slot's lock; loom reports any overlapping access.
                s.owned.with_mut(|o| unsafe { *o = true });
                true
            });
            slot.token.store(0, Ordering::Release);
            let gave_back = {
                let _g = slot.lock.lock();
                // SAFETY: as above.
                slot.owned.with_mut(|o| unsafe { std::mem::replace(&mut *o, false) })
            };
            let allocated = alloc.join().expect("allocating thread");
            let _g = slot.lock.lock();
            // SAFETY: as above.
            assert!(!slot.owned.with(|o| unsafe { *o }), "a buffer handed out after the free gave the buffers back");
            assert_eq!(allocated, gave_back, "an allocation the free did not give back");
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{SpinLock, SpinLockWithC};
    use std::sync::Arc;

    /// The C object sits first, where its address says, and what a guard
    /// writes there is what C code reads; the value beside it is the lock's.
    #[test]
    fn the_c_object_is_first_and_written_through_the_guard() {
        #[repr(C)]
        struct Obj {
            state: u32,
            count: u32,
        }
        let lock = SpinLockWithC::new(Obj { state: 0, count: 0 }, 5u64);
        assert_eq!(lock.c_ptr() as usize, &lock as *const _ as usize);
        {
            let mut g = lock.lock();
            g.update_c(|o| (o.state, o.count) = (3, 1));
            *g += 1;
            assert_eq!((g.c().state, g.c().count, *g), (3, 1, 6));
        }
        // SAFETY: nothing holds the lock, so nothing writes the object: a
        // plain read, as a C program makes.
        let seen = unsafe { (*lock.c_ptr()).state };
        assert_eq!(seen, 3);
    }

    /// Increments from several threads under the lock are none of them lost.
    #[test]
    fn excludes() {
        let lock = Arc::new(SpinLock::new(0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let mut g = lock.lock();
                        let v = *g;
                        std::hint::black_box(&mut *g);
                        *g = v + 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(*lock.lock(), 80_000);
    }

    /// A holder that keeps the lock a while (naps of the waiter) still
    /// hands it over, with its writes.
    #[test]
    fn long_hold() {
        let lock = Arc::new(SpinLock::new(0u32));
        let mut g = lock.lock();
        let l = lock.clone();
        let waiter = std::thread::spawn(move || *l.lock());
        std::thread::sleep(std::time::Duration::from_millis(20));
        *g = 7;
        drop(g);
        assert_eq!(waiter.join().expect("waiter"), 7);
    }

    /// A panic while the lock is held lets it go.
    #[test]
    fn unlocks_on_panic() {
        let lock = Arc::new(SpinLock::new(1u32));
        let l = lock.clone();
        let r = std::thread::spawn(move || {
            let _g = l.lock();
            panic!("held");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(*lock.lock(), 1);
    }
}
