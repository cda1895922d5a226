//! TLS fixtures: a throwaway CA with server and client certificates (made
//! with the `openssl` command), a `redis-server` with the module that
//! listens on a TLS port only, and a private Postgres cluster with
//! `ssl = on` that accepts TLS connections only. Everything is removed on
//! drop.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::postgres_server::{running_as_root, PgServer};
use crate::{free_port, module_path, scratch_dir, server_binary};

/// The names the server certificate is valid for.
pub const SERVER_NAMES: &str = "DNS:localhost,IP:127.0.0.1";

/// A CA, a server certificate it signed (for [`SERVER_NAMES`]), a client
/// certificate it signed (CN `postgres`), and an unrelated CA (for
/// "wrong CA" tests), as PEM files in a scratch directory.
pub struct Certs {
    pub dir: PathBuf,
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A CA that signed nothing here.
    pub other_ca: PathBuf,
}

impl Certs {
    /// Generates the files (EC P-256 keys, valid for two days).
    pub fn generate() -> Certs {
        let dir = scratch_dir("tls");
        let file = |name: &str| dir.join(name);
        let certs = Certs {
            ca: file("ca.crt"),
            server_cert: file("server.crt"),
            server_key: file("server.key"),
            client_cert: file("client.crt"),
            client_key: file("client.key"),
            other_ca: file("other-ca.crt"),
            dir: dir.clone(),
        };
        make_ca(&dir, "ca", "idem test CA");
        make_ca(&dir, "other-ca", "unrelated test CA");
        sign(
            &dir,
            "server",
            "localhost",
            &format!("subjectAltName={SERVER_NAMES}\nextendedKeyUsage=serverAuth\n"),
        );
        sign(&dir, "client", "postgres", "extendedKeyUsage=clientAuth\n");
        certs
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl (is it installed?)");
    assert!(
        out.status.success(),
        "openssl {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn make_ca(dir: &Path, name: &str, cn: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-subj",
            &format!("/CN={cn}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

/// `name.key` and `name.crt` signed by `ca`, with `extensions`.
fn sign(dir: &Path, name: &str, cn: &str, extensions: &str) {
    let ext_file = dir.join(format!("{name}.ext"));
    std::fs::write(
        &ext_file,
        format!("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n{extensions}"),
    )
    .expect("write the extensions file");
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={cn}"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
        ],
    );
}

/// A `redis-server` with the module listening on a TLS port only
/// (`--port 0`), its certificate from [`Certs`]; killed and its directory
/// removed on drop.
pub struct TlsRedisServer {
    pub port: u16,
    pub dir: PathBuf,
    child: Child,
}

impl TlsRedisServer {
    /// Starts one that requires a client certificate signed by the CA
    /// (`tls-auth-clients yes`) when `client_certs` is true, else accepts
    /// clients without one.
    pub fn start(certs: &Certs, client_certs: bool) -> TlsRedisServer {
        let dir = scratch_dir("redis-tls");
        let port = free_port();
        let path = |p: &Path| p.to_str().expect("UTF-8 path").to_string();
        let child = Command::new(server_binary())
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--tls-cert-file", &path(&certs.server_cert)])
            .args(["--tls-key-file", &path(&certs.server_key)])
            .args(["--tls-ca-cert-file", &path(&certs.ca)])
            .args([
                "--tls-auth-clients",
                if client_certs { "yes" } else { "no" },
            ])
            .arg("--dir")
            .arg(&dir)
            .arg("--logfile")
            .arg(dir.join("redis.log"))
            .arg("--loadmodule")
            .arg(module_path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        let mut server = TlsRedisServer { port, dir, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("redis-server exited ({status}):\n{}", server.log());
            }
            assert!(
                Instant::now() < deadline,
                "redis-server not ready:\n{}",
                server.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    /// `rediss://127.0.0.1:PORT/0`.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}/0", self.port)
    }

    /// A redis-rs client trusting the test CA and presenting the client
    /// certificate.
    pub fn client(&self, certs: &Certs) -> redis::Client {
        let read = |p: &Path| std::fs::read(p).expect("read a certificate");
        redis::Client::build_with_tls(
            self.url(),
            redis::TlsCertificates {
                client_tls: Some(redis::ClientTlsConfig {
                    client_cert: read(&certs.client_cert),
                    client_key: read(&certs.client_key),
                }),
                root_cert: Some(read(&certs.ca)),
            },
        )
        .expect("a TLS client")
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }
}

impl Drop for TlsRedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A private Postgres cluster with `ssl = on` (certificate and key from
/// [`Certs`], client certificates checked against its CA when presented)
/// whose `pg_hba.conf` accepts TCP clients over TLS only (trust auth).
pub fn tls_postgres(certs: &Certs) -> PgServer {
    let mut server = PgServer::start();
    let data = server.dir.join("data");
    for (from, to) in [
        (&certs.server_cert, "server.crt"),
        (&certs.server_key, "server.key"),
        (&certs.ca, "root.crt"),
    ] {
        std::fs::copy(from, data.join(to)).expect("copy a certificate into the cluster");
    }
    {
        use std::os::unix::fs::PermissionsExt;
        let key = data.join("server.key");
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))
            .expect("chmod the server key");
        if running_as_root() {
            let status = Command::new("chown")
                .args(["postgres:postgres"])
                .args(["server.crt", "server.key", "root.crt"].map(|f| data.join(f)))
                .status()
                .expect("run chown");
            assert!(status.success());
        }
    }
    let conf = data.join("postgresql.conf");
    let mut text = std::fs::read_to_string(&conf).expect("read postgresql.conf");
    text.push_str(
        "\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n\
         ssl_ca_file = 'root.crt'\n",
    );
    std::fs::write(&conf, text).expect("write postgresql.conf");
    let hba = data.join("pg_hba.conf");
    std::fs::write(
        &hba,
        "local all all trust\nhostssl all all 127.0.0.1/32 trust\nhostssl all all ::1/128 trust\n",
    )
    .expect("write pg_hba.conf");
    server.restart();
    server
}
