//! [`AdminStore`] for the in-process store: reads the entries under their shard's mutex.

use std::time::Instant;

use super::{Entry, MemoryBackend};
use crate::backend::admin::{
    is_holder, name_prefix, token_prefix, AdminStore, ForceReleased, Holder, LockPage, LockState,
    Waiter,
};
use crate::backend::{BoxFuture, OwnerToken};
use crate::key::ResourceName;
use crate::LockError;

impl MemoryBackend {
    fn state_of(&self, name: &str, e: &Entry, now: Instant) -> LockState {
        LockState {
            key: crate::backend::admin::key_of(name).to_owned(),
            holder: e.live_holder(now).map(|(t, exp)| Holder {
                token_prefix: token_prefix(t.as_str()),
                fencing_token: Some(e.fence),
                ttl_left: *exp - now,
            }),
            waiters: e
                .queue
                .iter()
                .filter(|(_, exp)| *exp > now)
                .map(|(t, exp)| Waiter {
                    token_prefix: token_prefix(t.as_str()),
                    expires_in: Some(*exp - now),
                })
                .collect(),
            fence_counter: Some(self.inner.fence.load(std::sync::atomic::Ordering::Acquire)),
        }
    }
}

impl AdminStore for MemoryBackend {
    fn inspect<'a>(
        &'a self,
        resource: &'a ResourceName,
    ) -> BoxFuture<'a, Result<LockState, LockError>> {
        let name = resource.as_str();
        let state = self.with_entry(name, |e, now| self.state_of(name, e, now));
        Box::pin(std::future::ready(Ok(state)))
    }

    fn list<'a>(
        &'a self,
        namespace: &'a str,
        key_prefix: &'a str,
        cursor: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, Result<LockPage, LockError>> {
        let want = name_prefix(namespace, key_prefix);
        let now = Instant::now();
        let mut found: Vec<(String, LockState)> = Vec::new();
        for shard in self.inner.shards.iter() {
            let shard = shard
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (name, e) in &shard.map {
                let after = cursor.is_none_or(|c| &**name > c);
                // Locks only (`…}`): a semaphore's (`…}:sem`) and a read-write lock's
                // (`…}:rw`) entries are not locks, and `inspect` of their key knows nothing
                // of them.
                let lock = name.ends_with('}');
                if after && lock && name.starts_with(&want) && !e.is_dead(now) {
                    let state = self.state_of(name, e, now);
                    if state.is_active() {
                        found.push((name.to_string(), state));
                    }
                }
            }
        }
        // Pages in name order, so the cursor (the last name of a page) is stable.
        found.sort_by(|a, b| a.0.cmp(&b.0));
        let limit = limit.max(1);
        let cursor = (found.len() > limit).then(|| found[limit - 1].0.clone());
        found.truncate(limit);
        Box::pin(std::future::ready(Ok(LockPage {
            locks: found.into_iter().map(|(_, s)| s).collect(),
            cursor,
        })))
    }

    fn force_release<'a>(
        &'a self,
        resource: &'a ResourceName,
    ) -> BoxFuture<'a, Result<ForceReleased, LockError>> {
        Box::pin(std::future::ready(Ok(self.force(resource, None))))
    }

    fn force_release_held_by<'a>(
        &'a self,
        resource: &'a ResourceName,
        holder: &'a str,
    ) -> BoxFuture<'a, Result<ForceReleased, LockError>> {
        Box::pin(std::future::ready(Ok(self.force(resource, Some(holder)))))
    }
}

impl MemoryBackend {
    /// A force release of `resource`; with `holder`, only while that owner holds it.
    fn force(&self, resource: &ResourceName, holder: Option<&str>) -> ForceReleased {
        let name = resource.as_str();
        // The fence is drawn under the entry's mutex, with the lock freed: an acquire that takes
        // it next draws its token after this one (drawn after the mutex was let go, it could
        // come after that acquire's, and a resource given it as its floor refused the new
        // holder).
        let done = self.with_entry(name, |e, now| {
            let live = e.live_holder(now).map(|(t, _)| t.as_str());
            if let Some(want) = holder {
                match live {
                    None => return Err(ForceReleased::default()),
                    Some(t) if !is_holder(t, want) => {
                        return Err(ForceReleased::spared(token_prefix(t)))
                    }
                    Some(_) => {}
                }
            }
            let held = live.is_some();
            e.holder = None;
            Ok((held, Self::next_waiter(e, now), self.next_fence()))
        });
        let (was_held, next, fence) = match done {
            Ok(done) => done,
            Err(untouched) => return untouched,
        };
        if was_held {
            self.inner
                .hub
                .notify(name, next.as_ref().map(OwnerToken::as_str));
        }
        ForceReleased {
            was_held,
            fence: Some(fence),
            other_holder: None,
        }
    }
}
