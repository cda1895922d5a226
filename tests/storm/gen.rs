//! The storm's command generator: IDEM.* commands with random arity, option
//! order and case, numbers at and beyond every bound, binary junk, keys of
//! other types, MULTI and Lua wrapping, forged RESTORE payloads and CONFIG
//! SET extremes. Never names a sentinel key in a command that could change
//! it legitimately (only IDEM.* with tokens nobody was given), and never
//! blocks (valid WAIT and BLOCK values become 0).

use rand::rngs::StdRng;
use rand::RngExt;

use super::dump::{self, Dump};

pub type Args = Vec<Vec<u8>>;

/// One unit sent in order: a plain command, or a MULTI ... EXEC block.
pub enum Item {
    Plain(Args),
    Multi(Vec<Args>),
}

pub struct Gen {
    pub rng: StdRng,
    /// Keys the storm owns (any command may touch them).
    keys: Vec<String>,
    /// Keys holding other types.
    others: Vec<String>,
    /// Sentinel keys: only IDEM.* commands with foreign tokens.
    sentinels: Vec<String>,
    /// Tokens the storm's own BEGINs were given, and their keys.
    pub tokens: Vec<(Vec<u8>, u64)>,
    /// Real DUMPs of records, to forge from.
    pub dumps: Vec<Dump>,
    /// Forge field values in RESTORE payloads (else only their structure).
    pub forge_fields: bool,
}

const IDEM: [&str; 8] = [
    "IDEM.BEGIN",
    "IDEM.COMPLETE",
    "IDEM.ABORT",
    "IDEM.TOUCH",
    "IDEM.GET",
    "IDEM.MIRROR.PULL",
    "IDEM.MIRROR.ACK",
    "IDEM._PUT",
];
const OPTIONS: [&str; 7] = [
    "LEASE", "WAIT", "HEADER", "MIRRORED", "CLAIM", "BLOCK", "NOSUCH",
];
const NUMBERS: [&str; 24] = [
    "0",
    "1",
    "2",
    "-1",
    "+1",
    "01",
    " 1",
    "1.5",
    "1e3",
    "99",
    "100",
    "599",
    "600",
    "10000",
    "10001",
    "2592000",
    "2592001",
    "31622400000",
    "31622400001",
    "9007199254740992",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551616",
    "-9223372036854775809",
];
/// Values a config may be set to: bounds, beyond, junk.
const CONFIG_VALUES: [&str; 12] = [
    "0",
    "1",
    "-1",
    "100",
    "1048576",
    "31622400000",
    "31622400001",
    "315360000",
    "315360001",
    "1073741824",
    "9223372036854775808",
    "abc",
];
const CONFIGS: [&str; 5] = [
    "idem.lease-ms",
    "idem.max-ttl",
    "idem.max-body-bytes",
    "idem.mirror-claim-ms",
    "idem.nosuch",
];

impl Gen {
    pub fn new(rng: StdRng, thread: usize, sentinels: Vec<String>, dumps: Vec<Dump>) -> Gen {
        Gen {
            rng,
            keys: (0..12).map(|i| format!("s:{thread}:{i}")).collect(),
            others: ["str", "hash", "list"]
                .iter()
                .map(|t| format!("o:{thread}:{t}"))
                .collect(),
            sentinels,
            tokens: Vec::new(),
            dumps,
            forge_fields: false,
        }
    }

    fn pick<'a>(&mut self, v: &'a [String]) -> &'a [u8] {
        v[self.rng.random_range(0..v.len())].as_bytes()
    }

    fn own_key(&mut self) -> Vec<u8> {
        let keys = std::mem::take(&mut self.keys);
        let k = self.pick(&keys).to_vec();
        self.keys = keys;
        k
    }

    /// Any key an IDEM.* command may name.
    fn idem_key(&mut self) -> Vec<u8> {
        match self.rng.random_range(0..10) {
            0..=5 => self.own_key(),
            6 => {
                let o = std::mem::take(&mut self.others);
                let k = self.pick(&o).to_vec();
                self.others = o;
                k
            }
            7 | 8 => {
                let s = std::mem::take(&mut self.sentinels);
                let k = self.pick(&s).to_vec();
                self.sentinels = s;
                k
            }
            _ => self.junk(),
        }
    }

    fn junk(&mut self) -> Vec<u8> {
        let n = [0, 1, 3, 17, 100][self.rng.random_range(0..5)];
        (0..n).map(|_| self.rng.random()).collect()
    }

    /// `usual` with probability `p`, else what `other` makes.
    fn mostly(&mut self, p: f64, usual: &[u8], other: fn(&mut Gen) -> Vec<u8>) -> Vec<u8> {
        if self.rng.random_bool(p) {
            usual.to_vec()
        } else {
            other(self)
        }
    }

    fn number(&mut self) -> Vec<u8> {
        match self.rng.random_range(0..10) {
            0..=5 => NUMBERS[self.rng.random_range(0..NUMBERS.len())].into(),
            6 => self.rng.random::<u64>().to_string().into(),
            7 => self.rng.random_range(0..1000u64).to_string().into(),
            8 => self.token(),
            _ => self.junk(),
        }
    }

    /// A token: mostly one the storm was given, else any number.
    fn token(&mut self) -> Vec<u8> {
        if !self.tokens.is_empty() && self.rng.random_bool(0.7) {
            let t = self.tokens[self.rng.random_range(0..self.tokens.len())].1;
            let t = match self.rng.random_range(0..4) {
                0 => t.wrapping_add(1),
                1 => t.wrapping_sub(1),
                _ => t,
            };
            t.to_string().into()
        } else {
            NUMBERS[self.rng.random_range(0..NUMBERS.len())].into()
        }
    }

    fn word(&mut self, w: &str) -> Vec<u8> {
        match self.rng.random_range(0..3) {
            0 => w.to_lowercase().into(),
            _ => w.into(),
        }
    }

    /// Options in random order, each followed by a value (or not).
    fn options(&mut self, names: &[&str]) -> Args {
        let mut out = Args::new();
        for _ in 0..self.rng.random_range(0..4) {
            let name = if self.rng.random_bool(0.9) {
                names[self.rng.random_range(0..names.len())]
            } else {
                OPTIONS[self.rng.random_range(0..OPTIONS.len())]
            };
            out.push(self.word(name));
            match name {
                "HEADER" => {
                    let (n, v) = (self.junk(), self.junk());
                    out.push(if self.rng.random_bool(0.9) {
                        b"h".to_vec()
                    } else {
                        n
                    });
                    if self.rng.random_bool(0.95) {
                        out.push(v);
                    }
                }
                "MIRRORED" => {}
                _ => {
                    if self.rng.random_bool(0.95) {
                        out.push(self.number());
                    }
                }
            }
        }
        out
    }

    fn body(&mut self) -> Vec<u8> {
        let n = [0, 5, 200, 3000][self.rng.random_range(0..4)];
        (0..n).map(|_| self.rng.random()).collect()
    }

    /// A (mostly malformed) IDEM.* command.
    pub fn idem(&mut self) -> Args {
        let name = IDEM[self.rng.random_range(0..IDEM.len())];
        let mut a: Args = vec![self.word(name)];
        let key = self.idem_key();
        match name {
            "IDEM.BEGIN" => {
                a.push(key);
                a.push(self.mostly(0.8, b"fp", Gen::junk));
                a.push(self.number());
                a.extend(self.options(&["LEASE", "WAIT"]));
            }
            "IDEM.COMPLETE" => {
                a.push(key);
                a.push(self.token());
                a.push(self.mostly(0.7, b"200", Gen::number));
                a.push(self.body());
                a.extend(self.options(&["HEADER", "MIRRORED"]));
            }
            "IDEM.ABORT" | "IDEM.MIRROR.ACK" => {
                a.push(key);
                a.push(self.token());
            }
            "IDEM.TOUCH" => {
                a.push(key);
                a.push(self.token());
                a.push(self.number());
            }
            "IDEM.GET" => a.push(key),
            "IDEM.MIRROR.PULL" => {
                a.push(self.number());
                a.extend(self.options(&["CLAIM", "BLOCK"]));
            }
            _ => {
                a.push(key);
                a.push(self.junk());
            }
        }
        // Random arity: drop, duplicate or append arguments.
        match self.rng.random_range(0..8) {
            0 if a.len() > 1 => {
                let i = self.rng.random_range(1..a.len());
                a.remove(i);
            }
            1 => {
                let i = self.rng.random_range(1..a.len().max(2));
                let dup = a[i.min(a.len() - 1)].clone();
                a.insert(i.min(a.len()), dup);
            }
            2 => a.push(self.junk()),
            3 => a.truncate(self.rng.random_range(1..=a.len())),
            _ => {}
        }
        cap_blocking(&mut a);
        a
    }

    /// A BEGIN that creates or takes over a storm key (its token is recorded
    /// from the reply), or a valid follow-up on a storm key.
    pub fn valid(&mut self) -> Args {
        let (key, token) = match self.tokens.len() {
            n if n > 0 && self.rng.random_bool(0.8) => {
                // One of the latest holders.
                let (k, t) = self.tokens[self.rng.random_range(n.saturating_sub(8)..n)].clone();
                (k, t.to_string().into_bytes())
            }
            _ => (self.own_key(), self.token()),
        };
        match self.rng.random_range(0..5) {
            0 | 1 => vec![
                b"IDEM.BEGIN".to_vec(),
                key,
                b"fp".to_vec(),
                b"600".to_vec(),
                b"LEASE".to_vec(),
                self.rng.random_range(1..200u64).to_string().into(),
            ],
            2 => {
                let body = self.body();
                vec![b"IDEM.COMPLETE".to_vec(), key, token, b"201".to_vec(), body]
            }
            3 => vec![b"IDEM.ABORT".to_vec(), key, token],
            _ => vec![b"IDEM.TOUCH".to_vec(), key, token, b"1000".to_vec()],
        }
    }

    /// Commands of other kinds on the storm's own keys.
    pub fn other(&mut self) -> Args {
        let k = self.own_key();
        let k2 = self.own_key();
        let o = std::mem::take(&mut self.others);
        let ok = self.pick(&o).to_vec();
        self.others = o;
        let n = self.number();
        // TTLs up to ten years, or malformed: farther ones make the module
        // write records it cannot load (tests/expiry_bounds.rs).
        let ttl = match std::str::from_utf8(&n)
            .ok()
            .and_then(|s| s.parse::<i64>().ok())
        {
            Some(ms) if ms > 315_360_000_000 => b"315360000000".to_vec(),
            _ => n.clone(),
        };
        let v: Vec<&[u8]> = match self.rng.random_range(0..16) {
            0 => vec![b"SET", &ok, b"value"],
            1 => vec![b"HSET", &ok, b"f", b"v"],
            2 => vec![b"LPUSH", &ok, b"x"],
            3 => vec![b"DEL", &k],
            4 => vec![b"PEXPIRE", &k, &ttl],
            5 => vec![b"PERSIST", &k],
            6 => vec![b"RENAME", &k, &k2],
            7 => vec![b"COPY", &k, &k2, b"REPLACE"],
            8 => vec![b"MOVE", &k, b"1"],
            9 => vec![b"TYPE", &k],
            10 => vec![b"MEMORY", b"USAGE", &k],
            11 => vec![b"DUMP", &k],
            12 => vec![b"OBJECT", b"ENCODING", &k],
            13 => vec![b"SET", &k, b"plain"],
            14 => vec![b"DEBUG", b"DIGEST-VALUE", &k],
            _ => vec![b"UNLINK", &k2],
        };
        v.into_iter().map(<[u8]>::to_vec).collect()
    }

    /// RESTORE of a forged, a genuine or a junk payload onto a storm key.
    pub fn restore(&mut self) -> Args {
        let key = self.own_key();
        let payload = match self.rng.random_range(0..10) {
            0 => self.junk(),
            1 => {
                let d = &self.dumps[self.rng.random_range(0..self.dumps.len())];
                d.build(&d.record.clone())
            }
            _ => {
                let d = self.dumps[self.rng.random_range(0..self.dumps.len())].clone();
                let mut r = d.record.clone();
                for _ in 0..self.rng.random_range(1..3) {
                    r = dump::mutate(&r, &mut self.rng, self.forge_fields);
                }
                d.build(&r)
            }
        };
        vec![
            b"RESTORE".to_vec(),
            key,
            b"0".to_vec(),
            payload,
            b"REPLACE".to_vec(),
        ]
    }

    /// MULTI ... EXEC around a few commands.
    pub fn multi(&mut self) -> Item {
        let n = self.rng.random_range(1..5);
        Item::Multi(
            (0..n)
                .map(|_| {
                    if self.rng.random_bool(0.5) {
                        self.valid()
                    } else {
                        self.idem()
                    }
                })
                .collect(),
        )
    }

    /// An IDEM.* command run from Lua (`redis.call` or `redis.pcall`).
    pub fn lua(&mut self) -> Args {
        let inner = if self.rng.random_bool(0.5) {
            self.valid()
        } else {
            self.idem()
        };
        let call = if self.rng.random_bool(0.5) {
            "call"
        } else {
            "pcall"
        };
        let mut a: Args = vec![
            b"EVAL".to_vec(),
            format!("return redis.{call}(unpack(ARGV))").into_bytes(),
            b"0".to_vec(),
        ];
        a.extend(inner);
        a
    }

    /// CONFIG SET of an idem config to a bound, beyond it, or junk.
    pub fn config(&mut self) -> Args {
        vec![
            b"CONFIG".to_vec(),
            b"SET".to_vec(),
            CONFIGS[self.rng.random_range(0..CONFIGS.len())].into(),
            CONFIG_VALUES[self.rng.random_range(0..CONFIG_VALUES.len())].into(),
        ]
    }
}

/// Valid WAIT and BLOCK values become 0 (answer at once): the storm
/// pipelines, and blocking is its own test.
fn cap_blocking(a: &mut Args) {
    for i in 0..a.len().saturating_sub(1) {
        if a[i].eq_ignore_ascii_case(b"WAIT") || a[i].eq_ignore_ascii_case(b"BLOCK") {
            let v = std::str::from_utf8(&a[i + 1])
                .ok()
                .and_then(|s| s.parse::<u64>().ok());
            if v.is_some_and(|v| v > 0) {
                a[i + 1] = b"0".to_vec();
            }
        }
    }
}
