//! With the `fabric` feature: compile the libfabric shim of the fabric
//! backend (src/backend/fabric/shim.c). libfabric is not linked: the shim
//! loads it when the first fabric endpoint opens (its headers are needed
//! here, the library only where a fabric endpoint is used).
fn main() {
    println!("cargo:rerun-if-changed=src/backend/fabric/shim.c");
    if std::env::var_os("CARGO_FEATURE_FABRIC").is_some() {
        cc::Build::new().file("src/backend/fabric/shim.c").warnings(true).compile("ferry_fabric_shim");
    }
}
