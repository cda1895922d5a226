//! The client's backends against real servers: the module where it is
//! loaded, else the Functions library (loaded by the client, and loaded
//! again when a call finds it gone), else its scripts form; a server with
//! none of them refused at construction; and the library's wait as a poll.

mod common;

use std::time::{Duration, Instant};

use common::BareRedis;
use idem_client::{
    Backend, BeginOptions, IdemClient, IdemError, Origin, Outcome, Pipe, StandaloneConnection,
    StoredResponse, Transport,
};

const TTL: Duration = Duration::from_secs(60);

fn options() -> BeginOptions {
    BeginOptions::new(TTL)
}

async fn client_on(server: &BareRedis, backend: Backend) -> IdemClient<StandaloneConnection> {
    IdemClient::standalone_using(server.client(), Transport::Auto, backend)
        .await
        .expect("client")
}

async fn new_token(client: &IdemClient<StandaloneConnection>, key: &str, fp: &[u8]) -> u64 {
    match client.begin(key, fp, options()).await.expect("BEGIN") {
        Outcome::New { token } => token,
        other => panic!("{key}: expected new, got {other:?}"),
    }
}

/// BEGIN, COMPLETE, replay, ABORT and TOUCH, with `flush` run between every
/// two calls: each call finds the library gone and must load it again.
async fn every_call_survives(client: &IdemClient<StandaloneConnection>, flush: impl Fn()) {
    let response = StoredResponse::new(201, "created").with_header("x-id", "7");
    flush();
    let token = new_token(client, "idem:{k1}", b"fp").await;
    flush();
    let left = client
        .touch("idem:{k1}", token, Duration::from_secs(5))
        .await
        .expect("TOUCH");
    assert!(left > Duration::from_secs(4), "{left:?}");
    flush();
    client
        .complete("idem:{k1}", token, &response, Origin::Handler)
        .await
        .expect("COMPLETE");
    flush();
    let again = client.begin("idem:{k1}", b"fp", options()).await;
    assert_eq!(again.expect("BEGIN"), Outcome::Replay(response));
    flush();
    let token = new_token(client, "idem:{k2}", b"fp").await;
    flush();
    assert!(client.abort("idem:{k2}", token).await.expect("ABORT"));
}

#[tokio::test]
async fn auto_loads_the_library_and_reloads_it_after_function_flush() {
    let server = BareRedis::start();
    let client = IdemClient::standalone(server.client())
        .await
        .expect("client");
    assert_eq!(client.backend(), Backend::Functions);
    let version: i64 = server.cmd(&["FCALL", "idem_version", "0"]).unwrap();
    assert_eq!(version, idem_core::functions::VERSION as i64);
    every_call_survives(&client, || {
        let _: () = server.cmd(&["FUNCTION", "FLUSH"]).unwrap();
    })
    .await;
    // The same over redis-rs' connection manager.
    let client = IdemClient::standalone_using(server.client(), Transport::Manager, Backend::Auto)
        .await
        .expect("client");
    assert_eq!(client.backend(), Backend::Functions);
    let _: () = server.cmd(&["FLUSHALL"]).unwrap();
    every_call_survives(&client, || {
        let _: () = server.cmd(&["FUNCTION", "FLUSH"]).unwrap();
    })
    .await;
}

#[tokio::test]
async fn an_older_library_is_replaced_at_construction() {
    let server = BareRedis::start();
    let old = "#!lua name=idem\nredis.register_function{function_name='idem_version', \
               callback=function() return 0 end, flags={'no-writes'}}";
    let _: String = server.cmd(&["FUNCTION", "LOAD", old]).unwrap();
    let client = client_on(&server, Backend::Functions).await;
    let version: i64 = server.cmd(&["FCALL", "idem_version", "0"]).unwrap();
    assert_eq!(version, idem_core::functions::VERSION as i64);
    new_token(&client, "idem:{old}", b"fp").await;
}

#[tokio::test]
async fn scripts_are_loaded_again_after_script_flush() {
    let server = BareRedis::start();
    let client = client_on(&server, Backend::Scripts).await;
    assert_eq!(client.backend(), Backend::Scripts);
    every_call_survives(&client, || {
        let _: () = server.cmd(&["SCRIPT", "FLUSH"]).unwrap();
    })
    .await;
}

#[tokio::test]
async fn complete_with_replica_ack_runs_on_the_library() {
    let primary = BareRedis::start();
    let replica = BareRedis::start_with(&["--replicaof", &format!("127.0.0.1 {}", primary.port)]);
    let synced = idem_testkit::eventually(Duration::from_secs(20), || {
        let info: String = replica.cmd(&["INFO", "replication"]).unwrap_or_default();
        info.contains("master_link_status:up")
    });
    assert!(synced, "the replica did not sync");
    let client = client_on(&primary, Backend::Functions).await;
    assert!(client.can_ack_replicas());
    let response = StoredResponse::new(200, "ok");
    for key in ["idem:{r1}", "idem:{r2}"] {
        let token = new_token(&client, key, b"fp").await;
        // The library gone before the pipelined COMPLETE + WAIT.
        let _: () = primary.cmd(&["FUNCTION", "FLUSH"]).unwrap();
        let acked = client
            .complete_replicated(
                key,
                token,
                &response,
                Origin::Handler,
                1,
                Duration::from_secs(5),
            )
            .await
            .expect("COMPLETE + WAIT");
        assert_eq!(acked, 1, "{key}");
        let again = client.begin(key, b"fp", options()).await.expect("BEGIN");
        assert_eq!(again, Outcome::Replay(response.clone()));
    }
}

#[tokio::test]
async fn the_librarys_wait_is_a_poll_until_the_answer_or_the_deadline() {
    let server = BareRedis::start();
    let client = client_on(&server, Backend::Functions).await;
    // No wait connections needed: the poll runs on the shared connection.
    let bare = IdemClient::new(Pipe::connect(&server.client()).await.unwrap())
        .resolve_backend(Backend::Functions)
        .await
        .unwrap();
    assert!(bare.can_wait());

    let token = new_token(&client, "idem:{w}", b"fp").await;
    let waiter = {
        let bare = bare.clone();
        tokio::spawn(async move {
            let options = options().wait(Duration::from_secs(10));
            let answer = bare.begin("idem:{w}", b"fp", options).await;
            (answer, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let response = StoredResponse::new(201, "done");
    client
        .complete("idem:{w}", token, &response, Origin::Handler)
        .await
        .unwrap();
    let completed = Instant::now();
    let (answer, answered) = waiter.await.unwrap();
    assert_eq!(answer.unwrap(), Outcome::Replay(response));
    let late = answered.saturating_duration_since(completed);
    assert!(late < Duration::from_millis(500), "answered {late:?} late");

    // A holder that never completes: in_flight once the wait runs out.
    new_token(&client, "idem:{held}", b"fp").await;
    let started = Instant::now();
    let options = options().wait(Duration::from_millis(400));
    let answer = bare.begin("idem:{held}", b"fp", options).await.unwrap();
    let took = started.elapsed();
    assert!(matches!(answer, Outcome::InFlight { .. }), "{answer:?}");
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(2),
        "{took:?}"
    );
}

#[tokio::test]
async fn a_server_without_idem_is_refused_with_what_to_do() {
    let server = BareRedis::start();
    let _: () = server
        .cmd(&[
            "ACL",
            "SETUSER",
            "app",
            "on",
            ">secret",
            "~*",
            "&*",
            "+@all",
            "-function",
            "-script",
            "-eval",
            "-evalsha",
            "-eval_ro",
            "-evalsha_ro",
            "-fcall",
            "-fcall_ro",
        ])
        .unwrap();
    let url = format!("redis://app:secret@127.0.0.1:{}/", server.port);
    let client = redis::Client::open(url).unwrap();
    for backend in [
        Backend::Auto,
        Backend::Module,
        Backend::Functions,
        Backend::Scripts,
    ] {
        let refused = IdemClient::standalone_using(client.clone(), Transport::Auto, backend).await;
        let Err(IdemError::NotInstalled(message)) = refused else {
            panic!("{backend}: {refused:?}");
        };
        let text = IdemError::NotInstalled(message).to_string();
        for hint in ["MODULE LOAD", "FUNCTION LOAD", "EVALSHA"] {
            assert!(text.contains(hint), "{backend}: {text}");
        }
        if backend == Backend::Auto {
            for tried in ["module:", "functions:", "scripts:"] {
                assert!(text.contains(tried), "{text}");
            }
        }
    }
}

#[tokio::test]
async fn the_module_is_preferred_where_it_is_loaded() {
    let server = idem_testkit::RedisServer::start();
    let client = IdemClient::standalone(server.client()).await.unwrap();
    assert_eq!(client.backend(), Backend::Module);
    // Asked for, the library runs beside the module too.
    let client = IdemClient::standalone_using(server.client(), Transport::Auto, Backend::Functions)
        .await
        .unwrap();
    assert_eq!(client.backend(), Backend::Functions);
    let token = match client.begin("lib:{m}", b"fp", options()).await.unwrap() {
        Outcome::New { token } => token,
        other => panic!("{other:?}"),
    };
    assert!(client.abort("lib:{m}", token).await.unwrap());
}

#[tokio::test]
async fn a_cluster_loads_the_library_on_every_primary_and_again_after_a_flush() {
    let cluster = idem_testkit::cluster::RedisCluster::start(3, 0, 5000);
    let flush_all = || {
        for i in 0..cluster.nodes.len() {
            let mut conn = cluster.conn(i);
            let _: () = redis::cmd("FUNCTION")
                .arg("FLUSH")
                .query(&mut conn)
                .unwrap();
        }
    };
    let client = redis::cluster::ClusterClient::new(cluster.urls()).unwrap();
    let client = IdemClient::cluster_using(client, Backend::Functions)
        .await
        .unwrap();
    assert_eq!(client.backend(), Backend::Functions);
    let response = StoredResponse::new(200, "ok");
    // Keys on every primary (their slots spread over the three).
    for i in 0..12 {
        let key = format!("lib:{{c{i}}}");
        flush_all();
        let token = match client.begin(&key, b"fp", options()).await.unwrap() {
            Outcome::New { token } => token,
            other => panic!("{key}: {other:?}"),
        };
        flush_all();
        client
            .complete(&key, token, &response, Origin::Handler)
            .await
            .unwrap();
        flush_all();
        let again = client.begin(&key, b"fp", options()).await.unwrap();
        assert_eq!(again, Outcome::Replay(response.clone()), "{key}");
    }
}

#[tokio::test]
async fn without_function_auto_falls_back_to_scripts() {
    // A Redis 7 whose FUNCTION is renamed away, as some managed services do.
    let server = BareRedis::start_with(&["--rename-command", "FUNCTION", ""]);
    let client = IdemClient::standalone(server.client())
        .await
        .expect("client");
    assert_eq!(client.backend(), Backend::Scripts);
    every_call_survives(&client, || {
        let _: () = server.cmd(&["SCRIPT", "FLUSH"]).unwrap();
    })
    .await;
    // And with EVAL denied too, nothing is left: refused, saying so.
    let _: () = server
        .cmd(&[
            "ACL",
            "SETUSER",
            "app",
            "on",
            ">secret",
            "~*",
            "&*",
            "+@all",
            "-script",
            "-eval",
            "-evalsha",
            "-eval_ro",
            "-evalsha_ro",
        ])
        .unwrap();
    let url = format!("redis://app:secret@127.0.0.1:{}/", server.port);
    let refused = IdemClient::standalone(redis::Client::open(url).unwrap()).await;
    let Err(error @ IdemError::NotInstalled(_)) = refused else {
        panic!("{refused:?}");
    };
    assert!(error.to_string().contains("SCRIPT LOAD"), "{error}");
}
