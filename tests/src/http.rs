//! HTTP helpers shared by the tower-layer tests (feature `http`): an axum app served on a
//! free loopback port, a hyper-util client, a body streamed in chunks of unknown total size,
//! reading a body as text, and a stand-in "auth layer" that puts a [`UserId`] in the request
//! extensions.
//!
//! ```no_run
//! # async fn demo() {
//! use axum::routing::get;
//! use dlock_tests::http::{client, serve, text};
//!
//! let (addr, server) = serve(axum::Router::new().route("/", get(|| async { "hi" }))).await;
//! let req = http::Request::get(format!("http://{addr}/")).body(Default::default()).unwrap();
//! assert_eq!(text(client().request(req).await.unwrap()).await, "hi");
//! server.abort();
//! # }
//! ```

use std::convert::Infallible;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinHandle;

/// Serves `app` on `127.0.0.1:<free port>`; returns the address and the server's task (abort
/// it to stop serving).
///
/// # Panics
/// If no loopback port can be bound; the task panics if serving fails.
pub async fn serve(app: axum::Router) -> (SocketAddr, JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        axum::serve(listener, app).into_future().await.unwrap();
    });
    (addr, server)
}

/// A plain HTTP/1 client sending [`Full`] bodies.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A new [`HttpClient`] (its own connection pool).
pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// The whole body of `res`, as UTF-8 text.
///
/// # Panics
/// If the body fails or is not UTF-8.
pub async fn text<B>(res: Response<B>) -> String
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// A body that yields its chunks one by one and does not announce its size.
#[derive(Debug)]
pub struct Chunked(pub Vec<Bytes>);

impl http_body::Body for Chunked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.0.is_empty() {
            Poll::Ready(None)
        } else {
            Poll::Ready(Some(Ok(Frame::data(self.0.remove(0)))))
        }
    }
}

/// The authenticated user, as an auth layer would put it in the request extensions.
#[derive(Clone, Debug)]
pub struct UserId(pub u64);

impl std::fmt::Display for UserId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The "auth layer" of the tests, for `tower::util::MapRequestLayer::new(user_from_header)`:
/// puts `UserId(n)` in the extensions when the request has a header `x-user: <n>`.
pub fn user_from_header<B>(mut req: Request<B>) -> Request<B> {
    let user = req
        .headers()
        .get("x-user")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .map(UserId);
    if let Some(user) = user {
        req.extensions_mut().insert(user);
    }
    req
}
