//! The payment processor the API calls, simulated: it takes
//! `PROCESSOR_DELAY_MS` to answer and honours an `Idempotency-Key` as
//! Stripe's and Adyen's APIs do (a second call with the same key returns the
//! first call's charge and charges nothing). Its ledger,
//! `processor_charges`, stands for the processor's own records: tests count
//! charges there, next to the API's payments.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use deadpool_postgres::Pool;

/// The processor's ledger, one row per charge (its own table, written
/// outside the API's transactions, as another system's would be).
pub const CREATE_CHARGES: &str = "CREATE TABLE IF NOT EXISTS processor_charges (
    id              BIGSERIAL   PRIMARY KEY,
    idempotency_key TEXT        NOT NULL UNIQUE,
    amount          BIGINT      NOT NULL,
    currency        TEXT        NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
)";

/// Records the charge under `key` unless the key has one, answering the
/// new charge's id (no row when the key had one).
const CHARGE: &str = "INSERT INTO processor_charges (idempotency_key, amount, currency) \
     VALUES ($1, $2, $3) ON CONFLICT (idempotency_key) DO NOTHING RETURNING id";

/// The key's charge, read in a statement of its own: one a concurrent call
/// committed while `CHARGE` waited on it is not in `CHARGE`'s snapshot.
const EXISTING: &str = "SELECT id FROM processor_charges WHERE idempotency_key = $1";

/// The simulated processor.
#[derive(Clone)]
pub struct Processor {
    ledger: Pool,
    delay: Duration,
}

impl Processor {
    pub fn new(ledger: Pool, delay: Duration) -> Self {
        Processor { ledger, delay }
    }

    /// Charges `amount` under `idempotency_key` (a fresh key when `None`:
    /// every such call charges) and answers the charge id after the
    /// processor's latency. The ledger's connection is held for one
    /// statement only, never across the latency.
    pub async fn charge(
        &self,
        idempotency_key: Option<&str>,
        amount: i64,
        currency: &str,
    ) -> anyhow::Result<i64> {
        let fresh;
        let key = match idempotency_key {
            Some(key) => key,
            None => {
                fresh = fresh_key();
                &fresh
            }
        };
        let id: i64 = {
            let client = self.ledger.get().await?;
            let charge = client.prepare_cached(CHARGE).await?;
            match client
                .query_opt(&charge, &[&key, &amount, &currency])
                .await?
            {
                Some(row) => row.try_get(0)?,
                None => {
                    let existing = client.prepare_cached(EXISTING).await?;
                    client.query_one(&existing, &[&key]).await?.try_get(0)?
                }
            }
        };
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        Ok(id)
    }
}

/// A key no other call uses: this process, the clock and a counter.
fn fresh_key() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "anon-{}-{nanos}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
