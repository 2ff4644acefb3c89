//! Finished spans leave through a bounded queue that a worker empties in batches to the OTLP
//! exporter, so a collector that is down or slow never slows a decision: ending a span is a
//! `try_send`, and a full queue drops the span and counts it ([`Counts`]).
//!
//! Why not the SDK's `BatchSpanProcessor`: it runs its own thread and drives the exporter with a
//! blocking executor (the gRPC exporter then needs a runtime entered around it, and the HTTP one
//! a blocking client), and it counts what it drops only in its internal log. Here the worker is
//! a task of the server's runtime, handed back to the caller as tower's `Buffer::pair` does, and
//! the exporter is built inside it (tonic's channel needs the runtime).
//!
//! Figures: the queue holds [`QUEUE_SPANS`] spans (a few MiB at the most); a batch leaves with
//! [`BATCH_SPANS`] spans or after [`BATCH_DELAY`], whichever comes first.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::Context;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use tokio::sync::mpsc;

/// Spans waiting to leave; past it, finished spans are dropped and counted.
pub const QUEUE_SPANS: usize = 8_192;
/// The most spans one export carries.
pub const BATCH_SPANS: usize = 512;
/// The longest a finished span waits for its batch.
pub const BATCH_DELAY: Duration = Duration::from_secs(1);

/// What the queue did, for the metrics.
#[derive(Debug, Default)]
pub struct Counts {
    pub exported: AtomicU64,
    /// Dropped because the queue was full, or their export failed.
    pub dropped: AtomicU64,
    pub failed_exports: AtomicU64,
}

/// The SDK's side: finished spans into the queue.
#[derive(Debug)]
pub struct Queue {
    /// Taken at shutdown, so the worker sees the queue end once it is empty.
    sender: Mutex<Option<mpsc::Sender<SpanData>>>,
    counts: Arc<Counts>,
}

/// The worker: run it on the server's runtime; it ends when the queue is shut down and empty.
pub type Worker = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A queue and its worker, which builds its exporter with `exporter` when it first runs and
/// gives each export at most `timeout`.
pub fn pair<E, F>(exporter: F, counts: Arc<Counts>, timeout: Duration) -> (Queue, Worker)
where
    E: SpanExporter + 'static,
    F: FnOnce() -> Option<E> + Send + 'static,
{
    let (sender, spans) = mpsc::channel(QUEUE_SPANS);
    let worker = run(spans, exporter, counts.clone(), timeout);
    (
        Queue {
            sender: Mutex::new(Some(sender)),
            counts,
        },
        Box::pin(worker),
    )
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        let sender = self.sender.lock().unwrap_or_else(|e| e.into_inner());
        let sent = sender.as_ref().is_some_and(|s| s.try_send(span).is_ok());
        if !sent {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        self.sender.lock().unwrap_or_else(|e| e.into_inner()).take();
        Ok(())
    }
}

async fn run<E, F>(
    mut spans: mpsc::Receiver<SpanData>,
    exporter: F,
    counts: Arc<Counts>,
    timeout: Duration,
) where
    E: SpanExporter,
    F: FnOnce() -> Option<E>,
{
    let Some(exporter) = exporter() else {
        // Nothing can be exported: drain and count, so senders never block on a full queue.
        while spans.recv().await.is_some() {
            counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
        return;
    };
    let mut batch = Vec::with_capacity(BATCH_SPANS);
    loop {
        // The first span of a batch waits for nothing; the rest come for up to BATCH_DELAY.
        let Some(first) = spans.recv().await else {
            break;
        };
        batch.push(first);
        let deadline = tokio::time::sleep(BATCH_DELAY);
        tokio::pin!(deadline);
        let mut ended = false;
        while batch.len() < BATCH_SPANS {
            tokio::select! {
                span = spans.recv() => match span {
                    Some(span) => batch.push(span),
                    None => { ended = true; break; }
                },
                () = &mut deadline => break,
            }
        }
        let n = batch.len() as u64;
        let exported = tokio::time::timeout(timeout, exporter.export(std::mem::take(&mut batch)));
        match exported.await {
            Ok(Ok(())) => counts.exported.fetch_add(n, Ordering::Relaxed),
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer within {timeout:?}"),
                };
                tracing::debug!(%error, spans = n, "trace export failed; spans dropped");
                counts.failed_exports.fetch_add(1, Ordering::Relaxed);
                counts.dropped.fetch_add(n, Ordering::Relaxed)
            }
        };
        if ended {
            break;
        }
    }
    let _ = exporter.shutdown();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// An exporter that counts what it gets, and can be made to hang (a collector that stopped
    /// answering) or fail.
    #[derive(Debug, Clone, Default)]
    struct Counting {
        got: Arc<AtomicU64>,
        hang: Arc<AtomicBool>,
        fail: bool,
    }

    impl SpanExporter for Counting {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            if self.hang.load(Ordering::Relaxed) {
                std::future::pending::<()>().await;
            }
            if self.fail {
                return Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(
                    "down".into(),
                ));
            }
            self.got.fetch_add(batch.len() as u64, Ordering::Relaxed);
            Ok(())
        }
    }

    fn span() -> SpanData {
        use opentelemetry::trace::{SpanContext, SpanKind, Status};
        SpanData {
            span_context: SpanContext::empty_context(),
            parent_span_id: opentelemetry::trace::SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Server,
            name: "s".into(),
            start_time: std::time::SystemTime::UNIX_EPOCH,
            end_time: std::time::SystemTime::UNIX_EPOCH,
            attributes: Vec::new(),
            dropped_attributes_count: 0,
            events: opentelemetry_sdk::trace::SpanEvents::default(),
            links: opentelemetry_sdk::trace::SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: opentelemetry::InstrumentationScope::builder("t").build(),
        }
    }

    /// A queue exporting to (a clone of) `exporter`, its worker running, and its counts.
    fn started(exporter: &Counting) -> (Queue, tokio::task::JoinHandle<()>, Arc<Counts>) {
        let counts = Arc::new(Counts::default());
        let exporter = exporter.clone();
        let (queue, worker) = pair(
            move || Some(exporter),
            counts.clone(),
            Duration::from_secs(3600),
        );
        (queue, tokio::spawn(worker), counts)
    }

    #[tokio::test]
    async fn a_stuck_collector_drops_and_counts_past_the_queue_and_never_blocks() {
        let exporter = Counting::default();
        exporter.hang.store(true, Ordering::Relaxed);
        let (queue, worker, counts) = started(&exporter);
        // The worker takes one batch and hangs in its export; the queue fills behind it.
        let total = QUEUE_SPANS + BATCH_SPANS + 1_000;
        for _ in 0..total {
            queue.on_end(span());
            tokio::task::yield_now().await;
        }
        let dropped = counts.dropped.load(Ordering::Relaxed);
        assert!(dropped >= 1_000 - 1, "dropped {dropped}");
        assert!(dropped as usize <= total - QUEUE_SPANS, "dropped {dropped}");
        worker.abort();
    }

    #[tokio::test]
    async fn spans_leave_in_batches_and_the_rest_at_shutdown() {
        let exporter = Counting::default();
        let (queue, worker, counts) = started(&exporter);
        for _ in 0..1_500 {
            queue.on_end(span());
        }
        queue.shutdown_with_timeout(Duration::from_secs(1)).unwrap();
        worker.await.unwrap();
        assert_eq!(exporter.got.load(Ordering::Relaxed), 1_500);
        assert_eq!(counts.exported.load(Ordering::Relaxed), 1_500);
        // After shutdown a span is dropped, counted.
        queue.on_end(span());
        assert_eq!(counts.dropped.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_failing_collector_counts_its_spans_dropped() {
        let exporter = Counting {
            fail: true,
            ..Counting::default()
        };
        let (queue, worker, counts) = started(&exporter);
        for _ in 0..10 {
            queue.on_end(span());
        }
        queue.shutdown_with_timeout(Duration::from_secs(1)).unwrap();
        worker.await.unwrap();
        assert_eq!(counts.dropped.load(Ordering::Relaxed), 10);
        assert!(counts.failed_exports.load(Ordering::Relaxed) >= 1);
    }
}
