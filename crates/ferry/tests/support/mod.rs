//! Test-only infrastructure shared by integration tests: a fault-injecting
//! TCP proxy and network namespaces joined by a veth pair.
#![allow(dead_code)]

pub mod fault_proxy;
pub mod netns;
