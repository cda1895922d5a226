//! Pure logic of the idem Redis module: the record, the four-outcome decision,
//! argument parsing, the versioned encoding and the mirror's pending index.
//!
//! Nothing here touches Redis, so it is unit- and property-tested with plain
//! `cargo test`; the module crate is a thin FFI layer on top.

pub mod args;
pub mod codec;
pub mod engine;
pub mod error;
pub mod fingerprint;
pub mod functions;
pub mod pending;
pub mod record;
pub mod token;
pub mod wire;

pub use error::Error;
pub use fingerprint::Fingerprint;
pub use record::{Completed, Header, MirrorState, Record, State};
