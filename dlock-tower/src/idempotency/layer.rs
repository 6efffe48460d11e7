use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::{LockError, Locker};
use http::header::HeaderName;
use http::Method;
use tower_layer::Layer;

use super::record::NEVER_REPLAYED;
use super::{Idempotency, MissingIdentity, Shared};

/// Makes `POST` and `PATCH` (by default) requests that carry an `Idempotency-Key` run once,
/// and answers retries with the stored response. See the [module docs](crate::idempotency)
/// for the lifecycle, every response and the crash semantics.
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::post, Router};
/// use dlock_runtime::Locker;
/// use dlock_tower::IdempotencyLayer;
///
/// #[derive(Clone)]
/// struct UserId(u64);
/// impl std::fmt::Display for UserId {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         self.0.fmt(f)
///     }
/// }
///
/// let locker = Locker::memory();
/// let app: Router = Router::new()
///     .route("/payments", post(|| async { "paid" }))
///     .route_layer(
///         IdempotencyLayer::new(locker)
///             .identity::<UserId>() // keys are per user when an auth layer set a `UserId`
///             .retention(Duration::from_secs(24 * 60 * 60))
///             .replay_header("x-payment-id"),
///     );
/// ```
#[must_use]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
}

impl IdempotencyLayer {
    /// Idempotency with `locker`'s backend and the defaults documented on each setter.
    ///
    /// # Panics
    /// If the locker's backend does not store idempotency records (Redlock, ZooKeeper); use
    /// [`try_new`](IdempotencyLayer::try_new) to get an error instead.
    pub fn new(locker: Locker) -> Self {
        match Self::try_new(locker) {
            Ok(layer) => layer,
            Err(e) => panic!("dlock_tower::IdempotencyLayer: {e}"),
        }
    }

    /// Like [`new`](IdempotencyLayer::new), but a backend that does not store idempotency
    /// records (Redlock, ZooKeeper) is a [`LockError::Unavailable`] naming it.
    pub fn try_new(locker: Locker) -> Result<Self, LockError> {
        locker.check_idempotency()?;
        Ok(IdempotencyLayer {
            shared: Arc::new(Shared::new(locker)),
        })
    }

    /// The methods the layer applies to; other methods pass through untouched. Default:
    /// `POST` and `PATCH` (the draft's non-idempotent methods; `PUT` and `DELETE` are
    /// idempotent by definition).
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        Arc::make_mut(&mut self.shared).methods = methods.into_iter().collect();
        self
    }

    /// The request header carrying the key. Default: `Idempotency-Key`.
    ///
    /// # Panics
    /// If `name` is not a valid header name.
    pub fn header<N>(mut self, name: N) -> Self
    where
        N: TryInto<HeaderName>,
        N::Error: fmt::Debug,
    {
        let name = name.try_into().unwrap_or_else(|e| {
            panic!("dlock_tower::IdempotencyLayer: invalid header name: {e:?}")
        });
        Arc::make_mut(&mut self.shared).header = name;
        self
    }

    /// The longest accepted key, in bytes (after removing the Structured Field quotes). A
    /// longer key is answered `400`. Default: [`DEFAULT_MAX_KEY_LEN`](super::DEFAULT_MAX_KEY_LEN)
    /// (255).
    pub fn max_key_len(mut self, len: usize) -> Self {
        Arc::make_mut(&mut self.shared).max_key_len = len;
        self
    }

    /// Scopes keys by the `T` an earlier layer (authentication) put in the request extensions:
    /// the lock key becomes `idem:<T's Display>:<key>`, so one user can never replay, block or
    /// probe another user's request by sending the same key. The scope is `T`'s text, not `T`:
    /// layers on one locker with identity types that print alike share keys unless their
    /// lockers have different [prefixes](dlock_runtime::LockerBuilder::prefix) (see
    /// [the key](super#the-key)). A request without a `T` is
    /// refused with `401` unless [`missing_identity`](IdempotencyLayer::missing_identity) says
    /// otherwise; one whose `T` cannot be formatted (its `Display` returns an error) with
    /// `500`, whatever that says. Default: no identity (every client shares one key space, so
    /// keys must be unguessable, e.g. UUIDv4).
    pub fn identity<T>(mut self) -> Self
    where
        T: fmt::Display + Send + Sync + 'static,
    {
        Arc::make_mut(&mut self.shared).identity =
            Some(Arc::new(|extensions: &http::Extensions| {
                // Not `to_string`, which panics when `Display` fails: such a request is answered
                // 500, never put in another identity's key space or the shared one.
                let Some(id) = extensions.get::<T>() else {
                    return Ok(None);
                };
                let mut out = String::new();
                fmt::write(&mut out, format_args!("{id}"))?;
                Ok(Some(out))
            }));
        self
    }

    /// Like [`identity`](IdempotencyLayer::identity), with a function of the request
    /// extensions (`None`: the request has no identity).
    pub fn identity_fn<F>(mut self, f: F) -> Self
    where
        F: Fn(&http::Extensions) -> Option<String> + Send + Sync + 'static,
    {
        Arc::make_mut(&mut self.shared).identity =
            Some(Arc::new(move |e: &http::Extensions| Ok(f(e))));
        self
    }

    /// What a request without the configured identity gets. Default:
    /// [`MissingIdentity::Reject`] (`401` + problem+json); [`MissingIdentity::SharedSpace`]
    /// lets it use the shared key space. No effect without an
    /// [`identity`](IdempotencyLayer::identity).
    pub fn missing_identity(mut self, missing: MissingIdentity) -> Self {
        Arc::make_mut(&mut self.shared).missing_identity = missing;
        self
    }

    /// The lease of a key's lock while its first request runs. Default: the locker's default
    /// TTL ([`Locker::default_ttl`], 30 s unless configured).
    ///
    /// The watchdog renews the lease while the handler runs, so this does not limit how long
    /// a request may take: it is how long a key stays blocked (`409`) after the process
    /// running its first request died, and what `Retry-After` counts down from. Must be
    /// within [`MIN_TTL`](dlock_runtime::MIN_TTL)..=[`MAX_TTL`](dlock_runtime::MAX_TTL); an
    /// invalid TTL makes every covered request fail with 500.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        Arc::make_mut(&mut self.shared).ttl = Some(ttl);
        self
    }

    /// How long a stored response is replayed. Default: 24 hours
    /// ([`DEFAULT_RETENTION`](dlock_runtime::idempotency::DEFAULT_RETENTION)). After it, the
    /// key is free and a request with it runs as a new one. An invalid retention (under
    /// 10 ms, over 365 days) makes every covered request fail with 500.
    pub fn retention(mut self, retention: Duration) -> Self {
        Arc::make_mut(&mut self.shared).retention = retention;
        self
    }

    /// The largest request body read to compute the fingerprint; a larger one is answered
    /// `413` with problem+json (declared by its size or found while reading). Default:
    /// [`DEFAULT_MAX_REQUEST_BODY`](super::DEFAULT_MAX_REQUEST_BODY) (1 MiB).
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.shared).max_request_body = bytes;
        self
    }

    /// The largest response body stored. A larger response still reaches the client in full
    /// but is **not** stored: the key is freed and a retry runs the handler again — set it
    /// above your largest response. Default:
    /// [`DEFAULT_MAX_RESPONSE_BODY`](super::DEFAULT_MAX_RESPONSE_BODY) (1 MiB).
    ///
    /// On etcd a record is one write, and etcd refuses a request over its
    /// `--max-request-bytes` (1.5 MiB by default): above about 1.4 MiB, raise that too, or a
    /// record that size fails to store (logged at `warn`) and its retries run again. Every
    /// record also counts against etcd's storage quota (`--quota-backend-bytes`, 2 GiB by
    /// default) until its retention ends and a compaction frees it; a full quota refuses every
    /// write, locks included.
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.shared).max_response_body = bytes;
        self
    }

    /// How long the layer waits for the handler's response body to end, to store it, before
    /// it sends what it read and streams the rest unstored (the key is freed; a retry runs the
    /// handler again). Default: [`DEFAULT_MAX_RESPONSE_WAIT`](super::DEFAULT_MAX_RESPONSE_WAIT)
    /// (30 s). The body is read whole before any of it is sent, so without a bound a streamed
    /// response (server-sent events, a long poll) would keep its client waiting and its key
    /// answering `409` for as long as it streams.
    pub fn max_response_wait(mut self, wait: Duration) -> Self {
        Arc::make_mut(&mut self.shared).max_response_wait = wait;
        self
    }

    /// Whether dropping the response future — the client disconnects, a timeout layer outside
    /// gives up — cancels the handler. Default `false`: once the key is taken, the handler
    /// runs to its end in a tokio task of its own and its response is stored, so the client's
    /// retry gets `409` while it runs, then the replay (see the
    /// [module docs](super#crashes-and-cancellation)). `true`: the handler's future is dropped
    /// with the response future and the key freed without a record; the retry runs the
    /// handler again. With the default, put layers that bound handlers (a timeout, a
    /// concurrency limit) inside this one: outside, they no longer bound a handler whose
    /// client went away. When a lock is held outside this layer (a lock or defer layer
    /// wrapping it), the handler is cancelled with it whatever this setting: see
    /// [with the lock and defer layers](super#with-the-lock-and-defer-layers).
    pub fn cancel_on_disconnect(mut self, cancel: bool) -> Self {
        Arc::make_mut(&mut self.shared).cancel_on_disconnect = cancel;
        self
    }

    /// The handlers this layer (and every clone of it, and the services it makes) runs in
    /// tasks of their own, for a shutdown to wait for: see
    /// [crashes and cancellation](super#crashes-and-cancellation).
    pub fn in_flight(&self) -> super::InFlight {
        self.shared.in_flight.clone()
    }

    /// Also stores and replays the response header `name` (in addition to
    /// [`DEFAULT_REPLAY_HEADERS`](super::DEFAULT_REPLAY_HEADERS)), e.g. an `x-payment-id`.
    ///
    /// # Panics
    /// If `name` is not a valid header name, or is one that is never replayed: `set-cookie`,
    /// `date`, `age`, `content-length`, `idempotent-replayed` and the hop-by-hop fields.
    pub fn replay_header<N>(mut self, name: N) -> Self
    where
        N: TryInto<HeaderName>,
        N::Error: fmt::Debug,
    {
        let name = name.try_into().unwrap_or_else(|e| {
            panic!("dlock_tower::IdempotencyLayer: invalid header name: {e:?}")
        });
        assert!(
            !NEVER_REPLAYED.contains(&name.as_str()),
            "dlock_tower::IdempotencyLayer: `{name}` is never replayed"
        );
        let shared = Arc::make_mut(&mut self.shared);
        if !shared.replay_headers.contains(&name) {
            shared.replay_headers.push(name);
        }
        self
    }

    crate::layer_common_setters!(
        missing_key: "What a covered request without a key gets. Default: [`MissingKey::Reject`](crate::MissingKey::Reject), \
            `400` with a problem+json body of type `urn:dlock:problem:idempotency-key-missing`. \
            [`MissingKey::PassThrough`](crate::MissingKey::PassThrough) makes the key optional.",
        fail_mode: "What a covered request gets when the backend is unavailable. Default: \
            [`FailMode::Closed`](crate::FailMode::Closed) (`503` + `Retry-After`). [`FailMode::Open`](crate::FailMode::Open) calls the handler \
            without idempotency (logged at `warn`): duplicates may then run twice."
    );
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::from_parts(inner, self.shared.clone())
    }
}

impl Clone for IdempotencyLayer {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            shared: self.shared.clone(),
        }
    }
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("shared", &self.shared)
            .finish()
    }
}
