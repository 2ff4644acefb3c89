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
    let docs = documents(&root().join("deploy/kubernetes/sluice.yaml"));
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
    assert_eq!(
        container["livenessProbe"]["httpGet"]["path"],
        "/healthcheck"
    );
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
    for d in documents(&root().join("deploy/kubernetes/redis-cluster.yaml")) {
        assert!(d["kind"].is_string(), "{d:?}");
    }
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
