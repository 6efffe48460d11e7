//! What dlock tells an operator: the metrics (feature `metrics`) after scripted runs, with
//! exact values, through a recorder that snapshots them and through the Prometheus exporter
//! scraped over HTTP; and the `tracing` spans and events (names, fields, levels), with keys
//! redacted by default and no secrets.
//!
//! Each test installs its recorder and subscriber for its own thread only
//! (`metrics::with_local_recorder`, `tracing::subscriber::with_default`) and runs a
//! current-thread runtime inside, so the locker's background tasks report to them too and the
//! tests of this binary never see each other's values.

use std::future::{Future, IntoFuture as _};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::backend::{
    AcquireArgs, Attempt, Backend, BoxFuture, MemoryBackend, OwnerToken, Watch,
};
use dlock_runtime::idempotency::{Begin, Fingerprint};
use dlock_runtime::key::ResourceName;
use dlock_runtime::metrics as m;
use dlock_runtime::{LockError, LockGuard, Locker, OnFail, RetryPolicy};
use dlock_tests::wait::wait_for;
use dlock_tests::RedisServer;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::sync::Notify;

#[path = "observability/capture.rs"]
mod capture;

/// Runs `fut` on a current-thread runtime with a debugging recorder installed for this thread;
/// returns its output and a snapshotter of what was recorded.
fn with_recorder<T>(fut: impl Future<Output = T>) -> (T, Snapshotter) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let out = metrics::with_local_recorder(&recorder, || runtime().block_on(fut));
    (out, snapshotter)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Sorted `(label, value)` pairs.
type Labels = Vec<(String, String)>;

/// The recorded metrics, as `(name, sorted labels, value)`.
struct Recorded(Vec<(String, Labels, DebugValue)>);

impl Recorded {
    fn of(snapshotter: &Snapshotter) -> Self {
        Recorded(
            snapshotter
                .snapshot()
                .into_vec()
                .into_iter()
                .map(|(key, _, _, value)| {
                    let (_, key) = key.into_parts();
                    let mut labels: Labels = key
                        .labels()
                        .map(|l| (l.key().to_owned(), l.value().to_owned()))
                        .collect();
                    labels.sort();
                    (key.name().to_owned(), labels, value)
                })
                .collect(),
        )
    }

    fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<&DebugValue> {
        let mut want: Labels = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        want.sort();
        self.0
            .iter()
            .find(|(n, l, _)| n == name && *l == want)
            .map(|(_, _, v)| v)
    }

    /// A counter's value (0 when never recorded).
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        match self.get(name, labels) {
            Some(DebugValue::Counter(n)) => *n,
            None => 0,
            Some(other) => panic!("{name} {labels:?} is not a counter: {other:?}"),
        }
    }

    fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        match self.get(name, labels) {
            Some(DebugValue::Gauge(v)) => v.into_inner(),
            other => panic!("{name} {labels:?} is not a recorded gauge: {other:?}"),
        }
    }

    /// How many values a histogram recorded.
    fn samples(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        match self.get(name, labels) {
            Some(DebugValue::Histogram(v)) => v.iter().map(|x| x.into_inner()).collect(),
            None => Vec::new(),
            Some(other) => panic!("{name} {labels:?} is not a histogram: {other:?}"),
        }
    }

    /// Every label set of `name` that carries `key = value`.
    fn names_of(&self, name: &str) -> Vec<String> {
        let mut names: Vec<String> = self
            .0
            .iter()
            .filter(|(n, _, _)| n == name)
            .flat_map(|(_, l, _)| {
                l.iter()
                    .filter(|(k, _)| k == "name")
                    .map(|(_, v)| v.clone())
            })
            .collect();
        names.sort();
        names.dedup();
        names
    }
}

const MEMORY: (&str, &str) = ("backend", "memory");

/// A lock on `key` named `name` with a 300 ms lease (renewed every 100 ms: a scheduler stall
/// of under 200 ms loses nothing), once the watchdog renewed it `n` times.
async fn renewed_lock(locker: &Locker, key: &str, name: &'static str, n: u64) -> LockGuard {
    let guard = locker
        .lock(key)
        .name(name)
        .ttl(Duration::from_millis(300))
        .acquire()
        .await
        .unwrap();
    wait_for("renewals", Duration::from_secs(5), async || {
        (locker.renewals() >= n).then_some(())
    })
    .await;
    guard
}

/// A lock on `key` named `name` whose `ttl` lease is not renewed, once it is reported lost.
async fn lost_lock(locker: &Locker, key: &str, name: &'static str, ttl: u64) -> LockGuard {
    let guard = locker
        .lock(key)
        .name(name)
        .ttl(Duration::from_millis(ttl))
        .auto_renew(false)
        .acquire()
        .await
        .unwrap();
    guard.lost().await;
    guard
}

/// A lock stops counting in `dlock_locks_held` when it is lost, not when its guard is dropped
/// later, and its hold time ends there; the loss counts once, however many report it (the
/// watchdog, a task waiting for it, the final release). Before, a lost guard counted as held
/// until dropped — its hold time growing — and a loss seen twice at once could count twice.
#[test]
fn a_lost_lock_stops_counting_as_held_when_it_is_lost() {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        runtime().block_on(async {
            let locker = Locker::memory();
            let l = [MEMORY, ("name", "gone")];
            let guard = lost_lock(&locker, "gone:1", "gone", 50).await;
            // Lost, the guard still alive.
            let r = Recorded::of(&snap);
            assert_eq!(
                r.gauge(m::LOCKS_HELD, &l),
                0.0,
                "a lost lock counted as held"
            );
            assert_eq!(r.counter(m::LOST, &l), 1);
            assert_eq!(
                r.samples(m::HOLD, &l).len(),
                1,
                "the hold ended with the loss"
            );
            // Its release reports the loss again, and its drop ends the hold again: neither
            // counts twice (a snapshot shows what was counted since the one before).
            let err = guard.release().await.unwrap_err();
            assert!(err.is_lost(), "{err}");
            let r = Recorded::of(&snap);
            assert_eq!(r.gauge(m::LOCKS_HELD, &l), 0.0);
            assert_eq!(r.counter(m::LOST, &l), 0, "one loss counted twice");
            assert!(r.samples(m::HOLD, &l).is_empty(), "a second hold time");
        })
    });
}

/// A scripted run on the in-memory backend — acquire, contend, time out, hand over to a
/// waiter, lose a lease, renew, defer until dead-lettered, replay and conflict an idempotency
/// key — and the exact values it must leave.
#[test]
fn a_scripted_run_records_exact_metrics() {
    let (renewals, snap) = with_recorder(async {
        let locker = Locker::memory();
        let orders = |key: &str| locker.lock(key.to_owned()).name("orders");

        // Acquire, then two requests that find it held.
        let held = orders("order:1").acquire().await.unwrap();
        assert!(orders("order:1").try_acquire().await.unwrap().is_none());
        assert!(orders("order:1")
            .acquire()
            .await
            .unwrap_err()
            .is_contended());

        // A waiter that gives up.
        let err = locker
            .lock("order:1")
            .name("orders-wait")
            .on_fail(OnFail::retry(Duration::from_millis(40)))
            .acquire()
            .await
            .unwrap_err();
        assert!(err.is_timeout(), "{err}");

        // A waiter that the release hands the lock to.
        let next = tokio::spawn({
            let locker = locker.clone();
            async move {
                locker
                    .lock("order:1")
                    .name("orders-next")
                    .on_fail(OnFail::retry(Duration::from_secs(10)))
                    .acquire()
                    .await
            }
        });
        wait_for("the waiter in line", Duration::from_secs(5), async || {
            (locker.waiting() == 1).then_some(())
        })
        .await;
        held.release().await.unwrap();
        next.await.unwrap().unwrap().release().await.unwrap();

        // A lease that runs out without renewal is lost.
        drop(lost_lock(&locker, "lease:1", "lease", 50).await);

        // A renewed lock.
        let renewed = renewed_lock(&locker, "renewed:1", "renewed", 2).await;
        let renewals = locker.renewals();
        renewed.release().await.unwrap();

        // Work deferred while its lock is busy, until it is dead-lettered.
        let busy = locker
            .lock("job:1")
            .name("jobs-holder")
            .acquire()
            .await
            .unwrap();
        let err = locker
            .lock("job:1")
            .name("jobs")
            .on_fail(OnFail::defer(Duration::from_millis(10), 2))
            .run(async {})
            .await
            .unwrap_err();
        assert!(err.is_deferred(), "{err}");
        wait_for("the dead letter", Duration::from_secs(5), async || {
            (!locker.defer_queue().dead_letters().is_empty()).then_some(())
        })
        .await;
        busy.release().await.unwrap();

        // Idempotency: first run, replay, conflict, in progress.
        let fp = |s: &str| Fingerprint::builder().field(s).finish();
        let Begin::Run(op) = locker
            .idempotency("pay:1", fp("a"))
            .name("pay")
            .begin()
            .await
            .unwrap()
        else {
            panic!("first begin must run")
        };
        op.complete(b"done").await.unwrap();
        let replay = locker
            .idempotency("pay:1", fp("a"))
            .name("pay")
            .begin()
            .await
            .unwrap();
        assert!(matches!(replay, Begin::Replay(_)), "{replay:?}");
        let conflict = locker
            .idempotency("pay:1", fp("b"))
            .name("pay")
            .begin()
            .await
            .unwrap();
        assert!(matches!(conflict, Begin::Mismatch), "{conflict:?}");
        let Begin::Run(running) = locker
            .idempotency("pay:2", fp("a"))
            .name("pay")
            .begin()
            .await
            .unwrap()
        else {
            panic!("first begin must run")
        };
        let busy = locker
            .idempotency("pay:2", fp("a"))
            .name("pay")
            .begin()
            .await
            .unwrap();
        assert!(matches!(busy, Begin::InProgress { .. }), "{busy:?}");
        running.abort().await.unwrap();
        renewals
    });
    let r = Recorded::of(&snap);
    let l = |name| [MEMORY, ("name", name)];
    let outcome = |name, outcome| [MEMORY, ("name", name), ("outcome", outcome)];

    // Attempts and outcomes.
    assert_eq!(r.counter(m::ACQUIRE_ATTEMPTS, &l("orders")), 3);
    assert_eq!(r.counter(m::ACQUIRE, &outcome("orders", "acquired")), 1);
    assert_eq!(r.counter(m::ACQUIRE, &outcome("orders", "contended")), 2);
    assert_eq!(r.counter(m::ACQUIRE, &outcome("orders-wait", "timeout")), 1);
    assert_eq!(
        r.counter(m::ACQUIRE, &outcome("orders-next", "acquired")),
        1
    );
    assert_eq!(r.samples(m::ACQUIRE_WAIT, &l("orders")).len(), 1);
    assert_eq!(r.samples(m::ACQUIRE_WAIT, &l("orders-next")).len(), 1);
    assert!(r.samples(m::ACQUIRE_WAIT, &l("orders-wait")).is_empty());
    // The waiters were counted while in line and are gone.
    assert_eq!(r.gauge(m::WAITERS, &l("orders-wait")), 0.0);
    assert_eq!(r.gauge(m::WAITERS, &l("orders-next")), 0.0);
    // The release woke the waiter: one handoff.
    assert_eq!(r.samples(m::HANDOFF, &l("orders-next")).len(), 1);
    assert!(r.samples(m::HANDOFF, &l("orders-wait")).is_empty());

    // Held, then released: the gauge is back at 0, one hold time each.
    for name in ["orders", "orders-next", "lease", "renewed", "jobs-holder"] {
        assert_eq!(r.gauge(m::LOCKS_HELD, &l(name)), 0.0, "{name}");
        assert_eq!(r.samples(m::HOLD, &l(name)).len(), 1, "{name}");
    }
    let hold = r.samples(m::HOLD, &l("lease"))[0];
    assert!(hold >= 0.05, "the lost lease was held {hold} s");

    // Loss and renewals.
    assert_eq!(r.counter(m::LOST, &l("lease")), 1);
    assert_eq!(r.counter(m::LOST, &l("renewed")), 0);
    assert_eq!(r.counter(m::RENEWALS, &l("renewed")), renewals);
    assert_eq!(r.counter(m::RENEWAL_FAILURES, &l("renewed")), 0);

    // The deferred job: deferred once, retried once, then dead-lettered (max 2 attempts);
    // each of its two attempts found the lock held.
    let job = |event| [MEMORY, ("name", "jobs"), ("event", event)];
    assert_eq!(r.counter(m::ACQUIRE, &outcome("jobs", "deferred")), 1);
    assert_eq!(r.counter(m::JOBS, &job("deferred")), 1);
    assert_eq!(r.counter(m::JOBS, &job("retried")), 1);
    assert_eq!(r.counter(m::JOBS, &job("dead_lettered")), 1);
    assert_eq!(r.counter(m::JOBS, &job("completed")), 0);
    assert_eq!(r.counter(m::ACQUIRE, &outcome("jobs", "contended")), 2);

    // Idempotency.
    let idem = |o| [MEMORY, ("name", "pay"), ("outcome", o)];
    assert_eq!(r.counter(m::IDEMPOTENCY, &idem("run")), 2);
    assert_eq!(r.counter(m::IDEMPOTENCY, &idem("replayed")), 1);
    assert_eq!(r.counter(m::IDEMPOTENCY, &idem("conflict")), 1);
    assert_eq!(r.counter(m::IDEMPOTENCY, &idem("in_progress")), 1);
    assert_eq!(r.gauge(m::LOCKS_HELD, &l("pay")), 0.0);

    // No key ever became a label.
    let names = r.names_of(m::ACQUIRE);
    assert!(names.iter().all(|n| !n.contains(':')), "{names:?}");
}

/// The memory backend, with its acquire attempts held at a gate while `gated` is set: the test
/// signals `arrived` when one comes, and lets it on with `go`.
#[derive(Clone, Default)]
struct GatedAcquire {
    inner: MemoryBackend,
    gated: Arc<AtomicBool>,
    arrived: Arc<Notify>,
    go: Arc<Notify>,
}

impl Backend for GatedAcquire {
    fn name(&self) -> &'static str {
        "gated"
    }

    fn acquire<'a>(&'a self, args: AcquireArgs<'a>) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(async move {
            if self.gated.swap(false, Ordering::SeqCst) {
                self.arrived.notify_one();
                self.go.notified().await;
            }
            self.inner.acquire(args).await
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

    fn abandon<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<(), LockError>> {
        self.inner.abandon(resource, token)
    }

    fn watch<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        self.inner.watch(resource, token)
    }
}

/// A release that lands while the waiter's attempt is on its way — the waiter woke on its
/// timer, not on the release — hands it the lock all the same, and is counted as a handoff.
/// (Such a race left `a_scripted_run_records_exact_metrics` one handoff short, now and then.)
#[test]
fn a_release_during_the_waiters_attempt_counts_as_a_handoff() {
    let ((), snap) = with_recorder(async {
        let backend = GatedAcquire::default();
        let locker = Locker::new(backend.clone());
        let held = locker.lock("k").name("holder").acquire().await.unwrap();
        let next = tokio::spawn({
            let locker = locker.clone();
            async move {
                // Its timer wakes it every 5 ms: its attempts are not woken by the release.
                let policy = RetryPolicy::new(Duration::from_secs(10))
                    .backoff(Duration::from_millis(5), Duration::from_millis(5))
                    .jitter(false);
                locker
                    .lock("k")
                    .name("next")
                    .on_fail(OnFail::Retry(policy))
                    .acquire()
                    .await
            }
        });
        wait_for("the waiter in line", Duration::from_secs(5), async || {
            (locker.waiting() == 1).then_some(())
        })
        .await;
        // Its next attempt, sent when its timer runs out, is held on its way while the
        // release frees the lock and names it the next holder.
        let limit = Duration::from_secs(5);
        backend.gated.store(true, Ordering::SeqCst);
        tokio::time::timeout(limit, backend.arrived.notified())
            .await
            .expect("the waiter's next attempt");
        held.release().await.unwrap();
        backend.go.notify_one();
        let next = tokio::time::timeout(limit, next)
            .await
            .expect("the waiter holds the lock");
        next.unwrap().unwrap().release().await.unwrap();
    });
    let r = Recorded::of(&snap);
    let l = |name| [("backend", "gated"), ("name", name)];
    assert_eq!(
        r.counter(
            m::ACQUIRE,
            &[
                ("backend", "gated"),
                ("name", "next"),
                ("outcome", "acquired")
            ]
        ),
        1
    );
    assert_eq!(r.samples(m::HANDOFF, &l("next")).len(), 1);
}

/// A Redis server that goes away: requests are `unavailable`, renewals fail, the lock is lost.
#[test]
fn a_backend_that_goes_away_counts_unavailable_failed_renewals_and_loss() {
    let mut server = RedisServer::start();
    let url = server.url();
    let ((), snap) = with_recorder(async move {
        let locker = Locker::builder()
            .command_timeout(Duration::from_millis(200))
            .connect(&url)
            .await
            .unwrap();
        let guard = locker
            .lock("r:1")
            .name("redis-lock")
            .ttl(Duration::from_millis(600))
            .acquire()
            .await
            .unwrap();
        server.stop();
        let err = locker
            .lock("r:2")
            .name("redis-lock")
            .acquire()
            .await
            .unwrap_err();
        assert!(err.is_unavailable(), "{err}");
        guard.lost().await;
        drop(guard);
        drop(server);
    });
    let r = Recorded::of(&snap);
    let l = [("backend", "redis"), ("name", "redis-lock")];
    let outcome = |o| [("backend", "redis"), ("name", "redis-lock"), ("outcome", o)];
    assert_eq!(r.counter(m::ACQUIRE, &outcome("acquired")), 1);
    assert_eq!(r.counter(m::ACQUIRE, &outcome("unavailable")), 1);
    assert_eq!(r.counter(m::LOST, &l), 1);
    assert!(
        r.counter(m::RENEWAL_FAILURES, &l) >= 1,
        "no failed renewal recorded"
    );
    assert_eq!(r.gauge(m::LOCKS_HELD, &l), 0.0);
}

/// `#[distributed_lock]` names its locks by the key template, never by the key.
#[test]
fn the_attribute_labels_its_locks_with_the_key_template() {
    #[dlock_runtime::distributed_lock(key = "invoice:<id>", ttl = "5s", locker = locker)]
    async fn send(locker: &Locker, id: u64) -> u64 {
        id
    }
    let ((), snap) = with_recorder(async {
        let locker = Locker::memory();
        assert_eq!(send(&locker, 7).await.unwrap(), 7);
        assert_eq!(send(&locker, 8).await.unwrap(), 8);
    });
    let r = Recorded::of(&snap);
    let outcome = [MEMORY, ("name", "invoice:<id>"), ("outcome", "acquired")];
    assert_eq!(r.counter(m::ACQUIRE, &outcome), 2);
    assert_eq!(r.names_of(m::ACQUIRE), vec!["invoice:<id>".to_owned()]);
}

/// A call the attribute refuses before asking the backend — the same key twice in a key list,
/// a key over the length limit — counts as an `error` outcome, as a request's invalid key
/// does. Before, it was counted nowhere.
#[test]
fn the_attributes_invalid_keys_count_as_errors() {
    #[dlock_runtime::distributed_lock(key = ["acct:<from>", "acct:<to>"], locker = locker)]
    async fn transfer(locker: &Locker, from: u64, to: u64) -> u64 {
        from + to
    }
    #[dlock_runtime::distributed_lock(key = "note:<text>", locker = locker)]
    async fn note(locker: &Locker, text: String) -> usize {
        text.len()
    }
    let ((), snap) = with_recorder(async {
        let locker = Locker::memory();
        let err = transfer(&locker, 7, 7).await.unwrap_err();
        assert!(matches!(err, LockError::InvalidKey { .. }), "{err}");
        let err = note(&locker, "x".repeat(100_000)).await.unwrap_err();
        assert!(matches!(err, LockError::InvalidKey { .. }), "{err}");
    });
    let r = Recorded::of(&snap);
    let error = |name| [MEMORY, ("name", name), ("outcome", "error")];
    assert_eq!(r.counter(m::ACQUIRE, &error("acct:<from> + acct:<to>")), 1);
    assert_eq!(r.counter(m::ACQUIRE, &error("note:<text>")), 1);
}

// ---- tracing ----

use capture::{capturing, Kind, Seen};
use tracing::Level;

const SECRET_KEY: &str = "user:secret-42";

/// Everything dlock does with one lock, under a capturing subscriber.
fn traced_run(locker: Locker) -> capture::Captured {
    let ((), captured) = capturing(|| {
        runtime().block_on(async {
            let guard = renewed_lock(&locker, SECRET_KEY, "users", 1).await;
            guard.extend(Duration::from_secs(1)).await.unwrap();
            guard.release().await.unwrap();
            let again = locker
                .lock(SECRET_KEY)
                .name("users")
                .try_acquire()
                .await
                .unwrap();
            again.expect("free again").release().await.unwrap();

            // A lease that runs out: the loss event, then a release that reports it.
            let short = lost_lock(&locker, SECRET_KEY, "users", 30).await;
            assert!(short.release().await.unwrap_err().is_lost());

            // Work whose lock runs out under it: the warning names the error, not the key.
            let out = locker
                .lock(SECRET_KEY)
                .name("users")
                .ttl(Duration::from_millis(30))
                .auto_renew(false)
                .run(tokio::time::sleep(Duration::from_millis(60)))
                .await;
            assert!(out.is_ok());

            // Deferred work.
            let busy = locker.lock(SECRET_KEY).acquire().await.unwrap();
            let err = locker
                .lock(SECRET_KEY)
                .name("jobs")
                .on_fail(OnFail::defer(Duration::from_secs(60), 2))
                .run(async {})
                .await
                .unwrap_err();
            assert!(err.is_deferred());
            busy.release().await.unwrap();

            // Idempotency.
            let fp = Fingerprint::builder().field("x").finish();
            let Begin::Run(op) = locker
                .idempotency(SECRET_KEY, fp)
                .name("pay")
                .begin()
                .await
                .unwrap()
            else {
                panic!("first begin must run")
            };
            op.complete(b"ok").await.unwrap();
            let Begin::Run(op) = locker
                .idempotency("user:secret-43", fp)
                .name("pay")
                .begin()
                .await
                .unwrap()
            else {
                panic!("first begin must run")
            };
            op.abort().await.unwrap();
        })
    });
    captured
}

fn one<'a>(seen: &'a [Seen], what: &str) -> &'a Seen {
    seen.first()
        .unwrap_or_else(|| panic!("no {what} was recorded"))
}

fn assert_redacted(key: Option<&str>) -> String {
    let key = key.expect("a key field");
    assert!(
        key.len() == 13 && key.starts_with('#') && key[1..].bytes().all(|b| b.is_ascii_hexdigit()),
        "not a redacted key: {key:?}"
    );
    key.to_owned()
}

/// The spans and events that exist, with their names, levels and fields; keys are a keyed
/// hash (the same for one key), never the key.
#[test]
fn spans_and_events_have_their_names_levels_and_fields_with_keys_redacted() {
    let captured = traced_run(Locker::memory());

    let span_fields = |name: &str, lock_name: &str| {
        let spans = captured.spans(name);
        let span = one(&spans, name);
        assert_eq!(span.level, Level::DEBUG, "{name}");
        assert!(span.target.starts_with("dlock_runtime"), "{span:?}");
        assert_eq!(span.field("name"), Some(lock_name), "{span:?}");
        assert_eq!(span.field("backend"), Some("memory"), "{span:?}");
        assert_redacted(span.field("key"))
    };
    let hash = span_fields("dlock.acquire", "users");
    for (span, lock_name) in [
        ("dlock.try_acquire", "users"),
        ("dlock.extend", "users"),
        ("dlock.release", "users"),
        ("dlock.idempotency.begin", "pay"),
        ("dlock.idempotency.complete", "pay"),
    ] {
        assert_eq!(
            span_fields(span, lock_name),
            hash,
            "{span}: one key, one hash"
        );
    }
    let other = span_fields("dlock.idempotency.abort", "pay");
    assert_ne!(other, hash, "another key, another hash");

    // The watchdog's renewal batch.
    let renew = captured.events("dlock.renew");
    let renew = one(&renew, "dlock.renew");
    assert_eq!(renew.level, Level::TRACE);
    assert_eq!(renew.field("batch"), Some("1"));
    assert_eq!(renew.field("renewed"), Some("1"));
    assert_eq!(
        renew.span, None,
        "the watchdog's events belong to no request's span"
    );

    // The loss.
    let lost = captured.events("dlock.lost");
    let lost = one(&lost, "dlock.lost");
    assert_eq!(lost.level, Level::WARN);
    assert_eq!(assert_redacted(lost.field("key")), hash);
    assert_eq!(lost.field("name"), Some("users"));
    assert_eq!(lost.field("backend"), Some("memory"));
    assert_eq!(lost.field("reason"), Some("the local lease ran out"));

    // A release that failed after the work: the error, with the key redacted.
    let unclean = captured.events("dlock: lock was not cleanly released after the work finished");
    let unclean = one(&unclean, "the unclean release warning");
    assert_eq!(unclean.level, Level::WARN);
    assert_eq!(
        unclean.field("error"),
        Some(format!("lock `{hash}` was lost").as_str())
    );

    // The defer queue's event.
    let deferred = captured.events("deferred");
    let deferred = one(&deferred, "the deferred event");
    assert_eq!(deferred.level, Level::INFO);
    assert_eq!(deferred.target, "dlock::defer");
    assert_eq!(deferred.field("queue"), Some("memory"));
    assert_eq!(deferred.field("name"), Some("jobs"));
    assert_eq!(deferred.field("attempt"), Some("0"));
    assert_eq!(deferred.field("job_id").map(str::len), Some(32));
    assert_eq!(assert_redacted(deferred.field("key")), hash);

    // The key itself appears nowhere.
    for seen in captured.all() {
        for text in seen.texts() {
            assert!(!text.contains("secret-4"), "the key leaked: {seen:?}");
        }
    }
}

/// `trace_plain_keys(true)` records the keys as they are.
#[test]
fn plain_keys_are_an_opt_in() {
    let locker = Locker::builder().trace_plain_keys(true).memory().unwrap();
    let captured = traced_run(locker);
    for span in ["dlock.acquire", "dlock.release", "dlock.idempotency.begin"] {
        let spans = captured.spans(span);
        assert_eq!(one(&spans, span).field("key"), Some(SECRET_KEY), "{span}");
    }
    let lost = captured.events("dlock.lost");
    assert_eq!(one(&lost, "dlock.lost").field("key"), Some(SECRET_KEY));
    let deferred = captured.events("deferred");
    assert_eq!(one(&deferred, "deferred").field("key"), Some(SECRET_KEY));
}

/// A password in a locker URL appears in no event and no error message: wrong password,
/// unreachable servers, every URL form.
#[test]
fn a_password_in_a_url_never_reaches_an_event_or_an_error() {
    const PASSWORD: &str = "pw-s3cret-9f1c";
    let server = RedisServer::start();
    let port = server.port();
    let free = dlock_tests::redis_server::free_port();
    let ((), captured) = capturing(|| {
        runtime().block_on(async {
            let () = server
                .query(
                    redis::cmd("CONFIG")
                        .arg("SET")
                        .arg("requirepass")
                        .arg(PASSWORD),
                )
                .await;
            let builder = || Locker::builder().command_timeout(Duration::from_millis(300));
            // The right password: a lock taken and released, events and all.
            let url = format!("redis://:{PASSWORD}@127.0.0.1:{port}");
            let locker = builder().connect(&url).await.unwrap();
            let guard = locker.lock("k").acquire().await.unwrap();
            guard.release().await.unwrap();
            let mut errors = Vec::new();
            let wrong = format!("redis://:{PASSWORD}-wrong@127.0.0.1:{port}");
            let failing = [
                wrong,
                format!("redis://user:{PASSWORD}@127.0.0.1:{free}"),
                format!("rediss://user:{PASSWORD}@127.0.0.1:{free}"),
                format!("redis+sentinel://user:{PASSWORD}@127.0.0.1:{free}/mymaster"),
                format!("redis+sentinel://127.0.0.1:{free}/mymaster?sentinel_password={PASSWORD}"),
                format!("redis+sentinel://127.0.0.1:{free}/m?sentinel_username=u&sentinel_password={PASSWORD}"),
                format!("redis+sentinel://127.0.0.1:{free}/mymaster?{PASSWORD}"),
                format!("redis+cluster://user:{PASSWORD}@127.0.0.1:{free}"),
                format!("redlock://:{PASSWORD}@127.0.0.1:{free},127.0.0.1:{free},127.0.0.1:{free}"),
                format!("postgres://user:{PASSWORD}@127.0.0.1:{free}/db"),
                format!("etcd://user:{PASSWORD}@127.0.0.1:{free}"),
                format!("memcache://user:{PASSWORD}@127.0.0.1:{free}"),
            ];
            for url in failing {
                let err = builder().connect(&url).await.unwrap_err();
                // The error and its whole source chain.
                let mut text = err.to_string();
                let mut source = std::error::Error::source(&err);
                while let Some(s) = source {
                    text.push_str(&format!(" / {s}"));
                    source = s.source();
                }
                errors.push((url, text));
            }
            for (url, text) in errors {
                assert!(
                    !text.contains(PASSWORD),
                    "{url}: the password is in the error: {text}"
                );
                assert!(!text.is_empty(), "{url}");
            }
        })
    });
    let all = captured.all();
    assert!(
        all.iter().any(|s| s.kind == Kind::Span),
        "nothing was traced"
    );
    for seen in all {
        for text in seen.texts() {
            assert!(!text.contains(PASSWORD), "the password leaked: {seen:?}");
        }
    }
}

/// A leader election the backend refuses for good (a user without the lock keys) is one
/// `ERROR` event naming the election by its redacted name — not one per attempt, and not a
/// `DEBUG` event nobody sees — and the campaign goes on: once the user is granted the keys, the
/// candidate leads.
#[test]
fn an_election_refused_for_good_is_an_error_once_and_leads_once_fixed() {
    const NAME: &str = "secret-election";
    let server = RedisServer::start();
    let (term, captured) = capture::capturing_run(async |captured| {
        let url = server.confined_user_url("campaigner").await;
        let locker = Locker::builder().connect(&url).await.unwrap();
        let election = locker.elect(NAME).start().unwrap();
        // Four refused campaign attempts (an attempt is an acquire).
        wait_for(
            "four campaign attempts",
            Duration::from_secs(10),
            async || (captured.spans("dlock.acquire").len() >= 4).then_some(()),
        )
        .await;
        assert!(!election.is_leader());
        let mut grant = redis::cmd("ACL");
        grant.arg(&["SETUSER", "campaigner", "~*"]);
        let () = server.query(&grant).await;
        let term = tokio::time::timeout(Duration::from_secs(10), election.wait_for_leadership())
            .await
            .expect("the campaign did not lead once the keys were granted")
            .expect("the campaign ended");
        election.resign().await.unwrap();
        term
    });
    assert!(term > 0);
    let errors = captured.at(Level::ERROR);
    assert_eq!(errors.len(), 1, "{errors:?}");
    let refused = &errors[0];
    assert!(refused.name.contains("refuses the campaign"), "{refused:?}");
    assert_redacted(refused.field("election"));
    let error = refused.field("error").expect("an error field");
    assert!(!error.contains(NAME), "{refused:?}");
    assert!(
        captured
            .events("dlock.election: campaign attempt failed")
            .is_empty(),
        "a refusal for good was also logged as an ordinary failed attempt"
    );
    assert_eq!(captured.events("dlock.election: leading").len(), 1);
}

/// A campaign whose every attempt fails in a way no retry changes, though it is not a
/// refusal of the backend's — here the locker asks every lock for a replica acknowledgement
/// the in-memory backend cannot give (`Unsupported`) — never leads; that is an `ERROR` event,
/// not a `DEBUG` event per attempt that nobody sees (a fleet without a leader, and nothing
/// alerting). A ZooKeeper TTL over twice the session timeout (`InvalidTtl`) is the same case.
#[test]
fn an_election_no_attempt_of_which_can_succeed_is_an_error() {
    let (led, captured) = capture::capturing_run(async |captured| {
        let locker = Locker::builder().replicas(1).memory().unwrap();
        let election = locker.elect("unsupported-election").start().unwrap();
        wait_for(
            "four campaign attempts",
            Duration::from_secs(10),
            async || (captured.spans("dlock.acquire").len() >= 4).then_some(()),
        )
        .await;
        let led = election.is_leader();
        election.resign().await.unwrap();
        led
    });
    assert!(!led);
    let errors = captured.at(Level::ERROR);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].name.contains("refuses the campaign"),
        "{errors:?}"
    );
    assert!(
        captured
            .events("dlock.election: campaign attempt failed")
            .is_empty(),
        "logged as an ordinary failed attempt"
    );
}

/// The `WARN` events of `connect` to `server` once its `maxmemory-policy` is `policy`.
fn warnings_at_connect(
    server: &RedisServer,
    policy: &str,
    connect: impl AsyncFnOnce(&str),
) -> Vec<capture::Seen> {
    let url = server.url();
    let ((), captured) = capture::capturing_run(async |_| {
        let mut set = redis::cmd("CONFIG");
        set.arg(&["SET", "maxmemory-policy", policy]);
        let () = server.query(&set).await;
        connect(&url).await;
    });
    captured.at(Level::WARN)
}

/// A Redis that may evict keys under memory pressure can evict a held lock (every lock key
/// has a TTL) and grant it to another owner: connecting to one whose `maxmemory-policy` is not
/// `noeviction` is one `WARN` event naming the policy; to one with `noeviction`, none.
#[test]
fn connecting_to_a_redis_that_evicts_keys_is_a_warning() {
    let server = RedisServer::start();
    let warnings = |policy| {
        warnings_at_connect(&server, policy, async |url| {
            Locker::builder().connect(url).await.unwrap();
        })
    };
    let evicting = warnings("volatile-lru");
    assert_eq!(evicting.len(), 1, "{evicting:?}");
    assert!(evicting[0].name.contains("evicts keys"), "{evicting:?}");
    assert_eq!(evicting[0].field("policy"), Some("volatile-lru"));
    assert!(warnings("noeviction").is_empty());
}

/// A Redlock node that may evict keys can evict its vote for a held lock — one node less for
/// the next taker's majority: connecting to Redlock warns for such a node as for one server.
/// (Its nodes were not checked.)
#[test]
fn a_redlock_node_that_evicts_keys_is_a_warning() {
    let server = RedisServer::start();
    let warnings = |policy| {
        warnings_at_connect(&server, policy, async |url| {
            let url = url.replacen("redis://", "redlock://", 1);
            Locker::builder().connect(&url).await.unwrap();
        })
    };
    let evicting = warnings("volatile-ttl");
    assert_eq!(evicting.len(), 1, "{evicting:?}");
    assert!(evicting[0].name.contains("evicts keys"), "{evicting:?}");
    assert_eq!(evicting[0].field("policy"), Some("volatile-ttl"));
    assert!(warnings("noeviction").is_empty());
}

/// A durable job queue on a Redis that may evict keys can lose queued jobs, their claims and
/// the records that keep a resent enqueue from queueing twice, without an error: connecting
/// the queue to one whose `maxmemory-policy` is not `noeviction` is one `WARN` naming the
/// policy and the queue (the queue may be on a Redis no locker connects to); with
/// `noeviction`, none.
#[test]
fn a_job_queue_on_a_redis_that_evicts_keys_is_a_warning() {
    let server = RedisServer::start();
    let warnings = |policy| {
        warnings_at_connect(&server, policy, async |url| {
            dlock_runtime::durable::DurableQueue::connect(url, "evicting")
                .await
                .unwrap();
        })
    };
    let evicting = warnings("allkeys-lru");
    assert_eq!(evicting.len(), 1, "{evicting:?}");
    assert!(evicting[0].name.contains("evicts keys"), "{evicting:?}");
    assert!(evicting[0].name.contains("job queue"), "{evicting:?}");
    assert_eq!(evicting[0].field("policy"), Some("allkeys-lru"));
    assert_eq!(evicting[0].field("queue"), Some("evicting"));
    assert!(warnings("noeviction").is_empty());
}

// ---- Prometheus over HTTP ----

/// The Prometheus exporter's text, served by a real HTTP server and scraped with a real client,
/// after locks taken on a real Redis: dlock's names, labels, help texts and values.
#[test]
fn prometheus_scrapes_dlock_metrics_over_http() {
    use http_body_util::{BodyExt as _, Empty};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let server = RedisServer::start();
    let url = server.url();
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let text = metrics::with_local_recorder(&recorder, || {
        runtime().block_on(async move {
            dlock_runtime::metrics::describe();
            let app = axum::Router::new().route(
                "/metrics",
                axum::routing::get(move || std::future::ready(handle.render())),
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(axum::serve(listener, app).into_future());

            let locker = Locker::from_url(&url).await.unwrap();
            for n in 0..3 {
                let guard = locker
                    .lock(format!("report:{n}"))
                    .name("report")
                    .acquire()
                    .await;
                guard.unwrap().release().await.unwrap();
            }
            let held = locker
                .lock("report:0")
                .name("report")
                .acquire()
                .await
                .unwrap();
            assert!(locker
                .lock("report:0")
                .name("report")
                .try_acquire()
                .await
                .unwrap()
                .is_none());

            let client =
                Client::builder(TokioExecutor::new()).build_http::<Empty<hyper::body::Bytes>>();
            let req = hyper::Request::get(format!("http://{addr}/metrics"))
                .body(Empty::new())
                .unwrap();
            let res = client.request(req).await.unwrap();
            assert_eq!(res.status(), 200);
            held.release().await.unwrap();
            let body = res.into_body().collect().await.unwrap().to_bytes();
            String::from_utf8(body.to_vec()).unwrap()
        })
    });
    let lines: Vec<&str> = text.lines().collect();
    let has = |line: &str| lines.contains(&line);
    for line in [
        "# TYPE dlock_acquire_total counter",
        "# HELP dlock_acquire_total Lock requests by outcome.",
        r#"dlock_acquire_total{backend="redis",name="report",outcome="acquired"} 4"#,
        r#"dlock_acquire_total{backend="redis",name="report",outcome="contended"} 1"#,
        r#"dlock_acquire_attempts_total{backend="redis",name="report"} 5"#,
        "# TYPE dlock_locks_held gauge",
        // Scraped while one lock was held.
        r#"dlock_locks_held{backend="redis",name="report"} 1"#,
        "# TYPE dlock_hold_seconds summary",
        r#"dlock_hold_seconds_count{backend="redis",name="report"} 3"#,
        r#"dlock_acquire_wait_seconds_count{backend="redis",name="report"} 4"#,
    ] {
        assert!(has(line), "missing `{line}` in:\n{text}");
    }
    assert!(!text.contains("report:"), "a key became a label:\n{text}");
}
