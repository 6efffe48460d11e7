//! [`AdminStore`] for Redis (one server, Sentinel, a cluster): one script reads a lock's key,
//! queue and fencing counter atomically; `SCAN` (never `KEYS`) lists a namespace, on every
//! master of a cluster; a force-release script is the release script without its owner check,
//! raising the fencing counter first.

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;

use super::{scripts, RedisBackend};
use crate::backend::admin::{
    key_of, name_prefix, token_prefix, AdminStore, ForceReleased, Holder, LockPage, LockState,
    Waiter,
};
use crate::backend::BoxFuture;
use crate::key::ResourceName;
use crate::{LockError, LockKey};

/// How many keys one `SCAN` call looks at.
const SCAN_COUNT: usize = 1000;

/// `SCAN` calls one page of [`AdminStore::list`] makes at most: on a server holding millions of
/// other keys, a page answers (maybe with no lock, and a cursor) after this many keys looked
/// at, rather than scanning the whole keyspace under one command deadline — which timed out
/// and gave no cursor to go on from. `Admin::list_all` follows the cursor through such pages.
const SCANS_PER_PAGE: usize = 16;

/// Reads one lock.
///
/// KEYS: 1 lock (plus, on a cluster, the derived keys). ARGV: 1 the fencing counter's key.
/// Returns `{value or '', PTTL, counter or '', {waiter, entry ms left, …}}`.
static INSPECT: LazyLock<Script> = LazyLock::new(|| {
    super::conn::script(
        &[
            scripts::QUEUE_KEYS,
            r#"
local v = redis.call('GET', KEYS[1]) or ''
local pttl = redis.call('PTTL', KEYS[1])
local fence = redis.call('GET', ARGV[1]) or ''
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ws = {}
for _, w in ipairs(redis.call('LRANGE', lq, 0, -1)) do
  local e = redis.call('HGET', lqw, w)
  local dl = e and string.match(e, '^(%d+)|')
  if dl and tonumber(dl) > now_ms then
    ws[#ws + 1] = w
    ws[#ws + 1] = string.format('%d', tonumber(dl) - now_ms)
  end
end
return {v, pttl, fence, ws}
"#,
        ]
        .concat(),
    )
});

/// The force-release script: raise the counter, then what a release by the holder
/// does (hand the lock to the first live waiter, or delete it).
///
/// KEYS as [`INSPECT`]. ARGV: 1 the fencing counter's key, 2 the client's fencing floor, 3 the
/// holder required (a token prefix; `''`: any). Returns `{1 if a live lease was removed else 0,
/// the counter after the raise, ''}`; when a holder is required and the lock is free, `{0, -1,
/// ''}`, and held by another, `{2, -1, its token's first 8 characters}` — nothing changed, the
/// counter not raised.
fn force_release(cluster: bool) -> Script {
    let text = [
        scripts::SLOT_GUARD,
        "local fence_key, fence_floor = ARGV[1], tonumber(ARGV[2])\nlocal fence\n",
        r#"
local want = ARGV[3]
if want ~= '' then
  local cur = redis.call('GET', KEYS[1])
  if not cur or redis.call('PTTL', KEYS[1]) <= LINGER then return {0, -1, ''} end
  local owner = cur
  local bar = string.find(cur, '|', 1, true)
  if bar then owner = string.sub(cur, bar + 1) end
  if string.sub(owner, 1, #want) ~= want then return {2, -1, string.sub(owner, 1, 8)} end
end
"#,
        scripts::NEXT_FENCE,
        r#"
local raised = fence
local v = redis.call('GET', KEYS[1])
if not v then return {0, raised, ''} end
local held = 0
if redis.call('PTTL', KEYS[1]) > LINGER then held = 1 end
"#,
        scripts::PARSE_LOCK,
        scripts::QUEUE_KEYS,
        scripts::PASS_ON,
        r#"
return {held, raised, ''}
"#,
    ]
    .concat();
    scripts::publishing(&text, cluster)
}

static FORCE_ONE: LazyLock<Script> = LazyLock::new(|| force_release(false));
#[cfg(feature = "cluster")]
static FORCE_CLUSTER: LazyLock<Script> = LazyLock::new(|| force_release(true));

/// `s` with the glob characters of `SCAN MATCH` escaped.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl RedisBackend {
    async fn read_lock(&self, resource: &ResourceName) -> Result<LockState, LockError> {
        let mut call = self.lock_call(&INSPECT, resource);
        call.arg(self.fence_key(resource));
        // Bytes, not text: a key another program wrote under the namespace may hold anything.
        let (value, pttl, fence, waiters): (Vec<u8>, i64, Vec<u8>, Vec<Vec<u8>>) =
            self.run_script("inspect", &call).await?;
        let (value, fence) = (
            String::from_utf8_lossy(&value),
            String::from_utf8_lossy(&fence),
        );
        let linger = super::millis(Self::LINGER) as i64;
        let owner = value.split_once('|').map_or(&*value, |(_, o)| o);
        // Held as the acquire and force-release scripts count it: a lease left past the linger.
        // A key with no expiry (`PTTL` -1) is not one of this library's locks (every lock has
        // one), and an acquire takes its place.
        let holder = (!value.is_empty() && pttl > linger).then(|| Holder {
            token_prefix: token_prefix(owner),
            fencing_token: None,
            ttl_left: Duration::from_millis(u64::try_from(pttl - linger).unwrap_or(0)),
        });
        Ok(LockState {
            key: resource.key().as_str().to_owned(),
            holder,
            waiters: waiters
                .chunks_exact(2)
                .map(|w| Waiter {
                    token_prefix: token_prefix(&String::from_utf8_lossy(&w[0])),
                    expires_in: std::str::from_utf8(&w[1])
                        .ok()
                        .and_then(|ms| ms.parse().ok())
                        .map(Duration::from_millis),
                })
                .collect(),
            fence_counter: fence.parse().ok(),
        })
    }

    /// The masters to scan: one server (`None`), or every master of the cluster, in a stable
    /// order (`host:port`).
    async fn scan_nodes(&self) -> Result<Vec<Option<(String, u16)>>, LockError> {
        #[cfg(feature = "cluster")]
        if let super::conn::Conn::Cluster { cmds, .. } = &self.inner.conn {
            use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
            let mut conn = cmds.clone();
            let nodes = self
                .deadline(
                    "cluster nodes",
                    conn.route_command(
                        redis::cmd("CLUSTER").arg("NODES").clone(),
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
                    ),
                )
                .await?;
            let text: String = redis::from_redis_value(nodes)
                .map_err(|e| super::redis_err("cluster nodes", e.into()))?;
            let mut masters: Vec<(String, u16)> = text
                .lines()
                .filter_map(|line| {
                    let mut f = line.split_whitespace();
                    let addr = f.nth(1)?;
                    let flags = f.next()?;
                    let is_master = flags.split(',').any(|x| x == "master")
                        && !flags.split(',').any(|x| x == "fail" || x == "noaddr");
                    let (host, port) = addr.split('@').next()?.rsplit_once(':')?;
                    is_master.then(|| Some((host.to_owned(), port.parse().ok()?)))?
                })
                .collect();
            masters.sort();
            return Ok(masters.into_iter().map(Some).collect());
        }
        Ok(vec![None])
    }

    async fn scan(
        &self,
        node: &Option<(String, u16)>,
        cursor: u64,
        pattern: &str,
    ) -> Result<(u64, Vec<String>), LockError> {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT)
            .arg("TYPE")
            .arg("string");
        let value = match node {
            None => {
                let mut conn = self.inner.conn.clone();
                self.deadline("scan", cmd.query_async::<redis::Value>(&mut conn))
                    .await?
            }
            #[cfg(feature = "cluster")]
            Some((host, port)) => {
                use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
                let super::conn::Conn::Cluster { cmds, .. } = &self.inner.conn else {
                    unreachable!("nodes are listed on a cluster only")
                };
                let mut conn = cmds.clone();
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                self.deadline("scan", conn.route_command(cmd, route))
                    .await?
            }
            #[cfg(not(feature = "cluster"))]
            Some(_) => unreachable!("nodes are listed on a cluster only"),
        };
        // Names as bytes: a key of another program that matches the pattern and is not UTF-8
        // (no lock key is one) is passed over, not an error that failed every page for as long
        // as it existed.
        let (next, keys): (String, Vec<Vec<u8>>) =
            redis::from_redis_value(value).map_err(|e| super::redis_err("scan", e.into()))?;
        let keys = keys
            .into_iter()
            .filter_map(|k| String::from_utf8(k).ok())
            .collect();
        Ok((next.parse().unwrap_or(0), keys))
    }

    async fn list_locks(
        &self,
        namespace: &str,
        key_prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<LockPage, LockError> {
        // The cursor is `<node index>:<SCAN cursor>`.
        let (mut node, mut at) = match cursor {
            None => (0usize, 0u64),
            Some(c) => c
                .split_once(':')
                .and_then(|(n, a)| Some((n.parse().ok()?, a.parse().ok()?)))
                .ok_or_else(|| LockError::invalid_key("invalid list cursor"))?,
        };
        let nodes = self.scan_nodes().await?;
        // Lock keys are exactly `<namespace>:{<key>}` (an encoded key holds no braces; the
        // queue keys end in `:q`/`:qw`, the fencing counters in `:fence`).
        let pattern = format!("{}*}}", glob_escape(&name_prefix(namespace, key_prefix)));
        let mut names = Vec::new();
        let mut scans = 0;
        while node < nodes.len() && names.len() < limit.max(1) && scans < SCANS_PER_PAGE {
            scans += 1;
            let (next, keys) = self.scan(&nodes[node], at, &pattern).await?;
            names.extend(keys);
            if next == 0 {
                node += 1;
                at = 0;
            } else {
                at = next;
            }
        }
        let reads = names.iter().filter_map(|name| {
            let key = LockKey::from_encoded(key_of(name)).ok()?;
            Some(ResourceName::new(namespace, key))
        });
        let reads =
            futures_util::future::join_all(reads.map(|r| async move { self.read_lock(&r).await }))
                .await;
        // A key that cannot be read as a lock (another program's key of another type under
        // the namespace: `WRONGTYPE`) is passed over; only when every read failed is the page
        // an error (the server is down, say).
        let mut locks = Vec::with_capacity(reads.len());
        let (mut failed, mut answered) = (None, false);
        for r in reads {
            match r {
                Ok(state) => {
                    answered = true;
                    if state.is_active() {
                        locks.push(state);
                    }
                }
                Err(e) => failed = Some(e),
            }
        }
        if let Some(e) = failed.filter(|_| !answered) {
            return Err(e);
        }
        Ok(LockPage {
            locks,
            cursor: (node < nodes.len()).then(|| format!("{node}:{at}")),
        })
    }
}

impl AdminStore for RedisBackend {
    fn inspect<'a>(
        &'a self,
        resource: &'a ResourceName,
    ) -> BoxFuture<'a, Result<LockState, LockError>> {
        Box::pin(self.read_lock(resource))
    }

    fn list<'a>(
        &'a self,
        namespace: &'a str,
        key_prefix: &'a str,
        cursor: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, Result<LockPage, LockError>> {
        Box::pin(self.list_locks(namespace, key_prefix, cursor, limit))
    }

    fn force_release<'a>(
        &'a self,
        resource: &'a ResourceName,
    ) -> BoxFuture<'a, Result<ForceReleased, LockError>> {
        Box::pin(self.force(resource, ""))
    }

    fn force_release_held_by<'a>(
        &'a self,
        resource: &'a ResourceName,
        holder: &'a str,
    ) -> BoxFuture<'a, Result<ForceReleased, LockError>> {
        Box::pin(async move {
            if holder.is_empty() {
                // `''` is "any holder" to the script; here it names nobody, as in the other
                // stores: nothing is released, and a holder is named.
                let state = self.read_lock(resource).await?;
                return Ok(match state.holder {
                    Some(h) => ForceReleased::spared(h.token_prefix),
                    None => ForceReleased::default(),
                });
            }
            self.force(resource, holder).await
        })
    }
}

impl RedisBackend {
    /// A force release of `resource`; with a `holder` (not `""`), only while that owner holds
    /// it.
    async fn force(
        &self,
        resource: &ResourceName,
        holder: &str,
    ) -> Result<ForceReleased, LockError> {
        #[cfg(feature = "cluster")]
        let script = if self.is_cluster() {
            &*FORCE_CLUSTER
        } else {
            &*FORCE_ONE
        };
        #[cfg(not(feature = "cluster"))]
        let script = &*FORCE_ONE;
        self.issuer().await?;
        let mut call = self.lock_call(script, resource);
        call.arg(self.fence_key(resource))
            .arg(self.floor())
            .arg(holder);
        let ((held, counter, other), issuer): ((i64, i64, Vec<u8>), _) =
            self.run_granting("force release", &call).await?;
        if held == 2 {
            return Ok(ForceReleased::spared(
                String::from_utf8_lossy(&other).into_owned(),
            ));
        }
        // As a token (`RedisBackend::ISSUER_BITS`): above every token issued before, below
        // every one issued after (none when the counter is past the tokens' range).
        let fence = u64::try_from(counter).ok();
        Ok(ForceReleased {
            was_held: held == 1,
            fence: fence.and_then(|c| self.granted(c, issuer).ok()),
            other_holder: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_patterns_escape_globs() {
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
        assert_eq!(
            format!("{}*}}", glob_escape(&name_prefix("dlock", "order:"))),
            "dlock:{order:*}"
        );
    }
}
