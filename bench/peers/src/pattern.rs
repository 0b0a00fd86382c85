//! A verifiable payload (the pattern of `crates/ferry-cli/src/pattern.rs`):
//! every 8-byte word is a function of a sequence number and its position,
//! so a receiver can check every byte without having seen the sender's copy.
//! Word 0 alone is the message's *tag*: peers that do not touch the payload
//! still write and check it, so a transport that loses, reorders or
//! truncates messages cannot report a fast number.

#[cfg(feature = "iceoryx2")]
use std::mem::MaybeUninit;

const K: u64 = 0x9E37_79B9_7F4A_7C15;

fn word(seq: u64, i: usize) -> u64 {
    (seq.wrapping_mul(K) ^ (i as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)).rotate_left((i % 63) as u32)
}

/// The first word of message `seq`.
pub fn tag(seq: u64) -> [u8; 8] {
    word(seq, 0).to_le_bytes()
}

/// Fill `buf` with the pattern of `seq`.
pub fn fill(buf: &mut [u8], seq: u64) {
    for (i, chunk) in buf.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(seq, i).to_le_bytes());
    }
}

/// Fill not-yet-initialised memory (a loaned iceoryx2 sample) with the pattern of `seq`.
#[cfg(feature = "iceoryx2")]
pub fn fill_uninit(buf: &mut [MaybeUninit<u8>], seq: u64) {
    for (i, chunk) in buf.chunks_exact_mut(8).enumerate() {
        for (d, b) in chunk.iter_mut().zip(word(seq, i).to_le_bytes()) {
            d.write(b);
        }
    }
}

/// Whether `buf` holds exactly the pattern of `seq` (reads every byte).
pub fn check(buf: &[u8], seq: u64) -> bool {
    buf.chunks_exact(8).enumerate().all(|(i, chunk)| chunk == word(seq, i).to_le_bytes())
}

/// Whether `buf` starts with the tag of `seq`.
pub fn check_tag(buf: &[u8], seq: u64) -> bool {
    buf.len() >= 8 && buf[..8] == tag(seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_check() {
        let mut b = vec![0u8; 4096];
        fill(&mut b, 7);
        assert!(check(&b, 7) && check_tag(&b, 7));
        assert!(!check(&b, 8) && !check_tag(&b, 8));
        b[4095] ^= 1;
        assert!(!check(&b, 7));
        assert!(check_tag(&b, 7));
        #[cfg(feature = "iceoryx2")]
        {
            let mut u = vec![MaybeUninit::<u8>::uninit(); 64];
            fill_uninit(&mut u, 3);
            let u: Vec<u8> = u.iter().map(|x| unsafe { x.assume_init() }).collect();
            assert!(check(&u, 3));
        }
    }
}
