//! The `etcd` scenario, on one etcd member (`dlock_tests::etcd_server`):
//!
//! * uncontended lock/unlock pairs per second, dlock's etcd backend against two hand-written
//!   floors over the same client crate — a bare transaction (create the key on a lease if
//!   absent, then delete it) and etcd's own lock RPC (`v3lock` `Lock`/`Unlock` on a lease);
//! * contended: [`contended::TASKS`] tasks on one key holding it [`contended::HOLD`] — dlock
//!   with `OnFail::retry` (fair queue, predecessor watch) against the lock RPC (the server's
//!   own queue on the same recipe): critical sections per second, handoff p50/p99, fairness.
//!
//! The floors grant their lease once per task and reuse it; dlock keeps its locks on a session
//! lease per locker (see `dlock_runtime::backend::etcd`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, LockOptions, PutOptions, Txn, TxnOp};
use serde_json::{json, Value};

use crate::contended::{self, Contended};
use crate::stats::{round1, us};
use crate::{BenchError, Plan};

/// Concurrent tasks per driver (each on its own keys: no contention).
pub(crate) const TASKS: usize = 8;

/// One uncontended driver's figures: pairs per second, and this process's CPU per pair (the
/// client's: only one driver runs at a time), pooled over the rounds; and each round's pairs
/// per second (a rate that falls round after round shows a cost that grows with the store's
/// history).
#[derive(Clone)]
pub(crate) struct Rate {
    pub(crate) pairs_per_s: f64,
    pub(crate) client_cpu_us_per_pair: f64,
    pub(crate) rounds_pairs_per_s: Vec<f64>,
}

impl Rate {
    pub(crate) fn json(&self) -> Value {
        json!({
            "pairs_per_s": self.pairs_per_s.round(),
            "client_cpu_us_per_pair": round1(self.client_cpu_us_per_pair),
            "rounds_pairs_per_s": self.rounds_pairs_per_s.iter().map(|r| r.round()).collect::<Vec<_>>(),
        })
    }
}

/// One measured window of one driver: pairs done, how long it took, this process's CPU.
#[derive(Clone, Copy)]
pub(crate) struct Window {
    pairs: u64,
    secs: f64,
    cpu_secs: f64,
}

impl Window {
    /// The rate over windows pooled (pairs and seconds summed).
    fn pooled(windows: &[Window]) -> Rate {
        let (pairs, secs, cpu) = windows.iter().fold((0, 0.0, 0.0), |(p, s, c), w| {
            (p + w.pairs, s + w.secs, c + w.cpu_secs)
        });
        Rate {
            pairs_per_s: pairs as f64 / secs.max(f64::MIN_POSITIVE),
            client_cpu_us_per_pair: cpu * 1e6 / pairs.max(1) as f64,
            rounds_pairs_per_s: windows
                .iter()
                .map(|w| w.pairs as f64 / w.secs.max(f64::MIN_POSITIVE))
                .collect(),
        }
    }
}

/// A driver's pair: one lock + unlock by task `t` (its `n`th), boxed so that drivers of
/// different types take turns in [`interleaved`].
pub(crate) type PairFn = Arc<
    dyn Fn(usize, u64) -> futures_util::future::BoxFuture<'static, Result<(), BenchError>>
        + Send
        + Sync,
>;

/// Boxes a pair closure into a [`PairFn`].
pub(crate) fn pair_fn<F, Fut>(f: F) -> PairFn
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), BenchError>> + Send + 'static,
{
    Arc::new(move |t, n| Box::pin(f(t, n)))
}

/// Runs each driver's window once per round, drivers taking turns (as the Redis scenarios
/// do: background drift and the store's own growth hit every driver alike), and pools each
/// driver's rounds.
pub(crate) async fn interleaved<const N: usize>(
    plan: &Plan,
    drivers: [PairFn; N],
) -> Result<[Rate; N], BenchError> {
    let mut windows: [Vec<Window>; N] = std::array::from_fn(|_| Vec::new());
    for _ in 0..plan.rounds {
        for (d, pair) in drivers.iter().enumerate() {
            windows[d].push(measure(plan, pair.clone()).await?);
        }
    }
    Ok(windows.map(|w| Window::pooled(&w)))
}

/// Runs `pair` (one lock + unlock of key `i`) from [`TASKS`] tasks for the warm-up, then counts
/// pairs and this process's CPU for the window.
async fn measure(plan: &Plan, pair: PairFn) -> Result<Window, BenchError> {
    let counting = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (pair, counting, stop, done) =
            (pair.clone(), counting.clone(), stop.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                pair(t, n).await?;
                n += 1;
                if counting.load(Ordering::Relaxed) {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok::<(), BenchError>(())
        }));
    }
    tokio::time::sleep(plan.warm).await;
    counting.store(true, Ordering::Relaxed);
    let (start, cpu) = (Instant::now(), crate::sys::cpu_secs());
    tokio::time::sleep(plan.measure).await;
    let pairs = done.load(Ordering::Relaxed);
    let (took, cpu) = (start.elapsed(), crate::sys::cpu_secs() - cpu);
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await??;
    }
    Ok(Window {
        pairs,
        secs: took.as_secs_f64(),
        cpu_secs: cpu,
    })
}

/// The dlock driver's pair on `locker`: `try_acquire` + `release` of key `n % 64` of task `t`
/// (TTL 10 s).
pub(crate) fn dlock_pair(locker: dlock_runtime::Locker) -> PairFn {
    pair_fn(move |t, n| {
        let locker = locker.clone();
        async move {
            let key = format!("bench:{t}:{}", n % 64);
            let g = locker
                .lock(&key)
                .ttl(Duration::from_secs(10))
                .try_acquire()
                .await?
                .ok_or("held")?;
            g.release().await?;
            Ok(())
        }
    })
}

/// [`contended::run_with`] for a locker on `url`: `OnFail::retry` (the fair queue), TTL 10 s.
pub(crate) async fn contended_dlock(plan: &Plan, url: &str) -> Result<Contended, BenchError> {
    let locker = dlock_runtime::Locker::from_url(url).await?;
    contended::run_with(
        plan,
        move |_| {
            let locker = locker.clone();
            async move {
                Ok(locker
                    .lock("contended")
                    .ttl(Duration::from_secs(10))
                    .on_fail(dlock_runtime::OnFail::retry(Duration::from_secs(30)))
                    .acquire()
                    .await?)
            }
        },
        |_, g: dlock_runtime::LockGuard| async move { Ok(g.release().await?) },
    )
    .await
}

/// The scenario's JSON: pairs per second of each driver.
pub(crate) async fn run(plan: &Plan) -> Result<Value, BenchError> {
    // On a thread that outlives the scenario: the member dies with the thread that started it
    // (`setpriv --pdeathsig`), and tokio retires idle blocking threads after 10 s.
    let member = tokio::task::spawn_blocking(|| {
        dlock_tests::redis_server::on_owner_thread(
            "etcd-bench",
            dlock_tests::etcd_server::EtcdCluster::start,
        )
    })
    .await?;
    let url = member.url();
    let endpoint = url.replacen("etcd://", "http://", 1);
    let client = Client::connect([endpoint.as_str()], None).await?;
    // Never renewed: long enough for every round of every driver.
    let lease_ttl = 3600;

    let mut leases = Vec::new();
    for _ in 0..TASKS {
        leases.push(client.lease_client().grant(lease_ttl, None).await?.id());
    }
    let leases = Arc::new(leases);
    let (c, l) = (client.clone(), leases.clone());
    let bare_txn = pair_fn(move |t, n| {
        let (mut kv, lease) = (c.kv_client(), l[t]);
        async move {
            let key = format!("floor/{t}/{}", n % 64);
            let txn = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(
                    key.clone(),
                    "x",
                    Some(PutOptions::new().with_lease(lease)),
                )]);
            if !kv.txn(txn).await?.succeeded() {
                return Err("held".into());
            }
            kv.delete(key, None).await?;
            Ok(())
        }
    });
    let (c, l) = (client.clone(), leases.clone());
    let lock_rpc = pair_fn(move |t, n| {
        let (mut lock, lease) = (c.lock_client(), l[t]);
        async move {
            let name = format!("rpc/{t}/{}", n % 64);
            let held = lock
                .lock(name, Some(LockOptions::new().with_lease(lease)))
                .await?;
            lock.unlock(held.key().to_vec()).await?;
            Ok(())
        }
    });
    let dlock = dlock_pair(dlock_runtime::Locker::from_url(&url).await?);
    let [dlock, bare_txn, lock_rpc] = interleaved(plan, [dlock, bare_txn, lock_rpc]).await?;
    let contended_dlock = contended_dlock(plan, &url).await?;
    let mut leases = Vec::new();
    for _ in 0..contended::TASKS {
        leases.push(client.lease_client().grant(lease_ttl, None).await?.id());
    }
    let leases = Arc::new(leases);
    let (c, l) = (client.clone(), leases.clone());
    let contended_rpc = contended::run_with(
        plan,
        move |t| {
            let (mut lock, lease) = (c.lock_client(), l[t]);
            async move {
                let options = LockOptions::new().with_lease(lease);
                Ok(lock.lock("contended", Some(options)).await?.key().to_vec())
            }
        },
        {
            let c = client.clone();
            move |_, key: Vec<u8>| {
                let mut lock = c.lock_client();
                async move {
                    lock.unlock(key).await?;
                    Ok(())
                }
            }
        },
    )
    .await?;
    drop(member);
    Ok(json!({
        "tasks": TASKS,
        "dlock": dlock.json(),
        "bare_txn": bare_txn.json(),
        "lock_rpc": lock_rpc.json(),
        "contended": {
            "tasks": contended::TASKS,
            "dlock": contended_json(&contended_dlock),
            "lock_rpc": contended_json(&contended_rpc),
        },
    }))
}

pub(crate) fn contended_json(c: &Contended) -> Value {
    json!({
        "cs_per_s": round1(c.cs_per_s()),
        "handoff_p50_us": us(c.handoff.median()),
        "handoff_p99_us": us(c.handoff.pct(99.0)),
        "fairness": c.fairness(),
        "overlaps": c.overlaps,
    })
}
