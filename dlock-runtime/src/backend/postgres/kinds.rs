//! Semaphores and read-write locks on Postgres: the rule of
//! [`backend`](crate::backend#semaphores-and-read-write-locks) in the schema's `kind_acquire`,
//! `kind_release` and `kind_extend` (tables `holders` and `queue`; see
//! [`schema`](super::schema)). Each operation is one function call, like a lock's; a grant
//! goes through [`PostgresBackend::gated`] so that its undo cannot overtake it.

use tokio_postgres::types::Type;

use super::{int8, int_of, malformed, millis, mode, refs, text, Params, PostgresBackend};
use crate::backend::{AcquireArgs, Attempt, OwnerToken};
use crate::key::ResourceName;
use crate::LockError;

/// The capacity as the functions take it (`bigint`: a read-write lock's is `u32::MAX`).
fn capacity(resource: &ResourceName) -> i64 {
    i64::from(resource.kind().capacity())
}

impl PostgresBackend {
    pub(super) async fn acquire_kind_once(
        &self,
        args: AcquireArgs<'_>,
    ) -> Result<Attempt, LockError> {
        let params: Params = vec![
            text(args.resource.as_str()),
            text(args.token.as_str()),
            (Box::new(args.resource.kind().is_exclusive()), Type::BOOL),
            int8(capacity(args.resource)),
            mode(args.mode),
            int8(millis(args.ttl)),
            int8(millis(args.waiter_ttl)),
        ];
        let rows = self
            .gated(
                args.token,
                true,
                "acquire",
                |s| &s.kind_acquire,
                params,
                args.sent,
            )
            .await?;
        Ok(Attempt::from_reply(int_of("acquire", &rows)?))
    }

    /// Owner-checked release (`abandon`: also leave the line, in order after the acquire it
    /// undoes). Answers whether the token held a live lease. Without a `LISTEN` session, the
    /// waiters it let in that wait in this process are woken here (with one, the `NOTIFY`
    /// reaches them and every other process).
    pub(super) async fn release_kind(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
        abandon: bool,
    ) -> Result<bool, LockError> {
        let what = if abandon { "abandon" } else { "release" };
        let params: Params = vec![
            text(resource.as_str()),
            text(token.as_str()),
            int8(capacity(resource)),
            (Box::new(abandon), Type::BOOL),
        ];
        let rows = if abandon {
            self.gated(token, false, what, |s| &s.kind_release, params, None)
                .await?
        } else {
            self.call(what, &self.sql().kind_release, &refs(&params))
                .await?
        };
        let row = rows.first().ok_or_else(|| malformed(what))?;
        let held: bool = row.try_get(0).map_err(|_| malformed(what))?;
        let woken: Vec<String> = row.try_get(1).map_err(|_| malformed(what))?;
        if self.inner.listening.is_none() {
            for t in &woken {
                self.inner.hub.notify(resource.as_str(), Some(t));
            }
        }
        // Room made and nobody in line: a barging waiter of this backend (`fair(false)`, not
        // in the line) tries again. One of another backend hears nothing (the release notifies
        // only the line) and runs on its timer.
        if held && woken.is_empty() {
            self.inner.hub.notify(resource.as_str(), None);
        }
        Ok(held)
    }
}
