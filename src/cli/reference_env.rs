//! The Go reference service's environment variables, read when sluice runs in its place (as
//! `ratelimit`, e.g. the image's `/bin/ratelimit`, or with `SLUICE_REFERENCE_ENV=true`).
//!
//! Each variable is honoured (turned into the `serve` flag that means the same), ignored because
//! it changes nothing sluice does (listed with why), or refused when it asks for something sluice
//! does not do, so a deployment never runs with a setting silently dropped. A `SLUICE_*`
//! variable of the same setting wins, and a flag on the command line wins over both (the flags
//! are passed before the command line's own).

/// The outcome: `serve` flags, and the variables read but not needed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Translation {
    pub flags: Vec<String>,
    /// `LOG_LEVEL`, for when `RUST_LOG` is not set.
    pub log_level: Option<String>,
    pub ignored: Vec<(String, &'static str)>,
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
    let mut t = Translation::default();
    let set = |name: &str| get(name).filter(|v| !v.is_empty());
    let truthy = |name: &str| -> Result<Option<bool>, ReferenceEnvError> {
        set(name)
            .map(|v| boolean(&v).ok_or_else(|| invalid(name, &v, "expected true or false")))
            .transpose()
    };
    let flag = |t: &mut Translation, sluice_env: &str, flag: &str, value: Option<String>| {
        // A SLUICE_* variable of the same setting wins: then clap reads that one.
        if get(sluice_env).is_some() {
            return;
        }
        t.flags.push(flag.to_owned());
        if let Some(v) = value {
            t.flags.push(v);
        }
    };

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
        let host = set(host).unwrap_or_else(|| "0.0.0.0".into());
        let port = set(port).unwrap_or_else(|| default_port.into());
        format!("{host}:{port}")
    };
    if set("GRPC_HOST").is_some() || set("GRPC_PORT").is_some() {
        let a = addr("GRPC_HOST", "GRPC_PORT", "8081");
        flag(&mut t, "SLUICE_GRPC_ADDR", "--grpc-addr", Some(a));
    }
    if set("HOST").is_some() || set("PORT").is_some() {
        let a = addr("HOST", "PORT", "8080");
        flag(&mut t, "SLUICE_HTTP_ADDR", "--http-addr", Some(a));
    }

    // TLS on the gRPC listener. The reference reads the client CA from GRPC_CLIENT_TLS_CACERT;
    // Envoy Gateway sets GRPC_SERVER_TLS_CA_CERT, meaning the same (client certificates
    // verified), so either names it.
    if truthy("GRPC_SERVER_USE_TLS")? == Some(true) {
        for (var, sluice_env, f) in [
            (
                "GRPC_SERVER_TLS_CERT",
                "SLUICE_GRPC_TLS_CERT",
                "--grpc-tls-cert",
            ),
            (
                "GRPC_SERVER_TLS_KEY",
                "SLUICE_GRPC_TLS_KEY",
                "--grpc-tls-key",
            ),
        ] {
            let path = set(var).ok_or_else(|| {
                invalid(
                    "GRPC_SERVER_USE_TLS",
                    "true",
                    "needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY",
                )
            })?;
            flag(&mut t, sluice_env, f, Some(path));
        }
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
            flag(
                &mut t,
                "SLUICE_GRPC_TLS_CLIENT_CA",
                "--grpc-tls-client-ca",
                Some(ca),
            );
            if let Some(san) = set("GRPC_CLIENT_TLS_SAN") {
                flag(
                    &mut t,
                    "SLUICE_GRPC_TLS_CLIENT_SAN",
                    "--grpc-tls-client-san",
                    Some(san),
                );
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
        xds_flags(&mut t, &set, &truthy, &flag)?;
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
    if let Some(root) = set("RUNTIME_ROOT").filter(|_| !xds) {
        let mut path = std::path::PathBuf::from(root);
        if let Some(sub) = set("RUNTIME_SUBDIRECTORY") {
            path.push(sub);
        }
        path.push(set("RUNTIME_APPDIRECTORY").unwrap_or_else(|| "config".into()));
        flag(
            &mut t,
            "SLUICE_CONFIG",
            "--config",
            Some(path.display().to_string()),
        );
    }

    // Redis.
    let redis_type = set("REDIS_TYPE").map(|v| v.to_ascii_lowercase());
    let backend = match (set("BACKEND_TYPE"), redis_type.as_deref()) {
        (_, Some("cluster")) => Some("redis-cluster"),
        (_, Some("single" | "sentinel")) | (Some(_), None) => Some("redis"),
        (_, Some(other)) => {
            return Err(invalid(
                "REDIS_TYPE",
                other,
                "expected single, cluster or sentinel",
            ));
        }
        (None, None) => set("REDIS_URL").map(|_| "redis"),
    };
    if let Some(b) = backend {
        flag(&mut t, "SLUICE_BACKEND", "--backend", Some(b.into()));
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
        flag(&mut t, "SLUICE_REDIS_URL", "--redis-url", Some(url));
    }
    if let Some(d) = set("REDIS_TIMEOUT") {
        // The reference's timeout is its dial timeout.
        let d = go_duration(&d)
            .ok_or_else(|| invalid("REDIS_TIMEOUT", &d, "expected a duration like 500ms or 10s"))?;
        flag(
            &mut t,
            "SLUICE_REDIS_CONNECT_TIMEOUT",
            "--redis-connect-timeout",
            Some(d),
        );
    }
    if let Some(p) = set("CACHE_KEY_PREFIX") {
        flag(
            &mut t,
            "SLUICE_REDIS_KEY_PREFIX",
            "--redis-key-prefix",
            Some(p),
        );
    }

    // Decisions and answers.
    for (var, sluice_env, f) in [
        ("SHADOW_MODE", "SLUICE_SHADOW_MODE", "--shadow-mode"),
        ("QUOTA_MODE", "SLUICE_QUOTA_MODE", "--quota-mode"),
        (
            "RESPONSE_DYNAMIC_METADATA",
            "SLUICE_RESPONSE_DYNAMIC_METADATA",
            "--response-dynamic-metadata",
        ),
        (
            "MERGE_DOMAIN_CONFIG",
            "SLUICE_MERGE_DOMAINS",
            "--merge-domains",
        ),
    ] {
        if truthy(var)? == Some(true) {
            flag(&mut t, sluice_env, f, None);
        }
    }
    if let Some(r) = set("NEAR_LIMIT_RATIO") {
        flag(
            &mut t,
            "SLUICE_NEAR_LIMIT_RATIO",
            "--near-limit-ratio",
            Some(r),
        );
    }
    if truthy("LIMIT_RESPONSE_HEADERS_ENABLED")? == Some(true) {
        flag(
            &mut t,
            "SLUICE_RESPONSE_HEADERS",
            "--response-headers",
            Some("ratelimit".into()),
        );
        let names = [
            ("LIMIT_LIMIT_HEADER", "RateLimit-Limit"),
            ("LIMIT_REMAINING_HEADER", "RateLimit-Remaining"),
            ("LIMIT_RESET_HEADER", "RateLimit-Reset"),
        ]
        .map(|(var, default)| set(var).unwrap_or_else(|| default.into()));
        flag(
            &mut t,
            "SLUICE_RATELIMIT_HEADER_NAMES",
            "--ratelimit-header-names",
            Some(names.join(",")),
        );
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
        flag(
            &mut t,
            "SLUICE_REFERENCE_METRICS_ADDR",
            "--reference-metrics-addr",
            Some(addr),
        );
        if let Some(path) = set("PROMETHEUS_PATH") {
            flag(
                &mut t,
                "SLUICE_REFERENCE_METRICS_PATH",
                "--reference-metrics-path",
                Some(path),
            );
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
            "json" => flag(
                &mut t,
                "SLUICE_LOG_FORMAT",
                "--log-format",
                Some("json".into()),
            ),
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

/// The xDS client's flags from the reference's CONFIG_GRPC_XDS_* variables (its defaults when
/// unset: server `localhost:18000`, node id `default`).
fn xds_flags(
    t: &mut Translation,
    set: &impl Fn(&str) -> Option<String>,
    truthy: &impl Fn(&str) -> Result<Option<bool>, ReferenceEnvError>,
    flag: &impl Fn(&mut Translation, &str, &str, Option<String>),
) -> Result<(), ReferenceEnvError> {
    let server = set("CONFIG_GRPC_XDS_SERVER_URL").unwrap_or_else(|| "localhost:18000".into());
    flag(t, "SLUICE_XDS_SERVER", "--xds-server", Some(server));
    let node = set("CONFIG_GRPC_XDS_NODE_ID").unwrap_or_else(|| "default".into());
    flag(t, "SLUICE_XDS_NODE_ID", "--xds-node-id", Some(node));
    for (var, sluice_env, f) in [
        (
            "CONFIG_GRPC_XDS_NODE_METADATA",
            "SLUICE_XDS_NODE_METADATA",
            "--xds-node-metadata",
        ),
        (
            "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
            "SLUICE_XDS_HEADERS",
            "--xds-headers",
        ),
    ] {
        if let Some(v) = set(var) {
            flag(t, sluice_env, f, Some(v));
        }
    }
    if let Some(d) = set("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL") {
        let d = go_duration(&d).ok_or_else(|| {
            invalid(
                "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
                &d,
                "expected a duration like 3s",
            )
        })?;
        flag(
            t,
            "SLUICE_XDS_RETRY_INITIAL",
            "--xds-retry-initial",
            Some(d),
        );
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
        flag(t, "SLUICE_XDS_TLS_CA", "--xds-tls-ca", Some(ca));
        match (
            set("CONFIG_GRPC_XDS_CLIENT_TLS_CERT"),
            set("CONFIG_GRPC_XDS_CLIENT_TLS_KEY"),
        ) {
            (Some(cert), Some(key)) => {
                flag(t, "SLUICE_XDS_TLS_CERT", "--xds-tls-cert", Some(cert));
                flag(t, "SLUICE_XDS_TLS_KEY", "--xds-tls-key", Some(key));
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
            flag(
                t,
                "SLUICE_XDS_TLS_SERVER_NAME",
                "--xds-tls-server-name",
                Some(san),
            );
        }
    }
    if truthy("FORCE_START_WITHOUT_INITIAL_CONFIG")? == Some(true) {
        flag(
            t,
            "SLUICE_XDS_START_WITHOUT_RULES",
            "--xds-start-without-rules",
            None,
        );
    }
    Ok(())
}

/// A Go boolean as the reference's settings parse it (`true`, `1`, `t`, any case).
fn boolean(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "t" => Some(true),
        "false" | "0" | "f" => Some(false),
        _ => None,
    }
}

/// A Go duration of one unit (`500ms`, `10s`, `2m`, `1h`) as sluice writes it.
fn go_duration(d: &str) -> Option<String> {
    let split = d.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = d.split_at(split);
    let n: u64 = n.parse().ok()?;
    let (n, unit) = match unit {
        "us" | "µs" => (n, "us"),
        "ms" => (n, "ms"),
        "s" => (n, "s"),
        "m" => (n.checked_mul(60)?, "s"),
        "h" => (n.checked_mul(3600)?, "s"),
        _ => return None,
    };
    Some(format!("{n}{unit}"))
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

    fn run(vars: &[(&str, &str)]) -> Result<Translation, ReferenceEnvError> {
        let vars: std::collections::HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        translate(|k| vars.get(k).cloned())
    }

    #[test]
    fn a_reference_deployment_becomes_serve_flags() {
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
            t.flags,
            [
                "--grpc-addr",
                "0.0.0.0:8081",
                "--http-addr",
                "0.0.0.0:8080",
                "--config",
                "/data/ratelimit/config",
                "--backend",
                "redis",
                "--redis-url",
                "redis://:secret@redis:6379",
                "--redis-connect-timeout",
                "2s",
                "--quota-mode",
                "--response-headers",
                "ratelimit",
                "--ratelimit-header-names",
                "RateLimit-Limit,RateLimit-Remaining,X-Reset",
                "--reference-metrics-addr",
                "0.0.0.0:9090",
            ]
        );
        let ignored: Vec<&str> = t.ignored.iter().map(|(v, _)| v.as_str()).collect();
        assert_eq!(ignored, ["REDIS_POOL_SIZE"]);
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
            t.flags,
            [
                "--backend",
                "redis-cluster",
                "--redis-url",
                "rediss://u:p@a:6379,rediss://u:p@b:6379"
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
        assert!(matches!(
            run(&[("SHADOW_MODE", "yes")]),
            Err(ReferenceEnvError::Invalid { .. })
        ));
        assert!(matches!(
            run(&[("REDIS_TIMEOUT", "1.5s")]),
            Err(ReferenceEnvError::Invalid { .. })
        ));
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
            t.flags,
            [
                "--backend",
                "redis",
                "--redis-url",
                "redis+sentinel://:pw@s1:26379,s2:26379/mymaster"
            ]
        );
        assert!(matches!(
            run(&[("REDIS_TYPE", "sentinel"), ("REDIS_URL", "mymaster")]),
            Err(ReferenceEnvError::Invalid { .. })
        ));
    }

    #[test]
    fn envoy_gateway_xds_becomes_the_xds_client_flags() {
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
            t.flags,
            [
                "--xds-server",
                "envoy-gateway:18001",
                "--xds-node-id",
                "envoy-ratelimit",
                "--xds-tls-ca",
                "/certs/ca.crt",
                "--xds-tls-cert",
                "/certs/tls.crt",
                "--xds-tls-key",
                "/certs/tls.key",
                "--xds-start-without-rules",
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
            t.flags,
            [
                "--xds-server",
                "localhost:18000",
                "--xds-node-id",
                "default",
                "--xds-retry-initial",
                "3s"
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
    fn envoy_gateway_tls_becomes_mutual_tls_flags() {
        let t = run(&[
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
            ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
            ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
        ])
        .unwrap();
        assert_eq!(
            t.flags,
            [
                "--grpc-tls-cert",
                "/certs/tls.crt",
                "--grpc-tls-key",
                "/certs/tls.key",
                "--grpc-tls-client-ca",
                "/certs/ca.crt"
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
            t.flags[4..],
            [
                "--grpc-tls-client-ca",
                "ca",
                "--grpc-tls-client-san",
                "envoy.internal"
            ]
        );
        let t = run(&[
            ("GRPC_SERVER_USE_TLS", "false"),
            ("GRPC_SERVER_TLS_CERT", "c"),
        ])
        .unwrap();
        assert!(t.flags.is_empty(), "{t:?}");
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

    #[test]
    fn a_sluice_variable_of_the_same_setting_wins() {
        let vars = [("GRPC_PORT", "9000"), ("SLUICE_GRPC_ADDR", "127.0.0.1:1")];
        assert!(run(&vars).unwrap().flags.is_empty());
    }
}
