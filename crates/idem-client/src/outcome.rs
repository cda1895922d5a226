//! What `IDEM.BEGIN` decided, and the stored response a replay hands back.

use std::time::Duration;

use bytes::Bytes;

/// The module's decision for one `IDEM.BEGIN`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// No record (or a takeover of a lapsed lease): the caller now holds the
    /// key with `token` and must `complete` or `abort` it.
    New {
        /// The fencing token of this holder.
        token: u64,
    },
    /// Another holder's lease is alive; try again after `retry_after`.
    InFlight {
        /// The holder's remaining lease.
        retry_after: Duration,
    },
    /// The key was completed before: answer with the stored response.
    Replay(StoredResponse),
    /// The key exists with another request fingerprint.
    Mismatch,
}

/// A response as stored by `IDEM.COMPLETE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status, 100..=599.
    pub status: u16,
    /// The response body.
    pub body: Bytes,
    /// `(name, value)` pairs in the order they were stored; names may repeat.
    pub headers: Vec<(String, Bytes)>,
}

impl StoredResponse {
    /// A response without headers.
    pub fn new(status: u16, body: impl Into<Bytes>) -> Self {
        StoredResponse {
            status,
            body: body.into(),
            headers: Vec::new(),
        }
    }

    /// Adds a header after those already there.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// What `IDEM.COMPLETE` sends of a response: a [`StoredResponse`], or a
/// view of a handler's response that reads its stored headers in place
/// (the middleware's), so the usual COMPLETE copies nothing.
pub(crate) trait ResponseParts: Sync {
    fn status(&self) -> u16;
    fn body(&self) -> &[u8];
    /// `(name, value)` in the order they are stored.
    fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> + Clone + Sync + '_;
    /// An owned copy, for what outlives the view (a retry in the background).
    #[cfg(feature = "middleware")]
    fn to_stored(&self) -> StoredResponse;
}

impl ResponseParts for StoredResponse {
    fn status(&self) -> u16 {
        self.status
    }

    fn body(&self) -> &[u8] {
        &self.body
    }

    fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> + Clone + Sync + '_ {
        self.headers
            .iter()
            .map(|(name, value)| (name.as_bytes(), value.as_ref()))
    }

    #[cfg(feature = "middleware")]
    fn to_stored(&self) -> StoredResponse {
        self.clone()
    }
}

/// Options of one `IDEM.BEGIN`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BeginOptions {
    /// How long the key lives (whole seconds, at least 1).
    pub ttl: Duration,
    /// The holder's lease; `None` uses the module's `lease-ms` config.
    pub lease: Option<Duration>,
    /// Instead of answering `in_flight`, wait up to this long for the holder's
    /// answer (`WAIT ms`). Needs dedicated wait connections.
    pub wait: Option<Duration>,
}

impl BeginOptions {
    /// Options with this ttl, the module's lease and no wait.
    pub fn new(ttl: Duration) -> Self {
        BeginOptions {
            ttl,
            lease: None,
            wait: None,
        }
    }

    /// Sets the holder's lease (`LEASE ms`).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Sets the wait (`WAIT ms`).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }
}

/// Whether a `complete` stores a response that came from the Postgres mirror
/// (`MIRRORED`: the writer must not mirror it again).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Produced by the handler: the writer mirrors it to Postgres.
    Handler,
    /// Read from Postgres (read-through, the fence): stored `MIRRORED`.
    Mirror,
}
