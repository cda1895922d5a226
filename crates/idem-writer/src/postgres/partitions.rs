//! The partitioned layout of `idempotency_keys`: which layout a database
//! has, the daily partitions the writer creates ahead (and on demand for a
//! batch), and the expired partitions cleanup drops whole.

use std::collections::BTreeSet;

use crate::error::{Context, Error, Result};
use tokio_postgres::{Client, GenericClient};

/// How `idempotency_keys` is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// One table, `PRIMARY KEY (key)`, rows deleted by cleanup (the default).
    #[default]
    Unpartitioned,
    /// Range-partitioned by `expires_at`, one partition per UTC day; cleanup
    /// drops expired partitions. One row per key is kept by the per-key
    /// advisory lock ([`KEY_LOCK_SEED`]).
    Partitioned,
}

impl std::str::FromStr for Layout {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "unpartitioned" => Ok(Layout::Unpartitioned),
            "partitioned" => Ok(Layout::Partitioned),
            other => Err(format!(
                "unknown layout {other:?}: use unpartitioned or partitioned"
            )),
        }
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Layout::Unpartitioned => "unpartitioned",
            Layout::Partitioned => "partitioned",
        })
    }
}

/// The seed of the per-key lock id `hashtextextended(key, seed)`: the fence's
/// gate (idem-client), which on the partitioned layout every writer of a key's
/// row must hold (blocking or not) before looking the key up.
pub const KEY_LOCK_SEED: i64 = 1_768_187_245;

/// Days of partitions kept ahead of today by default: longer than the
/// module's default `max-ttl` (30 days), so no row finds its partition missing.
pub const DEFAULT_DAYS_AHEAD: u32 = 35;

/// The partition for rows whose Redis key has no TTL (9999-12-31).
pub const NEVER_PARTITION: &str = "idempotency_keys_never";

/// Transaction-scoped advisory lock serialising partition DDL ("idempart").
const PARTITION_DDL_LOCK_ID: i64 = 0x6964_656d_7061_7274;

/// The first day (days since 1970-01-01) that belongs to [`NEVER_PARTITION`].
const NEVER_DAY: i64 = 2_932_896; // 9999-12-31

const MS_PER_DAY: i64 = 86_400_000;

/// The layout of `idempotency_keys`, `None` when the table does not exist.
pub async fn detect<C: GenericClient>(client: &C) -> Result<Option<Layout>> {
    let row = client
        .query_one(
            "SELECT (SELECT relkind::text FROM pg_class \
                     WHERE oid = to_regclass('idempotency_keys'))",
            &[],
        )
        .await
        .context("read the layout of idempotency_keys")?;
    Ok(match row.get::<_, Option<String>>(0).as_deref() {
        None => None,
        Some("p") => Some(Layout::Partitioned),
        Some(_) => Some(Layout::Unpartitioned),
    })
}

/// The day (since 1970-01-01, UTC) an expiry in Unix ms falls on.
pub fn day_of_ms(expires_at_ms: i64) -> i64 {
    expires_at_ms.div_euclid(MS_PER_DAY).min(NEVER_DAY)
}

/// The partition holding day `day`.
pub fn partition_name(day: i64) -> String {
    if day >= NEVER_DAY {
        return NEVER_PARTITION.to_string();
    }
    let (y, m, d) = civil_from_days(day);
    format!("idempotency_keys_p{y:04}{m:02}{d:02}")
}

/// `FOR VALUES ...` of the partition holding `day`.
fn bounds(day: i64) -> String {
    if day >= NEVER_DAY {
        return "FROM ('9999-12-31 00:00:00+00') TO (MAXVALUE)".to_string();
    }
    let (y, m, d) = civil_from_days(day);
    let (ny, nm, nd) = civil_from_days(day + 1);
    format!("FROM ('{y:04}-{m:02}-{d:02} 00:00:00+00') TO ('{ny:04}-{nm:02}-{nd:02} 00:00:00+00')")
}

/// The day a partition name stands for (`idempotency_keys_pYYYYMMDD`).
fn day_of_name(name: &str) -> Option<i64> {
    let digits = name.strip_prefix("idempotency_keys_p")?;
    if digits.len() != 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let y: i64 = digits[..4].parse().ok()?;
    let m: i64 = digits[4..6].parse().ok()?;
    let d: i64 = digits[6..].parse().ok()?;
    let day = days_from_civil(y, m, d);
    (civil_from_days(day) == (y, m, d)).then_some(day)
}

/// Creates the partitions for `days` that do not exist yet (any number of
/// writers may do this at once: the DDL is serialised and re-checked).
/// Returns the names created.
pub async fn ensure_days(
    client: &Client,
    days: impl IntoIterator<Item = i64>,
) -> Result<Vec<String>> {
    let wanted: BTreeSet<i64> = days.into_iter().map(|d| d.min(NEVER_DAY)).collect();
    let names: Vec<String> = wanted.iter().map(|d| partition_name(*d)).collect();
    let missing: Vec<String> = client
        .query(
            "SELECT n FROM unnest($1::text[]) AS n WHERE to_regclass(n) IS NULL",
            &[&names],
        )
        .await
        .context("look for missing partitions")?
        .iter()
        .map(|row| row.get(0))
        .collect();
    if missing.is_empty() {
        return Ok(Vec::new());
    }
    let mut script = format!(
        "BEGIN; SET LOCAL lock_timeout = '10s'; SELECT pg_advisory_xact_lock({PARTITION_DDL_LOCK_ID});"
    );
    // Created on its own, then attached: `CREATE TABLE ... PARTITION OF`
    // locks the parent ACCESS EXCLUSIVE, so it waits for every open
    // transaction on the table (a fence held by a slow handler) and stalls
    // every query queued behind it; `ATTACH PARTITION` takes SHARE UPDATE
    // EXCLUSIVE, which reads and writes do not conflict with.
    for day in wanted {
        let name = partition_name(day);
        if missing.contains(&name) {
            script.push_str(&format!(
                " DO $$ BEGIN IF to_regclass('{name}') IS NULL THEN \
                 CREATE TABLE {name} (LIKE idempotency_keys INCLUDING DEFAULTS INCLUDING CONSTRAINTS); \
                 ALTER TABLE idempotency_keys ATTACH PARTITION {name} FOR VALUES {}; \
                 END IF; END $$;",
                bounds(day)
            ));
        }
    }
    script.push_str(" COMMIT;");
    if let Err(error) = client.batch_execute(&script).await {
        let _ = client.batch_execute("ROLLBACK").await;
        return Err(error).context("create partitions");
    }
    Ok(missing)
}

/// Makes sure the partitions from today to `days_ahead` days after today
/// (UTC, by Postgres' clock) and [`NEVER_PARTITION`] exist. Idempotent.
/// (A row for an earlier day gets its partition from the writer on demand;
/// cleanup drops it.)
pub async fn ensure_ahead(client: &Client, days_ahead: u32) -> Result<Vec<String>> {
    let today = today(client).await?;
    let days = (today..=today + i64::from(days_ahead)).chain([NEVER_DAY]);
    ensure_days(client, days).await
}

/// Detaches (concurrently: the mirror and fences keep running) and drops
/// every daily partition whose whole range lies before now, so all its rows
/// have expired; finishes a detach an earlier pass left pending. Returns the
/// names dropped, oldest first.
pub async fn drop_expired(client: &Client) -> Result<Vec<String>> {
    let today = today(client).await?;
    let partitions = client
        .query(
            "SELECT c.relname::text, i.inhdetachpending
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             WHERE i.inhparent = 'idempotency_keys'::regclass
             ORDER BY 1",
            &[],
        )
        .await
        .context("list the partitions")?;
    let mut dropped = Vec::new();
    for row in partitions {
        let name: String = row.get(0);
        let pending: bool = row.get(1);
        // The partition of day d holds expires_at < day d + 1 (00:00 UTC).
        let Some(day) = day_of_name(&name) else {
            continue;
        };
        if day + 1 > today {
            continue;
        }
        let detach = if pending { "FINALIZE" } else { "CONCURRENTLY" };
        client
            .batch_execute(&format!(
                "ALTER TABLE idempotency_keys DETACH PARTITION {name} {detach}"
            ))
            .await
            .with_context(|| format!("detach partition {name}"))?;
        client
            .batch_execute(&format!("DROP TABLE {name}"))
            .await
            .with_context(|| format!("drop partition {name}"))?;
        dropped.push(name);
    }
    Ok(dropped)
}

/// Today (days since 1970-01-01, UTC) by Postgres' clock, as cleanup and the
/// fence measure expiry.
async fn today(client: &Client) -> Result<i64> {
    let row = client
        .query_one("SELECT floor(extract(epoch FROM now()) / 86400)::int8", &[])
        .await
        .context("read Postgres' clock")?;
    Ok(row.get(0))
}

/// Refuses to go on when `idempotency_keys` is not partitioned.
pub async fn require_partitioned(client: &Client) -> Result<()> {
    match detect(client).await? {
        Some(Layout::Partitioned) => Ok(()),
        Some(Layout::Unpartitioned) => Err(Error::Layout(
            "idempotency_keys is not partitioned (see docs/writer.md, \"Partitioned layout\")"
                .to_string(),
        )),
        None => Err(Error::Layout(
            "idempotency_keys does not exist: run idem-writer migrate --layout partitioned"
                .to_string(),
        )),
    }
}

/// (year, month, day) of a day count since 1970-01-01 (proleptic Gregorian;
/// H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_bounds_follow_utc_days() {
        assert_eq!(partition_name(0), "idempotency_keys_p19700101");
        assert_eq!(day_of_ms(1_796_000_000_000), 20_787);
        assert_eq!(partition_name(20_787), "idempotency_keys_p20261130");
        assert_eq!(
            bounds(20_787),
            "FROM ('2026-11-30 00:00:00+00') TO ('2026-12-01 00:00:00+00')"
        );
        assert_eq!(day_of_name("idempotency_keys_p20261130"), Some(20_787));
        assert_eq!(day_of_name("idempotency_keys_p20260230"), None);
        assert_eq!(day_of_name(NEVER_PARTITION), None);
        assert_eq!(day_of_ms(-1), -1);
        assert_eq!(
            partition_name(days_from_civil(2028, 2, 29)),
            "idempotency_keys_p20280229"
        );
    }

    #[test]
    fn rows_without_ttl_go_to_the_never_partition() {
        assert_eq!(days_from_civil(9999, 12, 31), NEVER_DAY);
        let never_ms = crate::mirror::record::NEVER_EXPIRES_MS;
        assert_eq!(partition_name(day_of_ms(never_ms)), NEVER_PARTITION);
        assert_eq!(partition_name(NEVER_DAY - 1), "idempotency_keys_p99991230");
    }
}
