//! A verifiable payload: every 8-byte word is a function of a sequence
//! number and its position, so a receiver can check every byte without
//! having seen the sender's copy.

const K: u64 = 0x9E37_79B9_7F4A_7C15;

fn word(seq: u64, i: usize) -> u64 {
    (seq.wrapping_mul(K) ^ (i as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)).rotate_left((i % 63) as u32)
}

/// The sequence number a sender put in the first 8 bytes of the meta data.
pub fn seq_of(meta: &[u8]) -> Option<u64> {
    meta.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes)
}

/// Fill `buf` with the pattern of `seq`.
pub fn fill(buf: &mut [u8], seq: u64) {
    for (i, chunk) in buf.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(seq, i).to_le_bytes());
    }
}

/// Whether `buf` holds exactly the pattern of `seq`.
pub fn check(buf: &[u8], seq: u64) -> bool {
    buf.chunks_exact(8).enumerate().all(|(i, chunk)| chunk == word(seq, i).to_le_bytes())
}

/// Read every byte (what a consumer that uses its data costs).
pub fn touch(buf: &[u8]) -> u64 {
    buf.chunks_exact(8).fold(0u64, |acc, c| acc.wrapping_add(u64::from_le_bytes(c.try_into().expect("8 bytes"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_check() {
        let mut b = vec![0u8; 4096];
        fill(&mut b, 7);
        assert!(check(&b, 7));
        assert!(!check(&b, 8));
        b[4095] ^= 1;
        assert!(!check(&b, 7));
    }
}
