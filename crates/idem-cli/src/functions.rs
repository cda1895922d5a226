//! `idem functions load|status`: the Functions library (`functions/idem.lua`)
//! for a Redis that refuses MODULE LOAD; and the library's side of `idem
//! pending` (its per-slot outboxes counted).

use std::path::Path;

use anyhow::Context as _;
use idem_core::functions::{self as lib, outbox_for_slot, SLOTS};
use redis::aio::MultiplexedConnection;
use redis::Value as Reply;
use serde_json::{json, Value};

use crate::exit::{Code, Failure};
use crate::output::{now_ms, Outcome};
use crate::redis_side;

/// Outboxes counted per pipeline.
const PIPELINE: usize = 2048;

/// `FUNCTION LOAD REPLACE` of `file` on every node, then its version.
pub async fn load(urls: &[String], file: &Path) -> Result<Outcome, Failure> {
    let source = std::fs::read_to_string(file)
        .with_context(|| format!("read the library {}", file.display()))?;
    let mut nodes = Vec::new();
    let mut failed = false;
    for url in urls {
        let loaded = async {
            let mut conn = redis_side::connect(url).await?;
            let name: String = redis::cmd("FUNCTION")
                .arg("LOAD")
                .arg("REPLACE")
                .arg(&source)
                .query_async(&mut conn)
                .await
                .context("FUNCTION LOAD REPLACE")?;
            let version = library_version(&mut conn)
                .await?
                .context("idem_version does not answer after the load")?;
            anyhow::Ok(
                json!({ "node": redis_side::redact(url), "library": name, "version": version }),
            )
        }
        .await;
        nodes.push(loaded.unwrap_or_else(|error| {
            failed = true;
            json!({ "node": redis_side::redact(url), "error": format!("{error:#}") })
        }));
    }
    let mut text = String::new();
    for node in &nodes {
        let name = node["node"].as_str().unwrap_or_default();
        match node["error"].as_str() {
            Some(error) => text.push_str(&format!("{name}: error: {error}\n")),
            None => text.push_str(&format!(
                "{name}: loaded library {} version {}\n",
                node["library"].as_str().unwrap_or_default(),
                node["version"]
            )),
        }
    }
    Ok(Outcome {
        json: json!({ "file": file.display().to_string(), "nodes": nodes }),
        text,
        code: if failed { Code::Error } else { Code::Ok },
    })
}

/// What each node runs: the module, the library (its version), or neither.
pub async fn status(urls: &[String]) -> Result<Outcome, Failure> {
    let mut nodes = Vec::new();
    let mut failed = false;
    for url in urls {
        let node = async {
            let mut conn = redis_side::connect(url).await?;
            let module = has_module(&mut conn).await?;
            let version = library_version(&mut conn).await?;
            let backend = match (module, version) {
                (true, _) => "module",
                (false, Some(_)) => "functions",
                (false, None) => "none",
            };
            anyhow::Ok(json!({
                "node": redis_side::redact(url),
                "backend": backend,
                "module": module,
                "library_version": version,
                "expected_version": lib::VERSION,
            }))
        }
        .await;
        nodes.push(node.unwrap_or_else(|error| {
            failed = true;
            json!({ "node": redis_side::redact(url), "error": format!("{error:#}") })
        }));
    }
    let mut text = format!(
        "{:<32}{:<11}{:<8}{}\n",
        "node", "backend", "module", "library"
    );
    for node in &nodes {
        let name = node["node"].as_str().unwrap_or_default();
        if let Some(error) = node["error"].as_str() {
            text.push_str(&format!("{name:<32}error: {error}\n"));
            continue;
        }
        let library = match node["library_version"].as_i64() {
            Some(v) if v < lib::VERSION as i64 => {
                format!(
                    "version {v} (older than {}: idem functions load)",
                    lib::VERSION
                )
            }
            Some(v) => format!("version {v}"),
            None => "-".to_string(),
        };
        text.push_str(&format!(
            "{name:<32}{:<11}{:<8}{library}\n",
            node["backend"].as_str().unwrap_or_default(),
            if node["module"] == json!(true) {
                "yes"
            } else {
                "no"
            },
        ));
    }
    Ok(Outcome {
        json: json!({ "nodes": nodes }),
        text,
        code: if failed { Code::Error } else { Code::Ok },
    })
}

/// Whether the module is loaded (`COMMAND INFO IDEM.MIRROR.PULL` names it).
async fn has_module(conn: &mut MultiplexedConnection) -> anyhow::Result<bool> {
    let reply: Reply = redis::cmd("COMMAND")
        .arg("INFO")
        .arg("IDEM.MIRROR.PULL")
        .query_async(conn)
        .await
        .context("COMMAND INFO")?;
    Ok(matches!(reply, Reply::Array(entries) if entries.iter().any(|e| !matches!(e, Reply::Nil))))
}

/// The library's version (`FCALL idem_version 0`), `None` when not loaded.
pub async fn library_version(conn: &mut MultiplexedConnection) -> anyhow::Result<Option<i64>> {
    let reply: redis::RedisResult<Reply> = redis::cmd("FCALL")
        .arg(lib::VERSION_FN)
        .arg(0)
        .query_async(conn)
        .await;
    match reply {
        Ok(Reply::Int(version)) => Ok(Some(version)),
        Ok(other) => anyhow::bail!("idem_version answered {other:?}"),
        // Function not found; no FCALL before Redis 7; an ACL refusing it.
        Err(error) if error.code().is_some() => Ok(None),
        Err(error) => Err(error).context("FCALL idem_version"),
    }
}

/// `idem pending` on a node running the library: the members of every
/// outbox it serves (records completed and not yet acknowledged), and how
/// long the most overdue has been due. `None` when the library is not
/// loaded.
pub async fn pending(conn: &mut MultiplexedConnection) -> anyhow::Result<Option<Value>> {
    let Some(version) = library_version(conn).await? else {
        return Ok(None);
    };
    let slots: Vec<u16> = (0..SLOTS).collect();
    let mut pending = 0u64;
    let mut busy = Vec::new();
    for chunk in slots.chunks(PIPELINE) {
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for &slot in chunk {
            pipe.cmd("ZCARD").arg(outbox_for_slot(slot));
        }
        let counts: Vec<Reply> = pipe.query_async(conn).await.context("ZCARD")?;
        for (&slot, count) in chunk.iter().zip(counts) {
            // A cluster node answers MOVED for slots it does not serve.
            if let Reply::Int(n) = count {
                if n > 0 {
                    pending += n as u64;
                    busy.push(slot);
                }
            }
        }
    }
    let mut earliest: Option<f64> = None;
    for chunk in busy.chunks(PIPELINE) {
        let mut pipe = redis::pipe();
        for &slot in chunk {
            pipe.cmd("ZRANGE")
                .arg(outbox_for_slot(slot))
                .arg(0)
                .arg(0)
                .arg("WITHSCORES");
        }
        let firsts: Vec<Vec<(Vec<u8>, f64)>> = pipe.query_async(conn).await.context("ZRANGE")?;
        for (_, score) in firsts.into_iter().flatten() {
            earliest = Some(earliest.map_or(score, |e: f64| e.min(score)));
        }
    }
    let now = now_ms();
    let overdue = earliest
        .map(|due| now.saturating_sub(due.max(0.0) as u64))
        .unwrap_or(0);
    Ok(Some(json!({
        "backend": "functions",
        "library_version": version,
        "pending": pending,
        "oldest_pending_ms": overdue,
        "acks": null,
    })))
}
