//! Argument encoders, beside the parsers: each `Encode` writes a command,
//! name first, exactly as its parser in `args` reads it back, so the client
//! and the writer never spell a command by hand (tests of bad input still
//! do). A command on one record (`Call`) is written with a `Head`: the
//! module's command, or the Functions library's function through `FCALL` or
//! its scripts form through `EVALSHA` (`spec/functions.json`). Held to the
//! parsers by `parse(encode(x)) == x` property tests below, for every head.

use super::{name, BeginArgs, Complete, KeyToken, Pull, Touch, PACKED};
use crate::functions;
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

/// How a command on one record reaches the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head<'a> {
    /// The module's command: `IDEM.BEGIN key args...`.
    Module,
    /// The library's function: `FCALL idem_begin numkeys key [outbox] args...`.
    Function,
    /// The library's scripts form (no `FUNCTION`, Redis 6):
    /// `EVALSHA sha numkeys key [outbox] idem_begin args...`, the SHA1 (hex)
    /// of the source without its first line.
    Script(&'a str),
}

/// A command on one record key, which the module runs as a command and the
/// Functions library as a function of the same arguments.
pub trait Call {
    /// The module's command name.
    const MODULE: &'static str;
    /// The library's function name.
    const FUNCTION: &'static str;
    /// Whether the function takes the key's outbox
    /// (`functions::outbox_key`) as its second key.
    const OUTBOX: bool = false;

    /// The record's key.
    fn key(&self) -> &[u8];

    /// The arguments after the key.
    fn encode_args(&self, out: &mut impl ArgSink);

    /// This command written with `head`.
    fn via<'a>(&'a self, head: Head<'a>) -> Via<'a, Self>
    where
        Self: Sized,
    {
        Via { head, call: self }
    }
}

/// A `Call` with its head: what is sent.
#[derive(Debug, Clone, Copy)]
pub struct Via<'a, C> {
    pub head: Head<'a>,
    pub call: &'a C,
}

impl<C: Call> Encode for Via<'_, C> {
    fn encode(&self, out: &mut impl ArgSink) {
        fn keys<C: Call>(key: &[u8], out: &mut impl ArgSink) {
            out.uint(1 + u64::from(C::OUTBOX));
            out.arg(key);
            if C::OUTBOX {
                out.arg(functions::outbox_key(key).as_bytes());
            }
        }
        let key = self.call.key();
        match self.head {
            Head::Module => {
                out.arg(C::MODULE.as_bytes());
                out.arg(key);
            }
            Head::Function => {
                out.arg(b"FCALL");
                out.arg(C::FUNCTION.as_bytes());
                keys::<C>(key, out);
            }
            Head::Script(sha) => {
                out.arg(b"EVALSHA");
                out.arg(sha.as_bytes());
                keys::<C>(key, out);
                out.arg(C::FUNCTION.as_bytes());
            }
        }
        self.call.encode_args(out);
    }
}

/// The module's command (`Head::Module`).
macro_rules! encode_as_module {
    ($($t:ty),*) => {$(
        impl Encode for $t {
            fn encode(&self, out: &mut impl ArgSink) {
                self.via(Head::Module).encode(out);
            }
        }
    )*};
}

encode_as_module!(BeginArgs<'_>, Abort<'_>, Ack<'_>, Touch<'_>);

impl<'a, H> Encode for CompleteArgs<'a, H>
where
    H: Iterator<Item = (&'a [u8], &'a [u8])> + Clone,
{
    fn encode(&self, out: &mut impl ArgSink) {
        self.via(Head::Module).encode(out);
    }
}

impl Call for BeginArgs<'_> {
    const MODULE: &'static str = name::BEGIN;
    const FUNCTION: &'static str = functions::BEGIN;

    fn key(&self) -> &[u8] {
        self.key
    }

    fn encode_args(&self, out: &mut impl ArgSink) {
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

impl<'a, H> Call for CompleteArgs<'a, H>
where
    H: Iterator<Item = (&'a [u8], &'a [u8])> + Clone,
{
    const MODULE: &'static str = name::COMPLETE;
    const FUNCTION: &'static str = functions::COMPLETE;
    const OUTBOX: bool = true;

    fn key(&self) -> &[u8] {
        self.key
    }

    fn encode_args(&self, out: &mut impl ArgSink) {
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

impl Call for Abort<'_> {
    const MODULE: &'static str = name::ABORT;
    const FUNCTION: &'static str = functions::ABORT;

    fn key(&self) -> &[u8] {
        self.0.key
    }

    fn encode_args(&self, out: &mut impl ArgSink) {
        out.uint(self.0.token);
    }
}

impl Call for Ack<'_> {
    const MODULE: &'static str = name::MIRROR_ACK;
    const FUNCTION: &'static str = functions::MIRROR_ACK;
    const OUTBOX: bool = true;

    fn key(&self) -> &[u8] {
        self.0.key
    }

    fn encode_args(&self, out: &mut impl ArgSink) {
        out.uint(self.0.token);
    }
}

impl Call for Touch<'_> {
    const MODULE: &'static str = name::TOUCH;
    const FUNCTION: &'static str = functions::TOUCH;

    fn key(&self) -> &[u8] {
        self.key
    }

    fn encode_args(&self, out: &mut impl ArgSink) {
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

    const SHA: &str = "0123456789abcdef0123456789abcdef01234567";
    const HEADS: [Head<'static>; 3] = [Head::Module, Head::Function, Head::Script(SHA)];

    /// `call` encoded with `head`, read back as the module's command: the
    /// module's name and the arguments its parser sees (the key first),
    /// after checking the function's head (its name, the key count, the
    /// outbox in the key's slot).
    fn split_via<C: Call>(call: &C, head: Head<'_>) -> (String, Vec<Vec<u8>>) {
        let via = call.via(head);
        check_size(&via);
        let (command, mut args) = split(&via);
        let (function, keys) = match head {
            Head::Module => return (command, args),
            Head::Function => {
                assert_eq!(command, "FCALL");
                let function = args.remove(0);
                let keys: usize = String::from_utf8(args.remove(0)).unwrap().parse().unwrap();
                let keys: Vec<_> = args.drain(..keys).collect();
                (function, keys)
            }
            Head::Script(sha) => {
                assert_eq!(command, "EVALSHA");
                assert_eq!(args.remove(0), sha.as_bytes());
                let keys: usize = String::from_utf8(args.remove(0)).unwrap().parse().unwrap();
                let keys: Vec<_> = args.drain(..keys).collect();
                (args.remove(0), keys)
            }
        };
        assert_eq!(function, C::FUNCTION.as_bytes());
        assert_eq!(keys.len(), 1 + usize::from(C::OUTBOX));
        if C::OUTBOX {
            assert_eq!(keys[1], functions::outbox_key(&keys[0]).into_bytes());
            assert_eq!(functions::key_slot(&keys[1]), functions::key_slot(&keys[0]));
        }
        args.insert(0, keys[0].clone());
        (C::MODULE.to_string(), args)
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
            prop_assert_eq!(split(&x), split_via(&x, Head::Module));
            for head in HEADS {
                let (name, encoded) = split_via(&x, head);
                prop_assert_eq!(name, name::BEGIN);
                prop_assert_eq!(args::begin_args(&refs(&encoded), &LIMITS).unwrap(), x);
            }
            let (_, encoded) = split(&x);
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
            prop_assert_eq!(split(&x.args()), split_via(&x.args(), Head::Module));
            for head in HEADS {
                let (name, encoded) = split_via(&x.args(), head);
                prop_assert_eq!(name, name::COMPLETE);
                prop_assert_eq!(&args::complete(&refs(&encoded), &LIMITS).unwrap(), &x);
            }
        }

        #[test]
        fn abort_ack_touch_round_trip(key in key(), token in token(), lease in 1..=MAX_MS) {
            let kt = KeyToken { key: &key, token };
            let x = Touch { key: &key, token, lease_ms: lease };
            check_size(&x);
            prop_assert_eq!(split(&Abort(kt)), split_via(&Abort(kt), Head::Module));
            prop_assert_eq!(split(&Ack(kt)), split_via(&Ack(kt), Head::Module));
            prop_assert_eq!(split(&x), split_via(&x, Head::Module));
            for head in HEADS {
                let (name, encoded) = split_via(&Abort(kt), head);
                prop_assert_eq!(name, name::ABORT);
                prop_assert_eq!(args::key_token(&refs(&encoded), "").unwrap(), kt);
                let (name, encoded) = split_via(&Ack(kt), head);
                prop_assert_eq!(name, name::MIRROR_ACK);
                prop_assert_eq!(args::key_token(&refs(&encoded), "").unwrap(), kt);
                let (name, encoded) = split_via(&x, head);
                prop_assert_eq!(name, name::TOUCH);
                prop_assert_eq!(args::touch(&refs(&encoded)).unwrap(), x);
            }
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
