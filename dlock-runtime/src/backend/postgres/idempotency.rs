//! Idempotency records of the Postgres backend: the functions `idem_begin`, `idem_complete` and
//! `idem_abort` of the schema, each one transaction that also takes or passes on the key's lock
//! (the record is stored in the same transaction as the release). Table `<prefix>idempotency`:
//! one row per key — fingerprint (hex), the running attempt's owner token or the stored
//! result, expiry by the database's clock. A row with a token notes the running attempt's
//! fingerprint; it is read only while the lock holds that same token and replaced by the next
//! holder, so one left by a crashed or cancelled holder is inert.

use std::time::Duration;

use tokio_postgres::types::Type;

use super::{int8, malformed, millis, text, PostgresBackend};
use crate::backend::idempotency::{BeginArgs, BeginReply, CompleteArgs, IdempotencyStore};
use crate::backend::{BoxFuture, OwnerToken};
use crate::key::ResourceName;
use crate::LockError;

impl IdempotencyStore for PostgresBackend {
    fn begin<'a>(&'a self, args: BeginArgs<'a>) -> BoxFuture<'a, Result<BeginReply, LockError>> {
        Box::pin(async move {
            const WHAT: &str = "idempotency begin";
            let params = vec![
                text(args.resource.as_str()),
                text(args.token.as_str()),
                int8(millis(args.ttl)),
                text(&args.fingerprint.to_hex()),
                int8(millis(args.retention)),
            ];
            // In order with the undo of a cancelled begin (see `PostgresBackend::gated`).
            let rows = self
                .gated(args.token, true, WHAT, |s| &s.idem_begin, params, args.sent)
                .await?;
            let row = rows.first().ok_or_else(|| malformed(WHAT))?;
            let code: i32 = row.try_get(0).map_err(|_| malformed(WHAT))?;
            let n: Option<i64> = row.try_get(1).map_err(|_| malformed(WHAT))?;
            let same: Option<i32> = row.try_get(2).map_err(|_| malformed(WHAT))?;
            let result: Option<Vec<u8>> = row.try_get(3).map_err(|_| malformed(WHAT))?;
            Ok(match (code, n) {
                (1, Some(t)) if t > 0 => BeginReply::Acquired {
                    fencing_token: t as u64,
                },
                (2, _) => BeginReply::Replay {
                    record: result.ok_or_else(|| malformed(WHAT))?,
                },
                (3, _) => BeginReply::Mismatch,
                (0, Some(n)) => BeginReply::Held {
                    remaining: (n >= 0).then(|| Duration::from_millis(n as u64)),
                    same_fingerprint: same.map(|s| s == 1),
                },
                _ => return Err(malformed(WHAT)),
            })
        })
    }

    fn complete<'a>(&'a self, args: CompleteArgs<'a>) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let retention = millis(args.retention);
            let fp = args.fingerprint.to_hex();
            let n = self
                .call_int(
                    "idempotency complete",
                    &self.sql().idem_complete,
                    &[
                        (&args.resource.as_str(), Type::TEXT),
                        (&args.token.as_str(), Type::TEXT),
                        (&fp, Type::TEXT),
                        (&args.record, Type::BYTEA),
                        (&retention, Type::INT8),
                    ],
                )
                .await?;
            Ok(n == 1)
        })
    }

    fn abort<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let n = self
                .call_int(
                    "idempotency abort",
                    &self.sql().idem_abort,
                    &[
                        (&resource.as_str(), Type::TEXT),
                        (&token.as_str(), Type::TEXT),
                    ],
                )
                .await?;
            Ok(n == 1)
        })
    }
}
