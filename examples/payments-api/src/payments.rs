//! The HTTP handlers: `POST /payments` (validate, insert one row, 201) and
//! `GET /payments/{id}`.

use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::json;

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

pub async fn create_payment(State(state): State<AppState>, body: Bytes) -> Response {
    let value: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(value) => value,
        Err(err) => return error(StatusCode::BAD_REQUEST, "invalid_json", &err.to_string()),
    };
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
    if !state.processor_delay.is_zero() {
        // Stands in for the call to a payment processor.
        tokio::time::sleep(state.processor_delay).await;
    }
    let recipient = request.recipient.trim();
    match db::insert_payment(&state.db, request.amount, &request.currency, recipient).await {
        Ok(payment) => {
            let location = format!("/payments/{}", payment.id);
            let mut response = (StatusCode::CREATED, Json(payment)).into_response();
            if let Ok(location) = HeaderValue::from_str(&location) {
                response.headers_mut().insert(header::LOCATION, location);
            }
            response
        }
        Err(err) => {
            tracing::error!(error = %err, "insert payment");
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "the payment could not be stored",
            )
        }
    }
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
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "the payment could not be read",
            )
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
