//! Servers without the module, running the Functions library
//! (`functions/idem.lua`) as a managed Redis would: a standalone server
//! and a Redis Cluster, for the writer's and the CLI's tests of the
//! library. Killed (and their directories removed) on drop, like the
//! module's; `RedisServer::restart` on one of these would load the module.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::cluster::RedisCluster;
use crate::{
    free_port, lost_port, scratch_dir, server_binary, workspace_root, RedisConfig, RedisServer,
};

/// `functions/idem.lua` of the workspace.
pub fn library_path() -> PathBuf {
    workspace_root().join("functions").join("idem.lua")
}

/// The library's source.
pub fn library_source() -> String {
    let path = library_path();
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("read the Functions library {}: {e}", path.display()))
}

/// `FUNCTION LOAD REPLACE` of the library on `conn`.
pub fn load_library(conn: &mut redis::Connection) {
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(library_source())
        .query(conn)
        .expect("FUNCTION LOAD REPLACE functions/idem.lua");
}

/// A `redis-server` without the module (and without the library), with
/// extra `server_args` (`["--appendonly", "yes"]`).
pub fn start_plain(server_args: &[&str]) -> RedisServer {
    let config = RedisConfig {
        module_args: Vec::new(),
        server_args: server_args.iter().map(|a| a.to_string()).collect(),
    };
    let mut server = RedisServer {
        port: free_port(),
        dir: scratch_dir("redis-plain"),
        config,
        child: None,
    };
    for attempt in 1..=5 {
        let mut cmd = Command::new(server_binary());
        cmd.arg("--port")
            .arg(server.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&server.dir)
            .arg("--logfile")
            .arg(server.dir.join("redis.log"))
            .args(["--repl-diskless-sync-delay", "0"])
            .args(&server.config.server_args)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        server.child = Some(cmd.spawn().expect("spawn redis-server (is it installed?)"));
        match server.wait_ready() {
            Ok(()) => return server,
            Err(log) if attempt < 5 && lost_port(&log, server.port) => server.port = free_port(),
            Err(log) => panic!("redis-server exited; log:\n{log}"),
        }
    }
    unreachable!("the last attempt returns or panics")
}

/// A server without the module, the library loaded.
pub fn start_with_library() -> RedisServer {
    let server = start_plain(&[]);
    load_library(&mut server.conn());
    server
}

/// A Redis Cluster of servers without the module, `primaries` primaries
/// with `replicas` replicas each, the library loaded on every node;
/// returned once healthy.
pub fn start_library_cluster(
    primaries: usize,
    replicas: usize,
    node_timeout_ms: u64,
) -> RedisCluster {
    let mut cluster = RedisCluster {
        nodes: Vec::new(),
        node_timeout_ms,
    };
    for _ in 0..primaries * (1 + replicas) {
        let timeout = node_timeout_ms.to_string();
        let bus = free_port().to_string();
        cluster.nodes.push(start_plain(&[
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            &timeout,
            "--cluster-port",
            &bus,
        ]));
    }
    let addrs: Vec<String> = (0..cluster.nodes.len()).map(|i| cluster.addr(i)).collect();
    let out = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
        .output()
        .expect("run redis-cli --cluster create");
    assert!(
        out.status.success(),
        "redis-cli --cluster create failed:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    cluster.wait_healthy(Duration::from_secs(30));
    // Replicas get it from their primary.
    for i in cluster.primaries() {
        load_library(&mut cluster.conn(i));
    }
    cluster
}
