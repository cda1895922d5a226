//! Reading RESP2 replies from a byte buffer into redis-rs `Value`s, the
//! shapes redis-rs' own parser gives (`+OK` is `Value::Okay`, errors are
//! `Value::ServerError`), so every caller of `IdemClient` sees the same
//! values whichever connection carried them. A reply the buffer does not
//! hold whole yet is `Ok(None)`; bytes that are not RESP2 are an error, and
//! the connection that read them is closed.

use redis::Value;

/// Longest bulk string accepted (Redis' own `proto-max-bulk-len` default).
const MAX_BULK: usize = 512 * 1024 * 1024;
/// Deepest nesting of arrays (redis-rs' own limit).
const MAX_DEPTH: usize = 100;
/// Elements reserved ahead for one array; more grow the vector as they come.
const RESERVE_ITEMS: usize = 1024;

/// Bytes that are not a RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProtocolError(pub String);

impl std::fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "not a RESP2 reply: {}", self.0)
    }
}

/// Reads replies one element at a time and keeps the arrays it is inside,
/// so a reply that arrives in many reads is read once, not again from its
/// start on every read.
#[derive(Default)]
pub(crate) struct Parser {
    /// Arrays begun and not yet whole: how many elements each still needs.
    open: Vec<(usize, Vec<Value>)>,
}

impl Parser {
    /// The next whole reply from `buf[*at..]`, advancing `*at` past every
    /// element read (also those of a reply still partial: the parser keeps
    /// them); `None` when `buf` ends first.
    pub(crate) fn next(
        &mut self,
        buf: &[u8],
        at: &mut usize,
    ) -> Result<Option<Value>, ProtocolError> {
        loop {
            let Some((element, len)) = element(&buf[*at..])? else {
                return Ok(None);
            };
            *at += len;
            let mut value = match element {
                Element::Value(value) => value,
                Element::Array(0) => Value::Array(Vec::new()),
                Element::Array(items) => {
                    if self.open.len() == MAX_DEPTH {
                        return Err(ProtocolError(format!(
                            "arrays nested over {MAX_DEPTH} deep"
                        )));
                    }
                    let reserve = items.min(RESERVE_ITEMS);
                    self.open.push((items, Vec::with_capacity(reserve)));
                    continue;
                }
            };
            // Close every array this element completes.
            loop {
                let Some((needed, items)) = self.open.last_mut() else {
                    return Ok(Some(value));
                };
                items.push(value);
                *needed -= 1;
                if *needed > 0 {
                    break;
                }
                let (_, items) = self.open.pop().expect("an open array");
                value = Value::Array(items);
            }
        }
    }
}

/// The first whole reply in `buf` and how many bytes it took, `None` when
/// `buf` holds only part of it (tests and the connection setup).
pub(crate) fn parse(buf: &[u8]) -> Result<Option<(Value, usize)>, ProtocolError> {
    let mut at = 0;
    Ok(Parser::default()
        .next(buf, &mut at)?
        .map(|value| (value, at)))
}

enum Element {
    Value(Value),
    /// An array header: this many elements follow.
    Array(usize),
}

/// One scalar or array header at the start of `buf`, and its length.
fn element(buf: &[u8]) -> Result<Option<(Element, usize)>, ProtocolError> {
    let Some(&kind) = buf.first() else {
        return Ok(None);
    };
    let Some(line) = line(&buf[1..]) else {
        return Ok(None);
    };
    let after = 1 + line.len() + 2;
    let value = match kind {
        b'+' => {
            let text = std::str::from_utf8(line)
                .map_err(|_| ProtocolError("a simple string is not UTF-8".into()))?;
            if text == "OK" {
                Value::Okay
            } else {
                Value::SimpleString(text.to_owned())
            }
        }
        // Errors are rare: redis-rs' parser makes the `ServerError`, so its
        // kinds and codes are exactly redis-rs' own. Their text is whatever
        // the server wrote, not always UTF-8 (`unknown command` echoes the
        // arguments, a binary fingerprint's bytes included), and redis-rs
        // takes only UTF-8: such a text is read lossily, so the error stays
        // the server's error and the connection stays up.
        b'-' => match std::str::from_utf8(line) {
            Ok(_) => redis::parse_redis_value(&buf[..after]),
            Err(_) => {
                let text = String::from_utf8_lossy(line);
                redis::parse_redis_value(format!("-{text}\r\n").as_bytes())
            }
        }
        .map_err(|e| ProtocolError(format!("error reply: {e}")))?,
        b':' => Value::Int(integer(line)?),
        b'$' => {
            // As redis-rs: any negative length is a nil.
            let Ok(len) = usize::try_from(integer(line)?) else {
                return Ok(Some((Element::Value(Value::Nil), after)));
            };
            if len > MAX_BULK {
                return Err(ProtocolError(format!(
                    "bulk string length {len} out of range"
                )));
            }
            let end = after + len;
            if buf.len() < end + 2 {
                return Ok(None);
            }
            if &buf[end..end + 2] != b"\r\n" {
                return Err(ProtocolError("a bulk string does not end in CRLF".into()));
            }
            return Ok(Some((
                Element::Value(Value::BulkString(buf[after..end].to_vec())),
                end + 2,
            )));
        }
        b'*' => {
            let element = match usize::try_from(integer(line)?) {
                Ok(items) => Element::Array(items),
                Err(_) => Element::Value(Value::Nil),
            };
            return Ok(Some((element, after)));
        }
        other => return Err(ProtocolError(format!("unknown type byte 0x{other:02x}"))),
    };
    Ok(Some((Element::Value(value), after)))
}

/// The bytes up to the first CRLF, or `None` if none is there yet.
fn line(buf: &[u8]) -> Option<&[u8]> {
    let mut from = 0;
    loop {
        let cr = from + buf[from..].iter().position(|&b| b == b'\r')?;
        match buf.get(cr + 1) {
            Some(b'\n') => return Some(&buf[..cr]),
            Some(_) => from = cr + 1,
            None => return None,
        }
    }
}

/// An integer line, spaces around it ignored as redis-rs does.
fn integer(line: &[u8]) -> Result<i64, ProtocolError> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .ok_or_else(|| {
            ProtocolError(format!(
                "{:?} is not an integer",
                String::from_utf8_lossy(line)
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_read_in_pieces_is_read_once() {
        let mut reply = b"*3\r\n".to_vec();
        for i in 0..3 {
            reply.extend_from_slice(format!("*2\r\n:{i}\r\n$3\r\nab{i}\r\n").as_bytes());
        }
        reply.extend_from_slice(b"+OK\r\n");
        let whole = redis::parse_redis_value(&reply).unwrap();
        // Fed a byte at a time, as a reader keeping what is unconsumed.
        let mut parser = Parser::default();
        let (mut buf, mut got) = (Vec::new(), Vec::new());
        for &byte in &reply {
            buf.push(byte);
            let mut at = 0;
            while let Some(value) = parser.next(&buf, &mut at).unwrap() {
                got.push(value);
            }
            buf.drain(..at);
        }
        assert_eq!(got, vec![whole, Value::Okay]);
        assert!(buf.is_empty());
    }

    fn whole(bytes: &[u8]) -> Value {
        let (value, used) = parse(bytes).unwrap().expect("a whole reply");
        assert_eq!(used, bytes.len(), "{:?}", String::from_utf8_lossy(bytes));
        value
    }

    #[test]
    fn reads_every_reply_type_as_redis_rs_does() {
        let cases: &[&[u8]] = &[
            b"+OK\r\n",
            b"+PONG\r\n",
            b"-STALE token 3 no longer holds the key\r\n",
            b"-ERR unknown command\r\n",
            b":42\r\n",
            b":-7\r\n",
            b"$5\r\nhello\r\n",
            b"$0\r\n\r\n",
            b"$-1\r\n",
            b"*-1\r\n",
            b"*0\r\n",
            b"*3\r\n:1\r\n$3\r\na\rb\r\n*2\r\n+x\r\n$-1\r\n",
            b"$4\r\n\r\n\r\n\r\n",
            b"$-2\r\n",
            b"*-3\r\n",
            b": 5\r\n",
            b"+a\rb\r\n",
        ];
        for bytes in cases {
            let ours = whole(bytes);
            let theirs = redis::parse_redis_value(bytes).unwrap();
            assert_eq!(ours, theirs, "{:?}", String::from_utf8_lossy(bytes));
        }
    }

    #[test]
    fn an_error_that_is_not_utf8_is_read_lossily() {
        let reply = b"-ERR unknown command 'IDEM.BEGIN', with args beginning with: 'k' '\xff\xfe' \r\n+OK\r\n";
        let (value, used) = parse(reply).unwrap().expect("a whole reply");
        let lossy = "-ERR unknown command 'IDEM.BEGIN', with args beginning with: 'k' '\u{fffd}\u{fffd}' \r\n";
        assert_eq!(value, redis::parse_redis_value(lossy.as_bytes()).unwrap());
        assert!(matches!(value, Value::ServerError(_)));
        assert_eq!(&reply[used..], b"+OK\r\n");
    }

    #[test]
    fn every_prefix_is_incomplete_and_the_rest_stays() {
        let reply: &[u8] = b"*2\r\n$10\r\n0123456789\r\n*1\r\n:5\r\n";
        for cut in 0..reply.len() {
            assert_eq!(parse(&reply[..cut]).unwrap(), None, "cut at {cut}");
        }
        let mut two = reply.to_vec();
        two.extend_from_slice(b"+OK\r\n");
        let (_, used) = parse(&two).unwrap().unwrap();
        assert_eq!(&two[used..], b"+OK\r\n");
    }

    #[test]
    fn refuses_what_is_not_resp2() {
        for bad in [
            &b"?\r\n"[..],
            b":12x\r\n",
            b"$3\r\nabcd\r\n",
            b"$999999999999\r\n",
            b"+\xff\r\n",
        ] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        let deep = b"*1\r\n".repeat(MAX_DEPTH + 1);
        assert!(parse(&deep).is_err());
        // A huge announced array reserves little before its items arrive.
        assert_eq!(parse(b"*16000000\r\n").unwrap(), None);
    }
}
