//! The Functions library (functions/idem.lua) against the module: two
//! servers, one with the module, one run as a managed service runs Redis
//! (no module, MODULE/DEBUG/CONFIG renamed away) with the library loaded;
//! the same histories on both, every reply compared as the bytes sent
//! (RESP2 and RESP3) once tokens and times are normalised. Then targeted
//! checks: WRONGTYPE and CORRUPT, token growth per key, the outbox, a
//! replica, the scripts form, a missing library, OOM, and that the library
//! touches no key it was not given.

mod functions_kit;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use functions_kit::{load_library, scripts_form, show, spec_version, Outboxes, RawConn, Resp};
use idem_testkit::managed::ManagedServer;
use idem_testkit::{RedisConfig, RedisServer};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after epoch")
        .as_millis() as i64
}

fn sleep_ms(ms: u64) {
    std::thread::sleep(Duration::from_millis(ms));
}

fn b(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

fn ok_status() -> Resp {
    Resp::Line(b'+', b"OK".to_vec())
}

/// A managed server with the library loaded.
fn library_server(args: &[&str]) -> ManagedServer {
    let server = ManagedServer::start(args);
    load_library(&mut RawConn::connect(server.port, false));
    server
}

// ---------------------------------------------------------------------------
// One command, as the module and the library are called for it.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cmd {
    Begin,
    Complete,
    Abort,
    Touch,
    Get,
    Ack,
}

impl Cmd {
    fn module(self) -> &'static str {
        match self {
            Cmd::Begin => "IDEM.BEGIN",
            Cmd::Complete => "IDEM.COMPLETE",
            Cmd::Abort => "IDEM.ABORT",
            Cmd::Touch => "IDEM.TOUCH",
            Cmd::Get => "IDEM.GET",
            Cmd::Ack => "IDEM.MIRROR.ACK",
        }
    }

    fn function(self) -> &'static str {
        match self {
            Cmd::Begin => "idem_begin",
            Cmd::Complete => "idem_complete",
            Cmd::Abort => "idem_abort",
            Cmd::Touch => "idem_touch",
            Cmd::Get => "idem_get",
            Cmd::Ack => "idem_mirror_ack",
        }
    }

    /// Whether the function takes the key's outbox as its second key.
    fn with_outbox(self) -> bool {
        matches!(self, Cmd::Complete | Cmd::Ack)
    }
}

/// An argument: bytes, or a token the history was issued (by its number in
/// the order of issue), which each server spells its own way.
#[derive(Debug, Clone)]
enum Arg {
    Bytes(Vec<u8>),
    /// `pad`: with leading zeros (the module reads "007" as 7).
    Token {
        sym: usize,
        pad: bool,
    },
}

/// How the library is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Fcall,
    /// FCALL_RO (idem_get only).
    FcallRo,
    /// EVALSHA of the scripts form.
    Evalsha,
}

/// One server's side of a pair: its connections (RESP2, RESP3) and the
/// tokens it issued, by order of issue. Tokens are told apart per key: the
/// module's are unique on the node, the library's only for their key.
struct Side {
    conns: [RawConn; 2],
    issued: Vec<(Vec<u8>, i64)>,
    symbols: HashMap<(Vec<u8>, i64), usize>,
    /// The largest token issued per key: tokens only grow for a key.
    key_max: HashMap<Vec<u8>, i64>,
}

impl Side {
    /// Connections to `port`, authenticated as `user` when given.
    fn new(port: u16, user: Option<&str>) -> Side {
        let mut conns = [RawConn::connect(port, false), RawConn::connect(port, true)];
        if let Some(user) = user {
            for c in &mut conns {
                c.ok(&[b"AUTH", user.as_bytes(), b"-"]);
            }
        }
        Side {
            conns,
            issued: Vec::new(),
            symbols: HashMap::new(),
            key_max: HashMap::new(),
        }
    }

    fn resolve(&self, arg: &Arg) -> Vec<u8> {
        match arg {
            Arg::Bytes(bytes) => bytes.clone(),
            Arg::Token { sym, pad } => {
                let t = self.issued[*sym].1.to_string();
                if *pad {
                    format!("00{t}").into_bytes()
                } else {
                    t.into_bytes()
                }
            }
        }
    }

    /// A token a `new` answered: numbered if fresh (order of issue); it
    /// must be larger than every token the key had.
    fn issue(&mut self, key: &[u8], token: i64) -> Result<usize, String> {
        let id = (key.to_vec(), token);
        if self.symbols.contains_key(&id) {
            return Err(format!("token {token} issued twice for the key"));
        }
        let max = self.key_max.entry(key.to_vec()).or_insert(0);
        if token <= *max {
            return Err(format!("token {token} not above {max}, the key's last"));
        }
        *max = token;
        self.issued.push(id.clone());
        self.symbols.insert(id, self.issued.len() - 1);
        Ok(self.issued.len() - 1)
    }

    /// A token of `key` in a reply, as its number; an unknown one is an
    /// error.
    fn symbol(&self, key: &[u8], token: i64) -> Result<usize, String> {
        self.symbols
            .get(&(key.to_vec(), token))
            .copied()
            .ok_or_else(|| format!("token {token} was never issued for the key"))
    }
}

/// What a reply holds, for normalising it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Begin,
    Get,
    Other,
}

/// Replaces tokens by their numbers and times (absolute, or the retry of
/// `in_flight`) by 0, collecting the times in order.
fn normalise(
    shape: Shape,
    key: &[u8],
    reply: &mut Resp,
    side: &mut Side,
    times: &mut Vec<i64>,
) -> Result<(), String> {
    let Some(items) = reply.items_mut() else {
        return Ok(());
    };
    match shape {
        Shape::Begin if items.len() == 2 => {
            let Some(v) = items[1].int() else {
                return Ok(());
            };
            match items[0].bulk() {
                Some(b"new") => items[1] = Resp::new_int(side.issue(key, v)? as i64),
                Some(b"in_flight") => {
                    times.push(v);
                    items[1] = Resp::new_int(0);
                }
                _ => {}
            }
        }
        Shape::Get => {
            for i in (0..items.len().saturating_sub(1)).step_by(2) {
                let Some(v) = items[i + 1].int() else {
                    continue;
                };
                match items[i].bulk() {
                    Some(b"token") => items[i + 1] = Resp::new_int(side.symbol(key, v)? as i64),
                    Some(b"created_at" | b"lease_until" | b"completed_at") => {
                        times.push(v);
                        items[i + 1] = Resp::new_int(0);
                    }
                    Some(b"expires_at") if v != -1 => {
                        times.push(v);
                        items[i + 1] = Resp::new_int(0);
                    }
                    _ => {}
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// An IDEM.MIRROR.PULL entry, normalised.
fn normalise_entry(entry: &mut Resp, side: &Side, times: &mut Vec<i64>) -> Result<(), String> {
    let items = entry.items_mut().ok_or("an entry that is not an array")?;
    if items.len() != 9 {
        return Err(format!("an entry of {} fields", items.len()));
    }
    let key = items[0]
        .bulk()
        .ok_or("a key that is not a string")?
        .to_vec();
    let token = items[1].int().ok_or("a token that is not an integer")?;
    items[1] = Resp::new_int(side.symbol(&key, token)? as i64);
    for i in [6, 7, 8] {
        let v = items[i].int().ok_or("a time that is not an integer")?;
        if v != -1 {
            times.push(v);
            items[i] = Resp::new_int(0);
        }
    }
    Ok(())
}

/// The ACL user the library is called as: before each call it is allowed
/// exactly the call's keys, so a key the library touched without being
/// given it would answer NOPERM.
const LIMITED: &str = "idem-keys";

/// `ACL SETUSER user resetkeys` and a read-write pattern matching exactly
/// each of `keys` (a byte ACL rules cannot hold matches any byte there).
fn allow_only(admin: &mut RawConn, user: &str, keys: &[Vec<u8>]) {
    let mut args: Vec<Vec<u8>> = vec![b("ACL"), b("SETUSER"), b(user), b("resetkeys")];
    for key in keys {
        let mut pattern = b"%RW~".to_vec();
        for &ch in key {
            match ch {
                // ACL rules take no NUL or whitespace: any byte there.
                0 | b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ' => pattern.push(b'?'),
                b'*' | b'?' | b'[' | b']' | b'\\' => pattern.extend([b'\\', ch]),
                _ => pattern.push(ch),
            }
        }
        args.push(pattern);
    }
    let r = admin.call_vec(&args);
    assert!(r.error().is_none(), "ACL SETUSER: {r:?}");
}

/// The two servers and the history run on them so far.
struct Pair {
    _module_server: RedisServer,
    library_server: ManagedServer,
    module: Side,
    library: Side,
    /// The library server as its default user.
    admin: RawConn,
    sha: Vec<u8>,
    outboxes: Outboxes,
    /// Every op and both replies, printed when they differ.
    log: Vec<String>,
    /// The longest a call took on both servers (ms): how far apart the two
    /// servers' clocks read for one op, the tolerance of time comparisons.
    spread_ms: i64,
    /// Deadlines (leases, expiries, claims) as client-time windows: no op
    /// runs close to one, where the two servers could decide apart.
    deadlines: Vec<(i64, i64)>,
    /// Keys the history used (the ones a claim is asked about).
    keys: Vec<Vec<u8>>,
    /// When the last op started and ended (client clock, ms).
    last: (i64, i64),
    /// How often each command got each kind of answer (the module's).
    stats: BTreeMap<String, usize>,
}

/// A reply's kind, for the statistics: the outcome word, the error code,
/// or the type.
fn kind(reply: &Resp) -> String {
    if let Some(e) = reply.error() {
        return e.split(' ').next().unwrap_or_default().to_string();
    }
    if reply.is_null() {
        return "nil".into();
    }
    if let Some(v) = reply.int() {
        return if v <= 1 { format!("{v}") } else { "n".into() };
    }
    if let Resp::Line(b'+', line) = reply {
        return String::from_utf8_lossy(line).into_owned();
    }
    match reply.items().and_then(|i| i.first()).and_then(Resp::bulk) {
        Some(b"state") => "record".into(),
        Some(word) => String::from_utf8_lossy(word).into_owned(),
        None => show(&reply.to_bytes(), 10),
    }
}

const MARGIN_MS: i64 = 25;

impl Pair {
    fn start() -> Pair {
        let module_server = RedisServer::start();
        let library_server = library_server(&[]);
        let mut admin = RawConn::connect(library_server.port, false);
        let sha = admin.ok(&[b"SCRIPT", b"LOAD", &scripts_form()]);
        let sha = sha.bulk().expect("a sha").to_vec();
        admin.ok(&[
            b"ACL",
            b"SETUSER",
            LIMITED.as_bytes(),
            b"on",
            b"nopass",
            b"+@all",
        ]);
        allow_only(&mut admin, LIMITED, &[]);
        Pair {
            module: Side::new(module_server.port, None),
            library: Side::new(library_server.port, Some(LIMITED)),
            admin,
            _module_server: module_server,
            library_server,
            sha,
            outboxes: Outboxes::load(),
            log: Vec::new(),
            spread_ms: 0,
            deadlines: Vec::new(),
            keys: Vec::new(),
            last: (0, 0),
            stats: BTreeMap::new(),
        }
    }

    fn fail(&self, what: &str) -> ! {
        panic!(
            "the library and the module differ: {what}\nhistory ({} ops):\n{}",
            self.log.len(),
            self.log.join("\n")
        )
    }

    /// Waits until no deadline is near.
    fn guard(&mut self) {
        loop {
            let now = now_ms();
            let margin = MARGIN_MS + self.spread_ms;
            self.deadlines.retain(|&(_, hi)| hi + margin >= now);
            let near = self
                .deadlines
                .iter()
                .filter(|&&(lo, hi)| now + margin >= lo && now <= hi + margin)
                .map(|&(_, hi)| hi + margin + 1)
                .max();
            match near {
                Some(until) => sleep_ms((until - now).max(1) as u64),
                None => return,
            }
        }
    }

    fn deadline(&mut self, t0: i64, t2: i64, after_ms: i64) {
        self.deadlines.push((t0 + after_ms, t2 + after_ms));
    }

    fn note_key(&mut self, key: &[u8]) {
        if !self.keys.iter().any(|k| k == key) {
            self.keys.push(key.to_vec());
        }
    }

    /// Runs one command on both servers; fails on any difference. Returns
    /// the module's reply (tokens as sent) and the normalised one.
    fn call(
        &mut self,
        cmd: Cmd,
        key: &[u8],
        args: &[Arg],
        resp3: bool,
        form: Form,
        in_multi: bool,
    ) -> (Resp, Resp) {
        self.guard();
        self.note_key(key);
        let c = usize::from(resp3);
        let mut module_args = vec![b(cmd.module()), key.to_vec()];
        module_args.extend(args.iter().map(|a| self.module.resolve(a)));
        let outbox = self.outboxes.of(key);
        let mut keys = vec![key.to_vec()];
        if cmd.with_outbox() {
            keys.push(outbox);
        }
        let mut library_args = match form {
            Form::Fcall | Form::FcallRo => vec![
                b(if form == Form::Fcall {
                    "FCALL"
                } else {
                    "FCALL_RO"
                }),
                b(cmd.function()),
                keys.len().to_string().into_bytes(),
            ],
            Form::Evalsha => vec![
                b("EVALSHA"),
                self.sha.clone(),
                keys.len().to_string().into_bytes(),
            ],
        };
        allow_only(&mut self.admin, LIMITED, &keys);
        library_args.extend(keys);
        if form == Form::Evalsha {
            library_args.push(b(cmd.function()));
        }
        library_args.extend(args.iter().map(|a| self.library.resolve(a)));

        let t0 = now_ms();
        let module_reply = if in_multi {
            self.module.conns[c].call_in_multi(&module_args)
        } else {
            self.module.conns[c].call_vec(&module_args)
        };
        let library_reply = self.library.conns[c].call_vec(&library_args);
        let t2 = now_ms();
        self.spread_ms = self.spread_ms.max(t2 - t0);
        self.last = (t0, t2);

        let shape = match cmd {
            Cmd::Begin => Shape::Begin,
            Cmd::Get => Shape::Get,
            _ => Shape::Other,
        };
        let show_args = |a: &[Vec<u8>]| a.iter().map(|x| show(x, 60)).collect::<Vec<_>>().join(" ");
        self.log.push(format!(
            "#{} RESP{}{} {}\n    module:  {}\n    library: {}  ({})",
            self.log.len(),
            if resp3 { 3 } else { 2 },
            if in_multi { " MULTI" } else { "" },
            show_args(&module_args),
            show(&module_reply.to_bytes(), 300),
            show(&library_reply.to_bytes(), 300),
            show_args(&library_args[..2]),
        ));
        let (mut m, mut l) = (module_reply.clone(), library_reply);
        let (mut mt, mut lt) = (Vec::new(), Vec::new());
        if let Err(e) = normalise(shape, key, &mut m, &mut self.module, &mut mt) {
            self.fail(&format!("module: {e}"));
        }
        if let Err(e) = normalise(shape, key, &mut l, &mut self.library, &mut lt) {
            self.fail(&format!("library: {e}"));
        }
        self.compare(&m, &l, &mt, &lt);
        let class = format!("{cmd:?} {}", kind(&module_reply));
        *self.stats.entry(class).or_default() += 1;
        (module_reply, m)
    }

    fn compare(&self, m: &Resp, l: &Resp, mt: &[i64], lt: &[i64]) {
        if m.to_bytes() != l.to_bytes() {
            self.fail(&format!(
                "replies\n  module:  {}\n  library: {}",
                show(&m.to_bytes(), 2000),
                show(&l.to_bytes(), 2000)
            ));
        }
        let tolerance = self.spread_ms + 2;
        if mt.len() != lt.len() || mt.iter().zip(lt).any(|(a, b)| (a - b).abs() > tolerance) {
            self.fail(&format!(
                "times (tolerance {tolerance} ms): module {mt:?}, library {lt:?}"
            ));
        }
        // The order of times within a reply is the same, where it is clear.
        for i in 0..mt.len() {
            for j in 0..mt.len() {
                if mt[i] - mt[j] > 2 * tolerance && lt[i] <= lt[j] {
                    self.fail(&format!("order of times: module {mt:?}, library {lt:?}"));
                }
            }
        }
    }

    /// IDEM.MIRROR.PULL on the module, idem_mirror_claim of every key the
    /// history used (per outbox) on the library; the entries compared
    /// sorted by key. Returns the module's entries' keys.
    fn claim(&mut self, claim_ms: u64, resp3: bool, form: Form) -> Vec<Vec<u8>> {
        self.guard();
        let c = usize::from(resp3);
        let claim = claim_ms.to_string().into_bytes();
        let mut groups: BTreeMap<Vec<u8>, Vec<Vec<u8>>> = BTreeMap::new();
        for key in &self.keys {
            groups
                .entry(self.outboxes.of(key))
                .or_default()
                .push(key.clone());
        }
        let t0 = now_ms();
        let module_reply = self.module.conns[c].call_vec(&[
            b("IDEM.MIRROR.PULL"),
            b("10000"),
            b("CLAIM"),
            claim.clone(),
        ]);
        let mut library_replies = Vec::new();
        for (outbox, keys) in &groups {
            let n = (keys.len() + 1).to_string().into_bytes();
            let mut args = match form {
                Form::Evalsha => vec![b("EVALSHA"), self.sha.clone(), n],
                _ => vec![b("FCALL"), b("idem_mirror_claim"), n],
            };
            let mut declared = vec![outbox.clone()];
            declared.extend(keys.iter().cloned());
            allow_only(&mut self.admin, LIMITED, &declared);
            args.extend(declared);
            if form == Form::Evalsha {
                args.push(b("idem_mirror_claim"));
            }
            args.push(claim.clone());
            library_replies.push(self.library.conns[c].call_vec(&args));
        }
        let t2 = now_ms();
        self.spread_ms = self.spread_ms.max(t2 - t0);
        self.last = (t0, t2);
        self.log.push(format!(
            "#{} RESP{} PULL/claim {claim_ms}\n    module:  {}\n    library: {}",
            self.log.len(),
            if resp3 { 3 } else { 2 },
            show(&module_reply.to_bytes(), 300),
            library_replies
                .iter()
                .map(|r| show(&r.to_bytes(), 300))
                .collect::<Vec<_>>()
                .join(" + ")
        ));
        let entries = |reply: &Resp| -> Vec<Resp> {
            reply
                .items()
                .unwrap_or_else(|| self.fail(&format!("not an array: {reply:?}")))
                .to_vec()
        };
        let mut m = entries(&module_reply);
        let mut l: Vec<Resp> = library_replies.iter().flat_map(entries).collect();
        let key_of = |e: &Resp| {
            e.items()
                .and_then(|i| i.first()?.bulk())
                .unwrap_or(b"")
                .to_vec()
        };
        m.sort_by_key(key_of);
        l.sort_by_key(key_of);
        let keys: Vec<Vec<u8>> = m.iter().map(key_of).collect();
        let (mut mt, mut lt) = (Vec::new(), Vec::new());
        for e in &mut m {
            if let Err(err) = normalise_entry(e, &self.module, &mut mt) {
                self.fail(&format!("module entry: {err}"));
            }
        }
        for e in &mut l {
            if let Err(err) = normalise_entry(e, &self.library, &mut lt) {
                self.fail(&format!("library entry: {err}"));
            }
        }
        let all = |v: Vec<Resp>| Resp::Agg(b'*', Some(v));
        self.compare(&all(m), &all(l), &mt, &lt);
        if !keys.is_empty() {
            self.deadline(t0, t2, claim_ms as i64);
        }
        let class = if keys.is_empty() {
            "Claim none"
        } else {
            "Claim some"
        };
        *self.stats.entry(class.into()).or_default() += 1;
        keys
    }

    /// A raw command on both servers (compared unless `quiet`).
    fn raw(&mut self, args: &[Vec<u8>], quiet: bool) {
        self.guard();
        let m = self.module.conns[0].call_vec(args);
        let l = self.admin.call_vec(args);
        self.log.push(format!(
            "#{} raw {}\n    module:  {}\n    library: {}",
            self.log.len(),
            args.iter()
                .map(|a| show(a, 40))
                .collect::<Vec<_>>()
                .join(" "),
            show(&m.to_bytes(), 100),
            show(&l.to_bytes(), 100)
        ));
        if !quiet {
            self.compare(&m, &l, &[], &[]);
        }
    }

    fn sleep(&mut self, ms: u64) {
        self.log.push(format!("#{} sleep {ms} ms", self.log.len()));
        sleep_ms(ms);
    }
}

// ---------------------------------------------------------------------------
// Random histories.

/// The history's view of each key, from the module's replies.
struct Model {
    keys: Vec<Vec<u8>>,
    /// Each key's usual fingerprint.
    fingerprints: Vec<Vec<u8>>,
    /// Tokens issued per key, by number.
    tokens: Vec<Vec<usize>>,
}

const GARBAGE_TOKENS: &[&[u8]] = &[
    b"0",
    b"-1",
    b"",
    b"abc",
    b"1",
    b"12345",
    b"9007199254740993",
    b"9223372036854775807",
    b"9223372036854775808",
    b"18446744073709551615",
    b"18446744073709551616",
    b"+5",
    b" 5",
    b"5 ",
    b"\xff\xfe",
];

fn random_bytes(rng: &mut StdRng, len: usize) -> Vec<u8> {
    (0..len).map(|_| rng.random::<u8>()).collect()
}

/// `word` in a random mix of cases.
fn any_case(rng: &mut StdRng, word: &str) -> Vec<u8> {
    word.bytes()
        .map(|c| {
            if rng.random_bool(0.3) {
                c.to_ascii_lowercase()
            } else {
                c
            }
        })
        .collect()
}

/// An option no command knows: ASCII, invalid UTF-8, or long enough to be
/// cut at 64 bytes (inside a multi-byte character, at times).
fn unknown_option(rng: &mut StdRng) -> Vec<u8> {
    match rng.random_range(0..5) {
        0 => b("FOO"),
        1 => {
            let n = rng.random_range(1..10);
            random_bytes(rng, n)
        }
        2 => {
            let mut v = b"\xc3\xa9t\xc3\xa9-".to_vec();
            v.extend(std::iter::repeat_n(0xe2, 1));
            v.extend(b"\x82\xac");
            v
        }
        3 => {
            let mut v = vec![b'x'; 63];
            v.extend("\u{20ac}\u{20ac}".as_bytes());
            v
        }
        _ => {
            let mut v = vec![b'y'; rng.random_range(60..66)];
            v.extend(b"\r\n\0\xf0\x9f\x98");
            v
        }
    }
}

impl Model {
    /// A key for the next op: often the last one (a request's life is a
    /// sequence on one key), at times a new one, else any.
    fn pick(&mut self, rng: &mut StdRng, last: usize) -> usize {
        match rng.random_range(0..100) {
            0..50 if last < self.keys.len() => last,
            50..62 => {
                let n = self.keys.len();
                let key = if rng.random_bool(0.7) {
                    format!("{{fx}}n{n}")
                } else {
                    format!("n{n}")
                };
                self.keys.push(key.into_bytes());
                let len = [32, 32, 32, 5, 0, 64][rng.random_range(0..6)];
                self.fingerprints.push(random_bytes(rng, len));
                self.tokens.push(Vec::new());
                n
            }
            _ => rng.random_range(0..self.keys.len()),
        }
    }

    fn new(rng: &mut StdRng) -> Model {
        let keys: Vec<Vec<u8>> = [
            &b"{fx}a"[..],
            b"{fx}b",
            b"{fx}c",
            b"{fx}d",
            b"{fx}e",
            b"plain",
            b"\xffbin\x00ary",
        ]
        .iter()
        .map(|k| k.to_vec())
        .collect();
        let fingerprints = keys
            .iter()
            .map(|_| {
                let len = [32, 32, 32, 5, 0, 64, 200][rng.random_range(0..7)];
                random_bytes(rng, len)
            })
            .collect();
        Model {
            tokens: vec![Vec::new(); keys.len()],
            keys,
            fingerprints,
        }
    }

    /// A token for key `k`: its holder's, an older one, padded, or garbage.
    /// Never another key's: the library's tokens are unique per key only,
    /// so another key's may equal this one's.
    fn token(&self, rng: &mut StdRng, k: usize) -> Arg {
        let own = &self.tokens[k];
        let roll = rng.random_range(0..100);
        if roll < 70 && !own.is_empty() {
            return Arg::Token {
                sym: *own.last().expect("a token"),
                pad: false,
            };
        }
        if roll < 78 && own.len() >= 2 {
            return Arg::Token {
                sym: own[rng.random_range(0..own.len() - 1)],
                pad: false,
            };
        }
        if roll < 83 && !own.is_empty() {
            return Arg::Token {
                sym: *own.last().expect("a token"),
                pad: true,
            };
        }
        if own.is_empty() && roll < 60 {
            return Arg::Bytes(b("12345")); // well formed, never issued
        }
        Arg::Bytes(GARBAGE_TOKENS[rng.random_range(0..GARBAGE_TOKENS.len())].to_vec())
    }
}

/// `IDEM.BEGIN`'s arguments after the key, and the lease and TTL (ms) a
/// `new` answer means.
fn begin_args(rng: &mut StdRng, model: &Model, k: usize) -> (Vec<Arg>, i64, i64, bool) {
    let fp = match rng.random_range(0..100) {
        0..75 => model.fingerprints[k].clone(),
        75..85 => random_bytes(rng, 32),
        85..95 => {
            let n = rng.random_range(0..40);
            random_bytes(rng, n)
        }
        _ => {
            let n = rng.random_range(100..400);
            random_bytes(rng, n)
        }
    };
    let ttl = match rng.random_range(0..100) {
        0..85 => b("60"),
        85..95 => b("1"),
        _ => [
            &b"0"[..],
            b"2592001",
            b"2592000",
            b"x",
            b"",
            b"-5",
            b"99999999999999999999999",
        ][rng.random_range(0..7)]
        .to_vec(),
    };
    let ttl_ms = std::str::from_utf8(&ttl)
        .ok()
        .and_then(|t| t.parse::<i64>().ok())
        .unwrap_or(0)
        * 1000;
    if rng.random_range(0..100) < 3 {
        let args = [vec![], vec![Arg::Bytes(fp)]][rng.random_range(0..2)].clone();
        return (args, 0, 0, false);
    }
    let mut args = vec![Arg::Bytes(fp), Arg::Bytes(ttl)];
    let mut lease = 30_000;
    let mut wait = false;
    for _ in 0..rng.random_range(0..4) {
        match rng.random_range(0..100) {
            0..35 => {
                args.push(Arg::Bytes(any_case(rng, "LEASE")));
                let v = match rng.random_range(0..10) {
                    0..6 => rng.random_range(40..150),
                    6..8 => 60_000,
                    8 => {
                        args.push(Arg::Bytes(
                            [&b"0"[..], b"x", b"31622400001", b"31622400000"]
                                [rng.random_range(0..4)]
                            .to_vec(),
                        ));
                        continue;
                    }
                    _ => return (args, 0, 0, wait), // no value
                };
                lease = v;
                args.push(Arg::Bytes(v.to_string().into_bytes()));
            }
            35..55 => {
                args.push(Arg::Bytes(any_case(rng, "WAIT")));
                wait = true;
                let v = [&b"0"[..], b"100", b"-1", b"31622400000", b"31622400001"]
                    [rng.random_range(0..5)];
                args.push(Arg::Bytes(v.to_vec()));
            }
            55..92 => args.push(Arg::Bytes(any_case(rng, "PACKED"))),
            _ => args.push(Arg::Bytes(unknown_option(rng))),
        }
    }
    (args, lease, ttl_ms, wait)
}

fn complete_args(rng: &mut StdRng, model: &Model, k: usize) -> Vec<Arg> {
    let token = model.token(rng, k);
    if rng.random_range(0..100) < 2 {
        return vec![token, Arg::Bytes(b("200"))]; // arity
    }
    let status = match rng.random_range(0..100) {
        0..90 => ["200", "201", "404", "500", "100", "599", "0200"][rng.random_range(0..7)],
        _ => ["99", "600", "x", "", "65736"][rng.random_range(0..5)],
    };
    // Mostly a few headers; at times max-headers (256) or one more.
    let count = match rng.random_range(0..100) {
        0..97 => rng.random_range(0..4),
        97..99 => 256,
        _ => 257,
    };
    let mut headers: Vec<(Vec<u8>, Vec<u8>)> = (0..count)
        .map(|_| {
            (
                {
                    let n = rng.random_range(1..12);
                    random_bytes(rng, n)
                },
                {
                    let n = rng.random_range(0..20);
                    random_bytes(rng, n)
                },
            )
        })
        .collect();
    // Each header counts its name, its value and 32 bytes.
    let header_bytes: usize = headers.iter().map(|(n, v)| n.len() + v.len() + 32).sum();
    let body = match rng.random_range(0..100) {
        0..96 => {
            let n = rng.random_range(0..50);
            random_bytes(rng, n)
        }
        // At the limit, or one byte past it (headers count too).
        96..98 => vec![b'z'; 1_048_576 - header_bytes],
        _ => vec![b'z'; 1_048_577 - header_bytes],
    };
    if rng.random_range(0..100) < 3 {
        headers.push((Vec::new(), b("v"))); // an empty name
    }
    let mut options: Vec<Vec<Arg>> = headers
        .into_iter()
        .map(|(name, value)| {
            vec![
                Arg::Bytes(any_case(rng, "HEADER")),
                Arg::Bytes(name),
                Arg::Bytes(value),
            ]
        })
        .collect();
    if rng.random_bool(0.25) {
        let at = rng.random_range(0..=options.len());
        options.insert(at, vec![Arg::Bytes(any_case(rng, "MIRRORED"))]);
    }
    let mut args = vec![token, Arg::Bytes(b(status)), Arg::Bytes(body)];
    args.extend(options.into_iter().flatten());
    match rng.random_range(0..100) {
        0..3 => args.push(Arg::Bytes(unknown_option(rng))),
        3..5 => {
            args.push(Arg::Bytes(b("HEADER")));
            args.push(Arg::Bytes(b("only-a-name")));
        }
        _ => {}
    }
    args
}

/// Runs one random history of `ops` steps on a fresh pair; returns how
/// often each command got each kind of answer.
fn random_history(seed: u64, ops: usize) -> BTreeMap<String, usize> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut pair = Pair::start();
    let mut model = Model::new(&mut rng);
    let mut long_sleeps = 0;
    let mut k = 0;
    for _ in 0..ops {
        k = model.pick(&mut rng, k);
        let key = model.keys[k].clone();
        let resp3 = rng.random_bool(0.5);
        let form = if rng.random_bool(0.25) {
            Form::Evalsha
        } else {
            Form::Fcall
        };
        match rng.random_range(0..100) {
            0..30 => {
                let (args, lease, ttl_ms, wait) = begin_args(&mut rng, &model, k);
                let (reply, _) = pair.call(Cmd::Begin, &key, &args, resp3, form, wait);
                let items = reply.items().unwrap_or_default();
                if items.first().and_then(Resp::bulk) == Some(b"new") {
                    let token = items[1].int().expect("a token");
                    model.tokens[k].push(pair.module.symbols[&(key.clone(), token)]);
                    let (t0, t2) = pair.last;
                    pair.deadline(t0, t2, lease);
                    pair.deadline(t0, t2, ttl_ms);
                }
            }
            30..50 => {
                let args = complete_args(&mut rng, &model, k);
                pair.call(Cmd::Complete, &key, &args, resp3, form, false);
            }
            50..57 => {
                let mut args = vec![model.token(&mut rng, k)];
                if rng.random_range(0..100) < 4 {
                    args.push(Arg::Bytes(b("extra")));
                }
                pair.call(Cmd::Abort, &key, &args, resp3, form, false);
            }
            57..65 => {
                let lease = match rng.random_range(0..10) {
                    0..5 => rng.random_range(40..150).to_string(),
                    5..8 => "60000".to_string(),
                    _ => ["0", "31622400001", "x"][rng.random_range(0..3)].to_string(),
                };
                let mut args = vec![model.token(&mut rng, k), Arg::Bytes(b(&lease))];
                if rng.random_range(0..100) < 4 {
                    args.pop();
                }
                let (reply, _) = pair.call(Cmd::Touch, &key, &args, resp3, form, false);
                if let Some(ms) = reply.int() {
                    let (t0, t2) = pair.last;
                    pair.deadline(t0, t2, ms);
                }
            }
            65..77 => {
                let mut args = vec![];
                if rng.random_range(0..100) < 4 {
                    args.push(Arg::Bytes(b("extra")));
                }
                let form = match form {
                    Form::Fcall if rng.random_bool(0.5) => Form::FcallRo,
                    other => other,
                };
                pair.call(Cmd::Get, &key, &args, resp3, form, false);
            }
            77..84 => {
                let mut args = vec![model.token(&mut rng, k)];
                if rng.random_range(0..100) < 4 {
                    args.push(Arg::Bytes(b("extra")));
                }
                pair.call(Cmd::Ack, &key, &args, resp3, form, false);
            }
            84..90 => {
                let claim_ms = if rng.random_bool(0.7) {
                    60_000
                } else {
                    rng.random_range(40..150)
                };
                pair.claim(claim_ms, resp3, form);
            }
            90..92 => {
                // The key changes type behind idem's back, or is freed.
                pair.raw(&[b("DEL"), key.clone()], true);
                // Without the record, the library's tokens for the key rest
                // on the clock alone (its last token went with the key).
                pair.library.key_max.remove(&key);
                match rng.random_range(0..3) {
                    0 => pair.raw(&[b("SET"), key.clone(), b("x")], false),
                    1 => pair.raw(&[b("HSET"), key.clone(), b("f"), b("v")], false),
                    _ => {}
                }
            }
            _ => {
                let ms = match rng.random_range(0..100) {
                    0..70 => rng.random_range(0..30),
                    70..96 => rng.random_range(100..200),
                    _ if long_sleeps < 2 => {
                        long_sleeps += 1;
                        1100
                    }
                    _ => 50,
                };
                pair.sleep(ms);
            }
        }
    }
    std::mem::take(&mut pair.stats)
}

#[test]
fn random_histories_answer_as_the_module() {
    let seed = std::env::var("IDEM_FUNCTIONS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("random histories: seed {seed} (IDEM_FUNCTIONS_SEED={seed} repeats it)");
    // The histories must reach every outcome and the common errors: two
    // histories, and up to two more while one is missing.
    let wanted = [
        "Begin new",
        "Begin in_flight",
        "Begin replay",
        "Begin mismatch",
        "Begin BADARG",
        "Complete OK",
        "Complete STALE",
        "Complete BADARG",
        "Touch n",
        "Abort 1",
        "Ack 1",
        "Get record",
        "Get nil",
        "Claim some",
    ];
    let started = Instant::now();
    let mut stats: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..4 {
        for (class, n) in random_history(seed.wrapping_add(i), 300) {
            *stats.entry(class).or_default() += n;
        }
        if i >= 1 && wanted.iter().all(|w| stats.contains_key(*w)) {
            break;
        }
    }
    eprintln!(
        "random histories: {:?}, answers: {stats:?}",
        started.elapsed()
    );
    for class in wanted {
        assert!(stats.contains_key(class), "no {class} in {stats:?}");
    }
}

// ---------------------------------------------------------------------------
// Targeted checks.

/// Arguments from text.
fn args(list: &[&str]) -> Vec<Arg> {
    list.iter().map(|a| Arg::Bytes(b(a))).collect()
}

/// `n` headers (`HEADER name value`, each `size` bytes of name and value).
fn headers(n: usize, size: usize) -> Vec<Arg> {
    (0..n)
        .flat_map(|i| {
            let name = format!("h{i:0width$}", width = size.max(2) - 1);
            [
                Arg::Bytes(b("HEADER")),
                Arg::Bytes(name.into_bytes()),
                Arg::Bytes(vec![b'v'; size]),
            ]
        })
        .collect()
}

/// The limits and the corners of parsing, on both servers, compared as in
/// the random histories (which reach them only now and then).
#[test]
fn edge_cases_answer_as_the_module() {
    let mut pair = Pair::start();
    // Each step over RESP2, then again over RESP3 (on the state the first
    // left: a second BEGIN meets the first's record).
    let step = |pair: &mut Pair, cmd: Cmd, key: &str, a: Vec<Arg>| {
        for resp3 in [false, true] {
            pair.call(cmd, key.as_bytes(), &a, resp3, Form::Fcall, false);
        }
    };
    // BEGIN: bounds, options in any case and order, repeated options.
    for (key, a) in [
        ("b1", vec!["fp", "2592000"]),
        ("b2", vec!["fp", "2592001"]),
        ("b3", vec!["fp", "1", "LEASE", "31622400000"]),
        ("b4", vec!["fp", "1", "LEASE", "31622400001"]),
        ("b5", vec!["fp", "1", "LEASE", "0"]),
        ("b6", vec!["fp", "1", "LEASE", ""]),
        (
            "b7",
            vec!["fp", "1", "wait", "31622400000", "packed", "PACKED"],
        ),
        ("b8", vec!["fp", "1", "Lease", "1000", "LEASE", "00060000"]),
        ("b9", vec!["", "60"]),
        ("b10", vec!["fp", "60", "WAIT"]),
        ("b11", vec!["fp", "60", "LEASE", "10", "BOGUS"]),
        ("b12", vec!["fp", "0060"]),
    ] {
        step(&mut pair, Cmd::Begin, key, args(&a));
        step(&mut pair, Cmd::Get, key, vec![]);
    }
    // Unknown options cut at 64 bytes, inside a character at times.
    let mut cut = vec![b'x'; 63];
    cut.extend("\u{20ac}".as_bytes());
    let mut exact = vec![b'y'; 61];
    exact.extend("\u{20ac}".as_bytes());
    for option in [cut, exact, b"\xf0\x9f\x98".to_vec(), b"a\r\nb\0c".to_vec()] {
        let a = vec![Arg::Bytes(b("fp")), Arg::Bytes(b("60")), Arg::Bytes(option)];
        step(&mut pair, Cmd::Begin, "u", a);
    }

    // COMPLETE: every refusal first, then the limits met exactly.
    let (reply, _) = pair.call(
        Cmd::Begin,
        b"c",
        &args(&["fp", "60"]),
        false,
        Form::Fcall,
        false,
    );
    let token = reply.items().expect("new")[1].int().expect("a token");
    let t = Arg::Token {
        sym: pair.module.symbols[&(b("c"), token)],
        pad: false,
    };
    let padded = Arg::Token {
        sym: pair.module.symbols[&(b("c"), token)],
        pad: true,
    };
    let complete = |extra: Vec<Arg>, body: Vec<u8>, status: &str| {
        let mut a = vec![t.clone(), Arg::Bytes(b(status)), Arg::Bytes(body)];
        a.extend(extra);
        a
    };
    let mut too_many = headers(256, 1);
    too_many.extend(args(&["HEADER"])); // the 257th, even without its name
    let mut missing = headers(255, 1);
    missing.extend(args(&["HEADER", "n"]));
    // Two headers of 10 + 10 bytes count 2 * (20 + 32).
    let at_limit = 1_048_576 - 2 * (20 + 32);
    for a in [
        complete(headers(257, 1), b("x"), "200"),
        complete(too_many, b("x"), "200"),
        complete(missing, b("x"), "200"),
        complete(headers(2, 10), vec![b'z'; at_limit + 1], "200"),
        complete(headers(0, 0), vec![b'z'; 1_048_577], "200"),
        complete(vec![], b("x"), "099"),
        complete(vec![], b("x"), "600"),
        complete(args(&["MIRRORED", "HEADER", "", "v"]), b("x"), "200"),
        vec![padded.clone(), Arg::Bytes(b("200"))],
    ] {
        step(&mut pair, Cmd::Complete, "c", a);
    }
    // TOUCH and ABORT bounds, a padded token.
    step(
        &mut pair,
        Cmd::Touch,
        "c",
        vec![padded.clone(), Arg::Bytes(b("0"))],
    );
    step(
        &mut pair,
        Cmd::Touch,
        "c",
        vec![padded.clone(), Arg::Bytes(b("31622400001"))],
    );
    step(
        &mut pair,
        Cmd::Touch,
        "c",
        vec![padded.clone(), Arg::Bytes(b("31622400000"))],
    );
    step(
        &mut pair,
        Cmd::Abort,
        "c",
        vec![padded.clone(), Arg::Bytes(b("x"))],
    );
    step(&mut pair, Cmd::Get, "c", args(&["x"]));
    step(&mut pair, Cmd::Ack, "c", vec![padded.clone()]);
    // The limits met exactly: max-headers, and max-body-bytes with them.
    let done = complete(headers(256, 1), b("x"), "0599");
    step(&mut pair, Cmd::Complete, "c", done);
    step(&mut pair, Cmd::Begin, "c", args(&["fp", "60", "PACKED"]));
    step(&mut pair, Cmd::Get, "c", vec![]);
    let (reply, _) = pair.call(
        Cmd::Begin,
        b"d",
        &args(&["fp", "60"]),
        false,
        Form::Fcall,
        false,
    );
    let token = reply.items().expect("new")[1].int().expect("a token");
    let t = Arg::Token {
        sym: pair.module.symbols[&(b("d"), token)],
        pad: false,
    };
    let mut a = vec![t, Arg::Bytes(b("200")), Arg::Bytes(vec![b'z'; at_limit])];
    a.extend(headers(2, 10));
    step(&mut pair, Cmd::Complete, "d", a);
    step(&mut pair, Cmd::Begin, "d", args(&["fp", "60"]));
    pair.claim(1000, true, Form::Fcall);
}

/// FCALL `function` with `keys` and `args` on `conn`.
fn fcall(conn: &mut RawConn, function: &str, keys: &[&[u8]], args: &[&[u8]]) -> Resp {
    let n = keys.len().to_string();
    let mut all: Vec<&[u8]> = vec![b"FCALL", function.as_bytes(), n.as_bytes()];
    all.extend_from_slice(keys);
    all.extend_from_slice(args);
    conn.call(&all)
}

fn token_of(reply: &Resp) -> Vec<u8> {
    let items = reply.items().unwrap_or_else(|| panic!("{reply:?}"));
    assert_eq!(items[0].bulk(), Some(&b"new"[..]), "{reply:?}");
    items[1].int().expect("a token").to_string().into_bytes()
}

/// A field of an IDEM.GET reply.
fn get_field(reply: &Resp, name: &str) -> Resp {
    let items = reply.items().unwrap_or_else(|| panic!("{reply:?}"));
    items
        .chunks(2)
        .find(|p| p[0].bulk() == Some(name.as_bytes()))
        .map(|p| p[1].clone())
        .unwrap_or_else(|| panic!("no {name} in {reply:?}"))
}

#[test]
fn other_values_answer_wrongtype_and_forged_records_corrupt() {
    let server = library_server(&[]);
    let mut c = RawConn::connect(server.port, false);
    let outboxes = Outboxes::load();
    // Every function on `key`: none may answer other than `code`, or leak
    // a Lua error.
    let check = |c: &mut RawConn, key: &[u8], code: &str| {
        let ob = outboxes.of(key);
        let replies = [
            fcall(c, "idem_begin", &[key], &[b"fp", b"60"]),
            fcall(c, "idem_complete", &[key, &ob], &[b"5", b"200", b"x"]),
            fcall(c, "idem_abort", &[key], &[b"5"]),
            fcall(c, "idem_touch", &[key], &[b"5", b"100"]),
            fcall(c, "idem_get", &[key], &[]),
            fcall(c, "idem_mirror_ack", &[key, &ob], &[b"5"]),
        ];
        for r in replies {
            let e = r
                .error()
                .unwrap_or_else(|| panic!("{}: {r:?}", show(key, 40)));
            assert!(e.starts_with(&format!("{code} ")), "{}: {e}", show(key, 40));
            assert!(!e.contains("script") && !e.contains("user_function"), "{e}");
        }
        // A claim drops the member quietly.
        c.ok(&[b"ZADD", &ob, b"0", key]);
        let claimed = fcall(c, "idem_mirror_claim", &[&ob, key], &[b"1000"]);
        assert_eq!(claimed.items().map(<[Resp]>::len), Some(0), "{claimed:?}");
        assert!(c.ok(&[b"ZSCORE", &ob, key]).is_null());
    };

    c.ok(&[b"SET", b"string", b"x"]);
    c.ok(&[b"RPUSH", b"list", b"x"]);
    c.ok(&[b"SADD", b"set", b"x"]);
    c.ok(&[b"HSET", b"hash", b"field", b"value"]);
    c.ok(&[b"HSET", b"almost", b"token", b"5", b"state", b"in_progress"]);
    for key in ["string", "list", "set", "hash", "almost"] {
        check(&mut c, key.as_bytes(), "WRONGTYPE");
    }
    let wrongtype = fcall(&mut c, "idem_get", &[b"string"], &[]);
    assert_eq!(
        wrongtype.error().as_deref(),
        Some("WRONGTYPE Operation against a key holding the wrong kind of value")
    );

    // An outbox of another type: refused before anything changes.
    let t = token_of(&fcall(&mut c, "idem_begin", &[b"held"], &[b"fp", b"60"]));
    let before = c.ok(&[b"HGETALL", b"held"]);
    let bad_outbox: &[u8] = b"string";
    for r in [
        fcall(
            &mut c,
            "idem_complete",
            &[b"held", bad_outbox],
            &[&t, b"200", b"x"],
        ),
        fcall(
            &mut c,
            "idem_mirror_claim",
            &[bad_outbox, b"held"],
            &[b"100"],
        ),
    ] {
        assert!(
            r.error().is_some_and(|e| e.starts_with("WRONGTYPE ")),
            "{r:?}"
        );
    }
    assert_eq!(c.ok(&[b"HGETALL", b"held"]), before, "nothing changed");
    let ob = outboxes.of(b"held");
    let r = fcall(
        &mut c,
        "idem_complete",
        &[b"held", &ob],
        &[&t, b"200", b"x"],
    );
    assert_eq!(r, ok_status());
    let r = fcall(&mut c, "idem_mirror_ack", &[b"held", bad_outbox], &[&t]);
    assert!(
        r.error().is_some_and(|e| e.starts_with("WRONGTYPE ")),
        "{r:?}"
    );
    let get = fcall(&mut c, "idem_get", &[b"held"], &[]);
    assert_eq!(get_field(&get, "mirror").bulk(), Some(&b"pending"[..]));

    // Real records, then each forged one field at a time.
    token_of(&fcall(&mut c, "idem_begin", &[b"ip"], &[&[7; 32], b"60"]));
    let t = token_of(&fcall(&mut c, "idem_begin", &[b"done"], &[b"short", b"60"]));
    let ob = outboxes.of(b"done");
    let r = fcall(
        &mut c,
        "idem_complete",
        &[b"done", &ob],
        &[&t, b"201", b"body", b"HEADER", b"a", b"b"],
    );
    assert_eq!(r, ok_status());
    let fields = |c: &mut RawConn, key: &[u8]| -> Vec<Vec<u8>> {
        let all = c.ok(&[b"HGETALL", key]);
        all.items()
            .expect("fields")
            .iter()
            .map(|f| f.bulk().expect("a bulk").to_vec())
            .collect()
    };
    let ip_fields = fields(&mut c, b"ip");
    let done_fields = fields(&mut c, b"done");
    let mut status99 = b"body\0\0\0\x01a\0\0\0\x01b".to_vec();
    status99.extend([0, 99, 0, 0, 0, 1, 0, 0, 0, 4]);
    let mut empty_name = b"body\0\0\0\0\0\0\0\x01b".to_vec();
    empty_name.extend([0, 201, 0, 0, 0, 1, 0, 0, 0, 4]);
    let mut too_many = b"body\0\0\0\x01a\0\0\0\x01b".to_vec();
    too_many.extend([0, 201, 0, 0, 0, 9, 0, 0, 0, 4]);
    let long_body = {
        let mut v = b"body".to_vec();
        v.extend([0, 201, 0, 0, 0, 0, 0, 0, 0, 99]);
        v
    };
    // A record's fields, the field to change, and its new value (None:
    // removed).
    type Forgery<'a> = (&'a [Vec<u8>], &'a str, Option<&'a [u8]>);
    let forgeries: Vec<Forgery> = vec![
        (&ip_fields, "idem", Some(b"2")),
        (&ip_fields, "token", Some(b"abc")),
        (&ip_fields, "token", Some(b"0")),
        (&ip_fields, "token", Some(b"9007199254740992")),
        (&ip_fields, "token", Some(b"")),
        (&ip_fields, "token", None),
        (&ip_fields, "state", Some(b"weird")),
        (&ip_fields, "state", None),
        (&ip_fields, "fp_sent", Some(b"short")),
        (&ip_fields, "fp_sent", None),
        (&ip_fields, "fp_sha256", Some(&[1; 32])),
        (&ip_fields, "created_at", Some(b"x")),
        (&ip_fields, "created_at", Some(b"9007199254741")),
        (&ip_fields, "lease_until", None),
        (&ip_fields, "lease_until", Some(b"-1")),
        (&ip_fields, "response", Some(b"0123456789")),
        (&done_fields, "response", Some(b"short")),
        (&done_fields, "response", Some(&status99)),
        (&done_fields, "response", Some(&empty_name)),
        (&done_fields, "response", Some(&too_many)),
        (&done_fields, "response", Some(&long_body)),
        (&done_fields, "response", None),
        (&done_fields, "completed_at", None),
        (&done_fields, "mirror", Some(b"maybe")),
        (&done_fields, "lease_until", Some(b"5")),
        (&done_fields, "fp_sha256", Some(b"")),
    ];
    for (i, (base, field, value)) in forgeries.into_iter().enumerate() {
        let key = format!("forged{i}").into_bytes();
        let mut hset: Vec<&[u8]> = vec![b"HSET", &key];
        for pair in base.chunks(2) {
            if pair[0] != field.as_bytes() {
                hset.extend([&pair[0][..], &pair[1][..]]);
            }
        }
        if let Some(v) = value {
            hset.extend([field.as_bytes(), v]);
        }
        c.ok(&hset);
        check(&mut c, &key, "CORRUPT");
    }
}

#[test]
fn tokens_only_grow_for_a_key_across_abort_expiry_and_reuse() {
    let server = library_server(&[]);
    let mut c = RawConn::connect(server.port, false);
    let mut last: i64 = 0;
    let mut next = |c: &mut RawConn, args: &[&[u8]]| {
        let t: i64 = std::str::from_utf8(&token_of(&fcall(c, "idem_begin", &[b"k"], args)))
            .expect("digits")
            .parse()
            .expect("a token");
        assert!(t > last, "token {t} after {last}");
        last = t;
        t
    };
    // Abort and begin again at once, many times within a millisecond.
    for _ in 0..200 {
        let t = next(&mut c, &[b"fp", b"60"]).to_string();
        assert_eq!(
            fcall(&mut c, "idem_abort", &[b"k"], &[t.as_bytes()]).int(),
            Some(1)
        );
        assert!(fcall(&mut c, "idem_get", &[b"k"], &[]).is_null(), "aborted");
    }
    // The tombstone: a hash with the last token, expiring a second after it.
    let pttl = c.ok(&[b"PTTL", b"k"]).int().expect("a TTL");
    assert!((0..=1000).contains(&pttl), "tombstone PTTL {pttl}");
    // A takeover.
    next(&mut c, &[b"fp", b"1", b"LEASE", b"20"]);
    sleep_ms(40);
    next(&mut c, &[b"fp", b"1", b"LEASE", b"20"]);
    // Expiry and reuse.
    sleep_ms(1100);
    assert!(fcall(&mut c, "idem_get", &[b"k"], &[]).is_null(), "expired");
    next(&mut c, &[b"fp", b"60"]);
    // A record deleted behind idem's back: the clock alone.
    c.ok(&[b"DEL", b"k"]);
    sleep_ms(2);
    next(&mut c, &[b"fp", b"60"]);
}

#[test]
fn times_and_expiry_are_exact() {
    let module = RedisServer::start();
    let library = library_server(&[]);
    let outboxes = Outboxes::load();
    let ob = outboxes.of(b"k");
    for (name, port, lib) in [
        ("module", module.port, false),
        ("library", library.port, true),
    ] {
        let mut c = RawConn::connect(port, false);
        let call = |c: &mut RawConn, cmd: Cmd, args: &[&[u8]]| -> Resp {
            if lib {
                let keys: Vec<&[u8]> = if cmd.with_outbox() {
                    vec![b"k", &ob]
                } else {
                    vec![b"k"]
                };
                fcall(c, cmd.function(), &keys, args)
            } else {
                let mut all: Vec<&[u8]> = vec![cmd.module().as_bytes(), b"k"];
                all.extend_from_slice(args);
                c.call(&all)
            }
        };
        let int = |r: &Resp| r.int().unwrap_or_else(|| panic!("{name}: {r:?}"));
        let t0 = now_ms();
        let token = token_of(&call(
            &mut c,
            Cmd::Begin,
            &[b"fp", b"60", b"LEASE", b"5000"],
        ));
        let t1 = now_ms();
        let g = call(&mut c, Cmd::Get, &[]);
        let created = int(&get_field(&g, "created_at"));
        assert!((t0..=t1).contains(&created), "{name}: created_at {created}");
        assert_eq!(
            int(&get_field(&g, "expires_at")),
            created + 60_000,
            "{name}"
        );
        assert_eq!(int(&get_field(&g, "lease_until")), created + 5000, "{name}");
        assert_eq!(
            c.ok(&[b"PEXPIRETIME", b"k"]).int(),
            Some(created + 60_000),
            "{name}: the key's TTL is expires_at"
        );
        let t0 = now_ms();
        let retry = int(&call(&mut c, Cmd::Begin, &[b"fp", b"60"])
            .items()
            .expect("in_flight")[1]);
        let t1 = now_ms();
        assert!(
            (created + 5000 - t1..=created + 5000 - t0).contains(&retry),
            "{name}: {retry}"
        );
        let t0 = now_ms();
        assert_eq!(
            call(&mut c, Cmd::Touch, &[&token, b"30"]).int(),
            Some(30),
            "{name}"
        );
        let t1 = now_ms();
        let lease = int(&get_field(&call(&mut c, Cmd::Get, &[]), "lease_until"));
        assert!(
            (t0 + 30..=t1 + 30).contains(&lease),
            "{name}: lease_until {lease}"
        );
        sleep_ms(50);
        let taken = token_of(&call(
            &mut c,
            Cmd::Begin,
            &[b"fp", b"60", b"LEASE", b"7000"],
        ));
        let g = call(&mut c, Cmd::Get, &[]);
        assert_eq!(
            int(&get_field(&g, "expires_at")),
            created + 60_000,
            "{name}: kept"
        );
        assert_eq!(int(&get_field(&g, "created_at")), created, "{name}: kept");
        let t0 = now_ms();
        assert_eq!(
            call(&mut c, Cmd::Complete, &[&taken, b"200", b"x"]),
            ok_status()
        );
        let t1 = now_ms();
        let g = call(&mut c, Cmd::Get, &[]);
        let done = int(&get_field(&g, "completed_at"));
        assert!((t0..=t1).contains(&done), "{name}: completed_at {done}");
        assert_eq!(
            int(&get_field(&g, "expires_at")),
            created + 60_000,
            "{name}"
        );
        if lib {
            let score = c.ok(&[b"ZSCORE", &ob, b"k"]);
            assert_eq!(
                score.bulk(),
                Some(done.to_string().as_bytes()),
                "due at completion"
            );
        }
        c.ok(&[b"PERSIST", b"k"]);
        assert_eq!(
            get_field(&call(&mut c, Cmd::Get, &[]), "expires_at").int(),
            Some(-1)
        );
    }
}

#[test]
fn the_outbox_follows_completions_claims_and_acks() {
    let mut pair = Pair::start();
    let keys: Vec<Vec<u8>> = ["{o}a", "{o}b", "{o}c", "{o}m", "x"]
        .iter()
        .map(|k| b(k))
        .collect();
    let outboxes = Outboxes::load();
    let mut tokens = HashMap::new();
    let mut lib = RawConn::connect(pair.library_server.port, false);
    for key in &keys {
        let (reply, _) = pair.call(
            Cmd::Begin,
            key,
            &[Arg::Bytes(b("fp")), Arg::Bytes(b("1"))],
            false,
            Form::Fcall,
            false,
        );
        let token = reply.items().expect("new")[1].int().expect("a token");
        tokens.insert(key.clone(), pair.module.symbols[&(key.clone(), token)]);
    }
    let tok = |k: &[u8]| Arg::Token {
        sym: tokens[k],
        pad: false,
    };
    let ob = outboxes.of(b"{o}a");
    // Completions: pending ones enter the outbox due now, MIRRORED never.
    for key in &keys {
        let mut args = vec![tok(key), Arg::Bytes(b("200")), Arg::Bytes(b("body"))];
        if key == b"{o}m" {
            args.push(Arg::Bytes(b("MIRRORED")));
        }
        pair.call(Cmd::Complete, key, &args, true, Form::Fcall, false);
    }
    assert!(
        lib.ok(&[b"ZSCORE", &ob, b"{o}m"]).is_null(),
        "MIRRORED stays out"
    );
    assert_eq!(lib.ok(&[b"ZCARD", &ob]).int(), Some(3));
    assert!(lib
        .ok(&[b"ZSCORE", &outboxes.of(b"x"), b"x"])
        .bulk()
        .is_some());
    // A claim hands out what PULL hands out, with the same fields.
    let claimed = pair.claim(400, false, Form::Fcall);
    assert_eq!(claimed, vec![b("x"), b("{o}a"), b("{o}b"), b("{o}c")]);
    let until = lib.ok(&[b"ZSCORE", &ob, b"{o}a"]);
    let until: i64 = std::str::from_utf8(until.bulk().expect("a score"))
        .expect("digits")
        .parse()
        .expect("an integer score");
    assert!(
        (pair.last.0 + 400..=pair.last.1 + 400).contains(&until),
        "claimed until {until}"
    );
    // Claimed: not handed out again until the claim lapses.
    assert!(pair.claim(400, true, Form::Evalsha).is_empty());
    // An ack marks the record mirrored and takes it out of the outbox.
    let (ack, _) = pair.call(
        Cmd::Ack,
        b"{o}a",
        &[tok(b"{o}a")],
        false,
        Form::Fcall,
        false,
    );
    assert_eq!(ack.int(), Some(1));
    assert!(lib.ok(&[b"ZSCORE", &ob, b"{o}a"]).is_null());
    let (get, _) = pair.call(Cmd::Get, b"{o}a", &[], false, Form::FcallRo, false);
    assert_eq!(get_field(&get, "mirror").bulk(), Some(&b"mirrored"[..]));
    let (again, _) = pair.call(
        Cmd::Ack,
        b"{o}a",
        &[tok(b"{o}a")],
        false,
        Form::Fcall,
        false,
    );
    assert_eq!(again.int(), Some(1), "acked already: still 1");
    // A record replaced by an in-progress one leaves on the next claim.
    pair.raw(&[b("DEL"), b("{o}b")], true);
    pair.call(
        Cmd::Begin,
        b"{o}b",
        &[Arg::Bytes(b("fp")), Arg::Bytes(b("60"))],
        false,
        Form::Fcall,
        false,
    );
    sleep_ms(450);
    let claimed = pair.claim(60_000, false, Form::Fcall);
    assert_eq!(claimed, vec![b("x"), b("{o}c")]);
    assert!(
        lib.ok(&[b"ZSCORE", &ob, b"{o}b"]).is_null(),
        "replaced: left"
    );
    // Expired records leave too.
    pair.call(Cmd::Ack, b"x", &[tok(b"x")], true, Form::Fcall, false);
    lib.ok(&[b"ZADD", &ob, b"0", b"{o}c"]); // due again at once
    sleep_ms(1000);
    assert!(pair.claim(60_000, false, Form::Fcall).is_empty());
    assert_eq!(
        lib.ok(&[b"ZCARD", &ob]).int(),
        Some(0),
        "the outbox is empty"
    );
    // Claims are bounded as PULL's (mirror-max-claim-ms, five minutes).
    let long = fcall(&mut lib, "idem_mirror_claim", &[&ob, b"{o}c"], &[b"300001"]);
    assert_eq!(
        long.error().as_deref(),
        Some("BADARG claim-ms must be between 1 and 300000")
    );
    let longest = fcall(&mut lib, "idem_mirror_claim", &[&ob, b"{o}c"], &[b"300000"]);
    assert_eq!(longest.items().map(<[Resp]>::len), Some(0), "{longest:?}");
}

#[test]
fn a_replica_serves_fcall_ro_and_holds_the_same_records() {
    let primary = library_server(&[]);
    let replica = ManagedServer::start_replica_of(&primary);
    let outboxes = Outboxes::load();
    let mut p = RawConn::connect(primary.port, false);
    let mut r = RawConn::connect(replica.port, true);
    let keys: Vec<Vec<u8>> = (0..6).map(|i| format!("r{i}").into_bytes()).collect();
    for (i, key) in keys.iter().enumerate() {
        let ob = outboxes.of(key);
        let t = token_of(&fcall(
            &mut p,
            "idem_begin",
            &[key],
            &[&[i as u8; 32], b"60"],
        ));
        match i % 3 {
            0 => {
                fcall(
                    &mut p,
                    "idem_complete",
                    &[key, &ob],
                    &[&t, b"201", b"b", b"HEADER", b"h", b"v"],
                );
                if i == 3 {
                    fcall(&mut p, "idem_mirror_claim", &[&ob, key], &[b"60000"]);
                    fcall(&mut p, "idem_mirror_ack", &[key, &ob], &[&t]);
                }
            }
            1 => {
                fcall(&mut p, "idem_touch", &[key], &[&t, b"777"]);
            }
            _ => {
                fcall(&mut p, "idem_abort", &[key], &[&t]);
            }
        }
    }
    assert_eq!(p.ok(&[b"WAIT", b"1", b"5000"]).int(), Some(1));
    let mut p3 = RawConn::connect(primary.port, true);
    for key in &keys {
        let ob = outboxes.of(key);
        let on_primary = p3.call(&[b"FCALL_RO", b"idem_get", b"1", key]);
        let on_replica = r.call(&[b"FCALL_RO", b"idem_get", b"1", key]);
        assert!(on_replica.error().is_none(), "{on_replica:?}");
        assert_eq!(
            on_primary.to_bytes(),
            on_replica.to_bytes(),
            "{}",
            show(key, 10)
        );
        for cmd in [&b"HGETALL"[..], b"PEXPIRETIME"] {
            assert_eq!(
                p3.call(&[cmd, key]),
                r.call(&[cmd, key]),
                "{}",
                show(key, 10)
            );
        }
        let z = [&b"ZRANGE"[..], &ob, b"0", b"-1", b"WITHSCORES"];
        assert_eq!(p3.call(&z), r.call(&z));
    }
    let refused = fcall(&mut r, "idem_begin", &[b"new"], &[b"fp", b"60"]);
    assert!(
        refused.error().is_some_and(|e| e.starts_with("READONLY")),
        "{refused:?}"
    );
}

#[test]
fn the_scripts_form_answers_as_fcall_and_a_missing_library_is_reported() {
    // No library: FCALL answers the prefix clients load it on.
    let bare = ManagedServer::start(&[]);
    let mut c = RawConn::connect(bare.port, false);
    for call in [&b"FCALL"[..], b"FCALL_RO"] {
        let r = c.call(&[call, b"idem_get", b"1", b"k"]);
        let e = r.error().expect("an error");
        assert!(e.starts_with("ERR Function not found"), "{e}");
    }
    let src = scripts_form();
    let sha = c
        .ok(&[b"SCRIPT", b"LOAD", &src])
        .bulk()
        .expect("sha")
        .to_vec();
    c.ok(&[b"SCRIPT", b"FLUSH"]);
    let r = c.call(&[b"EVALSHA", &sha, b"0", b"idem_version"]);
    assert!(
        r.error().is_some_and(|e| e.starts_with("NOSCRIPT")),
        "{r:?}"
    );
    // The scripts form on a server without the library.
    assert_eq!(c.ok(&[b"SCRIPT", b"LOAD", &src]).bulk(), Some(&sha[..]));
    let version = spec_version();
    assert_eq!(
        c.call(&[b"EVALSHA", &sha, b"0", b"idem_version"]).int(),
        Some(version)
    );
    assert_eq!(
        c.call(&[b"EVAL", &src, b"0", b"idem_version"]).int(),
        Some(version)
    );
    let r = c.call(&[b"EVALSHA", &sha, b"0", b"idem_nothing"]);
    assert_eq!(r.error().as_deref(), Some("ERR Function not found"));
    // Loaded: FCALL and EVALSHA answer the same bytes, RESP2 and RESP3.
    load_library(&mut c);
    load_library(&mut c); // REPLACE: a reload is harmless
    assert_eq!(fcall(&mut c, "idem_version", &[], &[]).int(), Some(version));
    for resp3 in [false, true] {
        let mut c = RawConn::connect(bare.port, resp3);
        let run = |c: &mut RawConn, evalsha: bool, f: &str, keys: &[&[u8]], args: &[&[u8]]| {
            if evalsha {
                let n = keys.len().to_string();
                let mut all: Vec<&[u8]> = vec![b"EVALSHA", &sha, n.as_bytes()];
                all.extend_from_slice(keys);
                all.push(f.as_bytes());
                all.extend_from_slice(args);
                c.call(&all)
            } else {
                fcall(c, f, keys, args)
            }
        };
        let mut seen: Vec<[Vec<u8>; 2]> = Vec::new();
        for evalsha in [false, true] {
            let key = format!("{{s}}{resp3}{evalsha}").into_bytes();
            let ob = Outboxes::load().of(&key);
            let t = token_of(&run(
                &mut c,
                evalsha,
                "idem_begin",
                &[&key],
                &[b"fp", b"60"],
            ));
            let steps = [
                run(
                    &mut c,
                    evalsha,
                    "idem_begin",
                    &[&key],
                    &[b"fp", b"60", b"PACKED"],
                ),
                run(&mut c, evalsha, "idem_begin", &[&key], &[b"other", b"60"]),
                run(&mut c, evalsha, "idem_touch", &[&key], &[&t, b"100"]),
                run(
                    &mut c,
                    evalsha,
                    "idem_complete",
                    &[&key, &ob],
                    &[&t, b"200", b"x", b"HEADER", b"a", b"b"],
                ),
                run(
                    &mut c,
                    evalsha,
                    "idem_begin",
                    &[&key],
                    &[b"fp", b"60", b"PACKED"],
                ),
                run(&mut c, evalsha, "idem_begin", &[&key], &[b"fp", b"60"]),
                run(
                    &mut c,
                    evalsha,
                    "idem_complete",
                    &[&key, &ob],
                    &[&t, b"200", b"x"],
                ),
                run(&mut c, evalsha, "idem_abort", &[&key], &[&t]),
                run(&mut c, evalsha, "idem_mirror_ack", &[&key, &ob], &[&t]),
                run(&mut c, evalsha, "idem_get", &[b"{s}none"], &[]),
                run(&mut c, evalsha, "idem_begin", &[&key], &[b"fp", b"0"]),
                run(
                    &mut c,
                    evalsha,
                    "idem_begin",
                    &[&key],
                    &[b"fp", b"1", b"\xffbad"],
                ),
                run(&mut c, evalsha, "idem_version", &[], &[]),
            ];
            for (i, r) in steps.iter().enumerate() {
                let mut r = r.clone();
                if let Some(items) = r.items_mut() {
                    if items[0].bulk() == Some(b"in_flight") {
                        items[1] = Resp::new_int(0);
                    }
                }
                if seen.len() <= i {
                    seen.push([r.to_bytes(), Vec::new()]);
                } else {
                    seen[i][1] = r.to_bytes();
                }
            }
        }
        for (i, [f, e]) in seen.iter().enumerate() {
            assert_eq!(show(f, 200), show(e, 200), "step {i}, RESP3 {resp3}");
        }
    }
}

#[test]
fn out_of_memory_refuses_new_records_as_the_module_does() {
    let module = RedisConfig::default()
        .server_arg("maxmemory", "4mb")
        .start();
    let library = library_server(&["--maxmemory", "4mb"]);
    let outboxes = Outboxes::load();
    let mut sides: Vec<(RawConn, bool)> = vec![
        (RawConn::connect(module.port, false), false),
        (RawConn::connect(library.port, false), true),
    ];
    let call = |c: &mut RawConn, lib: bool, cmd: Cmd, key: &[u8], args: &[&[u8]]| -> Resp {
        if lib {
            let ob = outboxes.of(key);
            let keys: Vec<&[u8]> = if cmd.with_outbox() {
                vec![key, &ob]
            } else {
                vec![key]
            };
            fcall(c, cmd.function(), &keys, args)
        } else {
            let mut all: Vec<&[u8]> = vec![cmd.module().as_bytes(), key];
            all.extend_from_slice(args);
            c.call(&all)
        }
    };
    let mut replies: Vec<Vec<String>> = vec![Vec::new(), Vec::new()];
    // A script with allow-oom stores 5 MiB where maxmemory is 4 MiB (a
    // plain SET would be refused: its own argument counts).
    let fill = b"#!lua flags=allow-oom\nredis.call('SET', KEYS[1], string.rep('f', 5242880))";
    for (i, (c, lib)) in sides.iter_mut().enumerate() {
        let lib = *lib;
        let held = token_of(&call(c, lib, Cmd::Begin, b"held", &[b"fp", b"60"]));
        let done = token_of(&call(c, lib, Cmd::Begin, b"done", &[b"fp", b"60"]));
        assert_eq!(
            call(c, lib, Cmd::Complete, b"done", &[&done, b"200", b"x"]),
            ok_status()
        );
        c.ok(&[b"EVAL", fill, b"1", b"filler"]); // used memory now above maxmemory
        sleep_ms(150); // past the library's last memory reading
        let mut log = |r: Resp| replies[i].push(show(&r.to_bytes(), 200));
        log(call(c, lib, Cmd::Begin, b"new", &[b"fp", b"60"]));
        log(call(c, lib, Cmd::Begin, b"done", &[b"fp", b"60"]));
        log(call(c, lib, Cmd::Begin, b"done", &[b"other", b"60"]));
        let in_flight = call(c, lib, Cmd::Begin, b"held", &[b"fp", b"60"]);
        log(Resp::new_int(
            in_flight.items().map_or(0, <[Resp]>::len) as i64
        ));
        log(call(c, lib, Cmd::Complete, b"held", &[&held, b"200", b"x"]));
        log(call(c, lib, Cmd::Complete, b"held", &[b"x"]));
        log(call(c, lib, Cmd::Touch, b"held", &[&held, b"100"]));
        log(call(c, lib, Cmd::Abort, b"held", &[&held]));
        log(call(c, lib, Cmd::Get, b"held", &[]));
        c.ok(&[b"DEL", b"filler"]);
        let fresh = call(c, lib, Cmd::Begin, b"new", &[b"fp", b"60"]);
        log(Resp::new_int(i64::from(fresh.items().is_some())));
    }
    assert_eq!(replies[0], replies[1]);
    assert!(
        replies[0][0].contains("OOM command not allowed"),
        "{:?}",
        replies[0]
    );
}

/// The library touches only the keys it is given: every call runs as a user
/// whose ACL allows exactly the call's keys (as in the random histories),
/// and one left out is refused; a cluster node refuses keys of two slots.
#[test]
fn the_library_touches_only_its_keys() {
    let server = library_server(&[]);
    let outboxes = Outboxes::load();
    let mut admin = RawConn::connect(server.port, false);
    admin.ok(&[
        b"ACL",
        b"SETUSER",
        b"idem",
        b"on",
        b"nopass",
        b"+@all",
        b"resetkeys",
    ]);
    let mut c = RawConn::connect(server.port, false);
    c.ok(&[b"AUTH", b"idem", b"x"]);
    let mut allow = |keys: &[&[u8]]| {
        let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.to_vec()).collect();
        allow_only(&mut admin, "idem", &keys);
    };
    let mut run = |c: &mut RawConn, f: &str, keys: &[&[u8]], args: &[&[u8]]| -> Resp {
        allow(keys);
        let r = fcall(c, f, keys, args);
        if let Some(e) = r.error() {
            assert!(
                !e.contains("NOPERM") && !e.contains("No permissions"),
                "{f}: {e}"
            );
        }
        r
    };
    let (a, b_key) = (&b"{acl}a"[..], &b"{acl}b"[..]);
    let ob = outboxes.of(a);
    let t = token_of(&run(&mut c, "idem_begin", &[a], &[b"fp", b"60"]));
    run(&mut c, "idem_begin", &[a], &[b"fp", b"60"]);
    run(&mut c, "idem_touch", &[a], &[&t, b"1000"]);
    run(&mut c, "idem_get", &[a], &[]);
    assert_eq!(
        run(&mut c, "idem_complete", &[a, &ob], &[&t, b"200", b"x"]),
        ok_status()
    );
    run(&mut c, "idem_begin", &[a], &[b"fp", b"60", b"PACKED"]);
    run(&mut c, "idem_begin", &[a], &[&[3; 32], b"60"]);
    let claimed = run(&mut c, "idem_mirror_claim", &[&ob, a, b_key], &[b"1000"]);
    assert_eq!(claimed.items().map(<[Resp]>::len), Some(1), "{claimed:?}");
    assert_eq!(
        run(&mut c, "idem_mirror_ack", &[a, &ob], &[&t]).int(),
        Some(1)
    );
    let t = token_of(&run(&mut c, "idem_begin", &[b_key], &[b"fp", b"60"]));
    assert_eq!(run(&mut c, "idem_abort", &[b_key], &[&t]).int(), Some(1));
    run(&mut c, "idem_begin", &[b_key], &[b"fp", b"60"]);
    run(&mut c, "idem_version", &[], &[]);
    // The control: a key left out is refused.
    allow(&[a]);
    let r = fcall(&mut c, "idem_complete", &[a, &ob], &[&t, b"200", b"x"]);
    assert!(r.error().is_some_and(|e| e.starts_with("NOPERM")), "{r:?}");

    // A cluster node: one slot per call, the outbox in the record's.
    let node = library_server(&[
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
    ]);
    let mut n = RawConn::connect(node.port, false);
    n.ok(&[b"CLUSTER", b"ADDSLOTSRANGE", b"0", b"16383"]);
    let up = idem_testkit::eventually(Duration::from_secs(10), || {
        let info = n.ok(&[b"CLUSTER", b"INFO"]);
        String::from_utf8_lossy(info.bulk().unwrap_or_default()).contains("cluster_state:ok")
    });
    assert!(up, "the cluster node never came up");
    let key = &b"{c}k"[..];
    let ob = outboxes.of(key);
    let t = token_of(&fcall(&mut n, "idem_begin", &[key], &[b"fp", b"60"]));
    let wrong = outboxes.of(b"elsewhere");
    let r = fcall(&mut n, "idem_complete", &[key, &wrong], &[&t, b"200", b"x"]);
    assert!(
        r.error().is_some_and(|e| e.starts_with("CROSSSLOT")),
        "{r:?}"
    );
    assert_eq!(
        fcall(&mut n, "idem_complete", &[key, &ob], &[&t, b"200", b"x"]),
        ok_status()
    );
    let claimed = fcall(&mut n, "idem_mirror_claim", &[&ob, key], &[b"1000"]);
    assert_eq!(claimed.items().map(<[Resp]>::len), Some(1), "{claimed:?}");
    assert_eq!(
        fcall(&mut n, "idem_mirror_ack", &[key, &ob], &[&t]).int(),
        Some(1)
    );
}
