//! The `sluice` command: `serve` and `validate`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

use sluice::engine::{Bounds, Engine, EngineSettings};
use sluice::metrics::Metrics;
use sluice::rules::reload::Reloader;
use sluice::rules::{LoadOptions, RuleSet, load_path_with};
use sluice::server::{self, Options};
use sluice::service::{HeaderSet, LimitHeaderNames};
use sluice::store::redis::{RedisOptions, Topology, redact};
use sluice::store::{
    BackendConfig, BackendObserver, FailureMode, LeaseOptions, Mode, Store, StoreConfig, build,
};
use sluice::xds::{Backoff, XdsOptions, XdsRules, XdsTls};

// glibc's malloc makes the worker threads queue on its arena lock; mimalloc's per-thread heaps
// raised the load run's throughput by half (BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    args_override_self = true,
    about = "A rate limit service for Envoy (RLS v3)"
)]
struct Cli {
    /// Log format on stderr; the level comes from RUST_LOG (default info).
    #[arg(long, env = "SLUICE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    /// Rules files naming the same domain add their descriptors to it (the reference's
    /// MERGE_DOMAIN_CONFIG); without it a domain in two files is an error.
    #[arg(long, env = "SLUICE_MERGE_DOMAINS", global = true)]
    merge_domains: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve ShouldRateLimit on --grpc-addr and /healthcheck, /json on --http-addr.
    // A flag given twice takes its last value: the reference's settings come first (see
    // command_line), the command line's own after them.
    #[command(args_override_self = true)]
    Serve(Box<ServeArgs>),
    /// Check rules exactly as `serve` loads them.
    Validate {
        /// A YAML file or a directory of *.yaml / *.yml files.
        path: PathBuf,
    },
    /// Exit 0 if the local server is ready (GET /readyz), 1 otherwise: a container HEALTHCHECK.
    Probe {
        #[arg(long, env = "SLUICE_HTTP_ADDR", default_value = "127.0.0.1:8080")]
        http_addr: SocketAddr,
    },
    /// Print the JSON Schema of rules files (config/sluice-rules.schema.json is this output).
    Schema,
    /// Show what the rules do with a request: the matched rule path (or where matching stopped),
    /// the limits, their algorithms and the counters' storage keys.
    Explain {
        #[arg(long, env = "SLUICE_CONFIG", default_value = "config/")]
        config: PathBuf,
        #[arg(long)]
        domain: String,
        /// One descriptor's entries in order: k=v[,k=v...]. Repeat for several descriptors.
        #[arg(long = "descriptor", required = true)]
        descriptors: Vec<String>,
        #[arg(long, env = "SLUICE_REDIS_KEY_PREFIX", default_value = "sluice:")]
        redis_key_prefix: String,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Backend {
    Memory,
    Redis,
    RedisCluster,
}

/// A duration such as `10ms`, `2s` or `1500us`.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("'{s}' is not a duration like 10ms or 2s"))?;
    match unit {
        "us" => Ok(Duration::from_micros(n)),
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        _ => Err(format!("'{s}': the unit must be us, ms or s")),
    }
}

#[derive(clap::Args)]
struct ServeArgs {
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
    #[arg(long, env = "SLUICE_XDS_RETRY_INITIAL", default_value = "1s", value_parser = parse_duration)]
    xds_retry_initial: Duration,
    /// xDS: the longest pause before reconnecting.
    #[arg(long, env = "SLUICE_XDS_RETRY_MAX", default_value = "30s", value_parser = parse_duration)]
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
    /// Multiplexed connections to a standalone Redis. Few is faster: each carries any number of
    /// calls at once, and calls that share one leave in one write and come back in one read
    /// (16 connections cost ~3 µs more of sluice's CPU per call than 2, BENCHMARKS.md).
    #[arg(long, env = "SLUICE_REDIS_POOL_SIZE", default_value_t = 2)]
    redis_pool_size: usize,
    /// The most one Redis call may take before the failure policy answers (Envoy's default
    /// filter timeout is 20ms).
    #[arg(long, env = "SLUICE_REDIS_TIMEOUT", default_value = "10ms", value_parser = parse_duration)]
    redis_timeout: Duration,
    /// The most one connection attempt to Redis may take. Connections are made ahead, in the
    /// background, so requests do not wait for them.
    #[arg(long, env = "SLUICE_REDIS_CONNECT_TIMEOUT", default_value = "1s", value_parser = parse_duration)]
    redis_connect_timeout: Duration,
    /// Prefix of every Redis key (no braces).
    #[arg(long, env = "SLUICE_REDIS_KEY_PREFIX", default_value = "sluice:")]
    redis_key_prefix: String,
    /// When Redis cannot answer: allow, deny, local (this node decides alone) or error (gRPC
    /// UNAVAILABLE, so Envoy's failure_mode_deny decides). A rule's `failure_mode` overrides it.
    #[arg(long, env = "SLUICE_FAILURE_MODE", default_value = "local")]
    failure_mode: FailureMode,
    /// Counters Redis denied are denied on this node until they can fit again, without a Redis
    /// call; this many at most (0: off).
    #[arg(long, env = "SLUICE_OVER_LIMIT_CACHE", default_value_t = 100_000)]
    over_limit_cache: usize,
    /// The mode of rules that set none: strict (one Redis call per request) or hybrid (nodes
    /// decide from leases of the shared quota; fixed_window and sliding_window rules only).
    #[arg(long, env = "SLUICE_MODE", default_value = "strict")]
    mode: Mode,
    /// Hybrid: a lease is used at most this long before its leftover goes back to Redis.
    #[arg(long, env = "SLUICE_LEASE_TTL", default_value = "2s", value_parser = parse_duration)]
    lease_ttl: Duration,
    /// Hybrid: a lease covers about this much of the node's recent traffic for its counter.
    #[arg(long, env = "SLUICE_LEASE_TARGET", default_value = "100ms", value_parser = parse_duration)]
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
    #[arg(long, env = "SLUICE_DRAIN_DELAY", default_value = "5s", value_parser = parse_duration)]
    drain_delay: Duration,
    /// On SIGTERM, after the drain, how long in-flight calls may take to finish before sluice
    /// exits anyway.
    #[arg(long, env = "SLUICE_SHUTDOWN_GRACE", default_value = "10s", value_parser = parse_duration)]
    shutdown_grace: Duration,
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
    #[arg(long, env = "SLUICE_GRPC_TLS_RELOAD_EVERY", default_value = "10s", value_parser = parse_duration)]
    grpc_tls_reload_every: Duration,
}

/// The command line, with the reference service's environment read in when sluice runs in its
/// place: invoked as `ratelimit` (the image's `/bin/ratelimit`, as Envoy Gateway starts it; with
/// no arguments that means `serve`) or with `SLUICE_REFERENCE_ENV=true`.
fn command_line() -> Result<(Vec<std::ffi::OsString>, sluice::reference_env::Translation), String> {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let as_reference = args
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .is_some_and(|n| n == "ratelimit");
    let asked = std::env::var("SLUICE_REFERENCE_ENV").is_ok_and(|v| v == "true" || v == "1");
    if !as_reference && !asked {
        return Ok((args, Default::default()));
    }
    if as_reference && args.len() == 1 {
        args.push("serve".into());
    }
    let mut t = sluice::reference_env::translate(|k| std::env::var(k).ok())
        .map_err(|e| format!("sluice (as the reference service): {e}"))?;
    // Only `serve` takes them; after the subcommand, before the command line's own flags (a
    // repeated flag's last value wins, so those still override).
    if let Some(at) = args.iter().position(|a| a == "serve") {
        let tail = args.split_off(at + 1);
        args.extend(std::mem::take(&mut t.flags).into_iter().map(Into::into));
        args.extend(tail);
    }
    Ok((args, t))
}

fn main() -> ExitCode {
    let (args, reference) = match command_line() {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let cli = Cli::parse_from(args);
    init_logging(
        cli.log_format,
        reference.log_level.as_deref().unwrap_or("info"),
    );
    for (var, why) in reference.ignored {
        tracing::info!(variable = var, "reference setting not needed: {why}");
    }
    let load = LoadOptions {
        merge_domains: cli.merge_domains,
    };
    match cli.command {
        Command::Validate { path } => validate(&path, load),
        Command::Probe { http_addr } => probe(http_addr),
        Command::Schema => {
            println!(
                "{}",
                serde_json::to_string_pretty(&sluice::rules::schema()).unwrap_or_default()
            );
            ExitCode::SUCCESS
        }
        Command::Explain {
            config,
            domain,
            descriptors,
            redis_key_prefix,
        } => explain(&config, &domain, &descriptors, &redis_key_prefix, load),
        Command::Serve(args) => match serve(*args, load) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("sluice: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}

/// `default_level` when `RUST_LOG` is not set.
fn init_logging(format: LogFormat, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn validate(path: &std::path::Path, load: LoadOptions) -> ExitCode {
    match load_path_with(path, load) {
        Ok(rules) => {
            println!(
                "ok: {} domains, {} rules",
                rules.domain_count(),
                rules.rule_count()
            );
            ExitCode::SUCCESS
        }
        Err(errors) => {
            println!("{errors}");
            ExitCode::FAILURE
        }
    }
}

fn probe(addr: SocketAddr) -> ExitCode {
    use std::io::{Read, Write};
    // A listener on 0.0.0.0 is reached on loopback.
    let addr = if addr.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], addr.port()))
    } else {
        addr
    };
    let ready = (|| -> std::io::Result<bool> {
        let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
        stream.set_read_timeout(Some(Duration::from_secs(1)))?;
        stream.write_all(b"GET /readyz HTTP/1.1\r\nHost: sluice\r\nConnection: close\r\n\r\n")?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head)?;
        Ok(&head[9..12] == b"200")
    })();
    match ready {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("sluice: not ready");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("sluice: {addr}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The async runtime: `threads` workers (0: the CPUs this process may use, as `taskset` or a
/// container's cpuset leaves them), single-threaded when that is one.
fn runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
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

fn explain(
    config: &std::path::Path,
    domain: &str,
    descriptors: &[String],
    prefix: &str,
    load: LoadOptions,
) -> ExitCode {
    let rules = match load_path_with(config, load) {
        Ok(rules) => rules,
        Err(errors) => {
            println!("{errors}");
            return ExitCode::FAILURE;
        }
    };
    let parsed: Result<Vec<_>, _> = descriptors
        .iter()
        .map(|d| sluice::explain::parse_descriptor(d))
        .collect();
    match parsed {
        Ok(parsed) => {
            print!(
                "{}",
                sluice::explain::explain(&rules, domain, &parsed, prefix)
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice: --descriptor {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve(args: ServeArgs, load: LoadOptions) -> anyhow::Result<()> {
    let mut headers = HeaderSet::parse(&args.response_headers)?;
    if let Some(names) = &mut headers.ratelimit {
        *names = LimitHeaderNames::parse(&args.ratelimit_header_names)?;
    }
    let xds = xds_options(&args)?;
    if xds.is_none() && !args.config.exists() {
        // The default is relative: started from another directory, it names nothing.
        let resolved = std::env::current_dir()
            .map(|d| d.join(&args.config))
            .unwrap_or_else(|_| args.config.clone());
        anyhow::bail!(
            "no rules at {} ({}): pass --config FILE_OR_DIRECTORY or set SLUICE_CONFIG",
            args.config.display(),
            resolved.display()
        );
    }
    let (rules, source) = match xds {
        Some(xds) => (
            RuleSet::default(),
            Source::Xds {
                options: xds,
                wait: !args.xds_start_without_rules,
            },
        ),
        None => {
            let rules = load_path_with(&args.config, load).map_err(|e| {
                anyhow::anyhow!("the rules in {} are invalid:\n{e}", args.config.display())
            })?;
            tracing::info!(
                config = %args.config.display(),
                domains = rules.domain_count(),
                rules = rules.rule_count(),
                "rules loaded"
            );
            (
                rules,
                Source::Files {
                    path: args.config.clone(),
                    watch: args.watch,
                },
            )
        }
    };
    let settings = EngineSettings {
        global_shadow: args.shadow_mode,
        global_quota: args.quota_mode,
        bounds: Bounds {
            max_descriptors: args.max_descriptors,
            max_entries: args.max_entries,
            max_entry_bytes: args.max_entry_bytes,
        },
    };
    let grpc_tls = match (&args.grpc_tls_cert, &args.grpc_tls_key) {
        (Some(cert), Some(key)) => Some(Arc::new(sluice::tls::ServerTls::load(
            sluice::tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: args.grpc_tls_client_ca.clone(),
                client_san: args.grpc_tls_client_san.clone(),
                reload_every: args.grpc_tls_reload_every,
            },
        )?)),
        _ => None,
    };
    let metrics = Metrics::new(args.near_limit_ratio, args.metrics_max_series);
    let metrics = Arc::new(match args.reference_metrics_addr {
        Some(_) => metrics.with_reference_names(),
        None => metrics,
    });
    if !args.reference_metrics_path.starts_with('/') {
        anyhow::bail!(
            "--reference-metrics-path '{}' must start with /",
            args.reference_metrics_path
        );
    }
    let options = Options {
        grpc_addr: args.grpc_addr,
        http_addr: args.http_addr,
        headers,
        housekeeping_every: Duration::from_secs(5),
        reloader: None,
        metrics: Some(metrics.clone()),
        json: args.json_endpoint,
        dynamic_metadata: args.response_dynamic_metadata,
        grpc_tls,
        reference_metrics: args
            .reference_metrics_addr
            .map(|a| (a, args.reference_metrics_path.clone())),
    };
    let live = Live {
        source,
        shutdown_grace: args.shutdown_grace,
        drain_delay: args.drain_delay,
        load,
    };
    let runtime = runtime(args.worker_threads).context("starting the async runtime")?;
    let topology = match args.backend {
        Backend::Memory => None,
        Backend::Redis => Some(Topology::Standalone(args.redis_url.clone())),
        Backend::RedisCluster => Some(Topology::Cluster(
            args.redis_url
                .split(',')
                .map(|u| u.trim().to_owned())
                .collect(),
        )),
    };
    let backend = match topology {
        None => BackendConfig::Memory,
        Some(topology) => BackendConfig::Redis(RedisOptions {
            topology,
            pool_size: args.redis_pool_size,
            timeout: args.redis_timeout,
            connect_timeout: args.redis_connect_timeout,
            key_prefix: args.redis_key_prefix.clone(),
        }),
    };
    if let BackendConfig::Redis(_) = backend {
        tracing::info!(
            backend = ?args.backend.to_possible_value().map(|v| v.get_name().to_owned()),
            url = %redact(&args.redis_url),
            timeout = ?args.redis_timeout,
            failure_mode = %args.failure_mode,
            mode = %args.mode,
            "using Redis"
        );
    }
    let config = StoreConfig {
        max_keys: args.max_keys,
        failure_mode: args.failure_mode,
        over_limit_cache: args.over_limit_cache,
        leases: LeaseOptions {
            default_mode: args.mode,
            ttl: args.lease_ttl,
            target: args.lease_target,
            ..LeaseOptions::default()
        },
        observer: Some(metrics as Arc<dyn BackendObserver>),
        ..StoreConfig::new(backend)
    };
    runtime.block_on(async move {
        // Inside the runtime: connections to Redis are made ahead, in the background.
        let store = build(&config)?;
        run(options, live, Engine::new(rules, store, settings)).await
    })
}

/// Where the rules come from.
enum Source {
    /// Files, reloaded on SIGHUP and, with `watch`, on change.
    Files { path: PathBuf, watch: bool },
    /// An xDS server; with `wait`, nothing is served before its first rules.
    Xds { options: XdsOptions, wait: bool },
}

/// The xDS client's settings, when --xds-server asks for one.
fn xds_options(args: &ServeArgs) -> anyhow::Result<Option<XdsOptions>> {
    let Some(server) = args.xds_server.clone() else {
        return Ok(None);
    };
    let node_metadata = sluice::xds::parse_pairs(&args.xds_node_metadata)
        .map_err(|e| anyhow::anyhow!("--xds-node-metadata: {e}"))?;
    let headers = sluice::xds::parse_pairs(&args.xds_headers)
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
    let tls = args.xds_tls_ca.clone().map(|ca| XdsTls {
        ca,
        identity: args.xds_tls_cert.clone().zip(args.xds_tls_key.clone()),
        server_name: args.xds_tls_server_name.clone(),
    });
    Ok(Some(XdsOptions {
        server,
        node_id: args.xds_node_id.clone(),
        node_metadata,
        headers,
        tls,
        retry: Backoff {
            initial: args.xds_retry_initial,
            max: args.xds_retry_max.max(args.xds_retry_initial),
        },
    }))
}

/// How the rules stay live.
struct Live {
    source: Source,
    shutdown_grace: Duration,
    drain_delay: Duration,
    load: LoadOptions,
}

async fn run<S: Store>(mut options: Options, live: Live, engine: Engine<S>) -> anyhow::Result<()> {
    let engine = Arc::new(engine);
    let apply = {
        let engine = engine.clone();
        move |rules| engine.replace_rules(rules)
    };
    let (reloader, watch, xds) = match live.source {
        Source::Files { path, watch } => (Reloader::new(path, &engine.rules(), apply), watch, None),
        Source::Xds { options, wait } => {
            let source = format!("xds {} (node {})", options.server, options.node_id);
            (
                Reloader::pushed(source, apply),
                false,
                Some((options, wait)),
            )
        }
    };
    let reloader = reloader.with_load_options(live.load);
    let reloader = Arc::new(match &options.metrics {
        Some(m) => reloader.with_metrics(m.clone()),
        None => reloader,
    });
    let _watch = if watch {
        Some(
            reloader
                .watch(Duration::from_millis(200))
                .with_context(|| format!("watching {}", reloader.source()))?,
        )
    } else {
        None
    };
    let stop_signal = shutdown_signal();
    tokio::pin!(stop_signal);
    let sighup = {
        let reloader = reloader.clone();
        // Registered here, before anything listens: a SIGHUP that arrived before a spawned
        // task got to register would take its default action and end the process.
        let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
        tokio::spawn(async move {
            let Ok(mut hup) = hup else {
                tracing::warn!("cannot watch SIGHUP; reload by editing the rules instead");
                return;
            };
            while hup.recv().await.is_some() {
                tracing::info!("SIGHUP: reloading the rules");
                let reloader = reloader.clone();
                let _ = tokio::task::spawn_blocking(move || reloader.reload()).await;
            }
        })
    };
    let _xds = match xds {
        Some((xds, wait)) => {
            let client = XdsRules::start(xds, reloader.clone());
            if wait {
                tracing::info!(source = %reloader.source(), "waiting for the first rules before serving");
                tokio::select! {
                    _ = client.first_rules() => {}
                    _ = &mut stop_signal => {
                        tracing::info!("stopped before the first rules arrived");
                        return Ok(());
                    }
                }
            }
            Some(client)
        }
        None => None,
    };
    options.reloader = Some(reloader);
    let running = server::start(options, engine).await?;
    (&mut stop_signal).await;
    if !live.drain_delay.is_zero() {
        tracing::info!(delay = ?live.drain_delay, "draining: health NOT_SERVING, calls still answered");
        running.drain();
        tokio::select! {
            _ = tokio::time::sleep(live.drain_delay) => {}
            _ = shutdown_signal() => tracing::info!("second signal: the drain ends now"),
        }
    }
    tracing::info!("shutting down");
    sighup.abort();
    match tokio::time::timeout(live.shutdown_grace, running.stop()).await {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!(grace = ?live.shutdown_grace, "calls still in flight after the grace period; exiting");
            Ok(())
        }
    }
}

/// Registers SIGTERM now (a SIGTERM before registration would end the process without a
/// graceful stop or the leases' return); the future resolves on SIGTERM or SIGINT.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
    async move { wait_for_shutdown(term).await }
}

async fn wait_for_shutdown(term: std::io::Result<tokio::signal::unix::Signal>) {
    match term {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGTERM; stopping on SIGINT only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
