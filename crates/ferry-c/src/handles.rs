//! What the library keeps for a caller-allocated struct (`struct
//! bulk_channel`, `struct bulk_allocator`), found from the token in its
//! `impl_data` with one index and one lock of its own: a call on a channel
//! or an allocator takes no shared directory lock and no thread-local
//! cache. A token is a slot number and the slot's generation; a slot is
//! used again once its struct is destroyed, under a new generation, so an
//! old token (a destroyed struct, or a copy of one) never names the new
//! user. Each slot is checked against the struct's address, so a struct
//! copied elsewhere or never initialized is refused.

use std::sync::{Mutex, MutexGuard, OnceLock};

/// Slots per chunk (chunks are made as needed and never freed).
const CHUNK_BITS: u32 = 8;
const CHUNK: usize = 1 << CHUNK_BITS;
/// Chunks at most: this many structs may be live at once.
const CHUNKS: usize = 1024;
/// Bits of a token that hold the slot number; the generation is above.
const INDEX_BITS: u32 = 24;
const INDEX_MASK: usize = (1 << INDEX_BITS) - 1;
/// Generations wrap within the bits left above the slot number.
const GEN_MASK: usize = usize::MAX >> INDEX_BITS;

/// One slot: its generation, the address of the struct it serves, and
/// what the library keeps for it (`None`: free).
struct Entry<T> {
    generation: usize,
    c_addr: usize,
    value: Option<T>,
}

/// A slot on a cache line of its own: two threads busy with two channels
/// do not take each other's lines.
#[repr(align(64))]
struct Slot<T>(Mutex<Entry<T>>);

/// Slot numbers free for use, and the next never used.
struct Free {
    recycled: Vec<usize>,
    next: usize,
}

/// A table of handles.
pub struct Handles<T> {
    chunks: [OnceLock<Box<[Slot<T>]>>; CHUNKS],
    free: Mutex<Free>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T> Handles<T> {
    /// An empty table.
    pub const fn new() -> Self {
        Handles {
            chunks: [const { OnceLock::new() }; CHUNKS],
            free: Mutex::new(Free { recycled: Vec::new(), next: 0 }),
        }
    }

    fn slot(&self, index: usize) -> Option<&Slot<T>> {
        self.chunks.get(index >> CHUNK_BITS)?.get()?.get(index & (CHUNK - 1))
    }

    /// Keeps `value` for the struct at `c_addr`: its token (never 0), or
    /// `None` when every slot is in use.
    pub fn insert(&self, c_addr: usize, value: T) -> Option<usize> {
        let index = {
            let mut free = lock(&self.free);
            match free.recycled.pop() {
                Some(i) => i,
                None if free.next < CHUNK * CHUNKS => {
                    free.next += 1;
                    free.next - 1
                }
                None => return None,
            }
        };
        let chunk = self.chunks[index >> CHUNK_BITS].get_or_init(|| {
            (0..CHUNK).map(|_| Slot(Mutex::new(Entry { generation: 0, c_addr: 0, value: None }))).collect()
        });
        let mut e = lock(&chunk[index & (CHUNK - 1)].0);
        // Never 0, so that a token is never 0 either.
        e.generation = match (e.generation + 1) & GEN_MASK {
            0 => 1,
            g => g,
        };
        e.c_addr = c_addr;
        e.value = Some(value);
        Some(e.generation << INDEX_BITS | index)
    }

    /// Runs `f` on what is kept for the struct at `c_addr` (any address
    /// with `None`) whose token is `token`, with the slot locked; `None` if
    /// the token names no live struct there.
    pub fn with<R>(&self, token: usize, c_addr: Option<usize>, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        let slot = self.slot(token & INDEX_MASK)?;
        let mut e = lock(&slot.0);
        if e.generation != token >> INDEX_BITS || c_addr.is_some_and(|a| a != e.c_addr) {
            return None;
        }
        e.value.as_mut().map(f)
    }

    /// Takes what is kept for the struct at `c_addr` whose token is
    /// `token`; its slot is free for another struct afterwards.
    pub fn remove(&self, token: usize, c_addr: usize) -> Option<T> {
        let index = token & INDEX_MASK;
        let value = {
            let mut e = lock(&self.slot(index)?.0);
            if e.generation != token >> INDEX_BITS || e.c_addr != c_addr {
                return None;
            }
            e.value.take()?
        };
        lock(&self.free).recycled.push(index);
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_names_its_struct_only_while_it_lives() {
        let h: Handles<u32> = Handles::new();
        let t = h.insert(0x1000, 7).expect("a slot");
        assert_ne!(t, 0);
        assert_eq!(h.with(t, Some(0x1000), |v| *v), Some(7));
        assert_eq!(h.with(t, None, |v| *v), Some(7));
        // A copy of the struct elsewhere, or a made-up token: refused.
        assert_eq!(h.with(t, Some(0x2000), |v| *v), None);
        assert_eq!(h.with(t ^ (1 << INDEX_BITS), Some(0x1000), |v| *v), None);
        assert_eq!(h.with(usize::MAX, None, |v| *v), None);
        assert_eq!(h.remove(t, 0x2000), None);
        assert_eq!(h.remove(t, 0x1000), Some(7));
        assert_eq!(h.remove(t, 0x1000), None);
        assert_eq!(h.with(t, Some(0x1000), |v| *v), None);
        // The slot serves the next struct, under a new token: the old one
        // stays dead even for a struct at the same address.
        let t2 = h.insert(0x1000, 8).expect("a slot");
        assert_eq!(t2 & INDEX_MASK, t & INDEX_MASK);
        assert_ne!(t2, t);
        assert_eq!(h.with(t, Some(0x1000), |v| *v), None);
        assert_eq!(h.with(t2, Some(0x1000), |v| *v), Some(8));
    }
}
