//! TLS and mutual TLS on the gRPC listener, with certificates a real CA (openssl) makes: who
//! gets in, and a certificate rotated while the server serves.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pki::{Pki, Usage};
use common::*;
use sluice::engine::EngineSettings;
use sluice::proto::{Code, RateLimitServiceClient};
use sluice::tls::{Reload, ServerTls, TlsError, TlsFiles};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const RULES: &str = r#"
domain: api
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 1000}
"#;

const SERVER_SANS: &str = "DNS:localhost,IP:127.0.0.1";

/// A server certificate `server` from CA `ca1`, and client certificates from `ca1` and from an
/// unrelated `ca2`.
fn pki(name: &str) -> Pki {
    let pki = Pki::new(name);
    pki.ca("ca1")
        .ca("ca2")
        .leaf("ca1", "server", SERVER_SANS, Usage::Server)
        .leaf("ca1", "client", "DNS:envoy.internal", Usage::Client)
        .leaf("ca1", "other-client", "DNS:someone.else", Usage::Client)
        .leaf("ca2", "stranger", "DNS:envoy.internal", Usage::Client);
    pki
}

fn files(pki: &Pki, client_ca: Option<&str>, client_san: Option<&str>) -> TlsFiles {
    TlsFiles {
        cert: pki.crt("server"),
        key: pki.key("server"),
        client_ca: client_ca.map(|ca| pki.crt(ca)),
        client_san: client_san.map(str::to_owned),
        reload_every: Duration::from_secs(3600),
    }
}

async fn serve(tls: &Arc<ServerTls>) -> TestServer {
    start_with_tls(RULES, "none", EngineSettings::default(), Some(tls.clone())).await
}

/// A client trusting CA `trust`, presenting certificate `identity` if given.
async fn connect(
    server: &TestServer,
    pki: &Pki,
    trust: &str,
    identity: Option<&str>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(pki.pem(&pki.crt(trust))))
        .domain_name("localhost");
    if let Some(id) = identity {
        tls = tls.identity(Identity::from_pem(
            pki.pem(&pki.crt(id)),
            pki.pem(&pki.key(id)),
        ));
    }
    Channel::from_shared(format!("https://{}", server.running.grpc_addr))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await
}

/// One ShouldRateLimit on `channel`: Ok when the server answered OK.
async fn call(channel: Channel) -> Result<(), String> {
    let r = RateLimitServiceClient::new(channel)
        .should_rate_limit(request("api", vec![descriptor(&[("k", "v")])]))
        .await
        .map_err(|s| s.to_string())?;
    assert_eq!(r.into_inner().overall_code, Code::Ok as i32);
    Ok(())
}

/// Connects and calls; Err says where it failed. With TLS 1.3 a refused client certificate
/// shows only on the first call, so both steps count.
async fn connect_and_call(
    server: &TestServer,
    pki: &Pki,
    trust: &str,
    identity: Option<&str>,
) -> Result<(), String> {
    let channel = connect(server, pki, trust, identity)
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    call(channel).await
}

#[tokio::test]
async fn tls_serves_ratelimit_calls_and_refuses_plaintext() {
    let pki = pki("tls-basic");
    let tls = Arc::new(ServerTls::load(files(&pki, None, None)).unwrap());
    let server = serve(&tls).await;

    connect_and_call(&server, &pki, "ca1", None)
        .await
        .expect("a client trusting the CA is served");
    assert!(
        connect_and_call(&server, &pki, "ca2", None).await.is_err(),
        "a client that does not trust the server's CA must fail"
    );
    // Plaintext HTTP/2 to a TLS port is not gRPC.
    let plain = Channel::from_shared(format!("http://{}", server.running.grpc_addr))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5));
    let plaintext = match plain.connect().await {
        Ok(channel) => call(channel).await,
        Err(e) => Err(e.to_string()),
    };
    assert!(plaintext.is_err(), "plaintext must not be served");
    // The failed handshakes did not stop the listener.
    connect_and_call(&server, &pki, "ca1", None).await.unwrap();
    server.running.stop().await.unwrap();
}

#[tokio::test]
async fn mutual_tls_admits_only_the_client_ca_and_then_only_the_named_client() {
    let pki = pki("tls-mutual");
    // (client name required by the server, client certificate presented, admitted, why)
    let cases: &[(Option<&str>, Option<&str>, bool, &str)] = &[
        (
            None,
            Some("client"),
            true,
            "a certificate from the client CA",
        ),
        (None, None, false, "no client certificate"),
        (
            None,
            Some("stranger"),
            false,
            "a certificate from another CA",
        ),
        (
            Some("envoy.internal"),
            Some("client"),
            true,
            "the named client",
        ),
        (
            Some("envoy.internal"),
            Some("other-client"),
            false,
            "the right CA with another name",
        ),
    ];
    for &(client_san, identity, admitted, why) in cases {
        let tls = Arc::new(ServerTls::load(files(&pki, Some("ca1"), client_san)).unwrap());
        let server = serve(&tls).await;
        let answer = connect_and_call(&server, &pki, "ca1", identity).await;
        assert_eq!(
            answer.is_ok(),
            admitted,
            "{why} (server requires name {client_san:?}): {answer:?}"
        );
        server.running.stop().await.unwrap();
    }
}

#[tokio::test]
async fn a_rotated_certificate_serves_new_connections_and_a_broken_one_is_not_loaded() {
    let pki = pki("tls-rotate");
    pki.leaf("ca2", "server-next", SERVER_SANS, Usage::Server)
        .leaf("ca2", "server-after", SERVER_SANS, Usage::Server);
    let tls = Arc::new(ServerTls::load(files(&pki, None, None)).unwrap());
    let server = serve(&tls).await;
    let open = connect(&server, &pki, "ca1", None).await.unwrap();
    call(open.clone()).await.unwrap();
    assert!(matches!(tls.reload(), Reload::Unchanged));

    // Rotate to a certificate from ca2.
    pki.install("server-next", "server");
    assert!(matches!(tls.reload(), Reload::Replaced));
    connect_and_call(&server, &pki, "ca2", None)
        .await
        .expect("a new connection gets the new certificate");
    assert!(
        connect_and_call(&server, &pki, "ca1", None).await.is_err(),
        "the old certificate is no longer offered"
    );
    call(open.clone())
        .await
        .expect("a connection made before the rotation keeps working");

    // Half a rotation: a new certificate beside the old key. It does not load, once.
    pki.replace(&pki.crt("server"), &pki.pem(&pki.crt("server-after")));
    match tls.reload() {
        Reload::Failed(TlsError::Identity { .. }) => {}
        other => panic!("a certificate with another key's pair must not load: {other:?}"),
    }
    assert!(matches!(tls.reload(), Reload::Unchanged), "reported once");
    connect_and_call(&server, &pki, "ca2", None)
        .await
        .expect("the last good certificate keeps serving");
    // The key arrives: the rotation completes.
    pki.replace(&pki.key("server"), &pki.pem(&pki.key("server-after")));
    assert!(matches!(tls.reload(), Reload::Replaced));
    connect_and_call(&server, &pki, "ca2", None).await.unwrap();
    server.running.stop().await.unwrap();
}

#[tokio::test]
async fn the_server_reads_rotated_files_on_its_own() {
    let pki = pki("tls-timer");
    pki.leaf("ca2", "server-next", SERVER_SANS, Usage::Server);
    let tls = Arc::new(
        ServerTls::load(TlsFiles {
            reload_every: Duration::from_millis(50),
            ..files(&pki, None, None)
        })
        .unwrap(),
    );
    let server = serve(&tls).await;
    connect_and_call(&server, &pki, "ca1", None).await.unwrap();
    pki.install("server-next", "server");
    // The server's own tick reloads; wait (bounded) until a new connection shows it.
    let deadline = Instant::now() + Duration::from_secs(20);
    while connect_and_call(&server, &pki, "ca2", None).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the rotation was never picked up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.running.stop().await.unwrap();
}

#[test]
fn bad_files_are_refused_at_start_with_the_reason() {
    let pki = pki("tls-bad");
    let load = |f: TlsFiles| ServerTls::load(f).map(|_| ()).unwrap_err();

    let e = load(TlsFiles {
        cert: pki.dir.join("missing.crt"),
        ..files(&pki, None, None)
    });
    assert!(matches!(e, TlsError::Read { .. }), "{e}");
    assert!(e.to_string().contains("missing.crt"), "{e}");

    let e = load(TlsFiles {
        key: pki.key("client"),
        ..files(&pki, None, None)
    });
    assert!(matches!(e, TlsError::Identity { .. }), "{e}");

    let e = load(TlsFiles {
        cert: pki.key("server"),
        ..files(&pki, None, None)
    });
    assert!(matches!(e, TlsError::NoCertificate { .. }), "{e}");

    let e = load(TlsFiles {
        key: pki.crt("server"),
        ..files(&pki, None, None)
    });
    assert!(matches!(e, TlsError::Pem { .. }), "{e}");

    let e = load(files(&pki, None, Some("envoy.internal")));
    assert!(matches!(e, TlsError::SanWithoutCa), "{e}");

    let e = load(files(&pki, Some("ca1"), Some("not a name!")));
    assert!(matches!(e, TlsError::ClientSan(_)), "{e}");
}
