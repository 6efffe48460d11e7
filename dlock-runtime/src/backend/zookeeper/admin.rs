//! [`AdminStore`](crate::backend::AdminStore) for ZooKeeper: a lock's nodes read in sequence
//! order and judged as an attempt judges them — the lowest node is the holder unless its lease
//! (node data, counted from its `mtime`) has run out by the ensemble's clock; later nodes whose
//! lease still runs are the waiters in line. The ensemble's "now" is the `mtime` of one write:
//! an empty `setData` on the lock root (ZooKeeper has no other clock a client can read, and a
//! client's own clock is never trusted). As in an attempt, a lease is judged only when that
//! write and the node's last one were made in the same epoch, by one leader's clock (see
//! `Seen`): a node last written under an earlier leader is live, with its whole lease left —
//! what it has once the next attempt starts it again. An inspection writes nothing to a lock's
//! nodes, so it does not start such a lease itself. Locks are listed from the children of the
//! lock root; a force release deletes only the holder's node, guarded by its `czxid`, so the
//! next waiter's predecessor watch fires and it takes the lock as after a release. The next
//! holder's fencing token — its node's `czxid` — is above the old holder's by construction, so
//! there is no counter to raise (`ForceReleased::fence` is `None`).

use zookeeper_client::Client;

use super::{again, node_name, sorted, unavailable, Now, Seen, ZkBackend, ZkError};
use crate::backend::admin::{
    is_holder, key_of, name_prefix, token_prefix, ForceReleased, Holder, LockPage, LockState,
    Waiter,
};
use crate::LockError;

/// The resource string of a lock directory's node name (the inverse of [`node_name`]).
fn resource_of(node: &str) -> Option<String> {
    crate::util::percent_decode(node)
}

/// One page of a listing from the lock root's children `names`: the resources of the first
/// `limit` (at least 1, as `Admin::list` asks) names under `prefix` after the node name
/// `after`, in order, and the cursor to the next page (the last of them) when more are left.
/// A name that does not decode (another program's node under the root) is no lock, and is
/// passed over before the page is cut: counted in it, a page of such names had no resource to
/// go on from, and the listing ended there with every later lock missing.
fn page_of(
    mut names: Vec<String>,
    prefix: &str,
    after: Option<&str>,
    limit: usize,
) -> (Vec<String>, Option<String>) {
    names.retain(|n| n.starts_with(prefix) && after.is_none_or(|a| n.as_str() > a));
    names.sort_unstable();
    let mut resources: Vec<String> = names.iter().filter_map(|n| resource_of(n)).collect();
    let limit = limit.max(1);
    let more = resources.len() > limit;
    resources.truncate(limit);
    let cursor = more.then(|| resources.last().cloned()).flatten();
    (resources, cursor)
}

/// The owner token part of a node name `<token>-<sequence>`.
fn token_of(seen: &Seen) -> String {
    let name = &seen.child.name;
    // Tokens are hex: the first '-' ends it (a wrapped sequence has a sign of its own).
    token_prefix(name.split_once('-').map_or(name.as_str(), |(t, _)| t))
}

/// A lock's nodes as an attempt judges them at `now`: the holder's (the lowest, while its lease
/// runs) and the live waiters', in sequence order.
struct Judged {
    holder: Option<Seen>,
    waiters: Vec<Seen>,
}

impl Judged {
    /// Judges the nodes of a listing as read one by one (`None`: deleted after the listing).
    /// A deleted node is not ahead of anything: when the head's node went between the listing
    /// and its read (a release, an expiry, a force), the next node is the lowest and holds —
    /// counted as a waiter, the lock read "free" while that node's owner held it.
    fn of(seen: Vec<Option<Seen>>, now: Now) -> Self {
        let mut live = seen
            .into_iter()
            .flatten()
            .enumerate()
            .filter(|(_, s)| !s.expired(now));
        let mut holder = None;
        let mut waiters = Vec::new();
        if let Some((i, s)) = live.next() {
            // Only the lowest node holds; an expired one ahead makes the lock free until the
            // next attempt deletes it.
            if i == 0 {
                holder = Some(s);
            } else {
                waiters.push(s);
            }
        }
        waiters.extend(live.map(|(_, s)| s));
        Self { holder, waiters }
    }
}

impl ZkBackend {
    /// The ensemble's clock: the `mtime` (and epoch) of an empty write to the lock root.
    async fn server_now(&self, c: &Client) -> Result<Now, LockError> {
        match again(|| c.set_data(&self.base, &[], None)).await {
            Ok(stat) => Ok(Now::of(&stat)),
            Err(e) => Err(unavailable("setData (clock)", e)),
        }
    }

    async fn judge(&self, c: &Client, resource: &str, now: Now) -> Result<Judged, LockError> {
        let dir = self.dir(resource);
        let kids = match again(|| c.list_children(&dir)).await {
            Ok(k) => sorted(k),
            Err(ZkError::NoNode) => Vec::new(),
            Err(e) => return Err(unavailable("getChildren", e)),
        };
        let seen = Self::read(c, &dir, &kids.iter().collect::<Vec<_>>()).await?;
        Ok(Judged::of(seen, now))
    }

    async fn state_at(&self, c: &Client, resource: &str, now: Now) -> Result<LockState, LockError> {
        let judged = self.judge(c, resource, now).await?;
        Ok(LockState {
            key: key_of(resource).to_owned(),
            holder: judged.holder.map(|s| Holder {
                token_prefix: token_of(&s),
                fencing_token: Some(s.stat.czxid.unsigned_abs()),
                // A node without a lease lives as long as its session.
                ttl_left: s.remaining(now).unwrap_or_else(|| self.session.timeout()),
            }),
            waiters: judged
                .waiters
                .iter()
                .map(|s| Waiter {
                    token_prefix: token_of(s),
                    expires_in: s.remaining(now),
                })
                .collect(),
            fence_counter: None,
        })
    }

    async fn read_lock(&self, resource: &str) -> Result<LockState, LockError> {
        self.bounded("inspect", async {
            let c = self.session.client().await?;
            let now = self.server_now(&c).await?;
            self.state_at(&c, resource, now).await
        })
        .await
    }

    async fn list_locks(
        &self,
        namespace: &str,
        key_prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<LockPage, LockError> {
        let c = self.session.client().await?;
        let prefix = node_name(&name_prefix(namespace, key_prefix));
        let after = cursor.map(node_name);
        let names = self
            .bounded("list", async {
                match again(|| c.list_children(&self.base)).await {
                    Ok(k) => Ok(k),
                    Err(ZkError::NoNode) => Ok(Vec::new()),
                    Err(e) => Err(unavailable("getChildren", e)),
                }
            })
            .await?;
        let (resources, cursor) = page_of(names, &prefix, after.as_deref(), limit);
        let now = self
            .bounded("list", async { self.server_now(&c).await })
            .await?;
        let c = &c;
        let locks = super::super::admin::read_active(
            resources,
            super::super::admin::PAGE_READS,
            |r| async move { self.bounded("inspect", self.state_at(c, &r, now)).await },
        )
        .await?;
        Ok(LockPage { locks, cursor })
    }

    /// A force release of `resource`; with `want`, only while that owner holds it (its node,
    /// named by its token, is the holder's, and the delete is guarded as below).
    async fn force(&self, resource: &str, want: Option<&str>) -> Result<ForceReleased, LockError> {
        self.bounded("force release", self.delete_holder(resource, want))
            .await
    }

    /// Deletes the holder's node, if the lock has a live holder (`want`'s, when given).
    async fn delete_holder(
        &self,
        resource: &str,
        want: Option<&str>,
    ) -> Result<ForceReleased, LockError> {
        let c = self.session.client().await?;
        let now = self.server_now(&c).await?;
        let Some(holder) = self.judge(&c, resource, now).await?.holder else {
            return Ok(ForceReleased::default());
        };
        if let Some(want) = want {
            let name = &holder.child.name;
            let owner = name.split_once('-').map_or(name.as_str(), |(t, _)| t);
            if !is_holder(owner, want) {
                return Ok(ForceReleased::spared(token_of(&holder)));
            }
        }
        let released = |was_held| ForceReleased {
            was_held,
            ..ForceReleased::default()
        };
        let path = format!("{}/{}", self.dir(resource), holder.child.name);
        let mut version = holder.stat.version;
        // Guarded by version; a renewal in between changes only the version, so the node is
        // read again and deleted while it is still the node seen (same czxid).
        loop {
            match again(|| c.delete(&path, Some(version))).await {
                Ok(()) => return Ok(released(true)),
                Err(ZkError::NoNode) => return Ok(released(false)),
                Err(ZkError::BadVersion) => {}
                Err(e) => return Err(unavailable("delete", e)),
            }
            match again(|| c.get_data(&path)).await {
                Ok((_, stat)) if stat.czxid == holder.stat.czxid => version = stat.version,
                Ok(_) | Err(ZkError::NoNode) => return Ok(released(false)),
                Err(e) => return Err(unavailable("getData", e)),
            }
        }
    }
}

crate::backend::admin::admin_store_via!(ZkBackend);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_decode_to_their_resource() {
        for name in ["dlock:{a/b c%}", "p:{é}", "{x-1}", ""] {
            assert_eq!(resource_of(&node_name(name)).as_deref(), Some(name));
        }
        assert_eq!(resource_of("bad%2"), None);
        assert_eq!(resource_of("bad%zz"), None);
    }

    /// A node under the root that does not decode (another program's) is passed over, not
    /// counted in a page: a page of such names had no cursor, and the listing ended before the
    /// locks after it.
    #[test]
    fn a_listing_goes_on_past_nodes_that_do_not_decode() {
        let names = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let all = names(&["dlock:{%zz", "dlock:{b}", "dlock:{a}", "other:{c}"]);
        let (page, cursor) = page_of(all.clone(), "dlock:{", None, 1);
        assert_eq!(page, ["dlock:{a}"]);
        let cursor = cursor.expect("a cursor: a lock is left");
        let (page, cursor) = page_of(all.clone(), "dlock:{", Some(&node_name(&cursor)), 1);
        assert_eq!(page, ["dlock:{b}"]);
        assert_eq!(cursor, None);
        let (page, cursor) = page_of(names(&["dlock:{%zz", "dlock:{%zy"]), "dlock:{", None, 1);
        assert!(page.is_empty() && cursor.is_none());
    }

    /// A node as read: made at sequence `order`, its lease `lease` ms from `mtime`.
    fn node(order: i64, mtime: i64, lease: i64) -> Option<Seen> {
        Some(Seen {
            child: super::super::Child {
                name: format!("ab{order}-{order:010}"),
                order,
            },
            lease: Some(lease),
            stat: super::super::stat_at(order, mtime),
        })
    }

    fn orders(nodes: &[Seen]) -> Vec<i64> {
        nodes.iter().map(|s| s.child.order).collect()
    }

    /// The head's node deleted between the listing and its read (a release): the next node is
    /// the lowest and is the holder. Before, it was counted a waiter and the lock read "free"
    /// (and a force release answered "was not held") while that node's owner held it.
    #[test]
    fn a_head_deleted_after_the_listing_leaves_the_next_node_holding() {
        let now = Now {
            mtime: 1_100,
            epoch: 0,
        };
        let judged = Judged::of(vec![None, node(2, 1_000, 500), node(3, 1_000, 500)], now);
        assert_eq!(judged.holder.map(|s| s.child.order), Some(2));
        assert_eq!(orders(&judged.waiters), [3]);
        // An expired node ahead still stands in line until an attempt deletes it: the lock is
        // free and the live nodes behind it wait.
        let judged = Judged::of(vec![node(1, 0, 100), node(2, 1_000, 500)], now);
        assert!(judged.holder.is_none());
        assert_eq!(orders(&judged.waiters), [2]);
        let judged = Judged::of(vec![None, node(2, 0, 100), node(3, 1_000, 500)], now);
        assert!(judged.holder.is_none());
        assert_eq!(orders(&judged.waiters), [3]);
    }

    /// After a leader change, a holder's node last written under the old leader is judged as
    /// an attempt judges it: live (its lease is started again, never judged by two leaders'
    /// clocks), so it is the holder, whatever its `mtime`.
    #[test]
    fn a_node_of_an_earlier_epoch_still_holds() {
        let now = Now {
            mtime: 1_100,
            epoch: 1,
        };
        let judged = Judged::of(vec![node(1, 0, 100), node(2, 1_000, 500)], now);
        assert_eq!(judged.holder.map(|s| s.child.order), Some(1));
        assert_eq!(orders(&judged.waiters), [2]);
    }
}
