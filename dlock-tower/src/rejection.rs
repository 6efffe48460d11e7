//! [`Rejection`]: an answer the layer gives instead of calling the inner service.

use std::fmt;

use dlock_runtime::{LockError, PROBLEM_JSON};
use http::{header, HeaderValue, Response, StatusCode};

/// A response the layer (or a key extractor) sends instead of calling the inner service: a
/// status, an optional `Retry-After` and an RFC 9457 `application/problem+json` body.
///
/// It is independent of any body type; [`into_response`](Rejection::into_response) turns it
/// into a `Response<B>` for any `B: From<String>`. Rejections are responses, never service
/// errors: the service's error type stays the inner service's (`Infallible` stays
/// `Infallible`).
///
/// | made by | status | problem `type` |
/// |---|---|---|
/// | the lock is held ([`LockError::Contended`], [`LockError::Timeout`]) | 409 + `Retry-After` | `urn:dlock:problem:lock-contended` / `lock-timeout` |
/// | the backend is down and the layer fails closed | 503 + `Retry-After` | `urn:dlock:problem:lock-backend-unavailable` |
/// | the backend refuses for good ([`LockError::Misconfigured`]: wrong credentials, no permission), in either fail mode | 500 | `urn:dlock:problem:lock-backend-misconfigured` |
/// | the key is invalid (oversized, empty, not UTF-8, repeated header) | 400 | `urn:dlock:problem:lock-invalid-key` |
/// | the key is missing and [`MissingKey::Reject`](crate::MissingKey::Reject) | 400 | `urn:dlock:problem:lock-key-missing` |
/// | [`IdempotencyLayer`](crate::IdempotencyLayer): an identity is configured and the request has none ([`MissingIdentity::Reject`](crate::MissingIdentity::Reject)) | 401 | `urn:dlock:problem:idempotency-identity-missing` |
/// | [`IdempotencyLayer`](crate::IdempotencyLayer): the request's identity cannot be formatted (its `Display` returned an error) | 500 | `urn:dlock:problem:idempotency-identity-unformattable` |
/// | the body is over [`body_digest`](crate::key::body_digest)'s limit | 413 | `urn:dlock:problem:body-too-large` |
/// | the lock is busy and the defer queue is full ([`LockError::QueueFull`], [`DeferLayer`](crate::DeferLayer)) | 503 + `Retry-After` | `urn:dlock:problem:defer-queue-full` |
/// | the lock is busy and the request, stored, is over the defer queue's bound for one job ([`LockError::JobTooLarge`], [`DeferLayer`](crate::DeferLayer)) | 413 | `urn:dlock:problem:defer-job-too-large` |
///
/// ```
/// use dlock_tower::Rejection;
/// use http::StatusCode;
///
/// let r = Rejection::new(StatusCode::BAD_REQUEST, "tenant-missing", "no tenant was selected");
/// let res: http::Response<String> = r.into_response();
/// assert_eq!(res.status(), 400);
/// assert_eq!(res.headers()["content-type"], "application/problem+json");
/// assert!(res.body().contains("urn:dlock:problem:tenant-missing"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Rejection {
    status: StatusCode,
    retry_after: Option<u64>,
    body: String,
}

impl Rejection {
    /// A problem+json rejection with type `urn:dlock:problem:<kind>`, the status's canonical
    /// reason as title, and `detail` (shown to the client: keep secrets out of it).
    pub fn new(status: StatusCode, kind: &str, detail: &str) -> Self {
        let mut body = String::with_capacity(96 + kind.len() + detail.len());
        body.push_str("{\"type\":");
        push_json_str(&mut body, &format!("urn:dlock:problem:{kind}"));
        body.push_str(",\"title\":");
        push_json_str(&mut body, status.canonical_reason().unwrap_or("Error"));
        body.push_str(",\"status\":");
        body.push_str(status.as_str());
        body.push_str(",\"detail\":");
        push_json_str(&mut body, detail);
        body.push('}');
        Rejection {
            status,
            retry_after: None,
            body,
        }
    }

    /// 400: the request has no lock key (used with [`MissingKey::Reject`](crate::MissingKey)).
    pub fn missing_key() -> Self {
        Rejection::new(
            StatusCode::BAD_REQUEST,
            "lock-key-missing",
            "the request does not carry the key this endpoint locks on",
        )
    }

    /// 400: the request's key cannot be used (`reason` is shown to the client).
    pub fn invalid_key(reason: &str) -> Self {
        Rejection::new(
            StatusCode::BAD_REQUEST,
            "lock-invalid-key",
            &format!("invalid lock key: {reason}"),
        )
    }

    /// 413: the request body is larger than `limit` bytes.
    pub fn body_too_large(limit: usize) -> Self {
        Rejection::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            &format!("the request body is larger than the {limit} bytes this endpoint reads"),
        )
    }

    /// The answer to a request body that failed while read: `413` when a body limit of the
    /// server cut it off — an `http_body_util::LengthLimitError` anywhere in the error's
    /// source chain, as tower-http's `RequestBodyLimitLayer` or a `Limited` body outside this
    /// layer raises —, else `400`.
    pub(crate) fn unreadable_body(err: dlock_runtime::BoxError) -> Self {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&*err);
        while let Some(e) = cause {
            if e.is::<http_body_util::LengthLimitError>() {
                return Rejection::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body-too-large",
                    "the request body is larger than this server reads",
                );
            }
            cause = e.source();
        }
        Rejection::new(
            StatusCode::BAD_REQUEST,
            "body-unreadable",
            "the request body could not be read",
        )
    }

    /// Adds a `Retry-After` header of `secs` seconds.
    #[must_use]
    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The `Retry-After` value in seconds, if any.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after
    }

    /// The `application/problem+json` body.
    pub fn body(&self) -> &str {
        &self.body
    }

    /// The response: status, `Content-Type: application/problem+json`, `Retry-After` when
    /// set, and the body.
    pub fn into_response<B: From<String>>(self) -> Response<B> {
        let mut res = Response::new(B::from(self.body));
        *res.status_mut() = self.status;
        let headers = res.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(secs) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        res
    }
}

/// Uses the runtime's HTTP mapping: [`LockError::status`], [`LockError::retry_after_secs`]
/// and [`LockError::problem_json`].
impl From<LockError> for Rejection {
    fn from(err: LockError) -> Self {
        Rejection::from(&err)
    }
}

impl From<&LockError> for Rejection {
    fn from(err: &LockError) -> Self {
        Rejection {
            status: StatusCode::from_u16(err.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            retry_after: err.retry_after_secs(),
            body: err.problem_json(),
        }
    }
}

impl fmt::Debug for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rejection")
            .field("status", &self.status)
            .field("retry_after", &self.retry_after)
            .field("body", &self.body)
            .finish()
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status, self.body)
    }
}

/// Appends `s` as a JSON string literal.
fn push_json_str(out: &mut String, s: &str) {
    use fmt::Write as _;
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_json_is_escaped() {
        let r = Rejection::new(StatusCode::BAD_REQUEST, "x", "a \"b\"\n\u{1}");
        assert_eq!(
            r.body(),
            "{\"type\":\"urn:dlock:problem:x\",\"title\":\"Bad Request\",\"status\":400,\
             \"detail\":\"a \\\"b\\\"\\n\\u0001\"}"
        );
    }

    #[test]
    fn into_response_sets_headers() {
        let res: Response<String> = Rejection::body_too_large(10)
            .with_retry_after(3)
            .into_response();
        assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(res.headers()[header::RETRY_AFTER], "3");
        assert_eq!(res.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
    }
}
