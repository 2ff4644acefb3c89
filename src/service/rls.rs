//! The RLS's gRPC door: a unary call's one message read from the HTTP/2 body, handed to
//! [`RateLimitGrpc::answer`], and the [`Answer`] written straight into the response (see
//! `answer`), then trailers saying OK.
//!
//! Why not the generated `RateLimitServiceServer` and tonic's `Grpc::unary`: they are built for
//! streams of messages in any codec and compression, and a rate-limit call is one small message
//! each way. Their per-call machinery (a decoding stream, an encoding stream, a status turned into
//! a header map, three boxed futures) cost more than the decision itself (callgrind: ~4 200
//! instructions a call). What an RLS client may send is answered with a status that says what
//! was wrong with it: a compressed message UNIMPLEMENTED and an oversized one OUT_OF_RANGE, as
//! tonic answers them; a body that is not one whole message, or a message that is not a
//! `RateLimitRequest`, INVALID_ARGUMENT with the reason (tonic and grpc-go say INTERNAL, which
//! tells an operator the server broke; Envoy treats every error alike). `grpc-timeout` is the
//! listener's (tonic's server applies it to every service).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body::Frame;
use prost::Message;
use prost::bytes::{BufMut, Bytes, BytesMut};
use tonic::Status;
use tonic::codegen::{BoxFuture, Service, http};
use tracing::Instrument;

use super::{Answer, HeaderSet, RateLimitGrpc};
use crate::proto::RateLimitRequest;
use crate::store::Store;

/// `ShouldRateLimit`'s path.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The largest request message taken, as tonic's default limit (4 MiB).
const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

/// A gRPC message's prefix: a compression flag and the message's length (big-endian u32).
const PREFIX_BYTES: usize = 5;

/// Room for the usual answer (a few statuses and headers); the buffer grows past it.
const ANSWER_CAPACITY: usize = 256;

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
            return Box::pin(std::future::ready(
                Ok(Status::unimplemented("").into_http()),
            ));
        }
        let service = self.service.clone();
        // The call's span in the caller's trace (none when traces are off).
        let span = crate::trace::rls_call(request.headers());
        Box::pin(
            async move {
                let answer = match read_request(request).await {
                    Ok(request) => service.answer(request).await,
                    Err(status) => Err(status),
                };
                if let Err(status) = &answer {
                    let span = tracing::Span::current();
                    span.record("otel.status_code", "error");
                    span.record("ratelimit.decision", status.message());
                }
                Ok(match answer {
                    Ok(answer) => respond(&answer, &service.headers),
                    Err(status) => status.into_http(),
                })
            }
            .instrument(span),
        )
    }
}

/// The call's request message, or the status tonic answers for what is not one.
async fn read_request(request: GrpcRequest) -> Result<RateLimitRequest, Status> {
    if let Some(encoding) = request.headers().get("grpc-encoding")
        && encoding != "identity"
    {
        return Err(Status::unimplemented(format!(
            "Content is compressed with `{}` which isn't supported",
            encoding.to_str().unwrap_or("?")
        )));
    }
    let body = read_body(request.into_body()).await?;
    let message = one_message(body)?;
    RateLimitRequest::decode(message).map_err(|e| {
        Status::invalid_argument(format!("the message is not a RateLimitRequest: {e}"))
    })
}

/// The body's bytes, at most one prefix and [`MAX_REQUEST_BYTES`] of message: usually one
/// DATA frame, kept without a copy.
async fn read_body(mut body: tonic::body::Body) -> Result<Bytes, Status> {
    let mut first = Bytes::new();
    let mut joined: Option<BytesMut> = None;
    while let Some(frame) =
        std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut body), cx)).await
    {
        // Trailers of a request carry nothing the RLS reads.
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        let so_far = joined.as_ref().map_or(first.len(), BytesMut::len);
        if so_far + data.len() > PREFIX_BYTES + MAX_REQUEST_BYTES {
            return Err(too_large(so_far + data.len() - PREFIX_BYTES));
        }
        match &mut joined {
            Some(joined) => joined.extend_from_slice(&data),
            None if first.is_empty() => first = data,
            None => {
                let mut both = BytesMut::with_capacity(first.len() + data.len());
                both.extend_from_slice(&first);
                both.extend_from_slice(&data);
                joined = Some(both);
            }
        }
    }
    Ok(joined.map_or(first, BytesMut::freeze))
}

/// The one message of a unary call's body.
fn one_message(mut body: Bytes) -> Result<Bytes, Status> {
    if body.is_empty() {
        return Err(Status::invalid_argument("Missing request message."));
    }
    let Some(prefix) = body.get(..PREFIX_BYTES) else {
        return Err(Status::invalid_argument(
            "a request body shorter than a gRPC message's 5-byte prefix",
        ));
    };
    match prefix[0] {
        0 => {}
        1 => {
            return Err(Status::invalid_argument(
                "protocol error: received message with compressed-flag but no grpc-encoding was specified",
            ));
        }
        flag => {
            return Err(Status::invalid_argument(format!(
                "protocol error: received message with invalid compression flag: {flag} (valid flags are 0 and 1)"
            )));
        }
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if len > MAX_REQUEST_BYTES {
        return Err(too_large(len));
    }
    let message = body.split_off(PREFIX_BYTES);
    match message.len().cmp(&len) {
        std::cmp::Ordering::Equal => Ok(message),
        std::cmp::Ordering::Less => Err(Status::invalid_argument(format!(
            "the request body ends inside its message ({} of {len} bytes)",
            message.len()
        ))),
        std::cmp::Ordering::Greater => Err(Status::invalid_argument(
            "a unary call carries one message; this body carries more",
        )),
    }
}

fn too_large(len: usize) -> Status {
    Status::out_of_range(format!(
        "Error, decoded message length too large: found {len} bytes, the limit is: {MAX_REQUEST_BYTES} bytes"
    ))
}

/// The answer as a gRPC response: headers, the one message, trailers saying OK.
fn respond(answer: &Answer, headers: &HeaderSet) -> GrpcResponse {
    let mut message = BytesMut::with_capacity(ANSWER_CAPACITY);
    message.put_slice(&[0; PREFIX_BYTES]);
    answer.encode(headers, &mut message);
    let len = message.len() - PREFIX_BYTES;
    // An answer is a few hundred bytes; one past 4 GiB cannot be framed, so it is an error.
    let Ok(len) = u32::try_from(len) else {
        return Status::internal("the answer is too large to send").into_http();
    };
    message[1..PREFIX_BYTES].copy_from_slice(&len.to_be_bytes());
    let mut response = http::Response::new(tonic::body::Body::new(AnswerBody {
        message: Some(message.freeze()),
        ok: true,
    }));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        tonic::metadata::GRPC_CONTENT_TYPE,
    );
    response
}

/// A unary answer's body: its message, then `grpc-status: 0`.
struct AnswerBody {
    message: Option<Bytes>,
    /// The trailers are still to send.
    ok: bool,
}

impl http_body::Body for AnswerBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(message) = self.message.take() {
            return Poll::Ready(Some(Ok(Frame::data(message))));
        }
        if std::mem::take(&mut self.ok) {
            let mut trailers = http::HeaderMap::with_capacity(1);
            trailers.insert(Status::GRPC_STATUS, http::HeaderValue::from_static("0"));
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.message.is_none() && !self.ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(flag: u8, declared: u32, message: &[u8]) -> Bytes {
        let mut body = vec![flag];
        body.extend_from_slice(&declared.to_be_bytes());
        body.extend_from_slice(message);
        Bytes::from(body)
    }

    #[test]
    fn a_body_of_one_message_gives_the_message() {
        let message = one_message(framed(0, 3, b"abc")).unwrap();
        assert_eq!(&message[..], b"abc");
        assert!(one_message(framed(0, 0, b"")).unwrap().is_empty());
    }

    #[test]
    fn a_body_that_is_not_one_message_is_an_invalid_argument() {
        let code = |body: Bytes| one_message(body).unwrap_err().code();
        assert_eq!(code(Bytes::new()), tonic::Code::InvalidArgument);
        assert_eq!(
            code(Bytes::from_static(&[0, 0, 0])),
            tonic::Code::InvalidArgument
        );
        // Compressed without a grpc-encoding, or a flag gRPC does not define.
        assert_eq!(code(framed(1, 3, b"abc")), tonic::Code::InvalidArgument);
        assert_eq!(code(framed(7, 3, b"abc")), tonic::Code::InvalidArgument);
        // Shorter or longer than its prefix says.
        assert_eq!(code(framed(0, 4, b"abc")), tonic::Code::InvalidArgument);
        assert_eq!(code(framed(0, 2, b"abc")), tonic::Code::InvalidArgument);
        // Past the limit, whatever follows; u32::MAX is the largest a prefix can say.
        assert_eq!(code(framed(0, u32::MAX, b"abc")), tonic::Code::OutOfRange);
        let limit = MAX_REQUEST_BYTES as u32;
        assert_eq!(code(framed(0, limit + 1, b"")), tonic::Code::OutOfRange);
        assert_eq!(code(framed(0, limit, b"")), tonic::Code::InvalidArgument);
    }
}
