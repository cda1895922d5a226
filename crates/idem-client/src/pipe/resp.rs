//! Reading RESP2 replies from a byte buffer into redis-rs `Value`s, the
//! shapes redis-rs' own parser gives (`+OK` is `Value::Okay`, errors are
//! `Value::ServerError`), so every caller of `IdemClient` sees the same
//! values whichever connection carried them. A reply the buffer does not
//! hold whole yet is `Ok(None)`; bytes that are not RESP2 are an error, and
//! the connection that read them is closed.

use redis::Value;

/// Longest bulk string accepted (Redis' own `proto-max-bulk-len` default).
const MAX_BULK: usize = 512 * 1024 * 1024;
/// Most elements in one array (each costs a `Value` before it is read).
const MAX_ARRAY: usize = 1 << 24;
/// Deepest nesting of arrays.
const MAX_DEPTH: usize = 16;

/// Bytes that are not a RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProtocolError(pub String);

impl std::fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "not a RESP2 reply: {}", self.0)
    }
}

/// The first whole reply in `buf` and how many bytes it took; `None` when
/// `buf` holds only part of it.
pub(crate) fn parse(buf: &[u8]) -> Result<Option<(Value, usize)>, ProtocolError> {
    let mut at = 0;
    match value(buf, &mut at, 0)? {
        Some(value) => Ok(Some((value, at))),
        None => Ok(None),
    }
}

fn value(buf: &[u8], at: &mut usize, depth: usize) -> Result<Option<Value>, ProtocolError> {
    let Some(kind) = buf.get(*at).copied() else {
        return Ok(None);
    };
    let start = *at;
    let Some(line) = line(buf, *at + 1)? else {
        return Ok(None);
    };
    let after_line = *at + 1 + line.len() + 2;
    match kind {
        b'+' => {
            *at = after_line;
            let text = std::str::from_utf8(line)
                .map_err(|_| ProtocolError("a simple string is not UTF-8".into()))?;
            Ok(Some(if text == "OK" {
                Value::Okay
            } else {
                Value::SimpleString(text.to_owned())
            }))
        }
        b'-' => {
            *at = after_line;
            // Errors are rare: redis-rs' parser makes the `ServerError`, so
            // its kinds and codes are exactly redis-rs' own.
            redis::parse_redis_value(&buf[start..after_line])
                .map(Some)
                .map_err(|e| ProtocolError(format!("error reply: {e}")))
        }
        b':' => {
            *at = after_line;
            Ok(Some(Value::Int(integer(line)?)))
        }
        b'$' => {
            let len = integer(line)?;
            if len == -1 {
                *at = after_line;
                return Ok(Some(Value::Nil));
            }
            let len = length(len, MAX_BULK, "bulk string")?;
            let end = after_line + len;
            if buf.len() < end + 2 {
                return Ok(None);
            }
            if &buf[end..end + 2] != b"\r\n" {
                return Err(ProtocolError("a bulk string does not end in CRLF".into()));
            }
            *at = end + 2;
            Ok(Some(Value::BulkString(buf[after_line..end].to_vec())))
        }
        b'*' => {
            let len = integer(line)?;
            if len == -1 {
                *at = after_line;
                return Ok(Some(Value::Nil));
            }
            let len = length(len, MAX_ARRAY, "array")?;
            if depth == MAX_DEPTH {
                return Err(ProtocolError(format!(
                    "arrays nested over {MAX_DEPTH} deep"
                )));
            }
            let mut next = after_line;
            // Each element takes at least 3 bytes: reserve no more than the
            // buffer could hold, so a hostile length allocates nothing.
            let mut items = Vec::with_capacity(len.min((buf.len() - next) / 3 + 1));
            for _ in 0..len {
                match value(buf, &mut next, depth + 1)? {
                    Some(item) => items.push(item),
                    None => return Ok(None),
                }
            }
            *at = next;
            Ok(Some(Value::Array(items)))
        }
        other => Err(ProtocolError(format!("unknown type byte 0x{other:02x}"))),
    }
}

/// The bytes from `from` up to the next CRLF, or `None` if none is there
/// yet. RESP2 lines hold no CR of their own.
fn line(buf: &[u8], from: usize) -> Result<Option<&[u8]>, ProtocolError> {
    let Some(rest) = buf.get(from..) else {
        return Ok(None);
    };
    let Some(cr) = rest.iter().position(|&b| b == b'\r') else {
        return Ok(None);
    };
    match rest.get(cr + 1) {
        Some(b'\n') => Ok(Some(&rest[..cr])),
        Some(_) => Err(ProtocolError("a CR without LF in a line".into())),
        None => Ok(None),
    }
}

fn integer(line: &[u8]) -> Result<i64, ProtocolError> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|text| text.parse().ok())
        .ok_or_else(|| {
            ProtocolError(format!(
                "{:?} is not an integer",
                String::from_utf8_lossy(line)
            ))
        })
}

fn length(len: i64, max: usize, what: &str) -> Result<usize, ProtocolError> {
    usize::try_from(len)
        .ok()
        .filter(|&len| len <= max)
        .ok_or_else(|| ProtocolError(format!("{what} length {len} out of range")))
}

#[cfg(test)]
mod tests {
    use super::*;

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
        ];
        for bytes in cases {
            let ours = whole(bytes);
            let theirs = redis::parse_redis_value(bytes).unwrap();
            assert_eq!(ours, theirs, "{:?}", String::from_utf8_lossy(bytes));
        }
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
            b"$-2\r\n",
            b"*-5\r\n",
            b"$999999999999\r\n",
            b"+\xff\r\n",
            b"+a\rb\r\n",
        ] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        let deep = b"*1\r\n".repeat(MAX_DEPTH + 1);
        assert!(parse(&deep).is_err());
        // A huge announced array allocates nothing before its items arrive.
        assert_eq!(parse(b"*16000000\r\n").unwrap(), None);
    }
}
