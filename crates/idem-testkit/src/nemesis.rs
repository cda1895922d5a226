//! The nemesis of a partition test: it partitions hosts of a `netns::Net`
//! (both ways or one way, by blackhole routes), takes links down, and asks
//! the test to kill or promote a component; it heals what it did, on
//! demand and on drop. Faults come from a fixed schedule or at random from
//! a seed it prints (`NEMESIS_SEED` replays a run).

use std::fmt;
use std::net::Ipv4Addr;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::netns::{Host, Net};

/// The environment variable that fixes the seed of a random schedule.
pub const SEED_VAR: &str = "NEMESIS_SEED";

/// One end of a partition: a host, or the test's own namespace (where the
/// processes the test starts without a host run).
#[derive(Debug, Clone)]
pub enum Side {
    Gateway,
    Host(Host),
}

impl Side {
    fn name(&self) -> &str {
        match self {
            Side::Gateway => "gateway",
            Side::Host(host) => host.name(),
        }
    }
}

impl From<&Host> for Side {
    fn from(host: &Host) -> Side {
        Side::Host(host.clone())
    }
}

/// What the nemesis does.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Nothing passes between any member of `a` and any member of `b`.
    Partition { a: Vec<Side>, b: Vec<Side> },
    /// What `from` sends to `to` is dropped; the other way still works.
    OneWay { from: Vec<Side>, to: Vec<Side> },
    /// The host's link is down (`Net::cut`).
    Cut(Host),
    /// The test kills the named component (its hook does).
    Kill(String),
    /// The test promotes the named component (its hook does).
    Promote(String),
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = |sides: &[Side]| sides.iter().map(Side::name).collect::<Vec<_>>().join(",");
        match self {
            Fault::Partition { a, b } => write!(f, "partition {} | {}", names(a), names(b)),
            Fault::OneWay { from, to } => write!(f, "one-way {} -/-> {}", names(from), names(to)),
            Fault::Cut(host) => write!(f, "cut {}", host.name()),
            Fault::Kill(name) => write!(f, "kill {name}"),
            Fault::Promote(name) => write!(f, "promote {name}"),
        }
    }
}

/// A step of a schedule: at `at` (from the schedule's start), a fault, or
/// `None`: heal everything.
#[derive(Debug, Clone)]
pub struct Step {
    pub at: Duration,
    pub fault: Option<Fault>,
}

/// Applies faults to a `Net` and remembers them to heal.
pub struct Nemesis<'n> {
    net: &'n Net,
    seed: u64,
    rng: StdRng,
    /// (from, to) pairs blocked: `None` is the gateway.
    blocked: Vec<(Option<Host>, Ipv4Addr)>,
    cut: Vec<Host>,
}

impl<'n> Nemesis<'n> {
    /// A nemesis whose random choices follow `seed`.
    pub fn new(net: &'n Net, seed: u64) -> Nemesis<'n> {
        Nemesis {
            net,
            seed,
            rng: StdRng::seed_from_u64(seed),
            blocked: Vec::new(),
            cut: Vec::new(),
        }
    }

    /// Seeded from `$NEMESIS_SEED`, else at random; prints the seed, so a
    /// failing run can be replayed. A malformed seed is an error.
    pub fn from_env(net: &'n Net) -> Result<Nemesis<'n>, String> {
        let seed = match std::env::var(SEED_VAR) {
            Ok(text) => text
                .trim()
                .parse()
                .map_err(|e| format!("{SEED_VAR}={text:?} is not a u64: {e}"))?,
            Err(_) => rand::random(),
        };
        eprintln!("nemesis seed: {seed} (replay with {SEED_VAR}={seed})");
        Ok(Nemesis::new(net, seed))
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Applies `fault`: network faults here, `Kill`/`Promote` through `hook`.
    pub fn apply(&mut self, fault: &Fault, hook: &mut dyn FnMut(&Fault)) {
        match fault {
            Fault::Partition { a, b } => {
                for (x, y) in a.iter().flat_map(|x| b.iter().map(move |y| (x, y))) {
                    self.block(x, y);
                    self.block(y, x);
                }
            }
            Fault::OneWay { from, to } => {
                for (x, y) in from.iter().flat_map(|x| to.iter().map(move |y| (x, y))) {
                    self.block(x, y);
                }
            }
            Fault::Cut(host) => {
                if !self.cut.iter().any(|h| h.name() == host.name()) {
                    self.net.cut(host);
                    self.cut.push(host.clone());
                }
            }
            Fault::Kill(_) | Fault::Promote(_) => hook(fault),
        }
    }

    /// Undoes every partition and cut (kills and promotions stay).
    pub fn heal(&mut self) {
        for (from, to) in std::mem::take(&mut self.blocked) {
            match from {
                Some(host) => self.net.unblock(&host, to),
                None => self.net.unblock_gateway(to),
            }
        }
        for host in std::mem::take(&mut self.cut) {
            self.net.heal(&host);
        }
    }

    /// Whether anything is partitioned or cut now.
    pub fn is_healed(&self) -> bool {
        self.blocked.is_empty() && self.cut.is_empty()
    }

    /// A random schedule of `duration`: a fault among `sides` (a partition
    /// into two groups, a one-way partition, a cut) or one of `extra`
    /// (kills, promotions), held 0.5 to 3 s, then healed, then 0.5 to 2 s
    /// of calm; it ends healed.
    pub fn random_schedule(
        &mut self,
        duration: Duration,
        sides: &[Side],
        extra: &[Fault],
    ) -> Vec<Step> {
        assert!(sides.len() >= 2, "a partition needs two sides");
        let mut steps = Vec::new();
        let mut at = Duration::ZERO;
        while at < duration {
            let kinds = 3 + extra.len();
            let fault = match self.rng.random_range(0..kinds) {
                0 => {
                    let (a, b) = self.split(sides);
                    Fault::Partition { a, b }
                }
                1 => {
                    let (from, to) = self.split(sides);
                    Fault::OneWay { from, to }
                }
                2 => {
                    let hosts: Vec<&Host> = sides
                        .iter()
                        .filter_map(|s| match s {
                            Side::Host(h) => Some(h),
                            Side::Gateway => None,
                        })
                        .collect();
                    Fault::Cut(hosts[self.rng.random_range(0..hosts.len())].clone())
                }
                n => extra[n - 3].clone(),
            };
            steps.push(Step {
                at,
                fault: Some(fault),
            });
            at += Duration::from_millis(self.rng.random_range(500..3000));
            steps.push(Step { at, fault: None });
            at += Duration::from_millis(self.rng.random_range(500..2000));
        }
        steps
    }

    /// Runs `steps` from now, sleeping between them (blocking: call it from
    /// a thread of its own or `spawn_blocking`); prints each step.
    pub fn run(&mut self, steps: &[Step], hook: &mut dyn FnMut(&Fault)) {
        let start = std::time::Instant::now();
        for step in steps {
            if let Some(wait) = step.at.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
            match &step.fault {
                Some(fault) => {
                    eprintln!("nemesis {:>6.1}s: {fault}", step.at.as_secs_f64());
                    self.apply(fault, hook);
                }
                None => {
                    eprintln!("nemesis {:>6.1}s: heal", step.at.as_secs_f64());
                    self.heal();
                }
            }
        }
        self.heal();
    }

    /// Splits `sides` into two non-empty groups at random.
    fn split(&mut self, sides: &[Side]) -> (Vec<Side>, Vec<Side>) {
        loop {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for side in sides {
                if self.rng.random_bool(0.5) {
                    a.push(side.clone());
                } else {
                    b.push(side.clone());
                }
            }
            if !a.is_empty() && !b.is_empty() {
                return (a, b);
            }
        }
    }

    fn block(&mut self, from: &Side, to: &Side) {
        let to_ip = match to {
            Side::Gateway => self.net.gateway(),
            Side::Host(host) => host.ip(),
        };
        let from = match from {
            Side::Gateway => None,
            Side::Host(host) => Some(host.clone()),
        };
        let same = |(f, t): &(Option<Host>, Ipv4Addr)| {
            *t == to_ip && f.as_ref().map(Host::name) == from.as_ref().map(Host::name)
        };
        if self.blocked.iter().any(same) {
            return;
        }
        match &from {
            Some(host) => self.net.block(host, to_ip),
            None => self.net.block_gateway(to_ip),
        }
        self.blocked.push((from, to_ip));
    }
}

impl Drop for Nemesis<'_> {
    fn drop(&mut self) {
        self.heal();
    }
}

#[cfg(test)]
mod tests {
    use std::net::{SocketAddr, TcpListener, TcpStream};

    use super::*;

    /// Whether `from` (a host, or the gateway) connects to `to`'s listener.
    fn connects(from: Option<&Host>, to: Ipv4Addr, port: u16) -> bool {
        match from {
            None => TcpStream::connect_timeout(
                &SocketAddr::new(to.into(), port),
                Duration::from_millis(500),
            )
            .is_ok(),
            Some(host) => host
                .command("timeout")
                .args(["1", "bash", "-c", &format!("exec 3<>/dev/tcp/{to}/{port}")])
                .status()
                .expect("bash")
                .success(),
        }
    }

    /// A listener inside `host` on `port` that accepts and closes.
    fn listen(host: &Host, port: u16) -> std::process::Child {
        let program = format!(
            "import socket\ns = socket.create_server(('0.0.0.0', {port}))\n\
             while True: s.accept()[0].close()"
        );
        host.command("python3")
            .args(["-c", &program])
            .spawn()
            .expect("python3")
    }

    #[test]
    fn partitions_block_both_ways_one_way_blocks_one_and_heal_undoes_them() {
        let Some(mut net) = Net::new() else { return };
        let (a, b) = (net.host("a"), net.host("b"));
        let mut servers = [listen(&a, 7000), listen(&b, 7000)];
        let gateway = TcpListener::bind((net.gateway(), 0)).expect("bind the gateway");
        let gw_port = gateway.local_addr().unwrap().port();
        std::thread::spawn(move || for _ in gateway.incoming() {});
        assert!(crate::eventually(Duration::from_secs(5), || connects(
            None,
            a.ip(),
            7000
        )));
        assert!(crate::eventually(Duration::from_secs(5), || connects(
            None,
            b.ip(),
            7000
        )));

        let mut nemesis = Nemesis::new(&net, 1);
        let mut no_hook = |f: &Fault| panic!("no hook expected: {f}");
        nemesis.apply(
            &Fault::Partition {
                a: vec![(&a).into()],
                b: vec![(&b).into(), Side::Gateway],
            },
            &mut no_hook,
        );
        assert!(!connects(Some(&a), b.ip(), 7000), "a to b");
        assert!(!connects(Some(&b), a.ip(), 7000), "b to a");
        assert!(!connects(None, a.ip(), 7000), "gateway to a");
        assert!(!connects(Some(&a), net.gateway(), gw_port), "a to gateway");
        assert!(connects(Some(&b), net.gateway(), gw_port), "b to gateway");
        nemesis.heal();
        assert!(connects(Some(&a), b.ip(), 7000) && connects(None, a.ip(), 7000));

        // One way: a's packets to b are dropped (a blackhole route in a
        // only); everything else still passes.
        nemesis.apply(
            &Fault::OneWay {
                from: vec![(&a).into()],
                to: vec![(&b).into()],
            },
            &mut no_hook,
        );
        assert!(!connects(Some(&a), b.ip(), 7000), "a to b");
        assert!(connects(None, a.ip(), 7000), "gateway to a still");
        let routes = a.command("ip").args(["route"]).output().expect("ip route");
        let routes = String::from_utf8_lossy(&routes.stdout);
        assert!(
            routes.contains(&format!("blackhole {}", b.ip())),
            "{routes}"
        );
        let routes_b = b.command("ip").args(["route"]).output().expect("ip route");
        assert!(!String::from_utf8_lossy(&routes_b.stdout).contains("blackhole"));
        drop(nemesis); // heals
        assert!(connects(Some(&a), b.ip(), 7000));

        let mut kills = Vec::new();
        let mut nemesis = Nemesis::new(&net, 1);
        nemesis.apply(&Fault::Kill("redis".into()), &mut |f| {
            kills.push(f.to_string())
        });
        nemesis.apply(&Fault::Cut(a.clone()), &mut no_hook);
        assert!(!connects(None, a.ip(), 7000));
        nemesis.heal();
        assert!(nemesis.is_healed());
        assert!(crate::eventually(Duration::from_secs(5), || connects(
            None,
            a.ip(),
            7000
        )));
        assert_eq!(kills, ["kill redis"]);
        for server in &mut servers {
            let _ = server.kill();
            let _ = server.wait();
        }
    }

    #[test]
    fn a_seed_gives_the_same_schedule_and_every_schedule_ends_healed() {
        let Some(mut net) = Net::new() else { return };
        let sides: Vec<Side> = vec![
            (&net.host("a")).into(),
            (&net.host("b")).into(),
            Side::Gateway,
        ];
        let extra = [Fault::Kill("writer".into())];
        let render = |steps: Vec<Step>| {
            steps
                .iter()
                .map(|s| {
                    format!(
                        "{:?} {}",
                        s.at,
                        s.fault.as_ref().map_or("heal".into(), |f| f.to_string())
                    )
                })
                .collect::<Vec<_>>()
        };
        let first =
            render(Nemesis::new(&net, 42).random_schedule(Duration::from_secs(60), &sides, &extra));
        let again =
            render(Nemesis::new(&net, 42).random_schedule(Duration::from_secs(60), &sides, &extra));
        let other =
            render(Nemesis::new(&net, 43).random_schedule(Duration::from_secs(60), &sides, &extra));
        assert_eq!(first, again);
        assert_ne!(first, other);
        assert!(first.last().unwrap().ends_with("heal"));
        for kind in ["partition", "one-way", "cut", "kill writer"] {
            assert!(
                first.iter().any(|s| s.contains(kind)),
                "{kind} never drawn: {first:?}"
            );
        }
    }
}
