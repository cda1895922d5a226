//! The module's command names, spelled once: the module registers them, the
//! encoders and the in-memory store use them.

pub const BEGIN: &str = "IDEM.BEGIN";
pub const COMPLETE: &str = "IDEM.COMPLETE";
pub const ABORT: &str = "IDEM.ABORT";
pub const TOUCH: &str = "IDEM.TOUCH";
pub const GET: &str = "IDEM.GET";
/// Internal: the effect a primary replicates (never sent by clients).
pub const PUT: &str = "IDEM._PUT";
pub const MIRROR_PULL: &str = "IDEM.MIRROR.PULL";
pub const MIRROR_ACK: &str = "IDEM.MIRROR.ACK";
