//! Parsing and validation of command arguments (everything after the command
//! name). Bad input becomes `Error::BadArg` / `Error::TooLarge` before any
//! record is touched. The encoders beside them (`encode`) build exactly what
//! these parsers accept.

mod encode;
pub mod name;

pub use encode::{Abort, Ack, ArgSink, ArgSize, Call, CompleteArgs, Encode, Head, Via};

use crate::record::STATUS_RANGE;
use crate::wire::ReplayLayout;
use crate::{Error, Fingerprint, Header};

/// Limits taken from the module's configs at call time.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_ttl_secs: u64,
    pub max_body_bytes: u64,
    pub default_lease_ms: u64,
    /// Most `HEADER`s one `IDEM.COMPLETE` may carry (`idem.max-headers`).
    pub max_headers: u64,
}

impl Limits {
    /// The module's defaults (`idem.max-ttl` 30 days, `idem.max-body-bytes`
    /// 1 MiB, `idem.lease-ms` 30 s, `idem.max-headers` 256); the in-memory
    /// store starts from them too.
    pub const DEFAULT: Limits = Limits {
        max_ttl_secs: 2_592_000,
        max_body_bytes: 1_048_576,
        default_lease_ms: 30_000,
        max_headers: 256,
    };
}

/// `IDEM.BEGIN`'s arguments as sent: what a client encodes and the parser
/// reads back; `resolve` turns them into the engine's `Begin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BeginArgs<'a> {
    pub key: &'a [u8],
    /// The client's fingerprint, before hashing.
    pub fingerprint: &'a [u8],
    pub ttl_secs: u64,
    /// `LEASE ms`; `None`: the module's `idem.lease-ms`.
    pub lease_ms: Option<u64>,
    /// `WAIT ms`: block up to this long instead of answering `in_flight`.
    pub wait_ms: Option<u64>,
    /// `PACKED`: a replay as `["replay", packed]`.
    pub replay: ReplayLayout,
}

impl<'a> BeginArgs<'a> {
    /// The engine's request: fingerprint in its record form, TTL in
    /// milliseconds, lease defaulted from `limits`.
    pub fn resolve(&self, limits: &Limits) -> Begin<'a> {
        Begin {
            key: self.key,
            fingerprint: Fingerprint::of(self.fingerprint),
            ttl_ms: self.ttl_secs * 1000,
            lease_ms: self.lease_ms.unwrap_or(limits.default_lease_ms),
            wait_ms: self.wait_ms,
            replay: self.replay,
        }
    }
}

/// `IDEM.BEGIN` as the engine takes it.
#[derive(Debug, PartialEq, Eq)]
pub struct Begin<'a> {
    pub key: &'a [u8],
    pub fingerprint: Fingerprint,
    pub ttl_ms: u64,
    pub lease_ms: u64,
    /// `WAIT ms`: block up to this long instead of answering `in_flight`.
    pub wait_ms: Option<u64>,
    /// How a replay is laid out (`PACKED`).
    pub replay: ReplayLayout,
}

#[derive(Debug, PartialEq, Eq)]
pub struct Complete<'a> {
    pub key: &'a [u8],
    pub token: u64,
    pub status: u16,
    pub body: &'a [u8],
    pub headers: Vec<Header>,
    /// The response came from Postgres: store it already mirrored.
    pub mirrored: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyToken<'a> {
    pub key: &'a [u8],
    pub token: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Touch<'a> {
    pub key: &'a [u8],
    pub token: u64,
    pub lease_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pull {
    pub count: usize,
    pub claim_ms: u64,
    pub block_ms: Option<u64>,
}

/// `IDEM.BEGIN`'s flag for a packed replay (`wire::ReplayLayout::Packed`).
pub const PACKED: &str = "PACKED";

/// Longest lease or wait accepted: a year, far beyond any sane value, and small
/// enough that `now + lease` never overflows.
pub const MAX_MS: u64 = 366 * 24 * 3600 * 1000;
/// Bytes each `HEADER` counts against `max-body-bytes` besides its name and
/// value: what a header costs a record beyond its bytes, so many tiny
/// headers cannot hold more memory than the limit says.
pub const HEADER_OVERHEAD: usize = 32;
/// Most records one `IDEM.MIRROR.PULL` hands out.
pub const MAX_PULL: usize = 10_000;

/// A duration as the millisecond argument of a command (`LEASE`, `WAIT`,
/// `CLAIM`, `BLOCK`, `IDEM.TOUCH`): whole milliseconds rounded up, so a
/// positive duration never becomes 0; saturating.
pub fn duration_ms(d: std::time::Duration) -> u64 {
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// A TTL as `IDEM.BEGIN`'s `ttl-seconds`: whole seconds rounded up, at least
/// 1; saturating.
pub fn ttl_secs(d: std::time::Duration) -> u64 {
    let secs = d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0));
    secs.max(1)
}

fn arity(args: &[&[u8]], min: usize, usage: &str) -> Result<(), Error> {
    if args.len() < min {
        Err(Error::bad_arg(format!(
            "wrong number of arguments, usage: {usage}"
        )))
    } else {
        Ok(())
    }
}

/// A strict unsigned decimal: digits only, no sign, no spaces.
pub fn uint(arg: &[u8], what: &str) -> Result<u64, Error> {
    let bad = || Error::bad_arg(format!("{what} must be a non-negative integer"));
    if arg.is_empty() {
        return Err(bad());
    }
    arg.iter().try_fold(0u64, |n, &b| {
        if !b.is_ascii_digit() {
            return Err(bad());
        }
        n.checked_mul(10)
            .and_then(|n| n.checked_add(u64::from(b - b'0')))
            .ok_or_else(bad)
    })
}

fn ranged(arg: &[u8], what: &str, min: u64, max: u64) -> Result<u64, Error> {
    let v = uint(arg, what)?;
    if v < min || v > max {
        return Err(Error::bad_arg(format!(
            "{what} must be between {min} and {max}"
        )));
    }
    Ok(v)
}

/// A fencing token as issued: 1 ..= i64::MAX.
pub fn token(arg: &[u8]) -> Result<u64, Error> {
    ranged(arg, "token", 1, i64::MAX as u64)
}

fn option_value<'a>(args: &[&'a [u8]], i: usize, name: &str) -> Result<&'a [u8], Error> {
    args.get(i + 1)
        .copied()
        .ok_or_else(|| Error::bad_arg(format!("{name} needs a value")))
}

/// `key fingerprint ttl-seconds [LEASE ms] [WAIT ms] [PACKED]`, resolved for the engine.
pub fn begin<'a>(args: &[&'a [u8]], limits: &Limits) -> Result<Begin<'a>, Error> {
    Ok(begin_args(args, limits)?.resolve(limits))
}

/// `key fingerprint ttl-seconds [LEASE ms] [WAIT ms] [PACKED]`, as sent.
pub fn begin_args<'a>(args: &[&'a [u8]], limits: &Limits) -> Result<BeginArgs<'a>, Error> {
    arity(
        args,
        3,
        "IDEM.BEGIN key fingerprint ttl-seconds [LEASE ms] [WAIT ms] [PACKED]",
    )?;
    let ttl_secs = ranged(args[2], "ttl", 1, limits.max_ttl_secs)?;
    let mut lease_ms = None;
    let mut wait_ms = None;
    let mut replay = ReplayLayout::Fields;
    let mut i = 3;
    while i < args.len() {
        let value = |name| option_value(args, i, name);
        if args[i].eq_ignore_ascii_case(PACKED.as_bytes()) {
            replay = ReplayLayout::Packed;
            i += 1;
            continue;
        }
        if args[i].eq_ignore_ascii_case(b"LEASE") {
            lease_ms = Some(ranged(value("LEASE")?, "LEASE", 1, MAX_MS)?);
        } else if args[i].eq_ignore_ascii_case(b"WAIT") {
            wait_ms = Some(ranged(value("WAIT")?, "WAIT", 0, MAX_MS)?);
        } else {
            return Err(unknown_option(args[i]));
        }
        i += 2;
    }
    Ok(BeginArgs {
        key: args[0],
        fingerprint: args[1],
        ttl_secs,
        lease_ms,
        wait_ms,
        replay,
    })
}

/// `key token status body [HEADER name value]... [MIRRORED]`
pub fn complete<'a>(args: &[&'a [u8]], limits: &Limits) -> Result<Complete<'a>, Error> {
    arity(
        args,
        4,
        "IDEM.COMPLETE key token status body [HEADER name value]... [MIRRORED]",
    )?;
    let token = token(args[1])?;
    let (lo, hi) = (*STATUS_RANGE.start(), *STATUS_RANGE.end());
    let status = ranged(args[2], "status", lo.into(), hi.into())? as u16;
    let body = args[3];
    let mut headers = Vec::new();
    let mut mirrored = false;
    let mut i = 4;
    while i < args.len() {
        if args[i].eq_ignore_ascii_case(b"HEADER") {
            if headers.len() as u64 >= limits.max_headers {
                return Err(Error::TooManyHeaders {
                    max: limits.max_headers,
                });
            }
            let (Some(name), Some(value)) = (args.get(i + 1), args.get(i + 2)) else {
                return Err(Error::bad_arg("HEADER needs a name and a value"));
            };
            if name.is_empty() {
                return Err(Error::bad_arg("HEADER name must not be empty"));
            }
            headers.push(Header {
                name: name.to_vec(),
                value: value.to_vec(),
            });
            i += 3;
        } else if args[i].eq_ignore_ascii_case(b"MIRRORED") {
            mirrored = true;
            i += 1;
        } else {
            return Err(unknown_option(args[i]));
        }
    }
    let size = body.len()
        + headers
            .iter()
            .map(|h| h.name.len() + h.value.len() + HEADER_OVERHEAD)
            .sum::<usize>();
    if size as u64 > limits.max_body_bytes {
        return Err(Error::TooLarge {
            len: size,
            max: limits.max_body_bytes,
        });
    }
    Ok(Complete {
        key: args[0],
        token,
        status,
        body,
        headers,
        mirrored,
    })
}

/// `key token` (ABORT, MIRROR.ACK)
pub fn key_token<'a>(args: &[&'a [u8]], usage: &str) -> Result<KeyToken<'a>, Error> {
    if args.len() != 2 {
        return Err(Error::bad_arg(format!(
            "wrong number of arguments, usage: {usage}"
        )));
    }
    Ok(KeyToken {
        key: args[0],
        token: token(args[1])?,
    })
}

/// `key token lease-ms`
pub fn touch<'a>(args: &[&'a [u8]]) -> Result<Touch<'a>, Error> {
    if args.len() != 3 {
        return Err(Error::bad_arg(
            "wrong number of arguments, usage: IDEM.TOUCH key token lease-ms",
        ));
    }
    Ok(Touch {
        key: args[0],
        token: token(args[1])?,
        lease_ms: ranged(args[2], "lease-ms", 1, MAX_MS)?,
    })
}

/// `count [CLAIM ms] [BLOCK ms]`, a claim up to `MAX_MS`.
pub fn pull(args: &[&[u8]], default_claim_ms: u64) -> Result<Pull, Error> {
    pull_within(args, default_claim_ms, MAX_MS)
}

/// `count [CLAIM ms] [BLOCK ms]` with the claim bounded by `max_claim_ms`
/// (`idem.mirror-max-claim-ms`): a longer `CLAIM` is refused and the
/// default is cut to it, so no caller can hide records from the writer for
/// longer.
pub fn pull_within(
    args: &[&[u8]],
    default_claim_ms: u64,
    max_claim_ms: u64,
) -> Result<Pull, Error> {
    arity(args, 1, "IDEM.MIRROR.PULL count [CLAIM ms] [BLOCK ms]")?;
    let count = ranged(args[0], "count", 1, MAX_PULL as u64)? as usize;
    let max_claim_ms = max_claim_ms.clamp(1, MAX_MS);
    let mut claim_ms = default_claim_ms.min(max_claim_ms);
    let mut block_ms = None;
    let mut i = 1;
    while i < args.len() {
        let value = |name| option_value(args, i, name);
        if args[i].eq_ignore_ascii_case(b"CLAIM") {
            claim_ms = ranged(value("CLAIM")?, "CLAIM", 1, max_claim_ms)?;
        } else if args[i].eq_ignore_ascii_case(b"BLOCK") {
            block_ms = Some(ranged(value("BLOCK")?, "BLOCK", 0, MAX_MS)?);
        } else {
            return Err(unknown_option(args[i]));
        }
        i += 2;
    }
    Ok(Pull {
        count,
        claim_ms,
        block_ms,
    })
}

fn unknown_option(arg: &[u8]) -> Error {
    Error::bad_arg(unknown_option_text(arg))
}

fn unknown_option_text(arg: &[u8]) -> String {
    format!(
        "unknown option '{}'",
        String::from_utf8_lossy(&arg[..arg.len().min(64)])
    )
}

/// Whether a `BADARG` error's text (after the code word) is a module from
/// before `PACKED` refusing that option of `IDEM.BEGIN`.
pub fn refuses_packed(detail: &str) -> bool {
    detail == unknown_option_text(PACKED.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_ttl_secs: 100,
        max_body_bytes: 80,
        default_lease_ms: 500,
        max_headers: 2,
    };

    fn a(s: &str) -> Vec<&[u8]> {
        s.split(' ').map(str::as_bytes).collect()
    }

    #[test]
    fn ttls_round_up_to_whole_seconds() {
        use std::time::Duration;
        assert_eq!(ttl_secs(Duration::ZERO), 1);
        assert_eq!(ttl_secs(Duration::from_millis(1)), 1);
        assert_eq!(ttl_secs(Duration::from_millis(1500)), 2);
        assert_eq!(ttl_secs(Duration::from_secs(86400)), 86400);
        assert_eq!(ttl_secs(Duration::MAX), u64::MAX);
    }

    #[test]
    fn durations_round_up_to_whole_milliseconds() {
        use std::time::Duration;
        assert_eq!(duration_ms(Duration::ZERO), 0);
        assert_eq!(duration_ms(Duration::from_micros(1)), 1);
        assert_eq!(duration_ms(Duration::from_micros(1500)), 2);
        assert_eq!(duration_ms(Duration::from_millis(30_000)), 30_000);
        assert_eq!(duration_ms(Duration::MAX), u64::MAX);
    }

    #[test]
    fn begin_parses_options_in_any_order_and_case() {
        let b = begin(&a("k fp 10 wait 7 LEASE 9"), &LIMITS).unwrap();
        assert_eq!((b.ttl_ms, b.lease_ms, b.wait_ms), (10_000, 9, Some(7)));
        assert_eq!(b.fingerprint.digest(), crate::fingerprint::sha256(b"fp"));
        let b = begin(&a("k fp 1"), &LIMITS).unwrap();
        assert_eq!((b.lease_ms, b.wait_ms), (500, None));
        assert_eq!(b.replay, ReplayLayout::Fields);
        let b = begin(&a("k fp 1 packed LEASE 3"), &LIMITS).unwrap();
        assert_eq!((b.lease_ms, b.replay), (3, ReplayLayout::Packed));
        let b = begin(&a("k fp 1 WAIT 2 PACKED"), &LIMITS).unwrap();
        assert_eq!((b.wait_ms, b.replay), (Some(2), ReplayLayout::Packed));
        // What a module from before `PACKED` answers, and what clients detect.
        let old = unknown_option(b"PACKED").to_string();
        assert!(refuses_packed(old.strip_prefix("BADARG ").unwrap()));
        assert!(!refuses_packed(&unknown_option_text(b"LEASE")));
    }

    #[test]
    fn begin_rejects_bad_input() {
        for bad in [
            "k fp",
            "k fp 0",
            "k fp 101",
            "k fp -1",
            "k fp 1.5",
            "k fp +5",
            "k fp 5 LEASE",
            "k fp 5 LEASE 0",
            "k fp 5 LEASE x",
            "k fp 5 FOO 1",
            "k fp 5 PACKED 1",
            "k fp 5 PACKEDX",
            "k fp 99999999999999999999999",
        ] {
            let e = begin(&a(bad), &LIMITS).unwrap_err();
            assert_eq!(e.code().as_str(), "BADARG", "{bad}");
        }
    }

    #[test]
    fn complete_parses_headers_and_mirrored() {
        let c = complete(&a("k 5 201 body HEADER a b MIRRORED header c d"), &LIMITS).unwrap();
        assert_eq!(c.token, 5);
        assert_eq!(c.status, 201);
        assert!(c.mirrored);
        assert_eq!(c.headers.len(), 2);
        assert_eq!(c.headers[1].name, b"c");
    }

    #[test]
    fn complete_rejects_bad_input() {
        for bad in [
            "k 5 99 b",
            "k 5 600 b",
            "k 0 200 b",
            "k x 200 b",
            "k 5 200 b HEADER a",
            "k 5 200 b HEADER  v",
            "k 5 200 b EXTRA",
            "k 9223372036854775808 200 b",
        ] {
            assert_eq!(
                complete(&a(bad), &LIMITS).unwrap_err().code().as_str(),
                "BADARG",
                "{bad}"
            );
        }
    }

    #[test]
    fn complete_bounds_the_response_and_its_headers() {
        let body = |n: usize| "b".repeat(n);
        assert!(complete(&a(&format!("k 5 200 {}", body(80))), &LIMITS).is_ok());
        let e = complete(&a(&format!("k 5 200 {}", body(81))), &LIMITS).unwrap_err();
        assert_eq!(
            e.to_string(),
            "TOOLARGE body is 81 bytes, max-body-bytes is 80"
        );
        // Each header counts HEADER_OVERHEAD besides its name and value.
        let at = format!("k 5 200 {} HEADER ab cd", body(80 - 4 - HEADER_OVERHEAD));
        assert!(complete(&a(&at), &LIMITS).is_ok());
        let over = format!("k 5 200 {} HEADER ab cd", body(81 - 4 - HEADER_OVERHEAD));
        let e = complete(&a(&over), &LIMITS).unwrap_err();
        assert_eq!(e.code().as_str(), "TOOLARGE");
        // max-headers: at the limit, then one more.
        assert!(complete(&a("k 5 200 b HEADER a b HEADER c d"), &LIMITS).is_ok());
        let e = complete(&a("k 5 200 b HEADER a b HEADER c d HEADER e f"), &LIMITS).unwrap_err();
        assert_eq!(e.to_string(), "TOOLARGE more than 2 headers (max-headers)");
    }

    #[test]
    fn pull_and_touch() {
        let p = pull(&a("10 BLOCK 5 CLAIM 7"), 30_000).unwrap();
        assert_eq!((p.count, p.claim_ms, p.block_ms), (10, 7, Some(5)));
        assert!(pull(&a("0"), 1).is_err());
        assert!(pull(&a("10001"), 1).is_err());
        assert_eq!(touch(&a("k 3 100")).unwrap().lease_ms, 100);
        assert!(touch(&a("k 3 0")).is_err());
        assert!(key_token(&a("k 3 4"), "x").is_err());
    }

    #[test]
    fn pull_claims_are_bounded() {
        assert_eq!(pull_within(&a("1"), 30_000, 5_000).unwrap().claim_ms, 5_000);
        assert_eq!(
            pull_within(&a("1 CLAIM 5000"), 30_000, 5_000)
                .unwrap()
                .claim_ms,
            5_000
        );
        let e = pull_within(&a("1 CLAIM 5001"), 30_000, 5_000).unwrap_err();
        assert_eq!(e.to_string(), "BADARG CLAIM must be between 1 and 5000");
    }
}
