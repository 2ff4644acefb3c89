//! sluice: a rate limit service for Envoy (envoy.service.ratelimit.v3).
//!
//! The folders are the architecture: `rules` (parse, validate, match), `limiter` (the
//! algorithms as pure functions), `store` (where state lives: memory), `engine` (one request:
//! match, build checks, apply them all-or-nothing, report), `service` (gRPC adapter), `admin`
//! (HTTP), `server` (wiring and lifecycle), `xds` (rules pushed by an xDS server).

pub mod admin;
pub mod cli;
pub mod clock;
pub mod counter;
pub mod engine;
pub mod explain;
pub mod limiter;
pub mod metrics;
pub mod proto;
pub mod readiness;
pub mod rules;
pub mod server;
pub mod service;
pub mod store;
pub mod tls;
pub mod xds;
