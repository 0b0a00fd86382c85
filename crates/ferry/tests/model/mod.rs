//! The executable reference model of `docs/SEMANTICS.md`, shared by the
//! model's own tests and the model-based tests of the library.

pub mod reference;

/// Random operation sequences interpreted against the model.
#[allow(dead_code)]
pub mod gen;

/// The library's names for the model's values, shared by the harnesses.
#[allow(dead_code)]
pub mod lib_map;

/// Coverage floors of the suites, met by running more rounds.
#[allow(dead_code)]
pub mod coverage;
