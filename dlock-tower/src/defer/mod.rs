//! Defer per request (feature `defer`): when a request's lock is busy, answer `202 Accepted` at once and run the
//! request later, when the lock frees — durably, through the runtime's Redis job queue.
//!
//! [`DeferLayer`] takes the request's lock like [`DistributedLockLayer`](crate::DistributedLockLayer)
//! (one attempt). If the lock is free it calls the inner service under the lock. If it is busy it
//! stores the request — method, URI, headers (minus hop-by-hop ones, those its `Connection`
//! names included) and body (up to a limit; larger is `413`) — as a job in a [`DurableQueue`]
//! and answers
//!
//! ```text
//! 202 Accepted
//! Location: <status path>/<job id>
//! Content-Type: application/json
//!
//! {"status":202,"title":"Accepted","job_id":"…","status_url":"<status path>/<job id>"}
//! ```
//!
//! with a [`Deferred`](crate::Deferred) response extension (the job id): an
//! [`IdempotencyLayer`](crate::IdempotencyLayer) outside this layer does not store that `202`
//! as the key's outcome, so the replay, which goes through the idempotency layer, runs the
//! handler once and stores its response (see
//! [deferred requests](crate::idempotency#deferred-requests), also for a layer with an
//! identity: the replay must be authenticated again). Put the idempotency layer outside this
//! one. Inside, it runs the handler in this layer's future, so a client that goes away cuts
//! the handler off before the lock is released, and the retry runs it again.
//!
//! A request without a key gets `400` ([`MissingKey::Reject`](crate::MissingKey), the default)
//! or passes through without a lock ([`MissingKey::PassThrough`](crate::MissingKey)); when the
//! lock backend is down the layer answers `503` ([`FailMode::Closed`](crate::FailMode), the
//! default) or calls the service without a lock ([`FailMode::Open`](crate::FailMode)) — the same
//! setters and defaults as [`DistributedLockLayer`](crate::DistributedLockLayer).
//!
//! A [`replay_worker`] — one per instance, like any [`DurableWorker`](dlock_runtime::durable::DurableWorker) — claims the job when it is
//! due, takes the same lock, and replays the request through the service you give it, which must
//! be the application **without** the `DeferLayer` (the worker already holds the lock; going
//! through the layer again would find it busy). The stored URI is the one the client sent —
//! inside axum's `Router::nest`, with the `axum` feature, the whole path, not the nested
//! router's rest — so that service is the whole application. The response status is recorded as the job's
//! result; [`status_response`] serves it (for the queue's retention period) at the status path.
//! A busy lock on replay defers the job again with the policy's backoff, up to its attempts,
//! then dead-letters it. A replay whose response is a 5xx still counts as run: the handler ran,
//! and running it again could repeat its effects.
//!
//! Delivery is at least once (see `dlock_runtime::defer`'s durable queue): a replay can run
//! twice if its worker dies mid-request, so the handler should fence its writes with the
//! [`LockInfo`](dlock_runtime::LockInfo) it finds in the request extensions. A request can
//! also run twice when the queue did not answer its enqueue in time (a slow link, a failover):
//! the layer answers `503` with `Retry-After`, but the job may be queued all the same (its
//! answer was lost), and a client that retries runs the request again — now, or as a second
//! job. Make such handlers' effects idempotent at the resource (record a client-sent key with
//! the write), since neither the lock nor the fencing token tells a repeat.
//!
//! Credential headers are not stored by default: `Authorization`, `Cookie`,
//! `Proxy-Authorization`, and the API-key and token headers in common use (`X-Api-Key`,
//! `Api-Key`, `X-Auth-Token`, `X-Access-Token`, `X-Amz-Security-Token`, `X-Goog-Api-Key`,
//! `X-CSRF-Token`, `X-XSRF-Token`), and those that authenticating proxies set
//! (`X-Forwarded-Access-Token`, `X-Auth-Request-Access-Token`, `Cf-Access-Jwt-Assertion`,
//! `X-Amzn-Oidc-AccessToken`, `X-Amzn-Oidc-Data`), and every header whose name contains
//! `token`, `secret`, `jwt`, `authorization`, `api-key`, `apikey`, `password`, `cookie`,
//! `credential`, `session`, `auth-key`, `access-key`, `private-key`, `master-key`,
//! `subscription-key` or `functions-key` (Azure App Service's `X-MS-TOKEN-AAD-*`, Google IAP's
//! `X-Goog-IAP-JWT-Assertion`, GitLab's `Private-Token`, `X-Vault-Token`, …) are left out of
//! the stored request (so the replay runs without them) unless you opt a header in by name with
//! [`DeferLayer::store_header`] — it then sits in your Redis for as long as the job lives (a dead letter for the queue's
//! dead-letter retention, 7 days by default). List your own with
//! [`DeferLayer::exclude_header`]. **The URI is stored as sent**, query string included: a
//! token in the query (`?access_token=…`) is stored with it — keep credentials out of the URIs
//! of deferred routes.
//!
//! **Order.** Requests for one key are not kept in order: a request that finds the lock free
//! runs at once, ahead of an earlier one deferred for that key, and two deferred ones may run in
//! either order (jitter). The replay takes the lock later, so it has the *newer* fencing token
//! and a fenced resource accepts its write. Defer requests whose order does not matter
//! (appending, idempotent creates); for whole-state writes (`PUT` of a document) use the lock
//! layer with `on_fail`-style rejection or waiting instead.
//!
//! The queue is bounded ([`QueueLimits::max_queued`](dlock_runtime::defer::QueueLimits)): when it
//! is full, a busy request gets `503 Service Unavailable` with `Retry-After` (problem type
//! `urn:dlock:problem:defer-queue-full`) and nothing already queued is lost. Each job is
//! bounded too ([`QueueLimits::max_job_bytes`](dlock_runtime::defer::QueueLimits), 4 MiB): a
//! busy request whose stored form — its body hex-encoded, with its URI and stored headers — is
//! larger gets `413` (`urn:dlock:problem:defer-job-too-large`) and is not queued; the default
//! holds a request at the default body limit. Raise both together. A stored request that
//! cannot be rebuilt (corrupt data) is dead-lettered at once with the reason.

use std::time::Duration;

use dlock_runtime::durable::DurableQueue;
use dlock_runtime::DeferPolicy;
use dlock_runtime::Locker;
use http::{header, HeaderName};

use crate::{FailMode, MissingKey};

mod future;
mod layer;
mod replay;
mod service;

pub use self::future::ResponseFuture;
pub use self::layer::DeferLayer;
pub use self::replay::{replay_worker, status_response, ReplayRequest, Replayer};
pub use self::service::Defer;

const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Headers that carry credentials: never stored unless opted in with
/// [`DeferLayer::store_header`]. The standard ones, and the API-key and token headers in
/// common use.
const CREDENTIALS: [HeaderName; 16] = [
    header::AUTHORIZATION,
    header::COOKIE,
    header::PROXY_AUTHORIZATION,
    HeaderName::from_static("x-api-key"),
    HeaderName::from_static("api-key"),
    HeaderName::from_static("x-auth-token"),
    HeaderName::from_static("x-access-token"),
    HeaderName::from_static("x-amz-security-token"),
    HeaderName::from_static("x-goog-api-key"),
    HeaderName::from_static("x-csrf-token"),
    HeaderName::from_static("x-xsrf-token"),
    // Set by authenticating proxies in front of the service (oauth2-proxy, Cloudflare Access,
    // AWS ALB): each is the user's token or a signed assertion of who they are.
    HeaderName::from_static("x-forwarded-access-token"),
    HeaderName::from_static("x-auth-request-access-token"),
    HeaderName::from_static("cf-access-jwt-assertion"),
    HeaderName::from_static("x-amzn-oidc-accesstoken"),
    HeaderName::from_static("x-amzn-oidc-data"),
];

/// Configuration shared by the layer and every service and future it makes.
#[derive(Clone, Debug)]
pub(crate) struct Shared {
    pub(crate) locker: Locker,
    pub(crate) queue: DurableQueue,
    pub(crate) policy: DeferPolicy,
    pub(crate) ttl: Option<Duration>,
    pub(crate) fail_mode: FailMode,
    /// The lock's bounded name in metrics and traces.
    pub(crate) name: &'static str,
    pub(crate) missing_key: MissingKey,
    pub(crate) status_path: String,
    pub(crate) body_limit: usize,
    pub(crate) excluded: Vec<HeaderName>,
    pub(crate) stored_credentials: Vec<HeaderName>,
}

impl Shared {
    pub(crate) fn new(locker: Locker, queue: DurableQueue) -> Self {
        Shared {
            locker,
            queue,
            policy: DeferPolicy::default(),
            ttl: None,
            fail_mode: FailMode::default(),
            name: dlock_runtime::metrics::UNNAMED,
            missing_key: MissingKey::default(),
            status_path: "/jobs".to_owned(),
            body_limit: 1 << 20,
            excluded: Vec::new(),
            stored_credentials: Vec::new(),
        }
    }

    /// The lease of each request's lock (and of its replay).
    pub(crate) fn ttl(&self) -> Duration {
        self.ttl.unwrap_or_else(|| self.locker.default_ttl())
    }

    /// The headers of a request that go into its stored copy (see [`stores`]).
    pub(crate) fn stored_headers<'a>(
        &'a self,
        headers: &'a http::HeaderMap,
    ) -> impl Iterator<Item = (&'a HeaderName, &'a http::HeaderValue)> + 'a {
        let named = connection_named(headers);
        headers
            .iter()
            .filter(move |(name, _)| stores(name, &named, &self.excluded, &self.stored_credentials))
    }
}

/// The headers a request's `Connection` header names: hop-by-hop for that one request
/// (RFC 9110 §7.6.1), whatever their names.
fn connection_named(headers: &http::HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty())
        .collect()
}

/// Whether header `name` goes into a stored request: not hop-by-hop (by the list, or named by
/// the request's `Connection`), not excluded, and not a credential unless opted in.
fn stores(
    name: &HeaderName,
    connection_named: &[String],
    excluded: &[HeaderName],
    opted_in: &[HeaderName],
) -> bool {
    !HOP_BY_HOP.contains(&name.as_str())
        && !connection_named.iter().any(|n| n == name.as_str())
        && !excluded.contains(name)
        && (!is_credential(name) || opted_in.contains(name))
}

/// Words that mark a header as a credential wherever they appear in its name: what the list
/// above does not name — `X-MS-TOKEN-AAD-REFRESH-TOKEN` (Azure App Service authentication),
/// `X-Goog-IAP-JWT-Assertion` (Google IAP), `X-Pomerium-Jwt-Assertion`, `Private-Token` and
/// `X-Gitlab-Token` (GitLab), `X-Vault-Token`, a `X-Client-Secret` or `X-Session-Id` of the
/// application's own. Before, only the list was left out, and those were stored in Redis for
/// as long as the job lived (dead letters: 7 days by default).
///
/// And the key headers of hosted services named otherwise: `X-Auth-Key` (Cloudflare's global
/// API key), `Ocp-Apim-Subscription-Key` (Azure API Management), `X-Functions-Key` (Azure
/// Functions), an `X-Access-Key`, `X-Master-Key` or `X-Private-Key` — not every name with
/// "key" in it: `Idempotency-Key` is stored on purpose, and a routing or partition key is the
/// request's own data.
const CREDENTIAL_WORDS: [&str; 16] = [
    "token",
    "secret",
    "jwt",
    "authorization",
    "api-key",
    "apikey",
    "password",
    "cookie",
    "credential",
    "session",
    "auth-key",
    "access-key",
    "private-key",
    "master-key",
    "subscription-key",
    "functions-key",
];

/// Whether header `name` carries a credential: on the list, or named with one of the words.
fn is_credential(name: &HeaderName) -> bool {
    // Header names are lowercase.
    CREDENTIALS.contains(name) || CREDENTIAL_WORDS.iter().any(|w| name.as_str().contains(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_not_stored_unless_opted_in_by_name() {
        let excluded = [HeaderName::from_static("x-secret")];
        let none: [HeaderName; 0] = [];
        for name in [
            header::AUTHORIZATION,
            header::COOKIE,
            header::PROXY_AUTHORIZATION,
            HeaderName::from_static("x-forwarded-access-token"),
            HeaderName::from_static("cf-access-jwt-assertion"),
        ] {
            assert!(
                !stores(&name, &[], &excluded, &none),
                "{name} stored by default"
            );
        }
        assert!(stores(&header::CONTENT_TYPE, &[], &excluded, &none));
        assert!(!stores(
            &HeaderName::from_static("x-secret"),
            &[],
            &excluded,
            &none
        ));
        assert!(!stores(&header::CONNECTION, &[], &excluded, &none));
        let opted = [header::AUTHORIZATION];
        assert!(stores(&header::AUTHORIZATION, &[], &excluded, &opted));
        assert!(!stores(&header::COOKIE, &[], &excluded, &opted));
    }

    /// The credential headers of authenticating proxies and services not on the list, and
    /// the application's own named like them, are left out too; other headers are stored.
    #[test]
    fn headers_named_like_credentials_are_not_stored() {
        for name in [
            "x-ms-token-aad-access-token",
            "x-ms-token-aad-id-token",
            "x-ms-token-aad-refresh-token",
            "x-goog-iap-jwt-assertion",
            "x-pomerium-jwt-assertion",
            "private-token",
            "x-gitlab-token",
            "x-vault-token",
            "x-client-secret",
            "x-session-id",
            "x-password",
            "x-upstream-authorization",
            "x-partner-api-key",
            "x-service-credentials",
            "x-auth-key",
            "ocp-apim-subscription-key",
            "x-functions-key",
            "x-access-key",
            "x-master-key",
            "x-private-key",
        ] {
            let name = HeaderName::from_static(name);
            assert!(!stores(&name, &[], &[], &[]), "{name} stored by default");
            assert!(
                stores(&name, &[], &[], std::slice::from_ref(&name)),
                "{name} not stored when opted in"
            );
        }
        for name in [
            "content-type",
            "x-request-id",
            "x-user",
            "idempotency-key",
            "x-partition-key",
            "accept",
        ] {
            let name = HeaderName::from_static(name);
            assert!(stores(&name, &[], &[], &[]), "{name} left out");
        }
    }

    #[test]
    fn headers_the_connection_header_names_are_not_stored() {
        let mut h = http::HeaderMap::new();
        h.append(header::CONNECTION, "keep-alive, X-Hop".parse().unwrap());
        h.append(header::CONNECTION, "x-other".parse().unwrap());
        h.insert("x-hop", "1".parse().unwrap());
        h.insert("x-other", "1".parse().unwrap());
        h.insert("proxy-connection", "keep-alive".parse().unwrap());
        h.insert("x-kept", "1".parse().unwrap());
        let named = connection_named(&h);
        let kept: Vec<_> = h
            .iter()
            .filter(|(n, _)| stores(n, &named, &[], &[]))
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(kept, ["x-kept"]);
    }
}
