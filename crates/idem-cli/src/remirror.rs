//! `idem remirror --since TIME`: writes into Postgres again the completed
//! records Redis still holds that were completed at or after TIME, for when
//! Postgres lost rows the writer had written (a promotion that dropped the
//! last transactions). It uses the writer's own upsert (`idem_writer::store`)
//! on either layout, so a row is only ever moved forward to a larger token,
//! and a fenced completion or a live durable claim is left as it is:
//! running it twice writes nothing the second time. The module's outbox is
//! not touched (pending records stay the writer's to acknowledge).

use anyhow::Context as _;
use idem_core::record::NO_EXPIRY;
use idem_core::{Record, State};
use idem_writer::partitions::{self, Layout};
use idem_writer::store::{self, Statements};
use idem_writer::{MirrorRecord, NEVER_EXPIRES_MS};
use serde_json::{json, Value};
use tokio_postgres::Client;

use crate::exit::{Code, Failure};
use crate::output::{time, Outcome};
use crate::{postgres, redis_side, scan};

/// Records per upsert statement.
const BATCH: usize = 500;

/// What one node's pass did.
#[derive(Default)]
struct Tally {
    scanned: u64,
    completed_since: u64,
    written: u64,
    unchanged: u64,
    skipped: Vec<(String, String)>,
    failed: Vec<(String, String)>,
}

pub async fn run(
    since_ms: u64,
    urls: &[String],
    database_url: &str,
    pattern: &str,
    dry_run: bool,
) -> Result<Outcome, Failure> {
    let pg = postgres::connect(database_url).await?;
    let layout = partitions::detect(&pg)
        .await
        .map_err(anyhow::Error::new)?
        .ok_or_else(|| {
            anyhow::anyhow!(
                "Postgres has no idempotency_keys table: run the writer's migrations first"
            )
        })?;
    let mut nodes = Vec::new();
    let mut incomplete = false;
    for url in urls {
        let tally = node(url, since_ms, &pg, layout, pattern, dry_run).await?;
        incomplete |= !tally.failed.is_empty();
        let list = |v: &[(String, String)]| -> Value {
            v.iter()
                .map(|(key, why)| json!({ "key": key, "why": why }))
                .collect()
        };
        nodes.push(json!({
            "node": redis_side::redact(url),
            "keys_scanned": tally.scanned,
            "completed_since": tally.completed_since,
            "written": tally.written,
            "unchanged": tally.unchanged,
            "skipped": list(&tally.skipped),
            "failed": list(&tally.failed),
        }));
    }
    let mut text = format!(
        "{} completed records since {} into Postgres ({layout} layout){}\n",
        if dry_run {
            "would re-mirror"
        } else {
            "re-mirrored"
        },
        time(since_ms),
        if dry_run {
            ", dry run: nothing written"
        } else {
            ""
        },
    );
    for n in &nodes {
        text.push_str(&format!(
            "{}: {} keys scanned, {} completed since, {} written, {} unchanged (Postgres as new or newer), {} skipped, {} failed\n",
            n["node"].as_str().unwrap_or_default(),
            n["keys_scanned"],
            n["completed_since"],
            n["written"],
            n["unchanged"],
            n["skipped"].as_array().map_or(0, Vec::len),
            n["failed"].as_array().map_or(0, Vec::len),
        ));
        for kind in ["skipped", "failed"] {
            for entry in n[kind].as_array().into_iter().flatten() {
                text.push_str(&format!(
                    "  {kind} {}: {}\n",
                    entry["key"].as_str().unwrap_or_default(),
                    entry["why"].as_str().unwrap_or_default()
                ));
            }
        }
    }
    Ok(Outcome {
        json: json!({
            "since": time(since_ms),
            "since_ms": since_ms,
            "dry_run": dry_run,
            "layout": layout.to_string(),
            "nodes": nodes,
        }),
        text,
        code: if incomplete {
            Code::Incomplete
        } else {
            Code::Ok
        },
    })
}

async fn node(
    url: &str,
    since_ms: u64,
    pg: &Client,
    layout: Layout,
    pattern: &str,
    dry_run: bool,
) -> anyhow::Result<Tally> {
    let mut conn = redis_side::connect(url).await?;
    let mut tally = Tally::default();
    let mut rows = Vec::new();
    tally.scanned = scan::records(&mut conn, pattern, |key, record| {
        match mirror_record(key, record, since_ms) {
            Some(Ok(row)) => rows.push(row),
            Some(Err(skip)) => tally.skipped.push(skip),
            None => {}
        }
    })
    .await
    .with_context(|| format!("scan {}", redis_side::redact(url)))?;
    // SCAN may return a key twice; the upsert keeps one version per key.
    rows.sort_by(|a: &MirrorRecord, b| (&a.key, a.token).cmp(&(&b.key, b.token)));
    rows.dedup_by(|a, b| a.key == b.key && a.token == b.token);
    tally.completed_since = rows.len() as u64 + tally.skipped.len() as u64;
    if dry_run {
        return Ok(tally);
    }
    for batch in rows.chunks(BATCH) {
        match upsert(pg, layout, batch).await {
            Ok(written) => {
                tally.written += written;
                tally.unchanged += batch.len() as u64 - written;
            }
            // One bad row fails its statement: write the batch row by row
            // to find it and still write the others.
            Err(_) => {
                for row in batch {
                    match upsert(pg, layout, std::slice::from_ref(row)).await {
                        Ok(written) => {
                            tally.written += written;
                            tally.unchanged += 1 - written;
                        }
                        Err(error) => tally.failed.push((row.key.clone(), format!("{error:#}"))),
                    }
                }
            }
        }
    }
    Ok(tally)
}

/// The writer's upsert of `rows` on `layout`: how many rows it wrote.
async fn upsert(pg: &Client, layout: Layout, rows: &[MirrorRecord]) -> anyhow::Result<u64> {
    match layout {
        Layout::Unpartitioned => {
            let statement = pg.prepare(store::UPSERT_SQL).await?;
            Ok(store::upsert_with(pg, Statements::Unpartitioned(&statement), rows).await?)
        }
        Layout::Partitioned => {
            partitions::ensure_days(
                pg,
                rows.iter().map(|r| partitions::day_of_ms(r.expires_at_ms)),
            )
            .await?;
            let lock = pg.prepare(store::LOCK_KEYS_SQL).await?;
            let upsert = pg.prepare(store::PARTITIONED_UPSERT_SQL).await?;
            let statements = Statements::Partitioned {
                lock: &lock,
                upsert: &upsert,
            };
            Ok(store::upsert_with(pg, statements, rows).await?)
        }
    }
}

/// The row the writer would store for a completed record of `since_ms` or
/// later (`None` for records in flight or completed earlier), or why it
/// cannot be stored.
fn mirror_record(
    key: Vec<u8>,
    record: Record,
    since_ms: u64,
) -> Option<Result<MirrorRecord, (String, String)>> {
    let State::Completed(c) = record.state else {
        return None;
    };
    if c.completed_at < since_ms {
        return None;
    }
    let key = match String::from_utf8(key) {
        Ok(key) if !key.contains('\0') => key,
        Ok(key) => {
            return Some(Err((
                key,
                "the key holds a NUL byte (Postgres TEXT cannot)".into(),
            )))
        }
        Err(e) => {
            let shown = String::from_utf8_lossy(e.as_bytes()).into_owned();
            return Some(Err((
                shown,
                "the key is not UTF-8 (Postgres TEXT cannot hold it)".into(),
            )));
        }
    };
    let signed = |v: u64| i64::try_from(v).ok();
    let expires_at_ms = match record.expires_at {
        NO_EXPIRY => Some(NEVER_EXPIRES_MS),
        at => signed(at).map(|at| at.min(NEVER_EXPIRES_MS)),
    };
    let (Some(token), Some(created_at_ms), Some(completed_at_ms), Some(expires_at_ms)) = (
        signed(record.token),
        signed(record.created_at),
        signed(c.completed_at),
        expires_at_ms,
    ) else {
        return Some(Err((key, "a time or token does not fit a bigint".into())));
    };
    Some(Ok(MirrorRecord {
        key,
        token,
        fingerprint: hex::encode(record.fingerprint.digest()),
        status: c.status.into(),
        body: c.body,
        headers: c
            .headers
            .into_iter()
            .flat_map(|h| [h.name, h.value])
            .collect(),
        created_at_ms,
        completed_at_ms,
        expires_at_ms,
    }))
}
