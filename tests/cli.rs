//! The `sluice` binary: `validate` output and exit codes, and `serve` start-up and SIGTERM.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

fn sluice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
}

#[test]
fn validate_accepts_the_sample_rules() {
    let out = sluice()
        .args(["validate", concat!(env!("CARGO_MANIFEST_DIR"), "/config")])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "ok: 3 domains, 20 rules\n"
    );
}

#[test]
fn validate_prints_every_error_and_exits_1() {
    let dir = common::temp_dir("validate");
    std::fs::write(
        dir.join("a.yaml"),
        "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight}\n  - key: k\n    rate_limit: {unit: second}\n",
    )
    .unwrap();
    std::fs::write(dir.join("b.yaml"), "domain: a\n").unwrap();
    let out = sluice().arg("validate").arg(&dir).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let a = dir.join("a.yaml").display().to_string();
    let b = dir.join("b.yaml").display().to_string();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!(
            "{a}: descriptors[0].rate_limit.unit: invalid rate limit unit 'fortnight'\n\
             {a}: descriptors[1]: duplicate descriptor composite key 'a.k'\n\
             {b}: domain: duplicate domain 'a' in config file\n"
        )
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn serve_refuses_invalid_rules_with_the_reason() {
    let dir = common::temp_dir("serve-bad");
    std::fs::write(
        dir.join("a.yaml"),
        "domain: a\ndescriptors:\n  - value: v\n",
    )
    .unwrap();
    let out = sluice()
        .arg("serve")
        .arg("--config")
        .arg(&dir)
        .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("descriptors[0]: descriptor has empty key"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn serve_without_rules_says_where_it_looked() {
    let dir = common::temp_dir("no-config");
    let out = sluice()
        .current_dir(&dir)
        .args([
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
        ])
        .env_remove("SLUICE_CONFIG")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no rules at config/"), "{err}");
    assert!(
        err.contains(&dir.join("config/").display().to_string()),
        "{err}"
    );
    assert!(err.contains("--config"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn serve_refuses_bad_header_names_with_the_reason() {
    for (names, reason) in [
        ("a,b", "takes three comma-separated names"),
        ("a,b c,d", "'b c' is not a header name"),
    ] {
        let out = sluice()
            .args(["serve", "--config", "config"])
            .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
            .args(["--response-headers", "ratelimit"])
            .args(["--ratelimit-header-names", names])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{names}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(reason), "{names}: {err}");
    }
}

#[test]
fn serve_refuses_unreadable_tls_files_with_the_path() {
    let out = sluice()
        .args(["serve", "--config", "config"])
        .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args(["--grpc-tls-cert", "/nonexistent/tls.crt"])
        .args(["--grpc-tls-key", "/nonexistent/tls.key"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("reading /nonexistent/tls.crt"), "{err}");
    // A certificate without its key is a usage error.
    let out = sluice()
        .args(["serve", "--grpc-tls-cert", "/nonexistent/tls.crt"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--grpc-tls-key"));
}

/// `sluice serve` on `config`, HTTP on `http`, gRPC anywhere, with `extra` flags.
fn serve(config: &std::path::Path, http: u16, extra: &[&str]) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        // A failed test must not leave a server holding the test runner's output open.
        .kill_on_drop(true)
        .args(["serve", "--grpc-addr", "127.0.0.1:0"])
        .arg("--config")
        .arg(config)
        .arg("--http-addr")
        .arg(format!("127.0.0.1:{http}"))
        .args(extra)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

fn terminate(pid: &str) {
    let kill = Command::new("kill").args(["-TERM", pid]).status().unwrap();
    assert!(kill.success(), "kill -TERM {pid}");
}

/// Waits (bounded) until `/readyz` answers 503: the drain has begun.
async fn wait_unready(addr: std::net::SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while common::http_get(addr, "/readyz").await.0 != 503 {
        assert!(
            Instant::now() < deadline,
            "readiness did not fail on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// SIGTERM starts the drain: health says the node is going, calls are still answered until
/// `--drain-delay` ends, then the graceful stop, exit 0.
#[tokio::test]
async fn serve_drains_then_exits_0_on_sigterm() {
    let http = common::free_port();
    let grpc = common::free_port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        // A failed test must not leave a server holding the test runner's output open.
        .kill_on_drop(true)
        .arg("serve")
        .env(
            "SLUICE_CONFIG",
            concat!(env!("CARGO_MANIFEST_DIR"), "/config"),
        )
        .env("SLUICE_GRPC_ADDR", format!("127.0.0.1:{grpc}"))
        .env("SLUICE_HTTP_ADDR", format!("127.0.0.1:{http}"))
        .env("SLUICE_LOG_FORMAT", "json")
        .env("SLUICE_DRAIN_DELAY", "2s")
        .env("SLUICE_JSON_ENDPOINT", "true")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let addr = format!("127.0.0.1:{http}").parse().unwrap();
    common::wait_healthy(addr).await;
    let body = r#"{"domain":"edge","descriptors":[{"entries":[{"key":"remote_address","value":"203.0.113.9"}]}]}"#;
    assert_eq!(common::http_post(addr, "/json", body).await.0, 429);

    let pid = child.id().unwrap().to_string();
    let terminated = Instant::now();
    terminate(&pid);
    // Draining: readiness fails at once, calls are still answered.
    wait_unready(addr).await;
    assert_eq!(common::http_post(addr, "/json", body).await.0, 429);
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(
        terminated.elapsed() >= Duration::from_secs(2),
        "stopped before the drain delay ended"
    );
    let mut stderr = String::new();
    use tokio::io::AsyncReadExt;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .await
        .unwrap();
    assert!(stderr.contains("draining"), "{stderr}");
    assert!(stderr.contains("\"message\":\"stopped\""), "{stderr}");
}

/// A second SIGTERM during a long drain stops the node now (an operator who means it).
#[tokio::test]
async fn a_second_sigterm_ends_the_drain() {
    let http = common::free_port();
    let config = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/config"));
    let mut child = serve(config, http, &["--drain-delay", "60s"]);
    let addr = format!("127.0.0.1:{http}").parse().unwrap();
    common::wait_healthy(addr).await;
    let pid = child.id().unwrap().to_string();
    terminate(&pid);
    wait_unready(addr).await;
    terminate(&pid);
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .expect("the second SIGTERM ended the 60 s drain")
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

#[tokio::test]
async fn sighup_reloads_even_without_watching() {
    let dir = common::temp_dir("sighup");
    std::fs::write(dir.join("a.yaml"), "domain: a\n").unwrap();
    let http = common::free_port();
    let mut child = serve(&dir, http, &["--watch", "false", "--drain-delay", "0s"]);
    let addr = format!("127.0.0.1:{http}").parse().unwrap();
    common::wait_listening(addr).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    std::fs::write(
        dir.join("a.yaml"),
        "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 3}\n",
    )
    .unwrap();
    // Not watching: nothing changes until SIGHUP.
    assert_eq!(common::http_get(addr, "/rlconfig").await.1, "");
    let pid = child.id().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success()
    );
    loop {
        let (_, body) = common::http_get(addr, "/rlconfig").await;
        if body.contains("a.k: unit=SECOND requests_per_unit=3") {
            break;
        }
        assert!(Instant::now() < deadline, "SIGHUP did not reload: {body:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    assert_eq!(child.wait().await.unwrap().code(), Some(0));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Once the server on `http` is healthy, an RLS client of its gRPC port.
async fn healthy_client(
    http: u16,
    grpc: u16,
) -> sluice::proto::RateLimitServiceClient<tonic::transport::Channel> {
    common::wait_healthy(format!("127.0.0.1:{http}").parse().unwrap()).await;
    sluice::proto::RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
        .await
        .unwrap()
}

#[tokio::test]
async fn as_ratelimit_it_serves_from_the_references_environment() {
    let dir = common::temp_dir("as-reference");
    // RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/config/, as the reference reads its rules.
    let rules = dir.join("runtime/ratelimit/config");
    std::fs::create_dir_all(&rules).unwrap();
    std::fs::write(
        rules.join("a.yaml"),
        "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    )
    .unwrap();
    let (http, grpc) = (common::free_port(), common::free_port());
    let mut child = common::as_reference_on(&dir, http, grpc)
        .env("RUNTIME_WATCH_ROOT", "false")
        .env("LOG_LEVEL", "info")
        .env("SHADOW_MODE", "true")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut client = healthy_client(http, grpc).await;
    let http_addr = format!("127.0.0.1:{http}").parse().unwrap();
    let (_, config) = common::http_get(http_addr, "/rlconfig").await;
    assert!(
        config.contains("a.k: unit=SECOND requests_per_unit=1"),
        "{config}"
    );
    // SHADOW_MODE=true: over the limit, still OK overall.
    for _ in 0..2 {
        let r = client
            .should_rate_limit(common::request(
                "a",
                vec![common::descriptor(&[("k", "v")])],
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code, sluice::proto::Code::Ok as i32);
    }
    child.start_kill().unwrap();
    let _ = child.wait().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A reference variable fills a setting only where neither the command line nor the setting's
/// `SLUICE_*` variable gave it: GRPC_PORT loses to SLUICE_GRPC_ADDR, PORT to `--http-addr`, and
/// SHADOW_MODE (given by nothing else) holds.
#[tokio::test]
async fn as_ratelimit_its_own_settings_win_over_the_references() {
    let dir = common::temp_dir("as-reference-precedence");
    let (http, grpc, unused) = (
        common::free_port(),
        common::free_port(),
        common::free_port(),
    );
    let mut child = common::as_reference(&dir)
        .args(["serve", "--http-addr", &format!("127.0.0.1:{http}")])
        .env("PORT", unused.to_string())
        .env("GRPC_PORT", unused.to_string())
        .env("SLUICE_GRPC_ADDR", format!("127.0.0.1:{grpc}"))
        .env("RUNTIME_ROOT", concat!(env!("CARGO_MANIFEST_DIR"), "/"))
        .env("SHADOW_MODE", "true")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut client = healthy_client(http, grpc).await;
    // config/edge.yaml allows 5 a second here; shadow mode answers OK past it.
    for _ in 0..7 {
        let search = common::descriptor(&[("api_key", "abc"), ("path", "/v1/search/x")]);
        let r = client
            .should_rate_limit(common::request("edge", vec![search]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code, sluice::proto::Code::Ok as i32);
    }
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", unused)).is_err(),
        "nothing listens on the reference's ports"
    );
    child.start_kill().unwrap();
    let _ = child.wait().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn as_ratelimit_it_refuses_what_it_cannot_do_by_name() {
    let dir = common::temp_dir("as-reference-refused");
    let out = common::as_reference(&dir)
        .env("BACKEND_TYPE", "memcache")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("BACKEND_TYPE=memcache: memcache is not supported"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// As the reference service, a node whose Redis it has never reached is not healthy: every
/// probe (`/healthcheck`, which Envoy Gateway uses for liveness, readiness and start-up, and
/// `/readyz`) fails with the reason, and passes once Redis answers.
#[tokio::test]
async fn unhealthy_until_redis_is_reached() {
    let mut redis = common::redis::RedisServer::start();
    redis.kill();
    let http = common::free_port();
    let url = redis.url();
    let _child = serve(
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/config")),
        http,
        &[
            "--backend",
            "redis",
            "--redis-url",
            &url,
            "--redis-connect-timeout",
            "200ms",
        ],
    );
    let addr: std::net::SocketAddr = format!("127.0.0.1:{http}").parse().unwrap();
    common::wait_listening(addr).await;
    let (status, body) = common::http_get(addr, "/healthcheck").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("backend has not been reached"), "{body}");
    assert_eq!(common::http_get(addr, "/readyz").await.0, 503);
    assert_eq!(
        common::http_get(addr, "/livez").await.0,
        200,
        "alive all the same: a restart would not bring Redis back"
    );

    redis.restart();
    common::wait_healthy(addr).await;
    assert_eq!(common::http_get(addr, "/readyz").await.0, 200);
}

/// `sluice serve` on `rules` (domain `a`) with `extra` flags, once `hits` calls for `k=value`
/// were made: the server and its HTTP port.
async fn serve_after_hits(
    name: &str,
    rules: &str,
    extra: &[&str],
    value: &str,
    hits: usize,
) -> (tokio::process::Child, u16) {
    let dir = common::temp_dir(name);
    std::fs::write(dir.join("a.yaml"), rules).unwrap();
    let (http, grpc) = (common::free_port(), common::free_port());
    let grpc_addr = format!("127.0.0.1:{grpc}");
    let mut flags = vec!["--grpc-addr", &grpc_addr, "--drain-delay", "0s"];
    flags.extend_from_slice(extra);
    let child = serve(&dir, http, &flags);
    let mut client = healthy_client(http, grpc).await;
    for _ in 0..hits {
        client
            .should_rate_limit(common::request(
                "a",
                vec![common::descriptor(&[("k", value)])],
            ))
            .await
            .unwrap();
    }
    (child, http)
}

#[tokio::test]
async fn inspect_prints_what_each_limit_has_left_without_spending() {
    let rules = "domain: a\ndescriptors:\n  - key: k\n    rate_limits:\n      - {unit: hour, requests_per_unit: 5, name: hourly}\n      - {unit: day, requests_per_unit: 50, name: daily}\n";
    let (_child, http) = serve_after_hits("inspect", rules, &[], "secret-key-1", 2).await;
    let inspect = || {
        sluice()
            .args(["inspect", "--http-addr", &format!("127.0.0.1:{http}")])
            .args(["--domain", "a", "--descriptor", "k=secret-key-1"])
            .output()
            .unwrap()
    };
    let first = inspect();
    let table = String::from_utf8_lossy(&first.stdout).into_owned();
    assert!(
        first.status.success(),
        "{table}{}",
        String::from_utf8_lossy(&first.stderr)
    );
    // The value is masked; each limit shows used and remaining.
    assert!(
        table.contains("k=secr…#") && !table.contains("secret-key-1"),
        "{table}"
    );
    let row = |name: &str| {
        table
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no {name} row in {table}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert_eq!(row("hourly")[2..5], ["5/hour", "2", "3"]);
    assert_eq!(row("daily")[2..5], ["50/day", "2", "48"]);
    // Looking spent nothing (the reset column moves on with the real clock).
    let again = String::from_utf8_lossy(&inspect().stdout).into_owned();
    let used = |table: &str| -> Vec<Vec<String>> {
        table
            .lines()
            .map(|l| l.split_whitespace().take(5).map(str::to_owned).collect())
            .collect()
    };
    assert_eq!(used(&again), used(&table), "{again}");
    // A domain that is not configured: the reason, and a failure.
    let out = sluice()
        .args(["inspect", "--http-addr", &format!("127.0.0.1:{http}")])
        .args(["--domain", "nope", "--descriptor", "k=v"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("domain 'nope' is not configured"));
}

#[tokio::test]
async fn top_prints_who_is_limited() {
    let rules =
        "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
    let (_child, http) =
        serve_after_hits("top", rules, &["--show-descriptor-values"], "noisy", 4).await;
    let out = sluice()
        .args(["top", "--once", "--http-addr", &format!("127.0.0.1:{http}")])
        .output()
        .unwrap();
    let view = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{view}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(view.contains("a / k"), "{view}");
    // Shown whole (--show-descriptor-values): three of the four were denied.
    let row = view
        .lines()
        .find(|l| l.ends_with("k=noisy"))
        .unwrap_or_else(|| panic!("{view}"));
    assert_eq!(row.split_whitespace().next(), Some("3"), "{view}");
}
