//! The Go reference service's environment variables, read when sluice runs in its place (as
//! `ratelimit`, e.g. the image's `/bin/ratelimit`, or with `SLUICE_REFERENCE_ENV=true`).
//!
//! Each variable is honoured (turned into the typed [`Setting`] it means, which `cli` applies to
//! the same arguments the flags fill), ignored because it changes nothing sluice does (listed
//! with why), or refused when it asks for something sluice does not do, so a deployment never
//! runs with a setting silently dropped. A `SLUICE_*` variable of the same setting wins, and a
//! flag on the command line wins over both: a setting fills only an argument that was left at
//! its default.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::{Backend, LogFormat};

/// One `serve` (or global) argument, as the reference's environment sets it.
#[derive(Debug, Clone, PartialEq)]
pub enum Setting {
    GrpcAddr(SocketAddr),
    HttpAddr(SocketAddr),
    GrpcTlsCert(PathBuf),
    GrpcTlsKey(PathBuf),
    GrpcTlsClientCa(PathBuf),
    GrpcTlsClientSan(String),
    XdsServer(String),
    XdsNodeId(String),
    XdsNodeMetadata(String),
    XdsHeaders(String),
    XdsRetryInitial(Duration),
    XdsTlsCa(PathBuf),
    XdsTlsCert(PathBuf),
    XdsTlsKey(PathBuf),
    XdsTlsServerName(String),
    XdsStartWithoutRules,
    Config(PathBuf),
    Backend(Backend),
    RedisUrl(String),
    RedisConnectTimeout(Duration),
    RedisKeyPrefix(String),
    ShadowMode,
    QuotaMode,
    ResponseDynamicMetadata,
    MergeDomains,
    NearLimitRatio(f64),
    ResponseHeaders(String),
    RatelimitHeaderNames(String),
    ReferenceMetricsAddr(SocketAddr),
    ReferenceMetricsPath(String),
    LogFormat(LogFormat),
}

/// The outcome: the settings, and the variables read but not needed.
#[derive(Debug, Default, PartialEq)]
pub struct Translation {
    pub settings: Vec<Setting>,
    /// `LOG_LEVEL`, for when `RUST_LOG` is not set.
    pub log_level: Option<String>,
    pub ignored: Vec<(String, &'static str)>,
    /// sluice runs as the reference: its `TRACING_*` variables are read too (`trace::from_env`).
    pub as_reference: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReferenceEnvError {
    #[error("{var}={value}: {why}")]
    Unsupported {
        var: String,
        value: String,
        why: &'static str,
    },
    #[error("{var}={value}: {why}")]
    Invalid {
        var: String,
        value: String,
        why: &'static str,
    },
}

/// Variables that change nothing here, and why.
const IGNORED: &[(&str, &str)] = &[
    (
        "PROMETHEUS_MAPPER_YAML",
        "the reference names are Envoy Gateway's mapping, fixed",
    ),
    (
        "RUNTIME_WATCH_ROOT",
        "the rules directory is watched either way",
    ),
    ("RUNTIME_IGNOREDOTFILES", "hidden files are always skipped"),
    (
        "LOCAL_CACHE_SIZE_IN_BYTES",
        "the over-limit cache is sized in counters (--over-limit-cache)",
    ),
    (
        "EXPIRATION_JITTER_MAX_SECONDS",
        "every key's TTL is its state's end",
    ),
    (
        "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
        "a denied request never consumes",
    ),
    (
        "REDIS_PIPELINE_WINDOW",
        "one script call per request (per cluster slot group)",
    ),
    (
        "REDIS_PIPELINE_LIMIT",
        "one script call per request (per cluster slot group)",
    ),
    (
        "REDIS_POOL_ON_EMPTY_BEHAVIOR",
        "calls share multiplexed connections",
    ),
    (
        "REDIS_POOL_SIZE",
        "calls share multiplexed connections: the reference's pool of one call per connection \
         does not translate (more connections only cost CPU; --redis-pool-size to choose)",
    ),
    (
        "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
        "serve refuses to start on invalid rules",
    ),
    (
        "DEBUG_HOST",
        "no debug listener: /rlconfig is on the HTTP port",
    ),
    (
        "DEBUG_PORT",
        "no debug listener: /rlconfig is on the HTTP port",
    ),
];

/// Reads the reference's variables through `get` and says what they become.
pub fn translate(get: impl Fn(&str) -> Option<String>) -> Result<Translation, ReferenceEnvError> {
    let mut t = Translation {
        as_reference: true,
        ..Translation::default()
    };
    let set = |name: &str| get(name).filter(|v| !v.is_empty());
    let truthy = |name: &str| -> Result<Option<bool>, ReferenceEnvError> {
        set(name)
            .map(|v| boolean(&v).ok_or_else(|| invalid(name, &v, "expected true or false")))
            .transpose()
    };
    let settings = &mut t.settings;

    // Refused first: sluice cannot do what these ask. A value names the one refused; None
    // refuses anything but false (a switch, or a certificate path).
    for (var, refused, why) in [
        (
            "BACKEND_TYPE",
            Some("memcache"),
            "memcache is not supported: use redis",
        ),
        (
            "REDIS_SOCKET_TYPE",
            Some("unix"),
            "Redis over a unix socket is not supported: use tcp",
        ),
        (
            "REDIS_SENTINEL_AUTH",
            None,
            "sentinels with a password are not supported: sluice asks them without one",
        ),
        (
            "REDIS_PERSECOND",
            Some("true"),
            "one Redis serves every unit",
        ),
        (
            "USE_STATSD",
            None,
            "statsd is not supported: metrics are Prometheus",
        ),
        (
            "USE_DOG_STATSD",
            None,
            "statsd is not supported: metrics are Prometheus",
        ),
        (
            "REDIS_TLS_CLIENT_CERT",
            None,
            "Redis client certificates are not supported yet",
        ),
    ] {
        if let Some(v) = set(var) {
            let asked = match refused {
                Some(r) => v.eq_ignore_ascii_case(r),
                None => boolean(&v) != Some(false),
            };
            if asked {
                return Err(unsupported(var, &v, why));
            }
        }
    }

    // Listeners.
    let addr = |host: &str, port: &str, default_port: &str| {
        let host_value = set(host).unwrap_or_else(|| "0.0.0.0".into());
        let port_value = set(port).unwrap_or_else(|| default_port.into());
        socket_addr(port, &format!("{host_value}:{port_value}"))
    };
    if set("GRPC_HOST").is_some() || set("GRPC_PORT").is_some() {
        settings.push(Setting::GrpcAddr(addr("GRPC_HOST", "GRPC_PORT", "8081")?));
    }
    if set("HOST").is_some() || set("PORT").is_some() {
        settings.push(Setting::HttpAddr(addr("HOST", "PORT", "8080")?));
    }

    // TLS on the gRPC listener. The reference reads the client CA from GRPC_CLIENT_TLS_CACERT;
    // Envoy Gateway sets GRPC_SERVER_TLS_CA_CERT, meaning the same (client certificates
    // verified), so either names it.
    if truthy("GRPC_SERVER_USE_TLS")? == Some(true) {
        let path = |var: &str| {
            set(var).map(PathBuf::from).ok_or_else(|| {
                invalid(
                    "GRPC_SERVER_USE_TLS",
                    "true",
                    "needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY",
                )
            })
        };
        settings.push(Setting::GrpcTlsCert(path("GRPC_SERVER_TLS_CERT")?));
        settings.push(Setting::GrpcTlsKey(path("GRPC_SERVER_TLS_KEY")?));
        let ca = match (
            set("GRPC_CLIENT_TLS_CACERT"),
            set("GRPC_SERVER_TLS_CA_CERT"),
        ) {
            (Some(a), Some(b)) if a != b => {
                return Err(invalid(
                    "GRPC_SERVER_TLS_CA_CERT",
                    &b,
                    "GRPC_CLIENT_TLS_CACERT names another client CA: set one",
                ));
            }
            (a, b) => a.or(b),
        };
        if let Some(ca) = ca {
            settings.push(Setting::GrpcTlsClientCa(ca.into()));
            if let Some(san) = set("GRPC_CLIENT_TLS_SAN") {
                settings.push(Setting::GrpcTlsClientSan(san));
            }
        }
    }

    // Rules: from an xDS server (CONFIG_TYPE=GRPC_XDS_SOTW), or from files under
    // RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY (default `config`).
    let config_type = set("CONFIG_TYPE").map(|v| v.to_ascii_uppercase());
    let xds = match config_type.as_deref() {
        None | Some("FILE") => false,
        Some("GRPC_XDS_SOTW") => true,
        Some(other) => {
            return Err(invalid(
                "CONFIG_TYPE",
                other,
                "expected FILE or GRPC_XDS_SOTW",
            ));
        }
    };
    if xds {
        xds_settings(settings, &set, &truthy)?;
        for var in [
            "RUNTIME_ROOT",
            "RUNTIME_SUBDIRECTORY",
            "RUNTIME_APPDIRECTORY",
        ] {
            if set(var).is_some() {
                t.ignored.push((var.to_owned(), "the rules come over xDS"));
            }
        }
    } else if set("FORCE_START_WITHOUT_INITIAL_CONFIG").is_some() {
        t.ignored.push((
            "FORCE_START_WITHOUT_INITIAL_CONFIG".to_owned(),
            "serve starts on the rules files it is given",
        ));
    }
    let settings = &mut t.settings;
    if let Some(root) = set("RUNTIME_ROOT").filter(|_| !xds) {
        let mut path = PathBuf::from(root);
        if let Some(sub) = set("RUNTIME_SUBDIRECTORY") {
            path.push(sub);
        }
        path.push(set("RUNTIME_APPDIRECTORY").unwrap_or_else(|| "config".into()));
        settings.push(Setting::Config(path));
    }

    // Redis.
    let redis_type = set("REDIS_TYPE").map(|v| v.to_ascii_lowercase());
    let backend = match (set("BACKEND_TYPE"), redis_type.as_deref()) {
        (_, Some("cluster")) => Some(Backend::RedisCluster),
        (_, Some("single" | "sentinel")) | (Some(_), None) => Some(Backend::Redis),
        (_, Some(other)) => {
            return Err(invalid(
                "REDIS_TYPE",
                other,
                "expected single, cluster or sentinel",
            ));
        }
        (None, None) => set("REDIS_URL").map(|_| Backend::Redis),
    };
    if let Some(b) = backend {
        settings.push(Setting::Backend(b));
    }
    if let Some(url) = set("REDIS_URL") {
        let scheme = if truthy("REDIS_TLS")?.unwrap_or(false) {
            "rediss"
        } else {
            "redis"
        };
        let auth = set("REDIS_AUTH").map(|a| match a.split_once(':') {
            Some((user, pass)) => format!("{user}:{pass}@"),
            None => format!(":{a}@"),
        });
        let auth = auth.unwrap_or_default();
        let url = if redis_type.as_deref() == Some("sentinel") {
            // The reference's form: the master's name, then the sentinels.
            let mut parts = url.split(',').map(str::trim);
            let master = parts.next().unwrap_or_default();
            let sentinels: Vec<&str> = parts.filter(|p| !p.is_empty()).collect();
            if master.is_empty() || sentinels.is_empty() {
                return Err(invalid(
                    "REDIS_URL",
                    &url,
                    "with REDIS_TYPE=sentinel: master-name,sentinel-host:port[,...]",
                ));
            }
            format!("{scheme}+sentinel://{auth}{}/{master}", sentinels.join(","))
        } else {
            url.split(',')
                .map(|hostport| format!("{scheme}://{auth}{}", hostport.trim()))
                .collect::<Vec<_>>()
                .join(",")
        };
        settings.push(Setting::RedisUrl(url));
    }
    if let Some(d) = set("REDIS_TIMEOUT") {
        // The reference's timeout is its dial timeout.
        let d = go_duration(&d)
            .ok_or_else(|| invalid("REDIS_TIMEOUT", &d, "expected a duration like 500ms or 10s"))?;
        settings.push(Setting::RedisConnectTimeout(d));
    }
    if let Some(p) = set("CACHE_KEY_PREFIX") {
        settings.push(Setting::RedisKeyPrefix(p));
    }

    // Decisions and answers.
    for (var, setting) in [
        ("SHADOW_MODE", Setting::ShadowMode),
        ("QUOTA_MODE", Setting::QuotaMode),
        (
            "RESPONSE_DYNAMIC_METADATA",
            Setting::ResponseDynamicMetadata,
        ),
        ("MERGE_DOMAIN_CONFIG", Setting::MergeDomains),
    ] {
        if truthy(var)? == Some(true) {
            settings.push(setting);
        }
    }
    if let Some(r) = set("NEAR_LIMIT_RATIO") {
        let ratio = r
            .parse::<f64>()
            .map_err(|_| invalid("NEAR_LIMIT_RATIO", &r, "expected a number like 0.8"))?;
        settings.push(Setting::NearLimitRatio(ratio));
    }
    // The reference adds headers only when asked; Envoy Gateway does not ask, and turns on
    // Envoy's own x-ratelimit-* headers instead: sluice's default (retry-after, draft03) would
    // send those twice.
    if truthy("LIMIT_RESPONSE_HEADERS_ENABLED")? != Some(true) {
        settings.push(Setting::ResponseHeaders("none".into()));
    } else {
        settings.push(Setting::ResponseHeaders("ratelimit".into()));
        let names = [
            ("LIMIT_LIMIT_HEADER", "RateLimit-Limit"),
            ("LIMIT_REMAINING_HEADER", "RateLimit-Remaining"),
            ("LIMIT_RESET_HEADER", "RateLimit-Reset"),
        ]
        .map(|(var, default)| set(var).unwrap_or_else(|| default.into()));
        settings.push(Setting::RatelimitHeaderNames(names.join(",")));
    }
    // Prometheus: sluice's own names are always on the HTTP port; the reference's names (as
    // Envoy Gateway's statsd mapping makes them) on PROMETHEUS_ADDR, as the reference serves.
    if truthy("USE_PROMETHEUS")? == Some(true) {
        let addr = set("PROMETHEUS_ADDR").unwrap_or_else(|| ":9090".into());
        // Go's `:19001` is every interface.
        let addr = match addr.strip_prefix(':') {
            Some(port) => format!("0.0.0.0:{port}"),
            None => addr,
        };
        settings.push(Setting::ReferenceMetricsAddr(socket_addr(
            "PROMETHEUS_ADDR",
            &addr,
        )?));
        if let Some(path) = set("PROMETHEUS_PATH") {
            settings.push(Setting::ReferenceMetricsPath(path));
        }
    }
    if let Some(level) = set("LOG_LEVEL") {
        let level = level.to_ascii_lowercase();
        let level = if level == "warning" {
            "warn".into()
        } else {
            level
        };
        if !["trace", "debug", "info", "warn", "error"].contains(&level.as_str()) {
            return Err(invalid(
                "LOG_LEVEL",
                &level,
                "expected trace, debug, info, warn or error",
            ));
        }
        t.log_level = Some(level);
    }
    if let Some(format) = set("LOG_FORMAT") {
        match format.to_ascii_lowercase().as_str() {
            "json" => t.settings.push(Setting::LogFormat(LogFormat::Json)),
            "text" => {}
            _ => return Err(invalid("LOG_FORMAT", &format, "expected text or json")),
        }
    }
    for (var, why) in IGNORED {
        if set(var).is_some() {
            t.ignored.push(((*var).to_owned(), *why));
        }
    }
    Ok(t)
}

/// The xDS client's settings from the reference's CONFIG_GRPC_XDS_* variables (its defaults
/// when unset: server `localhost:18000`, node id `default`).
fn xds_settings(
    settings: &mut Vec<Setting>,
    set: &impl Fn(&str) -> Option<String>,
    truthy: &impl Fn(&str) -> Result<Option<bool>, ReferenceEnvError>,
) -> Result<(), ReferenceEnvError> {
    let server = set("CONFIG_GRPC_XDS_SERVER_URL").unwrap_or_else(|| "localhost:18000".into());
    settings.push(Setting::XdsServer(server));
    let node = set("CONFIG_GRPC_XDS_NODE_ID").unwrap_or_else(|| "default".into());
    settings.push(Setting::XdsNodeId(node));
    if let Some(v) = set("CONFIG_GRPC_XDS_NODE_METADATA") {
        settings.push(Setting::XdsNodeMetadata(v));
    }
    if let Some(v) = set("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS") {
        settings.push(Setting::XdsHeaders(v));
    }
    if let Some(d) = set("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL") {
        let d = go_duration(&d).ok_or_else(|| {
            invalid(
                "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
                &d,
                "expected a duration like 3s",
            )
        })?;
        settings.push(Setting::XdsRetryInitial(d));
    }
    if truthy("CONFIG_GRPC_XDS_SERVER_USE_TLS")? == Some(true) {
        // sluice carries no system trust store: the server's CA must be named.
        let ca = set("CONFIG_GRPC_XDS_SERVER_TLS_CACERT").ok_or_else(|| {
            unsupported(
                "CONFIG_GRPC_XDS_SERVER_USE_TLS",
                "true",
                "needs CONFIG_GRPC_XDS_SERVER_TLS_CACERT: sluice verifies the xDS server against a named CA only",
            )
        })?;
        settings.push(Setting::XdsTlsCa(ca.into()));
        match (
            set("CONFIG_GRPC_XDS_CLIENT_TLS_CERT"),
            set("CONFIG_GRPC_XDS_CLIENT_TLS_KEY"),
        ) {
            (Some(cert), Some(key)) => {
                settings.push(Setting::XdsTlsCert(cert.into()));
                settings.push(Setting::XdsTlsKey(key.into()));
            }
            (None, None) => {}
            (Some(v), None) | (None, Some(v)) => {
                return Err(invalid(
                    "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
                    &v,
                    "needs both CONFIG_GRPC_XDS_CLIENT_TLS_CERT and CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
                ));
            }
        }
        if let Some(san) = set("CONFIG_GRPC_XDS_SERVER_TLS_SAN") {
            settings.push(Setting::XdsTlsServerName(san));
        }
    }
    if truthy("FORCE_START_WITHOUT_INITIAL_CONFIG")? == Some(true) {
        settings.push(Setting::XdsStartWithoutRules);
    }
    Ok(())
}

/// `host:port` as the listener's address; `var` is named when it is not one.
fn socket_addr(var: &str, value: &str) -> Result<SocketAddr, ReferenceEnvError> {
    value
        .parse()
        .map_err(|_| invalid(var, value, "expected an IP address and a port"))
}

/// A Go boolean as the reference's settings parse it (`true`, `1`, `t`, any case).
fn boolean(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "t" => Some(true),
        "false" | "0" | "f" => Some(false),
        _ => None,
    }
}

/// A Go duration of one unit (`500ms`, `10s`, `2m`, `1h`).
fn go_duration(d: &str) -> Option<Duration> {
    let split = d.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = d.split_at(split);
    let n: u64 = n.parse().ok()?;
    match unit {
        "us" | "µs" => Some(Duration::from_micros(n)),
        "ms" => Some(Duration::from_millis(n)),
        "s" => Some(Duration::from_secs(n)),
        "m" => Some(Duration::from_secs(n.checked_mul(60)?)),
        "h" => Some(Duration::from_secs(n.checked_mul(3600)?)),
        _ => None,
    }
}

fn unsupported(var: &str, value: &str, why: &'static str) -> ReferenceEnvError {
    ReferenceEnvError::Unsupported {
        var: var.to_owned(),
        value: value.to_owned(),
        why,
    }
}

fn invalid(var: &str, value: &str, why: &'static str) -> ReferenceEnvError {
    ReferenceEnvError::Invalid {
        var: var.to_owned(),
        value: value.to_owned(),
        why,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Setting::*;

    fn run(vars: &[(&str, &str)]) -> Result<Translation, ReferenceEnvError> {
        let vars: std::collections::HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        translate(|k| vars.get(k).cloned())
    }

    fn addr(a: &str) -> SocketAddr {
        a.parse().unwrap()
    }

    #[test]
    fn a_reference_deployment_becomes_serve_settings() {
        let t = run(&[
            ("PORT", "8080"),
            ("GRPC_PORT", "8081"),
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("REDIS_AUTH", "secret"),
            ("REDIS_POOL_SIZE", "20"),
            ("REDIS_TIMEOUT", "2s"),
            ("SHADOW_MODE", "false"),
            ("QUOTA_MODE", "true"),
            ("USE_STATSD", "false"),
            ("USE_PROMETHEUS", "true"),
            ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
            ("LIMIT_RESET_HEADER", "X-Reset"),
        ])
        .unwrap();
        assert_eq!(
            t.settings,
            [
                GrpcAddr(addr("0.0.0.0:8081")),
                HttpAddr(addr("0.0.0.0:8080")),
                Config("/data/ratelimit/config".into()),
                Backend(super::Backend::Redis),
                RedisUrl("redis://:secret@redis:6379".into()),
                RedisConnectTimeout(Duration::from_secs(2)),
                QuotaMode,
                ResponseHeaders("ratelimit".into()),
                RatelimitHeaderNames("RateLimit-Limit,RateLimit-Remaining,X-Reset".into()),
                ReferenceMetricsAddr(addr("0.0.0.0:9090")),
            ]
        );
        let ignored: Vec<&str> = t.ignored.iter().map(|(v, _)| v.as_str()).collect();
        assert_eq!(ignored, ["REDIS_POOL_SIZE"]);
    }

    /// Envoy Gateway turns on Envoy's own x-ratelimit-* headers and not the reference's: sluice
    /// then adds none either, or a client would get each twice.
    #[test]
    fn headers_follow_the_references_settings() {
        assert_eq!(run(&[]).unwrap().settings, [ResponseHeaders("none".into())]);
        assert_eq!(
            run(&[("LIMIT_RESPONSE_HEADERS_ENABLED", "false")])
                .unwrap()
                .settings,
            [ResponseHeaders("none".into())]
        );
        assert_eq!(
            run(&[("LIMIT_RESPONSE_HEADERS_ENABLED", "true")])
                .unwrap()
                .settings,
            [
                ResponseHeaders("ratelimit".into()),
                RatelimitHeaderNames("RateLimit-Limit,RateLimit-Remaining,RateLimit-Reset".into()),
            ]
        );
    }

    #[test]
    fn a_cluster_with_tls_and_a_user() {
        let t = run(&[
            ("REDIS_TYPE", "CLUSTER"),
            ("REDIS_URL", "a:6379, b:6379"),
            ("REDIS_AUTH", "u:p"),
            ("REDIS_TLS", "true"),
        ])
        .unwrap();
        assert_eq!(
            t.settings,
            [
                Backend(super::Backend::RedisCluster),
                RedisUrl("rediss://u:p@a:6379,rediss://u:p@b:6379".into()),
                ResponseHeaders("none".into()),
            ]
        );
    }

    #[test]
    fn what_sluice_cannot_do_is_refused_by_name() {
        for (var, value) in [
            ("BACKEND_TYPE", "memcache"),
            ("REDIS_SOCKET_TYPE", "unix"),
            ("REDIS_SENTINEL_AUTH", "secret"),
            ("USE_STATSD", "true"),
        ] {
            let e = run(&[(var, value)]).unwrap_err();
            assert!(
                matches!(&e, ReferenceEnvError::Unsupported { var: v, .. } if v == var),
                "{var}: {e}"
            );
        }
        for vars in [
            &[("SHADOW_MODE", "yes")][..],
            &[("REDIS_TIMEOUT", "1.5s")],
            &[("GRPC_PORT", "http")],
            &[
                ("USE_PROMETHEUS", "true"),
                ("PROMETHEUS_ADDR", "metrics:9090"),
            ],
            &[("NEAR_LIMIT_RATIO", "most")],
        ] {
            let e = run(vars).unwrap_err();
            assert!(
                matches!(&e, ReferenceEnvError::Invalid { var, .. } if var == vars[vars.len() - 1].0),
                "{vars:?}: {e}"
            );
        }
    }

    #[test]
    fn a_sentinel_deployment_names_its_master_and_sentinels() {
        let t = run(&[
            ("REDIS_TYPE", "sentinel"),
            ("REDIS_URL", "mymaster, s1:26379, s2:26379"),
            ("REDIS_AUTH", "pw"),
        ])
        .unwrap();
        assert_eq!(
            t.settings,
            [
                Backend(super::Backend::Redis),
                RedisUrl("redis+sentinel://:pw@s1:26379,s2:26379/mymaster".into()),
                ResponseHeaders("none".into()),
            ]
        );
        assert!(matches!(
            run(&[("REDIS_TYPE", "sentinel"), ("REDIS_URL", "mymaster")]),
            Err(ReferenceEnvError::Invalid { .. })
        ));
    }

    #[test]
    fn envoy_gateway_xds_becomes_the_xds_client_settings() {
        let t = run(&[
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
            ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
            ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
        ])
        .unwrap();
        assert_eq!(
            t.settings,
            [
                XdsServer("envoy-gateway:18001".into()),
                XdsNodeId("envoy-ratelimit".into()),
                XdsTlsCa("/certs/ca.crt".into()),
                XdsTlsCert("/certs/tls.crt".into()),
                XdsTlsKey("/certs/tls.key".into()),
                XdsStartWithoutRules,
                ResponseHeaders("none".into()),
            ]
        );
        // The rules directory is not read: RUNTIME_ROOT is listed as not needed.
        assert!(t.ignored.iter().any(|(v, _)| v == "RUNTIME_ROOT"));
        // The reference's defaults, and what cannot be done.
        let t = run(&[
            ("CONFIG_TYPE", "grpc_xds_sotw"),
            ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "3s"),
        ])
        .unwrap();
        assert_eq!(
            t.settings,
            [
                XdsServer("localhost:18000".into()),
                XdsNodeId("default".into()),
                XdsRetryInitial(Duration::from_secs(3)),
                ResponseHeaders("none".into()),
            ]
        );
        for vars in [
            &[("CONFIG_TYPE", "GRPC_XDS_DELTA")][..],
            &[
                ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
                ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
                ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/c"),
                ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/ca"),
            ],
        ] {
            assert!(
                matches!(run(vars), Err(ReferenceEnvError::Invalid { .. })),
                "{vars:?}"
            );
        }
        let e = run(&[
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
        ])
        .unwrap_err();
        assert!(
            e.to_string().contains("CONFIG_GRPC_XDS_SERVER_TLS_CACERT"),
            "{e}"
        );
    }

    #[test]
    fn envoy_gateway_tls_becomes_mutual_tls_settings() {
        let t = run(&[
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
            ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
            ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
        ])
        .unwrap();
        assert_eq!(
            t.settings,
            [
                GrpcTlsCert("/certs/tls.crt".into()),
                GrpcTlsKey("/certs/tls.key".into()),
                GrpcTlsClientCa("/certs/ca.crt".into()),
                ResponseHeaders("none".into()),
            ]
        );
        // The reference's own name, with a SAN; TLS off means the paths are not read.
        let t = run(&[
            ("GRPC_SERVER_USE_TLS", "1"),
            ("GRPC_SERVER_TLS_CERT", "c"),
            ("GRPC_SERVER_TLS_KEY", "k"),
            ("GRPC_CLIENT_TLS_CACERT", "ca"),
            ("GRPC_CLIENT_TLS_SAN", "envoy.internal"),
        ])
        .unwrap();
        assert_eq!(
            t.settings[2..],
            [
                GrpcTlsClientCa("ca".into()),
                GrpcTlsClientSan("envoy.internal".into()),
                ResponseHeaders("none".into()),
            ]
        );
        let t = run(&[
            ("GRPC_SERVER_USE_TLS", "false"),
            ("GRPC_SERVER_TLS_CERT", "c"),
        ])
        .unwrap();
        assert_eq!(t.settings, [ResponseHeaders("none".into())], "{t:?}");
        for vars in [
            &[
                ("GRPC_SERVER_USE_TLS", "true"),
                ("GRPC_SERVER_TLS_CERT", "c"),
            ][..],
            &[
                ("GRPC_SERVER_USE_TLS", "true"),
                ("GRPC_SERVER_TLS_CERT", "c"),
                ("GRPC_SERVER_TLS_KEY", "k"),
                ("GRPC_CLIENT_TLS_CACERT", "a"),
                ("GRPC_SERVER_TLS_CA_CERT", "b"),
            ],
        ] {
            assert!(
                matches!(run(vars), Err(ReferenceEnvError::Invalid { .. })),
                "{vars:?}"
            );
        }
    }
}
