//! Real redis-server processes for tests, on free loopback ports, stopped on drop.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    pub port: u16,
    dir: PathBuf,
    /// A cluster node, with this `cluster-node-timeout` in milliseconds.
    cluster: Option<u32>,
    /// Serves TLS only (self-signed certificate made with openssl).
    tls: bool,
    /// More `redis-server` arguments.
    extra: Vec<String>,
    child: Option<Child>,
}

/// A port `p` with `p` and `p + 10000` (the cluster bus) both free.
fn free_port_pair() -> u16 {
    for _ in 0..1000 {
        let p = 20_000 + rand_u16() % 9_000;
        if std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()
            && std::net::TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok()
        {
            return p;
        }
    }
    panic!("no free port pair for redis");
}

fn rand_u16() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    h.finish() as u16
}

pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli runs (apt-get install redis-server)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A command's call count in `INFO commandstats` output.
pub fn commandstat(info: &str, command: &str) -> u64 {
    info.lines()
        .find(|l| l.starts_with(&format!("cmdstat_{command}:")))
        .and_then(|l| l.split("calls=").nth(1))
        .and_then(|s| s.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

impl RedisServer {
    pub fn start() -> Self {
        Self::spawn(None, false, &[])
    }

    /// A server without Redis Functions (`FUNCTION` and `FCALL` renamed away), as Redis 6 is.
    pub fn start_without_functions() -> Self {
        Self::spawn(
            None,
            false,
            &[
                "--rename-command",
                "FUNCTION",
                "",
                "--rename-command",
                "FCALL",
                "",
            ],
        )
    }

    /// A TLS-only server with a fresh self-signed certificate.
    pub fn start_tls() -> Self {
        Self::spawn(None, true, &[])
    }

    fn spawn(cluster: Option<u32>, tls: bool, extra: &[&str]) -> Self {
        let port = free_port_pair();
        let dir = super::temp_dir(&format!("redis-{port}"));
        if tls {
            let out = Command::new("openssl")
                .args([
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-days",
                    "1",
                    "-subj",
                    "/CN=127.0.0.1",
                ])
                .arg("-keyout")
                .arg(dir.join("key.pem"))
                .arg("-out")
                .arg(dir.join("cert.pem"))
                .output()
                .expect("openssl runs");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let mut server = Self {
            port,
            dir,
            cluster,
            tls,
            extra: extra.iter().map(|a| (*a).to_owned()).collect(),
            child: None,
        };
        server.restart();
        server
    }

    pub fn url(&self) -> String {
        if self.tls {
            // The certificate is self-signed: `#insecure` skips verifying it (tests only).
            format!("rediss://127.0.0.1:{}/#insecure", self.port)
        } else {
            format!("redis://127.0.0.1:{}", self.port)
        }
    }

    /// Starts (again) on the same port.
    pub fn restart(&mut self) {
        let mut cmd = Command::new("redis-server");
        if self.tls {
            cmd.args([
                "--port",
                "0",
                "--tls-port",
                &self.port.to_string(),
                "--tls-auth-clients",
                "no",
            ])
            .arg("--tls-cert-file")
            .arg(self.dir.join("cert.pem"))
            .arg("--tls-key-file")
            .arg(self.dir.join("key.pem"))
            .arg("--tls-ca-cert-file")
            .arg(self.dir.join("cert.pem"));
        } else {
            cmd.args(["--port", &self.port.to_string()]);
        }
        cmd.args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // DEBUG SLEEP makes Redis slow on purpose (the fault tests); local connections only.
        cmd.args(["--enable-debug-command", "local"]);
        cmd.args(&self.extra);
        if let Some(timeout_ms) = self.cluster {
            cmd.args(["--cluster-enabled", "yes"])
                .args(["--cluster-node-timeout", &timeout_ms.to_string()])
                .args(["--cluster-config-file", "nodes.conf"]);
        }
        self.child = Some(
            cmd.spawn()
                .expect("redis-server starts (apt-get install redis-server)"),
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.cli(&["PING"]).trim() != "PONG" {
            assert!(
                Instant::now() < deadline,
                "redis-server on {} did not start",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGSTOP: the process stays, its sockets stay open, and nothing answers (a paused VM, a
    /// long fork, a stuck disk).
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after `pause`.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        let status = Command::new("kill").args([signal, &pid]).status().unwrap();
        assert!(status.success(), "kill {signal} {pid}");
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn cli(&self, args: &[&str]) -> String {
        if !self.tls {
            return redis_cli(self.port, args);
        }
        let out = Command::new("redis-cli")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "--tls",
                "--insecure",
            ])
            .args(args)
            .output()
            .expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The hits counted in every fixed window whose key matches `pattern` (fixed_window.lua
    /// keeps a window's count in a hash, one field per window). Keys that are not hashes (the
    /// fleet heartbeat's sorted set) hold no counts.
    pub fn fixed_window_counts(&self, pattern: &str) -> u64 {
        self.cli(&["--scan", "--pattern", pattern])
            .lines()
            .filter(|key| self.cli(&["TYPE", key]).trim() == "hash")
            .map(|key| {
                self.cli(&["HVALS", key])
                    .lines()
                    .map(|c| {
                        c.trim().parse::<u64>().unwrap_or_else(|_| {
                            panic!("{key} holds {c:?}, not a fixed window's count")
                        })
                    })
                    .sum::<u64>()
            })
            .sum()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three masters, all 16384 slots assigned, `cluster_state:ok` on every node.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> Self {
        Self::start_with(0, 2000)
    }

    /// Three masters with `replicas` replicas each; a master unreachable for `node_timeout_ms`
    /// is failed over to one of its replicas.
    pub fn start_with(replicas: usize, node_timeout_ms: u32) -> Self {
        let nodes: Vec<RedisServer> = (0..3 * (1 + replicas))
            .map(|_| RedisServer::spawn(Some(node_timeout_ms), false, &[]))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self { nodes };
        cluster.wait_ok();
        // A replica can take over only once it has synced with its master.
        let deadline = Instant::now() + Duration::from_secs(20);
        for n in &cluster.nodes {
            loop {
                let info = n.cli(&["INFO", "replication"]);
                if info.contains("role:master") || info.contains("master_link_status:up") {
                    break;
                }
                assert!(Instant::now() < deadline, "a replica never synced");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        cluster
    }

    /// The ports of the nodes that replicate the master on `port`.
    pub fn replicas_of(&self, port: u16) -> Vec<u16> {
        let id = self.node_id(port);
        self.nodes
            .iter()
            .filter(|n| {
                n.cli(&["CLUSTER", "NODES"])
                    .lines()
                    .any(|l| l.contains("myself") && l.contains(&format!("slave {id}")))
            })
            .map(|n| n.port)
            .collect()
    }

    pub fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        for n in &self.nodes {
            while !n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok") {
                assert!(
                    Instant::now() < deadline,
                    "cluster did not reach cluster_state:ok"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The node id and port of the master that serves `slot`.
    pub fn owner_of(&self, slot: u16) -> (String, u16) {
        for n in &self.nodes {
            let nodes = n.cli(&["CLUSTER", "NODES"]);
            let Some(me) = nodes.lines().find(|l| l.contains("myself")) else {
                continue;
            };
            let fields: Vec<&str> = me.split_whitespace().collect();
            for range in &fields[8..] {
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                if let (Ok(a), Ok(b)) = (a.parse::<u16>(), b.parse::<u16>())
                    && (a..=b).contains(&slot)
                {
                    return (fields[0].to_owned(), n.port);
                }
            }
        }
        panic!("no owner for slot {slot}");
    }

    pub fn node_id(&self, port: u16) -> String {
        let n = self
            .nodes
            .iter()
            .find(|n| n.port == port)
            .expect("a node of the cluster");
        let nodes = n.cli(&["CLUSTER", "NODES"]);
        let me = nodes
            .lines()
            .find(|l| l.contains("myself"))
            .expect("myself");
        me.split_whitespace().next().unwrap().to_owned()
    }
}

/// The store `sluice serve` builds for Redis at `topology` (production defaults otherwise).
pub fn shared_config(
    topology: sluice::store::redis::Topology,
    timeout: Duration,
) -> sluice::store::StoreConfig {
    sluice::store::StoreConfig::new(sluice::store::BackendConfig::Redis(
        sluice::store::redis::RedisOptions {
            topology,
            pool_size: 2,
            timeout,
            connect_timeout: Duration::from_secs(2),
            key_prefix: "sluice:".into(),
            read_string_windows: false,
        },
    ))
}

/// A master, one replica and three sentinels watching them (quorum 2, the master declared down
/// after 400 ms), all real processes on free loopback ports.
pub struct RedisSentinels {
    pub master: RedisServer,
    pub replica: RedisServer,
    sentinels: Vec<SentinelProcess>,
}

struct SentinelProcess {
    port: u16,
    dir: PathBuf,
    child: Child,
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub const SENTINEL_MASTER: &str = "mymaster";

impl RedisSentinels {
    pub fn start() -> Self {
        let master = RedisServer::start();
        let replica = RedisServer::start();
        replica.cli(&["REPLICAOF", "127.0.0.1", &master.port.to_string()]);
        wait_until("the replica in sync", || {
            replica
                .cli(&["INFO", "replication"])
                .contains("master_link_status:up")
        });
        let sentinels: Vec<SentinelProcess> = (0..3)
            .map(|_| {
                let port = free_port_pair();
                let dir = super::temp_dir(&format!("sentinel-{port}"));
                // Sentinels rewrite their configuration: a file of their own, writable.
                let conf = dir.join("sentinel.conf");
                std::fs::write(
                    &conf,
                    format!(
                        "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {}\n\
                         sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {} 2\n\
                         sentinel down-after-milliseconds {SENTINEL_MASTER} 400\n\
                         sentinel failover-timeout {SENTINEL_MASTER} 2000\n",
                        dir.display(),
                        master.port
                    ),
                )
                .unwrap();
                let child = Command::new("redis-server")
                    .arg(&conf)
                    .arg("--sentinel")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("redis-server --sentinel starts");
                SentinelProcess { port, dir, child }
            })
            .collect();
        let set = Self {
            master,
            replica,
            sentinels,
        };
        // Each sentinel knows the replica and the two other sentinels: a failover can be
        // authorised and has somewhere to go.
        for s in &set.sentinels {
            wait_until("the sentinels to see each other and the replica", || {
                let replicas = redis_cli(s.port, &["SENTINEL", "REPLICAS", SENTINEL_MASTER]);
                let peers = redis_cli(s.port, &["SENTINEL", "SENTINELS", SENTINEL_MASTER]);
                replicas.contains(&set.replica.port.to_string())
                    && peers.matches("127.0.0.1").count() >= 2
            });
        }
        set
    }

    /// `redis+sentinel://` naming every sentinel and the master.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        format!("redis+sentinel://{}/{SENTINEL_MASTER}", hosts.join(","))
    }

    /// `SENTINEL FAILOVER`: the sentinels promote the replica and demote the (live) master.
    pub fn failover(&self) {
        let out = redis_cli(
            self.sentinels[0].port,
            &["SENTINEL", "FAILOVER", SENTINEL_MASTER],
        );
        assert!(out.contains("OK"), "SENTINEL FAILOVER: {out}");
    }

    /// The port every sentinel now names as the master's.
    pub fn master_port_agreed(&self) -> Option<u16> {
        let ports: Vec<Option<u16>> = self
            .sentinels
            .iter()
            .map(|s| {
                let out = redis_cli(
                    s.port,
                    &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER],
                );
                out.lines().nth(1).and_then(|p| p.trim().parse().ok())
            })
            .collect();
        let first = ports[0]?;
        ports.iter().all(|p| *p == Some(first)).then_some(first)
    }
}

fn wait_until(what: &str, ok: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ok() {
        assert!(Instant::now() < deadline, "waited too long for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
