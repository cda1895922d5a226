//! A raw RESP2 connection for the storm: any bytes as arguments, deep
//! pipelines, every reply (errors included) read back in order, and a socket
//! that can be dropped mid-command.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resp {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Resp>>),
}

impl Resp {
    pub fn array(&self) -> Option<&[Resp]> {
        match self {
            Resp::Array(Some(a)) => Some(a),
            _ => None,
        }
    }

    pub fn bulk(&self) -> Option<&[u8]> {
        match self {
            Resp::Bulk(Some(b)) => Some(b),
            _ => None,
        }
    }
}

pub struct Conn {
    reader: BufReader<TcpStream>,
    out: Vec<u8>,
    pending: usize,
}

impl Conn {
    pub fn open(port: u16) -> Conn {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        Conn {
            reader: BufReader::with_capacity(1 << 16, s),
            out: Vec::new(),
            pending: 0,
        }
    }

    pub fn stream(&self) -> &TcpStream {
        self.reader.get_ref()
    }

    /// Queues one command (sent by `flush`).
    pub fn send<A: AsRef<[u8]>>(&mut self, args: &[A]) {
        self.out
            .extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in args {
            let a = a.as_ref();
            self.out
                .extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            self.out.extend_from_slice(a);
            self.out.extend_from_slice(b"\r\n");
        }
        self.pending += 1;
    }

    pub fn flush(&mut self) {
        self.reader.get_mut().write_all(&self.out).expect("send");
        self.out.clear();
    }

    /// Sends what is queued and reads one reply per command not yet
    /// answered.
    pub fn replies(&mut self) -> Vec<Resp> {
        self.flush();
        (0..self.pending)
            .map(|_| self.read().expect("reply"))
            .collect()
    }

    /// One command, one reply.
    pub fn call<A: AsRef<[u8]>>(&mut self, args: &[A]) -> Resp {
        self.send(args);
        self.replies().pop().unwrap()
    }

    /// Reads the next reply (of a command sent and flushed earlier).
    pub fn read(&mut self) -> std::io::Result<Resp> {
        let r = self.read_one()?;
        self.pending = self.pending.saturating_sub(1);
        Ok(r)
    }

    fn read_one(&mut self) -> std::io::Result<Resp> {
        let line = self.line()?;
        let (kind, rest) = line.split_at(1);
        let text = || String::from_utf8_lossy(rest).into_owned();
        let num = || -> std::io::Result<i64> {
            text()
                .parse()
                .map_err(|_| std::io::Error::other(format!("bad number {:?}", text())))
        };
        Ok(match kind[0] {
            b'+' => Resp::Simple(text()),
            b'-' => Resp::Error(text()),
            b':' => Resp::Int(num()?),
            b'$' => match num()? {
                -1 => Resp::Bulk(None),
                n => {
                    let mut b = vec![0; n as usize + 2];
                    self.reader.read_exact(&mut b)?;
                    b.truncate(n as usize);
                    Resp::Bulk(Some(b))
                }
            },
            b'*' => match num()? {
                -1 => Resp::Array(None),
                n => Resp::Array(Some(
                    (0..n).map(|_| self.read_one()).collect::<Result<_, _>>()?,
                )),
            },
            other => {
                return Err(std::io::Error::other(format!(
                    "unexpected RESP type {:?}",
                    other as char
                )))
            }
        })
    }

    fn line(&mut self) -> std::io::Result<Vec<u8>> {
        let mut line = Vec::new();
        self.reader.read_until(b'\n', &mut line)?;
        if line.len() < 3 || !line.ends_with(b"\r\n") {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "connection closed",
            ));
        }
        line.truncate(line.len() - 2);
        Ok(line)
    }
}
