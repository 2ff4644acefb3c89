//! An OTLP/gRPC trace sink for `scripts/bench`'s traced rows: it accepts every export and
//! counts the spans (printed every 5 seconds it received any), so the bench measures what
//! exporting costs sluice, with a collector that keeps up. Not a collector: nothing is kept.
//!
//!   cargo run --release --example otlp_sink -- 127.0.0.1:4317

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};

#[derive(Clone, Default)]
struct Sink(Arc<AtomicU64>);

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans: usize = request
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.0.fetch_add(spans as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:4317".into())
        .parse()?;
    let sink = Sink::default();
    let count = sink.0.clone();
    tokio::spawn(async move {
        let mut last = 0;
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
            let now = count.load(Ordering::Relaxed);
            if now != last {
                eprintln!("otlp_sink: {now} spans");
                last = now;
            }
        }
    });
    tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(sink))
        .serve(addr)
        .await?;
    Ok(())
}
