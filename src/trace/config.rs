//! Whether and where spans go, from the environment: the OpenTelemetry SDK's standard variables
//! (`OTEL_*`), and when sluice runs as the reference service its `TRACING_*` variables, as
//! Envoy Gateway sets them. A pure function of the variables, so every rule is tested without
//! touching the process's environment.
//!
//! Why not let the SDK read them: it falls back silently on a value it cannot read (an unknown
//! sampler becomes "always on", a ratio of "1,0" becomes 1.0), and the exporter connects to
//! `localhost:4317` when nothing is set. Here a value that cannot be read stops the start with
//! the variable's name, and with no endpoint set nothing is exported and no connection is made.

use std::time::Duration;
use tonic::codegen::http;

/// How spans leave: OTLP over gRPC, or over HTTP with protobuf bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Grpc,
    HttpProtobuf,
}

/// Which traces are kept, as the OpenTelemetry samplers name them.
#[derive(Debug, Clone, PartialEq)]
pub enum Sampling {
    AlwaysOn,
    AlwaysOff,
    /// This share of traces, by trace id (the same decision on every node).
    Ratio(f64),
    /// Follow the caller's decision when it sent one; else the inner sampler's.
    ParentBased(Box<Sampling>),
}

/// Spans are exported, with these settings.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceConfig {
    pub protocol: Protocol,
    /// The full URL spans are sent to (for HTTP, with its `/v1/traces` path).
    pub endpoint: String,
    pub sampling: Sampling,
    /// The resource's attributes: `service.name` first.
    pub resource: Vec<(String, String)>,
    /// The most one export may take.
    pub timeout: Duration,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TraceConfigError {
    #[error("{var}={value}: {why}")]
    Invalid {
        var: &'static str,
        value: String,
        why: &'static str,
    },
}

fn invalid(var: &'static str, value: &str, why: &'static str) -> TraceConfigError {
    TraceConfigError::Invalid {
        var,
        value: value.to_owned(),
        why,
    }
}

/// What the environment read through `get` asks for: None when nothing is to be exported.
/// `reference`: sluice runs as the reference service, whose `TRACING_ENABLED` turns export on
/// (with its defaults: HTTP, service name `RateLimit`, every trace its caller samples).
pub fn from_env(
    get: impl Fn(&str) -> Option<String>,
    reference: bool,
) -> Result<Option<TraceConfig>, TraceConfigError> {
    let set = |name: &str| {
        get(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    let truthy = |name: &'static str| -> Result<Option<bool>, TraceConfigError> {
        set(name)
            .map(|v| match v.to_ascii_lowercase().as_str() {
                "true" | "1" | "t" => Ok(true),
                "false" | "0" | "f" => Ok(false),
                _ => Err(invalid(name, &v, "expected true or false")),
            })
            .transpose()
    };
    if truthy("OTEL_SDK_DISABLED")? == Some(true) {
        return Ok(None);
    }
    match set("OTEL_TRACES_EXPORTER").as_deref() {
        None | Some("otlp") => {}
        Some("none") => return Ok(None),
        Some(other) => {
            return Err(invalid(
                "OTEL_TRACES_EXPORTER",
                other,
                "sluice exports traces over OTLP only: expected otlp or none",
            ));
        }
    }
    let traces_endpoint = set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    let base_endpoint = set("OTEL_EXPORTER_OTLP_ENDPOINT");
    let enabled = if reference {
        truthy("TRACING_ENABLED")?.unwrap_or(false)
    } else {
        traces_endpoint.is_some() || base_endpoint.is_some()
    };
    if !enabled {
        return Ok(None);
    }
    let protocol = protocol(&set, reference)?;
    let endpoint = match (traces_endpoint, base_endpoint) {
        (Some(url), _) => checked_url("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &url)?,
        (None, Some(base)) => {
            let base = checked_url("OTEL_EXPORTER_OTLP_ENDPOINT", &base)?;
            match protocol {
                Protocol::Grpc => base,
                Protocol::HttpProtobuf => format!("{}/v1/traces", base.trim_end_matches('/')),
            }
        }
        (None, None) => match protocol {
            Protocol::Grpc => "http://localhost:4317".to_owned(),
            Protocol::HttpProtobuf => "http://localhost:4318/v1/traces".to_owned(),
        },
    };
    let timeout = match set("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
        .map(|v| ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", v))
        .or_else(|| set("OTEL_EXPORTER_OTLP_TIMEOUT").map(|v| ("OTEL_EXPORTER_OTLP_TIMEOUT", v)))
    {
        Some((var, v)) => match v.parse::<u64>() {
            Ok(ms) if ms > 0 => Duration::from_millis(ms),
            _ => return Err(invalid(var, &v, "expected milliseconds, more than 0")),
        },
        None => Duration::from_secs(10),
    };
    Ok(Some(TraceConfig {
        protocol,
        endpoint,
        sampling: sampling(&set, reference)?,
        resource: resource(&set, reference)?,
        timeout,
    }))
}

fn protocol(
    set: &impl Fn(&str) -> Option<String>,
    reference: bool,
) -> Result<Protocol, TraceConfigError> {
    let reference_protocol = if reference {
        set("TRACING_EXPORTER_PROTOCOL")
    } else {
        None
    };
    if let Some(p) = reference_protocol {
        return match p.to_ascii_lowercase().as_str() {
            "http" => Ok(Protocol::HttpProtobuf),
            "grpc" => Ok(Protocol::Grpc),
            _ => Err(invalid(
                "TRACING_EXPORTER_PROTOCOL",
                &p,
                "expected http or grpc",
            )),
        };
    }
    let (var, value) = match set("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") {
        Some(v) => ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", v),
        None => match set("OTEL_EXPORTER_OTLP_PROTOCOL") {
            Some(v) => ("OTEL_EXPORTER_OTLP_PROTOCOL", v),
            // The specification's default, and the reference's.
            None => return Ok(Protocol::HttpProtobuf),
        },
    };
    match value.as_str() {
        "grpc" => Ok(Protocol::Grpc),
        "http/protobuf" => Ok(Protocol::HttpProtobuf),
        "http/json" => Err(invalid(
            var,
            &value,
            "http/json is not supported: use http/protobuf or grpc",
        )),
        _ => Err(invalid(var, &value, "expected grpc or http/protobuf")),
    }
}

/// An endpoint as a URL: `host:port` alone (as the reference's examples write it) is taken as
/// `http://host:port`.
fn checked_url(var: &'static str, value: &str) -> Result<String, TraceConfigError> {
    let url = if value.contains("://") {
        value.to_owned()
    } else {
        format!("http://{value}")
    };
    let parsed: http::Uri = url
        .parse()
        .map_err(|_| invalid(var, value, "not a URL (expected http://host:port)"))?;
    match parsed.scheme_str() {
        Some("http" | "https") if parsed.host().is_some() => Ok(url),
        _ => Err(invalid(
            var,
            value,
            "expected an http:// or https:// URL with a host",
        )),
    }
}

fn sampling(
    set: &impl Fn(&str) -> Option<String>,
    reference: bool,
) -> Result<Sampling, TraceConfigError> {
    let ratio = |var: &'static str, v: &str| match v.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(invalid(var, v, "expected a number from 0 to 1")),
    };
    if reference && let Some(rate) = set("TRACING_SAMPLING_RATE") {
        let r = ratio("TRACING_SAMPLING_RATE", &rate)?;
        return Ok(Sampling::ParentBased(Box::new(Sampling::Ratio(r))));
    }
    let Some(name) = set("OTEL_TRACES_SAMPLER") else {
        return Ok(Sampling::ParentBased(Box::new(Sampling::AlwaysOn)));
    };
    let arg = || match set("OTEL_TRACES_SAMPLER_ARG") {
        Some(v) => ratio("OTEL_TRACES_SAMPLER_ARG", &v),
        // The specification's default.
        None => Ok(1.0),
    };
    let parent = |s| Sampling::ParentBased(Box::new(s));
    Ok(match name.as_str() {
        "always_on" => Sampling::AlwaysOn,
        "always_off" => Sampling::AlwaysOff,
        "traceidratio" => Sampling::Ratio(arg()?),
        "parentbased_always_on" => parent(Sampling::AlwaysOn),
        "parentbased_always_off" => parent(Sampling::AlwaysOff),
        "parentbased_traceidratio" => parent(Sampling::Ratio(arg()?)),
        _ => {
            return Err(invalid(
                "OTEL_TRACES_SAMPLER",
                &name,
                "expected always_on, always_off, traceidratio, parentbased_always_on, \
                 parentbased_always_off or parentbased_traceidratio",
            ));
        }
    })
}

/// `service.name` first, then the rest: the reference's `TRACING_SERVICE_*` win where set (as
/// they do in the reference), then `OTEL_SERVICE_NAME`, then `OTEL_RESOURCE_ATTRIBUTES`.
fn resource(
    set: &impl Fn(&str) -> Option<String>,
    reference: bool,
) -> Result<Vec<(String, String)>, TraceConfigError> {
    let mut attributes: Vec<(String, String)> = Vec::new();
    if let Some(given) = set("OTEL_RESOURCE_ATTRIBUTES") {
        for pair in given.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((k, v)) = pair.split_once('=') else {
                return Err(invalid(
                    "OTEL_RESOURCE_ATTRIBUTES",
                    &given,
                    "expected key=value pairs separated by commas",
                ));
            };
            let (k, v) = (k.trim(), percent_decoded(v.trim()));
            if k.is_empty() {
                return Err(invalid(
                    "OTEL_RESOURCE_ATTRIBUTES",
                    &given,
                    "a pair has an empty key",
                ));
            }
            put(&mut attributes, k, v);
        }
    }
    if let Some(name) = set("OTEL_SERVICE_NAME") {
        put(&mut attributes, "service.name", name);
    }
    if reference {
        let name = set("TRACING_SERVICE_NAME").unwrap_or_else(|| "RateLimit".to_owned());
        put(&mut attributes, "service.name", name);
        if let Some(ns) = set("TRACING_SERVICE_NAMESPACE") {
            put(&mut attributes, "service.namespace", ns);
        }
        if let Some(id) = set("TRACING_SERVICE_INSTANCE_ID") {
            put(&mut attributes, "service.instance.id", id);
        }
    }
    if !attributes.iter().any(|(k, _)| k == "service.name") {
        put(&mut attributes, "service.name", "sluice".to_owned());
    }
    put(
        &mut attributes,
        "service.version",
        env!("CARGO_PKG_VERSION").to_owned(),
    );
    attributes.sort_by_key(|(k, _)| k != "service.name");
    Ok(attributes)
}

fn put(attributes: &mut Vec<(String, String)>, key: &str, value: String) {
    match attributes.iter_mut().find(|(k, _)| k == key) {
        Some(kv) => kv.1 = value,
        None => attributes.push((key.to_owned(), value)),
    }
}

/// `%XX` escapes decoded (the specification's encoding of a value's commas and equals signs); a
/// malformed escape is kept as written.
fn percent_decoded(v: &str) -> String {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(
        vars: &[(&str, &str)],
        reference: bool,
    ) -> Result<Option<TraceConfig>, TraceConfigError> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        from_env(
            |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()),
            reference,
        )
    }

    fn on(vars: &[(&str, &str)], reference: bool) -> TraceConfig {
        read(vars, reference).unwrap().expect("export is on")
    }

    fn service(c: &TraceConfig, key: &str) -> Option<String> {
        c.resource
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    #[test]
    fn with_no_endpoint_nothing_is_exported() {
        assert_eq!(read(&[], false), Ok(None));
        assert_eq!(read(&[("OTEL_SERVICE_NAME", "x")], false), Ok(None));
        // As the reference: off unless TRACING_ENABLED, whatever else is set.
        assert_eq!(
            read(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")], true),
            Ok(None)
        );
        let off = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_SDK_DISABLED", "true"),
        ];
        assert_eq!(read(&off, false), Ok(None));
        let none = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ];
        assert_eq!(read(&none, false), Ok(None));
    }

    #[test]
    fn endpoints_follow_the_specification() {
        let c = on(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/")], false);
        assert_eq!(c.protocol, Protocol::HttpProtobuf);
        assert_eq!(c.endpoint, "http://c:4318/v1/traces");
        let c = on(
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ],
            false,
        );
        assert_eq!(
            (c.protocol, c.endpoint.as_str()),
            (Protocol::Grpc, "http://c:4317")
        );
        // The traces endpoint is taken as it is, and wins.
        let c = on(
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "https://t:443/custom"),
            ],
            false,
        );
        assert_eq!(c.endpoint, "https://t:443/custom");
        // host:port alone, as the reference's examples write it.
        let c = on(
            &[
                ("TRACING_ENABLED", "true"),
                ("TRACING_EXPORTER_PROTOCOL", "grpc"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "127.0.0.1:26000"),
            ],
            true,
        );
        assert_eq!(
            (c.protocol, c.endpoint.as_str()),
            (Protocol::Grpc, "http://127.0.0.1:26000")
        );
        // The reference's defaults: HTTP to the local collector.
        let c = on(&[("TRACING_ENABLED", "true")], true);
        assert_eq!(c.endpoint, "http://localhost:4318/v1/traces");
        assert_eq!(c.timeout, Duration::from_secs(10));
    }

    #[test]
    fn the_reference_variables_as_envoy_gateway_sets_them() {
        let c = on(
            &[
                ("TRACING_ENABLED", "true"),
                ("TRACING_SERVICE_NAME", "envoy-ratelimit"),
                ("TRACING_SERVICE_NAMESPACE", "envoy-gateway-system"),
                ("TRACING_SERVICE_INSTANCE_ID", "pod-1"),
                ("TRACING_SAMPLING_RATE", "0.25"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel-collector:4318"),
                ("OTEL_SERVICE_NAME", "ignored-as-the-reference-does"),
            ],
            true,
        );
        assert_eq!(
            c.resource[0],
            ("service.name".into(), "envoy-ratelimit".into())
        );
        assert_eq!(
            service(&c, "service.namespace").as_deref(),
            Some("envoy-gateway-system")
        );
        assert_eq!(service(&c, "service.instance.id").as_deref(), Some("pod-1"));
        assert_eq!(
            c.sampling,
            Sampling::ParentBased(Box::new(Sampling::Ratio(0.25)))
        );
        assert_eq!(c.endpoint, "http://otel-collector:4318/v1/traces");
        let c = on(&[("TRACING_ENABLED", "true")], true);
        assert_eq!(service(&c, "service.name").as_deref(), Some("RateLimit"));
        assert_eq!(
            c.sampling,
            Sampling::ParentBased(Box::new(Sampling::AlwaysOn))
        );
    }

    #[test]
    fn samplers_and_resources_read_as_the_sdk_names_them() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318");
        let c = on(&[endpoint], false);
        assert_eq!(
            c.sampling,
            Sampling::ParentBased(Box::new(Sampling::AlwaysOn))
        );
        assert_eq!(service(&c, "service.name").as_deref(), Some("sluice"));
        let c = on(
            &[
                endpoint,
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.01"),
                (
                    "OTEL_RESOURCE_ATTRIBUTES",
                    "service.name=a, deployment.environment=prod%2Ceu",
                ),
            ],
            false,
        );
        assert_eq!(
            c.sampling,
            Sampling::ParentBased(Box::new(Sampling::Ratio(0.01)))
        );
        assert_eq!(service(&c, "service.name").as_deref(), Some("a"));
        assert_eq!(
            service(&c, "deployment.environment").as_deref(),
            Some("prod,eu")
        );
        let c = on(&[endpoint, ("OTEL_TRACES_SAMPLER", "always_off")], false);
        assert_eq!(c.sampling, Sampling::AlwaysOff);
        let c = on(
            &[
                endpoint,
                ("OTEL_SERVICE_NAME", "b"),
                ("OTEL_RESOURCE_ATTRIBUTES", "service.name=a"),
            ],
            false,
        );
        assert_eq!(service(&c, "service.name").as_deref(), Some("b"));
    }

    #[test]
    fn a_value_that_cannot_be_read_names_its_variable() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318");
        let var = |vars: &[(&str, &str)], reference| match read(vars, reference) {
            Err(TraceConfigError::Invalid { var, .. }) => var,
            other => panic!("{vars:?}: {other:?}"),
        };
        assert_eq!(
            var(&[endpoint, ("OTEL_TRACES_SAMPLER", "sometimes")], false),
            "OTEL_TRACES_SAMPLER"
        );
        assert_eq!(
            var(
                &[
                    endpoint,
                    ("OTEL_TRACES_SAMPLER", "traceidratio"),
                    ("OTEL_TRACES_SAMPLER_ARG", "1,0")
                ],
                false
            ),
            "OTEL_TRACES_SAMPLER_ARG"
        );
        assert_eq!(
            var(
                &[endpoint, ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")],
                false
            ),
            "OTEL_EXPORTER_OTLP_PROTOCOL"
        );
        assert_eq!(
            var(&[endpoint, ("OTEL_TRACES_EXPORTER", "zipkin")], false),
            "OTEL_TRACES_EXPORTER"
        );
        assert_eq!(
            var(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://c")], false),
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        );
        assert_eq!(
            var(&[endpoint, ("OTEL_RESOURCE_ATTRIBUTES", "novalue")], false),
            "OTEL_RESOURCE_ATTRIBUTES"
        );
        assert_eq!(
            var(&[endpoint, ("OTEL_EXPORTER_OTLP_TIMEOUT", "0")], false),
            "OTEL_EXPORTER_OTLP_TIMEOUT"
        );
        assert_eq!(var(&[("TRACING_ENABLED", "yes")], true), "TRACING_ENABLED");
        assert_eq!(
            var(
                &[("TRACING_ENABLED", "true"), ("TRACING_SAMPLING_RATE", "2")],
                true
            ),
            "TRACING_SAMPLING_RATE"
        );
        assert_eq!(
            var(
                &[
                    ("TRACING_ENABLED", "true"),
                    ("TRACING_EXPORTER_PROTOCOL", "udp")
                ],
                true
            ),
            "TRACING_EXPORTER_PROTOCOL"
        );
    }
}
