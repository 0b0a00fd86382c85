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

pub mod api;
mod boundary;
mod cmem;
pub mod codes;
pub mod ffi;
#[cfg(test)]
mod layout;
mod lock;
mod state;
mod table;
mod waitset;
