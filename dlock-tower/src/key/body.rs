//! [`body_digest`]: a digest of the request body, read up to a size limit.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use dlock_runtime::BoxError;
use http::request::Parts;
use http::Request;
use http_body::Body;
use pin_project_lite::pin_project;
use sha2::{Digest, Sha256};

use super::{combinators, ExtractKey, Extracted, Key};
use crate::Rejection;

/// Keys requests by the SHA-256 of their body: `body:sha256:<hex>`. Two requests with the same
/// payload share a lock, e.g. to stop a double-clicked form from being processed twice.
///
/// The body is read into memory, at most `limit` bytes, and handed on to the inner service
/// intact as `B::from(bytes)` (so the body type must implement `From<Bytes>`, as axum's
/// `Body` and http-body-util's `Full<Bytes>` do; hyper's `Incoming` does not: map it into one
/// of those first). A body longer than `limit` (by its declared size or as it is read) is
/// answered with `413 Payload Too Large` and an `application/problem+json` body, as is one a
/// body limit outside cuts off (tower-http's `RequestBodyLimitLayer`); a body that fails to read
/// otherwise with 400. Trailers are not handed on. An empty body has a key too (the
/// digest of nothing).
///
/// Usually combined with the endpoint, so that equal payloads to different endpoints do not
/// contend:
///
/// ```
/// use dlock_tower::key;
/// let same_payload_same_endpoint = key::method_path().and(key::body_digest(64 * 1024));
/// # let _ = same_payload_same_endpoint;
/// ```
pub fn body_digest(limit: usize) -> BodyDigest {
    BodyDigest { limit }
}

/// The extractor of [`body_digest`].
#[derive(Clone, Copy, Debug)]
pub struct BodyDigest {
    limit: usize,
}

combinators!(BodyDigest);

impl BodyDigest {
    /// The largest body read, in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }
}

impl<B> ExtractKey<B> for BodyDigest
where
    B: Body + From<Bytes>,
    B::Error: Into<BoxError>,
{
    type Future = BodyDigestFuture<B>;

    fn extract(&mut self, request: Request<B>) -> Self::Future {
        let (parts, body) = request.into_parts();
        // A declared length over the limit is refused at once; under it, the buffer grows
        // with the bytes that actually arrive. Reserving the declared `Content-Length` up front
        // would let a client that sends nothing hold `limit` bytes per connection.
        let too_large = body.size_hint().lower() > self.limit as u64;
        BodyDigestFuture {
            body,
            parts: Some(parts),
            buf: BytesMut::new(),
            limit: self.limit,
            too_large,
        }
    }
}

pin_project! {
    /// The future of [`BodyDigest`]: reads the body, up to the limit.
    pub struct BodyDigestFuture<B> {
        #[pin]
        body: B,
        parts: Option<Parts>,
        buf: BytesMut,
        limit: usize,
        too_large: bool,
    }
}

impl<B> Future for BodyDigestFuture<B>
where
    B: Body + From<Bytes>,
    B::Error: Into<BoxError>,
{
    type Output = Extracted<B>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if *this.too_large {
            return Poll::Ready(Err(Rejection::body_too_large(*this.limit)));
        }
        loop {
            match ready!(this.body.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers
                    };
                    let n = bytes::Buf::remaining(&data);
                    if this.buf.len().saturating_add(n) > *this.limit {
                        *this.too_large = true;
                        return Poll::Ready(Err(Rejection::body_too_large(*this.limit)));
                    }
                    this.buf.put(data);
                }
                Some(Err(e)) => return Poll::Ready(Err(Rejection::unreadable_body(e.into()))),
                None => break,
            }
        }
        let parts = this
            .parts
            .take()
            .expect("BodyDigestFuture polled after completion");
        let bytes: Bytes = this.buf.split().freeze();
        let hex = crate::hex::encode(&Sha256::digest(&bytes));
        let key = Key::new("body").lit("sha256").value(hex.as_str());
        Poll::Ready(Ok((Request::from_parts(parts, B::from(bytes)), Some(key))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::{Frame, SizeHint};

    /// Declares `len` bytes and never sends them.
    struct Stalled(u64);

    impl Body for Stalled {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Pending
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.0)
        }
    }

    impl From<Bytes> for Stalled {
        fn from(_: Bytes) -> Self {
            Stalled(0)
        }
    }

    #[test]
    fn a_declared_length_reserves_nothing_before_the_bytes_arrive() {
        let limit = 1 << 20;
        let request = Request::new(Stalled(limit as u64));
        let mut fut = Box::pin(body_digest(limit).extract(request));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        assert!(
            fut.buf.capacity() < 64 * 1024,
            "reserved {} bytes for a body that sent none",
            fut.buf.capacity()
        );
        // Over the limit is still refused at once.
        let request = Request::new(Stalled(limit as u64 + 1));
        let mut fut = Box::pin(body_digest(limit).extract(request));
        assert!(matches!(fut.as_mut().poll(&mut cx), Poll::Ready(Err(_))));
    }
}
