//! sluice: a rate limit service for Envoy (envoy.service.ratelimit.v3).
//!
//! The folders are the architecture, from the edge inwards:
//!
//! - [`cli`]: the command line (flags, the reference's environment, the tools) and what `serve`'s
//!   flags become, a [`server::Config`].
//! - [`server`]: the running system: rules source and reloads, the store's upkeep on timers,
//!   listeners, drain and graceful stop ([`server::run`]). [`readiness`]: whether this node takes
//!   traffic, the one rule every health door reads.
//! - [`service`] (gRPC: RLS, headers, health), [`rlqs`] (gRPC: Envoy's Rate Limit Quota
//!   Service, grants drawn from the same counters), [`admin`] (HTTP), [`xds`] (rules pushed by an
//!   xDS server): the doors. [`metrics`]: what the doors and the store report, for Prometheus.
//! - [`engine`]: one request: match, build checks, apply them all-or-nothing, report.
//!   [`explain`]: the same matching, shown instead of applied.
//! - [`rules`]: parse, validate, compile, match, reload. [`counter`]: what rules and stores share
//!   (keys, units, periods, modes).
//! - [`store`]: where state lives (memory or Redis) and the layers around the backend, composed
//!   once in [`store::build`], which returns the stack and its upkeep.
//! - [`limiter`]: the algorithms as pure functions, and their facts. [`calendar`]: a limit's
//!   calendar windows (a day, week, month or year in a time zone).
//! - [`clock`] (time, manual in tests), [`proto`] (the compiled protos), [`tls`] (the gRPC
//!   listener's certificates, rotated), [`top`] (the most-limited values, a bounded sketch).
//!   [`allocator`]: the global allocator the binary and the benches install. [`trace`]: each
//!   decision a span in the caller's trace (OpenTelemetry, OTLP), when an endpoint is set.

pub mod admin;
pub mod allocator;
pub mod calendar;
pub mod cli;
pub mod clock;
pub mod counter;
pub mod engine;
pub mod explain;
pub mod limiter;
pub mod metrics;
pub mod proto;
pub mod readiness;
pub mod rlqs;
pub mod rules;
pub mod server;
pub mod service;
pub mod store;
pub mod tls;
pub mod top;
pub mod trace;
pub mod xds;
