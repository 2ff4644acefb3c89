//! A small OTLP trace receiver the tests run, on loopback (there is no collector package here):
//! OTLP/gRPC (`TraceService/Export`) and OTLP/HTTP with protobuf bodies (`POST /v1/traces`) on
//! two ports, keeping every span it is sent with its service's name.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;

/// One span as received.
#[derive(Debug, Clone)]
pub struct Received {
    /// The resource's attributes (service.name, …).
    pub resource: Vec<(String, String)>,
    pub name: String,
    /// OTLP's kind: 1 internal, 2 server, 3 client.
    pub kind: i32,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub attributes: Vec<(String, String)>,
    /// Linked spans: (trace id, span id).
    pub links: Vec<(String, String)>,
}

impl Received {
    pub fn service(&self) -> &str {
        self.resource_attr("service.name").unwrap_or_default()
    }

    pub fn resource_attr(&self, key: &str) -> Option<&str> {
        self.resource
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

pub const SERVER: i32 = 2;
pub const CLIENT: i32 = 3;

#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<Received>>>);

impl Spans {
    fn take(&self, request: ExportTraceServiceRequest) {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let text = |v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>| match v
            .as_ref()
            .and_then(|v| v.value.as_ref())
        {
            Some(Value::StringValue(s)) => s.clone(),
            Some(Value::IntValue(i)) => i.to_string(),
            Some(Value::BoolValue(b)) => b.to_string(),
            Some(Value::DoubleValue(d)) => d.to_string(),
            other => format!("{other:?}"),
        };
        let mut spans = self.0.lock().unwrap();
        for rs in request.resource_spans {
            let resource: Vec<(String, String)> = rs
                .resource
                .map(|r| {
                    r.attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), text(&kv.value)))
                        .collect()
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    spans.push(Received {
                        resource: resource.clone(),
                        name: s.name,
                        kind: s.kind,
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        attributes: s
                            .attributes
                            .iter()
                            .map(|kv| (kv.key.clone(), text(&kv.value)))
                            .collect(),
                        links: s
                            .links
                            .iter()
                            .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                            .collect(),
                    });
                }
            }
        }
    }
}

#[tonic::async_trait]
impl TraceService for Spans {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.take(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// The receiver: its two ports, and what it was sent.
pub struct Receiver {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    spans: Spans,
}

impl Receiver {
    pub async fn start() -> Self {
        let spans = Spans::default();
        let grpc_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc = grpc_listener.local_addr().unwrap();
        let service = TraceServiceServer::new(spans.clone());
        tokio::spawn(async move {
            let incoming = tokio_stream_of(grpc_listener);
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await;
        });
        let http_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = http_listener.local_addr().unwrap();
        let for_http = spans.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let spans = for_http.clone();
                async move {
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(request) => {
                            spans.take(request);
                            (
                                axum::http::StatusCode::OK,
                                [("content-type", "application/x-protobuf")],
                                ExportTraceServiceResponse::default().encode_to_vec(),
                            )
                        }
                        Err(_) => (
                            axum::http::StatusCode::BAD_REQUEST,
                            [("content-type", "text/plain")],
                            b"not an ExportTraceServiceRequest".to_vec(),
                        ),
                    }
                }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(http_listener, app).await;
        });
        Self { grpc, http, spans }
    }

    /// The environment that points sluice at this receiver over OTLP/gRPC.
    pub fn grpc_env(&self) -> Vec<(&'static str, String)> {
        vec![
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                format!("http://{}", self.grpc),
            ),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".to_owned()),
        ]
    }

    pub fn spans(&self) -> Vec<Received> {
        self.spans.0.lock().unwrap().clone()
    }

    /// Waits (bounded) until `found` finds what it looks for among the spans received.
    pub async fn until<T>(&self, within: Duration, found: impl Fn(&[Received]) -> Option<T>) -> T {
        let deadline = Instant::now() + within;
        loop {
            if let Some(t) = found(&self.spans()) {
                return t;
            }
            assert!(
                Instant::now() < deadline,
                "not received within {within:?}; received: {:#?}",
                self.spans()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A listener's connections as the stream tonic serves.
fn tokio_stream_of(
    listener: tokio::net::TcpListener,
) -> impl futures_util::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(s, _)| s);
        Some((accepted, listener))
    })
}

/// A trace as an indented tree (name, kind, service, and the attributes that say what was
/// decided), for a test's output.
pub fn tree(spans: &[Received], trace_id: &str) -> String {
    let of: Vec<&Received> = spans.iter().filter(|s| s.trace_id == trace_id).collect();
    let ids: std::collections::HashSet<&str> = of.iter().map(|s| s.span_id.as_str()).collect();
    fn walk(of: &[&Received], s: &Received, depth: usize, out: &mut String) {
        let kind = match s.kind {
            SERVER => "SERVER",
            CLIENT => "CLIENT",
            _ => "INTERNAL",
        };
        let attrs: Vec<String> = s
            .attributes
            .iter()
            .filter(|(k, _)| k.starts_with("ratelimit.") || k.starts_with("redis."))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let links = if s.links.is_empty() {
            String::new()
        } else {
            format!(" (links {})", s.links.len())
        };
        out.push_str(&format!(
            "{}{} [{kind}, {}] {}{links}\n",
            "  ".repeat(depth),
            s.name,
            s.service(),
            attrs.join(" "),
        ));
        for child in of.iter().filter(|c| c.parent_span_id == s.span_id) {
            walk(of, child, depth + 1, out);
        }
    }
    let mut out = String::new();
    for root in of
        .iter()
        .filter(|s| s.parent_span_id.is_empty() || !ids.contains(s.parent_span_id.as_str()))
    {
        walk(&of, root, 0, &mut out);
    }
    out
}
