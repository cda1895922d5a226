//! `idem release`: frees a key stuck in flight, only where it is an
//! `in_progress` record held with the given token: the Redis record through
//! `IDEM.ABORT` (which checks the same, atomically) and the Postgres durable
//! claim through the fence's own `RELEASE_SQL` (token-guarded too). Both
//! sides are checked before either is touched; anything else is refused and
//! nothing changes.

use idem_client::fence::RELEASE_SQL;
use idem_core::{Record, State};
use serde_json::{json, Value};

use crate::exit::Failure;
use crate::output::Outcome;
use crate::postgres::{self, Row};
use crate::redis_side;

/// Why one side refuses the release, or `None` when it may go ahead.
fn redis_refusal(record: Option<&Record>, token: u64) -> Option<String> {
    let record = record?;
    match record.state {
        State::Completed(_) => Some(format!(
            "the Redis record is completed (token {}): its stored response answers retries, it is not stuck",
            record.token
        )),
        State::InProgress { .. } if record.token != token => Some(format!(
            "the Redis record is in flight under token {}, not {token}: another request holds it now",
            record.token
        )),
        State::InProgress { .. } => None,
    }
}

fn postgres_refusal(row: Option<&Row>, token: u64) -> Option<String> {
    let row = row?;
    let token = i64::try_from(token).unwrap_or(i64::MAX);
    if row.token > token {
        return Some(format!(
            "Postgres holds the key under a newer token {} ({}), not {token}",
            row.token, row.status
        ));
    }
    if row.token == token && row.status != "in_progress" {
        return Some(format!(
            "the Postgres row of token {token} is {}: the fence committed it, the key is not stuck",
            row.status
        ));
    }
    None
}

/// Whether the row is the durable claim of `token` (an older row, from
/// before the key's reuse, is not this holder's and stays).
fn is_claim_of(row: Option<&Row>, token: u64) -> bool {
    row.is_some_and(|r| r.status == "in_progress" && u64::try_from(r.token).ok() == Some(token))
}

pub async fn run(
    key: &str,
    token: u64,
    redis_url: &str,
    database_url: Option<&str>,
) -> Result<Outcome, Failure> {
    let mut conn = redis_side::connect(redis_url).await?;
    let pg = match database_url {
        Some(url) => Some(postgres::connect(url).await?),
        None => None,
    };
    let record = redis_side::record(&mut conn, key).await?;
    let row = match &pg {
        Some(pg) => postgres::row(pg, key).await?,
        None => None,
    };
    let found = json!({
        "key": key,
        "token": token,
        "redis": record.as_ref().map(redis_side::describe),
        "postgres": row.as_ref().map(postgres::describe),
    });
    let refusals: Vec<String> = [
        redis_refusal(record.as_ref(), token),
        postgres_refusal(row.as_ref(), token),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !refusals.is_empty() {
        return Err(Failure::Refused {
            reason: refusals.join("; "),
            found,
        });
    }
    let claim = is_claim_of(row.as_ref(), token);
    if record.is_none() && !claim {
        return Err(Failure::NotFound(format!(
            "no record of {key:?} in Redis{}; nothing to release",
            if pg.is_some() {
                " and no durable claim of this token in Postgres"
            } else {
                ""
            }
        )));
    }

    // Redis first: if the record changed since it was read (the holder
    // completed, or it was taken over), stop before touching Postgres,
    // where the holder's claim would then still be live.
    let mut released_redis = Value::Null;
    if record.is_some() {
        if !redis_side::abort(&mut conn, key, token).await? {
            return Err(Failure::Refused {
                reason: format!(
                    "the Redis record changed after it was read (completed or taken over); token {token} no longer holds it"
                ),
                found,
            });
        }
        released_redis = json!(true);
    }
    let mut released_postgres = Value::Null;
    if let (Some(pg), true) = (&pg, claim) {
        let token =
            i64::try_from(token).map_err(|_| Failure::Usage("--token is too large".into()))?;
        let deleted = pg
            .execute(RELEASE_SQL, &[&key, &token])
            .await
            .map_err(|e| anyhow::Error::new(e).context("release the Postgres durable claim"))?;
        released_postgres = json!(deleted == 1);
    }
    let text = format!(
        "released {key} (token {token}): Redis {}, Postgres {}\n",
        side(&released_redis, "record aborted"),
        side(&released_postgres, "durable claim deleted"),
    );
    Ok(Outcome::ok(
        json!({
            "key": key,
            "token": token,
            "released": { "redis": released_redis, "postgres": released_postgres },
            "before": found,
        }),
        text,
    ))
}

fn side(released: &Value, what: &str) -> String {
    match released {
        Value::Bool(true) => what.to_string(),
        Value::Bool(false) => "row changed meanwhile, left as it is".to_string(),
        _ => "nothing to release".to_string(),
    }
}
