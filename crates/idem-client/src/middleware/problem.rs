//! `application/problem+json` (RFC 9457) answers the middleware gives on its
//! own, and the replay of a stored response.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use super::body::IdemBody;
use crate::StoredResponse;

/// Header marking a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The middleware's own answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    /// 400: the layer is `required` and the request has no key.
    MissingKey,
    /// 400: the key header is empty, too long, malformed or repeated
    /// (the detail says which).
    InvalidKey(&'static str),
    /// 400: the layer has a tenant source and it gave no tenant, or an
    /// empty one.
    MissingTenant,
    /// 400: the tenant is longer than `MAX_TENANT_BYTES`.
    InvalidTenant,
    /// 413: the request body is over `max_request_body`.
    RequestTooLarge,
    /// 400: the request body could not be read.
    UnreadableRequest,
    /// 409: another request with this key is running.
    InFlight {
        /// Sent as `Retry-After` (whole seconds, rounded up).
        retry_after: Duration,
    },
    /// 422: the key was used with another request.
    Mismatch,
    /// 503: the store is unreachable (fail closed).
    Unavailable,
    /// 500: the store refused a call it should not have.
    Internal,
}

impl Problem {
    /// The HTTP status of this answer.
    pub fn status(&self) -> StatusCode {
        match self {
            Problem::MissingKey
            | Problem::InvalidKey(_)
            | Problem::MissingTenant
            | Problem::InvalidTenant
            | Problem::UnreadableRequest => StatusCode::BAD_REQUEST,
            Problem::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Problem::InFlight { .. } => StatusCode::CONFLICT,
            Problem::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Problem::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Problem::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Problem::MissingKey => "missing-idempotency-key",
            Problem::InvalidKey(_) => "invalid-idempotency-key",
            Problem::MissingTenant => "missing-tenant",
            Problem::InvalidTenant => "invalid-tenant",
            Problem::RequestTooLarge => "request-too-large",
            Problem::UnreadableRequest => "unreadable-request",
            Problem::InFlight { .. } => "idempotency-key-in-use",
            Problem::Mismatch => "idempotency-key-reused",
            Problem::Unavailable => "idempotency-store-unavailable",
            Problem::Internal => "idempotency-internal-error",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Problem::MissingKey => "Idempotency-Key is missing",
            Problem::InvalidKey(_) => "Idempotency-Key is invalid",
            Problem::MissingTenant => "Tenant is missing",
            Problem::InvalidTenant => "Tenant is invalid",
            Problem::RequestTooLarge => "Request body too large",
            Problem::UnreadableRequest => "Request body could not be read",
            Problem::InFlight { .. } => "A request with this Idempotency-Key is being processed",
            Problem::Mismatch => "Idempotency-Key was used with a different request",
            Problem::Unavailable => "Idempotency store unavailable",
            Problem::Internal => "Idempotency processing failed",
        }
    }

    fn detail(&self) -> &'static str {
        match self {
            Problem::MissingKey => "This operation requires an Idempotency-Key header.",
            Problem::InvalidKey(detail) => detail,
            Problem::MissingTenant => {
                "This operation requires an authenticated caller; the request names no tenant, or an empty one."
            }
            Problem::InvalidTenant => "The tenant is longer than 128 bytes.",
            Problem::RequestTooLarge => "The request body exceeds the size the server buffers.",
            Problem::UnreadableRequest => "The request body ended with an error.",
            Problem::InFlight { .. } => {
                "The original request has not finished yet; retry after the indicated time."
            }
            Problem::Mismatch => {
                "The key was already used for a request with a different method, path, headers or body."
            }
            Problem::Unavailable => "Retry the request later with the same Idempotency-Key.",
            Problem::Internal => "Retry the request later with the same Idempotency-Key.",
        }
    }

    /// The answer as an `application/problem+json` response (RFC 9457).
    pub fn into_response<B>(self) -> Response<IdemBody<B>> {
        let status = self.status();
        let body = serde_json::json!({
            "type": format!("urn:idem:problem:{}", self.kind()),
            "title": self.title(),
            "status": status.as_u16(),
            "detail": self.detail(),
        });
        let mut response = Response::new(IdemBody::full(Bytes::from(body.to_string())));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        match self {
            Problem::InFlight { retry_after } => {
                headers.insert(
                    RETRY_AFTER,
                    HeaderValue::from(retry_after_seconds(retry_after)),
                );
            }
            Problem::Unavailable => {
                headers.insert(RETRY_AFTER, HeaderValue::from(1u64));
            }
            _ => {}
        }
        response
    }
}

/// Whole seconds, rounded up, at least 1.
fn retry_after_seconds(retry_after: Duration) -> u64 {
    let secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
    secs.max(1)
}

/// The stored response with `Idempotent-Replayed: true`. Headers that are not
/// valid HTTP (never written by this middleware) are left out.
pub fn replay_response<B>(stored: StoredResponse) -> Response<IdemBody<B>> {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = Response::new(IdemBody::full(stored.body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        match (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value),
        ) {
            (Ok(name), Ok(value)) => {
                headers.append(name, value);
            }
            _ => {
                tracing::warn!(header = %name, "stored header is not valid HTTP; left out of the replay")
            }
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    #[tokio::test]
    async fn in_flight_is_409_problem_with_retry_after() {
        let response: Response<IdemBody<Full<Bytes>>> = Problem::InFlight {
            retry_after: Duration::from_millis(1200),
        }
        .into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[RETRY_AFTER], "2");
        assert_eq!(response.headers()[CONTENT_TYPE], "application/problem+json");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["status"], 409);
        assert_eq!(json["type"], "urn:idem:problem:idempotency-key-in-use");
    }

    #[tokio::test]
    async fn replay_restores_status_body_headers_and_marks_it() {
        let stored = StoredResponse::new(201, "{\"id\":1}")
            .with_header("content-type", "application/json")
            .with_header("location", "/payments/1");
        let response: Response<IdemBody<Full<Bytes>>> = replay_response(stored);
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers()["location"], "/payments/1");
        assert_eq!(response.headers()["idempotent-replayed"], "true");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "{\"id\":1}");
    }
}
