//! Error replies are bytes: a server's error whose text is not UTF-8
//! reaches the caller as that error, over a connection that stays up.

mod common;

use std::time::Duration;

use common::BareRedis;
use idem_client::{BeginOptions, IdemClient, IdemError, Pipe};

/// Redis' `unknown command` error echoes the arguments, a binary
/// fingerprint's bytes included: an error reply that is not UTF-8, which
/// must reach the caller as that error and leave the connection up.
#[tokio::test]
async fn an_error_reply_that_is_not_utf8_is_an_error_not_a_lost_connection() {
    let server = BareRedis::start();
    let pipe = Pipe::connect(&server.client()).await.unwrap();
    // The module's commands (no probing): the server does not know them.
    let client = IdemClient::new(pipe.clone());
    for _ in 0..2 {
        let answer = client
            .begin(
                "idem:{bin}",
                b"\xff\xfe\x80fp",
                BeginOptions::new(Duration::from_secs(60)),
            )
            .await;
        match answer {
            Err(IdemError::Redis(error)) => {
                let text = error.to_string();
                assert!(text.contains("unknown command"), "{text}");
            }
            other => panic!("expected the server's error, got {other:?}"),
        }
    }
    let mut conn = pipe;
    let pong: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    assert_eq!(pong, "PONG");
}
