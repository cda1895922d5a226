//! HTTP calls of the middleware and example-service tests (feature `http`):
//! a request sent and its reply read whole.

use reqwest::header::HeaderMap;

/// A whole HTTP reply.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: bytes::Bytes,
}

impl Reply {
    /// A header's value, when present and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Whether the middleware replayed a stored response.
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The body as JSON (panics when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("JSON body")
    }
}

/// Sends `request` and reads the whole reply (panics when the request fails).
pub async fn send(request: reqwest::RequestBuilder) -> Reply {
    let response = request.send().await.expect("HTTP request");
    Reply {
        status: response.status().as_u16(),
        headers: response.headers().clone(),
        body: response.bytes().await.expect("body"),
    }
}
