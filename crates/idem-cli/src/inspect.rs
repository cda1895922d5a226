//! `idem inspect`: a key's Redis record and Postgres row side by side, and
//! a verdict on whether they agree.

use idem_core::{MirrorState, Record, State};
use serde_json::{json, Value};

use crate::exit::{Code, Failure};
use crate::output::{now_ms, Outcome};
use crate::postgres::{self, Row};
use crate::redis_side;

// ANCHOR: verdicts
/// What the two sides say together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Both hold the same completion (token, fingerprint, response).
    Agree,
    /// Completed in Redis, not yet in Postgres: the writer has it pending.
    MirrorPending,
    /// In flight in Redis (with or without its durable claim in Postgres).
    InFlight,
    /// Only Postgres holds the key (Redis expired or lost it): the
    /// read-through and the fence answer from the row.
    PostgresOnly,
    /// Only Redis holds the key and nothing is wrong with that (in flight,
    /// or no Postgres configured).
    RedisOnly,
    /// Redis says the completion was mirrored but Postgres lacks it, or
    /// holds an older one: a Postgres loss (`idem remirror` writes it again).
    MissingInPostgres,
    /// Both hold the key and they differ otherwise.
    Differ,
    /// Neither holds the key.
    NotFound,
}
// ANCHOR_END: verdicts

impl Verdict {
    fn name(self) -> &'static str {
        match self {
            Verdict::Agree => "agree",
            Verdict::MirrorPending => "mirror_pending",
            Verdict::InFlight => "in_flight",
            Verdict::PostgresOnly => "postgres_only",
            Verdict::RedisOnly => "redis_only",
            Verdict::MissingInPostgres => "missing_in_postgres",
            Verdict::Differ => "differ",
            Verdict::NotFound => "not_found",
        }
    }

    fn says(self) -> &'static str {
        match self {
            Verdict::Agree => "Redis and Postgres hold the same completion",
            Verdict::MirrorPending => {
                "completed in Redis and waiting for the writer (not yet in Postgres)"
            }
            Verdict::InFlight => "a request holds the key in flight",
            Verdict::PostgresOnly => {
                "only Postgres holds the key (Redis expired or lost it); retries are answered from the row"
            }
            Verdict::RedisOnly => "only Redis holds the key",
            Verdict::MissingInPostgres => {
                "Redis says it was mirrored but Postgres lacks this completion: rows were lost (see `idem remirror`)"
            }
            Verdict::Differ => "Redis and Postgres hold different versions of the key",
            Verdict::NotFound => "neither Redis nor Postgres holds the key",
        }
    }

    fn code(self) -> Code {
        match self {
            Verdict::MissingInPostgres | Verdict::Differ => Code::Disagree,
            Verdict::NotFound => Code::NotFound,
            _ => Code::Ok,
        }
    }
}

/// The verdict on a key from its record and row (`postgres` false: no
/// Postgres was asked).
pub fn verdict(redis: Option<&Record>, row: Option<&Row>, postgres: bool) -> Verdict {
    let Some(record) = redis else {
        return if row.is_some() {
            Verdict::PostgresOnly
        } else {
            Verdict::NotFound
        };
    };
    let token = i64::try_from(record.token).unwrap_or(i64::MAX);
    match (&record.state, row) {
        (State::InProgress { .. }, None) => Verdict::InFlight,
        (State::InProgress { .. }, Some(row))
            if row.status == "in_progress" && row.token == token =>
        {
            Verdict::InFlight
        }
        // An older row (a completion from before the key's reuse, or a
        // lapsed claim) is replaced when this holder completes.
        (State::InProgress { .. }, Some(row)) if row.token < token => Verdict::InFlight,
        (State::InProgress { .. }, Some(_)) => Verdict::Differ,
        (State::Completed(_), None) if !postgres => Verdict::RedisOnly,
        (State::Completed(c), None) => match c.mirror {
            MirrorState::Pending => Verdict::MirrorPending,
            MirrorState::Mirrored => Verdict::MissingInPostgres,
        },
        (State::Completed(c), Some(row)) if row.token < token => match c.mirror {
            MirrorState::Pending => Verdict::MirrorPending,
            MirrorState::Mirrored => Verdict::MissingInPostgres,
        },
        (State::Completed(c), Some(row)) if row.token == token => {
            let same = row.status == "completed"
                && row.fingerprint == hex::encode(record.fingerprint.digest())
                && row.response_status == Some(i32::from(c.status))
                && row.response_body.as_deref().unwrap_or_default() == c.body.as_slice()
                && row.response_headers
                    == c.headers
                        .iter()
                        .flat_map(|h| [h.name.clone(), h.value.clone()])
                        .collect::<Vec<_>>();
            if same {
                Verdict::Agree
            } else {
                Verdict::Differ
            }
        }
        (State::Completed(_), Some(_)) => Verdict::Differ,
    }
}

pub async fn run(
    key: &str,
    redis_url: &str,
    database_url: Option<&str>,
) -> Result<Outcome, Failure> {
    let mut conn = redis_side::connect(redis_url).await?;
    let record = redis_side::record(&mut conn, key).await?;
    let row = match database_url {
        Some(url) => postgres::row(&postgres::connect(url).await?, key).await?,
        None => None,
    };
    let verdict = verdict(record.as_ref(), row.as_ref(), database_url.is_some());
    let redis_doc = record.as_ref().map(redis_side::describe);
    let postgres_doc = row.as_ref().map(postgres::describe);
    let json = json!({
        "key": key,
        "verdict": verdict.name(),
        "says": verdict.says(),
        "redis": redis_doc,
        "postgres": if database_url.is_some() { postgres_doc.clone().unwrap_or(Value::Null) } else { json!("not asked") },
        "now": crate::output::time(now_ms()),
    });
    let text = side_by_side(
        key,
        verdict,
        redis_doc.as_ref(),
        postgres_doc.as_ref(),
        database_url.is_some(),
    );
    Ok(Outcome {
        json,
        text,
        code: verdict.code(),
    })
}

/// The two documents as two columns, one line per field.
fn side_by_side(
    key: &str,
    verdict: Verdict,
    redis: Option<&Value>,
    postgres: Option<&Value>,
    asked: bool,
) -> String {
    const FIELDS: [&str; 13] = [
        "state",
        "token",
        "fingerprint",
        "created_at",
        "expires_at",
        "lease_until",
        "lease_left",
        "completed_at",
        "status",
        "body",
        "headers",
        "mirror",
        "fenced",
    ];
    let cell = |doc: Option<&Value>, field: &str| -> String {
        match doc.and_then(|d| d.get(field)) {
            None | Some(Value::Null) => "-".into(),
            // The whole fingerprint is in --json; 16 digits tell two apart.
            Some(Value::String(s)) if field == "fingerprint" => {
                format!("{}…", &s[..s.len().min(16)])
            }
            Some(Value::String(s)) => s.clone(),
            Some(Value::Object(o)) if o.contains_key("sha256") => format!(
                "{} bytes, sha256 {}",
                o["bytes"],
                o["sha256"]
                    .as_str()
                    .unwrap_or_default()
                    .get(..16)
                    .unwrap_or_default()
            ),
            Some(other) => other.to_string(),
        }
    };
    let mut out = format!(
        "key      {key}\nverdict  {}: {}\n\n",
        verdict.name(),
        verdict.says()
    );
    let redis_head = if redis.is_some() {
        "redis"
    } else {
        "redis (no record)"
    };
    let pg_head = match (asked, postgres.is_some()) {
        (false, _) => "postgres (not asked)",
        (true, true) => "postgres",
        (true, false) => "postgres (no row)",
    };
    out.push_str(&format!("{:<14}{:<40}{}\n", "", redis_head, pg_head));
    for field in FIELDS {
        let (r, p) = (cell(redis, field), cell(postgres, field));
        if r == "-" && p == "-" {
            continue;
        }
        out.push_str(&format!("{field:<14}{r:<40}{p}\n"));
    }
    out
}
