//! [`AdminStore`] for etcd: a lock's keys read in create-revision order (the first is the
//! holder, the others the waiters in line), locks listed by paged range reads (keys only), and
//! a force release that deletes only the holder's key (guarded by its create revision), so the
//! next waiter's predecessor watch fires and it takes the lock as after a release. The next
//! holder's fencing token — its key's create revision — is above the old holder's by
//! construction, so there is no counter to raise (`ForceReleased::fence` is `None`).

use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, SortOrder, SortTarget, Txn, TxnOp};

use super::{range_end, EtcdBackend};
use crate::backend::admin::{
    is_holder, key_of, name_prefix, token_prefix, ForceReleased, Holder, LockPage, LockState,
    Waiter,
};
use crate::LockError;

/// How many keys one range read of `list` asks for.
const PAGE_KEYS: i64 = 1000;

/// `%`- and `/`-encoding of a resource name, as in a lock's directory.
fn encode(name: &str) -> String {
    name.replace('%', "%25").replace('/', "%2F")
}

fn decode(dir: &str) -> String {
    dir.replace("%2F", "/").replace("%25", "%")
}

impl EtcdBackend {
    /// The lock's keys, oldest (the holder) first.
    async fn lock_keys(&self, resource: &str) -> Result<Vec<KeyValue>, LockError> {
        let dir = self.dir(resource);
        let end = range_end(&dir);
        let resp = self
            .call("inspect", |c| {
                let mut kv = c.kv_client();
                let (dir, end) = (dir.clone(), end.clone());
                async move {
                    kv.get(
                        dir,
                        Some(
                            GetOptions::new()
                                .with_range(end)
                                .with_sort(SortTarget::Create, SortOrder::Ascend),
                        ),
                    )
                    .await
                }
            })
            .await?;
        Ok(resp.kvs().to_vec())
    }

    async fn read_lock(&self, resource: &str) -> Result<LockState, LockError> {
        let dir_len = self.dir(resource).len();
        let keys = self.lock_keys(resource).await?;
        let token = |kv: &KeyValue| token_prefix(&owner_of(kv, dir_len));
        let holder = match keys.first() {
            Some(kv) => Some(Holder {
                token_prefix: token(kv),
                fencing_token: u64::try_from(kv.create_revision()).ok(),
                ttl_left: self.remaining(Some(kv)).await?.unwrap_or_default(),
            }),
            None => None,
        };
        Ok(LockState {
            key: key_of(resource).to_owned(),
            holder,
            waiters: keys
                .iter()
                .skip(1)
                .map(|kv| Waiter {
                    token_prefix: token(kv),
                    expires_in: None,
                })
                .collect(),
            fence_counter: None,
        })
    }

    async fn list_locks(
        &self,
        namespace: &str,
        key_prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<LockPage, LockError> {
        let root = format!("{}/", self.opts.prefix);
        let from = format!("{root}{}", encode(&name_prefix(namespace, key_prefix)));
        let end = {
            let mut e = from.clone().into_bytes();
            if let Some(last) = e.last_mut() {
                *last += 1;
            }
            e
        };
        // After a cursor (a resource name), past every key of that lock.
        let mut start = match cursor {
            Some(c) => range_end(&self.dir(c)),
            None => from.into_bytes(),
        };
        // `limit` 0 (the trait does not forbid it) is one lock, as `Admin::list` asks.
        let limit = limit.max(1);
        let mut names: Vec<String> = Vec::new();
        let mut more = true;
        while names.len() <= limit && more {
            let resp = self
                .call("list", |c| {
                    let mut kv = c.kv_client();
                    let (start, end) = (start.clone(), end.clone());
                    async move {
                        kv.get(
                            start,
                            Some(
                                GetOptions::new()
                                    .with_range(end)
                                    .with_keys_only()
                                    .with_limit(PAGE_KEYS),
                            ),
                        )
                        .await
                    }
                })
                .await?;
            more = resp.more();
            let Some(last) = resp.kvs().last() else { break };
            for kv in resp.kvs() {
                let key = String::from_utf8_lossy(kv.key());
                let Some(dir) = key.strip_prefix(&root).and_then(|k| k.split_once('/')) else {
                    continue;
                };
                let name = decode(dir.0);
                // Locks only (`…}`): a semaphore's directory (`…}:sem`) and a read-write
                // lock's (`…}:rw`) hold permits or holds, not a holder and its waiters.
                if name.ends_with('}') && names.last() != Some(&name) {
                    names.push(name);
                }
            }
            start = last.key().to_vec();
            start.push(0);
        }
        let cursor = (names.len() > limit).then(|| names[limit - 1].clone());
        names.truncate(limit);
        let locks = super::super::admin::read_active(
            names,
            super::super::admin::PAGE_READS,
            |n| async move { self.read_lock(&n).await },
        )
        .await?;
        Ok(LockPage { locks, cursor })
    }

    /// A force release of `resource`; with `holder`, only while that owner holds it: the head
    /// key read is that owner's, and its delete is guarded by its create revision (still there,
    /// it still holds: no key can come ahead of it).
    async fn force(
        &self,
        resource: &str,
        holder: Option<&str>,
    ) -> Result<ForceReleased, LockError> {
        let Some(head) = self.lock_keys(resource).await?.into_iter().next() else {
            return Ok(ForceReleased::default());
        };
        if let Some(want) = holder {
            let owner = owner_of(&head, self.dir(resource).len());
            if !is_holder(&owner, want) {
                return Ok(ForceReleased::spared(token_prefix(&owner)));
            }
        }
        let key = head.key().to_vec();
        let txn = Txn::new()
            .when([Compare::create_revision(
                key.clone(),
                CompareOp::Equal,
                head.create_revision(),
            )])
            .and_then([TxnOp::delete(key, None)]);
        let deleted = self.txn(txn).await?.succeeded();
        Ok(ForceReleased {
            was_held: deleted,
            ..ForceReleased::default()
        })
    }
}

/// The owner token of a lock's key `kv` (its directory `dir_len` bytes long): a key on a
/// session notes it in its value (its name is the locker's and is reused); a key on a lease of
/// its own is named by it.
fn owner_of(kv: &KeyValue, dir_len: usize) -> String {
    match super::noted(kv.value()).1 {
        Some(token) => token.to_owned(),
        None => String::from_utf8_lossy(kv.key().get(dir_len..).unwrap_or_default()).into_owned(),
    }
}

crate::backend::admin::admin_store_via!(EtcdBackend);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_names_round_trip() {
        let name = "dlock:{a/b%2F}";
        assert_eq!(decode(&encode(name)), name);
        assert!(!encode(name).contains('/'));
    }
}
