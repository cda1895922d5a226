//! Argument encoders, beside the parsers: each `Encode` writes a command,
//! name first, exactly as its parser in `args` reads it back, so the client
//! and the writer never spell a command by hand (tests of bad input still
//! do). Held to the parsers by `parse(encode(x)) == x` property tests below.

use super::{name, BeginArgs, Complete, KeyToken, Pull, Touch, PACKED};
use crate::wire::ReplayLayout;

/// Where an encoder writes arguments: a redis-rs `Cmd` (feature `redis`),
/// a `Vec<Vec<u8>>`, or `ArgSize` to measure first.
pub trait ArgSink {
    fn arg(&mut self, arg: &[u8]);

    /// An unsigned decimal argument.
    fn uint(&mut self, n: u64) {
        let mut buf = [0u8; 20];
        let mut i = buf.len();
        let mut n = n;
        loop {
            i -= 1;
            buf[i] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.arg(&buf[i..]);
    }
}

impl ArgSink for Vec<Vec<u8>> {
    fn arg(&mut self, arg: &[u8]) {
        self.push(arg.to_vec());
    }
}

/// Counts the arguments and bytes an encoder writes, to size a buffer.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ArgSize {
    pub args: usize,
    pub bytes: usize,
}

impl ArgSink for ArgSize {
    fn arg(&mut self, arg: &[u8]) {
        self.args += 1;
        self.bytes += arg.len();
    }

    fn uint(&mut self, n: u64) {
        self.args += 1;
        self.bytes += n.checked_ilog10().map_or(1, |d| d as usize + 1);
    }
}

#[cfg(feature = "redis")]
impl ArgSink for redis::Cmd {
    fn arg(&mut self, arg: &[u8]) {
        redis::Cmd::arg(self, arg);
    }

    fn uint(&mut self, n: u64) {
        redis::Cmd::arg(self, n);
    }
}

/// A command's encoder.
pub trait Encode {
    /// Writes the command name, then its arguments.
    fn encode(&self, out: &mut impl ArgSink);

    /// What `encode` writes, measured.
    fn size(&self) -> ArgSize {
        let mut size = ArgSize::default();
        self.encode(&mut size);
        size
    }

    /// The command as owned arguments (name first).
    fn to_args(&self) -> Vec<Vec<u8>> {
        let mut args = Vec::with_capacity(self.size().args);
        self.encode(&mut args);
        args
    }

    /// The command as a redis-rs `Cmd`, sized before it is written.
    #[cfg(feature = "redis")]
    fn to_cmd(&self) -> redis::Cmd {
        let size = self.size();
        let mut cmd = redis::Cmd::with_capacity(size.args, size.bytes);
        self.encode(&mut cmd);
        cmd
    }
}

impl Encode for BeginArgs<'_> {
    fn encode(&self, out: &mut impl ArgSink) {
        out.arg(name::BEGIN.as_bytes());
        out.arg(self.key);
        out.arg(self.fingerprint);
        out.uint(self.ttl_secs);
        if let Some(ms) = self.lease_ms {
            out.arg(b"LEASE");
            out.uint(ms);
        }
        if let Some(ms) = self.wait_ms {
            out.arg(b"WAIT");
            out.uint(ms);
        }
        if self.replay == ReplayLayout::Packed {
            out.arg(PACKED.as_bytes());
        }
    }
}

/// `IDEM.COMPLETE` as a client sends it: the headers are any cloneable
/// iterator of `(name, value)`, so a caller's own header list is encoded
/// without being copied into `Header`s first.
#[derive(Debug, Clone)]
pub struct CompleteArgs<'a, H> {
    pub key: &'a [u8],
    pub token: u64,
    pub status: u16,
    pub body: &'a [u8],
    pub headers: H,
    /// The response came from Postgres (`MIRRORED`).
    pub mirrored: bool,
}

impl<'a, H> Encode for CompleteArgs<'a, H>
where
    H: Iterator<Item = (&'a [u8], &'a [u8])> + Clone,
{
    fn encode(&self, out: &mut impl ArgSink) {
        out.arg(name::COMPLETE.as_bytes());
        out.arg(self.key);
        out.uint(self.token);
        out.uint(self.status.into());
        out.arg(self.body);
        for (name, value) in self.headers.clone() {
            out.arg(b"HEADER");
            out.arg(name);
            out.arg(value);
        }
        if self.mirrored {
            out.arg(b"MIRRORED");
        }
    }
}

impl<'a> Complete<'a> {
    /// These arguments, for encoding.
    pub fn args(&self) -> CompleteArgs<'a, impl Iterator<Item = (&[u8], &[u8])> + Clone + '_> {
        CompleteArgs {
            key: self.key,
            token: self.token,
            status: self.status,
            body: self.body,
            headers: self
                .headers
                .iter()
                .map(|h| (h.name.as_slice(), h.value.as_slice())),
            mirrored: self.mirrored,
        }
    }
}

/// `IDEM.ABORT key token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Abort<'a>(pub KeyToken<'a>);

/// `IDEM.MIRROR.ACK key token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack<'a>(pub KeyToken<'a>);

fn key_token(name: &str, kt: &KeyToken<'_>, out: &mut impl ArgSink) {
    out.arg(name.as_bytes());
    out.arg(kt.key);
    out.uint(kt.token);
}

impl Encode for Abort<'_> {
    fn encode(&self, out: &mut impl ArgSink) {
        key_token(name::ABORT, &self.0, out);
    }
}

impl Encode for Ack<'_> {
    fn encode(&self, out: &mut impl ArgSink) {
        key_token(name::MIRROR_ACK, &self.0, out);
    }
}

impl Encode for Touch<'_> {
    fn encode(&self, out: &mut impl ArgSink) {
        out.arg(name::TOUCH.as_bytes());
        out.arg(self.key);
        out.uint(self.token);
        out.uint(self.lease_ms);
    }
}

impl Encode for Pull {
    fn encode(&self, out: &mut impl ArgSink) {
        out.arg(name::MIRROR_PULL.as_bytes());
        out.uint(self.count as u64);
        out.arg(b"CLAIM");
        out.uint(self.claim_ms);
        if let Some(ms) = self.block_ms {
            out.arg(b"BLOCK");
            out.uint(ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{self as args, Limits, MAX_MS, MAX_PULL};
    use super::*;
    use crate::Header;
    use proptest::prelude::*;

    const LIMITS: Limits = Limits::DEFAULT;

    /// The encoded command: its name, and the arguments as a parser sees them.
    fn split(e: &impl Encode) -> (String, Vec<Vec<u8>>) {
        let mut args = e.to_args();
        let name = String::from_utf8(args.remove(0)).unwrap();
        (name, args)
    }

    fn refs(args: &[Vec<u8>]) -> Vec<&[u8]> {
        args.iter().map(Vec::as_slice).collect()
    }

    fn bytes() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(any::<u8>(), 0..24)
    }

    fn key() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(any::<u8>(), 1..24)
    }

    fn token() -> impl Strategy<Value = u64> {
        1..=i64::MAX as u64
    }

    fn check_size(e: &impl Encode) {
        let args = e.to_args();
        let size = e.size();
        assert_eq!(size.args, args.len());
        assert_eq!(size.bytes, args.iter().map(Vec::len).sum::<usize>());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        #[test]
        fn begin_round_trips(
            key in key(), fp in bytes(),
            ttl in 1..=LIMITS.max_ttl_secs,
            lease in prop::option::of(1..=MAX_MS),
            wait in prop::option::of(0..=MAX_MS),
            packed: bool,
        ) {
            let replay = if packed { ReplayLayout::Packed } else { ReplayLayout::Fields };
            let x = BeginArgs { key: &key, fingerprint: &fp, ttl_secs: ttl, lease_ms: lease, wait_ms: wait, replay };
            check_size(&x);
            let (name, encoded) = split(&x);
            prop_assert_eq!(name, name::BEGIN);
            prop_assert_eq!(args::begin_args(&refs(&encoded), &LIMITS).unwrap(), x);
            let resolved = args::begin(&refs(&encoded), &LIMITS).unwrap();
            prop_assert_eq!(resolved.fingerprint.digest(), crate::fingerprint::sha256(&fp));
            prop_assert_eq!(resolved.ttl_ms, ttl * 1000);
            prop_assert_eq!(resolved.lease_ms, lease.unwrap_or(LIMITS.default_lease_ms));
        }

        #[test]
        fn complete_round_trips(
            key in key(), token in token(), status in 100u16..=599, body in bytes(),
            headers in prop::collection::vec((key(), bytes()), 0..4),
            mirrored in any::<bool>(),
        ) {
            let headers: Vec<Header> = headers
                .into_iter()
                .map(|(name, value)| Header { name, value })
                .collect();
            let x = Complete { key: &key, token, status, body: &body, headers, mirrored };
            check_size(&x.args());
            let (name, encoded) = split(&x.args());
            prop_assert_eq!(name, name::COMPLETE);
            prop_assert_eq!(args::complete(&refs(&encoded), &LIMITS).unwrap(), x);
        }

        #[test]
        fn abort_ack_touch_round_trip(key in key(), token in token(), lease in 1..=MAX_MS) {
            let kt = KeyToken { key: &key, token };
            let (name, encoded) = split(&Abort(kt));
            prop_assert_eq!(name, name::ABORT);
            prop_assert_eq!(args::key_token(&refs(&encoded), "").unwrap(), kt);
            let (name, encoded) = split(&Ack(kt));
            prop_assert_eq!(name, name::MIRROR_ACK);
            prop_assert_eq!(args::key_token(&refs(&encoded), "").unwrap(), kt);
            let x = Touch { key: &key, token, lease_ms: lease };
            check_size(&x);
            let (name, encoded) = split(&x);
            prop_assert_eq!(name, name::TOUCH);
            prop_assert_eq!(args::touch(&refs(&encoded)).unwrap(), x);
        }

        #[test]
        fn pull_round_trips(
            count in 1..=MAX_PULL, claim in 1..=MAX_MS, block in prop::option::of(0..=MAX_MS),
        ) {
            let x = Pull { count, claim_ms: claim, block_ms: block };
            check_size(&x);
            let (name, encoded) = split(&x);
            prop_assert_eq!(name, name::MIRROR_PULL);
            prop_assert_eq!(args::pull(&refs(&encoded), 1).unwrap(), x);
        }

        #[test]
        fn uint_is_plain_decimal(n in any::<u64>()) {
            let mut out = Vec::<Vec<u8>>::new();
            out.uint(n);
            prop_assert_eq!(out[0].clone(), n.to_string().into_bytes());
            let mut size = ArgSize::default();
            size.uint(n);
            prop_assert_eq!(size.bytes, out[0].len());
        }
    }

    #[test]
    fn out_of_range_values_encode_but_do_not_parse() {
        let x = BeginArgs {
            key: b"k",
            fingerprint: b"fp",
            ttl_secs: LIMITS.max_ttl_secs + 1,
            lease_ms: None,
            wait_ms: None,
            replay: ReplayLayout::Fields,
        };
        let (_, encoded) = split(&x);
        assert_eq!(
            args::begin_args(&refs(&encoded), &LIMITS)
                .unwrap_err()
                .code()
                .as_str(),
            "BADARG"
        );
    }
}
