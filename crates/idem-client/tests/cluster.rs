//! `IdemClient::cluster` against a three-primary Redis Cluster (each node
//! with the module): keys spread over the nodes, every call reaches the
//! key's owner, and WAIT works on dedicated cluster connections.

mod common;

use std::time::Duration;

use common::LONG;
use idem_client::{BeginOptions, IdemClient, Origin, Outcome, StoredResponse};
use idem_testkit::{eventually, RedisConfig, RedisServer};

const SLOTS: [(u16, u16); 3] = [(0, 5460), (5461, 10922), (10923, 16383)];

fn start_cluster() -> Vec<RedisServer> {
    let nodes: Vec<RedisServer> = (0..3)
        .map(|_| {
            RedisConfig::default()
                .server_arg("cluster-enabled", "yes")
                .server_arg("cluster-node-timeout", "2000")
                .start()
        })
        .collect();
    for (node, (first, last)) in nodes.iter().zip(SLOTS) {
        let mut conn = node.conn();
        let _: () = redis::cmd("CLUSTER")
            .arg("ADDSLOTSRANGE")
            .arg(first)
            .arg(last)
            .query(&mut conn)
            .expect("ADDSLOTSRANGE");
    }
    let mut first = nodes[0].conn();
    for node in &nodes[1..] {
        let _: () = redis::cmd("CLUSTER")
            .arg("MEET")
            .arg("127.0.0.1")
            .arg(node.port)
            .query(&mut first)
            .expect("CLUSTER MEET");
    }
    let ready = eventually(Duration::from_secs(20), || {
        nodes.iter().all(|node| {
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query(&mut node.conn())
                .unwrap_or_default();
            info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:3")
        })
    });
    assert!(ready, "cluster did not form");
    nodes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_client_runs_every_outcome_on_the_owning_node() {
    let nodes = start_cluster();
    let urls: Vec<String> = nodes.iter().map(|n| n.url()).collect();
    let client = IdemClient::cluster(redis::cluster::ClusterClient::new(urls).unwrap())
        .await
        .unwrap();

    for i in 0..30 {
        let key = format!("idem:{{:key-{i}}}");
        let Outcome::New { token } = client
            .begin(&key, b"fp", BeginOptions::new(LONG))
            .await
            .unwrap()
        else {
            panic!("expected new for {key}");
        };
        let response = StoredResponse::new(201, format!("answer {i}"));
        client
            .complete(&key, token, &response, Origin::Handler)
            .await
            .unwrap();
        assert_eq!(
            client
                .begin(&key, b"fp", BeginOptions::new(LONG))
                .await
                .unwrap(),
            Outcome::Replay(response)
        );
        assert_eq!(
            client
                .begin(&key, b"other", BeginOptions::new(LONG))
                .await
                .unwrap(),
            Outcome::Mismatch
        );
    }
    let sizes: Vec<i64> = nodes
        .iter()
        .map(|n| redis::cmd("DBSIZE").query(&mut n.conn()).unwrap())
        .collect();
    assert_eq!(sizes.iter().sum::<i64>(), 30);
    assert!(
        sizes.iter().filter(|&&s| s > 0).count() >= 2,
        "keys spread: {sizes:?}"
    );

    // A duplicate waits on a dedicated cluster connection for the replay.
    let key = "idem:{:waited}";
    let Outcome::New { token } = client
        .begin(key, b"fp", BeginOptions::new(LONG))
        .await
        .unwrap()
    else {
        panic!("expected new");
    };
    let waiter = {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .begin(
                    key,
                    b"fp",
                    BeginOptions::new(LONG).wait(Duration::from_secs(10)),
                )
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let response = StoredResponse::new(200, "late");
    client
        .complete(key, token, &response, Origin::Handler)
        .await
        .unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), Outcome::Replay(response));
}
