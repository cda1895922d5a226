//! `idem cleanup`: one pass of the writer's cleanup, through its library
//! (`idem_writer::cleanup_once`), with the writer's defaults.

use serde_json::json;

use crate::exit::Failure;
use crate::output::Outcome;

pub async fn run(
    url: &str,
    batch_size: Option<u32>,
    days_ahead: Option<u32>,
) -> Result<Outcome, Failure> {
    let defaults = idem_writer::WriterConfig::new(Vec::new(), "");
    let batch_size = batch_size.unwrap_or(defaults.cleanup_batch_size);
    let days_ahead = days_ahead.unwrap_or(defaults.partition_days_ahead);
    if batch_size == 0 {
        return Err(Failure::Usage("--batch-size must be at least 1".into()));
    }
    let cleaned = idem_writer::cleanup_once(url, batch_size, days_ahead)
        .await
        .map_err(|e| anyhow::Error::new(e).context("cleanup"))?;
    let layout = cleaned.layout.to_string();
    Ok(Outcome::ok(
        json!({
            "layout": layout,
            "rows_deleted": cleaned.rows_deleted,
            "partitions_dropped": cleaned.partitions_dropped,
            "partitions_created": cleaned.partitions_created,
        }),
        format!("cleanup ({layout} layout): {cleaned}\n"),
    ))
}
