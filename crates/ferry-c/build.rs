//! Gives the shared library the soname it is installed under.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libferry.so.0");
    println!("cargo:rerun-if-changed=build.rs");
}
