//! `serve`'s flags (each with its `SLUICE_*` variable), and what they become: one
//! [`server::Config`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::ValueEnum;

use super::reference_env::Setting;
use crate::engine::{Bounds, EngineSettings};
use crate::metrics::Metrics;
use crate::rlqs::{ENVOY_REPORT_INTERVAL_US, QuotaOptions};
use crate::rules::LoadOptions;
use crate::server::{self, RulesSource};
use crate::service::{HeaderSet, LimitHeaderNames};
use crate::store::redis::{RedisOptions, Topology, redact};
use crate::store::{BackendConfig, FailureMode, LeaseOptions, Mode, StoreConfig};
use crate::xds::{Backoff, XdsOptions, XdsTls};

/// Where the counters live (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Memory,
    Redis,
    RedisCluster,
}

// Debug for the tests only: the Redis URL may carry a password.
#[cfg_attr(test, derive(Debug))]
#[derive(clap::Args)]
pub struct ServeArgs {
    /// A YAML rules file or a directory of them (one domain per file).
    #[arg(long, env = "SLUICE_CONFIG", default_value = "config/")]
    config: PathBuf,
    /// Take the rules from this xDS management server instead of files (host:port, or an
    /// http:// or https:// URL): RateLimitConfig resources over ADS, state of the world.
    #[arg(long, env = "SLUICE_XDS_SERVER", conflicts_with = "config")]
    xds_server: Option<String>,
    /// xDS: the node id the server keys its snapshots by.
    #[arg(long, env = "SLUICE_XDS_NODE_ID", default_value = "sluice")]
    xds_node_id: String,
    /// xDS: the node's metadata, k=v[,k=v...].
    #[arg(long, env = "SLUICE_XDS_NODE_METADATA", default_value = "")]
    xds_node_metadata: String,
    /// xDS: extra headers on the stream, name=value[,name=value...].
    #[arg(long, env = "SLUICE_XDS_HEADERS", default_value = "")]
    xds_headers: String,
    /// xDS: TLS to the server, verified against this PEM CA.
    #[arg(long, env = "SLUICE_XDS_TLS_CA")]
    xds_tls_ca: Option<PathBuf>,
    /// xDS: a client certificate (PEM) for a server that requires mutual TLS.
    #[arg(long, env = "SLUICE_XDS_TLS_CERT", requires_all = ["xds_tls_key", "xds_tls_ca"])]
    xds_tls_cert: Option<PathBuf>,
    /// xDS: the private key of --xds-tls-cert.
    #[arg(long, env = "SLUICE_XDS_TLS_KEY", requires = "xds_tls_cert")]
    xds_tls_key: Option<PathBuf>,
    /// xDS: the name the server's certificate must carry (default: the server's host).
    #[arg(long, env = "SLUICE_XDS_TLS_SERVER_NAME", requires = "xds_tls_ca")]
    xds_tls_server_name: Option<String>,
    /// xDS: the first pause before reconnecting; it doubles per failure in a row.
    #[arg(long, env = "SLUICE_XDS_RETRY_INITIAL", default_value = "1s", value_parser = crate::clock::parse_duration)]
    xds_retry_initial: Duration,
    /// xDS: the longest pause before reconnecting.
    #[arg(long, env = "SLUICE_XDS_RETRY_MAX", default_value = "30s", value_parser = crate::clock::parse_duration)]
    xds_retry_max: Duration,
    /// xDS: serve before the first rules arrive (no limits until then). Without it, the
    /// listeners open once the first rules are applied.
    #[arg(long, env = "SLUICE_XDS_START_WITHOUT_RULES")]
    xds_start_without_rules: bool,
    #[arg(long, env = "SLUICE_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    grpc_addr: SocketAddr,
    #[arg(long, env = "SLUICE_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    #[arg(long, env = "SLUICE_BACKEND", value_enum, default_value_t = Backend::Memory)]
    backend: Backend,
    /// redis://[user:pass@]host:port[/db] (rediss:// for TLS); for redis-cluster, a comma list
    /// of seed nodes.
    #[arg(
        long,
        env = "SLUICE_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    redis_url: String,
    /// Connections to a standalone Redis, each with one call of the limiter out at a time that
    /// carries every request queued meanwhile (up to 64); a second call goes out beside the
    /// first only while 64 wait. A distant Redis needs more: a node decides at most 64 × this ÷
    /// the round trip per second (128 000/s at 1 ms with 2). On a cluster: calls out at once per
    /// slot is 1.
    #[arg(long, env = "SLUICE_REDIS_POOL_SIZE", default_value_t = 2)]
    redis_pool_size: usize,
    /// The most one Redis call may take before the failure policy answers (Envoy's default
    /// filter timeout is 20ms).
    #[arg(long, env = "SLUICE_REDIS_TIMEOUT", default_value = "10ms", value_parser = crate::clock::parse_duration)]
    redis_timeout: Duration,
    /// The most one connection attempt to Redis may take. Connections are made ahead, in the
    /// background, so requests do not wait for them.
    #[arg(long, env = "SLUICE_REDIS_CONNECT_TIMEOUT", default_value = "1s", value_parser = crate::clock::parse_duration)]
    redis_connect_timeout: Duration,
    /// Prefix of every Redis key (no braces).
    #[arg(long, env = "SLUICE_REDIS_KEY_PREFIX", default_value = "sluice:")]
    redis_key_prefix: String,
    /// During a rolling upgrade from a build before December 2026: read a fixed window's count
    /// also from the form it wrote (a string under the key without its `#`), so what its nodes
    /// counted in the current windows is kept. Costs Redis a read on every window's first hit;
    /// leave it off once the old nodes are gone and their windows have ended.
    #[arg(long, env = "SLUICE_REDIS_READ_STRING_WINDOWS")]
    redis_read_string_windows: bool,
    /// When Redis cannot answer: allow, deny, local (this node decides alone) or error (gRPC
    /// UNAVAILABLE, so Envoy's failure_mode_deny decides). A rule's `failure_mode` overrides it.
    #[arg(long, env = "SLUICE_FAILURE_MODE", default_value = "local")]
    failure_mode: FailureMode,
    /// How often this node announces itself in Redis (a heartbeat that expires after three), so
    /// that with `local` each node enforces its share of every limit over the fleet it last saw
    /// live when Redis is lost; 0s: each node enforces the whole limit.
    #[arg(long, env = "SLUICE_FLEET_HEARTBEAT", default_value = "1s", value_parser = crate::clock::parse_duration)]
    fleet_heartbeat: Duration,
    /// Counters Redis denied are denied on this node until they can fit again, without a Redis
    /// call; this many at most (0: off).
    #[arg(long, env = "SLUICE_OVER_LIMIT_CACHE", default_value_t = 100_000)]
    over_limit_cache: usize,
    /// The mode of rules that set none: strict (one Redis call per request) or hybrid (nodes
    /// decide from leases of the shared quota; fixed_window and sliding_window rules only).
    #[arg(long, env = "SLUICE_MODE", default_value = "strict")]
    mode: Mode,
    /// Hybrid: a lease is used at most this long before its leftover goes back to Redis.
    #[arg(long, env = "SLUICE_LEASE_TTL", default_value = "2s", value_parser = crate::clock::parse_duration)]
    lease_ttl: Duration,
    /// Hybrid: a lease covers about this much of the node's recent traffic for its counter.
    #[arg(long, env = "SLUICE_LEASE_TARGET", default_value = "100ms", value_parser = crate::clock::parse_duration)]
    lease_target: Duration,
    /// Headers sluice adds: a comma list of retry-after, draft03, ietf, ratelimit, or none.
    #[arg(
        long,
        env = "SLUICE_RESPONSE_HEADERS",
        default_value = "retry-after,draft03"
    )]
    response_headers: String,
    /// `ratelimit` headers: the names of the limit, remaining and reset headers (the reference
    /// service's LIMIT_LIMIT_HEADER, LIMIT_REMAINING_HEADER, LIMIT_RESET_HEADER).
    #[arg(
        long,
        env = "SLUICE_RATELIMIT_HEADER_NAMES",
        default_value = "RateLimit-Limit,RateLimit-Remaining,RateLimit-Reset"
    )]
    ratelimit_header_names: String,
    /// Watch --config and reload on change (SIGHUP reloads too, whatever this says).
    #[arg(long, env = "SLUICE_WATCH", default_value_t = true, action = clap::ArgAction::Set)]
    watch: bool,
    /// Global shadow mode: the overall answer is always OK; statuses tell the truth.
    #[arg(long, env = "SLUICE_SHADOW_MODE")]
    shadow_mode: bool,
    /// Global quota mode: every descriptor is in quota mode (the request is OVER_LIMIT only when
    /// all of them are over, or a rule without quota mode is).
    #[arg(long, env = "SLUICE_QUOTA_MODE")]
    quota_mode: bool,
    /// Answer with `dynamic_metadata`: the domain, the descriptors, and the merged `metadata:` of
    /// the rules that allowed (for quota-based routing and access logs).
    #[arg(long, env = "SLUICE_RESPONSE_DYNAMIC_METADATA")]
    response_dynamic_metadata: bool,
    /// Most counters the memory store holds; past it, requests that need a new counter get
    /// UNAVAILABLE (Envoy's failure_mode_deny decides) until expired ones are swept.
    #[arg(long, env = "SLUICE_MAX_KEYS", default_value_t = 10_000_000)]
    max_keys: usize,
    /// Hits at or above this share of a limit count as near the limit in the metrics.
    #[arg(long, env = "SLUICE_NEAR_LIMIT_RATIO", default_value_t = 0.8)]
    near_limit_ratio: f64,
    /// Most metric series labelled with descriptor values (detailed_metric, value_to_metric);
    /// beyond it they are counted under rule="_other_".
    #[arg(long, env = "SLUICE_METRICS_MAX_SERIES", default_value_t = 10_000)]
    metrics_max_series: usize,
    /// Show descriptor values whole in `GET /counters` (by default a value is its first four
    /// characters and a short hash: values can be API keys or addresses).
    #[arg(long, env = "SLUICE_SHOW_DESCRIPTOR_VALUES")]
    show_descriptor_values: bool,
    /// Serve `POST /json` on the HTTP port: a rate-limit call as JSON. It decides on the same
    /// counters as Envoy's calls, so anyone who reaches the port can spend any client's quota.
    #[arg(long, env = "SLUICE_JSON_ENDPOINT")]
    json_endpoint: bool,
    /// Threads that serve calls (0: one per CPU this process may run on). With one, sluice runs
    /// on a single-threaded runtime: on one core that is faster, because a finished call does
    /// not wake its connection's writer at once, so responses leave in batches.
    #[arg(long, env = "SLUICE_WORKER_THREADS", default_value_t = 0)]
    worker_threads: usize,
    /// On SIGTERM, how long sluice keeps answering calls with health NOT_SERVING before it
    /// closes its listeners, so Envoys and Kubernetes stop sending first (a second SIGTERM or
    /// SIGINT ends the wait).
    #[arg(long, env = "SLUICE_DRAIN_DELAY", default_value = "5s", value_parser = crate::clock::parse_duration)]
    drain_delay: Duration,
    /// On SIGTERM, after the drain, how long in-flight calls may take to finish before sluice
    /// exits anyway.
    #[arg(long, env = "SLUICE_SHUTDOWN_GRACE", default_value = "10s", value_parser = crate::clock::parse_duration)]
    shutdown_grace: Duration,
    /// RLQS: most buckets one Envoy's stream may hold (a report naming more ends the stream).
    #[arg(
        long,
        env = "SLUICE_RLQS_MAX_BUCKETS_PER_STREAM",
        default_value_t = 10_000
    )]
    rlqs_max_buckets_per_stream: usize,
    /// RLQS: most buckets all streams of this node may hold; past it a new bucket gets no
    /// assignment (its Envoy applies its no_assignment_behavior).
    #[arg(long, env = "SLUICE_RLQS_MAX_BUCKETS", default_value_t = 100_000)]
    rlqs_max_buckets: usize,
    /// RLQS: a bucket that sees no request for this long is abandoned (Envoy forgets it until
    /// its next request); 0s never abandons. Counted in Envoy's 5-second reports.
    #[arg(long, env = "SLUICE_RLQS_IDLE_ABANDON", default_value = "60s", value_parser = crate::clock::parse_duration)]
    rlqs_idle_abandon: Duration,
    /// Most descriptors in one request.
    #[arg(long, env = "SLUICE_MAX_DESCRIPTORS", default_value_t = 64)]
    max_descriptors: usize,
    /// Most entries in one descriptor.
    #[arg(long, env = "SLUICE_MAX_ENTRIES", default_value_t = 32)]
    max_entries: usize,
    /// Longest key or value of an entry, in bytes.
    #[arg(long, env = "SLUICE_MAX_ENTRY_BYTES", default_value_t = 1024)]
    max_entry_bytes: usize,
    /// Serve gRPC over TLS with this PEM certificate chain (with --grpc-tls-key). The files are
    /// read again every --grpc-tls-reload-every: a rotated certificate serves new connections.
    #[arg(long, env = "SLUICE_GRPC_TLS_CERT", requires = "grpc_tls_key")]
    grpc_tls_cert: Option<PathBuf>,
    /// The PEM private key of --grpc-tls-cert.
    #[arg(long, env = "SLUICE_GRPC_TLS_KEY", requires = "grpc_tls_cert")]
    grpc_tls_key: Option<PathBuf>,
    /// Mutual TLS: require a client certificate that chains to this PEM CA.
    #[arg(long, env = "SLUICE_GRPC_TLS_CLIENT_CA", requires = "grpc_tls_cert")]
    grpc_tls_client_ca: Option<PathBuf>,
    /// Mutual TLS: the client certificate must also name this DNS name or IP address.
    #[arg(
        long,
        env = "SLUICE_GRPC_TLS_CLIENT_SAN",
        requires = "grpc_tls_client_ca"
    )]
    grpc_tls_client_san: Option<String>,
    /// Also serve the Go reference service's metric names
    /// (`ratelimit_service_rate_limit_*{domain,key1,key2}`, which Envoy Gateway's dashboard reads)
    /// on a listener of their own at this address (the reference's PROMETHEUS_ADDR).
    #[arg(long, env = "SLUICE_REFERENCE_METRICS_ADDR")]
    reference_metrics_addr: Option<SocketAddr>,
    /// The path of --reference-metrics-addr (the reference's PROMETHEUS_PATH).
    #[arg(
        long,
        env = "SLUICE_REFERENCE_METRICS_PATH",
        default_value = "/metrics",
        requires = "reference_metrics_addr"
    )]
    reference_metrics_path: String,
    /// How often the TLS files are read again.
    #[arg(long, env = "SLUICE_GRPC_TLS_RELOAD_EVERY", default_value = "10s", value_parser = crate::clock::parse_duration)]
    grpc_tls_reload_every: Duration,
}

/// How long a file watch waits for a burst of edits to end before reloading.
const WATCH_DEBOUNCE: Duration = Duration::from_millis(200);

/// How often expired counters and denials are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

impl ServeArgs {
    /// Takes a setting of the reference's environment, unless `given(id)` says its argument
    /// (by its clap id, the field's name) was given on the command line or by its `SLUICE_*`
    /// variable: those win. A setting that is not `serve`'s own (a global one) is handed back.
    pub(super) fn take(
        &mut self,
        setting: Setting,
        given: impl Fn(&str) -> bool,
    ) -> Option<Setting> {
        macro_rules! fill {
            ($field:ident, $value:expr) => {{
                if !given(stringify!($field)) {
                    self.$field = $value;
                }
                None
            }};
        }
        match setting {
            Setting::GrpcAddr(a) => fill!(grpc_addr, a),
            Setting::HttpAddr(a) => fill!(http_addr, a),
            Setting::GrpcTlsCert(p) => fill!(grpc_tls_cert, Some(p)),
            Setting::GrpcTlsKey(p) => fill!(grpc_tls_key, Some(p)),
            Setting::GrpcTlsClientCa(p) => fill!(grpc_tls_client_ca, Some(p)),
            Setting::GrpcTlsClientSan(n) => fill!(grpc_tls_client_san, Some(n)),
            Setting::XdsServer(s) => fill!(xds_server, Some(s)),
            Setting::XdsNodeId(n) => fill!(xds_node_id, n),
            Setting::XdsNodeMetadata(m) => fill!(xds_node_metadata, m),
            Setting::XdsHeaders(h) => fill!(xds_headers, h),
            Setting::XdsRetryInitial(d) => fill!(xds_retry_initial, d),
            Setting::XdsTlsCa(p) => fill!(xds_tls_ca, Some(p)),
            Setting::XdsTlsCert(p) => fill!(xds_tls_cert, Some(p)),
            Setting::XdsTlsKey(p) => fill!(xds_tls_key, Some(p)),
            Setting::XdsTlsServerName(n) => fill!(xds_tls_server_name, Some(n)),
            Setting::XdsStartWithoutRules => fill!(xds_start_without_rules, true),
            Setting::Config(p) => fill!(config, p),
            Setting::Backend(b) => fill!(backend, b),
            Setting::RedisUrl(u) => fill!(redis_url, u),
            Setting::RedisConnectTimeout(d) => fill!(redis_connect_timeout, d),
            Setting::RedisKeyPrefix(p) => fill!(redis_key_prefix, p),
            Setting::ShadowMode => fill!(shadow_mode, true),
            Setting::QuotaMode => fill!(quota_mode, true),
            Setting::ResponseDynamicMetadata => fill!(response_dynamic_metadata, true),
            Setting::NearLimitRatio(r) => fill!(near_limit_ratio, r),
            Setting::ResponseHeaders(h) => fill!(response_headers, h),
            Setting::RatelimitHeaderNames(n) => fill!(ratelimit_header_names, n),
            Setting::ReferenceMetricsAddr(a) => fill!(reference_metrics_addr, Some(a)),
            Setting::ReferenceMetricsPath(p) => fill!(reference_metrics_path, p),
            Setting::MergeDomains | Setting::LogFormat(_) => Some(setting),
        }
    }

    /// Threads that serve calls (0: one per CPU this process may run on).
    pub fn worker_threads(&self) -> usize {
        self.worker_threads
    }

    /// The server's configuration, every flag checked.
    pub fn config(&self, load: LoadOptions) -> anyhow::Result<server::Config> {
        let mut headers = HeaderSet::parse(&self.response_headers)?;
        if let Some(names) = &mut headers.ratelimit {
            *names = LimitHeaderNames::parse(&self.ratelimit_header_names)?;
        }
        let rules = match self.xds_options()? {
            Some(options) => RulesSource::Xds {
                options,
                wait: !self.xds_start_without_rules,
            },
            None => RulesSource::Files {
                path: self.config.clone(),
                watch: self.watch.then_some(WATCH_DEBOUNCE),
            },
        };
        let grpc_tls = match (&self.grpc_tls_cert, &self.grpc_tls_key) {
            (Some(cert), Some(key)) => Some(Arc::new(crate::tls::ServerTls::load(
                crate::tls::TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: self.grpc_tls_client_ca.clone(),
                    client_san: self.grpc_tls_client_san.clone(),
                    reload_every: self.grpc_tls_reload_every,
                },
            )?)),
            _ => None,
        };
        let metrics = Metrics::new(self.near_limit_ratio, self.metrics_max_series);
        let metrics = Arc::new(match self.reference_metrics_addr {
            Some(_) => metrics.with_reference_names(),
            None => metrics,
        });
        if !self.reference_metrics_path.starts_with('/') {
            anyhow::bail!(
                "--reference-metrics-path '{}' must start with /",
                self.reference_metrics_path
            );
        }
        Ok(server::Config {
            grpc_addr: self.grpc_addr,
            http_addr: self.http_addr,
            grpc_tls,
            reference_metrics: self
                .reference_metrics_addr
                .map(|a| (a, self.reference_metrics_path.clone())),
            rules,
            load,
            store: self.store(),
            engine: EngineSettings {
                global_shadow: self.shadow_mode,
                global_quota: self.quota_mode,
                bounds: Bounds {
                    max_descriptors: self.max_descriptors,
                    max_entries: self.max_entries,
                    max_entry_bytes: self.max_entry_bytes,
                },
            },
            headers,
            json: self.json_endpoint,
            dynamic_metadata: self.response_dynamic_metadata,
            show_descriptor_values: self.show_descriptor_values,
            metrics: Some(metrics),
            sweep_every: SWEEP_EVERY,
            drain_delay: self.drain_delay,
            shutdown_grace: self.shutdown_grace,
            quota: QuotaOptions {
                max_buckets_per_stream: self.rlqs_max_buckets_per_stream,
                max_buckets: self.rlqs_max_buckets,
                idle_reports_to_abandon: u32::try_from(
                    self.rlqs_idle_abandon
                        .as_micros()
                        .div_ceil(u128::from(ENVOY_REPORT_INTERVAL_US)),
                )
                .unwrap_or(u32::MAX),
                ..QuotaOptions::default()
            },
        })
    }

    fn store(&self) -> StoreConfig {
        let topology = match self.backend {
            Backend::Memory => None,
            Backend::Redis => Some(Topology::Standalone(self.redis_url.clone())),
            Backend::RedisCluster => Some(Topology::Cluster(
                self.redis_url
                    .split(',')
                    .map(|u| u.trim().to_owned())
                    .collect(),
            )),
        };
        let backend = match topology {
            None => BackendConfig::Memory,
            Some(topology) => BackendConfig::Redis(RedisOptions {
                topology,
                pool_size: self.redis_pool_size,
                timeout: self.redis_timeout,
                connect_timeout: self.redis_connect_timeout,
                key_prefix: self.redis_key_prefix.clone(),
                read_string_windows: self.redis_read_string_windows,
            }),
        };
        if let BackendConfig::Redis(_) = backend {
            tracing::info!(
                backend = ?self.backend.to_possible_value().map(|v| v.get_name().to_owned()),
                url = %redact(&self.redis_url),
                timeout = ?self.redis_timeout,
                failure_mode = %self.failure_mode,
                mode = %self.mode,
                "using Redis"
            );
        }
        StoreConfig {
            max_keys: self.max_keys,
            failure_mode: self.failure_mode,
            fleet_heartbeat: self.fleet_heartbeat,
            over_limit_cache: self.over_limit_cache,
            leases: LeaseOptions {
                default_mode: self.mode,
                ttl: self.lease_ttl,
                target: self.lease_target,
                ..LeaseOptions::default()
            },
            ..StoreConfig::new(backend)
        }
    }

    /// The xDS client's settings, when --xds-server asks for one.
    fn xds_options(&self) -> anyhow::Result<Option<XdsOptions>> {
        let Some(server) = self.xds_server.clone() else {
            return Ok(None);
        };
        let node_metadata = crate::xds::parse_pairs(&self.xds_node_metadata)
            .map_err(|e| anyhow::anyhow!("--xds-node-metadata: {e}"))?;
        let headers = crate::xds::parse_pairs(&self.xds_headers)
            .map_err(|e| anyhow::anyhow!("--xds-headers: {e}"))?
            .into_iter()
            .map(|(name, value)| {
                let key = name.to_ascii_lowercase().parse();
                match (key, value.parse()) {
                    (Ok(k), Ok(v)) => Ok((k, v)),
                    _ => Err(anyhow::anyhow!(
                        "--xds-headers: '{name}: {value}' is not a valid header"
                    )),
                }
            })
            .collect::<anyhow::Result<_>>()?;
        let tls = self.xds_tls_ca.clone().map(|ca| XdsTls {
            ca,
            identity: self.xds_tls_cert.clone().zip(self.xds_tls_key.clone()),
            server_name: self.xds_tls_server_name.clone(),
        });
        Ok(Some(XdsOptions {
            server,
            node_id: self.xds_node_id.clone(),
            node_metadata,
            headers,
            tls,
            retry: Backoff {
                initial: self.xds_retry_initial,
                max: self.xds_retry_max.max(self.xds_retry_initial),
            },
        }))
    }
}

/// The async runtime: `threads` workers (0: the CPUs this process may use, as `taskset` or a
/// container's cpuset leaves them), single-threaded when that is one.
pub fn runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let threads = match threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
    }
}
