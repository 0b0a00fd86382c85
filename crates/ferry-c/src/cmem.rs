//! Memory the library owns and C programs read: the `struct bulk_pool` and
//! `struct bulk_buffer` objects (and a pool's array of buffer pointers).
//! Each lives in a boxed slice that never moves, so its address stays valid
//! for as long as the library keeps the pool.

#![allow(unsafe_code)]

use std::cell::UnsafeCell;

/// A fixed-address array of C-visible objects. After it is made, Rust
/// reaches the objects only through the one [`CRef`] of each, handed out
/// by [`CArray::new`]; C code only reads them.
pub struct CArray<T> {
    cells: Box<[UnsafeCell<T>]>,
}

// SAFETY: the array itself is only asked for addresses after it is made;
// every write goes through an object's single `CRef`, which needs `&mut`.
unsafe impl<T> Send for CArray<T> {}
// SAFETY: as above: shared references only read addresses.
unsafe impl<T> Sync for CArray<T> {}

/// The only Rust handle that writes one object of a [`CArray`]: whoever
/// holds it `&mut` (behind the lock that guards it) may change the object.
pub struct CRef<T> {
    ptr: *mut T,
}

// SAFETY: the object it points to lives as long as its `CArray`, which its
// owner keeps beside it; writes need `&mut self`, so they are exclusive.
unsafe impl<T> Send for CRef<T> {}

impl<T> CRef<T> {
    /// Changes the object.
    pub fn update(&mut self, f: impl FnOnce(&mut T)) {
        // SAFETY: `ptr` points into a live `CArray` (its owner keeps it as
        // long as this handle), this is the object's only `CRef` and we have
        // it `&mut`: no other Rust access overlaps; C code only reads.
        f(unsafe { &mut *self.ptr })
    }
}

impl<T> CArray<T> {
    /// The objects, placed at a fixed address, and the single write handle
    /// of each, by index.
    pub fn new(items: Vec<T>) -> (Self, Vec<CRef<T>>) {
        let cells: Box<[UnsafeCell<T>]> = items.into_iter().map(UnsafeCell::new).collect();
        let refs = cells.iter().map(|c| CRef { ptr: c.get() }).collect();
        (CArray { cells }, refs)
    }

    /// The address of object `i` (given to C code).
    pub fn ptr(&self, i: usize) -> *mut T {
        self.cells[i].get()
    }

    /// The address of the first object.
    pub fn base(&self) -> usize {
        self.cells.as_ptr() as usize
    }
}
