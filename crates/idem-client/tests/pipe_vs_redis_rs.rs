//! The Pipe's hand-written RESP parser (`src/pipe/resp.rs`, compiled here
//! from its own file) held to redis-rs' parser, which it replaces on the
//! Pipe: on random RESP2 and RESP3 replies, pipelined several to a stream
//! and fed in random byte splits, on random corruptions of them, and at the
//! nesting limit. Wherever both read a reply they read the same `Value`;
//! where redis-rs refuses bytes the Pipe's parser never reads a value from
//! them. The differences allowed are the parser's by design: it reads RESP2
//! only (the Pipe never asks for RESP3, so a RESP3 type byte is a broken
//! stream); it refuses a bulk length over Redis' 512 MiB at once, where
//! redis-rs waits for the bytes; and it judges an element once its bytes
//! are all there, so it may wait for them where redis-rs refuses at the
//! first wrong byte (`difference_allowed`). Plus one off-by-one at the
//! nesting limit (`nesting_is_limited_where_redis_rs_limits_it`).

#[allow(dead_code)]
#[path = "../src/pipe/resp.rs"]
mod resp;

use std::io::{Cursor, Read};

use proptest::prelude::*;
use redis::Value;

/// What reading a whole stream gave: the replies read, then how it ended.
#[derive(Debug, Clone, PartialEq)]
enum Read_ {
    /// Every byte read into replies.
    Whole(Vec<Value>),
    /// The replies read, then a reply the stream holds only part of.
    Partial(Vec<Value>),
    /// The replies read, then bytes refused.
    Refused(Vec<Value>),
}

impl Read_ {
    fn values(&self) -> &[Value] {
        match self {
            Read_::Whole(v) | Read_::Partial(v) | Read_::Refused(v) => v,
        }
    }
}

/// The stream through the Pipe's parser, fed in pieces cut at `cuts` as its
/// connection reads them (what a read leaves unconsumed stays in the
/// buffer). The pieces must read the same replies as the one-shot reader
/// over the whole stream, and refuse where it refuses; its reading is the
/// answer.
fn ours(stream: &[u8], cuts: &[usize]) -> Read_ {
    let mut parser = resp::Parser::default();
    let (mut buf, mut got, mut refused) = (Vec::new(), Vec::new(), false);
    let mut from = 0;
    'feed: for &to in cuts.iter().chain(std::iter::once(&stream.len())) {
        buf.extend_from_slice(&stream[from..to]);
        from = to;
        let mut at = 0;
        loop {
            match parser.next(&buf, &mut at) {
                Ok(Some(value)) => got.push(value),
                Ok(None) => break,
                Err(_) => {
                    refused = true;
                    break 'feed;
                }
            }
        }
        buf.drain(..at);
    }
    let whole = ours_whole(stream);
    assert_eq!(got, whole.values(), "in pieces at {cuts:?}");
    assert_eq!(
        refused,
        matches!(whole, Read_::Refused(_)),
        "in pieces at {cuts:?}"
    );
    whole
}

/// The stream through the one-shot reader, reply after reply.
fn ours_whole(stream: &[u8]) -> Read_ {
    let (mut at, mut got) = (0, Vec::new());
    while at < stream.len() {
        match resp::parse(&stream[at..]) {
            Ok(Some((value, used))) => {
                got.push(value);
                at += used;
            }
            Ok(None) => return Read_::Partial(got),
            Err(_) => return Read_::Refused(got),
        }
    }
    Read_::Whole(got)
}

/// A reader that hands out `data` in the pieces cut at `cuts`.
struct Pieces<'a> {
    data: &'a [u8],
    at: usize,
    cuts: Vec<usize>,
}

impl Read for Pieces<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let end = self
            .cuts
            .iter()
            .copied()
            .find(|&c| c > self.at)
            .unwrap_or(self.data.len());
        let n = (end - self.at).min(out.len());
        out[..n].copy_from_slice(&self.data[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// The stream through redis-rs' parser, read from a reader that returns the
/// same pieces.
fn theirs(stream: &[u8], cuts: &[usize], replies: usize) -> Read_ {
    let mut parser = redis::Parser::new();
    let mut reader = Pieces {
        data: stream,
        at: 0,
        cuts: cuts.to_vec(),
    };
    let mut got = Vec::new();
    for _ in 0..replies {
        match parser.parse_value(&mut reader) {
            Ok(value) => got.push(value),
            // The stream ended inside a reply.
            Err(e) if e.is_io_error() => return Read_::Partial(got),
            Err(_) => return Read_::Refused(got),
        }
    }
    Read_::Whole(got)
}

/// redis-rs reading `stream` whole, as many replies as it has. Its parser
/// reads ahead of the reply it returns, so the reader's position does not
/// tell whether a reply is left half read: a stream is whole when a
/// sentinel reply appended to it is read as itself, after the same replies.
fn theirs_whole(stream: &[u8]) -> Read_ {
    let read_all = |bytes: &[u8]| {
        let mut parser = redis::Parser::new();
        let mut reader = Cursor::new(bytes);
        let mut got = Vec::new();
        loop {
            match parser.parse_value(&mut reader) {
                Ok(value) => got.push(value),
                Err(e) => return (got, e.is_io_error()),
            }
        }
    };
    let (got, ended) = read_all(stream);
    if !ended {
        return Read_::Refused(got);
    }
    let sentinel = Value::SimpleString("\u{1}sentinel".into());
    let (with_sentinel, _) = read_all(&[stream, b"+\x01sentinel\r\n"].concat());
    if with_sentinel.len() == got.len() + 1
        && with_sentinel[..got.len()] == got[..]
        && with_sentinel[got.len()] == sentinel
    {
        Read_::Whole(got)
    } else {
        Read_::Partial(got)
    }
}

// ---- generators: RESP replies as bytes ----

/// Text of a simple string or error line: any UTF-8 but CRLF (a lone CR or
/// LF included), mostly ASCII. (Lines that are not UTF-8 are malformed:
/// `malformed_replies_are_refused_by_both`.)
fn line_text() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => "[ -~\r\n]{0,24}".prop_map(|s| s.into_bytes()),
        1 => "(?s).{0,12}".prop_map(|s| s.into_bytes()),
    ]
    .prop_filter("no CRLF inside a line", |b| {
        !b.windows(2).any(|w| w == b"\r\n")
    })
    // A line that ends in CR would run into the terminator's CRLF.
    .prop_map(|mut b| {
        if b.last() == Some(&b'\r') {
            b.pop();
        }
        b
    })
}

/// Error lines as servers send them: module codes, cluster redirections,
/// redis' own, and anything.
fn error_line() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(b"ERR unknown command 'IDEM.X'".to_vec()),
        Just(b"STALE token 3 no longer holds the key".to_vec()),
        Just(b"MISMATCH the key was used with another request".to_vec()),
        Just(b"MOVED 3999 127.0.0.1:6381".to_vec()),
        Just(b"ASK 3999 127.0.0.1:6381".to_vec()),
        Just(b"TRYAGAIN Multiple keys request during rehashing of slot".to_vec()),
        Just(b"CLUSTERDOWN The cluster is down".to_vec()),
        Just(b"OOM command not allowed when used memory > 'maxmemory'.".to_vec()),
        Just(b"READONLY You can't write against a read only replica.".to_vec()),
        Just(b"NOSCRIPT No matching script".to_vec()),
        Just(b"LOADING Redis is loading the dataset in memory".to_vec()),
        Just(b"BUSY Redis is busy running a script".to_vec()),
        Just(b"WRONGTYPE Operation against a key holding the wrong kind of value".to_vec()),
        Just(b"NOPERM this user has no permissions".to_vec()),
        Just(b"".to_vec()),
        line_text(),
    ]
}

/// An integer line's text: numbers, with the spaces both parsers trim.
fn int_text() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => any::<i64>().prop_map(|n| n.to_string()),
        2 => (-3i64..200).prop_map(|n| n.to_string()),
        1 => (-3i64..200).prop_map(|n| format!(" {n} ")),
        1 => (0i64..200).prop_map(|n| format!("+{n}")),
    ]
}

/// One RESP2 reply.
fn resp2() -> impl Strategy<Value = Vec<u8>> {
    let leaf = prop_oneof![
        line_text().prop_map(|t| [b"+".as_slice(), &t, b"\r\n"].concat()),
        Just(b"+OK\r\n".to_vec()),
        error_line().prop_map(|t| [b"-".as_slice(), &t, b"\r\n"].concat()),
        int_text().prop_map(|t| format!(":{t}\r\n").into_bytes()),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(|b| [
            format!("${}\r\n", b.len()).as_bytes(),
            &b,
            b"\r\n"
        ]
        .concat()),
        // Bulk strings that hold CRLF, or look like replies.
        Just(b"$4\r\n\r\n\r\n\r\n".to_vec()),
        Just(b"$5\r\n+OK\r\n\r\n".to_vec()),
        (-5i64..0).prop_map(|n| format!("${n}\r\n").into_bytes()),
        (-5i64..0).prop_map(|n| format!("*{n}\r\n").into_bytes()),
    ];
    leaf.prop_recursive(6, 64, 8, |inner| {
        proptest::collection::vec(inner, 0..8).prop_map(|items| {
            let mut out = format!("*{}\r\n", items.len()).into_bytes();
            for item in items {
                out.extend_from_slice(&item);
            }
            out
        })
    })
}

/// A RESP3-only element (redis-rs reads them; the Pipe's parser must not).
fn resp3_only() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(b"_\r\n".to_vec()),
        Just(b",3.25\r\n".to_vec()),
        Just(b",-inf\r\n".to_vec()),
        Just(b"#t\r\n".to_vec()),
        Just(b"#f\r\n".to_vec()),
        Just(b"(3492890328409238509324850943850943825024385\r\n".to_vec()),
        Just(b"=15\r\ntxt:Some string\r\n".to_vec()),
        Just(b"!21\r\nSYNTAX invalid syntax\r\n".to_vec()),
        Just(b"%1\r\n+key\r\n:1\r\n".to_vec()),
        Just(b"~2\r\n:1\r\n:2\r\n".to_vec()),
        Just(b">2\r\n+message\r\n$2\r\nhi\r\n".to_vec()),
        Just(b"|1\r\n+ttl\r\n:3\r\n:7\r\n".to_vec()),
    ]
}

/// A reply holding a RESP3 element somewhere inside RESP2 arrays.
fn with_resp3() -> impl Strategy<Value = Vec<u8>> {
    (
        proptest::collection::vec(resp2(), 0..3),
        resp3_only(),
        proptest::collection::vec(resp2(), 0..3),
        0usize..3,
    )
        .prop_map(|(before, odd, after, depth)| {
            let mut body = Vec::new();
            for item in &before {
                body.extend_from_slice(item);
            }
            body.extend_from_slice(&odd);
            for item in &after {
                body.extend_from_slice(item);
            }
            let mut reply = format!("*{}\r\n", before.len() + 1 + after.len()).into_bytes();
            reply.extend_from_slice(&body);
            for _ in 0..depth {
                reply = [b"*1\r\n".as_slice(), &reply].concat();
            }
            reply
        })
}

/// Sorted cut points inside a stream of `len` bytes.
fn cuts(len: usize, raw: Vec<usize>) -> Vec<usize> {
    let mut cuts: Vec<usize> = raw.into_iter().map(|c| c % len.max(1)).collect();
    cuts.sort_unstable();
    cuts.dedup();
    cuts.retain(|&c| c > 0);
    cuts
}

fn stream_of(replies: &[Vec<u8>]) -> Vec<u8> {
    replies.concat()
}

/// Types both parsers know, and what only redis-rs reads.
const RESP2_TYPES: &[u8] = b"+-:$*";
const RESP3_TYPES: &[u8] = b"_,#(=!%~>|";

/// Whether the two readings `ours` and `theirs` of `stream` differ only as
/// documented:
/// - the Pipe's parser judges an element once all its bytes are there (a
///   line up to its CRLF, a bulk string and its CRLF), where redis-rs
///   refuses at the first wrong byte: it may wait where redis-rs refused,
///   and refuses once the rest arrives;
/// - a RESP3 type byte: redis-rs reads it, the Pipe's parser refuses it;
/// - a bulk length over 512 MiB: refused at once, where redis-rs waits.
///
/// The last two are found by walking the stream's elements as the Pipe's
/// parser does, up to the first it cannot read as RESP2.
fn difference_allowed(stream: &[u8], ours: &Read_, theirs: &Read_) -> bool {
    if matches!((ours, theirs), (Read_::Partial(_), Read_::Refused(_))) {
        return true;
    }
    let (mut at, mut open) = (0, Vec::new());
    loop {
        let Some(&kind) = stream.get(at) else {
            return false;
        };
        if RESP3_TYPES.contains(&kind) {
            return true;
        }
        // The element's line starts after its type byte.
        let Some(end) = stream[at + 1..].windows(2).position(|w| w == b"\r\n") else {
            return false;
        };
        if !RESP2_TYPES.contains(&kind) {
            return false;
        }
        let line = &stream[at + 1..at + 1 + end];
        let number = std::str::from_utf8(line)
            .ok()
            .and_then(|t| t.trim().parse::<i64>().ok());
        at += 1 + end + 2;
        match (kind, number) {
            (b'$', Some(n)) if n > 512 * 1024 * 1024 => {
                return matches!(ours, Read_::Refused(_)) && matches!(theirs, Read_::Partial(_))
            }
            (b'$', Some(n)) if n >= 0 => at += n as usize + 2,
            (b'*', Some(n)) if n > 0 => {
                open.push(n as usize);
                continue;
            }
            (b'$' | b'*' | b':', None) => return false,
            _ => {}
        }
        while let Some(left) = open.last_mut() {
            *left -= 1;
            if *left > 0 {
                break;
            }
            open.pop();
        }
    }
}

/// Whether a line of `stream` that starts an error reply (`-`) is not
/// UTF-8 (a bulk string's bytes may be taken for one: that only skips a
/// comparison).
fn non_utf8_error_line(stream: &[u8]) -> bool {
    (0..stream.len()).any(|at| {
        let starts_line = at == 0 || stream[..at].ends_with(b"\r\n");
        if !starts_line || stream[at] != b'-' {
            return false;
        }
        let rest = &stream[at + 1..];
        let end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .unwrap_or(rest.len());
        std::str::from_utf8(&rest[..end]).is_err()
    })
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 2_000,
        // Failures are reported with the smallest stream found; no files.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    /// Pipelined RESP2 replies in random pieces: both read the same values,
    /// and the same as redis-rs reading the stream whole.
    #[test]
    fn resp2_replies_in_any_pieces_read_as_redis_rs_reads_them(
        replies in proptest::collection::vec(resp2(), 1..6),
        raw_cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let stream = stream_of(&replies);
        let cuts = cuts(stream.len(), raw_cuts);
        let whole = theirs_whole(&stream);
        prop_assert!(matches!(whole, Read_::Whole(_)), "redis-rs: {whole:?}");
        prop_assert_eq!(whole.values().len(), replies.len());
        prop_assert_eq!(&ours(&stream, &cuts), &whole);
        prop_assert_eq!(&theirs(&stream, &cuts, replies.len()), &whole);
        // Each reply alone, whole, through the one-shot reader.
        for reply in &replies {
            let (value, used) = resp::parse(reply).expect("RESP2").expect("whole");
            prop_assert_eq!(used, reply.len());
            prop_assert_eq!(value, redis::parse_redis_value(reply).expect("redis-rs"));
        }
    }

    /// Every proper prefix of a reply is incomplete for both, never an error
    /// or a value.
    #[test]
    fn a_cut_reply_is_incomplete_for_both(reply in resp2(), raw in any::<usize>()) {
        let cut = raw % reply.len();
        prop_assert_eq!(resp::parse(&reply[..cut]).expect("a prefix is no error"), None);
        let theirs = redis::parse_redis_value(&reply[..cut]);
        prop_assert!(theirs.as_ref().is_err_and(|e| e.is_io_error()), "{theirs:?}");
    }

    /// A RESP3 element: redis-rs reads it, the Pipe's parser refuses the
    /// stream there (after the replies before it), in any pieces.
    #[test]
    fn a_resp3_element_is_refused_where_redis_rs_reads_it(
        before in proptest::collection::vec(resp2(), 0..3),
        odd in with_resp3(),
        raw_cuts in proptest::collection::vec(any::<usize>(), 0..8),
    ) {
        let mut replies = before.clone();
        replies.push(odd);
        let stream = stream_of(&replies);
        let cuts = cuts(stream.len(), raw_cuts);
        let whole = theirs_whole(&stream);
        prop_assert!(matches!(whole, Read_::Whole(_)), "redis-rs: {whole:?}");
        let read = ours(&stream, &cuts);
        prop_assert_eq!(read, Read_::Refused(whole.values()[..before.len()].to_vec()));
    }

    /// Corrupted streams (bytes changed, dropped or added): both read the
    /// same replies before the damage, and then both refuse, or both wait
    /// for more, or both read the same values, except where the damage made
    /// a RESP3 type byte or an over-long bulk length.
    #[test]
    fn corrupted_streams_are_refused_by_both(
        replies in proptest::collection::vec(resp2(), 1..4),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 1..4),
        raw_cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let mut stream = stream_of(&replies);
        for (at, byte, how) in edits {
            let at = at % stream.len().max(1);
            match how {
                0 if !stream.is_empty() => stream[at] = byte,
                1 if !stream.is_empty() => { stream.remove(at); }
                _ => stream.insert(at, byte),
            }
        }
        prop_assume!(!stream.is_empty());
        let cuts = cuts(stream.len(), raw_cuts);
        let whole = theirs_whole(&stream);
        let read = ours(&stream, &cuts);
        if read != whole && non_utf8_error_line(&stream) {
            // An error whose text is not UTF-8 is an error reply to the
            // Pipe (tests/error_bytes.rs) and a broken stream to redis-rs.
            return Ok(());
        }
        if read != whole {
            prop_assert!(
                difference_allowed(&stream, &read, &whole),
                "ours {read:?}\nredis-rs {whole:?}\nstream {:?}",
                String::from_utf8_lossy(&stream)
            );
            // Whatever differs, the Pipe's parser never reads a value
            // redis-rs does not: it stops, or reads the same ones.
            let n = read.values().len();
            prop_assert!(n <= whole.values().len());
            prop_assert_eq!(read.values(), &whole.values()[..n]);
        }
    }
}

/// Malformed replies both refuse (not merely wait for more bytes).
#[test]
fn malformed_replies_are_refused_by_both() {
    let bad: &[&[u8]] = &[
        b"?\r\n",
        b"\x00\r\n",
        b":12x\r\n",
        b":\r\n",
        b": \r\n",
        b":99999999999999999999\r\n",
        b"$abc\r\n",
        b"$1.5\r\nx\r\n",
        b"*x\r\n",
        b"*1.5\r\n",
        b"$3\r\nabcd\r\n",
        b"$2\r\nab\n\r\n",
        b"$0\r\nx\r\n",
        b"+\xff\xfe\r\n",
        b"*1\r\n+\xc3\r\n",
        b"*2\r\n:1\r\n$2\r\nabc\r\n",
        b"*1\r\n*1\r\n:z\r\n",
    ];
    for bytes in bad {
        let what = String::from_utf8_lossy(bytes);
        assert!(resp::parse(bytes).is_err(), "ours read {what:?}");
        let theirs = redis::parse_redis_value(bytes);
        assert!(
            theirs.as_ref().is_err_and(|e| !e.is_io_error()),
            "redis-rs: {theirs:?} for {what:?}"
        );
        assert_eq!(ours(bytes, &[]), Read_::Refused(Vec::new()), "{what:?}");
    }
}

/// The nesting limit: 99 arrays and an element inside both read; an array
/// opened at depth 101 both refuse. In between, 100 arrays and an element
/// inside, redis-rs refuses (it counts the element's depth, 101) and the
/// Pipe's parser reads it (it counts arrays only): one level more than the
/// `MAX_DEPTH` comment in resp.rs promises, harmless, reported.
#[test]
fn nesting_is_limited_where_redis_rs_limits_it() {
    let nested = |arrays: usize, leaf: &[u8]| [b"*1\r\n".repeat(arrays), leaf.to_vec()].concat();
    for leaf in [&b"*0\r\n"[..], b"*-1\r\n", b":1\r\n"] {
        let at_limit = nested(99, leaf);
        assert_eq!(
            resp::parse(&at_limit).unwrap().map(|(v, _)| v),
            Some(redis::parse_redis_value(&at_limit).unwrap()),
        );
        let between = nested(100, leaf);
        assert!(redis::parse_redis_value(&between).is_err_and(|e| !e.is_io_error()));
        assert!(
            !matches!(resp::parse(&between), Ok(None)),
            "read or refused, not waiting"
        );
    }
    let over = nested(101, b":1\r\n");
    assert!(resp::parse(&over).is_err());
    assert!(redis::parse_redis_value(&over).is_err_and(|e| !e.is_io_error()));
}
