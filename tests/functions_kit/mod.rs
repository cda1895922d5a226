//! Helpers of tests/functions.rs: a raw RESP client (replies kept as the
//! bytes the server sent, RESP2 or RESP3), the outbox a record key belongs
//! to (spec/outbox_slots.json), and the library's source.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::Duration;

/// One reply, its framing kept: re-encoding gives back the bytes read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resp {
    /// `+ - : _ , # (` and the line after the type byte.
    Line(u8, Vec<u8>),
    /// `$ = !` and the payload (`None`: `$-1`).
    Blob(u8, Option<Vec<u8>>),
    /// `* ~ > % |` and the elements (maps and attributes: keys and values
    /// in turn); `None`: `*-1`.
    Agg(u8, Option<Vec<Resp>>),
}

impl Resp {
    pub fn read(r: &mut impl BufRead) -> std::io::Result<Resp> {
        let mut line = Vec::new();
        r.read_until(b'\n', &mut line)?;
        if line.len() < 3 || !line.ends_with(b"\r\n") {
            return Err(std::io::Error::other(format!(
                "bad RESP line {:?}",
                String::from_utf8_lossy(&line)
            )));
        }
        let kind = line[0];
        let rest = line[1..line.len() - 2].to_vec();
        let len = || -> std::io::Result<i64> {
            std::str::from_utf8(&rest)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| std::io::Error::other("bad RESP length"))
        };
        Ok(match kind {
            b'+' | b'-' | b':' | b'_' | b',' | b'#' | b'(' => Resp::Line(kind, rest),
            b'$' | b'=' | b'!' => match len()? {
                -1 => Resp::Blob(kind, None),
                n => {
                    let mut buf = vec![0; n as usize + 2];
                    r.read_exact(&mut buf)?;
                    buf.truncate(n as usize);
                    Resp::Blob(kind, Some(buf))
                }
            },
            b'*' | b'~' | b'>' | b'%' | b'|' => match len()? {
                -1 => Resp::Agg(kind, None),
                n => {
                    let count = if matches!(kind, b'%' | b'|') {
                        2 * n
                    } else {
                        n
                    };
                    let items = (0..count)
                        .map(|_| Resp::read(r))
                        .collect::<std::io::Result<_>>()?;
                    Resp::Agg(kind, Some(items))
                }
            },
            other => {
                return Err(std::io::Error::other(format!(
                    "unknown RESP type {:?}",
                    other as char
                )))
            }
        })
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Resp::Line(kind, line) => {
                out.push(*kind);
                out.extend_from_slice(line);
            }
            Resp::Blob(kind, None) => out.extend_from_slice(&[*kind, b'-', b'1']),
            Resp::Blob(kind, Some(b)) => {
                out.push(*kind);
                out.extend_from_slice(b.len().to_string().as_bytes());
                out.extend_from_slice(b"\r\n");
                out.extend_from_slice(b);
            }
            Resp::Agg(kind, None) => out.extend_from_slice(&[*kind, b'-', b'1']),
            Resp::Agg(kind, Some(items)) => {
                let n = if matches!(kind, b'%' | b'|') {
                    items.len() / 2
                } else {
                    items.len()
                };
                out.push(*kind);
                out.extend_from_slice(n.to_string().as_bytes());
                out.extend_from_slice(b"\r\n");
                for item in items {
                    item.encode(out);
                }
                return;
            }
        }
        out.extend_from_slice(b"\r\n");
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }

    pub fn int(&self) -> Option<i64> {
        match self {
            Resp::Line(b':', line) => std::str::from_utf8(line).ok()?.parse().ok(),
            _ => None,
        }
    }

    pub fn bulk(&self) -> Option<&[u8]> {
        match self {
            Resp::Blob(b'$', Some(b)) => Some(b),
            _ => None,
        }
    }

    pub fn items(&self) -> Option<&[Resp]> {
        match self {
            Resp::Agg(_, Some(items)) => Some(items),
            _ => None,
        }
    }

    pub fn items_mut(&mut self) -> Option<&mut Vec<Resp>> {
        match self {
            Resp::Agg(_, Some(items)) => Some(items),
            _ => None,
        }
    }

    /// The text of an error reply.
    pub fn error(&self) -> Option<String> {
        match self {
            Resp::Line(b'-', line) | Resp::Blob(b'!', Some(line)) => {
                Some(String::from_utf8_lossy(line).into_owned())
            }
            _ => None,
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(
            self,
            Resp::Line(b'_', _) | Resp::Blob(_, None) | Resp::Agg(_, None)
        )
    }

    pub fn new_int(v: i64) -> Resp {
        Resp::Line(b':', v.to_string().into_bytes())
    }
}

/// Bytes made readable: printable ASCII as is, the rest escaped, long
/// strings cut.
pub fn show(bytes: &[u8], max: usize) -> String {
    let mut s = String::new();
    for &b in bytes.iter().take(max) {
        match b {
            b'\r' => s.push_str("\\r"),
            b'\n' => s.push_str("\\n"),
            b'\\' => s.push_str("\\\\"),
            0x20..=0x7e => s.push(b as char),
            _ => s.push_str(&format!("\\x{b:02x}")),
        }
    }
    if bytes.len() > max {
        s.push_str(&format!("...({} bytes)", bytes.len()));
    }
    s
}

/// A connection that keeps replies as sent.
pub struct RawConn {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    pub resp3: bool,
}

impl RawConn {
    /// Connects to 127.0.0.1:`port`; RESP3 (`HELLO 3`) when `resp3`.
    pub fn connect(port: u16, resp3: bool) -> RawConn {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .expect("read timeout");
        let _ = stream.set_nodelay(true);
        let mut conn = RawConn {
            reader: BufReader::new(stream.try_clone().expect("clone stream")),
            writer: stream,
            resp3,
        };
        if resp3 {
            let hello = conn.call(&[b"HELLO", b"3"]);
            assert!(hello.error().is_none(), "HELLO 3: {hello:?}");
        }
        conn
    }

    pub fn send(&mut self, args: &[&[u8]]) {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        self.writer.write_all(&out).expect("send");
    }

    pub fn recv(&mut self) -> Resp {
        Resp::read(&mut self.reader).expect("read a reply")
    }

    pub fn call(&mut self, args: &[&[u8]]) -> Resp {
        self.send(args);
        self.recv()
    }

    /// `call` with owned arguments.
    pub fn call_vec(&mut self, args: &[Vec<u8>]) -> Resp {
        let refs: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
        self.call(&refs)
    }

    /// A command that must not fail.
    pub fn ok(&mut self, args: &[&[u8]]) -> Resp {
        let r = self.call(args);
        if let Some(e) = r.error() {
            panic!(
                "{:?}: {e}",
                args.iter().map(|a| show(a, 40)).collect::<Vec<_>>()
            );
        }
        r
    }

    /// The command run inside MULTI/EXEC, its reply taken out of EXEC's.
    pub fn call_in_multi(&mut self, args: &[Vec<u8>]) -> Resp {
        self.ok(&[b"MULTI"]);
        let queued = self.call_vec(args);
        assert_eq!(queued, Resp::Line(b'+', b"QUEUED".to_vec()), "{queued:?}");
        let exec = self.ok(&[b"EXEC"]);
        match exec {
            Resp::Agg(_, Some(mut items)) if items.len() == 1 => items.remove(0),
            other => panic!("EXEC: {other:?}"),
        }
    }
}

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// functions/idem.lua as loaded with FUNCTION LOAD.
pub fn library_source() -> Vec<u8> {
    std::fs::read(root().join("functions/idem.lua")).expect("read functions/idem.lua")
}

/// The scripts form: the source without its first line.
pub fn scripts_form() -> Vec<u8> {
    let src = library_source();
    let nl = src.iter().position(|&b| b == b'\n').expect("a first line");
    src[nl + 1..].to_vec()
}

/// `"name": <integer>` of a JSON text (the spec files are flat enough).
fn json_int(text: &str, name: &str) -> i64 {
    let at = text.find(&format!("\"{name}\"")).expect(name) + name.len() + 2;
    let rest = text[at..].trim_start().trim_start_matches(':').trim_start();
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().expect("an integer")
}

fn json_str<'a>(text: &'a str, name: &str) -> &'a str {
    let at = text.find(&format!("\"{name}\":\"")).expect(name) + name.len() + 4;
    let end = text[at..].find('"').expect("a closing quote");
    &text[at..at + end]
}

/// `version` of spec/functions.json.
pub fn spec_version() -> i64 {
    let text = std::fs::read_to_string(root().join("spec/functions.json")).expect("spec");
    json_int(&text, "version")
}

/// The outboxes of spec/outbox_slots.json: prefix, suffix, tag per slot.
pub struct Outboxes {
    prefix: String,
    suffix: String,
    tags: Vec<String>,
}

impl Outboxes {
    pub fn load() -> Outboxes {
        let text =
            std::fs::read_to_string(root().join("spec/outbox_slots.json")).expect("outbox spec");
        let at = text.find("\"tags\":[").expect("tags") + 8;
        let end = text[at..].find(']').expect("end of tags");
        let tags: Vec<String> = text[at..at + end]
            .split(',')
            .map(|t| t.trim().trim_matches('"').to_string())
            .collect();
        assert_eq!(tags.len(), 16384);
        Outboxes {
            prefix: json_str(&text, "prefix").to_string(),
            suffix: json_str(&text, "suffix").to_string(),
            tags,
        }
    }

    /// The outbox of `key`: in its slot.
    pub fn of(&self, key: &[u8]) -> Vec<u8> {
        let name = format!(
            "{}{}{}",
            self.prefix,
            self.tags[slot(key) as usize],
            self.suffix
        );
        assert_eq!(slot(name.as_bytes()), slot(key), "the spec's tag");
        name.into_bytes()
    }
}

/// CRC16 (XMODEM), as Redis Cluster hashes keys.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The cluster slot of `key` (its hash tag when it has a non-empty one).
pub fn slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let close = key[open + 1..].iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &key[open + 1..open + 1 + close])
    });
    crc16(tagged.unwrap_or(key)) % 16384
}

/// Loads the library on a server (`FUNCTION LOAD REPLACE`).
pub fn load_library(conn: &mut RawConn) {
    let src = library_source();
    let r = conn.call(&[b"FUNCTION", b"LOAD", b"REPLACE", &src]);
    assert_eq!(r.bulk(), Some(&b"idem"[..]), "FUNCTION LOAD: {r:?}");
}
