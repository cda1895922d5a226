//! A minimal RESP value model: what a reply looks like after it left the
//! server, without depending on a client library. `Recorder` turns writes
//! into frames, so writers and readers are tested against each other.

use std::fmt;

use super::ReplySink;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Int(i64),
    Bulk(Vec<u8>),
    /// A status reply (`OK`).
    Simple(String),
    Array(Vec<Frame>),
    Null,
}

/// A reply that does not have the documented shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError(String);

impl WireError {
    pub fn new(msg: impl Into<String>) -> Self {
        WireError(msg.into())
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unexpected reply: {}", self.0)
    }
}

impl std::error::Error for WireError {}

impl Frame {
    /// An integer; a bulk string of decimal digits is accepted too (RESP
    /// clients may turn one into the other).
    pub fn int(&self, what: &str) -> Result<i64, WireError> {
        match self {
            Frame::Int(i) => Ok(*i),
            Frame::Bulk(b) => std::str::from_utf8(b)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| WireError::new(format!("{what} is not an integer"))),
            other => Err(WireError::new(format!(
                "{what} is not an integer: {other:?}"
            ))),
        }
    }

    pub fn bytes(&self, what: &str) -> Result<&[u8], WireError> {
        match self {
            Frame::Bulk(b) => Ok(b),
            Frame::Simple(s) => Ok(s.as_bytes()),
            other => Err(WireError::new(format!("{what} is not a string: {other:?}"))),
        }
    }

    /// The string, moved out of the frame.
    pub fn into_bytes(self, what: &str) -> Result<Vec<u8>, WireError> {
        match self {
            Frame::Bulk(b) => Ok(b),
            Frame::Simple(s) => Ok(s.into_bytes()),
            other => Err(WireError::new(format!("{what} is not a string: {other:?}"))),
        }
    }

    pub fn text(&self, what: &str) -> Result<&str, WireError> {
        std::str::from_utf8(self.bytes(what)?)
            .map_err(|_| WireError::new(format!("{what} is not UTF-8")))
    }

    pub fn array(&self, what: &str) -> Result<&[Frame], WireError> {
        match self {
            Frame::Array(items) => Ok(items),
            other => Err(WireError::new(format!("{what} is not an array: {other:?}"))),
        }
    }
}

/// A `ReplySink` that records what is written as frames.
#[derive(Debug, Default)]
pub struct Recorder {
    /// Open arrays: how many elements each still expects, and those so far.
    open: Vec<(usize, Vec<Frame>)>,
    done: Vec<Frame>,
}

impl Recorder {
    /// The complete top-level replies written so far.
    pub fn into_frames(self) -> Vec<Frame> {
        assert!(self.open.is_empty(), "an array was left unfinished");
        self.done
    }

    fn push(&mut self, mut frame: Frame) {
        loop {
            let Some((want, items)) = self.open.last_mut() else {
                self.done.push(frame);
                return;
            };
            items.push(frame);
            if items.len() < *want {
                return;
            }
            let (_, items) = self.open.pop().expect("an open array");
            frame = Frame::Array(items);
        }
    }
}

impl ReplySink for Recorder {
    fn array(&mut self, len: usize) {
        if len == 0 {
            self.push(Frame::Array(Vec::new()));
        } else {
            self.open.push((len, Vec::with_capacity(len)));
        }
    }

    fn int(&mut self, v: i64) {
        self.push(Frame::Int(v));
    }

    fn bulk(&mut self, b: &[u8]) {
        self.push(Frame::Bulk(b.to_vec()));
    }

    fn simple(&mut self, s: &'static std::ffi::CStr) {
        self.push(Frame::Simple(s.to_string_lossy().into_owned()));
    }

    fn null(&mut self) {
        self.push(Frame::Null);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_arrays_close_in_order() {
        let mut r = Recorder::default();
        r.array(3);
        r.int(1);
        r.array(0);
        r.array(1);
        r.bulk(b"x");
        r.null();
        assert_eq!(
            r.into_frames(),
            vec![
                Frame::Array(vec![
                    Frame::Int(1),
                    Frame::Array(vec![]),
                    Frame::Array(vec![Frame::Bulk(b"x".to_vec())]),
                ]),
                Frame::Null
            ]
        );
    }
}
