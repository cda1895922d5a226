//! Writing a command as RESP2 (an array of bulk strings) straight from its
//! `idem_core::args` encoder into `Pipe`'s buffer: no redis-rs `Cmd` in
//! between, so a call allocates nothing for its command.

use idem_core::args::{ArgSink, Encode};

/// Appends `command` to `out` as one RESP2 array. An encoder that writes
/// other arguments than it measured fails the call (the caller drops what
/// was appended): its array's length would swallow or leave over arguments
/// of the commands after it.
pub(crate) fn write(command: &impl Encode, out: &mut Vec<u8>) -> redis::RedisResult<()> {
    let size = command.size();
    // Each argument adds "$", its length (digits) and two CRLFs.
    out.reserve(size.bytes + 16 * size.args + 16);
    out.push(b'*');
    decimal(out, size.args as u64);
    out.extend_from_slice(b"\r\n");
    let mut sink = Resp { out, args: 0 };
    command.encode(&mut sink);
    if sink.args != size.args {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "command encoder miscounted its arguments",
            format!("measured {}, wrote {}", size.args, sink.args),
        )));
    }
    Ok(())
}

/// An `ArgSink` that writes each argument as a RESP2 bulk string, and
/// counts them.
struct Resp<'a> {
    out: &'a mut Vec<u8>,
    args: usize,
}

impl ArgSink for Resp<'_> {
    fn arg(&mut self, arg: &[u8]) {
        self.args += 1;
        let out = &mut *self.out;
        out.push(b'$');
        decimal(out, arg.len() as u64);
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

fn decimal(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

#[cfg(test)]
mod tests {
    use idem_core::args::{Abort, BeginArgs, CompleteArgs, KeyToken};
    use idem_core::wire::ReplayLayout;

    use super::*;

    /// The bytes redis-rs writes for the same command.
    fn redis_rs(command: &impl Encode) -> Vec<u8> {
        command.to_cmd().get_packed_command()
    }

    #[test]
    fn commands_are_written_as_redis_rs_writes_them() {
        let begin = BeginArgs {
            key: b"idem:{k}",
            fingerprint: &[0, 255, 13, 10],
            ttl_secs: 86_400,
            lease_ms: Some(30_000),
            wait_ms: None,
            replay: ReplayLayout::Packed,
        };
        let headers = [(&b"content-type"[..], &b"application/json"[..])];
        let complete = CompleteArgs {
            key: b"k",
            token: u64::MAX,
            status: 201,
            body: &[7u8; 300],
            headers: headers.iter().copied(),
            mirrored: true,
        };
        let abort = Abort(KeyToken { key: b"", token: 0 });
        let mut out = Vec::new();
        write(&begin, &mut out).unwrap();
        assert_eq!(out, redis_rs(&begin));
        out.clear();
        write(&complete, &mut out).unwrap();
        assert_eq!(out, redis_rs(&complete));
        // Appended after what the buffer holds.
        write(&abort, &mut out).unwrap();
        assert_eq!(out, [redis_rs(&complete), redis_rs(&abort)].concat());
    }
}
