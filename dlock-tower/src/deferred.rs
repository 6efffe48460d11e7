//! [`Deferred`]: the mark of a response that answers a request without running it.

/// A response extension saying: this response is not the request's outcome — the request was
/// queued to run later (the [`DeferLayer`](crate::DeferLayer)'s `202 Accepted`).
///
/// An [`IdempotencyLayer`](crate::IdempotencyLayer) outside does not store a response that
/// carries it: the key is released without a record, so the deferred request's replay, which
/// goes through the idempotency layer again, runs the handler and stores its real response
/// (see [the idempotency docs](crate::idempotency#deferred-requests)). A middleware of your
/// own that queues requests can mark its answers the same way.
///
/// ```
/// use dlock_tower::Deferred;
///
/// let mut res = http::Response::new(String::new());
/// *res.status_mut() = http::StatusCode::ACCEPTED;
/// res.extensions_mut().insert(Deferred::new("0f3a"));
/// assert_eq!(res.extensions().get::<Deferred>().unwrap().job_id(), "0f3a");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Deferred {
    job_id: String,
}

impl Deferred {
    /// The mark of a request queued as job `job_id`.
    pub fn new(job_id: impl Into<String>) -> Self {
        Deferred {
            job_id: job_id.into(),
        }
    }

    /// The id of the job the request was queued as.
    pub fn job_id(&self) -> &str {
        &self.job_id
    }
}
