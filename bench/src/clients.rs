//! The three drivers behind one interface: `raw` (hand-written commands, the floor), `dlock`
//! (the runtime) and `rslock` (crates.io, defaults).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::backend::{RedlockBackend, RedlockOptions};
use dlock_runtime::{LockGuard, Locker, OnFail};
use futures_util::stream::{FuturesUnordered, StreamExt as _};
use redis::aio::MultiplexedConnection;

use crate::BenchError;

/// How long a `raw` waiter sleeps between attempts on a held lock (a fixed short poll).
pub(crate) const RAW_POLL: Duration = Duration::from_millis(1);
/// Per-node deadline of the `raw` Redlock fan-out (the same as dlock's default node timeout).
pub(crate) const RAW_NODE_TIMEOUT: Duration = Duration::from_millis(50);
/// dlock's waiting deadline in the contended scenarios: long, so it never gives up.
pub(crate) const DLOCK_WAIT: Duration = Duration::from_secs(30);

/// The compare-and-delete of `raw`.
pub(crate) const RAW_UNLOCK: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

/// An operation that did not go through for a reason a loaded machine can cause (a node
/// deadline passed, a majority did not confirm): counted in the figures, not a driver error.
#[derive(Debug)]
pub(crate) struct Soft(pub(crate) String);

impl std::fmt::Display for Soft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Soft {}

/// Whether `e` is a [`Soft`] failure: ours, dlock's "unavailable"/"lost" (deadlines), or a
/// redis-rs timeout.
pub(crate) fn is_soft(e: &BenchError) -> bool {
    if e.is::<Soft>() {
        return true;
    }
    if let Some(e) = e.downcast_ref::<dlock_runtime::LockError>() {
        return e.is_unavailable() || e.is_lost();
    }
    if let Some(e) = e.downcast_ref::<redis::RedisError>() {
        return e.is_timeout();
    }
    false
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Driver {
    Raw,
    Dlock,
    Rslock,
}

impl Driver {
    pub(crate) const ALL: [Driver; 3] = [Driver::Raw, Driver::Dlock, Driver::Rslock];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Driver::Raw => "raw",
            Driver::Dlock => "dlock",
            Driver::Rslock => "rslock",
        }
    }

    /// Commands this driver sends itself (not from inside a Lua script), for counting
    /// requests per operation from Redis's `INFO commandstats`.
    pub(crate) fn top_level_commands(self) -> &'static [&'static str] {
        match self {
            Driver::Raw => &["set", "evalsha"],
            Driver::Dlock => &[
                "evalsha",
                "eval",
                "script",
                "subscribe",
                "unsubscribe",
                "ping",
            ],
            Driver::Rslock => &["set", "evalsha", "eval", "script"],
        }
    }
}

/// A connected driver. Cheap to clone.
#[derive(Clone)]
pub(crate) enum Client {
    Raw(Raw),
    Dlock(Locker),
    Rslock(rslock::LockManager),
}

/// A held lock of any driver.
pub(crate) enum Held {
    Raw { key: String, token: String },
    Dlock(LockGuard),
    Rslock(rslock::Lock),
}

impl Client {
    /// Connects `driver` to one server (`urls.len() == 1`) or, for Redlock, to all `urls`.
    pub(crate) async fn connect(driver: Driver, urls: &[String]) -> Result<Client, BenchError> {
        Ok(match driver {
            Driver::Raw => Client::Raw(Raw::connect(urls).await?),
            Driver::Dlock if urls.len() == 1 => Client::Dlock(Locker::from_url(&urls[0]).await?),
            Driver::Dlock => {
                let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
                let backend = RedlockBackend::connect(&refs, RedlockOptions::default()).await?;
                Client::Dlock(Locker::new(backend))
            }
            // rslock connects lazily, on its first command.
            Driver::Rslock => Client::Rslock(rslock::LockManager::new(urls.to_vec())),
        })
    }

    /// One acquire with the driver's "don't wait" behaviour: `Ok(None)` when not acquired.
    /// For rslock that is its `lock()`, which itself makes up to 3 attempts (its default).
    pub(crate) async fn try_lock(
        &self,
        key: &str,
        ttl: Duration,
    ) -> Result<Option<Held>, BenchError> {
        match self {
            Client::Raw(raw) => raw.try_lock(key, ttl).await,
            Client::Dlock(locker) => Ok(locker
                .lock(key)
                .ttl(ttl)
                .try_acquire()
                .await?
                .map(Held::Dlock)),
            Client::Rslock(m) => match m.lock(key, ttl).await {
                Ok(lock) => Ok(Some(Held::Rslock(lock))),
                Err(rslock::LockError::Unavailable) => Ok(None),
                Err(e) => Err(e.into()),
            },
        }
    }

    /// Waits for the lock with the driver's waiting strategy, giving up (as an error) after
    /// `give_up`.
    pub(crate) async fn lock_wait(
        &self,
        key: &str,
        ttl: Duration,
        give_up: Duration,
    ) -> Result<Held, BenchError> {
        let deadline = Instant::now() + give_up;
        match self {
            Client::Raw(raw) => loop {
                if let Some(h) = raw.try_lock(key, ttl).await? {
                    return Ok(h);
                }
                if Instant::now() >= deadline {
                    return Err(format!("raw: no lock on {key} within {give_up:?}").into());
                }
                tokio::time::sleep(RAW_POLL).await;
            },
            Client::Dlock(locker) => Ok(Held::Dlock(
                locker
                    .lock(key)
                    .ttl(ttl)
                    .on_fail(OnFail::retry(DLOCK_WAIT.min(give_up)))
                    .acquire()
                    .await?,
            )),
            // rslock's own retry behaviour (3 attempts, 0–200 ms random delay between them),
            // called again until it succeeds, as its `acquire()` does.
            Client::Rslock(m) => loop {
                match m.lock(key, ttl).await {
                    Ok(lock) => return Ok(Held::Rslock(lock)),
                    Err(rslock::LockError::Unavailable) if Instant::now() < deadline => {}
                    Err(rslock::LockError::Unavailable) => {
                        return Err(format!("rslock: no lock on {key} within {give_up:?}").into())
                    }
                    Err(e) => return Err(e.into()),
                }
            },
        }
    }

    /// Releases `held`. A lock found lost is an error.
    pub(crate) async fn unlock(&self, held: Held) -> Result<(), BenchError> {
        match (self, held) {
            (Client::Raw(raw), Held::Raw { key, token }) => {
                if raw.unlock(&key, &token).await? {
                    Ok(())
                } else {
                    Err(Box::new(Soft(format!(
                        "raw: release of {key} not confirmed (lost, or a majority missed its deadline)"
                    ))))
                }
            }
            (Client::Dlock(_), Held::Dlock(guard)) => Ok(guard.release().await?),
            // Best effort, no result (rslock's API).
            (Client::Rslock(m), Held::Rslock(lock)) => {
                m.unlock(&lock).await;
                Ok(())
            }
            _ => Err("a lock was released through another driver".into()),
        }
    }
}

/// Hand-written `SET key token NX PX ttl` and an `EVALSHA` compare-and-delete over one shared
/// multiplexed connection per server. With several servers: a Redlock-style fan-out
/// (granted when a majority says OK, each node with [`RAW_NODE_TIMEOUT`], undone everywhere
/// on failure), without validity-time or fencing bookkeeping.
#[derive(Clone)]
pub(crate) struct Raw {
    nodes: Arc<[MultiplexedConnection]>,
    sha: Arc<str>,
    prefix: u64,
    seq: Arc<AtomicU64>,
}

impl Raw {
    async fn connect(urls: &[String]) -> Result<Raw, BenchError> {
        let mut nodes = Vec::with_capacity(urls.len());
        let mut sha = String::new();
        for url in urls {
            let mut conn = redis::Client::open(url.as_str())?
                .get_multiplexed_async_connection()
                .await?;
            sha = redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(RAW_UNLOCK)
                .query_async(&mut conn)
                .await?;
            nodes.push(conn);
        }
        let mut seed = [0u8; 8];
        getrandom::fill(&mut seed).map_err(|e| format!("getrandom: {e}"))?;
        Ok(Raw {
            nodes: nodes.into(),
            sha: sha.into(),
            prefix: u64::from_le_bytes(seed),
            seq: Arc::new(AtomicU64::new(0)),
        })
    }

    /// A unique owner token as long as dlock's (32 hex digits), without a syscall.
    fn token(&self) -> String {
        format!(
            "{:016x}{:016x}",
            self.prefix,
            self.seq.fetch_add(1, Ordering::Relaxed)
        )
    }

    fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    async fn set_nx(
        mut conn: MultiplexedConnection,
        key: &str,
        token: &str,
        ttl_ms: u64,
    ) -> redis::RedisResult<bool> {
        let v: redis::Value = redis::cmd("SET")
            .arg(key)
            .arg(token)
            .arg("NX")
            .arg("PX")
            .arg(ttl_ms)
            .query_async(&mut conn)
            .await?;
        Ok(matches!(v, redis::Value::Okay))
    }

    async fn del_if(
        mut conn: MultiplexedConnection,
        sha: &str,
        key: &str,
        token: &str,
    ) -> redis::RedisResult<bool> {
        let n: i64 = redis::cmd("EVALSHA")
            .arg(sha)
            .arg(1)
            .arg(key)
            .arg(token)
            .query_async(&mut conn)
            .await?;
        Ok(n == 1)
    }

    async fn try_lock(&self, key: &str, ttl: Duration) -> Result<Option<Held>, BenchError> {
        let token = self.token();
        let ttl_ms = ttl.as_millis() as u64;
        let held = || Held::Raw {
            key: key.to_owned(),
            token: token.clone(),
        };
        if self.nodes.len() == 1 {
            let ok = Self::set_nx(self.nodes[0].clone(), key, &token, ttl_ms).await?;
            return Ok(ok.then(held));
        }
        let n = self.nodes.len();
        let mut votes: FuturesUnordered<_> = self
            .nodes
            .iter()
            .map(|c| {
                let fut = Self::set_nx(c.clone(), key, &token, ttl_ms);
                async move {
                    matches!(
                        tokio::time::timeout(RAW_NODE_TIMEOUT, fut).await,
                        Ok(Ok(true))
                    )
                }
            })
            .collect();
        let (mut yes, mut no) = (0, 0);
        while let Some(v) = votes.next().await {
            if v {
                yes += 1;
            } else {
                no += 1;
            }
            if yes >= self.quorum() || no > n - self.quorum() {
                break;
            }
        }
        if yes >= self.quorum() {
            return Ok(Some(held()));
        }
        drop(votes);
        // Failed: undo on every node (the unanswered ones included).
        futures_util::future::join_all(self.nodes.iter().map(|c| {
            tokio::time::timeout(
                RAW_NODE_TIMEOUT,
                Self::del_if(c.clone(), &self.sha, key, &token),
            )
        }))
        .await;
        Ok(None)
    }

    async fn unlock(&self, key: &str, token: &str) -> Result<bool, BenchError> {
        if self.nodes.len() == 1 {
            return Ok(Self::del_if(self.nodes[0].clone(), &self.sha, key, token).await?);
        }
        let yes = futures_util::future::join_all(self.nodes.iter().map(|c| {
            tokio::time::timeout(
                RAW_NODE_TIMEOUT,
                Self::del_if(c.clone(), &self.sha, key, token),
            )
        }))
        .await
        .into_iter()
        .filter(|r| matches!(r, Ok(Ok(true))))
        .count();
        Ok(yes >= self.quorum())
    }
}
