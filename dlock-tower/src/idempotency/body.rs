//! [`ResponseBody`], the response body of [`Idempotency`](super::Idempotency).

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The response body of [`Idempotency`](super::Idempotency): the inner service's body `B`,
    /// or bytes the layer holds (a replay, a rejection, a response it read to store it).
    ///
    /// It is an [`http_body::Body`] with `B`'s data (`Bytes`) and error types, so it works
    /// wherever `B` does: axum's `Router::layer`/`route_layer` (which accept any such body),
    /// hyper's server, or `http_body_util::BodyExt::collect`.
    pub struct ResponseBody<B>
    where
        B: Body,
    {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B>
    where
        B: Body,
    {
        // Bytes held by the layer; `None` once yielded.
        Full { data: Option<Bytes> },
        // The inner service's body, untouched.
        Inner { #[pin] body: B },
        // A body the layer started reading and gave back: what was read, the frame (or error)
        // that stopped the reading, then the rest.
        Chain {
            prefix: Option<Bytes>,
            pending: Option<Result<Frame<Bytes>, B::Error>>,
            rest: Pin<Box<B>>,
            failed: bool,
        },
    }
}

impl<B: Body> ResponseBody<B> {
    pub(crate) fn full(data: Bytes) -> Self {
        ResponseBody {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    pub(crate) fn inner(body: B) -> Self {
        ResponseBody {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn chain(
        prefix: Bytes,
        pending: Option<Result<Frame<Bytes>, B::Error>>,
        rest: Pin<Box<B>>,
    ) -> Self {
        ResponseBody {
            kind: Kind::Chain {
                prefix: (!prefix.is_empty()).then_some(prefix),
                pending,
                rest,
                failed: false,
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Chain {
                prefix,
                pending,
                rest,
                failed,
            } => {
                if *failed {
                    return Poll::Ready(None);
                }
                if let Some(p) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(p))));
                }
                if let Some(p) = pending.take() {
                    *failed = p.is_err();
                    return Poll::Ready(Some(p));
                }
                rest.as_mut().poll_frame(cx)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Chain {
                prefix,
                pending,
                rest,
                failed,
            } => *failed || (prefix.is_none() && pending.is_none() && rest.is_end_stream()),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Inner { body } => body.size_hint(),
            Kind::Chain {
                prefix,
                pending,
                rest,
                ..
            } => {
                let held = prefix.as_ref().map_or(0, |p| p.len() as u64)
                    + match pending {
                        Some(Ok(frame)) => frame.data_ref().map_or(0, |d| d.len() as u64),
                        _ => 0,
                    };
                let inner = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower().saturating_add(held));
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper.saturating_add(held));
                }
                hint
            }
        }
    }
}

impl<B: Body> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Full { .. } => "held by the layer",
            Kind::Inner { .. } => "inner",
            Kind::Chain { .. } => "inner, partly read",
        };
        f.debug_struct("ResponseBody")
            .field("kind", &kind)
            .finish_non_exhaustive()
    }
}
