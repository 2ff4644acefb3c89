//! The RLS's gRPC door: tonic's unary call handling (framing, grpc-status, trailers) around
//! [`RateLimitGrpc::answer`], with a codec whose encoder writes the [`Answer`] straight from the
//! decision (see `answer`).
//!
//! Why not the generated `RateLimitServiceServer`: its response type is the
//! `RateLimitResponse` message, which this door no longer builds, and it boxes three futures a
//! call (the route's, the method's and `async_trait`'s) where one does.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::codegen::{BoxFuture, Service, http};
use tonic::{Request, Response, Status};

use super::{Answer, RateLimitGrpc};
use crate::proto::{self, RateLimitRequest, RateLimitResponse};
use crate::store::Store;

/// `ShouldRateLimit`'s path.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The RLS as a gRPC service of the listener (see `server::grpc`).
pub struct RlsServer<S> {
    service: Arc<RateLimitGrpc<S>>,
}

impl<S> RlsServer<S> {
    pub fn new(service: Arc<RateLimitGrpc<S>>) -> Self {
        Self { service }
    }
}

impl<S> Clone for RlsServer<S> {
    fn clone(&self) -> Self {
        Self {
            service: self.service.clone(),
        }
    }
}

type GrpcRequest = http::Request<tonic::body::Body>;
type GrpcResponse = http::Response<tonic::body::Body>;

impl<S: Store> Service<GrpcRequest> for RlsServer<S> {
    type Response = GrpcResponse;
    type Error = Infallible;
    type Future = BoxFuture<GrpcResponse, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: GrpcRequest) -> Self::Future {
        if request.uri().path() != SHOULD_RATE_LIMIT {
            return Box::pin(std::future::ready(Ok(unimplemented())));
        }
        let service = self.service.clone();
        Box::pin(async move {
            let method = Method(|call: Request<RateLimitRequest>| async {
                service.answer(call.into_inner()).await.map(Response::new)
            });
            Ok(tonic::server::Grpc::new(AnswerCodec)
                .unary(method, request)
                .await)
        })
    }
}

/// The method as tonic's unary handling calls it: a function of the decoded request.
struct Method<F>(F);

impl<F, Fut> Service<Request<RateLimitRequest>> for Method<F>
where
    F: FnMut(Request<RateLimitRequest>) -> Fut,
    Fut: Future<Output = Result<Response<Answer>, Status>>,
{
    type Response = Response<Answer>;
    type Error = Status;
    type Future = Fut;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<RateLimitRequest>) -> Fut {
        (self.0)(request)
    }
}

/// Requests decoded by prost, answers written by [`Answer::encode`]; the buffers of
/// [`proto::codec`].
#[derive(Clone, Copy, Default)]
struct AnswerCodec;

impl Codec for AnswerCodec {
    type Encode = Answer;
    type Decode = RateLimitRequest;
    type Encoder = AnswerEncoder;
    type Decoder = tonic_prost::ProstDecoder<RateLimitRequest>;

    fn encoder(&mut self) -> AnswerEncoder {
        AnswerEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstCodec::<RateLimitResponse, RateLimitRequest>::raw_decoder(
            proto::codec::buffer_settings(),
        )
    }
}

struct AnswerEncoder;

impl Encoder for AnswerEncoder {
    type Item = Answer;
    type Error = Status;

    fn encode(&mut self, answer: Answer, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // `EncodeBuf` grows as it is written to.
        answer.encode(buf);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        proto::codec::buffer_settings()
    }
}

/// What the generated servers answer for a method they do not have.
fn unimplemented() -> GrpcResponse {
    let mut response = http::Response::new(tonic::body::Body::default());
    let headers = response.headers_mut();
    headers.insert(
        Status::GRPC_STATUS,
        (tonic::Code::Unimplemented as i32).into(),
    );
    headers.insert(
        http::header::CONTENT_TYPE,
        tonic::metadata::GRPC_CONTENT_TYPE,
    );
    response
}
