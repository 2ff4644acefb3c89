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

/// prost's gRPC codec with buffers sized for rate-limit messages, which every generated service
/// and client here uses (build.rs names it). tonic's default is an 8 KiB buffer each way per
/// call, for messages that are a few hundred bytes; a larger one grows as it needs to.
pub mod codec {
    use tonic::codec::BufferSettings;

    /// Each call's first encode and decode buffer; past it, tonic grows the buffer.
    const BUFFER_SIZE: usize = 1024;
    /// tonic's own threshold for yielding an encoded stream's buffer.
    const YIELD_THRESHOLD: usize = 32 * 1024;

    /// [`tonic_prost::ProstCodec`] with [`BUFFER_SIZE`] buffers.
    #[derive(Debug, Clone, Copy)]
    pub struct SmallBuffers<T, U>(std::marker::PhantomData<(T, U)>);

    impl<T, U> Default for SmallBuffers<T, U> {
        fn default() -> Self {
            Self(std::marker::PhantomData)
        }
    }

    /// The buffers of each call's encoder and decoder.
    fn buffer_settings() -> BufferSettings {
        BufferSettings::new(BUFFER_SIZE, YIELD_THRESHOLD)
    }

    impl<T, U> tonic::codec::Codec for SmallBuffers<T, U>
    where
        T: prost::Message + Send + 'static,
        U: prost::Message + Default + Send + 'static,
    {
        type Encode = T;
        type Decode = U;
        type Encoder = tonic_prost::ProstEncoder<T>;
        type Decoder = tonic_prost::ProstDecoder<U>;

        fn encoder(&mut self) -> Self::Encoder {
            tonic_prost::ProstEncoder::new(buffer_settings())
        }

        fn decoder(&mut self) -> Self::Decoder {
            tonic_prost::ProstCodec::<T, U>::raw_decoder(buffer_settings())
        }
    }
}
