//! The Postgres backend against a real PostgreSQL (one throwaway cluster per test binary, on a
//! free loopback port) and a real PgBouncer in transaction pooling in front of it: the shared
//! conformance suite (locks, semaphores and read-write locks, idempotency) directly, through PgBouncer with timers, and
//! through PgBouncer with a direct notify URL; then the faults (server killed mid-hold and
//! restarted, sessions terminated, database unreachable, statement timeouts) and the
//! transaction-scoped mode.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock_runtime::backend::postgres::{
    lock_in_transaction, tokio_postgres, try_lock_in_transaction,
};
use dlock_runtime::backend::{
    AcquireArgs, Attempt, Backend, BoxFuture, ExtendItem, OwnerToken, PostgresBackend,
    PostgresOptions, Watch,
};
use dlock_runtime::conformance::Store;
use dlock_runtime::key::ResourceName;
use dlock_runtime::{LockError, LockGuard, LockKey, Locker, OnFail, RetryPolicy};
use dlock_tests::postgres_server::{shared, shared_bouncer};
use dlock_tests::proxy::Proxy;
use dlock_tests::redis_server::free_port;
use dlock_tests::wait::{poll_until, refused_at_once, taken_once_back, wait_for};
use dlock_tests::PostgresServer;

/// The shared server's port.
fn port() -> u16 {
    shared().lock().unwrap_or_else(|e| e.into_inner()).port()
}

/// The direct URL of database `db` on the shared server.
fn direct_url(db: &str) -> String {
    format!("postgres://postgres@127.0.0.1:{}/{db}", port())
}

/// A store whose lockers connect to `url` with `opts`; locks are broken over a direct
/// connection.
fn store_at(name: &'static str, url: String, opts: PostgresOptions, notifications: bool) -> Store {
    let breaker_url = direct_url("postgres");
    let breaker_opts = opts.clone().notifications(false).pool_size(1);
    let mut store = Store::new(
        name,
        move |b| {
            let (url, opts) = (url.clone(), opts.clone());
            Box::pin(async move {
                let backend = PostgresBackend::connect(&url, opts).await.expect("connect");
                b.try_build(backend).expect("locker")
            })
        },
        move |resource| {
            let (url, opts) = (breaker_url.clone(), breaker_opts.clone());
            Box::pin(async move {
                let backend = PostgresBackend::connect(&url, opts).await.expect("connect");
                let freed = backend.force_release(&resource).await.expect("delete");
                assert!(freed, "no lock row {resource}");
            })
        },
    );
    store.notifications = notifications;
    store
}

fn direct_store() -> ((), Store) {
    let opts = PostgresOptions::default();
    ((), store_at("postgres", direct_url("postgres"), opts, true))
}

fn bouncer_timers_store() -> ((), Store) {
    let url = shared_bouncer().url("postgres");
    let opts = PostgresOptions::default()
        .schema("bounced")
        .notifications(false);
    ((), store_at("postgres via pgbouncer", url, opts, false))
}

fn bouncer_notify_store() -> ((), Store) {
    let url = shared_bouncer().url("postgres");
    let opts = PostgresOptions::default()
        .schema("bounced_notify")
        .notify_url(direct_url("postgres"));
    (
        (),
        store_at("postgres via pgbouncer, direct LISTEN", url, opts, true),
    )
}

mod direct {
    dlock_runtime::conformance_tests!(super::direct_store);
}

mod pgbouncer_timers {
    dlock_runtime::conformance_tests!(super::bouncer_timers_store);
}

mod pgbouncer_notify {
    dlock_runtime::conformance_tests!(super::bouncer_notify_store);
}

// ---- faults ------------------------------------------------------------------------------

/// A locker over `url` with a short command timeout (`limit`), so faults surface quickly.
async fn locker_at(url: &str, limit: Duration) -> (Locker, PostgresBackend) {
    let opts = PostgresOptions::default()
        .command_timeout(limit)
        .connect_timeout(limit);
    let backend = PostgresBackend::connect(url, opts).await.expect("connect");
    let locker = Locker::builder()
        .command_timeout(limit)
        .try_build(backend.clone())
        .expect("locker");
    (locker, backend)
}

/// Waits until every one of `backends` has its LISTEN session up.
async fn until_listening(backends: &[&PostgresBackend], limit: Duration) {
    wait_for("the LISTEN sessions", limit, async || {
        backends.iter().all(|b| b.is_listening()).then_some(())
    })
    .await;
}

/// Runs `fut`, which must fail with `Unavailable` within `limit`.
async fn unavailable_within<T: std::fmt::Debug>(
    limit: Duration,
    fut: impl std::future::Future<Output = Result<T, LockError>>,
) -> LockError {
    let start = Instant::now();
    let err = fut
        .await
        .expect_err("must fail while the database is out of reach");
    let took = start.elapsed();
    assert!(err.is_unavailable(), "{err}");
    assert_eq!(err.status(), 503);
    assert!(took < limit, "took {took:?}, limit {limit:?}");
    err
}

/// Runs `fut`, which must fail with `Misconfigured` (500: retrying does not help) within
/// `limit`.
async fn misconfigured_within<T: std::fmt::Debug>(
    limit: Duration,
    fut: impl std::future::Future<Output = Result<T, LockError>>,
) -> LockError {
    let start = Instant::now();
    let err = fut.await.expect_err("must be refused");
    let took = start.elapsed();
    assert!(err.is_misconfigured(), "{err}");
    assert_eq!(err.status(), 500);
    assert!(took < limit, "took {took:?}, limit {limit:?}");
    err
}

/// How long a restarted or promoted server has to serve again ([`taken_once_back`]), and how
/// often to try meanwhile.
const BACK_WITHIN: Duration = Duration::from_secs(15);
const BACK_EVERY: Duration = Duration::from_millis(50);

/// Blocking harness calls (kill, restart) off the runtime's threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("harness call")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_killed_mid_hold_reports_loss_and_recovers_after_restart() {
    let server = Arc::new(Mutex::new(blocking(PostgresServer::start).await));
    let url = server.lock().unwrap().url("postgres");
    let (locker, _) = locker_at(&url, Duration::from_millis(300)).await;
    let (short, long) = (Duration::from_millis(800), Duration::from_secs(30));
    let lapsing = locker
        .lock("kill:short")
        .ttl(short)
        .acquire()
        .await
        .unwrap();
    let surviving = locker.lock("kill:long").ttl(long).acquire().await.unwrap();
    let old_token = lapsing.fencing_token();

    let s = server.clone();
    blocking(move || s.lock().unwrap().kill()).await;
    // Down: every call is a typed 503 within the command timeout (plus scheduling slack).
    unavailable_within(
        Duration::from_millis(900),
        locker.lock("kill:other").try_acquire(),
    )
    .await;
    // The short lease runs out while its renewals fail: its holder is told.
    tokio::time::timeout(short + Duration::from_secs(2), lapsing.lost())
        .await
        .expect("loss reported once renewals failed for a whole lease");
    assert!(!lapsing.is_held());
    drop(lapsing);

    let s = server.clone();
    blocking(move || s.lock().unwrap().restart()).await;
    // The same locker recovers on its own: a new lock without restarting anything.
    let g = taken_once_back(&locker, "kill:after", BACK_WITHIN, BACK_EVERY).await;
    g.release().await.unwrap();
    // The lock table is durable: the long lease survived the crash and is still held by its
    // guard (renewed again), not reported lost.
    assert!(
        surviving.is_held(),
        "a lock that survived the restart was reported lost"
    );
    let (other, _) = locker_at(&url, Duration::from_millis(300)).await;
    assert!(
        other
            .lock("kill:long")
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "the surviving lock must still exclude others"
    );
    surviving
        .extend(long)
        .await
        .expect("the survivor renews after the restart");
    surviving
        .release()
        .await
        .expect("the survivor releases its own lock");
    // The lapsed lock frees by the database's clock, with a larger fencing token.
    let g = other
        .lock("kill:short")
        .try_acquire()
        .await
        .unwrap()
        .expect("lapsed lock free");
    assert!(
        g.fencing_token() > old_token,
        "fencing tokens keep increasing across the crash"
    );
    g.release().await.unwrap();
}

/// With `synchronous_commit = off` (here for the whole server; a database, a role or a URL's
/// `options=-c synchronous_commit=off` do the same), a commit returns before its WAL is written
/// out: the WAL writer does that every `wal_writer_delay` (here 10 s). A grant is answered
/// once its transaction committed, so a crash right after the answer lost the grant and the
/// sequence's advance: after the restart the lock was free and the next grant, to another
/// owner, had the same fencing token. The schema's functions now make a grant's commit wait
/// for its WAL, whatever the settings. (`fsync` is off in these servers: WAL written out by the
/// commit is in the kernel's page cache and survives the server's processes killed with
/// `kill -9`, while a record still in `wal_buffers` does not — as a machine crash would treat
/// WAL fsync'd or not.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_outlives_a_crash_right_after_it_with_synchronous_commit_off() {
    let server = Arc::new(Mutex::new(
        blocking(|| {
            PostgresServer::start_with(&[
                "synchronous_commit=off",
                "wal_writer_delay=10s",
                "wal_writer_flush_after=1GB",
            ])
        })
        .await,
    ));
    let url = server.lock().unwrap().url("postgres");
    let (locker, _) = locker_at(&url, Duration::from_secs(2)).await;
    let s = server.clone();
    blocking(move || {
        let s = s.lock().unwrap();
        assert_eq!(s.psql("SHOW synchronous_commit"), "off");
        // The schema on disk: what a crash can lose below is the grant alone.
        s.psql("CHECKPOINT");
    })
    .await;
    let held = locker
        .lock("sync:k")
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let token = held.fencing_token();
    // Killed at once (every process of the server), long before the WAL writer's next round.
    let s = server.clone();
    blocking(move || s.lock().unwrap().restart()).await;

    let (other, _) = locker_at(&url, Duration::from_secs(2)).await;
    assert!(
        other.lock("sync:k").try_acquire().await.unwrap().is_none(),
        "the lock granted (token {token}) before the crash was granted again: two holders"
    );
    let next = token_of_a_grant(&other, "sync:other").await;
    assert!(
        next > token,
        "a fencing token was issued twice: {next} after {token} before the crash"
    );
    drop(held);
}

/// Takes `key` (free), releases it, and returns its fencing token.
async fn token_of_a_grant(locker: &Locker, key: &'static str) -> u64 {
    let g = locker.lock(key).try_acquire().await.unwrap().expect("free");
    let token = g.fencing_token();
    g.release().await.unwrap();
    token
}

/// A copy of the data on another cluster — a dump restored, `pg_upgrade` — starts at WAL
/// timeline 1 again with the sequence where it was. Its tokens stay above every token the
/// original issued, also when the original had been promoted (its tokens' high part above 1).
/// Once, the copy's tokens started again at timeline 1: below the original's, so every resource
/// that kept one of those refused the copy's for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_restored_on_another_cluster_issues_larger_tokens() {
    let promoted = blocking(|| {
        let primary = PostgresServer::start();
        let standby = primary.start_standby();
        primary.until_replayed(&standby);
        standby.promote();
        standby
    })
    .await;
    let (original, _) = locker_at(&promoted.url("postgres"), Duration::from_secs(2)).await;
    let mut last = 0;
    for key in ["copy:k", "copy:other", "copy:k"] {
        let token = token_of_a_grant(&original, key).await;
        assert!(token > last, "{token} after {last}");
        last = token;
    }
    assert_eq!(last >> 48, 2, "the promoted server's timeline: {last}");
    drop(original);

    // Restored into a database of the shared server, a cluster on timeline 1.
    let db = blocking(move || {
        let server = shared();
        let server = server.lock().unwrap_or_else(|e| e.into_inner());
        let db = server.create_database("copy");
        promoted.copy_schema("postgres", "dlock", &server, &db);
        db
    })
    .await;
    let (copy, _) = locker_at(&direct_url(&db), Duration::from_secs(2)).await;
    let token = token_of_a_grant(&copy, "copy:k").await;
    assert!(
        token > last,
        "the copy issued {token}, not above the original's {last}"
    );
    assert!(token_of_a_grant(&copy, "copy:other").await > token);
}

/// A schema of version 3 (the last before the epoch row; its DDL, as released, is in
/// `tests/fixtures`) is upgraded in place by a client that creates the schema, and its tokens
/// go on from where version 3's were, with the same high part.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_3_schema_is_upgraded_in_place_and_its_tokens_go_on() {
    let (db, before) = blocking(|| {
        let server = shared();
        let server = server.lock().unwrap_or_else(|e| e.into_inner());
        let db = server.create_database("v3");
        server.psql_in(&db, include_str!("../fixtures/postgres-schema-v3.sql"));
        assert_eq!(
            server.psql_in(&db, "SELECT dlock.dlock_schema_version()"),
            "3"
        );
        let token = server.psql_in(&db, "SELECT dlock.dlock_next_fence()");
        (db, token.parse::<u64>().expect("a token"))
    })
    .await;
    let (locker, _) = locker_at(&direct_url(&db), Duration::from_secs(2)).await;
    let token = token_of_a_grant(&locker, "v3:k").await;
    assert!(token > before, "{token} after version 3's {before}");
    assert_eq!(
        token >> 48,
        before >> 48,
        "the same high part: {token}, {before}"
    );
    let version = blocking(move || {
        let server = shared();
        let server = server.lock().unwrap_or_else(|e| e.into_inner());
        server.psql_in(&db, "SELECT dlock.dlock_schema_version()")
    })
    .await;
    assert_eq!(version, "8");
}

/// The lock functions need `READ COMMITTED`: they wait for a lock's advisory lock, then read
/// what the transactions before them committed. Under `REPEATABLE READ` (a database's, role's
/// or connection's `default_transaction_isolation`) their reads come from a snapshot taken
/// before that wait, and a semaphore or read-write lock was granted beside holders the
/// snapshot could not see — two holders of one permit, a writer beside a reader — with no
/// error. Every grant under another level is now refused as misconfigured, naming the level,
/// and takes nothing; `SERIALIZABLE` too (every contended grant failed to serialise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_outside_read_committed_is_refused_as_misconfigured() {
    for level in ["repeatable read", "serializable"] {
        let db = blocking(move || {
            let server = shared();
            let server = server.lock().unwrap_or_else(|e| e.into_inner());
            let db = server.create_database("isolation");
            server.psql(&format!(
                "ALTER DATABASE {db} SET default_transaction_isolation = '{level}'"
            ));
            db
        })
        .await;
        let (locker, _) = locker_at(&direct_url(&db), Duration::from_secs(2)).await;
        let attempts = [
            locker.lock("iso:lock").try_acquire().await,
            locker.semaphore("iso:sem", 1).try_acquire().await,
            locker.rw("iso:rw").write().try_acquire().await,
            locker.rw("iso:rw").read().try_acquire().await,
        ];
        for (i, attempt) in attempts.into_iter().enumerate() {
            let err = attempt.expect_err("granted outside READ COMMITTED");
            assert!(err.is_misconfigured(), "{level}, attempt {i}: {err}");
            let text = err.to_string();
            assert!(
                text.contains("need READ COMMITTED") && text.contains(&level.to_uppercase()),
                "{level}, attempt {i}: {text}"
            );
        }
        let taken = blocking(move || {
            let server = shared();
            let server = server.lock().unwrap_or_else(|e| e.into_inner());
            server.psql_in(
                &db,
                "SELECT (SELECT count(*) FROM dlock.dlock_locks) \
                 + (SELECT count(*) FROM dlock.dlock_holders)",
            )
        })
        .await;
        assert_eq!(taken, "0", "{level}: rows of refused grants");
    }
}

/// A locker used only for idempotency sweeps the records that lapsed: 500 lapsed rows go
/// while 1,000 keys begin and complete (`idem_begin` sweeps at 2 %: no sweep at all in 1,000
/// begins has a chance of 2 in a billion). Before, only lock acquires swept, and such a
/// locker's table kept every record it ever stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locker_used_only_for_idempotency_sweeps_lapsed_records() {
    use dlock_runtime::idempotency::{Begin, Fingerprint};

    let db = blocking(|| {
        let server = shared();
        let server = server.lock().unwrap_or_else(|e| e.into_inner());
        server.create_database("idemsweep")
    })
    .await;
    let (locker, _) = locker_at(&direct_url(&db), Duration::from_secs(5)).await;
    let lapsed = {
        let db = db.clone();
        move || {
            let db = db.clone();
            blocking(move || {
                let server = shared();
                let server = server.lock().unwrap_or_else(|e| e.into_inner());
                server
                    .psql_in(
                        &db,
                        "SELECT count(*) FROM dlock.dlock_idempotency \
                         WHERE expires_at < clock_timestamp()",
                    )
                    .parse::<u64>()
                    .expect("a count")
            })
        }
    };
    blocking({
        let db = db.clone();
        move || {
            let server = shared();
            let server = server.lock().unwrap_or_else(|e| e.into_inner());
            server.psql_in(
                &db,
                "INSERT INTO dlock.dlock_idempotency (name, fingerprint, owner, result, expires_at) \
                 SELECT 'lapsed:' || g, 'fp', NULL, 'x', clock_timestamp() - interval '1 hour' \
                 FROM generate_series(1, 500) g",
            );
        }
    })
    .await;
    assert_eq!(lapsed().await, 500);
    let fingerprint = Fingerprint::builder().field("f").finish();
    for i in 0..1000 {
        match locker
            .idempotency(format!("sweep:{i}").as_str(), fingerprint)
            .begin()
            .await
            .expect("begin")
        {
            Begin::Run(op) => op.complete(b"done").await.expect("complete"),
            other => panic!("expected Run, got {other:?}"),
        }
    }
    let left = lapsed().await;
    assert!(
        left < 500,
        "{left} of the 500 lapsed records are still there"
    );
}

/// The multi-host URL of a primary and its standby that asks for the primary.
fn failover_url(primary: u16, standby: u16) -> String {
    format!(
        "postgres://postgres@127.0.0.1:{primary},127.0.0.1:{standby}/postgres\
         ?target_session_attrs=read-write"
    )
}

/// Asynchronous replication: a standby promoted without the latest grants has a sequence that
/// is behind the old primary's, yet every token it issues is larger than every token the old
/// primary did — promotion starts a new WAL timeline, the token's high part. A lock granted
/// after the standby stopped hearing is lost with the failover: its holder, following to the
/// new primary, is told so by its next renewal, and another owner takes it with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_promoted_without_the_latest_grants_issues_larger_tokens() {
    const COUNT: u64 = (1 << 48) - 1;
    let primary = Arc::new(Mutex::new(blocking(PostgresServer::start).await));
    let url = primary.lock().unwrap().url("postgres");
    let (old, _) = locker_at(&url, Duration::from_secs(2)).await;
    let first = token_of_a_grant(&old, "failover:k").await;
    assert_eq!(first >> 48, 1, "timeline 1 on a new cluster: {first}");
    let p = primary.clone();
    let standby = blocking(move || {
        let p = p.lock().unwrap();
        let mut standby = p.start_standby();
        p.until_replayed(&standby);
        // The standby stops hearing from the primary, which goes on granting.
        standby.kill();
        standby
    })
    .await;
    let both = failover_url(primary.lock().unwrap().port(), standby.port());
    let (holder, _) = locker_at(&both, Duration::from_millis(500)).await;
    let held = holder
        .lock("failover:held")
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let mut last = held.fencing_token();
    for _ in 0..100 {
        let token = token_of_a_grant(&old, "failover:k").await;
        assert!(token > last, "{token} after {last}");
        last = token;
    }
    drop(old);
    let p = primary.clone();
    let standby = blocking(move || {
        p.lock().unwrap().kill();
        let mut standby = standby;
        standby.restart();
        standby.promote();
        standby
    })
    .await;

    let (new, _) = locker_at(&standby.url("postgres"), Duration::from_secs(2)).await;
    let token = token_of_a_grant(&new, "failover:k").await;
    // The case is the one named: the promoted standby's count is behind the old primary's.
    assert!(
        token & COUNT < last & COUNT,
        "the standby had the latest grants: count {} against {}",
        token & COUNT,
        last & COUNT
    );
    assert_eq!(token >> 48, 2, "the promoted standby's timeline: {token}");
    assert!(
        token > last,
        "the promoted standby issued {token}, not above the old primary's {last}"
    );
    assert!(token_of_a_grant(&new, "failover:other").await > token);

    // The holder's pool finds the new primary; its renewal finds the lock gone.
    let err = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        async || match held.extend(Duration::from_secs(30)).await {
            Ok(()) => panic!("a lock the standby never received was renewed"),
            Err(e) if e.is_unavailable() => Err(format!("not back: {e}")),
            Err(e) => Ok(e),
        },
    )
    .await;
    assert!(matches!(err, LockError::Lost { .. }), "{err}");
    assert!(!held.is_held());
    let taken = new
        .lock("failover:held")
        .try_acquire()
        .await
        .unwrap()
        .expect("the lost lock is free on the new primary");
    assert!(taken.fencing_token() > held.fencing_token());
    taken.release().await.unwrap();
}

/// The sessions of one application name, terminated by the server.
fn terminate(app: &str) -> usize {
    let out = shared()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .psql(&format!(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = '{app}'"
        ));
    out.parse().expect("a count")
}

/// A waiter over `backend` queues for `key`, which `guard` holds, and must be woken by the
/// release within 2 s: by the notification, not by its fallback timer (10 s backoff steps, a
/// 60 s waiter TTL).
async fn woken_by_the_release(backend: &PostgresBackend, key: &'static str, guard: LockGuard) {
    woken_by(backend, key, async move { guard.release().await.unwrap() }).await;
}

/// As [`woken_by_the_release`], for any `release` of the holder's lock on `key`.
async fn woken_by(
    backend: &PostgresBackend,
    key: &'static str,
    release: impl std::future::Future<Output = ()>,
) {
    let slow = Locker::builder()
        .command_timeout(Duration::from_secs(2))
        .waiter_ttl(Duration::from_secs(60))
        .try_build(backend.clone())
        .unwrap();
    let policy = RetryPolicy::new(Duration::from_secs(30))
        .backoff(Duration::from_secs(10), Duration::from_secs(10))
        .jitter(false);
    let h = slow.clone();
    let wait = tokio::spawn(async move {
        let g = h
            .lock(key)
            .on_fail(OnFail::Retry(policy))
            .acquire()
            .await
            .unwrap();
        g.release().await.unwrap();
    });
    wait_for("the waiter to queue", Duration::from_secs(5), async || {
        (slow.waiting() > 0).then_some(())
    })
    .await;
    let released = Instant::now();
    release.await;
    wait.await.unwrap();
    let took = released.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "woken after {took:?}: not by the notification"
    );
}

/// The `LISTEN` task starts on the runtime the backend is connected on. When that runtime shuts
/// down (an actix-web worker restarting, a runtime built for set-up) while the backend lives
/// on, the task moves to the fallback thread: `LISTEN` comes back and a waiter over the backend
/// is woken by another process's release, not by its fallback timer (10 s backoff steps).
/// Before, the task was gone for good and `is_listening` went on saying `true`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listen_task_outlives_the_runtime_it_started_on() {
    let url = direct_url("postgres");
    let (tx, rx) = tokio::sync::oneshot::channel();
    let first_url = url.clone();
    std::thread::spawn(move || {
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let backend = first.block_on(async {
            let (_, backend) = locker_at(&first_url, Duration::from_secs(2)).await;
            until_listening(&[&backend], Duration::from_secs(5)).await;
            backend
        });
        drop(first);
        let _ = tx.send(backend);
    });
    let waiter_backend = rx.await.expect("the first runtime's thread");
    until_listening(&[&waiter_backend], Duration::from_secs(10)).await;
    let (holder, _) = locker_at(&url, Duration::from_secs(2)).await;
    let guard = holder
        .lock("rt:k")
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    woken_by_the_release(&waiter_backend, "rt:k", guard).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_sessions_are_replaced_and_notifications_resume() {
    let app = "dlock_terminated";
    let url = format!("{}?application_name={app}", direct_url("postgres"));
    let (holder, holder_backend) = locker_at(&url, Duration::from_millis(500)).await;
    // Another backend (its own pool and LISTEN session), terminated as well: the waiter below
    // runs over it, so only its LISTEN session can tell it of the holder's release.
    let (waiter, waiter_backend) = locker_at(&url, Duration::from_millis(500)).await;
    let guard = holder
        .lock("term:k")
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    until_listening(&[&holder_backend, &waiter_backend], Duration::from_secs(5)).await;

    let killed = blocking(move || terminate(app)).await;
    assert!(
        killed >= 2,
        "pool and LISTEN sessions terminated ({killed})"
    );
    // The LISTEN sessions come back by themselves.
    until_listening(&[&holder_backend, &waiter_backend], Duration::from_secs(10)).await;
    // The lock was a row: it survived, and the holder still renews and owns it.
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        async || guard.extend(Duration::from_secs(30)).await,
    )
    .await;
    assert!(guard.is_held());
    assert!(waiter.lock("term:k").try_acquire().await.unwrap().is_none());

    // Notifications resume: a waiter over the other terminated backend is woken by the
    // release, not by its fallback timer.
    woken_by_the_release(&waiter_backend, "term:k", guard).await;
}

/// A database that refuses for good — a role without privileges on the lock schema, a
/// database that does not exist, a schema dropped under a running locker — answers
/// `Misconfigured` (500), not `Unavailable` (503): there is no outage to ride out, so a wait
/// through outages ends with it at once instead of retrying until its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_for_good_is_misconfigured_and_ends_a_wait_through_outages_at_once() {
    let (db, outsider) = {
        let server = shared();
        let server = server.lock().unwrap_or_else(|e| e.into_inner());
        let db = server.create_database("refused");
        let outsider = format!("{db}_outsider");
        server.psql(&format!("CREATE ROLE {outsider} LOGIN"));
        (db, outsider)
    };
    // A role that may sign in but not create the lock schema (42501).
    let url = format!("postgres://{outsider}@127.0.0.1:{}/{db}", port());
    let err = Locker::from_url(&url).await.unwrap_err();
    assert!(err.is_misconfigured(), "{err}");
    assert_eq!(err.status(), 500);
    // A database that does not exist (3D000).
    let err = Locker::from_url(&direct_url(&format!("{db}_missing")))
        .await
        .unwrap_err();
    assert!(err.is_misconfigured(), "{err}");

    // A running locker whose schema an operator dropped (42883/42P01).
    let locker = Locker::from_url(&direct_url(&db)).await.unwrap();
    let guard = locker.lock("refused:k").acquire().await.unwrap();
    guard.release().await.unwrap();
    shared()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .psql_in(&db, "DROP SCHEMA dlock CASCADE");
    refused_at_once(&locker, "refused:k").await;
}

/// A key the database's encoding cannot store (a `LATIN1` database, a Cyrillic key: SQLSTATE
/// `22P05`) is refused as `Misconfigured` (500): the same key fails the same way every time.
/// It was `Unavailable` (503), so a wait through outages asked again until its deadline and a
/// durable job with that key was put back for ever. Keys the encoding holds work as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_the_databases_encoding_cannot_store_is_misconfigured() {
    let db = blocking(|| {
        let server = shared();
        let server = server.lock().unwrap_or_else(|e| e.into_inner());
        let db = server.create_database("latin");
        let latin = format!("{db}_1");
        server.psql(&format!(
            "CREATE DATABASE {latin} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' \
             TEMPLATE template0"
        ));
        latin
    })
    .await;
    let locker = Locker::from_url(&direct_url(&db)).await.unwrap();
    let err = locker.lock("ключ").try_acquire().await.unwrap_err();
    assert!(err.is_misconfigured(), "{err}");
    assert_eq!(err.status(), 500);
    assert!(err.to_string().contains("encoding"), "{err}");
    for key in ["plain", "café"] {
        let g = locker.lock(key).try_acquire().await.unwrap();
        g.expect("free").release().await.unwrap();
    }
}

/// The schema check at connect took *any* error the database answered for "no schema": with
/// `create_schema` off, a shutdown (`57P01`), a cancel (`57014`), a connection failure (class
/// 08) or too many connections (`53300`) at that moment made `connect` fail as
/// `Misconfigured` ("apply sql/postgres.sql") — permanent, so a service that retries only
/// `Unavailable` gave up. Only a missing function or schema is "missing" now; the rest is the
/// error it is. (The check's function raises each SQLSTATE here, on a real server.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passing_error_in_the_schema_check_is_unavailable_not_a_missing_schema() {
    let db = blocking(|| {
        let server = shared();
        let server = server.lock().unwrap_or_else(|e| e.into_inner());
        let db = server.create_database("schema_check");
        server.psql_in(&db, "CREATE SCHEMA dlock");
        db
    })
    .await;
    let opts = PostgresOptions::default()
        .create_schema(false)
        .notifications(false);
    for code in ["57P01", "57014", "08006", "53300"] {
        let db2 = db.clone();
        blocking(move || {
            let server = shared();
            let server = server.lock().unwrap_or_else(|e| e.into_inner());
            server.psql_in(
                &db2,
                &format!(
                    "CREATE OR REPLACE FUNCTION dlock.dlock_schema_version() RETURNS integer \
                     LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'passing' \
                     USING ERRCODE = '{code}'; END $$"
                ),
            );
        })
        .await;
        let err = PostgresBackend::connect(&direct_url(&db), opts.clone())
            .await
            .expect_err("the check failed");
        assert!(err.is_unavailable(), "{code}: {err}");
        assert!(err.to_string().contains(code), "{code}: {err}");
    }
    // Missing for real: still `Misconfigured`, naming the file to apply.
    let db2 = db.clone();
    blocking(move || {
        let server = shared();
        let server = server.lock().unwrap_or_else(|e| e.into_inner());
        server.psql_in(&db2, "DROP FUNCTION dlock.dlock_schema_version()");
    })
    .await;
    let err = PostgresBackend::connect(&direct_url(&db), opts.clone())
        .await
        .expect_err("no schema");
    assert!(err.is_misconfigured(), "{err}");
    assert!(err.to_string().contains("sql/postgres.sql"), "{err}");
    let err = PostgresBackend::connect(&direct_url(&db), opts.schema("never_made"))
        .await
        .expect_err("no schema");
    assert!(err.is_misconfigured(), "{err}");
    assert!(err.to_string().contains("sql/postgres.sql"), "{err}");
}

/// Fencing tokens exhausted (the sequence at 2^48, or the epoch at 2^15) are a refusal for
/// good: `Misconfigured` (500), naming what ran out, and a wait through outages ends at once.
/// It was `Unavailable` (503: the generic `P0001` of a `RAISE`), retried until every deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_fencing_tokens_are_a_refusal_for_good() {
    let db = blocking(|| {
        let server = shared();
        let server = server.lock().unwrap_or_else(|e| e.into_inner());
        server.create_database("exhausted")
    })
    .await;
    let (locker, _) = locker_at(&direct_url(&db), Duration::from_secs(2)).await;
    token_of_a_grant(&locker, "exhausted:k").await;
    let db2 = db.clone();
    blocking(move || {
        let server = shared();
        let server = server.lock().unwrap_or_else(|e| e.into_inner());
        server.psql_in(&db2, "SELECT setval('dlock.dlock_fence', 281474976710655)");
    })
    .await;
    let err = locker
        .lock("exhausted:k")
        .try_acquire()
        .await
        .expect_err("no token left");
    assert!(err.is_misconfigured(), "{err}");
    assert!(err.to_string().contains("exhausted"), "{err}");
    refused_at_once(&locker, "exhausted:k").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_database_is_a_typed_503_within_the_timeout() {
    let limit = Duration::from_millis(300);
    // Nothing listens.
    let url = format!(
        "postgres://postgres:secret-pw@127.0.0.1:{}/postgres",
        free_port()
    );
    let opts = PostgresOptions::default()
        .command_timeout(limit)
        .connect_timeout(limit);
    let err = unavailable_within(
        Duration::from_millis(1500),
        PostgresBackend::connect(&url, opts.clone()),
    )
    .await;
    assert!(!format!("{err} {err:?}").contains("secret-pw"), "{err:?}");
    let err = unavailable_within(
        Duration::from_millis(1500),
        Locker::builder().command_timeout(limit).connect(&url),
    )
    .await;
    assert!(!format!("{err} {err:?}").contains("secret-pw"), "{err:?}");

    // Reachable, then hung: every byte delayed far beyond the command timeout.
    let proxy = Proxy::start(port()).await.unwrap();
    let via = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        proxy_port(&proxy)
    );
    let (locker, _) = locker_at(&via, limit).await;
    proxy.set_latency(Duration::from_secs(5));
    for on_fail in [OnFail::Reject, OnFail::retry(Duration::from_secs(30))] {
        unavailable_within(
            Duration::from_millis(900),
            locker.lock("hung:k").on_fail(on_fail).acquire(),
        )
        .await;
    }
}

/// A connection that takes longer to make than the command timeout leaves a call (here two
/// round trips — TLS negotiation and start-up — where a statement takes one; TLS and SCRAM
/// over a long link take more) is still made once its caller gave up, and goes to the pool for
/// the next call. Before, the caller's timeout dropped it half-made, and once the pool's
/// connections were gone every call timed out making one, for as long as the link was slow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_slower_to_make_than_the_command_timeout_are_made_for_the_next_call() {
    let proxy = Proxy::start(port()).await.unwrap();
    let via = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        proxy_port(&proxy)
    );
    let limit = Duration::from_millis(500);
    let (locker, _) = locker_at(&via, limit).await;
    // A round trip of 300 ms: a statement fits in the command timeout, a new connection not.
    proxy.set_latency(Duration::from_millis(150));
    proxy.cut(false);
    let mut answers = Vec::new();
    for n in 0..8 {
        let out = locker
            .lock(format!("slowlink:{n}").as_str())
            .try_acquire()
            .await;
        match out {
            Ok(guard) => {
                let guard = guard.expect("a free lock");
                guard.release().await.expect("release");
                answers.push("ok".to_owned());
                break;
            }
            Err(e) => {
                assert!(e.is_unavailable(), "{e:?}");
                answers.push(e.to_string());
            }
        }
    }
    assert_eq!(
        answers.last().map(String::as_str),
        Some("ok"),
        "no call over the slow link was answered: {answers:#?}"
    );
    assert!(answers.len() <= 4, "answered only after {answers:#?}");
}

/// A locker over a pool of 8 connections reached through a proxy, made `at_once` at a time,
/// without notifications (no `LISTEN` connection), with `limit` as every timeout.
async fn pool_of_8_via_proxy(schema: &str, at_once: usize, limit: Duration) -> (Proxy, Locker) {
    let proxy = Proxy::start(port()).await.unwrap();
    let via = format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port());
    let opts = PostgresOptions::default()
        .schema(schema)
        .pool_size(8)
        .connects_at_once(at_once)
        .notifications(false)
        .command_timeout(limit)
        .connect_timeout(limit);
    let backend = PostgresBackend::connect(&via, opts).await.expect("connect");
    let locker = Locker::builder()
        .command_timeout(limit)
        .try_build(backend)
        .expect("locker");
    (proxy, locker)
}

/// A pool is made, and made again after every connection was lost (a database restart or a
/// reset, as the clients see it), at most [`connects_at_once`](PostgresOptions::connects_at_once)
/// connections at a time — counted at a proxy as connections open that the server has not
/// answered yet — while a burst of calls that finds no idle connection is answered in full.
/// Before, each call made its own connection: a burst of 8 had 7 or 8 being made at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_is_made_a_few_connections_at_a_time() {
    let (proxy, locker) = pool_of_8_via_proxy("made_few", 2, Duration::from_secs(10)).await;
    // A round trip of 100 ms: every connection is being made for that long at least, so the
    // burst's calls all want one at the same time.
    proxy.set_latency(Duration::from_millis(50));
    for round in ["cold", "after every connection was cut"] {
        proxy.reset_peak_unanswered();
        let burst = (0..8).map(|n| {
            let locker = locker.clone();
            async move {
                // A connection cut an instant ago may still look open to the pool: its call
                // fails as unavailable, and the next one makes a new connection.
                for _ in 0..3 {
                    match locker
                        .lock(format!("madefew:{n}").as_str())
                        .try_acquire()
                        .await
                    {
                        Ok(guard) => {
                            let guard = guard.expect("a free lock");
                            guard.release().await.expect("release");
                            return;
                        }
                        Err(e) => assert!(e.is_unavailable(), "{e:?}"),
                    }
                }
                panic!("call {n} was not answered in 3 tries ({round})");
            }
        });
        futures_util::future::join_all(burst).await;
        let peak = proxy.peak_unanswered();
        assert!(
            (1..=2).contains(&peak),
            "{peak} connections were being made at once ({round})"
        );
        proxy.cut(false);
    }
}

/// A call that finds no idle connection while the turn to make one is taken takes a connection
/// that goes back to the pool first, rather than waiting for the turn: with one connection
/// made at a time and that one hanging (the server takes no new connections, as when it is
/// forking slowly), a burst of calls is served by the connection the pool had. With the bound
/// alone every call waited behind the hanging connection to make its own; without it each
/// made its own, and hung on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waiting_to_make_a_connection_takes_one_that_came_back() {
    // Made with one connection (the schema check's), idle in the pool.
    let (proxy, locker) = pool_of_8_via_proxy("made_back", 1, Duration::from_secs(60)).await;
    let opened = proxy.accepted();
    proxy.pause_new();
    let (tx, mut answered) = tokio::sync::mpsc::unbounded_channel();
    for n in 0..8 {
        let (locker, tx) = (locker.clone(), tx.clone());
        tokio::spawn(async move {
            let guard = locker
                .lock(format!("madeback:{n}").as_str())
                .try_acquire()
                .await
                .expect("acquire")
                .expect("a free lock");
            guard.release().await.expect("release");
            let _ = tx.send(n);
        });
    }
    // At most one call makes a connection (its turn), and it hangs; the others are answered.
    for seen in 0..7 {
        tokio::time::timeout(Duration::from_secs(20), answered.recv())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{seen} of 8 calls answered while {} connection(s) hang being made",
                    proxy.accepted() - opened
                )
            });
    }
    assert!(
        proxy.accepted() - opened <= 1,
        "{} connections made at once",
        proxy.accepted() - opened
    );
    proxy.resume_new();
    tokio::time::timeout(Duration::from_secs(20), answered.recv())
        .await
        .expect("the last call, once its connection could be made");
}

/// A connection the server takes and never answers (a wedged postmaster, a proxy that drops
/// everything) gives its turn back within ten connect timeouts: tokio-postgres's connect timeout
/// bounds only the socket's connect, and a connect past it kept its turn for good — with one
/// turn, every later call waited for it and was answered `Unavailable`, also once the database
/// took new connections again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_is_never_answered_gives_its_turn_back() {
    let (proxy, locker) = pool_of_8_via_proxy("made_hung", 1, Duration::from_millis(500)).await;
    // The pool's connection goes, and the next one is taken and never answered.
    proxy.cut(false);
    proxy.pause_new();
    let opened = proxy.accepted();
    let err = locker.lock("madehung").try_acquire().await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    wait_for(
        "the call's connection",
        Duration::from_secs(10),
        async || (proxy.accepted() > opened).then_some(()),
    )
    .await;
    // That connection stays unanswered for good; new ones reach the database. Its turn comes
    // back ten connect timeouts (5 s) after it was asked for.
    proxy.silence();
    proxy.resume_new();
    wait_for("a call answered", Duration::from_secs(20), async || {
        let guard = locker.lock("madehung").try_acquire().await.ok()??;
        guard.release().await.ok()
    })
    .await;
}

/// Through PgBouncer in transaction pooling, a `LISTEN` made on the main URL (notifications
/// on, no `notify_url`) hears nothing other sessions send: PgBouncer hands the `LISTEN` and
/// every later statement to server connections the session does not keep. The session finds
/// it out when it starts (the probe it sends itself through the pool does not come) and does
/// not count as listening; a session on a direct `notify_url` hears the same probe and does.
/// Before, `is_listening` said `true` and every waiter slept to its fallback timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listen_session_through_transaction_pooling_is_found_deaf() {
    let url = shared_bouncer().url("postgres");
    let opts = PostgresOptions::default()
        .schema("bounced_deaf")
        .command_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500));
    let deaf = PostgresBackend::connect(&url, opts.clone())
        .await
        .expect("connect");
    let heard = PostgresBackend::connect(&url, opts.notify_url(direct_url("postgres")))
        .await
        .expect("connect");
    until_listening(&[&heard], Duration::from_secs(10)).await;
    wait_for(
        "the deaf session's probe to lapse",
        Duration::from_secs(10),
        async || (deaf.listen_probes_unheard() > 0).then_some(()),
    )
    .await;
    assert!(!deaf.is_listening(), "a deaf session says it listens");
    assert_eq!(heard.listen_probes_unheard(), 0);
}

/// A `LISTEN` connection whose peer goes silent (every byte held: a partition, a middlebox that
/// forgot the connection) is found dead within two intervals of its empty-query check and
/// made again: `is_listening` turns `false`, then `true`, and a waiter over the backend is
/// woken by another backend's release, not by its fallback timer. Before, the connection
/// stayed open and deaf for as long as TCP keepalive allowed (hours), saying it listened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listen_connection_gone_silent_is_made_again() {
    let proxy = Proxy::start(port()).await.unwrap();
    let via = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        proxy_port(&proxy)
    );
    let limit = Duration::from_millis(500);
    let (_, backend) = locker_at(&via, limit).await;
    until_listening(&[&backend], Duration::from_secs(5)).await;
    // Silent: held, not closed (only what is read from now on; new connections too, so the
    // latency is lifted once the old connection is given up).
    proxy.set_latency(Duration::from_secs(3600));
    wait_for(
        "LISTEN taken for dead",
        Duration::from_secs(10),
        async || (!backend.is_listening()).then_some(()),
    )
    .await;
    proxy.set_latency(Duration::ZERO);
    until_listening(&[&backend], Duration::from_secs(10)).await;

    let (holder, _) = locker_at(&direct_url("postgres"), Duration::from_secs(2)).await;
    let guard = holder
        .lock("silent:k")
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    woken_by_the_release(&backend, "silent:k", guard).await;
}

/// `watch` waited up to half the *backend's* command timeout for the `LISTEN` session, inside
/// the locker's deadline for it — its own, smaller command timeout. With the session unable to
/// come up (here a `notify_url` nobody listens on), a waiter's subscription timed out and a
/// plain acquire with a retry policy failed with `Unavailable` (503) on a healthy database.
/// Now it is answered at once and the waiter runs on its timers (and this backend's own
/// releases) until the session is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listen_session_that_cannot_be_made_never_fails_an_acquire() {
    let nobody = format!("postgres://postgres@127.0.0.1:{}/postgres", free_port());
    let opts = PostgresOptions::default()
        .command_timeout(Duration::from_secs(4))
        .notify_url(nobody);
    let backend = PostgresBackend::connect(&direct_url("postgres"), opts)
        .await
        .expect("connect");
    let locker = Locker::builder()
        .command_timeout(Duration::from_secs(1))
        .try_build(backend.clone())
        .unwrap();
    let a = locker.lock("nolisten:k").acquire().await.unwrap();
    let b = tokio::spawn({
        let locker = locker.clone();
        async move {
            locker
                .lock("nolisten:k")
                .on_fail(OnFail::Retry(RetryPolicy::new(Duration::from_secs(5))))
                .acquire()
                .await
        }
    });
    // B waits behind A (or has already failed, as it did).
    wait_for("B to wait", Duration::from_secs(5), async || {
        (locker.waiting() > 0 || b.is_finished()).then_some(())
    })
    .await;
    assert!(!backend.is_listening());
    a.release().await.unwrap();
    let g = tokio::time::timeout(Duration::from_secs(5), b)
        .await
        .expect("B still waits after A released")
        .unwrap()
        .expect("a healthy database, yet B's acquire failed");
    g.release().await.unwrap();
}

fn proxy_port(proxy: &Proxy) -> u16 {
    proxy
        .url()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("proxy port")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_timeout_leaves_no_half_taken_lock() {
    let key = "stmt:k";
    let resource = format!("dlock:{{{key}}}");
    // A session that inserts the lock's row and keeps its transaction open: the acquire's own
    // insert waits on it, past the statement timeout, after it already drew a fencing token and
    // pruned the waiter line.
    let server = shared();
    let admin = format!("{}?application_name=dlock_blocker", direct_url("postgres"));
    let (blocker, conn) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let (locker, backend) = locker_at(
        &format!(
            "{}?options=-c%20statement_timeout%3D200",
            direct_url("postgres")
        ),
        Duration::from_secs(5),
    )
    .await;
    let _ = backend;
    blocker.batch_execute("BEGIN").await.unwrap();
    blocker
        .execute(
            "INSERT INTO dlock.dlock_locks (name, owner, fence, expires_at) \
             VALUES ($1, 'blocker', 1, clock_timestamp() + interval '1 hour')",
            &[&resource],
        )
        .await
        .unwrap();
    let start = Instant::now();
    let err = locker
        .lock(key)
        .try_acquire()
        .await
        .expect_err("statement timeout");
    assert!(err.is_unavailable(), "{err}");
    assert!(
        format!("{err}").contains("57014"),
        "canceled by statement timeout: {err}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    blocker.batch_execute("ROLLBACK").await.unwrap();
    // Nothing of the attempt is left: no row, and the key is free at once for anyone.
    let rows = server
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .psql(&format!(
            "SELECT count(*) FROM dlock.dlock_locks WHERE name = '{resource}'"
        ));
    assert_eq!(rows, "0", "a half-taken lock row was left behind");
    let (other, _) = locker_at(&direct_url("postgres"), Duration::from_secs(1)).await;
    let g = other
        .lock(key)
        .try_acquire()
        .await
        .unwrap()
        .expect("the key is free");
    g.release().await.unwrap();
}

// ---- timed-out calls ---------------------------------------------------------------------

/// A backend over `url` with two pooled connections (both made, and back in the pool in the
/// order first made, first out), `limit` as command timeout, and no LISTEN session.
async fn two_connections(url: &str, limit: Duration) -> PostgresBackend {
    let opts = PostgresOptions::default()
        .pool_size(2)
        .command_timeout(limit)
        .connect_timeout(Duration::from_secs(2))
        .notifications(false);
    let backend = PostgresBackend::connect(url, opts).await.expect("connect");
    let pool = backend.pool();
    let (a, b) = (pool.get().await.unwrap(), pool.get().await.unwrap());
    drop((a, b));
    backend
}

/// A fencing sequence that caches numbers per session (`CACHE 20`, set by a migration tool or
/// by hand) would let a key's next token, drawn on another pooled connection, fall below its
/// last: connecting refuses it as misconfigured, naming the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fencing_sequence_with_a_cache_is_misconfigured() {
    let opts = || {
        PostgresOptions::default()
            .schema("dlock_cached")
            .notifications(false)
    };
    let psql = |sql: &str| {
        let server = shared();
        let server = server.lock().unwrap_or_else(|e| e.into_inner());
        server.psql(sql);
    };
    drop(
        PostgresBackend::connect(&direct_url("postgres"), opts())
            .await
            .unwrap(),
    );
    psql("ALTER SEQUENCE dlock_cached.dlock_fence CACHE 20");
    let err = PostgresBackend::connect(&direct_url("postgres"), opts())
        .await
        .expect_err("a cached fencing sequence");
    assert!(err.is_misconfigured(), "{err}");
    assert!(err.to_string().contains("CACHE 1"), "{err}");
    psql("ALTER SEQUENCE dlock_cached.dlock_fence CACHE 1");
    PostgresBackend::connect(&direct_url("postgres"), opts())
        .await
        .expect("CACHE 1 again");
}

/// A database too slow for the command timeout, its cancel requests lost: every call times
/// out, and each timed-out call's connection is drained until its statement ends. The drained
/// connections count against the pool — later calls wait for one of its slots and time out
/// as unavailable — so the backend never has more connections than the pool's. Before, the
/// pool made a new connection for each one taken out to drain: up to eleven times its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_calls_never_take_more_connections_than_the_pool() {
    let proxy = Proxy::start(port()).await.unwrap();
    // A schema of its own: the table lock below holds up no other test.
    let app = "dlock_slots";
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?application_name={app}&dlock_schema=dlock_slots",
        proxy_port(&proxy)
    );
    // Drains last up to ten command timeouts (5 s): past the callers' 1.2 s, even on a busy
    // machine, so none ends by its bound while the table is locked.
    let limit = Duration::from_millis(500);
    let backend = two_connections(&url, limit).await;
    let locker = Locker::builder()
        .command_timeout(limit)
        .try_build(backend.clone())
        .unwrap();
    proxy.swallow_cancels();
    // Every statement on the locks table waits behind this session.
    let blocker = client(&direct_url("postgres")).await;
    blocker
        .batch_execute("BEGIN; LOCK TABLE dlock_slots.dlock_locks IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let watcher = client(&direct_url("postgres")).await;
    let connections = async || -> i64 {
        watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                &[&app],
            )
            .await
            .unwrap()
            .get(0)
    };
    let callers: Vec<_> = (0..8)
        .map(|i| {
            let locker = locker.clone();
            tokio::spawn(async move {
                let key = format!("slots:{i}");
                let until = Instant::now() + Duration::from_millis(1200);
                let mut unavailable = 0;
                while Instant::now() < until {
                    match locker.lock(key.as_str()).try_acquire().await {
                        Err(e) if e.is_unavailable() => unavailable += 1,
                        other => panic!("the table is locked: {other:?}"),
                    }
                }
                unavailable
            })
        })
        .collect();
    let mut most = 0;
    while callers.iter().any(|c| !c.is_finished()) {
        most = most.max(connections().await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for c in callers {
        assert!(c.await.unwrap() > 0);
    }
    assert!(
        proxy.swallowed() > 0,
        "no call timed out with its statement running"
    );
    assert!(most <= 2, "{most} connections with a pool of 2");

    // The statements end: the drains close their connections, and the backend works again.
    blocker.batch_execute("ROLLBACK").await.unwrap();
    let g = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        async || match locker.lock("slots:after").try_acquire().await {
            Ok(Some(g)) => Ok(g),
            other => Err(format!("{other:?}")),
        },
    )
    .await;
    g.release().await.unwrap();
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        async || match connections().await {
            n if n <= 2 => Ok(()),
            n => Err(format!("{n} connections with a pool of 2")),
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_call_never_hands_its_busy_connection_to_a_later_call() {
    let limit = Duration::from_millis(200);
    let backend = two_connections(&direct_url("postgres"), limit).await;
    let locker = Locker::builder()
        .command_timeout(limit)
        .try_build(backend.clone())
        .unwrap();
    // A session holds the advisory lock every grant of `x` takes.
    let x = locker.resource(LockKey::new("flight:busy:x").unwrap());
    let blocker = client(&direct_url("postgres")).await;
    blocker
        .batch_execute(&format!(
            "BEGIN; SELECT dlock.dlock_serialise('{}')",
            x.as_str()
        ))
        .await
        .unwrap();
    // A release of `x` waits on it past the command timeout: its statement is still running.
    let err = backend
        .release(&x, &OwnerToken::generate())
        .await
        .expect_err("the release waits behind the blocker");
    assert!(err.is_unavailable(), "{err}");
    // One quick call takes the other connection (and puts it back behind the first).
    assert!(!backend
        .force_release("dlock:{flight:busy:none}")
        .await
        .unwrap());
    // The next call is not queued behind the stuck release on its connection.
    let g = locker
        .lock("flight:busy:k")
        .try_acquire()
        .await
        .expect("a later call must not run behind the timed-out one")
        .expect("the key is free");
    blocker.batch_execute("COMMIT").await.unwrap();
    g.release().await.unwrap();
}

/// The backend under test with hooks: with `attempts`, each attempt waits for a permit from
/// the gate and is counted once answered; with `undos`, each undo (`abandon`) waits until the
/// test says go and is counted once it has run.
struct Hooked {
    inner: PostgresBackend,
    attempts: Option<(Arc<tokio::sync::Semaphore>, tokio::sync::watch::Sender<u32>)>,
    undos: Option<(
        tokio::sync::watch::Receiver<bool>,
        tokio::sync::watch::Sender<u32>,
    )>,
}

impl Hooked {
    fn new(inner: PostgresBackend) -> Self {
        Hooked {
            inner,
            attempts: None,
            undos: None,
        }
    }
}

impl Backend for Hooked {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn lease_margin(&self, ttl: Duration) -> Duration {
        self.inner.lease_margin(ttl)
    }

    fn acquire<'a>(&'a self, args: AcquireArgs<'a>) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(async move {
            let Some((gate, answered)) = &self.attempts else {
                return self.inner.acquire(args).await;
            };
            gate.acquire().await.expect("gate").forget();
            let out = self.inner.acquire(args).await;
            answered.send_modify(|n| *n += 1);
            out
        })
    }

    fn release<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        self.inner.release(resource, token)
    }

    fn extend<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        self.inner.extend(resource, token, ttl)
    }

    fn extend_many<'a>(
        &'a self,
        items: &'a [ExtendItem],
    ) -> BoxFuture<'a, Vec<Result<bool, LockError>>> {
        self.inner.extend_many(items)
    }

    fn abandon<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<(), LockError>> {
        Box::pin(async move {
            let Some((go, undone)) = &self.undos else {
                return self.inner.abandon(resource, token).await;
            };
            let _ = go.clone().wait_for(|go| *go).await;
            let out = self.inner.abandon(resource, token).await;
            if out.is_ok() {
                undone.send_modify(|n| *n += 1);
            }
            out
        })
    }

    fn watch<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        self.inner.watch(resource, token)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undo_lands_after_the_timed_out_acquire_it_undoes() {
    let limit = Duration::from_millis(200);
    let proxy = Proxy::start(port()).await.unwrap();
    let via = format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port());
    let backend = two_connections(&via, limit).await;
    let (go_tx, go) = tokio::sync::watch::channel(false);
    let (undone, mut undos) = tokio::sync::watch::channel(0u32);
    let locker = Locker::builder()
        .command_timeout(limit)
        .try_build(Hooked {
            undos: Some((go, undone)),
            ..Hooked::new(backend.clone())
        })
        .unwrap();
    // The acquire reaches the database a second after it was sent: long after it timed out.
    proxy.set_latency(Duration::from_secs(1));
    let err = locker
        .lock("flight:late:k")
        .try_acquire()
        .await
        .expect_err("the acquire times out");
    assert!(err.is_unavailable(), "{err}");
    // Its undo travels without delay, so on its own it would overtake the acquire.
    proxy.set_latency(Duration::ZERO);
    go_tx.send_replace(true);
    tokio::time::timeout(Duration::from_secs(10), undos.wait_for(|n| *n > 0))
        .await
        .expect("the undo ran")
        .unwrap();
    // Every statement sent on the pool's connections has ended (answers come in order).
    let pool = backend.pool();
    let (a, b) = (pool.get().await.unwrap(), pool.get().await.unwrap());
    for c in [&a, &b] {
        tokio::time::timeout(Duration::from_secs(5), c.batch_execute("SELECT 1"))
            .await
            .expect("the pool answers")
            .unwrap();
    }
    drop((a, b));
    let (other, _) = locker_at(&direct_url("postgres"), Duration::from_secs(1)).await;
    let g = other
        .lock("flight:late:k")
        .try_acquire()
        .await
        .unwrap()
        .expect("the undo must not leave a late grant holding the key");
    g.release().await.unwrap();
}

/// An acquire that timed out while it waited for a pooled connection is never sent: it does
/// not go out once a connection is free, take the lock for nobody, or need an undo. (It used
/// to: under a burst, every acquire timed out in the pool's queue went out late and queued an
/// undo behind it, and the live acquires timed out behind both.) The test's own schema gives
/// it its own fencing sequence: every grant is the one before plus one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_given_up_on_in_the_pools_queue_is_never_sent() {
    let opts = PostgresOptions::default()
        .schema("dlock_unsent")
        .pool_size(1)
        .command_timeout(Duration::from_secs(5))
        .notifications(false);
    let backend = PostgresBackend::connect(&direct_url("postgres"), opts)
        .await
        .expect("connect");
    let locker = Locker::builder()
        .command_timeout(Duration::from_millis(200))
        .try_build(backend.clone())
        .unwrap();
    let before = token_of_a_grant(&locker, "unsent:k").await;
    let busy = backend.pool().get().await.unwrap();
    let err = locker
        .lock("unsent:k")
        .try_acquire()
        .await
        .expect_err("no connection is free before the locker's deadline");
    assert!(err.is_unavailable(), "{err}");
    drop(busy);
    let next = locker
        .lock("unsent:k")
        .try_acquire()
        .await
        .unwrap()
        .expect("the timed-out acquire went out late and took the lock for nobody");
    assert_eq!(next.fencing_token(), before + 1, "a grant came in between");
    next.release().await.unwrap();
}

// ---- batched renewals and names -------------------------------------------------------------

/// A release's handoff whose notification comes late — after the waiter's next attempt found
/// the handed-over lease lapsed and the lock gone to the next in line — is not a grant: the
/// waiter asks, and waits behind the new holder. (Notifications come on the LISTEN connection,
/// not in order with the answers; taken as a grant, it counted a lease that had ended from the
/// later attempt, and two guards held the lock.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_handoff_notification_is_not_a_grant() {
    let proxy = Proxy::start(port()).await.unwrap();
    let listen_via = format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port());
    let opts = PostgresOptions::default().notify_url(listen_via);
    let late = PostgresBackend::connect(&direct_url("postgres"), opts)
        .await
        .expect("connect");
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (answered, mut answers) = tokio::sync::watch::channel(0u32);
    let w = Locker::builder()
        .try_build(Hooked {
            attempts: Some((gate.clone(), answered)),
            ..Hooked::new(late.clone())
        })
        .unwrap();
    let (others, prompt) = locker_at(&direct_url("postgres"), Duration::from_secs(5)).await;
    until_listening(&[&late, &prompt], Duration::from_secs(10)).await;
    let hang = Duration::from_secs(5);

    let key = "handoff:late:k";
    let ttl = Duration::from_millis(400);
    let retry = OnFail::Retry(
        RetryPolicy::new(Duration::from_secs(20))
            .backoff(Duration::from_millis(5), Duration::from_millis(10)),
    );
    let holder = others
        .lock(key)
        .ttl(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    // W queues (its first attempt) and subscribes (its second); then its attempts wait.
    let mut waiter = tokio::spawn({
        let (w, retry) = (w.clone(), retry.clone());
        async move { w.lock(key).ttl(ttl).on_fail(retry).acquire().await }
    });
    gate.add_permits(2);
    tokio::time::timeout(hang, answers.wait_for(|n| *n == 2))
        .await
        .expect("W queued and subscribed")
        .unwrap();
    // X's own TTL plays no part (the handoff lease is W's, from the line): a long one keeps it
    // held through the seconds below without depending on 50 ms renewals.
    let next = tokio::spawn({
        let (others, retry) = (others.clone(), retry.clone());
        let x_ttl = Duration::from_secs(10);
        async move { others.lock(key).ttl(x_ttl).on_fail(retry).acquire().await }
    });
    wait_for("X to wait", hang, async || {
        (others.waiting() == 1).then_some(())
    })
    .await;
    // The release hands the lock to W, whose notification comes a second late; the 400 ms
    // handoff lease lapses and X, next in line, takes the lock (renewed while held).
    proxy.set_latency(Duration::from_secs(1));
    let admin = others.admin().unwrap();
    let line = admin.inspect(key).await.unwrap().waiters;
    assert_eq!(line.len(), 2, "W and X wait: {line:?}");
    let released = tokio::time::Instant::now();
    holder.release().await.unwrap();
    // The release handed the lock to W, first in line (else the set-up outlived W's queue
    // entry, and this test checks nothing). Read within W's handoff lease, the lock is W's;
    // read after it (a slow machine), it may have lapsed — but not gone to anyone else.
    let state = admin.inspect(key).await.unwrap();
    let read_within = released.elapsed() < ttl;
    let to = state.holder.map(|h| h.token_prefix);
    assert!(
        to.as_ref() == Some(&line[0].token_prefix) || (to.is_none() && !read_within),
        "the lock went to {to:?}, not W ({})",
        line[0].token_prefix
    );
    let x = tokio::time::timeout(hang, next)
        .await
        .expect("X gets the lock once W's handoff lapsed")
        .unwrap()
        .unwrap();
    // W asks again and is told the lock is X's; then the notification comes.
    gate.add_permits(1);
    tokio::time::timeout(hang, answers.wait_for(|n| *n == 3))
        .await
        .expect("W asked again")
        .unwrap();
    gate.add_permits(1_000);
    let early = tokio::time::timeout(Duration::from_secs(2), &mut waiter).await;
    assert!(
        early.is_err(),
        "W was granted the lock while X held it (token {:?})",
        early.map(|r| r.map(|g| g.map(|g| g.fencing_token())))
    );
    assert!(x.is_held());
    x.release().await.unwrap();
    let w_guard = tokio::time::timeout(hang, waiter)
        .await
        .expect("W gets the lock after X")
        .unwrap()
        .unwrap();
    w_guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_extend_tells_two_tokens_of_one_name_apart() {
    let opts = PostgresOptions::default().notifications(false);
    let backend = PostgresBackend::connect(&direct_url("postgres"), opts)
        .await
        .expect("connect");
    let k = Locker::new(backend.clone()).resource(LockKey::new("extend:twice").unwrap());
    let (t1, t2) = (OwnerToken::generate(), OwnerToken::generate());
    // T2 holds the lock (taken by the schema's own acquire function); T1 does not.
    let raw = client(&direct_url("postgres")).await;
    let fence: i64 = raw
        .query_one(
            "SELECT dlock.dlock_acquire($1, $2, 30000, 0, 30000)",
            &[&k.as_str(), &t2.as_str()],
        )
        .await
        .unwrap()
        .get(0);
    assert!(fence > 0, "taken by T2");
    let item = |token: &OwnerToken| ExtendItem {
        resource: k.clone(),
        token: token.clone(),
        ttl: Duration::from_secs(30),
    };
    let out: Vec<bool> = backend
        .extend_many(&[item(&t1), item(&t2)])
        .await
        .into_iter()
        .map(|r| r.expect("extend"))
        .collect();
    assert_eq!(out, [false, true], "only the owner's renewal extends");
    assert!(backend.release(&k, &t2).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_schema_and_prefix_still_notify_a_waiter() {
    let (schema, prefix) = (
        format!("s{}", "x".repeat(39)),
        format!("p{}", "y".repeat(15)),
    );
    let opts = PostgresOptions::default()
        .schema(schema.clone())
        .table_prefix(prefix.clone())
        .command_timeout(Duration::from_secs(2));
    let url = direct_url("postgres");
    let holder = PostgresBackend::connect(&url, opts.clone())
        .await
        .expect("the longest names are accepted");
    // The waiter runs over another backend: only its LISTEN session can tell it.
    let waiter_backend = PostgresBackend::connect(&url, opts).await.expect("connect");
    until_listening(&[&waiter_backend], Duration::from_secs(5)).await;
    let k = Locker::builder()
        .try_build(holder.clone())
        .unwrap()
        .resource(LockKey::new("long:k").unwrap());
    let token = OwnerToken::generate();
    let raw = client(&url).await;
    let fence: i64 = raw
        .query_one(
            &format!("SELECT {schema}.{prefix}acquire($1, $2, 30000, 0, 30000)"),
            &[&k.as_str(), &token.as_str()],
        )
        .await
        .unwrap()
        .get(0);
    assert!(fence > 0, "held");
    woken_by(&waiter_backend, "long:k", async {
        assert!(
            holder
                .release(&k, &token)
                .await
                .expect("the release notifies"),
            "the holder's release"
        );
    })
    .await;
}

// ---- URLs ----------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_url_takes_both_schemes_and_the_backends_own_parameters() {
    let base = direct_url("postgres");
    let url = format!(
        "{}?dlock_schema=from_url&dlock_table_prefix=t_&dlock_notify=off&application_name=x",
        base.replacen("postgres://", "postgresql://", 1)
    );
    let locker = Locker::from_url(&url)
        .await
        .expect("postgresql:// connects");
    let g = locker
        .lock("url:k")
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let token = g.fencing_token();
    let row = blocking(|| {
        shared()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .psql("SELECT fence FROM from_url.t_locks WHERE name = 'dlock:{url:k}'")
    })
    .await;
    assert_eq!(
        row,
        token.to_string(),
        "the lock lives in the schema and prefix the URL named"
    );
    g.release().await.unwrap();
    let locker = Locker::from_url(&base).await.expect("postgres:// connects");
    let g = locker.lock("url:k").try_acquire().await.unwrap();
    g.expect("free").release().await.unwrap();

    // A bad schema name is the deployment's mistake, not the request's: 500, not 400.
    let bad = format!("{base}?dlock_schema=Robert%27;DROP");
    let err = Locker::from_url(&bad).await.expect_err("invalid schema");
    assert!(err.is_misconfigured(), "{err:?}");
    assert_eq!(err.status(), 500);
}

/// A schema or table prefix that is not a plain identifier — from the options or the URL —
/// is `Misconfigured` (500): the deployment's mistake. It was `InvalidKey` (400), the answer
/// for a bad key in a request, which tells the caller to fix its request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_schema_or_prefix_name_is_misconfigured() {
    let url = direct_url("postgres");
    for opts in [
        PostgresOptions::default().schema("Dlock"),
        PostgresOptions::default().schema(""),
        PostgresOptions::default().table_prefix("a-b"),
    ] {
        let err = opts.ddl().expect_err("a bad name");
        assert!(err.is_misconfigured(), "{err:?}");
        let err = PostgresBackend::connect(&url, opts)
            .await
            .expect_err("a bad name");
        assert!(err.is_misconfigured(), "{err:?}");
        assert_eq!(err.status(), 500);
    }
    let err = Locker::from_url(&format!("{url}?dlock_table_prefix=x%3By"))
        .await
        .expect_err("a bad prefix");
    assert!(err.is_misconfigured(), "{err:?}");
}

// ---- TLS -----------------------------------------------------------------------------------

/// Whether every session of `app` on `server` runs over TLS, and how many there are.
fn ssl_sessions(server: &PostgresServer, app: &str) -> (bool, i64) {
    let out = server.psql(&format!(
        "SELECT coalesce(bool_and(s.ssl), false) || ' ' || count(*) FROM pg_stat_ssl s \
         JOIN pg_stat_activity a USING (pid) WHERE a.application_name = '{app}'"
    ));
    let (ssl, n) = out.split_once(' ').expect("two fields");
    (ssl == "true", n.parse().expect("a count"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_follows_the_urls_sslmode_and_verifies_the_server() {
    let (server, ca) = blocking(PostgresServer::start_tls).await;
    let server = Arc::new(server);
    let base = format!("postgres://postgres@127.0.0.1:{}/postgres", server.port());
    let opts = PostgresOptions::default().tls_root_certificates(ca.clone());

    // require: the pool and the LISTEN session both speak TLS, and locking works over it.
    let url = format!("{base}?sslmode=require&application_name=dlock_tls");
    let backend = PostgresBackend::connect(&url, opts.clone())
        .await
        .expect("TLS connect");
    let locker = Locker::new(backend.clone());
    let g = locker
        .lock("tls:k")
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    until_listening(&[&backend], Duration::from_secs(5)).await;
    let s = server.clone();
    let (all_tls, n) = blocking(move || ssl_sessions(&s, "dlock_tls")).await;
    assert!(
        all_tls && n >= 2,
        "sessions over TLS: {all_tls}, {n} of them"
    );
    g.release().await.unwrap();

    // disable: plaintext.
    let url = format!("{base}?sslmode=disable&application_name=dlock_plain");
    let plain = PostgresBackend::connect(&url, opts.clone().notifications(false))
        .await
        .expect("plain connect");
    // The backend stays alive (its pooled session with it) until the check below.
    let plain_locker = Locker::new(plain.clone());
    let g = plain_locker.lock("tls:k").try_acquire().await.unwrap();
    g.expect("free").release().await.unwrap();
    let s = server.clone();
    let (all_tls, n) = blocking(move || ssl_sessions(&s, "dlock_plain")).await;
    assert!(!all_tls && n >= 1, "a plaintext session expected ({n})");

    // A server certificate nobody vouches for is refused, with `prefer` too — for good
    // (`Misconfigured`, 500): retrying meets the same certificate. It was `Unavailable` (503),
    // so a wait through outages retried it until its deadline.
    let limit = Duration::from_millis(500);
    let untrusted = PostgresOptions::default()
        .command_timeout(limit)
        .connect_timeout(limit);
    for mode in ["require", "prefer"] {
        let url = format!("{base}?sslmode={mode}");
        let err = misconfigured_within(
            Duration::from_secs(3),
            PostgresBackend::connect(&url, untrusted.clone()),
        )
        .await;
        assert!(err.to_string().contains("TLS"), "{mode}: {err}");
    }
    // A trusted certificate for another name (the server's is for 127.0.0.1 and localhost):
    // the name the URL gives, the address `hostaddr` gives.
    let other_name = format!(
        "postgres://postgres@dlock-other.invalid:{}/postgres?hostaddr=127.0.0.1&sslmode=require",
        server.port()
    );
    let err = misconfigured_within(
        Duration::from_secs(3),
        PostgresBackend::connect(&other_name, opts.clone().command_timeout(limit)),
    )
    .await;
    assert!(err.to_string().contains("TLS"), "{err}");
    // require against a server without TLS fails, for good; prefer falls back to plaintext.
    let no_tls = direct_url("postgres");
    let err = misconfigured_within(
        Duration::from_secs(3),
        PostgresBackend::connect(&format!("{no_tls}?sslmode=require"), untrusted.clone()),
    )
    .await;
    assert!(err.to_string().contains("TLS"), "{err}");
    PostgresBackend::connect(&format!("{no_tls}?sslmode=prefer"), untrusted)
        .await
        .expect("prefer falls back to plaintext");
}

/// A Unix-socket host (`postgres://user@%2Ftmp%2Fdir:port/db`) under the default
/// `sslmode=prefer`, with the `postgres-tls` feature: every connection failed with "invalid
/// dns name" (the TLS connector was handed the socket's empty host name). Now the pool and the
/// `LISTEN` session connect over the socket in plaintext, as libpq does (a server never offers
/// TLS on a socket), and `require` for a socket host is refused at once as `Misconfigured`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_host_connects_without_tls_and_refuses_require() {
    let url = shared()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .socket_url("postgres");
    let opts = PostgresOptions::default();
    let backend = PostgresBackend::connect(
        &format!("{url}?application_name=dlock_socket"),
        opts.clone(),
    )
    .await
    .expect("connect over the socket with sslmode=prefer");
    let locker = Locker::new(backend.clone());
    let g = locker
        .lock("socket:k")
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    until_listening(&[&backend], Duration::from_secs(5)).await;
    let sessions = blocking(|| {
        shared().lock().unwrap_or_else(|e| e.into_inner()).psql(
            "SELECT count(*) FILTER (WHERE client_addr IS NULL) || ' ' || count(*) \
             FROM pg_stat_activity WHERE application_name = 'dlock_socket'",
        )
    })
    .await;
    let (socket, all) = sessions.split_once(' ').expect("two counts");
    assert!(
        socket == all && all.parse::<u32>().unwrap() >= 2,
        "pool and LISTEN sessions over the socket: {sessions}"
    );
    g.release().await.unwrap();
    for mode in ["disable", "prefer"] {
        let locker = Locker::new(
            PostgresBackend::connect(&format!("{url}?sslmode={mode}"), opts.clone())
                .await
                .unwrap_or_else(|e| panic!("{mode}: {e}")),
        );
        let g = locker.lock("socket:k").try_acquire().await.unwrap();
        g.expect("free").release().await.unwrap();
    }
    let err = misconfigured_within(
        Duration::from_millis(500),
        PostgresBackend::connect(&format!("{url}?sslmode=require"), opts),
    )
    .await;
    assert!(err.to_string().contains("Unix socket"), "{err}");
}

// ---- limits --------------------------------------------------------------------------------

/// `Duration::MAX` as the command and connect timeouts ("no deadline") panicked at connect
/// (`connect_timeout + command_timeout`), and the `LISTEN` task's check timer at
/// `now + limit`. Now the backend connects, locks, and its `LISTEN` session wakes a waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_of_duration_max_do_not_panic() {
    let opts = PostgresOptions::default()
        .command_timeout(Duration::MAX)
        .connect_timeout(Duration::MAX);
    let backend = PostgresBackend::connect(&direct_url("postgres"), opts)
        .await
        .expect("connect");
    let locker = Locker::builder()
        .command_timeout(Duration::from_secs(2))
        .try_build(backend.clone())
        .unwrap();
    let g = locker
        .lock("max:k")
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    g.release().await.unwrap();
    until_listening(&[&backend], Duration::from_secs(5)).await;
    let (holder, _) = locker_at(&direct_url("postgres"), Duration::from_secs(2)).await;
    let guard = holder
        .lock("max:woken")
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    woken_by_the_release(&backend, "max:woken", guard).await;
    assert!(backend.is_listening());
}

/// `AdminStore::list` straight on the backend with a page of 0 panicked (`limit - 1`), and with
/// `usize::MAX` (`limit + 1` in `i64`). A page of 0 is a page of one, as on the memory store;
/// `usize::MAX` is everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_a_page_of_zero_or_usize_max_does_not_panic() {
    let (locker, backend) = locker_at(&direct_url("postgres"), Duration::from_secs(2)).await;
    let a = locker.lock("pagelimit_a").acquire().await.unwrap();
    let b = locker.lock("pagelimit_b").acquire().await.unwrap();
    let prefix = LockKey::new("pagelimit_").unwrap();
    let admin = backend.admin().expect("an admin store");
    let page = admin
        .list(locker.prefix(), prefix.as_str(), None, 0)
        .await
        .unwrap();
    assert_eq!(page.locks.len(), 1, "{page:?}");
    let cursor = page.cursor.expect("more to come");
    let rest = admin
        .list(locker.prefix(), prefix.as_str(), Some(&cursor), 0)
        .await
        .unwrap();
    assert_eq!(rest.locks.len(), 1, "{rest:?}");
    assert_ne!(rest.locks[0].key, page.locks[0].key);
    let all = admin
        .list(locker.prefix(), prefix.as_str(), None, usize::MAX)
        .await
        .unwrap();
    assert_eq!(all.locks.len(), 2, "{all:?}");
    assert_eq!(all.cursor, None);
    let all = locker
        .admin()
        .unwrap()
        .list("pagelimit_", None, usize::MAX)
        .await;
    assert_eq!(all.unwrap().locks.len(), 2);
    a.release().await.unwrap();
    b.release().await.unwrap();
}

// ---- transaction-scoped locks --------------------------------------------------------------

async fn client(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_scoped_lock_commits_and_rolls_back_with_the_writes() {
    let url = direct_url("postgres");
    let (mut a, mut b) = (client(&url).await, client(&url).await);
    a.batch_execute("CREATE TABLE IF NOT EXISTS xact_orders (id int PRIMARY KEY, state text)")
        .await
        .unwrap();
    let key = LockKey::new("xact:order:1").unwrap();

    // Held by A's transaction: B cannot take it; A's rollback frees it and drops A's write.
    let tx = a.transaction().await.unwrap();
    lock_in_transaction(&tx, "dlock", &key).await.unwrap();
    tx.execute("INSERT INTO xact_orders VALUES (1, 'paid')", &[])
        .await
        .unwrap();
    {
        let txb = b.transaction().await.unwrap();
        assert!(!try_lock_in_transaction(&txb, "dlock", &key).await.unwrap());
        // Another key is not affected.
        let other = LockKey::new("xact:order:2").unwrap();
        assert!(try_lock_in_transaction(&txb, "dlock", &other)
            .await
            .unwrap());
        txb.rollback().await.unwrap();
    }
    tx.rollback().await.unwrap();
    let n: i64 = a
        .query_one("SELECT count(*) FROM xact_orders WHERE id = 1", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0, "the rolled-back write is gone with the lock");

    // A waiting lock_in_transaction is granted when the holder commits, and sees its write.
    let tx = a.transaction().await.unwrap();
    lock_in_transaction(&tx, "dlock", &key).await.unwrap();
    tx.execute("INSERT INTO xact_orders VALUES (1, 'paid')", &[])
        .await
        .unwrap();
    let waiter = tokio::spawn(async move {
        let txb = b.transaction().await.unwrap();
        lock_in_transaction(&txb, "dlock", &LockKey::new("xact:order:1").unwrap())
            .await
            .unwrap();
        let state: String = txb
            .query_one("SELECT state FROM xact_orders WHERE id = 1", &[])
            .await
            .unwrap()
            .get(0);
        txb.execute("DELETE FROM xact_orders WHERE id = 1", &[])
            .await
            .unwrap();
        txb.commit().await.unwrap();
        state
    });
    // The database says the waiter is blocked on the advisory lock.
    let probe = client(&url).await;
    wait_for(
        "the second transaction to wait",
        Duration::from_secs(5),
        async || {
            let n: i64 = probe
                .query_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            (n > 0).then_some(())
        },
    )
    .await;
    assert!(!waiter.is_finished());
    tx.commit().await.unwrap();
    assert_eq!(
        waiter.await.unwrap(),
        "paid",
        "the waiter ran after the commit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_scoped_lock_works_through_pgbouncer() {
    let (mut via, mut direct) = (
        client(&shared_bouncer().url("postgres")).await,
        client(&direct_url("postgres")).await,
    );
    let key = LockKey::new("xact:bounced").unwrap();
    for _ in 0..3 {
        let tx = via.transaction().await.unwrap();
        assert!(try_lock_in_transaction(&tx, "dlock", &key).await.unwrap());
        let txd = direct.transaction().await.unwrap();
        assert!(!try_lock_in_transaction(&txd, "dlock", &key).await.unwrap());
        txd.rollback().await.unwrap();
        tx.commit().await.unwrap();
        let txd = direct.transaction().await.unwrap();
        assert!(try_lock_in_transaction(&txd, "dlock", &key).await.unwrap());
        txd.commit().await.unwrap();
    }
}

// ---- schema and pools ----------------------------------------------------------------------

/// Failover, with asynchronous replication and a multi-host URL that asks for the primary
/// (`target_session_attrs=read-write`): the primary dies and its standby is promoted. Meanwhile
/// every call is a typed 503; then the same lockers serve again, without a restart: a lock
/// held before (replicated) still excludes others and renews on the new primary, new grants
/// have larger tokens, and the `LISTEN` session follows, so a waiter is woken by a release. A
/// waiter that started with no primary up waits through the failover
/// (`RetryPolicy::through_outages`) and is served by the promoted standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_the_same_lockers_serve_from_the_promoted_standby() {
    let primary = Arc::new(Mutex::new(blocking(PostgresServer::start).await));
    let p = primary.clone();
    let standby = blocking(move || p.lock().unwrap().start_standby()).await;
    let url = failover_url(primary.lock().unwrap().port(), standby.port());
    let (a, _) = locker_at(&url, Duration::from_millis(500)).await;
    let (b, b_backend) = locker_at(&url, Duration::from_millis(500)).await;
    let held = a
        .lock("fo:held")
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let before = held.fencing_token();
    let p = primary.clone();
    let standby = blocking(move || {
        let mut p = p.lock().unwrap();
        p.until_replayed(&standby);
        p.kill();
        standby
    })
    .await;
    unavailable_within(
        Duration::from_millis(1500),
        b.lock("fo:during").try_acquire(),
    )
    .await;
    let mut through = tokio::spawn({
        let b = b.clone();
        let policy = RetryPolicy::new(Duration::from_secs(60)).through_outages(true);
        async move {
            b.lock("fo:through")
                .on_fail(OnFail::Retry(policy))
                .acquire()
                .await
        }
    });
    // Three command timeouts with no primary: still waiting.
    let still = tokio::time::timeout(Duration::from_millis(1500), &mut through).await;
    assert!(
        still.is_err(),
        "the waiter through outages gave up: {still:?}"
    );
    let standby = blocking(move || {
        standby.promote();
        standby
    })
    .await;
    let g = tokio::time::timeout(BACK_WITHIN, through)
        .await
        .expect("the waiter through outages was not served by the promoted standby")
        .unwrap()
        .expect("the waiter through outages gave up");
    assert_eq!(g.fencing_token() >> 48, 2, "granted on the new timeline");
    g.release().await.unwrap();

    let g = taken_once_back(&b, "fo:new", BACK_WITHIN, BACK_EVERY).await;
    assert!(g.fencing_token() > before, "tokens keep increasing");
    assert_eq!(g.fencing_token() >> 48, 2, "granted on the new timeline");
    g.release().await.unwrap();
    assert!(
        b.lock("fo:held").try_acquire().await.unwrap().is_none(),
        "the lock held before the failover must still exclude others"
    );
    held.extend(Duration::from_secs(30))
        .await
        .expect("the holder renews on the new primary");
    assert!(
        held.is_held(),
        "a lock that survived the failover was reported lost"
    );
    until_listening(&[&b_backend], Duration::from_secs(10)).await;
    woken_by_the_release(&b_backend, "fo:held", held).await;
    drop(standby);
}

/// A server that does not tell its WAL position (`pg_current_wal_lsn` refused, as Amazon
/// Aurora does) still grants locks, its tokens counted on timeline 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_hiding_its_wal_position_still_issues_tokens() {
    let server = shared();
    let db = blocking(move || {
        let s = server.lock().unwrap_or_else(|e| e.into_inner());
        let db = s.create_database("hidden_wal");
        s.psql_in(
            &db,
            &format!(
                "DO $$ BEGIN CREATE ROLE dlock_nowal LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$; \
                 REVOKE EXECUTE ON FUNCTION pg_current_wal_lsn() FROM PUBLIC; \
                 GRANT CREATE ON DATABASE {db} TO dlock_nowal;"
            ),
        );
        db
    })
    .await;
    let url = format!("postgres://dlock_nowal@127.0.0.1:{}/{db}", port());
    let (locker, _) = locker_at(&url, Duration::from_secs(2)).await;
    let first = token_of_a_grant(&locker, "nowal:k").await;
    assert_eq!(first >> 48, 1, "counted on timeline 1: {first}");
    assert!(token_of_a_grant(&locker, "nowal:k").await > first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sql_file_is_all_a_least_privileged_role_needs() {
    let server = shared();
    // A fresh database, the file applied as a migration would, and a role with only the
    // privileges the file lists.
    let db = blocking(move || {
        let s = server.lock().unwrap_or_else(|e| e.into_inner());
        let db = s.create_database("migrated");
        let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../dlock-runtime/sql/postgres.sql");
        s.psql_in(&db, &std::fs::read_to_string(file).unwrap());
        s.psql_in(
            &db,
            "DO $$ BEGIN CREATE ROLE dlock_app LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$; \
             GRANT USAGE ON SCHEMA dlock TO dlock_app; \
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA dlock TO dlock_app; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA dlock TO dlock_app; \
             GRANT USAGE ON ALL SEQUENCES IN SCHEMA dlock TO dlock_app; \
             REVOKE CREATE ON SCHEMA public FROM PUBLIC;",
        );
        db
    })
    .await;
    let url = format!("postgres://dlock_app@127.0.0.1:{}/{db}", port());
    let opts = PostgresOptions::default().create_schema(false);
    let backend = PostgresBackend::connect(&url, opts.clone())
        .await
        .expect("connects without creating anything");
    let (a, b) = (Locker::new(backend.clone()), Locker::new(backend));
    let g = a.lock("priv:k").try_acquire().await.unwrap().expect("free");
    assert!(b.lock("priv:k").try_acquire().await.unwrap().is_none());
    g.release().await.unwrap();
    let p = a.semaphore("priv:s", 1).try_acquire().await.unwrap();
    assert!(p.is_some(), "a permit with the file's privileges");
    assert!(b
        .semaphore("priv:s", 1)
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    let r = b.rw("priv:rw").read().try_acquire().await.unwrap();
    assert!(r.is_some(), "a read hold with the file's privileges");
    drop((p, r));
    let fingerprint = dlock_runtime::idempotency::Fingerprint::builder()
        .field("x")
        .finish();
    let begun = a.idempotency("priv:idem", fingerprint).begin().await;
    assert!(
        begun.is_ok(),
        "idempotency records with the file's privileges"
    );

    // Without the schema, and not allowed to create it: a clear error naming the file.
    let err = PostgresBackend::connect(&url, opts.schema("never_created"))
        .await
        .expect_err("no schema");
    assert!(err.to_string().contains("sql/postgres.sql"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_pool_shares_the_services_pool() {
    use dlock_runtime::backend::postgres::deadpool_postgres::{Manager, Pool};
    let config: tokio_postgres::Config = direct_url("postgres").parse().unwrap();
    let pool = Pool::builder(Manager::new(config, tokio_postgres::NoTls))
        .max_size(4)
        .build()
        .unwrap();
    // The service's pool, no notify URL: locks work, waiters use their timers.
    let backend = PostgresBackend::from_pool(pool.clone(), PostgresOptions::default())
        .await
        .expect("from pool");
    assert!(!backend.is_listening());
    let locker = Locker::new(backend.clone());
    let g = locker
        .lock("pool:k")
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    assert_eq!(pool.status().size, backend.pool().status().size, "one pool");
    g.release().await.unwrap();
    // With a direct notify URL it listens too.
    let backend = PostgresBackend::from_pool(
        pool,
        PostgresOptions::default().notify_url(direct_url("postgres")),
    )
    .await
    .expect("from pool");
    until_listening(&[&backend], Duration::from_secs(5)).await;
}

/// A schema upgrade that fails part-way on a connection of the service's own pool
/// (`from_pool`) — here its advisory lock is not granted within the role's `lock_timeout`,
/// another instance upgrading — does not hand that connection back: the failed batch left
/// its session inside an aborted transaction, where every later statement of the service on
/// it failed (`25P02`) until it was closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_schema_upgrade_leaves_no_broken_connection_in_the_services_pool() {
    use dlock_runtime::backend::postgres::deadpool_postgres::{Manager, Pool};
    let db = blocking(|| {
        let server = shared();
        let server = server.lock().unwrap_or_else(|e| e.into_inner());
        server.create_database("failed_upgrade")
    })
    .await;
    let url = direct_url(&db);
    let (_locker, installed) = locker_at(&url, Duration::from_secs(5)).await;
    drop(installed);
    // An older schema, so the next backend runs the DDL; another instance holds its lock.
    let connect = async || {
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("a session");
        tokio::spawn(conn);
        client
    };
    let upgrading = connect().await;
    upgrading
        .batch_execute(
            "CREATE OR REPLACE FUNCTION dlock.dlock_schema_version() RETURNS integer \
             LANGUAGE sql IMMUTABLE AS 'SELECT 5'",
        )
        .await
        .expect("an older schema");
    upgrading
        .batch_execute("BEGIN; SELECT pg_advisory_xact_lock(1684824939, 0)")
        .await
        .expect("hold the schema lock");
    let mut config: tokio_postgres::Config = url.parse().unwrap();
    config.options("-c lock_timeout=100");
    let pool = Pool::builder(Manager::new(config, tokio_postgres::NoTls))
        .max_size(1)
        .build()
        .unwrap();
    let refused = PostgresBackend::from_pool(pool.clone(), PostgresOptions::default()).await;
    assert!(refused.is_err(), "the upgrade got past a held lock");
    upgrading.batch_execute("COMMIT").await.unwrap();
    let service = pool
        .get()
        .await
        .expect("a connection of the service's pool");
    let answered = service.simple_query("SELECT 1").await;
    assert!(
        answered.is_ok(),
        "the service's pool holds a broken connection: {:?}",
        answered.err()
    );
}

/// A grant's transaction commits durably without overriding what the operator chose: the
/// schema raises `synchronous_commit` from `off` to `local` (its WAL written out on this
/// server) and leaves `local` and stronger settings alone. The first version forced `on`,
/// which made a role kept out of a synchronous standby's wait (`local`) wait for it: with that
/// standby down, every grant stalled, holding its name's locks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_raises_synchronous_commit_from_off_to_local_and_leaves_stronger_settings() {
    let db = blocking(|| {
        let server = shared();
        let server = server.lock().unwrap_or_else(|e| e.into_inner());
        server.create_database("durable_commit")
    })
    .await;
    let (locker, _) = locker_at(&direct_url(&db), Duration::from_secs(2)).await;
    token_of_a_grant(&locker, "durable:k").await;
    for (session, during_a_grant) in [
        ("off", "local"),
        ("local", "local"),
        ("remote_write", "remote_write"),
        ("on", "on"),
        ("remote_apply", "remote_apply"),
    ] {
        let db2 = db.clone();
        let shown = blocking(move || {
            let server = shared();
            let server = server.lock().unwrap_or_else(|e| e.into_inner());
            server.psql_in(
                &db2,
                &format!(
                    "BEGIN; SET LOCAL synchronous_commit = {session}; \
                     SELECT dlock.dlock_next_fence(); SHOW synchronous_commit; ROLLBACK"
                ),
            )
        })
        .await;
        assert_eq!(
            shown.lines().last(),
            Some(during_a_grant),
            "{session}: {shown}"
        );
    }
}
