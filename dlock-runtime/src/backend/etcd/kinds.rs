//! Semaphores and read-write locks on etcd: the lock recipe generalised, by the rule of
//! [`backend`](crate::backend#semaphores-and-read-write-locks).
//!
//! Every acquisition of a permit or a read or write hold puts its own key under the name's
//! directory, named as a lock's is (`<prefix>/<resource>/<locker>.<slot>` on a session,
//! `…/<token>` on a lease of its own; the resource being `…:sem` or `…:rw`), with a kind
//! marker for a writer (`…/w.<locker>.<slot>`: locker ids and tokens are hex, so the marker
//! cannot be mistaken for one). The keys in create-revision order are the line, and
//! the holders are its *ready prefix*: walking from the first key, each one is admitted while
//! it fits beside those admitted before it (a semaphore's first `permits` keys; a reader while
//! no writer key precedes it; a writer when it is first). Keys are only ever appended (a new
//! key has the highest create revision) or deleted, so an admitted key stays admitted until
//! its own key goes: there is no separate holder set to keep in step.
//!
//! * [`WaitMode::Queue`](crate::backend::WaitMode::Queue): the key joins the line (kept with
//!   its create revision by later attempts) and the attempt reads the line in the same
//!   transaction; granted when the own key is in the ready prefix.
//! * `Try` and `Barge` (the same here: a newcomer cannot pass a waiter's key): an uncontended
//!   attempt puts the key only if the directory is empty, like a lock; otherwise it puts the
//!   key anyway (unless a key with its name is there that is not its own: one an earlier
//!   registration of its token put, which it deletes), reads the line in the same
//!   transaction, and deletes the key again when it was not admitted. Such a key is briefly in the line behind the holders: a waiter that
//!   queued behind it in that moment waits for its deletion (which its watch sees).
//! * Fencing: the own key's create revision, as for locks. Grants follow create order (the
//!   ready prefix only grows at its end), so a writer's token is above every token granted on
//!   the name before it, and permits' and readers' tokens increase with their arrival.
//! * Waiting: a waiter's task reads the keys ahead of it once (create revision below its own,
//!   keys only) and watches the name's directory for deletions from that read's revision on,
//!   counting the keys ahead down locally until it fits (a semaphore waiter needs fewer than
//!   `permits` keys ahead, a reader no writer key ahead, a writer none at all). A permit
//!   frees when *any* key ahead goes, so one key cannot be watched, as a lock's waiter
//!   watches its predecessor; the delete events cost the waiter no read. Waiters not yet
//!   admitted are woken only when they are: a release wakes exactly the new ready prefix.
//!
//! Leases, sessions, release, extension and cancellation are a lock's (module docs of
//! [`etcd`](super)): the key names differ, nothing else.

use std::time::Duration;

use etcd_client::{GetOptions, KeyValue, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse};

use super::pool::{call, Pool};
use super::{EtcdBackend, Keys, Turn};
use crate::backend::{AcquireArgs, Attempt, OwnerToken};
use crate::key::{LockKind, ResourceName};
use crate::LockError;

/// The marker that starts a writer's key name after the directory.
pub(super) const WRITER: &[u8] = b"w.";

/// Whether `key` (under `dir`) is a writer's.
fn is_writer(dir_len: usize, key: &[u8]) -> bool {
    key.get(dir_len..)
        .is_some_and(|name| name.starts_with(WRITER))
}

/// Room for one more holder (`exclusive` or shared) beside `held` holders, `writer` of them
/// exclusive, under `capacity`.
fn fits(held: u64, writer: bool, exclusive: bool, capacity: u32) -> bool {
    if exclusive {
        held == 0
    } else {
        !writer && held < u64::from(capacity)
    }
}

/// Whether the own key is in the ready prefix of `line` (the name's keys in create-revision
/// order). For a lock (capacity 1, no writer marker) it is "the own key is first".
pub(super) fn admitted(kind: LockKind, dir_len: usize, line: &[KeyValue], own: &[u8]) -> bool {
    let (mut held, mut writer) = (0u64, false);
    for kv in line {
        // A lock's keys carry no marker: capacity 1 admits the first alone.
        let exclusive = kind != LockKind::Exclusive && is_writer(dir_len, kv.key());
        if !fits(held, writer, exclusive, kind.capacity()) {
            return false;
        }
        if kv.key() == own {
            return true;
        }
        held += 1;
        writer |= exclusive;
    }
    false
}

/// Whether a key of `kind` put now at the end of `line` (the name's keys in create-revision
/// order) would be in its ready prefix: every key of the line fits beside those before it,
/// and one more of `kind` beside them all.
fn admits_one_more(kind: LockKind, dir_len: usize, line: &[Vec<u8>]) -> bool {
    let (mut held, mut writer) = (0u64, false);
    for key in line {
        let exclusive = is_writer(dir_len, key);
        if !fits(held, writer, exclusive, kind.capacity()) {
            return false;
        }
        held += 1;
        writer |= exclusive;
    }
    fits(held, writer, kind.is_exclusive(), kind.capacity())
}

/// How an attempt reads the line: a lock needs its head only, a kind every key in order.
pub(super) fn line_options(kind: LockKind, end: &[u8]) -> GetOptions {
    let options = GetOptions::new()
        .with_range(end.to_vec())
        .with_sort(SortTarget::Create, SortOrder::Ascend);
    if kind == LockKind::Exclusive {
        options.with_limit(1)
    } else {
        options
    }
}

/// The keys the `i`th response read.
pub(super) fn kvs_at(ops: &[TxnOpResponse], i: usize) -> &[KeyValue] {
    match ops.get(i) {
        Some(TxnOpResponse::Get(g)) => g.kvs(),
        _ => &[],
    }
}

impl EtcdBackend {
    /// A try (or barge) of a permit or hold that the watchdog does not renew: the key on a
    /// lease of the TTL, the line read in the same transaction; a key not admitted is taken
    /// back by revoking the attempt's lease.
    pub(super) async fn acquire_kind_if_free(
        &self,
        args: &AcquireArgs<'_>,
    ) -> Result<Attempt, LockError> {
        let k = self.keys(args.resource, args.token);
        let lease = self.grant_for(args.resource, args.token, args.ttl).await?;
        let kind = args.resource.kind();
        let ops = self.put_and_read_line(&k, args, lease).await?;
        let line = kvs_at(&ops, 1);
        if admitted(kind, k.dir.len(), line, &k.own) {
            let create = kvs_at(&ops, 2).first().map_or(0, KeyValue::create_revision);
            // A put is unconditional here: a try of an earlier attempt's put still on its way
            // (one that timed out, a hedged try's first one) would land after this admission
            // and move the key onto that attempt's lease, which ends sooner — deleting the
            // key while this holder's guard says held, and admitting the next. So the
            // token's other leases are revoked first (a put on a revoked lease fails), and the
            // key must still be on this one.
            if !self
                .keep_only_on(args.resource, args.token, &k.own, lease)
                .await?
            {
                return Ok(Attempt::Held { remaining: None });
            }
            return Ok(Attempt::Acquired {
                fencing_token: create.unsigned_abs(),
            });
        }
        self.revoke_leases(args.resource, args.token).await?;
        Ok(Attempt::Held {
            remaining: self.remaining(line.first()).await?,
        })
    }
}

/// Returns [`Turn::Now`] once the own key fits beside the keys ahead of it or is deleted (the
/// waiter must ask again), or — when it has none (a barging waiter) — once a key put then would
/// fit; the watch loop of a permit's or hold's waiter (see the module docs).
pub(super) async fn wait_admitted(
    pool: &Pool,
    watches: &super::watches::Watches,
    kind: LockKind,
    k: &Keys,
    timeout: Duration,
) -> Result<Turn, LockError> {
    // One transaction: the own key and the line, so that no deletion falls between the two
    // reads unseen (a queued waiter whose key went there waited for the next one).
    let txn = Txn::new().and_then([
        TxnOp::get(k.own.clone(), Some(GetOptions::new().with_keys_only())),
        TxnOp::get(
            k.dir.clone(),
            Some(line_options(kind, &k.end).with_keys_only()),
        ),
    ]);
    let resp = call(pool, timeout, "txn", |c| {
        let mut kv = c.kv_client();
        let txn = txn.clone();
        async move { kv.txn(txn).await }
    })
    .await?;
    let read = resp.header().map_or(0, |h| h.revision());
    let ops = resp.op_responses();
    let (line, dir_len) = (kvs_at(&ops, 1), k.dir.len());
    let Some(own) = kvs_at(&ops, 0).first() else {
        // No key in the line (a barging waiter): woken at once when a key put now would be
        // admitted — a release came between its attempt and this read (or the floor its watch
        // was given), and a watch from the read on would wait for the next one. Else woken
        // when a deletion makes room in the line as read here, not on any deletion: a barging
        // try that loses puts its key and deletes it again, and waking on that deletion had
        // two barging waiters wake each other (and one itself) for as long as the line was
        // full, with two writes a turn.
        let mut keys: Vec<Vec<u8>> = line.iter().map(|kv| kv.key().to_vec()).collect();
        if admits_one_more(kind, dir_len, &keys) {
            return Ok(Turn::Now);
        }
        let mut watch = watches.watch(&k.dir, Some(&k.end), read + 1).await?;
        loop {
            for key in watch.deleted().await? {
                keys.retain(|a| *a != key);
            }
            // A key put after the read is not in `keys`: room seen here may be gone, and the
            // attempt then finds the line full and watches again from a new read.
            if admits_one_more(kind, dir_len, &keys) {
                return Ok(Turn::Now);
            }
        }
    };
    let rev = own.create_revision();
    let mut keys: Vec<Vec<u8>> = line
        .iter()
        .filter(|kv| kv.create_revision() < rev)
        .map(|kv| kv.key().to_vec())
        .collect();
    let fits_now = |keys: &[Vec<u8>]| {
        let writers = keys.iter().any(|key| is_writer(dir_len, key));
        let exclusive = kind.is_exclusive();
        fits(keys.len() as u64, writers, exclusive, kind.capacity())
    };
    if fits_now(&keys) {
        return Ok(Turn::Now);
    }
    let from = read + 1;
    let mut watch = watches.watch(&k.dir, Some(&k.end), from).await?;
    loop {
        for key in watch.deleted().await? {
            if key == k.own {
                return Ok(Turn::Now);
            }
            keys.retain(|a| *a != key);
        }
        if fits_now(&keys) {
            return Ok(Turn::Now);
        }
    }
}

/// The own key of `token` under `dir` (a key on a lease of its own): a writer's carries the
/// marker.
pub(super) fn own_key(dir: &[u8], resource: &ResourceName, token: &OwnerToken) -> Vec<u8> {
    named(dir, resource.kind(), &[token.as_str().as_bytes()])
}

/// The key of slot `slot` of the locker `instance` under `dir` (a key on a session, module
/// `session`): `<instance>.<slot>`, which no token (hex) can be; a writer's carries the marker.
pub(super) fn slot_key(dir: &[u8], kind: LockKind, instance: &str, slot: u32) -> Vec<u8> {
    let mut digits = [0; 39];
    let slot = crate::util::decimal(u128::from(slot), &mut digits);
    named(dir, kind, &[instance.as_bytes(), b".", slot.as_bytes()])
}

fn named(dir: &[u8], kind: LockKind, parts: &[&[u8]]) -> Vec<u8> {
    let mut own = Vec::with_capacity(dir.len() + 48);
    own.extend_from_slice(dir);
    if kind == LockKind::Write {
        own.extend_from_slice(WRITER);
    }
    for p in parts {
        own.extend_from_slice(p);
    }
    own
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writer_keys_are_marked() {
        assert!(is_writer(4, b"dir/w.abc"));
        assert!(!is_writer(4, b"dir/abc"));
        assert!(!is_writer(4, b"dir/"));
    }

    #[test]
    fn fits_follows_the_rule() {
        assert!(fits(0, false, true, u32::MAX));
        assert!(!fits(1, false, true, u32::MAX));
        assert!(fits(5, false, false, u32::MAX));
        assert!(!fits(0, true, false, u32::MAX));
        assert!(!fits(3, false, false, 3));
    }
}
