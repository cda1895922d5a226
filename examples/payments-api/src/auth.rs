//! Authentication: `Authorization: Bearer <token>` mapped to an account by a
//! configured table (`API_TOKENS="tok_a=acct_1,tok_b=acct_2"`). The account
//! is what scopes idempotency keys (the layer's `tenant`); the client never
//! names it. A missing or unknown token is answered 401 before the
//! idempotency layer runs.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Context};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// The demo table used when `API_TOKENS` is unset (scripts/up.sh, the
/// conformance suite): never deploy it, set `API_TOKENS`.
pub const DEMO_TOKENS: &str = "tok_demo=acct_demo,tok_a=acct_a,tok_b=acct_b";

/// The authenticated caller, left in the request's extensions for the
/// idempotency layer's `tenant` and the handlers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account(pub String);

/// Bearer tokens and the account each stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokens(HashMap<String, String>);

impl Tokens {
    /// `token=account` pairs separated by commas; spaces around either are
    /// dropped. Empty tokens or accounts, and a token given twice, are
    /// errors.
    pub fn parse(table: &str) -> anyhow::Result<Tokens> {
        let mut tokens = HashMap::new();
        for pair in table.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (token, account) = pair
                .split_once('=')
                .with_context(|| format!("API_TOKENS: {pair:?} is not token=account"))?;
            let (token, account) = (token.trim(), account.trim());
            if token.is_empty() || account.is_empty() {
                bail!("API_TOKENS: {pair:?} has an empty token or account");
            }
            if tokens
                .insert(token.to_owned(), account.to_owned())
                .is_some()
            {
                bail!("API_TOKENS: a token is given twice");
            }
        }
        if tokens.is_empty() {
            bail!("API_TOKENS has no token=account pair");
        }
        Ok(Tokens(tokens))
    }

    /// [`DEMO_TOKENS`].
    pub fn demo() -> Tokens {
        Tokens::parse(DEMO_TOKENS).expect("the demo table parses")
    }

    /// The account of an `Authorization` header's value.
    pub fn account(&self, authorization: &[u8]) -> Option<&str> {
        let token = std::str::from_utf8(authorization)
            .ok()?
            .strip_prefix("Bearer ")?
            .trim();
        self.0.get(token).map(String::as_str)
    }
}

impl Default for Tokens {
    fn default() -> Self {
        Tokens::demo()
    }
}

/// The middleware: 401 without a known bearer token, else the request goes
/// on with its [`Account`].
pub async fn authenticate(
    State(tokens): State<Arc<Tokens>>,
    mut request: Request,
    next: Next,
) -> Response {
    let account = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| tokens.account(value.as_bytes()));
    match account {
        Some(account) => {
            let account = Account(account.to_owned());
            request.extensions_mut().insert(account);
            next.run(request).await
        }
        None => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            Json(json!({
                "error": "unauthorized",
                "message": "send Authorization: Bearer <token> with a known token",
            })),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_parse_and_map_tokens_to_accounts() {
        let tokens = Tokens::parse(" tok_a=acct_1, tok_b = acct_2 ,").unwrap();
        assert_eq!(tokens.account(b"Bearer tok_a"), Some("acct_1"));
        assert_eq!(tokens.account(b"Bearer tok_b"), Some("acct_2"));
        assert_eq!(tokens.account(b"Bearer tok_c"), None);
        assert_eq!(tokens.account(b"tok_a"), None, "not a bearer token");
        assert_eq!(tokens.account(b"Basic tok_a"), None);
        assert_eq!(tokens.account(b"Bearer "), None);
        for bad in ["", "tok", "=acct", "tok=", "a=1,a=2"] {
            assert!(Tokens::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            Tokens::demo().account(b"Bearer tok_demo"),
            Some("acct_demo")
        );
    }
}
