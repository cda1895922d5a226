//! `idem functions load|status` and `idem pending` against real servers
//! without the module: the library loaded and its version reported, what
//! each node runs, the outboxes counted, and no password printed.

use std::process::Command;

use idem_core::functions::{self as lib, outbox_key};
use idem_core::wire::{BeginReply, Frame};
use idem_testkit::cluster::library::{library_path, start_plain, start_with_library};
use serde_json::Value;

/// `idem ARGS` with no URLs from the environment: (exit code, stdout).
fn idem(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .env_remove("REDIS_URL")
        .env_remove("DATABASE_URL")
        .output()
        .expect("run idem");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("s3cret"), "a password on stderr: {stderr}");
    (
        out.status.code().expect("an exit code"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn idem_json(args: &[&str]) -> (i32, Value) {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let (code, stdout) = idem(&all);
    let json = serde_json::from_str(&stdout)
        .unwrap_or_else(|_| panic!("idem {args:?}: stdout is not JSON: {stdout}"));
    (code, json)
}

#[test]
fn load_then_status_on_a_server_without_the_module() {
    let server = start_plain(&[]);
    let url = server.url();
    let file = library_path();
    let file = file.to_str().expect("a UTF-8 path");

    let (code, status) = idem_json(&["functions", "status", "--redis", &url]);
    assert_eq!(code, 0, "{status}");
    let node = &status["nodes"][0];
    assert_eq!(node["backend"], "none", "{status}");
    assert_eq!(node["module"], false);
    assert_eq!(node["library_version"], Value::Null);

    let (code, text) = idem(&["functions", "load", "--redis", &url, "--file", file]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains(&format!("loaded library idem version {}", lib::VERSION)),
        "{text}"
    );
    // Loading again replaces it.
    let (code, loaded) = idem_json(&["functions", "load", "--redis", &url, "--file", file]);
    assert_eq!(code, 0, "{loaded}");
    assert_eq!(loaded["nodes"][0]["version"], lib::VERSION);
    assert_eq!(loaded["nodes"][0]["library"], "idem");

    let (code, status) = idem_json(&["functions", "status", "--redis", &url]);
    assert_eq!(code, 0);
    let node = &status["nodes"][0];
    assert_eq!(node["backend"], "functions", "{status}");
    assert_eq!(node["library_version"], lib::VERSION);
    let (code, text) = idem(&["functions", "status", "--redis", &url]);
    assert_eq!(code, 0);
    let line = text.lines().nth(1).expect("a node line");
    assert!(
        line.contains("functions") && line.contains(&format!("version {}", lib::VERSION)),
        "{text}"
    );

    // A missing file is an error, and changes nothing.
    let (code, _) = idem(&[
        "functions",
        "load",
        "--redis",
        &url,
        "--file",
        "/nonexistent.lua",
    ]);
    assert_eq!(code, 1);
}

#[test]
fn a_password_in_the_url_is_never_printed() {
    let server = start_with_library();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("s3cret")
        .query(&mut server.conn())
        .expect("set a password");
    let url = format!("redis://:s3cret@127.0.0.1:{}/", server.port);
    let wrong = format!("redis://:s3cretX@127.0.0.1:{}/", server.port);
    let file = library_path();
    let file = file.to_str().expect("a UTF-8 path");
    for args in [
        vec!["functions", "status", "--redis", &url],
        vec!["--json", "functions", "status", "--redis", &url],
        vec!["functions", "load", "--redis", &url, "--file", file],
        vec!["pending", "--redis", &url],
        vec!["--json", "functions", "status", "--redis", &wrong],
        vec!["functions", "load", "--redis", &wrong, "--file", file],
    ] {
        let (_, stdout) = idem(&args);
        assert!(
            !stdout.contains("s3cret"),
            "idem {args:?} printed the password: {stdout}"
        );
        assert!(
            stdout.contains(&server.port.to_string()),
            "idem {args:?}: {stdout}"
        );
    }
}

#[test]
fn pending_counts_the_librarys_outboxes() {
    let server = start_with_library();
    let mut conn = server.conn();
    let url = server.url();

    let (code, empty) = idem_json(&["pending", "--redis", &url]);
    assert_eq!(code, 0, "{empty}");
    assert_eq!(empty["pending"], 0);
    assert_eq!(empty["nodes"][0]["backend"], "functions");

    for i in 0..5 {
        let key = format!("pending-{i}");
        let reply: redis::Value = redis::cmd("FCALL")
            .arg(lib::BEGIN)
            .arg(1)
            .arg(&key)
            .arg("fp")
            .arg(3600)
            .query(&mut conn)
            .expect("idem_begin");
        let Ok(BeginReply::New { token }) = BeginReply::parse(&Frame::from(&reply)) else {
            panic!("idem_begin {key}: {reply:?}");
        };
        let _: redis::Value = redis::cmd("FCALL")
            .arg(lib::COMPLETE)
            .arg(2)
            .arg(&key)
            .arg(outbox_key(key.as_bytes()))
            .arg(token)
            .arg(200)
            .arg("body")
            .query(&mut conn)
            .expect("idem_complete");
    }
    let (code, pending) = idem_json(&["pending", "--redis", &url]);
    assert_eq!(code, 0, "{pending}");
    assert_eq!(pending["pending"], 5, "{pending}");
    let node = &pending["nodes"][0];
    assert_eq!(node["pending"], 5);
    assert_eq!(node["role"], "master");
    assert_eq!(node["library_version"], lib::VERSION);
    assert!(node["oldest_pending_ms"].as_u64().is_some(), "{pending}");

    let (code, text) = idem(&["pending", "--redis", &url]);
    assert_eq!(code, 0);
    let total = text.lines().last().expect("a total line");
    assert!(
        total.starts_with("total") && total.contains(" 5 "),
        "{text}"
    );
}

#[test]
fn status_names_the_module_where_it_is_loaded() {
    let server = idem_testkit::RedisServer::start();
    let (code, status) = idem_json(&["functions", "status", "--redis", &server.url()]);
    assert_eq!(code, 0, "{status}");
    assert_eq!(status["nodes"][0]["backend"], "module", "{status}");
    assert_eq!(status["nodes"][0]["module"], true);
}
