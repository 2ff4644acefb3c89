//! The metrics layer: times every backend call and counts its errors by variant
//! (`StoreError::label`). It sits outside the breaker, so calls the breaker refused are counted
//! (`circuit_open`) too. The store does not know the metrics registry: it reports to a
//! [`BackendObserver`], which `metrics::Metrics` implements.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Check, Outcome, Store, StoreError};

/// Receives one observation per backend call.
pub trait BackendObserver: Send + Sync + 'static {
    fn backend_call(&self, took: Duration, error: Option<&StoreError>);
}

pub struct Metered<S> {
    inner: S,
    observer: Option<Arc<dyn BackendObserver>>,
}

impl<S: Store> Metered<S> {
    pub fn new(inner: S, observer: Option<Arc<dyn BackendObserver>>) -> Self {
        Self { inner, observer }
    }
}

impl<S: Store> Store for Metered<S> {
    async fn apply(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        let Some(observer) = &self.observer else {
            return self.inner.apply(checks).await;
        };
        let started = Instant::now();
        let result = self.inner.apply(checks).await;
        let took = match &result {
            Err(StoreError::CircuitOpen) => Duration::ZERO,
            _ => started.elapsed(),
        };
        observer.backend_call(took, result.as_ref().err());
        if let Err(e) = &result {
            tracing::debug!(error = %e, "backend call failed");
        }
        result
    }
}
