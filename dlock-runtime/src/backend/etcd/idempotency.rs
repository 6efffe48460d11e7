//! Idempotency records of the etcd backend, each step one transaction.
//!
//! Key layout of one idempotency key, beside the lock's keys (under `<prefix>/<resource>/`; the
//! record's lock is on a lease of its own, so its key is named by its token):
//!
//! | key | value | lease |
//! |---|---|---|
//! | `<prefix>/<resource>/<token>` (the holder's own key) | `fp:<fingerprint hex>` | the lock's |
//! | `<prefix>-idem/<resource>` (the record) | `<fingerprint hex><stored result>` | the retention period |
//!
//! The running attempt's fingerprint is the value of its own lock key, so it lives exactly as
//! long as the lock. `begin` takes the lock only when neither a record nor any lock key exists
//! (one transaction, like a `try_acquire`); `complete` stores the record and deletes the own key
//! in one transaction guarded by the own key's existence (the owner check), so the record is
//! written if and only if the lock is released by its owner.
//!
//! Requests are hedged and retried (module `pool`), so an answer may come from a repeat whose
//! first try was applied and not yet answered. A repeat never undoes that first try: a `begin`
//! whose compare fails but that finds its own key at the head took the lock (its fencing token
//! is the key's create revision), and a `complete` whose compare fails but that finds the
//! record on the lease it granted for this call stored it (the lease is not revoked).

use super::{first_kv, EtcdBackend};
use crate::backend::idempotency::{BeginArgs, BeginReply, CompleteArgs, IdempotencyStore};
use crate::backend::{BoxFuture, OwnerToken};
use crate::key::ResourceName;
use crate::LockError;

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};

/// The value prefix of an own key that notes a fingerprint.
const NOTE: &[u8] = b"fp:";

impl EtcdBackend {
    /// `<prefix>-idem/<resource>`: outside every lock's key range.
    fn record_key(&self, resource: &ResourceName) -> Vec<u8> {
        let mut dir = self.dir(resource.as_str());
        dir.pop(); // the trailing `/`
        let prefix_len = self.opts.prefix.len();
        let mut key = dir[..prefix_len].to_vec();
        key.extend_from_slice(b"-idem");
        key.extend_from_slice(&dir[prefix_len..]);
        key
    }
}

impl IdempotencyStore for EtcdBackend {
    fn begin<'a>(&'a self, args: BeginArgs<'a>) -> BoxFuture<'a, Result<BeginReply, LockError>> {
        Box::pin(async move {
            let k = self.keys(args.resource, args.token);
            let record = self.record_key(args.resource);
            let fp = args.fingerprint.to_hex();
            let mut note = NOTE.to_vec();
            note.extend_from_slice(fp.as_bytes());
            let lease = self.grant_for(args.resource, args.token, args.ttl).await?;
            let ops = match self
                .put_if_free(
                    &k,
                    note,
                    lease,
                    vec![record.clone()],
                    vec![TxnOp::get(record, None)],
                )
                .await?
            {
                Ok(fencing_token) => return Ok(BeginReply::Acquired { fencing_token }),
                Err(ops) => ops,
            };
            let head = ops.get(1).and_then(first_kv);
            if let Some(own) = head.filter(|h| h.key() == k.own.as_slice()) {
                // The own key (named by this attempt's token, written by nothing else) is
                // there: a try of this very transaction took the lock before this one was
                // applied — a hedged sibling, or a first try whose answer was lost. The lock
                // is this attempt's; its lease must not be revoked.
                return Ok(BeginReply::Acquired {
                    fencing_token: own.create_revision().unsigned_abs(),
                });
            }
            self.revoke_later(self.take_leases(args.resource, args.token));
            if let Some(rec) = ops.first().and_then(first_kv) {
                let value = rec.value();
                return Ok(match value.split_at_checked(fp.len()) {
                    Some((stored, result)) if stored == fp.as_bytes() => BeginReply::Replay {
                        record: result.to_vec(),
                    },
                    _ => BeginReply::Mismatch,
                });
            }
            let same_fingerprint = head
                .and_then(|h| h.value().strip_prefix(NOTE))
                .map(|noted| noted == fp.as_bytes());
            Ok(BeginReply::Held {
                remaining: self.remaining(head).await?,
                same_fingerprint,
            })
        })
    }

    fn complete<'a>(&'a self, args: CompleteArgs<'a>) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let k = self.keys(args.resource, args.token);
            let mut value = args.fingerprint.to_hex().into_bytes();
            value.extend_from_slice(args.record);
            let lease = self.grant(args.retention).await?;
            let record = self.record_key(args.resource);
            let txn = Txn::new()
                .when([Compare::create_revision(
                    k.own.clone(),
                    CompareOp::Greater,
                    0,
                )])
                .and_then([
                    TxnOp::put(
                        record.clone(),
                        value,
                        Some(PutOptions::new().with_lease(lease)),
                    ),
                    TxnOp::delete(k.own, None),
                ])
                .or_else([TxnOp::get(record, Some(GetOptions::new().with_keys_only()))]);
            let resp = self.txn(txn).await?;
            // A failed compare may be a repeat (a hedged sibling, or a retry after a lost
            // answer) of a try that was applied: the record is then on `lease`, granted for
            // this call alone — stored, and its lease must not be revoked.
            let done = resp.succeeded()
                || resp
                    .op_responses()
                    .first()
                    .and_then(first_kv)
                    .is_some_and(|rec| rec.lease() == lease);
            let mut unused = self.take_leases(args.resource, args.token);
            if !done {
                unused.push(lease);
            }
            self.revoke_later(unused);
            Ok(done)
        })
    }

    fn abort<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        crate::backend::Backend::release(self, resource, token)
    }
}
