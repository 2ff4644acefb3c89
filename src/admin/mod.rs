//! The HTTP side: `GET /healthcheck` and `POST /json` (`/metrics` comes with the metrics work).

pub mod json;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::proto::Code;
use crate::service::RateLimitGrpc;
use crate::store::Store;

struct AdminState<S> {
    service: Arc<RateLimitGrpc<S>>,
    serving: Arc<AtomicBool>,
}

/// `serving` is true while rules are loaded and the server is not shutting down.
pub fn router<S: Store>(service: Arc<RateLimitGrpc<S>>, serving: Arc<AtomicBool>) -> Router {
    Router::new()
        .route("/healthcheck", get(healthcheck::<S>))
        .route("/json", post(json_call::<S>))
        .with_state(Arc::new(AdminState { service, serving }))
}

async fn healthcheck<S: Store>(State(state): State<Arc<AdminState<S>>>) -> Response {
    if state.serving.load(Ordering::Acquire) {
        (StatusCode::OK, "OK\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "NOT SERVING\n").into_response()
    }
}

/// 200 for OK, 429 for OVER_LIMIT, 400 for a bad request, 503 when the store cannot answer.
async fn json_call<S: Store>(State(state): State<Arc<AdminState<S>>>, body: Bytes) -> Response {
    let request = match json::parse_request(&body) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    match state.service.handle(request).await {
        Ok(response) => {
            let status = if response.overall_code == Code::OverLimit as i32 {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            (status, axum::Json(json::render_response(&response))).into_response()
        }
        Err(s) if s.code() == tonic::Code::InvalidArgument => {
            (StatusCode::BAD_REQUEST, format!("{}\n", s.message())).into_response()
        }
        Err(s) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{}\n", s.message()),
        )
            .into_response(),
    }
}
