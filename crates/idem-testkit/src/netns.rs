//! Private networks for one test: named network namespaces ("hosts") joined
//! by veth pairs to a Linux bridge, on a /24 of their own, so a test can
//! take a host off the network as a pulled cable or a dead machine would:
//! its peers hear nothing, not even the FIN a killed process still sends.
//!
//! The bridge sits in a namespace of its own (the "switch"), so the only
//! interface the test's namespace gets is its link to the switch, the
//! network's `.1`. Needs root and `ip` (iproute2): `Net::new` says why and
//! returns `None` without them, and the test skips. Everything is removed
//! on drop, also when the test panics; what a killed test process left
//! behind is swept by the next `Net::new`.

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use crate::postgres_server::{running_as_root, Listen, PgServer};

/// Every namespace of the harness is named `idem-PID-N[-HOST]`.
const NETNS_PREFIX: &str = "idem-";

/// Where each network's /24 is reserved: a file named after the subnet,
/// holding its owner's pid (`/run` is a tmpfs: reboots forget them).
const RESERVATIONS: &str = "/run/idem-netns";

/// The subnets handed out: 10.100.0.0/24 to 10.199.255.0/24.
const SECOND_OCTETS: std::ops::RangeInclusive<u8> = 100..=199;

/// One test's network: a switch namespace with the bridge, the test's link
/// to it, and the hosts made by `host`. Torn down on drop.
pub struct Net {
    /// `idem-PID-N`: the switch namespace, and the prefix of the hosts'.
    id: String,
    /// The test namespace's end of its link to the switch.
    uplink: String,
    /// The first three octets of the network's /24.
    subnet: [u8; 3],
    reservation: Option<PathBuf>,
    hosts: Vec<Host>,
    /// Blackhole routes `block_gateway` added in the test's namespace.
    gateway_blocks: Mutex<Vec<Ipv4Addr>>,
}

/// A namespace on a `Net`, with one interface (`eth0`) on the bridge.
#[derive(Debug, Clone)]
pub struct Host {
    name: String,
    netns: String,
    /// Its bridge port in the switch namespace.
    port: String,
    ip: Ipv4Addr,
}

impl Host {
    /// The name `Net::host` was given.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its address on the network.
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The network namespace's name (for `ip netns exec` and `ip -n`).
    pub fn netns(&self) -> &str {
        &self.netns
    }

    /// `program` to run inside the namespace (`ip netns exec`, which
    /// executes it in place: the child's pid is the program's).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.netns]).arg(program);
        command
    }
}

impl Host {
    /// Relays TCP connections made to the returned `Forward`'s address (on
    /// the test's own loopback) to `target` as seen from inside this host,
    /// e.g. a server that listens on the host's own 127.0.0.1. The
    /// connections into the host are made there (a thread of ours joins
    /// the namespace), so the host's partitions never touch the relay.
    pub fn forward(&self, target: SocketAddr) -> Forward {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a forwarder");
        let addr = listener.local_addr().expect("the forwarder's address");
        let stop = Arc::new(AtomicBool::new(false));
        let (accepted, connect) = mpsc::channel::<TcpStream>();
        let netns = Path::new("/run/netns").join(&self.netns);
        let inside = std::thread::spawn(move || -> Result<(), String> {
            let file = std::fs::File::open(&netns)
                .map_err(|e| format!("open {}: {e}", netns.display()))?;
            // SAFETY: setns on a valid, open namespace file descriptor; it
            // changes this thread's network namespace only.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(format!("setns: {}", std::io::Error::last_os_error()));
            }
            for client in connect {
                if let Ok(server) = TcpStream::connect(target) {
                    relay(client, server);
                }
            }
            Ok(())
        });
        let stopping = stop.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if stopping.load(Ordering::Relaxed) || accepted.send(client).is_err() {
                    break;
                }
            }
        });
        Forward {
            addr,
            stop,
            inside: Some(inside),
        }
    }
}

/// A relay made by `Host::forward`; stops taking connections on drop.
pub struct Forward {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    inside: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl Forward {
    /// Where to connect: 127.0.0.1 and a port of the test's namespace.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr); // wakes the accepting thread
        if let Some(Ok(Err(e))) = self.inside.take().map(|t| t.join()) {
            eprintln!("forwarder: {e}");
        }
    }
}

/// Copies both ways between `a` and `b` on threads of their own, passing
/// each end's close on to the other.
fn relay(a: TcpStream, b: TcpStream) {
    for (from, to) in [(&a, &b), (&b, &a)] {
        let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
            return;
        };
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut from, &mut to);
            let _ = to.shutdown(std::net::Shutdown::Write);
        });
    }
}

impl Net {
    /// A new network with no hosts yet; `None`, after saying why on stderr,
    /// where namespaces cannot be made (not root, no `ip`, no permission).
    pub fn new() -> Option<Net> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        if !running_as_root() {
            eprintln!("network namespaces unavailable: not running as root");
            return None;
        }
        if let Err(e) = ip("-V") {
            eprintln!("network namespaces unavailable: {e}");
            return None;
        }
        sweep_stale();
        let pid = std::process::id();
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut net = Net {
            id: format!("{NETNS_PREFIX}{pid}-{n}"),
            // Interface names have 15 bytes at most: at most 3 + 6 + 1 + 5.
            uplink: format!("idm{pid:x}.{n:x}"),
            subnet: [10, 0, 0],
            reservation: None,
            hosts: Vec::new(),
            gateway_blocks: Mutex::new(Vec::new()),
        };
        match net.reserve_subnet(pid, n).and_then(|()| net.make_switch()) {
            Ok(()) => Some(net),
            Err(e) => {
                eprintln!("network namespaces unavailable: {e}");
                None // dropping `net` removes what was made
            }
        }
    }

    /// Adds a host named `name` (letters, digits and `-`), its loopback and
    /// `eth0` up, with the network's next address.
    pub fn host(&mut self, name: &str) -> Host {
        assert!(
            !name.is_empty()
                && name.len() <= 32
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
            "host name {name:?}: use 1 to 32 letters, digits and '-'"
        );
        assert!(
            self.hosts.iter().all(|h| h.name != name),
            "host {name} already exists"
        );
        let index = self.hosts.len();
        assert!(index < 250, "a /24 has room for 250 hosts");
        let host = Host {
            name: name.to_string(),
            netns: format!("{}-{name}", self.id),
            port: format!("h{index}"),
            ip: self.address(index as u8 + 2),
        };
        let (ns, switch, port, addr) = (&host.netns, &self.id, &host.port, host.ip);
        ip_checked(&format!("netns add {ns}"));
        self.hosts.push(host.clone()); // from here on, drop removes it
        ip_checked(&format!("-n {ns} link set lo up"));
        ip_checked(&format!(
            "-n {switch} link add {port} type veth peer name eth0 netns {ns}"
        ));
        ip_checked(&format!("-n {switch} link set {port} master br0 up"));
        ip_checked(&format!("-n {ns} addr add {addr}/24 dev eth0"));
        ip_checked(&format!("-n {ns} link set eth0 up"));
        host
    }

    /// The test namespace's address on the network (the `.1`).
    pub fn gateway(&self) -> Ipv4Addr {
        self.address(1)
    }

    /// The network, `10.X.Y.0/24`.
    pub fn subnet(&self) -> String {
        format!("{}/24", self.address(0))
    }

    /// Takes `host` off the network, both ways: its `eth0` and its bridge
    /// port down. Nothing it sends leaves, nothing sent to it arrives.
    pub fn cut(&self, host: &Host) {
        self.set_link(host, "down");
    }

    /// Puts `host` back on the network after `cut`.
    pub fn heal(&self, host: &Host) {
        self.set_link(host, "up");
    }

    /// One way: what `from` sends to `to` is dropped (a blackhole route in
    /// `from`'s namespace); what `to` sends still arrives.
    pub fn block(&self, from: &Host, to: Ipv4Addr) {
        ip_checked(&format!("-n {} route add blackhole {to}/32", from.netns));
    }

    /// Undoes `block`.
    pub fn unblock(&self, from: &Host, to: Ipv4Addr) {
        ip_checked(&format!("-n {} route del blackhole {to}/32", from.netns));
    }

    /// One way, from the test's own namespace (the gateway, where processes
    /// the test starts without a host run): what it sends to `to` is
    /// dropped. New connections from here to `to` fail at once (the route
    /// refuses them); established ones hear nothing until `unblock_gateway`.
    pub fn block_gateway(&self, to: Ipv4Addr) {
        assert!(self.is_ours(to), "{to} is not on {}", self.subnet());
        ip_checked(&format!("route add blackhole {to}/32"));
        self.blocks().push(to);
    }

    /// Undoes `block_gateway`.
    pub fn unblock_gateway(&self, to: Ipv4Addr) {
        ip_checked(&format!("route del blackhole {to}/32"));
        self.blocks().retain(|ip| *ip != to);
    }

    /// Whether `addr` lies in this network's /24.
    pub fn is_ours(&self, addr: Ipv4Addr) -> bool {
        addr.octets()[..3] == self.subnet
    }

    /// A throwaway PostgreSQL cluster running inside `host`, listening on
    /// its address, trust auth for the whole network. Drop it before the
    /// `Net` (declare it after), else the net's teardown kills it first.
    pub fn postgres(&self, host: &Host) -> PgServer {
        PgServer::start_with(Listen {
            netns: Some(host.netns.clone()),
            addr: host.ip.into(),
            trusted: Some(self.subnet()),
        })
    }

    fn blocks(&self) -> std::sync::MutexGuard<'_, Vec<Ipv4Addr>> {
        self.gateway_blocks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn address(&self, last: u8) -> Ipv4Addr {
        let [a, b, c] = self.subnet;
        Ipv4Addr::new(a, b, c, last)
    }

    fn set_link(&self, host: &Host, state: &str) {
        ip_checked(&format!("-n {} link set {} {state}", self.id, host.port));
        ip_checked(&format!("-n {} link set eth0 {state}", host.netns));
    }

    /// Reserves a /24 no other `Net` holds and no interface here uses,
    /// searching from one the pid and counter pick.
    fn reserve_subnet(&mut self, pid: u32, n: u32) -> Result<(), String> {
        std::fs::create_dir_all(RESERVATIONS).map_err(|e| format!("create {RESERVATIONS}: {e}"))?;
        let in_use = ip("-4 -o addr show")? + &ip("-4 route show")?;
        let count = SECOND_OCTETS.len() * 256;
        let start = (pid as usize).wrapping_mul(61).wrapping_add(n as usize);
        for step in 0..count {
            let i = (start + step) % count;
            let subnet = [10, SECOND_OCTETS.start() + (i / 256) as u8, (i % 256) as u8];
            let prefix = format!("{}.{}.{}.", subnet[0], subnet[1], subnet[2]);
            if in_use.contains(&prefix) {
                continue;
            }
            let path = Path::new(RESERVATIONS).join(&prefix[..prefix.len() - 1]);
            let created = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path);
            if let Ok(mut file) = created {
                self.reservation = Some(path.clone());
                self.subnet = subnet;
                return write!(file, "{pid}").map_err(|e| format!("write {}: {e}", path.display()));
            }
        }
        Err(format!("no free /24 in 10.{SECOND_OCTETS:?}.0.0"))
    }

    /// The switch namespace with bridge `br0`, and the test namespace's link
    /// to it with the network's `.1`.
    fn make_switch(&self) -> Result<(), String> {
        let (switch, uplink, gateway) = (&self.id, &self.uplink, self.gateway());
        ip(&format!("netns add {switch}"))?;
        ip(&format!("-n {switch} link add br0 type bridge"))?;
        ip(&format!("-n {switch} link set br0 up"))?;
        ip(&format!(
            "link add {uplink} type veth peer name up0 netns {switch}"
        ))?;
        ip(&format!("-n {switch} link set up0 master br0 up"))?;
        ip(&format!("addr add {gateway}/24 dev {uplink}"))?;
        ip(&format!("link set {uplink} up"))?;
        Ok(())
    }
}

impl Drop for Net {
    /// Kills what still runs in the namespaces, deletes them (their
    /// interfaces go with them) and the uplink, and frees the subnet.
    fn drop(&mut self) {
        for to in self.blocks().drain(..) {
            let _ = ip(&format!("route del blackhole {to}/32"));
        }
        let _ = ip(&format!("link del {}", self.uplink));
        for netns in self.hosts.iter().map(|h| h.netns.as_str()) {
            remove_netns(netns);
        }
        remove_netns(&self.id);
        if let Some(path) = &self.reservation {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Kills every process in `netns` and deletes it (quietly: it may not exist).
fn remove_netns(netns: &str) {
    if let Ok(pids) = ip(&format!("netns pids {netns}")) {
        for pid in pids.split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).output();
        }
    }
    let _ = ip(&format!("netns del {netns}"));
}

/// Removes the namespaces, subnet reservations, gateway routes and
/// `partition` scratch directories of harness processes that are gone
/// (killed before their `Net`s dropped).
fn sweep_stale() {
    let gone = |pid: &str| pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists();
    for line in ip("netns list").unwrap_or_default().lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let pid = name
            .strip_prefix(NETNS_PREFIX)
            .and_then(|rest| rest.split('-').next());
        if pid.is_some_and(gone) {
            remove_netns(name);
        }
    }
    for entry in std::fs::read_dir(RESERVATIONS)
        .into_iter()
        .flatten()
        .flatten()
    {
        let owner = std::fs::read_to_string(entry.path()).unwrap_or_default();
        if gone(owner.trim()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    // The scratch directories of the servers `partition` starts in hosts.
    for entry in std::fs::read_dir(std::env::temp_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let mut parts = name.rsplitn(3, '-');
        let (_, pid, tag) = (parts.next(), parts.next(), parts.next());
        let ours = matches!(
            tag,
            Some("idem-nsredis" | "idem-nssentinel" | "idem-pgstandby")
        );
        if ours && pid.is_some_and(gone) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    // `block_gateway`'s routes in our namespace into a subnet nobody holds.
    let routes = ip("-4 route show type blackhole").unwrap_or_default();
    for to in routes.lines().filter_map(|l| l.split_whitespace().nth(1)) {
        let Ok(addr) = to.trim_end_matches("/32").parse::<Ipv4Addr>() else {
            continue;
        };
        let [a, b, c, _] = addr.octets();
        let reserved = Path::new(RESERVATIONS).join(format!("{a}.{b}.{c}"));
        if a == 10 && SECOND_OCTETS.contains(&b) && !reserved.exists() {
            let _ = ip(&format!("route del blackhole {addr}/32"));
        }
    }
}

/// Runs `ip ARGS` (split at whitespace: no name here has any): its stdout,
/// or why it failed.
fn ip(args: &str) -> Result<String, String> {
    let out: Output = Command::new("ip")
        .args(args.split_whitespace())
        .output()
        .map_err(|e| format!("run ip (iproute2): {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "ip {args}: {} ({})",
            String::from_utf8_lossy(&out.stderr).trim(),
            out.status
        ))
    }
}

/// `ip ARGS`, which must succeed.
fn ip_checked(args: &str) {
    if let Err(e) = ip(args) {
        panic!("{e}");
    }
}

#[cfg(test)]
mod tests {
    use std::net::{SocketAddr, TcpStream};
    use std::time::Duration;

    use super::*;

    fn reachable(addr: SocketAddr) -> bool {
        TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
    }

    #[test]
    fn a_host_is_reachable_until_it_is_cut_and_again_once_healed() {
        let Some(mut net) = Net::new() else { return };
        let db = net.host("db");
        let client = net.host("client");
        let postgres = net.postgres(&db);
        let addr = SocketAddr::new(db.ip().into(), postgres.port);
        assert!(reachable(addr), "{}", postgres.log());
        assert_eq!(postgres.psql("SELECT 1").trim(), "1");

        let ifaces = db.command("ip").args(["-o", "addr"]).output().expect("ip");
        let ifaces = String::from_utf8_lossy(&ifaces.stdout);
        assert!(
            ifaces.contains(&format!("eth0    inet {}/24", db.ip())),
            "{ifaces}"
        );
        assert!(ifaces.contains("lo    inet 127.0.0.1/8"), "{ifaces}");
        let from_client = client
            .command("bash")
            .args([
                "-c",
                &format!("exec 3<>/dev/tcp/{}/{}", db.ip(), postgres.port),
            ])
            .status()
            .expect("bash");
        assert!(from_client.success(), "host to host");

        net.cut(&db);
        assert!(!reachable(addr), "cut");
        net.heal(&db);
        assert!(reachable(addr), "healed");

        // One way: the SYN arrives, the SYN-ACK does not.
        net.block(&db, net.gateway());
        assert!(!reachable(addr), "blocked");
        net.unblock(&db, net.gateway());
        assert!(reachable(addr), "unblocked");

        // One way from the test's namespace: the SYN never leaves.
        net.block_gateway(db.ip());
        assert!(!reachable(addr), "blocked from the gateway");
        net.unblock_gateway(db.ip());
        assert!(reachable(addr), "unblocked from the gateway");
    }

    #[test]
    fn a_forward_reaches_a_hosts_own_loopback_whatever_the_hosts_link() {
        let Some(mut net) = Net::new() else { return };
        let host = net.host("a");
        // An echo server on the host's own 127.0.0.1, out of reach otherwise.
        let program = "import socket\ns = socket.create_server(('127.0.0.1', 7001))\n\
                       while True:\n c = s.accept()[0]\n c.sendall(c.recv(100))\n c.close()";
        let mut server = host
            .command("python3")
            .args(["-c", program])
            .spawn()
            .expect("python3");
        let forward = host.forward("127.0.0.1:7001".parse().unwrap());
        let echo = |text: &str| -> Option<String> {
            let mut stream = TcpStream::connect(forward.addr()).ok()?;
            stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
            stream.write_all(text.as_bytes()).ok()?;
            let mut answer = String::new();
            std::io::Read::read_to_string(&mut stream, &mut answer).ok()?;
            Some(answer)
        };
        let up = crate::eventually(Duration::from_secs(5), || {
            echo("hello").as_deref() == Some("hello")
        });
        assert!(up, "no echo through the forwarder");
        net.cut(&host);
        assert_eq!(
            echo("cut").as_deref(),
            Some("cut"),
            "the relay is not the host's link"
        );
        net.heal(&host);
        let _ = server.kill();
        let _ = server.wait();
    }

    #[test]
    fn a_panicking_test_leaves_nothing_behind() {
        let Some(mut net) = Net::new() else { return };
        let host = net.host("a");
        let mut sleeper = host.command("sleep").arg("600").spawn().expect("sleep");
        let (names, uplink) = ([net.id.clone(), host.netns.clone()], net.uplink.clone());
        let reservation = net.reservation.clone().expect("a reserved subnet");
        net.block_gateway(host.ip());
        let blocked = host.ip().to_string();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _net = net;
            panic!("the test fails");
        }));
        assert!(panicked.is_err());
        let left = ip("netns list").expect("ip netns list");
        for name in names {
            assert!(!left.contains(&name), "{name} left: {left}");
        }
        assert!(ip(&format!("link show {uplink}")).is_err(), "{uplink} left");
        assert!(!reservation.exists(), "{} left", reservation.display());
        let routes = ip("-4 route show type blackhole").expect("ip route");
        let left = |l: &str| l.split_whitespace().nth(1) == Some(blocked.as_str());
        assert!(
            !routes.lines().any(left),
            "a route to {blocked} left: {routes}"
        );
        let status = sleeper.wait().expect("wait");
        assert!(!status.success(), "killed: {status}");
    }

    #[test]
    fn what_a_killed_test_left_behind_is_swept() {
        // No process has this pid: pids stay below the largest pid_max.
        let stale = format!("{NETNS_PREFIX}4194304-0-a");
        if !running_as_root() || ip(&format!("netns add {stale}")).is_err() {
            return;
        }
        let tmp = std::env::temp_dir();
        let stale_dir = tmp.join("idem-pgstandby-4194304-1");
        let live_dir = tmp.join(format!("idem-nsredis-{}-2", std::process::id()));
        for dir in [&stale_dir, &live_dir] {
            std::fs::create_dir_all(dir.join("data")).expect("a scratch dir");
        }
        let Some(_net) = Net::new() else { return };
        let left = ip("netns list").expect("ip netns list");
        assert!(!left.contains(&stale), "{stale} left: {left}");
        assert!(!stale_dir.exists(), "{} left", stale_dir.display());
        assert!(live_dir.exists(), "a live test's directory was swept");
        std::fs::remove_dir_all(&live_dir).expect("remove");
    }
}
