//! The writer over TLS: against a Redis that listens on a TLS port only and
//! a Postgres that accepts TLS connections only (both with certificates of
//! a CA made for the test), and libpq's `sslmode`s against TLS and
//! plaintext servers: what connects, what is encrypted, and what is a
//! configuration error (stops, never retried, never plaintext).

mod common;

use std::path::Path;
use std::time::Duration;

use idem_testkit::postgres_server::PgServer;
use idem_testkit::tls::{tls_postgres, Certs, TlsRedisServer};
use idem_writer::Error;

fn path(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// Whether the connection `pg` is on is encrypted (`pg_stat_ssl`).
async fn encrypted(pg: &tokio_postgres::Client) -> bool {
    pg.query_one(
        "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        &[],
    )
    .await
    .expect("read pg_stat_ssl")
    .get(0)
}

fn assert_config_error(result: Result<tokio_postgres::Client, Error>, says: &str) {
    match result {
        Err(Error::Config(message)) => {
            assert!(message.contains(says), "{says:?} not in {message:?}")
        }
        Err(other) => panic!("not a configuration error: {other:?}"),
        Ok(_) => panic!("connected; expected a configuration error saying {says:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmodes_connect_encrypt_and_fail_closed_as_libpq_says() {
    let certs = Certs::generate();
    let tls = tls_postgres(&certs);
    let port = tls.port;
    let ca = path(&certs.ca);
    let url = |host: &str, params: &str| {
        format!("postgres://postgres@{host}:{port}/postgres?hostaddr=127.0.0.1&{params}")
    };

    // verify-full with the right CA and host, a client certificate too.
    let full = url(
        "127.0.0.1",
        &format!(
            "sslmode=verify-full&sslrootcert={ca}&sslcert={}&sslkey={}",
            path(&certs.client_cert),
            path(&certs.client_key)
        ),
    );
    let pg = idem_writer::connect(&full).await.expect("verify-full");
    assert!(encrypted(&pg).await);
    let client_dn: Option<String> = pg
        .query_one(
            "SELECT client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(client_dn.as_deref(), Some("/CN=postgres"));

    // The host name is checked by verify-full only.
    let wrong_host = |mode: &str| {
        url(
            "wrong-host.test",
            &format!("sslmode={mode}&sslrootcert={ca}"),
        )
    };
    assert_config_error(
        idem_writer::connect(&wrong_host("verify-full")).await,
        "certificate",
    );
    let pg = idem_writer::connect(&wrong_host("verify-ca"))
        .await
        .expect("verify-ca ignores the host name");
    assert!(encrypted(&pg).await);

    // Another CA: refused under verify-ca and verify-full, and under
    // require and prefer when given as sslrootcert (libpq's rule).
    let other = path(&certs.other_ca);
    for mode in ["verify-full", "verify-ca", "require", "prefer"] {
        assert_config_error(
            idem_writer::connect(&url(
                "127.0.0.1",
                &format!("sslmode={mode}&sslrootcert={other}"),
            ))
            .await,
            "certificate",
        );
    }

    // prefer (the default) and require encrypt without checking the
    // certificate, as libpq does when no CA is given.
    for params in ["", "sslmode=prefer", "sslmode=require", "sslmode=allow"] {
        let pg = idem_writer::connect(&url("127.0.0.1", params))
            .await
            .unwrap_or_else(|e| panic!("{params:?}: {e}"));
        assert!(encrypted(&pg).await, "{params:?} did not encrypt");
    }
    // The same settings as a key=value string.
    let conninfo = format!(
        "host=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=verify-full sslrootcert='{ca}'"
    );
    assert!(encrypted(&idem_writer::connect(&conninfo).await.unwrap()).await);

    // disable against a TLS-only server: refused by the server.
    assert!(idem_writer::connect(&url("127.0.0.1", "sslmode=disable"))
        .await
        .is_err());
    // A certificate file that cannot be read, an unknown sslmode.
    assert_config_error(
        idem_writer::connect(&url(
            "127.0.0.1",
            "sslmode=verify-full&sslrootcert=/nonexistent/ca",
        ))
        .await,
        "/nonexistent/ca",
    );
    assert_config_error(
        idem_writer::connect(&url("127.0.0.1", "sslmode=verify_full")).await,
        "invalid sslmode",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_against_a_server_without_tls_is_a_configuration_error() {
    let plain = PgServer::start();
    let url = plain.url();
    assert_config_error(
        idem_writer::connect(&format!("{url}?sslmode=require")).await,
        "does not support TLS",
    );
    // prefer falls back to plaintext when TLS is not offered.
    let pg = idem_writer::connect(&format!("{url}?sslmode=prefer"))
        .await
        .expect("prefer");
    assert!(!encrypted(&pg).await);

    // The writer stops with the reason instead of retrying for ever.
    let redis = idem_testkit::RedisServer::start();
    let mut writer =
        common::WriterProcess::start(&[redis.url()], &format!("{url}?sslmode=require"), &[]);
    // The reason's text is asserted on `connect` above; the process's log
    // can end before its last line is written, so here it is the exit
    // (not a retry loop) that is asserted.
    let status = writer.wait(Duration::from_secs(20));
    assert!(!status.success());
    let log = writer.log_tail();
    assert!(!log.contains("Postgres unreachable"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_mirrors_from_tls_redis_into_tls_postgres() {
    let certs = Certs::generate();
    let redis = TlsRedisServer::start(&certs, true);
    let pg_server = tls_postgres(&certs);
    let database = pg_server.create_database("idem_tls");
    let database_url = format!(
        "{database}?sslmode=verify-full&sslrootcert={}",
        path(&certs.ca)
    );
    let mut writer = common::WriterProcess::start(
        &[redis.url()],
        &database_url,
        &[
            "--redis-ca-cert",
            path(&certs.ca),
            "--redis-client-cert",
            path(&certs.client_cert),
            "--redis-client-key",
            path(&certs.client_key),
        ],
    );

    let mut conn = redis
        .client(&certs)
        .get_connection()
        .expect("connect over TLS");
    let keys = common::keys("tls", 0..20);
    let done = common::complete_keys(&mut conn, &keys, 3600);
    let pg = idem_writer::connect(&database_url).await.expect("connect");
    let expected = done.len() as i64;
    let mirrored = idem_testkit::eventually_async(Duration::from_secs(20), || {
        let pg = &pg;
        async move {
            pg.query_one("SELECT to_regclass('idempotency_keys') IS NOT NULL", &[])
                .await
                .map(|r| r.get::<_, bool>(0))
                .unwrap_or(false)
                && common::row_count(pg).await == expected
        }
    })
    .await;
    assert!(mirrored, "not mirrored; writer log:\n{}", writer.log_tail());
    let rows = common::rows(&pg).await;
    for completion in &done {
        let row = &rows[&completion.key];
        assert_eq!(row.token, completion.token);
    }
    // Every connection the writer holds is encrypted.
    let (connections, all_tls): (i64, Option<bool>) = {
        let row = pg
            .query_one(
                "SELECT count(*), bool_and(s.ssl) FROM pg_stat_activity a
                 JOIN pg_stat_ssl s USING (pid) WHERE a.application_name = 'idem-writer'",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert!(connections > 0);
    assert_eq!(all_tls, Some(true));
    assert!(writer.is_running(), "{}", writer.log_tail());
    writer.terminate();
    assert!(writer.wait(Duration::from_secs(20)).success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_with_another_ca_fails_closed_at_start() {
    let certs = Certs::generate();
    let redis = TlsRedisServer::start(&certs, false);
    let pg = idem_testkit::PgDatabase::create();
    // The platform's roots do not know the test CA; an explicit wrong CA
    // neither. The writer never mirrors; its log says why.
    let mut writer = common::WriterProcess::start(
        &[redis.url()],
        &pg.url,
        &["--redis-ca-cert", path(&certs.other_ca)],
    );
    let said = idem_testkit::eventually(Duration::from_secs(20), || {
        writer.log_tail().contains("certificate")
    });
    assert!(said, "{}", writer.log_tail());
    writer.kill();
}
