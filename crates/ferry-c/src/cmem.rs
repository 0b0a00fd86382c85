//! Memory the library owns and C programs read: the `struct bulk_pool` and
//! `struct bulk_buffer` objects (and a pool's array of buffer pointers).
//! Each lives in a boxed slice that never moves, so its address stays valid
//! for as long as the library keeps the pool.

#![allow(unsafe_code)]

use std::cell::UnsafeCell;

/// A fixed-address array of C-visible objects. The library changes them
/// only while it holds its registry lock; C code reads them through raw
/// pointers (and, per the interface's thread rules, not while a call that
/// changes them runs on another thread).
pub struct CArray<T> {
    cells: Box<[UnsafeCell<T>]>,
}

// SAFETY: the objects hold raw pointers into other library-owned objects
// (or the pool mapping), never thread-bound data; every Rust access goes
// through the registry's mutex.
unsafe impl<T> Send for CArray<T> {}

impl<T> CArray<T> {
    /// The objects, placed at a fixed address.
    pub fn new(items: Vec<T>) -> Self {
        CArray { cells: items.into_iter().map(UnsafeCell::new).collect() }
    }

    /// The address of object `i` (given to C code).
    pub fn ptr(&self, i: usize) -> *mut T {
        self.cells[i].get()
    }

    /// The address of the first object.
    pub fn base(&self) -> usize {
        self.cells.as_ptr() as usize
    }

    /// How many objects there are.
    pub fn len(&self) -> usize {
        self.cells.len()
    }

    /// Reads object `i`.
    pub fn read<R>(&self, i: usize, f: impl FnOnce(&T) -> R) -> R {
        // SAFETY: the library writes the objects only through `update`,
        // which needs `&mut self`; C code never writes them (they are
        // read-only to the program), so no write overlaps this read.
        f(unsafe { &*self.cells[i].get() })
    }

    /// Changes object `i`.
    pub fn update(&mut self, i: usize, f: impl FnOnce(&mut T)) {
        // `&mut self` comes from under the registry lock: no other Rust
        // reference to the object exists; C code only reads it.
        f(self.cells[i].get_mut())
    }
}
