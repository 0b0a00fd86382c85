//! Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`). Each
//! feeds bytes a peer could send to one of our decoders; none may panic.

use std::sync::Arc;

use crate::proto::{self, Message};
use crate::ring::{self, RingLayout, RingMemory};

/// One descriptor slot from a peer: decoding must not panic, and whatever
/// decodes must encode back to something that decodes to the same message.
pub fn decode_slot(data: &[u8]) {
    let Some((&meta, slot)) = data.split_first() else { return };
    let meta_size = usize::from(meta) % (proto::MAX_META_SIZE + 1);
    if let Ok(msg) = Message::decode(slot, meta_size) {
        let mut again = vec![0u8; proto::slot_size(meta_size) as usize];
        msg.encode(&mut again);
        assert_eq!(Message::decode(&again, meta_size).as_ref(), Ok(&msg), "codec is not symmetric");
    }
}

/// A ring segment written by a hostile peer: attaching and draining it must
/// end in messages or typed errors, never a panic or an endless loop.
pub fn ring_from_peer(data: &[u8]) {
    let Some((&knobs, bytes)) = data.split_first() else { return };
    let layout = RingLayout::new(4 << (knobs % 4), 64 << (knobs / 4 % 3)).expect("valid layout");
    let region = ring::region_written_by_peer(layout, bytes, knobs & 0x80 == 0);
    let mem: Arc<dyn RingMemory> = region;
    // The producer end of the same garbage: staging and publishing in
    // batches (the tail it reads is the peer's) ends in Full or an error.
    if let Ok(mut producer) = ring::attach_producer(mem.clone(), layout) {
        for i in 0..=2 * layout.capacity() + 1 {
            match producer.stage(|slot| Message::Teardown.encode(slot)) {
                Ok(()) if i % 3 == 0 => {
                    let _ = producer.publish();
                }
                Ok(()) => {}
                Err(_) => break,
            }
        }
        assert!(producer.staged() <= layout.capacity());
        let _ = producer.publish();
    }
    let Ok(mut consumer) = ring::attach_consumer(mem, layout) else { return };
    for _ in 0..=layout.capacity() + 1 {
        match consumer.try_pop(|slot| Message::decode(slot, 16).is_ok()) {
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
}
