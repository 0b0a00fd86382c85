//! Ferry's C interface: the bulk-transfer API of the original
//! implementation ([ETH-BT] Listings 6.1–6.13) over the `ferry` crate,
//! built as `libferry.so` and `libferry.a` with the headers in
//! `include/bulk_transfer/`. docs/C-API.md describes the design: what
//! differs from the original interface and why, the thread rules, and who
//! owns which field.
//!
//! Layout: [`ffi`] has the C types, [`codes`] the numbers, `boundary` and
//! `cmem` every unsafe access to C memory, `state` the library's state
//! (safe Rust), [`api`] the exported functions.

#![deny(unsafe_code)]
// Built with `--cfg loom` (`.ci/loom.sh`), only the lock and its model:
// the `ferry` crate leaves its selector and its process backends out of
// that build.
#![cfg_attr(loom, allow(dead_code))]

#[cfg(not(loom))]
pub mod api;
#[cfg(not(loom))]
mod boundary;
#[cfg(not(loom))]
mod closing;
#[cfg(not(loom))]
mod cmem;
#[cfg(not(loom))]
pub mod codes;
#[cfg(not(loom))]
pub mod ffi;
#[cfg(all(test, not(loom)))]
mod layout;
mod lock;
#[cfg(not(loom))]
mod state;
#[cfg(not(loom))]
mod table;
#[cfg(not(loom))]
mod waitset;
