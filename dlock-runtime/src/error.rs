//! [`LockError`], the one error type of the runtime, and its HTTP mapping.

use std::time::Duration;

/// A boxed error source, kept for `Error::source` chains.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong when taking, keeping or releasing a lock.
///
/// The variants separate the outcomes a caller handles differently:
///
/// | variant | meaning | HTTP ([`LockError::status`]) |
/// |---|---|---|
/// | [`Contended`](LockError::Contended) | someone else holds the lock (one attempt was made) | 409 + `Retry-After` |
/// | [`Timeout`](LockError::Timeout) | waited until the deadline, still held by someone else | 409 + `Retry-After` |
/// | [`Deferred`](LockError::Deferred) | the work was queued to run when the lock frees | 202 |
/// | [`Unavailable`](LockError::Unavailable) | the backend did not answer in time, or failed in a way that can pass (a failover, a restart, overload) | 503 + `Retry-After` |
/// | [`Misconfigured`](LockError::Misconfigured) | the backend refused in a way retrying does not change: authentication failed, no permission, the database or schema missing, the key holding other data | 500 |
/// | [`QueueFull`](LockError::QueueFull) | the lock was busy and the defer queue is at its bound | 503 + `Retry-After` |
/// | [`JobTooLarge`](LockError::JobTooLarge) | the work to defer is over the durable queue's bound for one job | 413 |
/// | [`InvalidKey`](LockError::InvalidKey) | empty, oversized or malformed key | 400 |
/// | [`InvalidTtl`](LockError::InvalidTtl) | zero or absurd TTL | 500 |
/// | [`InvalidPermits`](LockError::InvalidPermits) | a semaphore of zero permits | 500 |
/// | [`Lost`](LockError::Lost) | the lock expired or was taken over while held | 503 |
/// | [`NoLocker`](LockError::NoLocker) | the attribute ran with no default locker set | 500 |
/// | [`Unsupported`](LockError::Unsupported) | the backend cannot do what the request asks (replica acknowledgement on a backend without replicas) | 500 |
/// | [`Reentrant`](LockError::Reentrant) | the task asked by hand for a lock it already holds through the attribute or [`with_lock`](crate::with_lock) | 500 |
///
/// Match with a wildcard arm: the enum is `#[non_exhaustive]` and grows with the product
/// (the defer strategy adds "deferred").
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The lock is held by another owner and the strategy made a single attempt.
    #[error("lock `{key}` is held by another owner")]
    #[non_exhaustive]
    Contended {
        /// The logical key.
        key: String,
        /// How long until the holder's lease ends — or, when the lock is free but another
        /// waiter is first in line, until that waiter's turn lapses — when the backend knows.
        retry_after: Option<Duration>,
        /// A human-readable detail for the response (the attribute's `message`).
        detail: Option<String>,
    },
    /// Waiting (the retry strategy) reached its deadline while another owner held the lock.
    #[error("gave up waiting for lock `{key}` after {waited:?}")]
    #[non_exhaustive]
    Timeout {
        /// The logical key.
        key: String,
        /// How long the caller waited.
        waited: Duration,
        /// How long until the holder's lease ends — or, when the lock is free but another
        /// waiter is first in line, until that waiter's turn lapses — when the backend knows.
        retry_after: Option<Duration>,
        /// A human-readable detail for the response (the attribute's `message`).
        detail: Option<String>,
    },
    /// The lock was busy and the work was handed to a delay queue ([`OnFail::Defer`](crate::OnFail::Defer));
    /// it will run when the lock frees. Not a failure: HTTP 202 Accepted.
    #[error("lock `{key}` is busy; the work was deferred as job {job_id}")]
    #[non_exhaustive]
    Deferred {
        /// The logical key.
        key: String,
        /// The queue's id for the job (look it up in the queue).
        job_id: String,
    },
    /// The backend could not be reached, timed out or answered with an error.
    #[error("lock backend unavailable: {message}")]
    #[non_exhaustive]
    Unavailable {
        /// What failed, without secrets (no owner tokens, no passwords).
        message: String,
        /// The underlying error, if any.
        #[source]
        source: Option<BoxError>,
    },
    /// The backend cannot be used as configured, and retrying does not change that: its URL is
    /// invalid, the credentials are wrong, the user lacks a permission (a Redis ACL, a Postgres
    /// grant, an etcd role, a ZooKeeper ACL), the database, schema or table is missing, or the
    /// key holds data that is not this crate's. An operator has to act, so it is not an outage:
    /// a wait [through outages](crate::RetryPolicy::through_outages) ends with it at once, a
    /// fail-open layer does not open on it, and a durable job it stops counts the attempt
    /// (it is dead-lettered after its attempts rather than put back for ever). HTTP 500.
    #[error("lock backend refused the request: {message}")]
    #[non_exhaustive]
    Misconfigured {
        /// What was refused, without secrets (no owner tokens, no passwords).
        message: String,
        /// The underlying error, if any.
        #[source]
        source: Option<BoxError>,
    },
    /// The lock was busy and the work should have been deferred, but the queue already holds
    /// its configured maximum of jobs (`defer::QueueLimits::max_queued`).
    /// Nothing was queued and nothing already queued was dropped: try again later.
    #[error("lock `{key}` is busy and the defer queue `{queue}` is full")]
    #[non_exhaustive]
    QueueFull {
        /// The logical key.
        key: String,
        /// The queue's name (`memory` for the in-process queue).
        queue: String,
        /// When to try again (the queue's drain is not predictable; one second by default).
        retry_after: Duration,
    },
    /// The work should have been deferred, but its stored form is larger than the durable
    /// queue takes (`defer::QueueLimits::max_job_bytes`). Nothing was queued; trying again
    /// does not change that: HTTP 413.
    #[error("the job for lock `{key}` is {bytes} bytes, over the {max} bytes defer queue `{queue}` takes")]
    #[non_exhaustive]
    JobTooLarge {
        /// The logical key.
        key: String,
        /// The queue's name.
        queue: String,
        /// The size of the job's stored form.
        bytes: usize,
        /// The queue's bound.
        max: usize,
    },
    /// The key is empty, too long or otherwise unusable.
    #[error("invalid lock key: {reason}")]
    #[non_exhaustive]
    InvalidKey {
        /// Why the key was refused.
        reason: String,
    },
    /// The TTL is zero or outside [`MIN_TTL`](crate::MIN_TTL)..=[`MAX_TTL`](crate::MAX_TTL).
    #[error("invalid lock ttl {ttl:?}: {reason}")]
    #[non_exhaustive]
    InvalidTtl {
        /// The TTL that was refused.
        ttl: Duration,
        /// Why it was refused.
        reason: String,
    },
    /// A semaphore was asked for with zero permits ([`Locker::semaphore`](crate::Locker::semaphore)).
    #[error("invalid semaphore: {permits} permits (at least 1)")]
    #[non_exhaustive]
    InvalidPermits {
        /// The count that was refused.
        permits: u32,
    },
    /// The lock was lost while held: its lease ran out (renewal failed, the process froze) or
    /// another owner holds it now.
    #[error("lock `{key}` was lost")]
    #[non_exhaustive]
    Lost {
        /// The logical key.
        key: String,
    },
    /// The `#[distributed_lock]` attribute ran with no `locker = …` and no default locker set
    /// with [`set_default_locker`](crate::set_default_locker).
    #[error("no locker configured: call dlock_runtime::set_default_locker at startup or pass `locker = …`")]
    NoLocker,
    /// The request asks for something its backend cannot do, such as
    /// [`replicas`](crate::LockRequest::replicas) on a backend without replicas. A
    /// configuration mistake: the backend refuses rather than offer a weaker version.
    #[error("the {backend} backend does not support {what}")]
    #[non_exhaustive]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// What was asked.
        what: String,
    },
    /// The current task asked for a lock it already holds (through `#[distributed_lock]` or
    /// [`with_lock`](crate::with_lock), on the same [`Locker`](crate::Locker)): waiting would
    /// wait for itself. A programming mistake, reported instead of a deadlock; nested
    /// `#[distributed_lock]` calls re-enter instead.
    #[error("lock `{key}` is already held by this task; a second acquire would wait for itself")]
    #[non_exhaustive]
    Reentrant {
        /// The logical key.
        key: String,
    },
}

impl LockError {
    /// An [`Unavailable`](LockError::Unavailable) error (503): for a
    /// [`Backend`](crate::backend::Backend) outside this crate whose store did not answer, or
    /// failed in a way that can pass. `message` must hold no secret (it is logged and shown).
    ///
    /// ```
    /// let e = dlock_runtime::LockError::unavailable("store timed out", None);
    /// assert!(e.is_unavailable());
    /// assert_eq!(e.status(), 503);
    /// ```
    pub fn unavailable(message: impl Into<String>, source: Option<BoxError>) -> Self {
        LockError::Unavailable {
            message: message.into(),
            source,
        }
    }

    /// A [`Misconfigured`](LockError::Misconfigured) error (500): for a
    /// [`Backend`](crate::backend::Backend) outside this crate whose store refused in a way
    /// retrying does not change (a permission, a missing table). `message` must hold no secret.
    ///
    /// ```
    /// let e = dlock_runtime::LockError::misconfigured("no permission on the lock table", None);
    /// assert!(e.is_misconfigured());
    /// assert_eq!(e.status(), 500);
    /// ```
    pub fn misconfigured(message: impl Into<String>, source: Option<BoxError>) -> Self {
        LockError::Misconfigured {
            message: message.into(),
            source,
        }
    }

    /// A backend's failure: [`Misconfigured`](LockError::Misconfigured) when `permanent` (the
    /// backend refused in a way retrying does not change), else
    /// [`Unavailable`](LockError::Unavailable).
    #[cfg_attr(
        not(any(
            feature = "redis",
            feature = "postgres",
            feature = "etcd",
            feature = "zookeeper"
        )),
        allow(dead_code)
    )]
    pub(crate) fn backend(
        message: impl Into<String>,
        source: Option<BoxError>,
        permanent: bool,
    ) -> Self {
        if permanent {
            LockError::misconfigured(message, source)
        } else {
            LockError::unavailable(message, source)
        }
    }

    /// A [`LockError::InvalidKey`] with the given reason, for key extractors outside this crate
    /// (a repeated header, a value that is not UTF-8).
    pub fn invalid_key(reason: impl Into<String>) -> Self {
        LockError::InvalidKey {
            reason: reason.into(),
        }
    }

    pub(crate) fn contended(key: &str, retry_after: Option<Duration>) -> Self {
        LockError::Contended {
            key: key.to_owned(),
            retry_after,
            detail: None,
        }
    }

    pub(crate) fn timeout(key: &str, waited: Duration, retry_after: Option<Duration>) -> Self {
        LockError::Timeout {
            key: key.to_owned(),
            waited,
            retry_after,
            detail: None,
        }
    }

    pub(crate) fn queue_full(key: &str, queue: &str) -> Self {
        LockError::QueueFull {
            key: key.to_owned(),
            queue: queue.to_owned(),
            retry_after: Duration::from_secs(1),
        }
    }

    #[cfg_attr(not(feature = "durable"), allow(dead_code))]
    pub(crate) fn job_too_large(key: &str, queue: &str, bytes: usize, max: usize) -> Self {
        LockError::JobTooLarge {
            key: key.to_owned(),
            queue: queue.to_owned(),
            bytes,
            max,
        }
    }

    pub(crate) fn unsupported(backend: &'static str, what: impl Into<String>) -> Self {
        LockError::Unsupported {
            backend,
            what: what.into(),
        }
    }

    pub(crate) fn reentrant(key: &str) -> Self {
        LockError::Reentrant {
            key: key.to_owned(),
        }
    }

    /// A [`LockError::Lost`] for `key`, for middleware outside this crate that stops work when
    /// a held lock is lost.
    pub fn lost(key: &str) -> Self {
        LockError::Lost {
            key: key.to_owned(),
        }
    }

    /// Replaces the human-readable detail of a [`Contended`](LockError::Contended) or
    /// [`Timeout`](LockError::Timeout) error (other variants are returned unchanged).
    ///
    /// ```
    /// # use dlock_runtime::LockError;
    /// # fn f(err: LockError) -> LockError {
    /// err.with_detail("this order is already being submitted, try again in a few seconds")
    /// # }
    /// ```
    pub fn with_detail(mut self, text: impl Into<String>) -> Self {
        match &mut self {
            LockError::Contended { detail, .. } | LockError::Timeout { detail, .. } => {
                *detail = Some(text.into());
            }
            _ => {}
        }
        self
    }

    /// The logical (encoded) key the error is about, for the variants that name one.
    pub fn key(&self) -> Option<&str> {
        match self {
            LockError::Contended { key, .. }
            | LockError::Timeout { key, .. }
            | LockError::Deferred { key, .. }
            | LockError::QueueFull { key, .. }
            | LockError::JobTooLarge { key, .. }
            | LockError::Lost { key } => Some(key),
            _ => None,
        }
    }

    /// Someone else holds the lock ([`Contended`](LockError::Contended) or
    /// [`Timeout`](LockError::Timeout)).
    pub fn is_contended(&self) -> bool {
        matches!(
            self,
            LockError::Contended { .. } | LockError::Timeout { .. }
        )
    }

    /// The work was deferred ([`Deferred`](LockError::Deferred)); see [`job_id`](LockError::job_id).
    pub fn is_deferred(&self) -> bool {
        matches!(self, LockError::Deferred { .. })
    }

    /// The job id of a [`Deferred`](LockError::Deferred) outcome.
    pub fn job_id(&self) -> Option<&str> {
        match self {
            LockError::Deferred { job_id, .. } => Some(job_id),
            _ => None,
        }
    }

    /// The retry strategy gave up at its deadline.
    pub fn is_timeout(&self) -> bool {
        matches!(self, LockError::Timeout { .. })
    }

    /// The backend was unreachable, slow or failing.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, LockError::Unavailable { .. })
    }

    /// Whether a deferred job whose lock could not be taken for this error used up one of its
    /// attempts: every error but an outage ([`Unavailable`](LockError::Unavailable)), which
    /// the defer queues wait out however long it lasts. `Lost` is a 503 too — a grant whose
    /// answer came after the lease it granted: the job's TTL too short for the backend — but
    /// may never change: not counted, such a job went round for good instead of reaching the
    /// dead letters.
    pub(crate) fn uses_a_job_attempt(&self) -> bool {
        !self.is_unavailable()
    }

    /// The backend refused the request in a way retrying does not change
    /// ([`Misconfigured`](LockError::Misconfigured)).
    pub fn is_misconfigured(&self) -> bool {
        matches!(self, LockError::Misconfigured { .. })
    }

    /// The defer queue was full ([`QueueFull`](LockError::QueueFull)).
    pub fn is_queue_full(&self) -> bool {
        matches!(self, LockError::QueueFull { .. })
    }

    /// The work to defer was over the durable queue's bound for one job
    /// ([`JobTooLarge`](LockError::JobTooLarge)).
    pub fn is_job_too_large(&self) -> bool {
        matches!(self, LockError::JobTooLarge { .. })
    }

    /// The key or TTL was refused before anything was sent.
    pub fn is_invalid(&self) -> bool {
        matches!(
            self,
            LockError::InvalidKey { .. }
                | LockError::InvalidTtl { .. }
                | LockError::InvalidPermits { .. }
        )
    }

    /// The lock was lost while held.
    pub fn is_lost(&self) -> bool {
        matches!(self, LockError::Lost { .. })
    }

    /// No locker was configured for the attribute.
    pub fn is_no_locker(&self) -> bool {
        matches!(self, LockError::NoLocker)
    }

    /// The backend does not support what the request asked ([`Unsupported`](LockError::Unsupported)).
    pub fn is_unsupported(&self) -> bool {
        matches!(self, LockError::Unsupported { .. })
    }

    /// The task asked by hand for a lock it already holds ([`Reentrant`](LockError::Reentrant)).
    pub fn is_reentrant(&self) -> bool {
        matches!(self, LockError::Reentrant { .. })
    }

    /// How long a client should wait before trying again, when that is known: the holder's
    /// remaining lease for contention, one second for an unavailable backend.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            LockError::Contended { retry_after, .. } | LockError::Timeout { retry_after, .. } => {
                *retry_after
            }
            LockError::QueueFull { retry_after, .. } => Some(*retry_after),
            LockError::Unavailable { .. } | LockError::Lost { .. } => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    /// The HTTP status this error maps to (see the table on the type).
    pub fn status(&self) -> u16 {
        match self {
            LockError::Contended { .. } | LockError::Timeout { .. } => 409,
            LockError::Deferred { .. } => 202,
            LockError::Unavailable { .. }
            | LockError::Lost { .. }
            | LockError::QueueFull { .. } => 503,
            LockError::InvalidKey { .. } => 400,
            LockError::JobTooLarge { .. } => 413,
            LockError::InvalidTtl { .. }
            | LockError::InvalidPermits { .. }
            | LockError::NoLocker
            | LockError::Misconfigured { .. }
            | LockError::Unsupported { .. }
            | LockError::Reentrant { .. } => 500,
        }
    }

    /// The value of the `Retry-After` header in whole seconds (rounded up, at least 1), for
    /// the statuses that carry one (409 and 503).
    pub fn retry_after_secs(&self) -> Option<u64> {
        match self.status() {
            409 => Some(ceil_secs(
                self.retry_after().unwrap_or(Duration::from_secs(1)),
            )),
            503 => Some(ceil_secs(
                self.retry_after().unwrap_or(Duration::from_secs(1)),
            )),
            _ => None,
        }
    }

    /// The `Content-Type` of [`problem_json`](LockError::problem_json):
    /// `application/problem+json`, or `application/json` for the 202 of a deferred job.
    pub fn content_type(&self) -> &'static str {
        if self.is_deferred() {
            "application/json"
        } else {
            PROBLEM_JSON
        }
    }

    /// An RFC 9457 `application/problem+json` body describing this error (for
    /// [`Deferred`](LockError::Deferred), a plain JSON body naming the job:
    /// `{"status":202,"title":"Accepted","detail":…,"job_id":…}`).
    ///
    /// Server-side failures (5xx other than 503) get a generic detail so that internals are
    /// not shown to clients; the full error stays available through `Display` for logs.
    pub fn problem_json(&self) -> String {
        let status = self.status();
        if let LockError::Deferred { job_id, .. } = self {
            let mut out = String::from(
                "{\"status\":202,\"title\":\"Accepted\",\"detail\":\"the resource is busy; the work will run when it frees\",\"job_id\":",
            );
            push_json_str(&mut out, job_id);
            out.push('}');
            return out;
        }
        let (kind, title) = match self {
            LockError::Contended { .. } => ("lock-contended", "Conflict"),
            LockError::Timeout { .. } => ("lock-timeout", "Conflict"),
            LockError::Unavailable { .. } => ("lock-backend-unavailable", "Service Unavailable"),
            LockError::Lost { .. } => ("lock-lost", "Service Unavailable"),
            LockError::QueueFull { .. } => ("defer-queue-full", "Service Unavailable"),
            LockError::JobTooLarge { .. } => ("defer-job-too-large", "Payload Too Large"),
            LockError::InvalidKey { .. } => ("lock-invalid-key", "Bad Request"),
            LockError::InvalidTtl { .. } => ("lock-invalid-ttl", "Internal Server Error"),
            LockError::InvalidPermits { .. } => ("lock-invalid-permits", "Internal Server Error"),
            LockError::NoLocker => ("lock-not-configured", "Internal Server Error"),
            LockError::Misconfigured { .. } => {
                ("lock-backend-misconfigured", "Internal Server Error")
            }
            LockError::Unsupported { .. } => ("lock-unsupported", "Internal Server Error"),
            LockError::Reentrant { .. } => ("lock-reentrant", "Internal Server Error"),
            LockError::Deferred { .. } => ("deferred", "Accepted"),
        };
        let detail = match self {
            LockError::Contended {
                detail: Some(d), ..
            }
            | LockError::Timeout {
                detail: Some(d), ..
            } => d.clone(),
            LockError::Contended { .. } | LockError::Timeout { .. } => {
                "the resource is locked by another request; try again later".to_owned()
            }
            LockError::Unavailable { .. } => "the lock service is unavailable".to_owned(),
            LockError::Lost { .. } => "the lock was lost while the request ran".to_owned(),
            LockError::QueueFull { .. } => {
                "the resource is busy and the queue for deferred work is full; try again later"
                    .to_owned()
            }
            LockError::JobTooLarge { max, .. } => {
                format!("the work's stored form is over the {max} bytes the defer queue takes")
            }
            LockError::InvalidKey { reason } => format!("invalid lock key: {reason}"),
            LockError::InvalidTtl { .. }
            | LockError::InvalidPermits { .. }
            | LockError::NoLocker
            | LockError::Misconfigured { .. }
            | LockError::Unsupported { .. }
            | LockError::Reentrant { .. } => "the lock is misconfigured on the server".to_owned(),
            LockError::Deferred { .. } => String::new(),
        };
        let mut out = String::with_capacity(160);
        out.push_str("{\"type\":\"urn:dlock:problem:");
        out.push_str(kind);
        out.push_str("\",\"title\":");
        push_json_str(&mut out, title);
        out.push_str(",\"status\":");
        out.push_str(&status.to_string());
        out.push_str(",\"detail\":");
        push_json_str(&mut out, &detail);
        if let Some(secs) = self.retry_after_secs() {
            out.push_str(",\"retry_after\":");
            out.push_str(&secs.to_string());
        }
        out.push('}');
        out
    }
}

/// The media type of [`LockError::problem_json`].
pub const PROBLEM_JSON: &str = "application/problem+json";

fn ceil_secs(d: Duration) -> u64 {
    let secs = d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0));
    secs.max(1)
}

/// Appends `s` as a JSON string literal.
pub(crate) fn push_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(feature = "axum")]
mod axum_impl {
    use super::LockError;
    use axum_core::response::{IntoResponse, Response};
    use http::{header, HeaderValue, StatusCode};

    /// 409/503/400/413/500 with `Retry-After` and an `application/problem+json` body (202
    /// with a plain JSON body for a deferred job).
    impl IntoResponse for LockError {
        fn into_response(self) -> Response {
            let mut res = (status_of(&self), self.problem_json()).into_response();
            let headers = res.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(self.content_type()),
            );
            if let Some(secs) = self.retry_after_secs() {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
            }
            res
        }
    }

    fn status_of(err: &LockError) -> StatusCode {
        StatusCode::from_u16(err.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// For handlers (and `#[distributed_lock]` functions) returning `Result<T, Response>`:
    /// the whole response, as [`IntoResponse`] makes it.
    impl From<LockError> for Response {
        fn from(err: LockError) -> Self {
            err.into_response()
        }
    }

    /// For handlers returning `Result<T, StatusCode>`: the status alone (409, 503, …), without
    /// `Retry-After` or the problem body — return `Response` (or `LockError`) to keep them.
    impl From<LockError> for StatusCode {
        fn from(err: LockError) -> Self {
            status_of(&err)
        }
    }

    /// For handlers returning `Result<T, (StatusCode, String)>`: the status and the error's
    /// message (its `Display`; no `Retry-After`).
    impl From<LockError> for (StatusCode, String) {
        fn from(err: LockError) -> Self {
            (status_of(&err), err.to_string())
        }
    }
}

#[cfg(feature = "actix")]
mod actix_impl {
    use super::LockError;
    use actix_web::http::{header, StatusCode};
    use actix_web::{HttpResponse, ResponseError};

    /// 409/503/400/413/500 with `Retry-After` and an `application/problem+json` body (202
    /// with a plain JSON body for a deferred job).
    impl ResponseError for LockError {
        fn status_code(&self) -> StatusCode {
            StatusCode::from_u16(self.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
        }

        fn error_response(&self) -> HttpResponse {
            let mut res = HttpResponse::build(self.status_code());
            res.insert_header((header::CONTENT_TYPE, self.content_type()));
            if let Some(secs) = self.retry_after_secs() {
                res.insert_header((header::RETRY_AFTER, secs.to_string()));
            }
            res.body(self.problem_json())
        }
    }
}

/// For code returning [`std::io::Result`] (a `#[distributed_lock]` function declared
/// `-> io::Result<T>`, or `?` in one): the `LockError` is kept whole as the error's inner
/// error (`get_ref`, `into_inner`), under the kind that fits — `WouldBlock` for a lock held
/// ([`Contended`](LockError::Contended)), `TimedOut` for a wait that reached its deadline,
/// `InvalidInput` for a bad key, TTL or argument or a job too large to defer, `Unsupported`,
/// and `Other` for the rest.
impl From<LockError> for std::io::Error {
    fn from(err: LockError) -> Self {
        use std::io::ErrorKind;
        let kind = if err.is_timeout() {
            ErrorKind::TimedOut
        } else if err.is_contended() {
            ErrorKind::WouldBlock
        } else if err.is_invalid() || err.is_job_too_large() {
            ErrorKind::InvalidInput
        } else if err.is_unsupported() {
            ErrorKind::Unsupported
        } else {
            ErrorKind::Other
        };
        std::io::Error::new(kind, err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_outage_leaves_a_deferred_job_untried() {
        assert!(!LockError::unavailable("down", None).uses_a_job_attempt());
        // A 503 as well, but no outage: it counts, and the job reaches the dead letters.
        assert_eq!(LockError::lost("job:1").status(), 503);
        assert!(LockError::lost("job:1").uses_a_job_attempt());
        assert!(LockError::misconfigured("refused", None).uses_a_job_attempt());
    }

    #[test]
    fn an_io_error_keeps_the_lock_error_under_its_kind() {
        use std::io::ErrorKind;
        let cases = [
            (LockError::contended("k", None), ErrorKind::WouldBlock),
            (
                LockError::timeout("k", Duration::from_secs(1), None),
                ErrorKind::TimedOut,
            ),
            (LockError::invalid_key("empty"), ErrorKind::InvalidInput),
            (
                LockError::job_too_large("k", "q", 2, 1),
                ErrorKind::InvalidInput,
            ),
            (
                LockError::unsupported("memory", "replica acknowledgement"),
                ErrorKind::Unsupported,
            ),
            (LockError::unavailable("down", None), ErrorKind::Other),
        ];
        for (err, kind) in cases {
            let shown = err.to_string();
            let io = std::io::Error::from(err);
            assert_eq!(io.kind(), kind, "{shown}");
            let inner = io.into_inner().unwrap().downcast::<LockError>().unwrap();
            assert_eq!(inner.to_string(), shown);
        }
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one_second() {
        let e = LockError::contended("k", Some(Duration::from_millis(1500)));
        assert_eq!(e.retry_after_secs(), Some(2));
        let e = LockError::contended("k", Some(Duration::from_millis(1)));
        assert_eq!(e.retry_after_secs(), Some(1));
        let e = LockError::contended("k", None);
        assert_eq!(e.retry_after_secs(), Some(1));
        assert_eq!(LockError::NoLocker.retry_after_secs(), None);
        // A backend (the trait is public) may report any remaining lease: no overflow.
        let e = LockError::contended("k", Some(Duration::MAX));
        assert_eq!(e.retry_after_secs(), Some(u64::MAX));
    }

    #[test]
    fn status_mapping_follows_the_contract() {
        assert_eq!(LockError::contended("k", None).status(), 409);
        assert_eq!(
            LockError::timeout("k", Duration::from_secs(1), None).status(),
            409
        );
        assert_eq!(LockError::unavailable("down", None).status(), 503);
        assert_eq!(LockError::invalid_key("empty").status(), 400);
        assert_eq!(LockError::NoLocker.status(), 500);
        let unsupported = LockError::unsupported("memory", "replica acknowledgement");
        assert_eq!(unsupported.status(), 500);
        assert!(unsupported.is_unsupported());
        assert_eq!(unsupported.retry_after_secs(), None);
        assert!(unsupported
            .problem_json()
            .starts_with("{\"type\":\"urn:dlock:problem:lock-unsupported\""));
        let full = LockError::queue_full("k", "memory");
        assert_eq!(full.status(), 503);
        assert_eq!(full.retry_after_secs(), Some(1));
        assert!(full.is_queue_full() && !full.is_unavailable());
        assert!(full
            .problem_json()
            .starts_with("{\"type\":\"urn:dlock:problem:defer-queue-full\""));
        let large = LockError::job_too_large("k", "orders", 5000, 4096);
        assert_eq!(large.status(), 413);
        assert_eq!(large.retry_after_secs(), None);
        assert_eq!(large.key(), Some("k"));
        assert!(large.is_job_too_large() && !large.is_queue_full() && !large.is_invalid());
        assert!(large.problem_json().starts_with(
            "{\"type\":\"urn:dlock:problem:defer-job-too-large\",\"title\":\"Payload Too Large\",\"status\":413,"
        ));
        let refused = LockError::backend("redis lock: NOPERM", None, true);
        assert_eq!(refused.status(), 500);
        assert!(refused.is_misconfigured() && !refused.is_unavailable());
        assert_eq!(refused.retry_after_secs(), None);
        let body = refused.problem_json();
        assert!(
            body.starts_with("{\"type\":\"urn:dlock:problem:lock-backend-misconfigured\"")
                && !body.contains("NOPERM"),
            "{body}"
        );
        assert!(LockError::backend("down", None, false).is_unavailable());
        let deferred = LockError::Deferred {
            key: "k".into(),
            job_id: "j1".into(),
        };
        assert_eq!(deferred.status(), 202);
        assert_eq!(deferred.content_type(), "application/json");
        assert!(deferred.problem_json().contains("\"job_id\":\"j1\""));
        assert_eq!(deferred.retry_after_secs(), None);
    }

    #[test]
    fn problem_json_escapes_and_carries_detail() {
        let e = LockError::contended("k", Some(Duration::from_secs(3)))
            .with_detail("already \"submitted\"\n");
        let body = e.problem_json();
        assert_eq!(
            body,
            "{\"type\":\"urn:dlock:problem:lock-contended\",\"title\":\"Conflict\",\
             \"status\":409,\"detail\":\"already \\\"submitted\\\"\\n\",\"retry_after\":3}"
        );
    }
}
