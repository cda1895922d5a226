//! The HTTP handlers: `POST /payments` (validate, charge at the processor,
//! insert one row, 201) and `GET /payments/{id}`. With the fence (the
//! default) in two phases: a durable claim of the key, the processor's
//! charge under the fence's downstream key with no Postgres connection
//! held, then one short transaction that inserts the payment and completes
//! the key's row, only while this request still holds it.

use axum::extract::{Path, State};
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use bytes::Bytes;
use idem_client::middleware::IDEMPOTENT_REPLAYED;
use idem_client::{Claim, Commit, Fence, StoredResponse};
use serde::Deserialize;
use serde_json::json;
use tokio_postgres::types::ToSql;

use crate::db;
use crate::AppState;

/// Longest recipient accepted, in characters.
const MAX_RECIPIENT_CHARS: usize = 200;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewPayment {
    pub amount: i64,
    pub currency: String,
    pub recipient: String,
}

impl NewPayment {
    /// The first rule the request breaks, if any.
    fn violation(&self) -> Option<&'static str> {
        if self.amount <= 0 {
            return Some("amount must be a positive integer (minor units)");
        }
        if self.currency.len() != 3 || !self.currency.bytes().all(|b| b.is_ascii_uppercase()) {
            return Some("currency must be a three-letter ISO 4217 code such as EUR");
        }
        let recipient = self.recipient.trim();
        if recipient.is_empty() || recipient.chars().count() > MAX_RECIPIENT_CHARS {
            return Some("recipient must be 1 to 200 characters");
        }
        None
    }
}

pub async fn create_payment(
    State(state): State<AppState>,
    fence: Option<Extension<Fence>>,
    body: Bytes,
) -> Response {
    let value: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(value) => value,
        Err(err) => return error(StatusCode::BAD_REQUEST, "invalid_json", &err.to_string()),
    };
    // serde would also read a struct from an array of its fields.
    if !value.is_object() {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_payment",
            "a payment is a JSON object",
        );
    }
    let request: NewPayment = match serde_json::from_value(value) {
        Ok(request) => request,
        Err(err) => {
            return error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_payment",
                &err.to_string(),
            )
        }
    };
    if let Some(violation) = request.violation() {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_payment",
            violation,
        );
    }
    let recipient = request.recipient.trim();
    match fence {
        Some(Extension(fence)) if state.fence => {
            create_fenced(&state, &fence, &request, recipient).await
        }
        _ => create_unfenced(&state, &request, recipient).await,
    }
}

// ANCHOR: create_fenced
/// Claim, charge, then the payment and its idempotency row in one
/// autocommitted statement (the response, its id reserved ahead, is known
/// before the row is written). A failure after the claim leaves it to the
/// middleware to release (the claim was made through the pool); the retry's
/// charge under the same downstream key finds the first one.
async fn create_fenced(
    state: &AppState,
    fence: &Fence,
    request: &NewPayment,
    recipient: &str,
) -> Response {
    let result = async {
        match fence.claim(&state.db).await? {
            Claim::Proceed => {}
            other => return Ok(claim_answer(other)),
        }
        let downstream_key = fence.downstream_key();
        state
            .processor
            .charge(Some(&downstream_key), request.amount, &request.currency)
            .await?;
        let id = state.ids.next(&state.db).await?;
        let (payment, at) = db::new_payment(id, request.amount, &request.currency, recipient)?;
        let created = created(&payment)?;
        let row: [&(dyn ToSql + Sync); 5] = [
            &payment.id,
            &payment.amount,
            &payment.currency,
            &payment.recipient,
            &at,
        ];
        let committed = fence
            .commit_effect(&state.db, &created, db::INSERT_FENCED, &row)
            .await?;
        anyhow::Ok(match committed {
            Commit::Committed => http(&created),
            // Another holder took the key over meanwhile: nothing was
            // committed; the middleware answers what the key holds.
            Commit::Lost(claim) => claim_answer(claim),
        })
    };
    result.await.unwrap_or_else(|err| {
        tracing::error!(error = %err, "fenced payment");
        internal("the payment could not be stored")
    })
}
// ANCHOR_END: create_fenced

async fn create_unfenced(state: &AppState, request: &NewPayment, recipient: &str) -> Response {
    // Without the fence there is no downstream key: every run charges.
    if let Err(err) = state
        .processor
        .charge(None, request.amount, &request.currency)
        .await
    {
        tracing::error!(error = %err, "processor");
        return internal("the payment could not be charged");
    }
    let payment =
        match db::insert_payment(&state.db, request.amount, &request.currency, recipient).await {
            Ok(payment) => payment,
            Err(err) => {
                tracing::error!(error = %err, "insert payment");
                return internal("the payment could not be stored");
            }
        };
    match created(&payment) {
        Ok(created) => http(&created),
        Err(err) => {
            tracing::error!(error = %err, "encode payment");
            internal("the payment could not be encoded")
        }
    }
}

/// The 201 for a new payment, as stored and as sent.
fn created(payment: &db::Payment) -> anyhow::Result<StoredResponse> {
    Ok(StoredResponse::new(201, serde_json::to_vec(payment)?)
        .with_header(header::CONTENT_TYPE.as_str(), "application/json")
        .with_header(
            header::LOCATION.as_str(),
            format!("/payments/{}", payment.id),
        ))
}

fn http(stored: &StoredResponse) -> Response {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, stored.body.clone()).into_response();
    for (name, value) in &stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            response.headers_mut().insert(name, value);
        }
    }
    response
}

/// What the handler answers when the claim did not proceed (the middleware
/// gives the same answers; without it these stand).
fn claim_answer(claim: Claim) -> Response {
    match claim {
        Claim::Replay(stored) => {
            let mut response = http(&stored);
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            response
        }
        Claim::Mismatch => error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_key_reused",
            "the key was used for another request",
        ),
        Claim::InFlight | Claim::Proceed => error(
            StatusCode::CONFLICT,
            "idempotency_key_in_use",
            "a request with this key is being processed",
        ),
    }
}

fn internal(message: &str) -> Response {
    error(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
}

pub async fn get_payment(State(state): State<AppState>, Path(id): Path<i64>) -> Response {
    match db::find_payment(&state.db, id).await {
        Ok(Some(payment)) => (StatusCode::OK, Json(payment)).into_response(),
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            "no payment with this id",
        ),
        Err(err) => {
            tracing::error!(error = %err, "read payment");
            internal("the payment could not be read")
        }
    }
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (status, Json(json!({ "error": code, "message": message }))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payment(amount: i64, currency: &str, recipient: &str) -> NewPayment {
        NewPayment {
            amount,
            currency: currency.into(),
            recipient: recipient.into(),
        }
    }

    #[test]
    fn validates_fields() {
        assert_eq!(payment(100, "EUR", "bob").violation(), None);
        assert!(payment(0, "EUR", "bob").violation().is_some());
        assert!(payment(-5, "EUR", "bob").violation().is_some());
        assert!(payment(100, "eur", "bob").violation().is_some());
        assert!(payment(100, "EURO", "bob").violation().is_some());
        assert!(payment(100, "EUR", "  ").violation().is_some());
        assert!(payment(100, "EUR", &"x".repeat(201)).violation().is_some());
    }
}
