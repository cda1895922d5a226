//! Property fuzzing of the argument parsers (`idem_core::args`): arbitrary
//! byte arguments never panic and fail only with BADARG or TOOLARGE, and
//! well-formed arguments in any option order and case parse to exactly what
//! they say. Many cases; runs in a few seconds in release.

use idem_core::args::{self, Limits};
use idem_core::wire::ErrorCode::{self, BadArg, TooLarge};
use proptest::prelude::*;

const LIMITS: Limits = Limits {
    max_ttl_secs: 2_592_000,
    max_body_bytes: 128,
    default_lease_ms: 30_000,
    max_headers: 3,
};
/// The documented cap of LEASE, WAIT, CLAIM, BLOCK and lease-ms: one year.
const YEAR_MS: u64 = 366 * 24 * 3600 * 1000;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 20_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Words the parsers react to, numbers at and beyond every bound, junk.
fn word() -> impl Strategy<Value = Vec<u8>> {
    let special: Vec<&'static [u8]> = vec![
        b"LEASE",
        b"lease",
        b"WAIT",
        b"wAiT",
        b"HEADER",
        b"MIRRORED",
        b"CLAIM",
        b"BLOCK",
        b"",
        b"0",
        b"1",
        b"-1",
        b"+1",
        b" 1",
        b"1 ",
        b"01",
        b"99",
        b"100",
        b"599",
        b"600",
        b"2592000",
        b"2592001",
        b"10000",
        b"10001",
        b"31622400000",
        b"31622400001",
        b"9007199254740992",
        b"9223372036854775807",
        b"9223372036854775808",
        b"18446744073709551615",
        b"18446744073709551616",
        b"1e3",
        b"0x10",
        b"\x00",
        b"\xff\xfe",
    ];
    prop_oneof![
        3 => proptest::sample::select(special).prop_map(<[u8]>::to_vec),
        1 => proptest::collection::vec(any::<u8>(), 0..24),
        1 => any::<u64>().prop_map(|n| n.to_string().into_bytes()),
    ]
}

fn words(max: usize) -> impl Strategy<Value = Vec<Vec<u8>>> {
    proptest::collection::vec(word(), 0..max)
}

fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
    v.iter().map(Vec::as_slice).collect()
}

fn only_documented<T: std::fmt::Debug>(r: Result<T, idem_core::Error>, codes: &[ErrorCode]) {
    if let Err(e) = r {
        assert!(codes.contains(&e.code()), "unexpected error {e}");
        assert!(e.to_string().starts_with(e.code().as_str()), "{e}");
    }
}

/// An option list for BEGIN / PULL in random order and case, with the value
/// the parser must end up with (the last occurrence wins).
fn options() -> impl Strategy<Value = Vec<(usize, bool, u64)>> {
    let ms = prop_oneof![
        Just(0),
        Just(1),
        Just(YEAR_MS),
        Just(YEAR_MS + 1),
        0..=YEAR_MS + 1,
    ];
    proptest::collection::vec((0..2usize, any::<bool>(), ms), 0..5)
}

/// Whether every option value is in range (`min_first`: the lower bound of
/// the first option, LEASE or CLAIM; the second, WAIT or BLOCK, may be 0).
fn options_valid(opts: &[(usize, bool, u64)], min_first: u64) -> bool {
    opts.iter()
        .all(|&(i, _, n)| n <= YEAR_MS && (i == 1 || n >= min_first))
}

fn option_args(names: [&str; 2], opts: &[(usize, bool, u64)]) -> Vec<Vec<u8>> {
    opts.iter()
        .flat_map(|&(i, lower, n)| {
            let name = if lower {
                names[i].to_lowercase()
            } else {
                names[i].to_string()
            };
            [name.into_bytes(), n.to_string().into_bytes()]
        })
        .collect()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn any_begin_arguments_are_parsed_or_refused(a in words(9)) {
        only_documented(args::begin(&refs(&a), &LIMITS), &[BadArg]);
    }

    #[test]
    fn any_complete_arguments_are_parsed_or_refused(a in words(12)) {
        only_documented(args::complete(&refs(&a), &LIMITS), &[BadArg, TooLarge]);
    }

    #[test]
    fn any_key_token_touch_pull_arguments_are_parsed_or_refused(a in words(7)) {
        let a = refs(&a);
        only_documented(args::key_token(&a, "usage"), &[BadArg]);
        only_documented(args::touch(&a), &[BadArg]);
        only_documented(args::pull(&a, 30_000), &[BadArg]);
    }

    #[test]
    fn uint_is_exactly_a_plain_decimal(a in word()) {
        let expect = std::str::from_utf8(&a)
            .ok()
            .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse::<u64>().ok());
        prop_assert_eq!(args::uint(&a, "n").ok(), expect);
    }

    #[test]
    fn token_accepts_exactly_1_to_i64_max(n in any::<u64>()) {
        let ok = args::token(n.to_string().as_bytes()).ok();
        prop_assert_eq!(ok, (1..=i64::MAX as u64).contains(&n).then_some(n));
    }

    #[test]
    fn well_formed_begin_parses_to_what_it_says(
        key in proptest::collection::vec(any::<u8>(), 0..16),
        fp in proptest::collection::vec(any::<u8>(), 0..16),
        ttl in 0u64..=LIMITS.max_ttl_secs + 1,
        opts in options(),
    ) {
        let mut a = vec![key.clone(), fp.clone(), ttl.to_string().into_bytes()];
        a.extend(option_args(["LEASE", "WAIT"], &opts));
        let lease = opts.iter().rev().find(|o| o.0 == 0).map(|o| o.2);
        let wait = opts.iter().rev().find(|o| o.0 == 1).map(|o| o.2);
        let valid = (1..=LIMITS.max_ttl_secs).contains(&ttl)
            && options_valid(&opts, 1);
        match args::begin(&refs(&a), &LIMITS) {
            Ok(b) => {
                prop_assert!(valid);
                prop_assert_eq!(b.key, &key[..]);
                prop_assert_eq!(b.fingerprint.digest(), idem_core::fingerprint::sha256(&fp));
                prop_assert_eq!(b.ttl_ms, ttl * 1000);
                prop_assert_eq!(b.lease_ms, lease.unwrap_or(LIMITS.default_lease_ms));
                prop_assert_eq!(b.wait_ms, wait);
            }
            Err(e) => {
                prop_assert!(!valid, "valid BEGIN refused: {}", e);
                prop_assert_eq!(e.code(), BadArg);
            }
        }
    }

    #[test]
    fn well_formed_complete_parses_to_what_it_says(
        token in 0u64..=i64::MAX as u64 + 1,
        status in 98u16..602,
        body in proptest::collection::vec(any::<u8>(), 0..48),
        headers in proptest::collection::vec(
            (proptest::collection::vec(any::<u8>(), 1..8), proptest::collection::vec(any::<u8>(), 0..8)),
            0..4,
        ),
        mirrored_at in proptest::option::of(0usize..5),
        lower in any::<bool>(),
    ) {
        let word = |w: &str| if lower { w.to_lowercase() } else { w.to_string() }.into_bytes();
        let mut a = vec![b"k".to_vec(), token.to_string().into_bytes(), status.to_string().into_bytes(), body.clone()];
        for (i, (n, v)) in headers.iter().enumerate() {
            if mirrored_at == Some(i) {
                a.push(word("MIRRORED"));
            }
            a.extend([word("HEADER"), n.clone(), v.clone()]);
        }
        if mirrored_at.is_some_and(|i| i >= headers.len()) {
            a.push(word("MIRRORED"));
        }
        let size = body.len()
            + headers.iter().map(|(n, v)| n.len() + v.len() + args::HEADER_OVERHEAD).sum::<usize>();
        let too_many = headers.len() as u64 > LIMITS.max_headers;
        let valid_args = (1..=i64::MAX as u64).contains(&token) && (100..=599).contains(&status);
        match args::complete(&refs(&a), &LIMITS) {
            Ok(c) => {
                prop_assert!(valid_args && !too_many && size as u64 <= LIMITS.max_body_bytes);
                prop_assert_eq!((c.token, c.status, c.body), (token, status, &body[..]));
                prop_assert_eq!(c.mirrored, mirrored_at.is_some());
                let got: Vec<(Vec<u8>, Vec<u8>)> =
                    c.headers.iter().map(|h| (h.name.clone(), h.value.clone())).collect();
                prop_assert_eq!(got, headers);
            }
            Err(e) if !valid_args => prop_assert_eq!(e.code(), BadArg),
            Err(e) => {
                prop_assert!(too_many || size as u64 > LIMITS.max_body_bytes, "valid COMPLETE refused: {}", e);
                prop_assert_eq!(e.code(), TooLarge);
            }
        }
    }

    #[test]
    fn well_formed_pull_and_touch_parse_to_what_they_say(
        count in 0u64..10_002,
        opts in options(),
        lease in 0u64..=YEAR_MS + 1,
        token in 0u64..4,
    ) {
        let mut a = vec![count.to_string().into_bytes()];
        a.extend(option_args(["CLAIM", "BLOCK"], &opts));
        let claim = opts.iter().rev().find(|o| o.0 == 0).map(|o| o.2);
        let block = opts.iter().rev().find(|o| o.0 == 1).map(|o| o.2);
        let valid = (1..=10_000).contains(&count) && options_valid(&opts, 1);
        match args::pull(&refs(&a), 777) {
            Ok(p) => {
                prop_assert!(valid);
                prop_assert_eq!(p.count as u64, count);
                prop_assert_eq!(p.claim_ms, claim.unwrap_or(777));
                prop_assert_eq!(p.block_ms, block);
            }
            Err(e) => prop_assert!(!valid && e.code() == BadArg, "{}", e),
        }

        let t = [b"k".to_vec(), token.to_string().into_bytes(), lease.to_string().into_bytes()];
        match args::touch(&refs(&t)) {
            Ok(t) => {
                prop_assert!(token >= 1 && (1..=YEAR_MS).contains(&lease));
                prop_assert_eq!((t.token, t.lease_ms), (token, lease));
            }
            Err(e) => prop_assert!(token == 0 || !(1..=YEAR_MS).contains(&lease), "{}", e),
        }
    }
}

#[test]
fn bounds_are_exact() {
    let ok = |a: &[&str]| {
        let a: Vec<&[u8]> = a.iter().map(|s| s.as_bytes()).collect();
        args::begin(&a, &LIMITS).is_ok()
    };
    let year = YEAR_MS.to_string();
    let past = (YEAR_MS + 1).to_string();
    assert!(ok(&["k", "f", "2592000", "LEASE", &year, "WAIT", &year]));
    assert!(!ok(&["k", "f", "2592001"]));
    assert!(!ok(&["k", "f", "1", "LEASE", &past]));
    assert!(!ok(&["k", "f", "1", "WAIT", &past]));
    assert!(ok(&["k", "f", "1", "WAIT", "0"]));
}
