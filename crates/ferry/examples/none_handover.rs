//! The two ways to hand a buffer over at trust NONE between processes,
//! measured side by side per buffer size (is there a size where sealing wins?):
//!
//! - **copy** (what the shared-memory backend does): the sender writes the
//!   payload into its pool buffer (resident, reused), the receiver copies it
//!   from its read-only mapping of the sender's memory into its own buffer;
//! - **seal** (kernel-proven ownership transfer): the sender writes the
//!   payload into a fresh memfd (a sealed file can never be written again,
//!   so each transfer needs a new one), unmaps it, seals it with
//!   `F_SEAL_WRITE`, passes the fd over a Unix socket; the receiver maps it
//!   read-only.
//!
//! Both include the sender's write and the receiver touching every page,
//! so they compare what an application pays per transfer. One thread does
//! both sides (the costs are syscalls, page faults and copies, not the
//! crossing). Run: `cargo run --release -p ferry --example none_handover`.

use std::io::IoSlice;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Instant;

use rustix::fs::{fcntl_add_seals, ftruncate, memfd_create, MemfdFlags, SealFlags};
use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};
use rustix::net::{
    recvmsg, sendmsg, socketpair, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};

const PAGE: usize = 4096;

fn map(fd: &OwnedFd, len: usize, prot: ProtFlags) -> *mut u8 {
    // SAFETY: a fresh shared mapping at a kernel-chosen address.
    unsafe { mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, 0).expect("mmap").cast() }
}

fn touch_pages(p: *const u8, len: usize) -> u64 {
    // SAFETY: p points at `len` mapped readable bytes.
    (0..len).step_by(PAGE).map(|i| u64::from(unsafe { p.add(i).read_volatile() })).sum()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Copy variant: µs per transfer.
fn copy_variant(size: usize, iters: usize) -> f64 {
    let src_fd = memfd_create("src", MemfdFlags::CLOEXEC).unwrap();
    ftruncate(&src_fd, size as u64).unwrap();
    let dst_fd = memfd_create("dst", MemfdFlags::CLOEXEC).unwrap();
    ftruncate(&dst_fd, size as u64).unwrap();
    let src = map(&src_fd, size, ProtFlags::READ | ProtFlags::WRITE);
    let dst = map(&dst_fd, size, ProtFlags::READ | ProtFlags::WRITE);
    let mut samples = Vec::with_capacity(iters);
    let mut sink = 0u64;
    for i in 0..=iters {
        let t = Instant::now();
        // SAFETY: both mappings are `size` bytes, ours, and distinct.
        unsafe {
            std::ptr::write_bytes(src, i as u8, size);
            std::ptr::copy_nonoverlapping(src, dst, size);
        }
        sink += touch_pages(dst, size);
        if i > 0 {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    std::hint::black_box(sink);
    // SAFETY: our own mappings, no longer used.
    unsafe {
        munmap(src.cast(), size).unwrap();
        munmap(dst.cast(), size).unwrap();
    }
    median(samples)
}

/// Seal variant: µs per transfer.
fn seal_variant(size: usize, iters: usize) -> f64 {
    let (a, b) = socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap();
    let mut samples = Vec::with_capacity(iters);
    let mut sink = 0u64;
    for i in 0..=iters {
        let t = Instant::now();
        let fd = memfd_create("buf", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        ftruncate(&fd, size as u64).unwrap();
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
        let w = map(&fd, size, ProtFlags::READ | ProtFlags::WRITE);
        // SAFETY: our own fresh mapping of `size` bytes.
        unsafe {
            std::ptr::write_bytes(w, i as u8, size);
            munmap(w.cast(), size).unwrap();
        }
        // EBUSY while pages freshly written through a mapping still hold
        // extra references (the kernel's per-CPU page batches); it clears
        // once those drain: retry, and count it in the cost.
        loop {
            match fcntl_add_seals(&fd, SealFlags::WRITE) {
                Ok(()) => break,
                Err(rustix::io::Errno::BUSY) => std::thread::yield_now(),
                Err(e) => panic!("F_SEAL_WRITE: {e}"),
            }
        }
        let fds = [fd.as_fd()];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut anc = SendAncillaryBuffer::new(&mut space);
        assert!(anc.push(SendAncillaryMessage::ScmRights(&fds)));
        sendmsg(&a, &[IoSlice::new(&[1])], &mut anc, SendFlags::empty()).unwrap();
        drop(fd);
        let mut byte = [0u8; 1];
        let mut rspace = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut ranc = RecvAncillaryBuffer::new(&mut rspace);
        recvmsg(&b, &mut [std::io::IoSliceMut::new(&mut byte)], &mut ranc, RecvFlags::empty()).unwrap();
        let got: OwnedFd = ranc
            .drain()
            .find_map(|m| match m {
                RecvAncillaryMessage::ScmRights(mut fds) => fds.next(),
                _ => None,
            })
            .expect("fd");
        let r = map(&got, size, ProtFlags::READ);
        sink += touch_pages(r, size);
        // SAFETY: our own mapping, no longer used.
        unsafe { munmap(r.cast(), size).unwrap() };
        if i > 0 {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    std::hint::black_box(sink);
    median(samples)
}

fn main() {
    println!("| buffer | copy µs/transfer | seal µs/transfer | seal / copy |");
    println!("|---|---:|---:|---:|");
    let mut crossover = None;
    for shift in [12, 14, 16, 18, 20, 22] {
        let size = 1usize << shift;
        let iters = if size >= 1 << 20 { 200 } else { 2000 };
        // Alternate to share the machine's noise.
        let (mut c, mut s) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            c.push(copy_variant(size, iters));
            s.push(seal_variant(size, iters));
        }
        let (c, s) = (median(c), median(s));
        if s < c && crossover.is_none() {
            crossover = Some(size);
        }
        println!("| {} KiB | {c:.2} | {s:.2} | {:.1} |", size >> 10, s / c);
    }
    match crossover {
        Some(size) => println!("\nseal is cheaper from {} KiB up", size >> 10),
        None => println!("\nno crossover up to 4 MiB: the copy is cheaper at every size"),
    }
}
