//! Rules over xDS, end to end: the real `sluice` binary subscribes to an ADS management server
//! that the test runs (tests/common/xds.rs), applies and ACKs good pushes, NACKs bad ones while
//! the old rules keep deciding, reconnects after the server dies, and waits for the first
//! rules unless told to start without them.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::xds::{MutualTls, XdsServer};
use common::*;
use sluice::proto::envoy::service::discovery::v3::DiscoveryRequest;
use sluice::proto::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use sluice::proto::{Code, RateLimitServiceClient};

/// `domain` limiting `key=value` to `n` a minute.
fn config(domain: &str, key: &str, value: &str, n: u32, unit: RateLimitUnit) -> RateLimitConfig {
    RateLimitConfig {
        name: domain.into(),
        domain: domain.into(),
        descriptors: vec![RateLimitDescriptor {
            key: key.into(),
            value: value.into(),
            rate_limit: Some(RateLimitPolicy {
                unit: unit as i32,
                requests_per_unit: n,
                ..RateLimitPolicy::default()
            }),
            ..RateLimitDescriptor::default()
        }],
    }
}

/// The real binary on free loopback ports, its rules from `xds`.
struct Sluice {
    /// Killed when dropped.
    _child: tokio::process::Child,
    grpc: SocketAddr,
    http: SocketAddr,
}

impl Sluice {
    fn spawn(xds: &XdsServer, extra: &[&str]) -> Self {
        let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("serve")
            .args(["--grpc-addr", &grpc.to_string()])
            .args(["--http-addr", &http.to_string()])
            .args(["--xds-server", &xds.addr.to_string()])
            .args([
                "--xds-node-id",
                "test-node",
                "--xds-node-metadata",
                "zone=a",
            ])
            // Quick reconnects: the test kills the server and waits for the client to return.
            .args(["--xds-retry-initial", "50ms", "--xds-retry-max", "200ms"])
            .args(["--drain-delay", "0s"])
            .args(extra)
            .kill_on_drop(true)
            .spawn()
            .expect("sluice starts");
        Self {
            _child: child,
            grpc,
            http,
        }
    }

    async fn client(&self) -> RateLimitServiceClient<tonic::transport::Channel> {
        wait_healthy(self.http).await;
        RateLimitServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .unwrap()
    }
}

async fn code(
    client: &mut RateLimitServiceClient<tonic::transport::Channel>,
    domain: &str,
    entries: &[(&str, &str)],
) -> Code {
    let r = client
        .should_rate_limit(request(domain, vec![descriptor(entries)]))
        .await
        .unwrap()
        .into_inner();
    Code::try_from(r.overall_code).unwrap()
}

fn acks(version: &str) -> impl Fn(&DiscoveryRequest) -> bool + '_ {
    move |r| r.version_info == version && !r.response_nonce.is_empty() && r.error_detail.is_none()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_rules_are_acked_and_a_bad_push_is_nacked_while_the_old_rules_serve() {
    let xds = XdsServer::start(None);
    xds.set("1", vec![config("xds", "k", "v", 2, RateLimitUnit::Minute)]);
    let sluice = Sluice::spawn(&xds, &[]);
    let mut client = sluice.client().await;

    // The subscription names the node and the type, and asks for everything.
    let first = xds.requests().into_iter().next().expect("subscribed");
    let node = first.node.as_ref().expect("node");
    assert_eq!(node.id, "test-node");
    assert_eq!(node.user_agent_name, "sluice");
    assert!(node.metadata.as_ref().unwrap().fields.contains_key("zone"));
    assert_eq!(first.type_url, sluice::xds::resource::TYPE_URL);
    assert!(first.resource_names.is_empty() && first.version_info.is_empty());
    xds.wait_request("ACK of 1", acks("1")).await;
    for _ in 0..2 {
        assert_eq!(code(&mut client, "xds", &[("k", "v")]).await, Code::Ok);
    }
    assert_eq!(
        code(&mut client, "xds", &[("k", "v")]).await,
        Code::OverLimit
    );

    // A push with an error: NACKed with why, naming the last good version.
    xds.set(
        "2",
        vec![config("xds", "k", "v", 100, RateLimitUnit::Unknown)],
    );
    let nack = xds
        .wait_request("NACK of 2", |r| r.error_detail.is_some())
        .await;
    assert_eq!(nack.version_info, "1");
    let why = &nack.error_detail.as_ref().unwrap().message;
    assert!(why.contains("invalid rate limit unit 'UNKNOWN'"), "{why}");
    // The old rules still decide (still over: the limit of 100 did not arrive).
    assert_eq!(
        code(&mut client, "xds", &[("k", "v")]).await,
        Code::OverLimit
    );
    let (status, body) = http_get(sluice.http, "/config").await;
    assert_eq!(status, 200);
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["reloads_failed"], 1, "{body}");
    assert!(
        body["source"].as_str().unwrap().starts_with("xds "),
        "{body}"
    );

    // The next good push replaces the whole state of the world.
    xds.set("3", vec![config("xds", "k", "w", 1, RateLimitUnit::Hour)]);
    xds.wait_request("ACK of 3", acks("3")).await;
    assert_eq!(code(&mut client, "xds", &[("k", "w")]).await, Code::Ok);
    assert_eq!(
        code(&mut client, "xds", &[("k", "w")]).await,
        Code::OverLimit
    );
    assert_eq!(
        code(&mut client, "xds", &[("k", "v")]).await,
        Code::Ok,
        "k=v has no rule in version 3"
    );
    drop(sluice);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn it_reconnects_after_the_server_dies_and_keeps_deciding_meanwhile() {
    let mut xds = XdsServer::start(None);
    xds.set("1", vec![config("xds", "k", "v", 1, RateLimitUnit::Hour)]);
    let sluice = Sluice::spawn(&xds, &[]);
    let mut client = sluice.client().await;
    xds.wait_request("ACK of 1", acks("1")).await;
    assert_eq!(code(&mut client, "xds", &[("k", "v")]).await, Code::Ok);

    xds.stop();
    // No server: the rules held keep deciding.
    assert_eq!(
        code(&mut client, "xds", &[("k", "v")]).await,
        Code::OverLimit
    );
    let before = xds.requests().len();
    xds.set("2", vec![config("xds", "k", "v", 5, RateLimitUnit::Hour)]);
    xds.restart();
    // The new stream subscribes with the version held, then takes the new one.
    let again = xds
        .wait_request("a new subscription", |r| {
            r.response_nonce.is_empty() && r.version_info == "1"
        })
        .await;
    assert!(again.error_detail.is_none());
    assert!(xds.requests().len() > before);
    xds.wait_request("ACK of 2", acks("2")).await;
    // Version 2 raises the limit to 5 an hour; the hit already counted still counts (the
    // counter is the descriptor's, as after a file reload).
    for _ in 0..4 {
        assert_eq!(code(&mut client, "xds", &[("k", "v")]).await, Code::Ok);
    }
    assert_eq!(
        code(&mut client, "xds", &[("k", "v")]).await,
        Code::OverLimit
    );
    drop(sluice);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn it_serves_only_once_the_first_rules_arrive_unless_told_otherwise() {
    let xds = XdsServer::start(None);
    let waiting = Sluice::spawn(&xds, &[]);
    let eager = Sluice::spawn(&xds, &["--xds-start-without-rules"]);
    // Both subscribed; the server has nothing yet.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while xds.requests().len() < 2 {
        assert!(std::time::Instant::now() < deadline, "{:?}", xds.requests());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Started without rules: serving, and nothing is limited.
    let mut eager_client = eager.client().await;
    assert_eq!(
        code(&mut eager_client, "xds", &[("k", "v")]).await,
        Code::Ok
    );
    // Waiting: no listener yet.
    assert!(tokio::net::TcpStream::connect(waiting.http).await.is_err());
    assert!(tokio::net::TcpStream::connect(waiting.grpc).await.is_err());

    xds.set("1", vec![config("xds", "k", "v", 1, RateLimitUnit::Hour)]);
    let mut client = waiting.client().await;
    assert_eq!(code(&mut client, "xds", &[("k", "v")]).await, Code::Ok);
    assert_eq!(
        code(&mut client, "xds", &[("k", "v")]).await,
        Code::OverLimit
    );
    xds.wait_request("ACK of 1", acks("1")).await;
    drop((waiting, eager));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_come_over_mutual_tls_and_a_client_without_a_certificate_gets_none() {
    use common::pki::{Pki, Usage};
    let pki = Pki::new("xds-mtls");
    pki.ca("ca")
        .leaf("ca", "server", "IP:127.0.0.1", Usage::Server)
        .leaf("ca", "client", "DNS:sluice.internal", Usage::Client);
    let xds = XdsServer::start(Some(MutualTls {
        cert: pki.pem(&pki.crt("server")),
        key: pki.pem(&pki.key("server")),
        client_ca: pki.pem(&pki.crt("ca")),
    }));
    xds.set("1", vec![config("xds", "k", "v", 1, RateLimitUnit::Hour)]);
    let ca = pki.crt("ca").display().to_string();
    let (crt, key) = (
        pki.crt("client").display().to_string(),
        pki.key("client").display().to_string(),
    );
    // No client certificate: the handshake fails, so no rules (and it keeps trying).
    let anonymous = Sluice::spawn(&xds, &["--xds-start-without-rules", "--xds-tls-ca", &ca]);
    let sluice = Sluice::spawn(
        &xds,
        &[
            "--xds-tls-ca",
            &ca,
            "--xds-tls-cert",
            &crt,
            "--xds-tls-key",
            &key,
        ],
    );
    let mut client = sluice.client().await;
    assert_eq!(code(&mut client, "xds", &[("k", "v")]).await, Code::Ok);
    assert_eq!(
        code(&mut client, "xds", &[("k", "v")]).await,
        Code::OverLimit
    );
    let mut anonymous_client = anonymous.client().await;
    for _ in 0..3 {
        assert_eq!(
            code(&mut anonymous_client, "xds", &[("k", "v")]).await,
            Code::Ok
        );
    }
    let (_, body) = http_get(anonymous.http, "/config").await;
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["rules"], 0, "{body}");
    assert_eq!(body["reloads_ok"], 0, "{body}");
    drop((sluice, anonymous));
    std::fs::remove_dir_all(&pki.dir).unwrap();
}
