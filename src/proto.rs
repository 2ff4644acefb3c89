//! The generated Envoy RLS v3 and xDS types and the reference service's rules resource (from
//! `proto/`, compiled by build.rs). Module nesting follows the proto packages because the
//! generated code refers across them by path.
#![allow(clippy::all, clippy::pedantic, missing_docs)]

pub mod envoy {
    pub mod config {
        pub mod core {
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
    pub mod extensions {
        pub mod common {
            pub mod ratelimit {
                pub mod v3 {
                    tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                }
            }
        }
    }
    pub mod service {
        pub mod discovery {
            pub mod v3 {
                tonic::include_proto!("envoy.service.discovery.v3");
            }
        }
        pub mod ratelimit {
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
            }
        }
        pub mod rate_limit_quota {
            pub mod v3 {
                tonic::include_proto!("envoy.service.rate_limit_quota.v3");
            }
        }
    }
    pub mod r#type {
        pub mod v3 {
            tonic::include_proto!("envoy.r#type.v3");
        }
    }
}

pub mod google {
    pub mod rpc {
        tonic::include_proto!("google.rpc");
    }
}

/// The Go reference service's rules resource, which Envoy Gateway pushes over xDS.
pub mod ratelimit {
    pub mod config {
        pub mod ratelimit {
            pub mod v3 {
                tonic::include_proto!("ratelimit.config.ratelimit.v3");
            }
        }
    }
}

pub use envoy::config::core::v3::HeaderValue;
pub use envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
pub use envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
pub use envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit, rate_limit::Unit as ResponseUnit,
};
pub use envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
pub use envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
pub use envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
pub use envoy::r#type::v3::RateLimitUnit as OverrideUnit;

impl RateLimitDescriptor {
    /// A descriptor of these `(key, value)` entries and nothing else, as a client sends one.
    pub fn with_entries(entries: &[(&str, &str)]) -> Self {
        Self {
            entries: entries
                .iter()
                .map(|(key, value)| Entry {
                    key: (*key).to_owned(),
                    value: (*value).to_owned(),
                })
                .collect(),
            ..Self::default()
        }
    }
}

/// The encoded descriptors of the RLS protos (from build.rs), for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/rls_descriptor.bin"));

/// The gRPC service name, as health checks use it.
pub const SERVICE_NAME: &str = "envoy.service.ratelimit.v3.RateLimitService";

/// The Rate Limit Quota Service's gRPC name (see `rlqs`).
pub const QUOTA_SERVICE_NAME: &str = "envoy.service.rate_limit_quota.v3.RateLimitQuotaService";

/// The Rate Limit Quota Service's messages and service (see `rlqs`).
pub mod rlqs {
    pub use super::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::{
        BucketAction, bucket_action,
    };
    pub use super::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
    pub use super::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
        RateLimitQuotaService, RateLimitQuotaServiceServer,
    };
    pub use super::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
    pub use super::envoy::service::rate_limit_quota::v3::{
        BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
    };
    pub use super::envoy::r#type::v3::{RateLimitStrategy, TokenBucket, rate_limit_strategy};
}
