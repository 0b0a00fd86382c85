//! With the `fabric` feature: compile the libfabric shim of the fabric
//! backend (src/backend/fabric/shim.c) and link libfabric.
fn main() {
    println!("cargo:rerun-if-changed=src/backend/fabric/shim.c");
    if std::env::var_os("CARGO_FEATURE_FABRIC").is_some() {
        cc::Build::new().file("src/backend/fabric/shim.c").warnings(true).compile("ferry_fabric_shim");
        println!("cargo:rustc-link-lib=fabric");
    }
}
