//! Test-only infrastructure shared by integration tests: a fault-injecting
//! TCP proxy, network namespaces joined by a veth pair, and the payload
//! pattern and child-process helpers of the multi-process tests.
#![allow(dead_code)]

pub mod fault_proxy;
pub mod netns;
pub mod payload;
