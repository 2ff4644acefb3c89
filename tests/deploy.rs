//! Everything under deploy/ and the packaging files: Envoy configs pass the real Envoy's
//! validation, manifests parse and carry what production needs, the Grafana dashboard queries
//! only metrics that /metrics has, and the compose file points at files that exist.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use sluice::engine::EngineSettings;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn documents(path: &Path) -> Vec<serde_yaml::Value> {
    use serde::Deserialize;
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| {
            serde_yaml::Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        })
        .collect()
}

#[test]
fn envoy_configs_pass_envoy_validation() {
    let envoy = venv_tool("SLUICE_ENVOY", "envoy");
    let dir = root().join("deploy/envoy");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let out = std::process::Command::new(&envoy)
            .args(["--mode", "validate", "-c"])
            .arg(&path)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("OK"),
            "{}: {text}{}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        checked += 1;
    }
    assert!(checked >= 2);
}

#[test]
fn kubernetes_manifests_parse_and_are_production_shaped() {
    let docs = documents(&root().join("deploy/kubernetes/base/sluice.yaml"));
    let kind = |k: &str| {
        docs.iter()
            .find(|d| d["kind"] == k)
            .unwrap_or_else(|| panic!("no {k}"))
    };
    for d in &docs {
        assert!(
            d["apiVersion"].is_string() && d["metadata"]["name"].is_string(),
            "{d:?}"
        );
    }
    let deployment = kind("Deployment");
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let container = &pod["containers"][0];
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/livez");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert!(container["resources"]["requests"]["cpu"].is_string());
    let service = kind("Service");
    let grpc = service["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|p| p["port"] == 8081)
        .unwrap();
    assert_eq!(grpc["appProtocol"], "grpc");
    assert!(kind("PodDisruptionBudget")["spec"]["minAvailable"].is_number());
    // The rules in the ConfigMap load.
    let data = kind("ConfigMap")["data"].as_mapping().unwrap();
    let files: Vec<(String, String)> = data
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().unwrap().to_owned(),
                v.as_str().unwrap().to_owned(),
            )
        })
        .collect();
    sluice::rules::load_texts(files.iter().map(|(k, v)| (k.as_str(), v.as_str()))).unwrap();
}

/// The compose file passes Compose's own schema check (`docker-compose config`, no daemon
/// needed): a misspelled or misplaced key fails here, not on an operator's `docker compose up`.
#[test]
fn compose_file_passes_the_compose_schema() {
    let tool = std::env::var("SLUICE_DOCKER_COMPOSE").unwrap_or_else(|_| "docker-compose".into());
    let out = std::process::Command::new(&tool)
        .arg("-f")
        .arg(root().join("docker-compose.yml"))
        .args(["config", "-q"])
        .output()
        .unwrap_or_else(|e| {
            panic!("{tool}: {e} (apt-get install docker-compose, or set SLUICE_DOCKER_COMPOSE)")
        });
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `kubectl kustomize DIR`: the manifests an operator's `kubectl apply -k DIR` sends.
fn kustomize(dir: &str) -> String {
    let kubectl = std::env::var("SLUICE_KUBECTL").unwrap_or_else(|_| "kubectl".into());
    let out = std::process::Command::new(&kubectl)
        .arg("kustomize")
        .arg(root().join(dir))
        .output()
        .unwrap_or_else(|e| panic!("{kubectl}: {e} (install kubectl, or set SLUICE_KUBECTL)"));
    assert!(
        out.status.success(),
        "kubectl kustomize {dir}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn kustomize_base_and_overlay_build_and_validate_against_the_kubernetes_schemas() {
    let validate = venv_tool("SLUICE_KUBERNETES_VALIDATE", "kubernetes-validate");
    let dir = temp_dir("kustomize");
    for (name, built) in [
        ("base", kustomize("deploy/kubernetes/base")),
        (
            "redis-cluster",
            kustomize("deploy/kubernetes/overlays/redis-cluster"),
        ),
    ] {
        let file = dir.join(format!("{name}.yaml"));
        std::fs::write(&file, &built).unwrap();
        let out = std::process::Command::new(&validate)
            .arg("--strict")
            .arg(&file)
            .output()
            .expect("kubernetes-validate runs");
        let report = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && !report.contains("ERROR"),
            "{name}: {report}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(report.matches("passed").count() >= 5, "{name}: {report}");
    }
    // The overlay switches the backend: one SLUICE_BACKEND, redis-cluster, the URL from the Secret.
    let overlay: Vec<serde_yaml::Value> = {
        use serde::Deserialize;
        let text = std::fs::read_to_string(dir.join("redis-cluster.yaml")).unwrap();
        serde_yaml::Deserializer::from_str(&text)
            .map(|d| serde_yaml::Value::deserialize(d).unwrap())
            .collect()
    };
    let deployment = overlay.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_sequence()
        .unwrap();
    let backends: Vec<_> = env
        .iter()
        .filter(|e| e["name"] == "SLUICE_BACKEND")
        .collect();
    assert_eq!(backends.len(), 1, "{env:?}");
    assert_eq!(backends[0]["value"], "redis-cluster");
    let url = env
        .iter()
        .find(|e| e["name"] == "SLUICE_REDIS_URL")
        .unwrap();
    assert_eq!(url["valueFrom"]["secretKeyRef"]["name"], "sluice-redis");
    assert!(overlay.iter().any(|d| d["kind"] == "Secret"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn envoy_gateway_runs_sluice_by_its_image_alone() {
    let docs = documents(&root().join("deploy/envoy-gateway/envoy-gateway-config.yaml"));
    assert_eq!(docs.len(), 1);
    assert_eq!(docs[0]["kind"], "ConfigMap");
    assert_eq!(docs[0]["metadata"]["namespace"], "envoy-gateway-system");
    let embedded = docs[0]["data"]["envoy-gateway.yaml"].as_str().unwrap();
    let config: serde_yaml::Value = serde_yaml::from_str(embedded).unwrap();
    assert_eq!(config["kind"], "EnvoyGateway");
    let image = &config["provider"]["kubernetes"]["rateLimitDeployment"]["container"]["image"];
    assert!(image.as_str().unwrap().contains("sluice"), "{image:?}");
    // Global rate limiting is on only with a backend configured.
    assert_eq!(config["rateLimit"]["backend"]["type"], "Redis");
    // The image offers the command Envoy Gateway runs.
    let dockerfile = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    assert!(dockerfile.contains("/bin/ratelimit"));
}

#[test]
fn istio_envoyfilters_wire_the_gateway_to_sluice() {
    let docs = documents(&root().join("deploy/istio/envoyfilter.yaml"));
    assert_eq!(docs.len(), 2);
    assert!(docs.iter().all(|d| d["kind"] == "EnvoyFilter"));
    let filter = &docs[0]["spec"]["configPatches"][0]["patch"]["value"]["typed_config"];
    assert_eq!(filter["domain"], "api");
    assert_eq!(
        filter["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"],
        "outbound|8081||sluice.sluice.svc.cluster.local"
    );
    // The route actions reach plain HTTP and HTTPS gateways alike.
    let vhosts: Vec<&str> = docs[1]["spec"]["configPatches"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| {
            p["match"]["routeConfiguration"]["vhost"]["name"]
                .as_str()
                .unwrap()
        })
        .collect();
    assert_eq!(vhosts, ["*:80", "*:443"]);
}

#[test]
fn compose_and_dockerfile_point_at_real_files() {
    let compose = &documents(&root().join("docker-compose.yml"))[0];
    for (name, service) in compose["services"].as_mapping().unwrap() {
        for volume in service["volumes"].as_sequence().into_iter().flatten() {
            let source = volume.as_str().unwrap().split(':').next().unwrap();
            assert!(
                root().join(source).exists(),
                "{name:?}: {source} is missing"
            );
        }
    }
    let dockerfile = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    for needed in [
        "AS build",
        "USER 10001",
        "EXPOSE 8081 8080",
        "HEALTHCHECK",
        "sluice\", \"probe",
    ] {
        assert!(dockerfile.contains(needed), "Dockerfile lacks {needed}");
    }
}

const RULES: &str = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n  - key: s\n    shadow_mode: true\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";

#[tokio::test]
async fn every_metric_the_dashboard_queries_exists() {
    let server = start(RULES, "none", EngineSettings::default()).await;
    let mut client = server.client().await;
    // Traffic that touches every per-rule counter the dashboard shows.
    for key in ["k", "k", "k", "s", "s"] {
        let _ = client
            .should_rate_limit(request("d", vec![descriptor(&[(key, "v")])]))
            .await;
    }
    let metrics = http_get(server.running.http_addr, "/metrics").await.1;
    let dashboard =
        std::fs::read_to_string(root().join("deploy/grafana/sluice-dashboard.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    let mut queried = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(i) = rest.find("sluice_") {
                let name: String = rest[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[i + name.len()..];
                queried.push(name);
            }
        }
    }
    assert!(queried.len() >= 12, "{queried:?}");
    for name in queried {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with(&name) && l[name.len()..].starts_with(['{', ' '])),
            "the dashboard queries {name}, which /metrics lacks:\n{metrics}"
        );
    }
    // The container health check speaks to the same server (async: the server runs on this
    // test's runtime).
    let probe = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        // A failed test must not leave a server holding the test runner's output open.
        .kill_on_drop(true)
        .args([
            "probe",
            "--http-addr",
            &server.running.http_addr.to_string(),
        ])
        .status()
        .await
        .unwrap();
    assert!(probe.success());
    let http = server.running.http_addr.to_string();
    server.running.stop().await.unwrap();
    let probe = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["probe", "--http-addr", &http])
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!probe.success(), "nothing listens after stop");
}

/// The Istio RLQS filter patch is a filter the real Envoy accepts: it is put in a bootstrap with
/// the cluster Istio would give sluice, and validated.
#[test]
fn the_istio_rlqs_filter_passes_envoy_validation() {
    let docs = documents(&root().join("deploy/istio/envoyfilter-rlqs.yaml"));
    assert_eq!(docs.len(), 1);
    let patch = &docs[0]["spec"]["configPatches"][0];
    assert_eq!(patch["patch"]["operation"], "INSERT_BEFORE");
    let filter = serde_yaml::to_string(&patch["patch"]["value"]).unwrap();
    let cluster = "outbound|8081||sluice.sluice.svc.cluster.local";
    let indented: String = filter
        .lines()
        .map(|l| format!("            {l}\n"))
        .collect();
    let bootstrap = format!(
        r#"
static_resources:
  listeners:
  - name: gateway
    address: {{socket_address: {{address: 127.0.0.1, port_value: 10000}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config: {{virtual_hosts: [{{name: all, domains: ["*"], routes: [{{match: {{prefix: "/"}}, direct_response: {{status: 200}}}}]}}]}}
          http_filters:
          - {filter_start}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: "{cluster}"
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: "{cluster}"
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: 8081}}}}}}}}]}}]
"#,
        filter_start = indented.trim_start()
    );
    let dir = common::temp_dir("istio-rlqs");
    let path = dir.join("envoy.yaml");
    std::fs::write(&path, bootstrap).unwrap();
    let out = std::process::Command::new(venv_tool("SLUICE_ENVOY", "envoy"))
        .args(["--mode", "validate", "-c"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
