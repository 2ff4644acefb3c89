//! A no-op RLS built with the same stack as sluice: it answers OK without deciding. The
//! ceiling the benchmarks compare sluice with.

use sluice::proto;

/// Answers OK without deciding anything.
pub struct NoOp;

#[tonic::async_trait]
impl proto::RateLimitService for NoOp {
    async fn should_rate_limit(
        &self,
        r: tonic::Request<proto::RateLimitRequest>,
    ) -> Result<tonic::Response<proto::RateLimitResponse>, tonic::Status> {
        let n = r.into_inner().descriptors.len();
        Ok(tonic::Response::new(proto::RateLimitResponse {
            overall_code: proto::Code::Ok as i32,
            statuses: vec![
                proto::DescriptorStatus {
                    code: proto::Code::Ok as i32,
                    ..Default::default()
                };
                n
            ],
            ..Default::default()
        }))
    }
}
