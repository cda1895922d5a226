//! The `idem` CLI against a TLS-only redis-server and a TLS-only Postgres
//! (certificates from `REDIS_CA_CERT`, `REDIS_CLIENT_CERT`,
//! `REDIS_CLIENT_KEY` and the database URL's `sslmode`), URLs read from
//! files, and no password in anything it prints when a connection fails.

use std::path::Path;
use std::process::Command;

use idem_testkit::tls::{tls_postgres, Certs, TlsRedisServer};
use serde_json::Value;

fn path(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// Runs `idem ARGS` with `env` and nothing else from the environment's
/// idem settings: (exit code, stdout, stderr).
fn idem(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args);
    for name in [
        "REDIS_URL",
        "DATABASE_URL",
        "REDIS_URL_FILE",
        "DATABASE_URL_FILE",
        "REDIS_CA_CERT",
        "REDIS_CLIENT_CERT",
        "REDIS_CLIENT_KEY",
    ] {
        cmd.env_remove(name);
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().expect("run idem");
    (
        out.status.code().expect("an exit code"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_cli_works_over_tls_with_urls_from_files() {
    let certs = Certs::generate();
    let redis = TlsRedisServer::start(&certs, true);
    let pg = tls_postgres(&certs);
    let database = format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        pg.url(),
        path(&certs.ca)
    );
    let tls_env = [
        ("REDIS_CA_CERT", path(&certs.ca)),
        ("REDIS_CLIENT_CERT", path(&certs.client_cert)),
        ("REDIS_CLIENT_KEY", path(&certs.client_key)),
    ];
    let (code, stdout, stderr) = idem(&["--json", "pending", "--redis", &redis.url()], &tls_env);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let doc: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(doc["nodes"][0]["node"], redis.url(), "{doc}");

    // The URLs from files; Postgres over verify-full (the table made by the
    // writer's migrations over the same URL).
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let mut client = idem_writer::connect(&database).await.expect("verify-full");
        idem_writer::migrate(&mut client).await.expect("migrate");
    });
    let redis_file = certs.dir.join("redis-url");
    let database_file = certs.dir.join("database-url");
    std::fs::write(&redis_file, format!("{}\n", redis.url())).unwrap();
    std::fs::write(&database_file, format!("{database}\n")).unwrap();
    let mut env = tls_env.to_vec();
    env.push(("REDIS_URL_FILE", path(&redis_file)));
    env.push(("DATABASE_URL_FILE", path(&database_file)));
    let (code, stdout, stderr) = idem(&["--json", "inspect", "absent", "--raw"], &env);
    assert_eq!(code, 4, "found nowhere: {stdout}{stderr}");
    let (code, stdout, stderr) = idem(&["--json", "cleanup"], &env);
    assert_eq!(code, 0, "{stdout}{stderr}");

    // Without the CA, the server's certificate is refused: exit 1, saying so.
    let (code, stdout, stderr) = idem(&["pending", "--redis", &redis.url()], &[]);
    assert_eq!(code, 1, "{stdout}{stderr}");
    let said = format!("{stdout}{stderr}").to_lowercase();
    assert!(said.contains("certificate"), "{said}");
}

/// A command line and the environment it runs with.
type Run<'a> = (Vec<&'a str>, &'a [(&'a str, &'a str)]);

#[test]
fn no_password_is_printed_when_a_connection_fails() {
    let certs = Certs::generate();
    let redis = TlsRedisServer::start(&certs, false);
    let pg = tls_postgres(&certs);
    let secret = "hunter2-secret";
    let unreachable = format!(
        "redis://:{secret}@127.0.0.1:{}/0",
        idem_testkit::free_port()
    );
    let wrong_ca_redis = format!("rediss://:{secret}@127.0.0.1:{}/0", redis.port);
    let malformed = format!("redis://:{secret}@127.0.0.1:notaport/0");
    let wrong_ca_pg = format!(
        "postgres://postgres:{secret}@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={}",
        pg.port,
        path(&certs.other_ca)
    );
    let other_ca = [("REDIS_CA_CERT", path(&certs.other_ca))];
    let runs: Vec<Run> = vec![
        (vec!["pending", "--redis", &unreachable], &[]),
        (vec!["pending", "--redis", &wrong_ca_redis], &other_ca),
        (vec!["pending", "--redis", &malformed], &[]),
        (vec!["cleanup", "--database", &wrong_ca_pg], &[]),
        (
            vec!["inspect", "k", "--redis", &wrong_ca_redis, "--redis-only"],
            &other_ca,
        ),
    ];
    for (args, env) in runs {
        for json in [false, true] {
            let mut all = args.clone();
            if json {
                all.insert(0, "--json");
            }
            let (code, stdout, stderr) = idem(&all, env);
            assert_ne!(code, 0, "{all:?}: {stdout}{stderr}");
            assert!(
                !stdout.contains(secret) && !stderr.contains(secret),
                "{all:?} printed the password:\n{stdout}{stderr}"
            );
            assert!(
                stdout.contains("***") || stderr.contains("***"),
                "{all:?} does not name the server:\n{stdout}{stderr}"
            );
        }
    }
}
