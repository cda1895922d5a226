//! `idem pending`: each node's mirror outbox from `INFO idem` (how many
//! completed records wait for the writer, how long the oldest has waited,
//! acknowledgements so far), its role, and optionally the oldest pending
//! keys themselves.

use idem_core::State;
use serde_json::{json, Value};

use crate::exit::{Code, Failure};
use crate::output::{age, now_ms, time, Outcome};
use crate::{redis_side, scan};

/// The `INFO idem` fields read here (src/info.rs writes them).
const PENDING: &str = "mirror_pending";
const OLDEST_MS: &str = "mirror_oldest_pending_ms";
const ACKS: &str = "mirror_acks";

pub async fn run(urls: &[String], keys: Option<usize>, pattern: &str) -> Result<Outcome, Failure> {
    let mut nodes = Vec::new();
    let mut failed = false;
    for url in urls {
        match node(url, keys, pattern).await {
            Ok(doc) => nodes.push(doc),
            Err(error) => {
                failed = true;
                nodes.push(
                    json!({ "node": redis_side::redact(url), "error": format!("{error:#}") }),
                );
            }
        }
    }
    let total: u64 = nodes.iter().filter_map(|n| n["pending"].as_u64()).sum();
    let oldest = nodes
        .iter()
        .filter_map(|n| n["oldest_pending_ms"].as_u64())
        .max();
    let text = table(&nodes, total, oldest);
    Ok(Outcome {
        json: json!({ "nodes": nodes, "pending": total, "oldest_pending_ms": oldest }),
        text,
        code: if failed { Code::Error } else { Code::Ok },
    })
}

async fn node(url: &str, keys: Option<usize>, pattern: &str) -> anyhow::Result<Value> {
    let mut conn = redis_side::connect(url).await?;
    let idem = redis_side::info(&mut conn, "idem").await?;
    if !idem.iter().any(|(n, _)| n.ends_with(PENDING)) {
        // No module: the Functions library's outboxes, when it is loaded.
        if let Some(mut doc) = crate::functions::pending(&mut conn).await? {
            doc["node"] = json!(redis_side::redact(url));
            doc["role"] = json!(role(&mut conn).await?);
            if keys.is_some() {
                doc["keys_note"] = json!("--keys lists module records only");
            }
            return Ok(doc);
        }
    }
    let field = |name: &str| -> anyhow::Result<u64> {
        idem.iter()
            .find(|(n, _)| n.ends_with(name))
            .and_then(|(_, v)| v.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("INFO idem has no {name}: is the idem module loaded?"))
    };
    let (pending, oldest_ms, acks) = (field(PENDING)?, field(OLDEST_MS)?, field(ACKS)?);
    let role = role(&mut conn).await?;
    let mut doc = json!({
        "node": redis_side::redact(url),
        "role": role,
        "pending": pending,
        "oldest_pending_ms": oldest_ms,
        "acks": acks,
    });
    if let Some(limit) = keys {
        let mut found = Vec::new();
        scan::records(&mut conn, pattern, |key, record| {
            if let (true, State::Completed(c)) = (record.mirror_pending(), &record.state) {
                found.push((c.completed_at, key, record.token));
            }
        })
        .await?;
        found.sort();
        found.dedup();
        let now = now_ms();
        doc["keys"] = found
            .into_iter()
            .take(limit)
            .map(|(at, key, token)| {
                json!({
                    "key": String::from_utf8_lossy(&key),
                    "token": token,
                    "completed_at": time(at),
                    "waiting_ms": now.saturating_sub(at),
                })
            })
            .collect();
    }
    Ok(doc)
}

/// The node's `role` from `INFO replication`.
async fn role(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<String> {
    let replication = redis_side::info(conn, "replication").await?;
    Ok(replication
        .iter()
        .find(|(n, _)| n == "role")
        .map_or("unknown", |(_, v)| v.as_str())
        .to_string())
}

fn table(nodes: &[Value], total: u64, oldest: Option<u64>) -> String {
    let mut out = format!(
        "{:<32}{:<8}{:>10}  {:<16}{:>10}\n",
        "node", "role", "pending", "oldest pending", "acks"
    );
    for node in nodes {
        let name = node["node"].as_str().unwrap_or_default();
        if let Some(error) = node["error"].as_str() {
            out.push_str(&format!("{name:<32}error: {error}\n"));
            continue;
        }
        let oldest = node["oldest_pending_ms"].as_u64().unwrap_or(0);
        let pending = node["pending"].as_u64().unwrap_or(0);
        out.push_str(&format!(
            "{name:<32}{:<8}{pending:>10}  {:<16}{:>10}\n",
            node["role"].as_str().unwrap_or_default(),
            if pending == 0 {
                "-".into()
            } else {
                age(oldest)
            },
            match &node["acks"] {
                Value::Null => "-".to_string(),
                acks => acks.to_string(),
            },
        ));
        for key in node["keys"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "    {}  token {}  completed {}  waiting {}\n",
                key["key"].as_str().unwrap_or_default(),
                key["token"],
                key["completed_at"].as_str().unwrap_or_default(),
                age(key["waiting_ms"].as_u64().unwrap_or(0)),
            ));
        }
    }
    out.push_str(&format!(
        "{:<40}{total:>10}  {}\n",
        "total",
        match oldest {
            Some(ms) if total > 0 => age(ms),
            _ => "-".into(),
        }
    ));
    out
}
