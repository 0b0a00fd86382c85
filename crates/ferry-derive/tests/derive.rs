//! The derives as a crate using Ferry writes them: through `ferry::` only.
//! This crate has no bytemuck dependency; the expansion names the traits
//! through `ferry::bytemuck`.

use ferry::{Allocator, Domain, ErrorKind, PoolConstraints};

#[derive(Clone, Copy, Debug, PartialEq, ferry::Pod, ferry::Zeroable)]
#[repr(C)]
struct Record {
    id: u64,
    values: [f32; 4],
    tag: [u8; 8],
}

#[derive(Clone, Copy, Debug, PartialEq, ferry::Pod, ferry::Zeroable)]
#[repr(transparent)]
struct Meters(f64);

#[derive(Clone, Copy, ferry::Pod, ferry::Zeroable)]
#[repr(C, packed)]
struct Packed {
    a: u8,
    b: u32,
}

#[derive(Clone, Copy, ferry::Zeroable)]
struct Wrapper<T> {
    inner: T,
    count: u16,
}

/// The traits hold: bytemuck's casts work on the derived types, and a
/// zeroed value is all zeros.
#[test]
fn derived_types_are_plain_old_data() {
    let r = Record { id: 0x0102_0304_0506_0708, values: [1.0, 2.0, 3.0, 4.0], tag: *b"abcdefgh" };
    let bytes: &[u8] = ferry::bytemuck::bytes_of(&r);
    assert_eq!(bytes.len(), 32);
    assert_eq!(&bytes[..8], &r.id.to_ne_bytes());
    assert_eq!(&bytes[24..], b"abcdefgh");
    assert_eq!(*ferry::bytemuck::from_bytes::<Record>(bytes), r);
    let z: Record = ferry::Zeroable::zeroed();
    assert_eq!(z, Record { id: 0, values: [0.0; 4], tag: [0; 8] });
    assert_eq!(ferry::bytemuck::cast::<u64, Meters>(2.5f64.to_bits()), Meters(2.5));
    assert_eq!(std::mem::size_of::<Packed>(), 5);
    let p: Packed = ferry::bytemuck::cast([7u8, 1, 0, 0, 0]);
    assert_eq!((p.a, { p.b }), (7, u32::from_ne_bytes([1, 0, 0, 0])));
    let w: Wrapper<u32> = ferry::Zeroable::zeroed();
    assert_eq!((w.inner, w.count), (0, 0));
}

/// A struct of the application's own, viewed in buffer memory: written
/// through one view, read through another and as bytes; bounds and
/// alignment give typed errors.
#[test]
fn user_structs_view_buffer_memory() {
    let alloc = Allocator::new(&Domain::new("d"), 1, 4096, PoolConstraints::default()).unwrap();
    let mut buf = alloc.alloc().unwrap();
    let r = Record { id: 42, values: [0.5; 4], tag: *b"ferry!!!" };
    *buf.view_mut::<Record>(64).unwrap() = r;
    assert_eq!(*buf.view::<Record>(64).unwrap(), r);
    assert_eq!(&buf[88..96], b"ferry!!!");
    assert_eq!(buf.slice_of::<Record>(64, 1).unwrap(), &[r], "the same bytes as the slice view");
    assert_eq!(buf.view::<Meters>(4088).unwrap(), &Meters(0.0));
    for (offset, why) in [
        (4, "the offset is not aligned for the type"),
        (4072, "the range leaves the buffer"),
        (usize::MAX, "the range leaves the buffer"),
    ] {
        match buf.view::<Record>(offset).map_err(|e| e.kind().clone()) {
            Err(ErrorKind::BadView(m)) => assert_eq!((m.offset, m.why), (offset, why)),
            other => panic!("offset {offset}: {other:?}"),
        }
    }
    assert!(matches!(buf.view_mut::<Record>(4).map_err(|e| e.kind().clone()), Err(ErrorKind::BadView(_))));
}
