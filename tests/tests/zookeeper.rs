//! ZooKeeper (`zk://`): the conformance suite on one real standalone server started once for
//! this binary (`dlock_tests::zookeeper_server::shared`), URL and chroot checks, session expiry
//! through a cut proxy, a backend outliving the runtime it started on, then fault tests on one
//! 3-server ensemble shared by them.

use dlock_runtime::backend::{ZkBackend, ZkOptions};
use dlock_runtime::conformance::Store;
use dlock_tests::zookeeper_server;

/// The conformance checks share the machine's two cores with no ensemble: they hold this for
/// reading, a fault test (which starts, kills and freezes JVMs) for writing. A check of 500 ms
/// leases must not run while three JVMs start.
static CPU: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn zk_store() -> (std::sync::RwLockReadGuard<'static, ()>, Store) {
    let shared_cpu = CPU
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let url = zookeeper_server::shared().lock().unwrap().url();
    let for_break = url.clone();
    let mut store = Store::new(
        "zookeeper",
        move |b| {
            let url = url.clone();
            Box::pin(async move { b.connect(&url).await.expect("connect") })
        },
        move |resource| {
            let url = for_break.clone();
            Box::pin(async move {
                let backend = ZkBackend::connect(&url, ZkOptions::default())
                    .await
                    .expect("connect");
                let n = backend.delete_lock(&resource).await.expect("delete");
                assert!(n >= 1, "no lock nodes for {resource}");
            })
        },
    );
    store.idempotency = false;
    // ZooKeeper has no semaphores and read-write locks yet: the conformance checks assert the
    // typed refusal.
    store.kinds = false;
    store.admin = true;
    (shared_cpu, store)
}

// The `CPU` read guard lives across each check's awaits on purpose: every check runs on its
// own runtime's `block_on` (one thread), and it only orders checks against the fault tests.
#[allow(clippy::await_holding_lock)]
mod conformance {
    dlock_runtime::conformance_tests!(super::zk_store);
}

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use dlock_runtime::{LockKey, Locker, OnFail, RetryPolicy};
use dlock_tests::proxy::Proxy;
use dlock_tests::redis_server::on_owner_thread;
use dlock_tests::wait::{poll_until, refused_at_once, try_take, wait_for};
use dlock_tests::zookeeper_server::ZkEnsemble;

const COMMAND_TIMEOUT: Duration = Duration::from_millis(2000);

/// The 3-server ensemble the fault tests share (started once: a JVM takes seconds), one test at
/// a time; each test leaves every server running and serving.
fn ensemble() -> &'static tokio::sync::Mutex<ZkEnsemble> {
    static ENSEMBLE: OnceLock<tokio::sync::Mutex<ZkEnsemble>> = OnceLock::new();
    ENSEMBLE.get_or_init(|| {
        tokio::sync::Mutex::new(on_owner_thread(
            "zk-ensemble-owner",
            ZkEnsemble::start_ensemble,
        ))
    })
}

/// The ensemble, locked for one test and healed when the test ends (passed or failed), so that
/// a failing test leaves no server frozen or dead for the next; the conformance checks wait
/// meanwhile ([`CPU`]).
struct Faults {
    zk: tokio::sync::MutexGuard<'static, ZkEnsemble>,
    _cpu: std::sync::RwLockWriteGuard<'static, ()>,
}

impl Faults {
    async fn take() -> Self {
        let zk = ensemble().lock().await;
        let cpu = tokio::task::block_in_place(|| {
            CPU.write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        });
        Faults { zk, _cpu: cpu }
    }
}

impl std::ops::Deref for Faults {
    type Target = ZkEnsemble;
    fn deref(&self) -> &ZkEnsemble {
        &self.zk
    }
}

impl std::ops::DerefMut for Faults {
    fn deref_mut(&mut self) -> &mut ZkEnsemble {
        &mut self.zk
    }
}

impl Drop for Faults {
    fn drop(&mut self) {
        self.zk.heal();
    }
}

async fn locker(url: &str) -> Locker {
    Locker::builder()
        .command_timeout(COMMAND_TIMEOUT)
        .connect(url)
        .await
        .expect("connect to ZooKeeper")
}

/// An ensemble that refuses for good — an ACL on the lock root that lets this client read but
/// not create — answers `Misconfigured` (500), not `Unavailable` (503), at connect when the
/// root cannot be made and at each lock when it exists: a wait through outages ends with it
/// at once instead of retrying until its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_for_good_is_misconfigured_and_ends_a_wait_through_outages_at_once() {
    use zookeeper_client::{Acls, CreateMode};
    let url = zookeeper_server::shared().lock().unwrap().url();
    let raw = zookeeper_client::Client::connect(url.trim_start_matches("zk://"))
        .await
        .expect("a raw client");
    let chroot = format!("/refused-{}", std::process::id());
    let read_only = CreateMode::Persistent.with_acls(Acls::anyone_read());
    raw.create(&chroot, b"", &read_only)
        .await
        .expect("the read-only chroot");
    let err = Locker::builder()
        .command_timeout(COMMAND_TIMEOUT)
        .connect(&format!("{url}{chroot}"))
        .await
        .unwrap_err();
    assert!(err.is_misconfigured(), "{err}");

    // The lock root exists, and lets this client read only.
    let chroot = format!("{chroot}-root");
    raw.create(
        &chroot,
        b"",
        &CreateMode::Persistent.with_acls(Acls::anyone_all()),
    )
    .await
    .expect("the chroot");
    raw.create(&format!("{chroot}/dlock"), b"", &read_only)
        .await
        .expect("the read-only lock root");
    let locker = locker(&format!("{url}{chroot}")).await;
    refused_at_once(&locker, "refused:k").await;
}

/// Bad URLs are refused with a typed error naming the problem, before any connection.
#[tokio::test]
async fn bad_urls_are_typed_errors() {
    for url in ["zk://", "zk://127.0.0.1:1/a//b", "zk://127.0.0.1:x"] {
        let err = Locker::from_url(url).await.expect_err(url);
        assert!(err.is_misconfigured(), "{url}: {err}");
        assert!(err.to_string().contains("invalid ZooKeeper URL"), "{err}");
    }
}

/// A chroot in the URL keeps lockers apart: the same key under two chroots is two locks, and
/// under one chroot one lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chroot_is_a_separate_lock_space() {
    let url = zookeeper_server::shared().lock().unwrap().url();
    let a = locker(&format!("{url}/tenant-a")).await;
    let a2 = locker(&format!("{url}/tenant-a/")).await;
    let b = locker(&format!("{url}/tenant-b")).await;
    let g = a.lock("same").try_acquire().await.unwrap().expect("free");
    assert!(a2.lock("same").try_acquire().await.unwrap().is_none());
    let other = b.lock("same").try_acquire().await.unwrap();
    assert!(other.is_some(), "another chroot shares the lock");
    g.release().await.unwrap();
}

/// Breaking a lock ([`ZkBackend::delete_lock`]) deletes its waiters' nodes before its holder's.
/// A waiter's watch fires when the node before it goes, so deleting the holder's first let the
/// next waiter take the lock and then lose its node to the same break: a holder whose node
/// vanished (an election's new leader whose `resign` answered `Lost`, once in about 70 runs of
/// the conformance suite). A recursive watch on the lock's directory sees the deletions in the
/// order the server applied them; afterwards every waiter gets the lock in turn, with a greater
/// fencing token, and releases it as its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaking_a_lock_deletes_its_waiters_before_its_holder() {
    let url = zookeeper_server::shared().lock().unwrap().url();
    let key = format!("break-order-{}", std::process::id());
    let holder = locker(&url).await;
    let held = holder
        .lock(key.as_str())
        .ttl(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    let resource = holder.resource(LockKey::new(&key).unwrap());
    // The key has no character the backend encodes: the node name is the resource string.
    let dir = format!("/dlock/{}", resource.as_str());
    let mut waiters = Vec::new();
    for _ in 0..3 {
        let w = locker(&url).await;
        let key = key.clone();
        waiters.push(tokio::spawn(async move {
            let policy = RetryPolicy::new(Duration::from_secs(30));
            let g = w
                .lock(key.as_str())
                .ttl(Duration::from_secs(3))
                .on_fail(OnFail::Retry(policy))
                .acquire()
                .await
                .expect("a waiter gets the lock after the break");
            let token = g.fencing_token();
            g.release().await.expect("the lock is its own to release");
            token
        }));
    }
    let raw = zookeeper_client::Client::connect(url.trim_start_matches("zk://"))
        .await
        .expect("a raw client");
    let listed = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(10),
        async || {
            let mut kids = raw.list_children(&dir).await.map_err(|e| e.to_string())?;
            if kids.len() < 4 {
                return Err(format!("{} of 4 nodes queued", kids.len()));
            }
            kids.sort_by_key(|k| k.rsplit_once('-').map(|(_, seq)| seq.to_owned()));
            Ok(kids)
        },
    )
    .await;
    let mut events = raw
        .watch(&dir, zookeeper_client::AddWatchMode::PersistentRecursive)
        .await
        .expect("a recursive watch");
    let breaker = ZkBackend::connect(&url, ZkOptions::default())
        .await
        .unwrap();
    assert_eq!(breaker.delete_lock(resource.as_str()).await.unwrap(), 4);
    let holder_node = format!("{dir}/{}", listed[0]);
    let mut deleted = Vec::new();
    while deleted.last() != Some(&holder_node) {
        let event = tokio::time::timeout(Duration::from_secs(10), events.changed())
            .await
            .expect("the holder's node is deleted");
        if event.event_type == zookeeper_client::EventType::NodeDeleted {
            deleted.push(event.path);
        }
    }
    for waiter in &listed[1..] {
        assert!(
            deleted.contains(&format!("{dir}/{waiter}")),
            "the holder's node went before the waiter's {waiter}: {deleted:?}"
        );
    }
    tokio::time::timeout(Duration::from_secs(10), held.lost())
        .await
        .expect("the broken holder is told");
    for w in waiters {
        let token = w.await.unwrap();
        assert!(token > held.fencing_token());
    }
}

/// A lock released within its minimum hold is left to its lease (the release cuts the lease to
/// the hold's rest), and an ephemeral node has no expiry of its own: on a lock nobody tries
/// again, the node stayed on the server, and in the backend's record of its own nodes, for the
/// life of the session (a leak per run of a scheduled job keyed by its date). The backend now
/// deletes it a session timeout after its lease ended, at the next write it makes; not before:
/// until the hold has passed, another locker is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_left_to_its_lease_is_deleted_by_its_owner_after_the_lease() {
    let url = zookeeper_server::shared().lock().unwrap().url();
    let session = Duration::from_millis(1500);
    let backend = with_session(&url, session).await;
    let a = Locker::builder().build(backend.clone());
    let key = format!("swept-{}", std::process::id());
    let hold = Duration::from_millis(300);
    let g = a
        .lock(key.as_str())
        .ttl(Duration::from_secs(2))
        .hold_at_least(hold)
        .acquire()
        .await
        .unwrap();
    let released = Instant::now();
    g.release().await.unwrap();
    let dir = format!(
        "/dlock/{}",
        a.resource(LockKey::new(&key).unwrap()).as_str()
    );
    let raw = zookeeper_client::Client::connect(url.trim_start_matches("zk://"))
        .await
        .expect("a raw client");
    assert_eq!(
        raw.list_children(&dir).await.unwrap().len(),
        1,
        "left to its lease"
    );
    assert_eq!(backend.own_nodes(), 1);
    let b = locker(&url).await;
    if released.elapsed() < hold - Duration::from_millis(100) {
        assert!(
            b.lock(key.as_str()).try_acquire().await.unwrap().is_none(),
            "taken within the minimum hold"
        );
    }
    // Locks on other keys are the backend's next writes; one of them sweeps.
    let mut n = 0;
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || {
            n += 1;
            let other = a
                .lock(format!("{key}-other-{n}"))
                .ttl(Duration::from_secs(2))
                .acquire()
                .await
                .unwrap();
            other.release().await.unwrap();
            match raw.list_children(&dir).await {
                Err(zookeeper_client::Error::NoNode) => Ok(()),
                Ok(kids) if kids.is_empty() => Ok(()),
                Ok(kids) => Err(format!("still there: {kids:?}")),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await;
    let gone = released.elapsed();
    // The hold's rest counts from the acquire, just before the release.
    assert!(
        gone >= session + hold / 2,
        "deleted {gone:?} after the release"
    );
    assert_eq!(backend.own_nodes(), 0, "records of own nodes are left");
}

/// A lock's directory goes once the lock is left alone: a backend deletes a directory it
/// left (a release, a try that found the lock held) a second later, at its next release or try.
/// Many distinct keys (a lock per order id) held at once, then released: none of their
/// directories is left within 3 s. Before, only the child was deleted and the directory, a
/// container node, was left to the server's cleanup, which runs every
/// `znode.container.checkIntervalMs` (60 s by default, 1 s on the test server) and deletes at
/// most `znode.container.maxPerMinute` (10,000) a minute, one every 6 ms (1,000 take 6 s): at
/// 1,000 new keys a second, 50,000 more directories every minute, without bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locks_directory_goes_once_the_lock_is_left_alone() {
    const KEYS: usize = 1000;
    let url = zookeeper_server::shared().lock().unwrap().url();
    // A lock space of this test's own: its lock root holds only its keys.
    let chroot = format!("/tidy-{}", std::process::id());
    let (_backend, l) = zk_locker(&format!("{url}{chroot}")).await;
    let raw = raw_client(&url).await;
    let root = format!("{chroot}/dlock");
    let ttl = Duration::from_secs(20);
    let guards = futures_util::future::try_join_all(
        (0..KEYS).map(|i| l.lock(format!("order-{i}")).ttl(ttl).acquire()),
    )
    .await
    .unwrap();
    assert_eq!(raw.list_children(&root).await.unwrap().len(), KEYS);
    futures_util::future::try_join_all(guards.into_iter().map(|g| g.release()))
        .await
        .unwrap();
    let released = Instant::now();
    // A try of one more key every 100 ms (its own directory comes and stays: it is used).
    poll_until(
        Duration::from_secs(3),
        Duration::from_millis(100),
        async || {
            assert!(l.lock("trigger").try_acquire().await.unwrap().is_some());
            match raw.list_children(&root).await.unwrap().len() {
                0 | 1 => Ok(()),
                left => Err(format!(
                    "{} of {KEYS} lock directories left {:?} after their locks were released",
                    left - 1,
                    released.elapsed()
                )),
            }
        },
    )
    .await;
    // Taken again: its directory is made again.
    let g = try_take(&l, "order-0", ttl).await.expect("free");
    g.release().await.unwrap();
}

/// A lock taken again and again by one backend keeps its directory: it is deleted only once
/// the lock is left alone, not on every release — which made every cycle delete the directory
/// and make it again, two more writes through the ensemble each time (0.55–0.6× the
/// uncontended pairs a second in `dlock-bench`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_taken_again_and_again_keeps_its_directory() {
    let url = zookeeper_server::shared().lock().unwrap().url();
    let l = locker(&url).await;
    let raw = raw_client(&url).await;
    let key = "hot-key";
    let ttl = Duration::from_secs(20);
    let dir = format!("/dlock/{}", l.resource(LockKey::new(key).unwrap()).as_str());
    let g = try_take(&l, key, ttl).await.expect("free");
    let made = raw
        .check_stat(&dir)
        .await
        .unwrap()
        .expect("its directory")
        .czxid;
    g.release().await.unwrap();
    for round in 0..20 {
        let g = try_take(&l, key, ttl).await.expect("free");
        let now = raw
            .check_stat(&dir)
            .await
            .unwrap()
            .expect("its directory")
            .czxid;
        assert_eq!(
            now, made,
            "round {round}: the directory was deleted and made again"
        );
        g.release().await.unwrap();
    }
}

/// The directory of a contended lock stays while waiters are queued in it, and nothing breaks
/// — each waiter is granted the lock in turn, with a greater fencing token — and once the lock
/// is left alone its directory goes; the lock works on after (its directory made again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contended_locks_directory_stays_while_waiters_are_queued() {
    let server = zookeeper_server::shared().lock().unwrap().url();
    let chroot = format!("/tidy-queued-{}", std::process::id());
    let url = format!("{server}{chroot}");
    let raw = raw_client(&server).await;
    let key = "contended";
    let ttl = Duration::from_secs(20);
    let holder = locker(&url).await;
    let held = holder.lock(key).ttl(ttl).acquire().await.unwrap();
    let dir = format!(
        "{chroot}/dlock/{}",
        holder.resource(LockKey::new(key).unwrap()).as_str()
    );
    let queued = async |n: usize| {
        poll_until(
            Duration::from_secs(10),
            Duration::from_millis(10),
            async || match raw.list_children(&dir).await {
                Ok(kids) if kids.len() == n => Ok(()),
                Ok(kids) => Err(format!("{} nodes, not {n}: {kids:?}", kids.len())),
                Err(e) => Err(format!("listing the lock's directory: {e}")),
            },
        )
        .await
    };
    // Two waiters, queued in this order; each says when it is granted, and releases when told.
    let mut waiters = Vec::new();
    for n in [2, 3] {
        let (granted_tx, granted) = tokio::sync::oneshot::channel();
        let (release, release_rx) = tokio::sync::oneshot::channel::<()>();
        let w = locker(&url).await;
        let task = tokio::spawn(async move {
            let g = w
                .lock(key)
                .ttl(ttl)
                .on_fail(OnFail::Retry(RetryPolicy::new(Duration::from_secs(30))))
                .acquire()
                .await
                .expect("a queued waiter is granted the lock");
            let _ = granted_tx.send(g.fencing_token());
            let _ = release_rx.await;
            g.release()
                .await
                .expect("the waiter's lock is its own to release");
        });
        queued(n).await;
        waiters.push((granted, release, task));
    }
    // A try finds the lock held; it deletes its own node, and its delete of the directory is
    // refused.
    let other = locker(&url).await;
    assert!(other.lock(key).try_acquire().await.unwrap().is_none());
    queued(3).await;

    let mut last = held.fencing_token();
    held.release().await.unwrap();
    for (i, (granted, release, task)) in waiters.into_iter().enumerate() {
        let token = tokio::time::timeout(Duration::from_secs(10), granted)
            .await
            .unwrap_or_else(|_| panic!("waiter {i} was not granted the lock within 10 s"))
            .expect("the waiter's task ended");
        assert!(token > last, "fencing: {token} after {last}");
        last = token;
        // The directory stays with the nodes of this holder and of the waiters behind it.
        queued(2 - i).await;
        release.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the waiter's release within 10 s")
            .unwrap();
    }
    // And the lock works on, also once its directory went (left alone, or by the server's
    // cleanup: it is made again).
    let g = try_take(&other, key, ttl).await.expect("free");
    g.release().await.unwrap();
    gone(&raw, &dir, &other).await;
    let g = try_take(&other, key, ttl).await.expect("free");
    g.release().await.unwrap();
}

/// Waits until the lock directory `dir` is gone: left alone for a second, it is deleted at
/// `locker`'s next release or try (one of another key is made every 100 ms here), within 5 s.
async fn gone(raw: &zookeeper_client::Client, dir: &str, locker: &Locker) {
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(100),
        async || {
            let _ = locker.lock("elsewhere").try_acquire().await.unwrap();
            match raw.check_stat(dir).await {
                Ok(None) => Ok(()),
                Ok(Some(stat)) => Err(format!(
                    "the lock's directory is left ({} children)",
                    stat.num_children
                )),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await;
}

/// A node of a token that the backend does not know of — made by an attempt whose answer was
/// lost and that was not found again, or left by a delete that failed — would hold the lock
/// (or the queue) for that token with nobody knowing: the token's next attempt deletes it and
/// is granted the lock (here the stray is lowest, so the lock was held by it meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stray_node_of_a_token_is_deleted_by_its_next_attempt() {
    use dlock_runtime::backend::{Attempt, Backend, OwnerToken, WaitMode};
    use dlock_runtime::conformance::attempt_as;
    let url = zookeeper_server::shared().lock().unwrap().url();
    let (backend, a) = zk_locker(&url).await;
    let b = locker(&url).await;
    let key = format!("stray-{}", std::process::id());
    let resource = a.resource(LockKey::new(&key).unwrap());
    let token = OwnerToken::generate();
    let ttl = Duration::from_secs(30);
    let ask = || attempt_as(&a, &resource, &token, WaitMode::Try, ttl);
    // The lock's directory is made with a first node.
    let first = ask().await.unwrap();
    assert!(matches!(first, Attempt::Acquired { .. }), "{first:?}");
    assert!(backend.release(&resource, &token).await.unwrap());
    let raw = raw_client(&url).await;
    let dir = format!("/dlock/{}", resource.as_str());
    // It went with the release; made again for the stray node.
    remake_dir(&raw, &dir).await;
    let opts = zookeeper_client::CreateMode::EphemeralSequential
        .with_acls(zookeeper_client::Acls::anyone_all());
    let stray = format!("{dir}/{}-", token.as_str());
    raw.create(&stray, b"30000", &opts)
        .await
        .expect("the stray node");
    assert!(
        b.lock(key.as_str()).try_acquire().await.unwrap().is_none(),
        "the stray node holds the lock"
    );
    let again = ask().await.unwrap();
    assert!(
        matches!(again, Attempt::Acquired { .. }),
        "the token was blocked by its own stray node: {again:?}"
    );
    assert_eq!(
        raw.list_children(&dir).await.unwrap().len(),
        1,
        "the stray node is left"
    );
    assert!(b.lock(key.as_str()).try_acquire().await.unwrap().is_none());
    assert!(backend.release(&resource, &token).await.unwrap());
    let free = b.lock(key.as_str()).try_acquire().await.unwrap();
    free.expect("free once released").release().await.unwrap();
}

/// A try by a token that already has a node in the queue (a barging waiter asking again after
/// an answer was lost) judges the holder by the ensemble's time like any attempt: it reports
/// the holder's lease left, not the lease counted from the epoch — and, as a try, leaves
/// nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_by_a_queued_token_reports_the_holders_lease() {
    use dlock_runtime::backend::{Attempt, OwnerToken, WaitMode};
    use dlock_runtime::conformance::attempt_as;
    let url = zookeeper_server::shared().lock().unwrap().url();
    let (_, a) = zk_locker(&url).await;
    let key = format!("queued-try-{}", std::process::id());
    let ttl = Duration::from_secs(20);
    let held = a.lock(key.as_str()).ttl(ttl).acquire().await.unwrap();
    let resource = a.resource(LockKey::new(&key).unwrap());
    let token = OwnerToken::generate();
    let queued = attempt_as(&a, &resource, &token, WaitMode::Queue, ttl).await;
    assert!(matches!(queued, Ok(Attempt::Held { .. })), "{queued:?}");
    let tried = attempt_as(&a, &resource, &token, WaitMode::Try, ttl).await;
    assert_reports_the_holders_lease(tried, ttl);
    held.release().await.unwrap();
    let free = a.lock(key.as_str()).try_acquire().await.unwrap();
    free.expect("the try left its node in the queue")
        .release()
        .await
        .unwrap();
}

/// A holder whose connection is cut (behind a proxy that then refuses) cannot renew: its
/// guard reports `lost()` by the local lease clock — capped at the session timeout — before
/// the server expires the session and lets the next holder in, whose fencing token is greater.
/// When the network is back the locker opens a new session by itself and locks again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_holder_is_told_before_its_session_expires_and_is_fenced() {
    let server = zookeeper_server::shared().lock().unwrap().client_port(0);
    let url = zookeeper_server::shared().lock().unwrap().url();
    let proxy = Proxy::start(server).await.unwrap();
    let session = Duration::from_millis(1500);
    let holder = locker(&format!(
        "zk://127.0.0.1:{}?session_timeout_ms={}",
        proxy.port(),
        session.as_millis()
    ))
    .await;
    let next = locker(&url).await;
    // A TTL longer than the session: the local lease counts only the session timeout.
    let ttl = Duration::from_millis(2500);
    let old = holder.lock("expiry").ttl(ttl).acquire().await.unwrap();
    proxy.cut(true);
    let cut = Instant::now();
    tokio::time::timeout(session + Duration::from_millis(500), old.lost())
        .await
        .expect("a holder that could not reach ZooKeeper was not told within the session timeout");
    let told = cut.elapsed();
    let g = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        async || try_take(&next, "expiry", ttl).await,
    )
    .await;
    let taken = cut.elapsed();
    assert!(
        taken >= told,
        "the next holder got the lock ({taken:?}) before the old one was told ({told:?})"
    );
    assert!(
        g.fencing_token() > old.fencing_token(),
        "fencing: {} after {}",
        g.fencing_token(),
        old.fencing_token()
    );
    let err = old.release().await.unwrap_err();
    assert!(err.is_lost() || err.is_unavailable(), "{err}");
    g.release().await.unwrap();
    // The session expired meanwhile; once the network is back the locker starts a new one.
    proxy.allow();
    let again = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        async || try_take(&holder, "after-expiry", ttl).await,
    )
    .await;
    again.release().await.unwrap();
}

/// A TTL the session cannot carry (over twice the granted session timeout) is refused with a
/// typed error naming the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_beyond_the_session_is_refused() {
    let url = zookeeper_server::shared().lock().unwrap().url();
    let l = locker(&format!("{url}?session_timeout_ms=2000")).await;
    let err = l
        .lock("long")
        .ttl(Duration::from_secs(10))
        .try_acquire()
        .await
        .expect_err("a TTL of 5 sessions was taken");
    assert!(
        matches!(err, dlock_runtime::LockError::InvalidTtl { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("session timeout"), "{err}");

    // An extend to such a TTL is refused the same way, and changes nothing: the lock keeps
    // its lease and its renewals (it was taken, the local lease capped at the session, while
    // the renewals, due at a third of the new TTL, came after that: lost, the node kept).
    let guard = l
        .lock("long")
        .ttl(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    let err = guard.extend(Duration::from_secs(10)).await.unwrap_err();
    assert!(
        matches!(err, dlock_runtime::LockError::InvalidTtl { .. }),
        "{err}"
    );
    let lost = tokio::time::timeout(Duration::from_secs(4), guard.lost()).await;
    assert!(lost.is_err(), "the lock was lost after a refused extend");
    assert!(guard.is_held());
    guard.release().await.unwrap();
}

/// The leader is killed while a lock is held: the lock survives (still held, renewed, nobody
/// else can take it) and new acquires work again within an election and a client round.
///
/// Every client loses its connection when the leader dies (the followers drop theirs as they
/// start an election), and the client library comes back in rounds over the servers, due
/// about 0.3, 0.9, 2.1, 4.5 and 9.3 s after the drop: an election a little over 2 s brings the
/// clients back at 4.5 s. The held lock's lease, last renewed up to a third of it before the
/// kill, must cover that: a 6 s TTL (ending as early as 4 s after the kill) was lost once in
/// CI; 12 s covers elections up to 4.5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_kill_keeps_locks_and_acquires_keep_working() {
    let mut zk = Faults::take().await;
    let a = locker(&zk.url()).await;
    let b = locker(&zk.url()).await;
    let ttl = Duration::from_secs(12);
    let held = a.lock("held").ttl(ttl).acquire().await.unwrap();
    let leader = zk.wait_leader(Duration::from_secs(10));
    let renewed_before = a.renewals();
    zk.kill(leader);
    let killed = Instant::now();
    let g = poll_until(
        Duration::from_secs(20),
        Duration::from_millis(20),
        async || try_take(&b, "after", ttl).await,
    )
    .await;
    eprintln!("acquires back {:?} after the leader died", killed.elapsed());
    assert!(
        killed.elapsed() < Duration::from_secs(10),
        "acquires came back {:?} after the leader died",
        killed.elapsed()
    );
    assert!(g.fencing_token() > held.fencing_token());
    g.release().await.unwrap();
    // Renewed twice since the kill (through the new leader, the session moved to a live
    // server): the lock is still held, and nobody else can take it.
    wait_for("two renewals after the kill", ttl * 2, async || {
        (a.renewals() >= renewed_before + 2).then_some(())
    })
    .await;
    assert!(held.is_held(), "a lock was lost when the leader died");
    assert!(
        try_take(&b, "held", ttl).await.is_err(),
        "another locker took a lock that is still held"
    );
    held.release().await.unwrap();
    assert!(try_take(&b, "held", ttl).await.is_ok());
}

/// A raw client of the ensemble or server at `url` (`zk://…`), to look at what the backend
/// leaves in ZooKeeper.
async fn raw_client(url: &str) -> zookeeper_client::Client {
    zookeeper_client::Client::connect(url.trim_start_matches("zk://"))
        .await
        .expect("a raw client")
}

/// The epoch (the leader's term) a zxid was written in.
fn epoch(zxid: i64) -> i64 {
    zxid >> 32
}

/// Makes sure the lock directory `dir` is there, made as the backend makes it (a container
/// node), for a test that puts nodes in it by hand: a backend deletes a lock's directory it
/// left alone for a second, and the server's own cleanup of empty containers (every second on
/// the test server) may have deleted it.
async fn remake_dir(raw: &zookeeper_client::Client, dir: &str) {
    let opts =
        zookeeper_client::CreateMode::Container.with_acls(zookeeper_client::Acls::anyone_all());
    match raw.create(dir, &[], &opts).await {
        Ok(_) | Err(zookeeper_client::Error::NodeExists) => {}
        Err(e) => panic!("making the lock's directory {dir} again: {e}"),
    }
}

/// A holder's node left to its lease (`auto_renew(false)`, a short TTL) while the leader is
/// restarted: the node was last written under the old leader, whose wall clock stamped its
/// `mtime`. A contender in the new epoch does not judge that lease by the new leader's clock:
/// it starts the lease again (writes the node's data back, so the new leader stamps it) and
/// takes the lock a whole TTL after its first attempt — not before, and not never.
///
/// Before, a lease was judged by comparing the node's `mtime` with the contender's own write's,
/// stamped by different leaders after an election. Here the servers share one clock, so the
/// contender got the lock when the old lease ended by that clock — before a TTL had passed since
/// it first asked; with a new leader whose clock ran 50 ms ahead of the old one's, a waiter
/// deleted a live holder's node 50 ms early (the margin is 1 ms for TTLs up to ¾ of the session
/// timeout): two holders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_written_under_an_old_leader_is_started_again_not_judged_across_clocks() {
    let mut zk = Faults::take().await;
    let url = zk.url();
    let a = locker(&url).await;
    // Up to ¾ of the (30 s) session timeout: the lease margin is one millisecond.
    let ttl = Duration::from_secs(10);
    let key = "old-epoch";
    let held = a
        .lock(key)
        .ttl(ttl)
        .auto_renew(false)
        .acquire()
        .await
        .unwrap();
    let taken = Instant::now();
    let dir = format!("/dlock/{}", a.resource(LockKey::new(key).unwrap()).as_str());
    let raw = raw_client(&url).await;
    let kids = raw.list_children(&dir).await.unwrap();
    assert_eq!(kids.len(), 1, "{kids:?}");
    let node = format!("{dir}/{}", kids[0]);
    let (_, written) = raw.get_data(&node).await.unwrap();
    drop(raw);

    let leader = zk.wait_leader(Duration::from_secs(10));
    tokio::task::block_in_place(|| zk.restart(leader));
    let restarted = taken.elapsed();
    let raw = raw_client(&url).await;
    let probe = raw.set_data("/dlock", &[], None).await.unwrap();
    assert!(
        epoch(probe.mzxid) > epoch(written.mzxid),
        "restarting the leader made no new epoch: {:#x} then {:#x}",
        written.mzxid,
        probe.mzxid
    );
    let still = raw.check_stat(&node).await.unwrap();
    let still = still.expect("the holder's node went with the restart (its session expired?)");
    assert_eq!(
        still.mzxid, written.mzxid,
        "the holder's node was written since it was taken"
    );

    let b = locker(&url).await;
    let asked = Instant::now();
    let policy = RetryPolicy::new(ttl * 3).through_outages(true);
    let g = tokio::time::timeout(
        ttl * 3,
        b.lock(key)
            .ttl(ttl)
            .on_fail(OnFail::Retry(policy))
            .acquire(),
    )
    .await
    .expect("the contender was never granted the lock after the holder's restarted lease")
    .expect("the contender's wait failed");
    let granted = asked.elapsed();
    eprintln!(
        "leader restarted {restarted:?} into a {ttl:?} lease; the contender asked {:?} after \
         the lock was taken and was granted {granted:?} later",
        asked - taken
    );
    // The lease started again with the contender's first attempt, after `asked`: the next
    // holder is let in a whole TTL later (less the millisecond `mtime`s are counted in).
    assert!(
        granted + Duration::from_millis(20) >= ttl,
        "the contender was granted {granted:?} after it first asked in the new epoch, {:?} \
         after the lock was taken: the lease of a node written under the old leader was \
         judged by the new leader's clock, not started again ({ttl:?})",
        taken.elapsed()
    );
    // Judged again once the restarted lease ran out (a waiter asks again within its backoff,
    // at most 1 s): not held up for good.
    assert!(
        granted < ttl + Duration::from_secs(3),
        "the contender was granted {granted:?} after it first asked: long after the restarted \
         {ttl:?} lease"
    );
    assert!(g.fencing_token() > held.fencing_token());
    assert!(
        raw.check_stat(&node).await.unwrap().is_none(),
        "the holder's node is left"
    );
    g.release().await.unwrap();
    let _ = held.release().await;
}

/// One server of three frozen (SIGSTOP, a minority, not the leader): locks are taken, renewed
/// and released as before, with no error — a client connected to it moves to another server
/// within the connection timeout, inside one command timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn freezing_one_server_changes_nothing() {
    let mut zk = Faults::take().await;
    let leader = zk.wait_leader(Duration::from_secs(10));
    let follower = (leader + 1) % zk.len();
    let a = locker(&zk.url()).await;
    // A renewal on the frozen server waits out the connection timeout (0.67 s) and a move to
    // another server: a 4 s TTL leaves it room twice over.
    let held = a
        .lock("long")
        .ttl(Duration::from_secs(4))
        .acquire()
        .await
        .unwrap();
    zk.pause(follower);
    let renewed_before = a.renewals();
    for i in 0..20 {
        let g = a
            .lock(format!("k{}", i % 3))
            .ttl(Duration::from_secs(2))
            .try_acquire()
            .await
            .unwrap_or_else(|e| panic!("acquire {i} with one server frozen: {e}"))
            .expect("free");
        g.release()
            .await
            .unwrap_or_else(|e| panic!("release {i} with one server frozen: {e}"));
    }
    wait_for(
        "three renewals with one server frozen",
        Duration::from_secs(10),
        async || (a.renewals() >= renewed_before + 3).then_some(()),
    )
    .await;
    assert!(held.is_held(), "a renewal failed with one server frozen");
    held.release().await.unwrap();
}

/// Two servers of three frozen: no quorum. Requests fail with the typed 503 error within the
/// command timeout (never a hang); once the servers thaw, locks are taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_quorum_errors_are_typed_and_timely_then_recovery() {
    let mut zk = Faults::take().await;
    let a = locker(&zk.url()).await;
    let leader = zk.wait_leader(Duration::from_secs(10));
    let frozen = [(leader + 1) % 3, (leader + 2) % 3];
    for &i in &frozen {
        zk.pause(i);
    }
    for key in ["q1", "q2", "q3"] {
        let started = Instant::now();
        let err = a
            .lock(key)
            .ttl(Duration::from_secs(2))
            .try_acquire()
            .await
            .expect_err("a lock was granted without quorum");
        assert!(err.is_unavailable(), "{err}");
        assert_eq!(err.status(), 503);
        assert!(
            started.elapsed() < COMMAND_TIMEOUT * 2 + Duration::from_millis(500),
            "without quorum an acquire took {:?}",
            started.elapsed()
        );
    }
    for &i in &frozen {
        zk.resume(i);
    }
    let g = poll_until(
        Duration::from_secs(30),
        Duration::from_millis(50),
        async || try_take(&a, "q1", Duration::from_secs(2)).await,
    )
    .await;
    g.release().await.unwrap();
}

/// Every server killed for 10 s — long enough that the client's own reconnect rounds have
/// spaced out (it waits 0.3, 0.6, 1.2, 2.4, 4.8, 9.6 s … between rounds over three servers, the
/// next one due some 20 s in) — with requests going on and nothing held: once the ensemble
/// serves again, locks are taken at once, not at the client's next round seconds later. The
/// backend gave the stuck session, which carried nothing, up for a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_long_outage_locks_come_back_as_soon_as_the_ensemble_serves() {
    let mut zk = Faults::take().await;
    let (backend, a) = zk_locker(&zk.url()).await;
    let ttl = Duration::from_secs(2);
    let g = a.lock("outage").ttl(ttl).acquire().await.unwrap();
    g.release().await.unwrap();
    let before = backend.session_id();
    let killed = outage(&mut zk, &a, Duration::from_secs(10)).await;
    let serving = Instant::now();
    let g = poll_until(
        Duration::from_secs(30),
        Duration::from_millis(20),
        async || try_take(&a, "outage", ttl).await,
    )
    .await;
    let back = serving.elapsed();
    eprintln!(
        "locks back {back:?} after the ensemble served again ({:?} after the kill)",
        killed.elapsed()
    );
    // Usually tens of milliseconds; at most one command timeout more when a call in flight as
    // the servers came back waits it out before its stuck session is given up (2.03 s once,
    // under CI load). The client's own reconnect round came 10.7 s late.
    assert!(
        back < COMMAND_TIMEOUT + Duration::from_secs(2),
        "locks came back {back:?} after the ensemble served again ({:?} after the servers \
         were killed)",
        killed.elapsed()
    );
    assert_ne!(backend.session_id(), before, "the stuck session was kept");
    g.release().await.unwrap();
}

/// The same outage (shorter) with a lock held whose lease outlasts it: its session is kept —
/// given up, it would take the lock's node with it when it closes — so the lock stays held,
/// renewed once the client is back, and nobody else takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_whose_lease_outlasts_an_outage_keeps_its_session() {
    let mut zk = Faults::take().await;
    let (backend, a) = zk_locker(&zk.url()).await;
    let b = locker(&zk.url()).await;
    let ttl = Duration::from_secs(20);
    let held = a.lock("kept").ttl(ttl).acquire().await.unwrap();
    // Another locker holds the lock `outage` tries meanwhile, so that lock's directory stays:
    // a create sent during the outage lands in it once the servers are back.
    let blocker = b.lock("during").ttl(ttl).acquire().await.unwrap();
    let before = backend.session_id();
    outage(&mut zk, &a, Duration::from_secs(3)).await;
    // The client comes back by itself (at its next round) on the same session.
    let g = poll_until(
        Duration::from_secs(30),
        Duration::from_millis(50),
        async || try_take(&a, "other", Duration::from_secs(2)).await,
    )
    .await;
    g.release().await.unwrap();
    assert_eq!(
        backend.session_id(),
        before,
        "a session was given up while a lease on it was live"
    );
    // The tries made during the outage were answered 503 and undone in vain (no server):
    // their creates, kept by the client, were applied once it had a server again, queued
    // behind the blocker. Their nodes (a fresh lease each, no guard) are deleted then, by
    // their owner — nothing else would, short of another attempt on that lock.
    let dir = format!(
        "/dlock/{}",
        a.resource(LockKey::new("during").unwrap()).as_str()
    );
    let raw = zookeeper_client::Client::connect(zk.url().trim_start_matches("zk://"))
        .await
        .expect("a raw client");
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        async || {
            let kids = match raw.list_children(&dir).await {
                Ok(kids) => kids,
                Err(zookeeper_client::Error::NoNode) => return Ok(()),
                Err(e) => return Err(e.to_string()),
            };
            let mut left = 0;
            for kid in &kids {
                let stat = raw.check_stat(&format!("{dir}/{kid}")).await;
                if let Ok(Some(stat)) = stat {
                    left += usize::from(stat.ephemeral_owner == before);
                }
            }
            match left {
                0 => Ok(()),
                n => Err(format!(
                    "{n} nodes of the outage's tries left on the session"
                )),
            }
        },
    )
    .await;
    assert!(held.is_held(), "the lock was lost");
    assert!(
        try_take(&b, "kept", ttl).await.is_err(),
        "another locker took a lock that is still held"
    );
    held.release().await.unwrap();
    blocker.release().await.unwrap();
}

/// A locker on a backend the test can look into.
/// A backend on the server at `url` whose session has the timeout `session` (asked for in the
/// URL; the server must grant it as asked: its minimum is lower).
async fn with_session(url: &str, session: Duration) -> ZkBackend {
    let backend = ZkBackend::connect(
        &format!("{url}?session_timeout_ms={}", session.as_millis()),
        ZkOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(
        backend.session_timeout(),
        session,
        "the server's minimum is lower"
    );
    backend
}

/// `tried` — a try on a lock held with a lease of `ttl` — answered "held" with the holder's
/// lease left, at most `ttl` (judged by the ensemble's time, not counted from the epoch).
fn assert_reports_the_holders_lease(
    tried: Result<dlock_runtime::backend::Attempt, dlock_runtime::LockError>,
    ttl: Duration,
) {
    let Ok(dlock_runtime::backend::Attempt::Held {
        remaining: Some(left),
    }) = tried
    else {
        panic!("{tried:?}");
    };
    assert!(
        left <= ttl,
        "the holder has {left:?} left of a {ttl:?} lease"
    );
}

async fn zk_locker(url: &str) -> (ZkBackend, Locker) {
    let backend = ZkBackend::connect(url, ZkOptions::default().command_timeout(COMMAND_TIMEOUT))
        .await
        .expect("connect to ZooKeeper");
    let locker = Locker::builder()
        .command_timeout(COMMAND_TIMEOUT)
        .build(backend.clone());
    (backend, locker)
}

/// Kills every server for `down`, with `a` trying a lock every 100 ms meanwhile (each try
/// fails with the typed 503 in time), then brings them all back and returns once they serve.
/// Returns when the servers were killed.
async fn outage(zk: &mut Faults, a: &Locker, down: Duration) -> Instant {
    for i in 0..zk.len() {
        zk.kill(i);
    }
    let killed = Instant::now();
    while killed.elapsed() < down {
        let started = Instant::now();
        assert!(
            try_take(a, "during", Duration::from_secs(2)).await.is_err(),
            "a lock was granted with every server dead"
        );
        assert!(started.elapsed() < COMMAND_TIMEOUT * 2 + Duration::from_millis(500));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::task::block_in_place(|| zk.heal());
    killed
}

/// Nothing listens at the URL: connecting fails with the typed 503 error within the command
/// timeout, never a hang.
#[tokio::test]
async fn unreachable_zookeeper_is_unavailable_in_time() {
    let port = dlock_tests::redis_server::free_port();
    let started = Instant::now();
    let err = Locker::builder()
        .command_timeout(COMMAND_TIMEOUT)
        .connect(&format!("zk://127.0.0.1:{port}"))
        .await
        .expect_err("connected to no server");
    assert!(err.is_unavailable(), "{err}");
    assert_eq!(err.status(), 503);
    assert!(
        started.elapsed() < COMMAND_TIMEOUT + Duration::from_millis(500),
        "an unreachable ZooKeeper took {:?} to report",
        started.elapsed()
    );
}

/// A locker built on a runtime that then shuts down (an actix-web worker restarting, a runtime
/// built for set-up and dropped) keeps serving its waiters on the other runtimes, each woken by
/// the release before it: one queued while that runtime ran, and one that starts waiting after.
/// The ZooKeeper client ran the session in a task on the first runtime; with the task gone, the
/// client still said `SyncConnected` while every call failed (503, ending every wait at once),
/// and a watch awaited on another runtime panicked in the client, so the waiter queued before
/// was told nothing. The backend now resumes the same session on another runtime (its nodes,
/// so the waiters' places in the queue, kept) and wakes its waiters to watch again.
///
/// Every fallback timer of the waiters is 20 s or more away (backoff and refresh interval set
/// long): getting the lock sooner is the release's doing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_woken_by_releases_after_the_runtime_that_built_their_locker_shut_down() {
    let url = zookeeper_server::shared().lock().unwrap().url();
    let key = format!("first-runtime-{}", std::process::id());
    // Twice the granted session timeout (30 s): the waiters refresh their place every 20 s.
    let ttl = Duration::from_secs(60);
    let (built_tx, built_rx) = tokio::sync::oneshot::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let first = std::thread::spawn({
        let url = url.clone();
        move || {
            let first = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            first.block_on(async move {
                let backend = ZkBackend::connect(&url, ZkOptions::default())
                    .await
                    .expect("connect to ZooKeeper");
                let locker = Locker::builder()
                    .command_timeout(COMMAND_TIMEOUT)
                    .waiter_ttl(ttl)
                    .build(backend.clone());
                let _ = built_tx.send((backend, locker));
                let _ = stop_rx.await;
            });
            // Shut down, with the session's task and whatever the backend started on it.
            drop(first);
        }
    });
    let (backend, a) = built_rx.await.expect("the first runtime's thread");
    let session = backend.session_id();
    let b = locker(&url).await;
    let holder = b.lock(key.as_str()).ttl(ttl).acquire().await.unwrap();
    let wait = |n: u32| {
        let (a, key) = (a.clone(), key.clone());
        let policy = RetryPolicy::new(ttl).backoff(ttl, ttl).jitter(false);
        tokio::spawn(async move {
            a.lock(key.as_str())
                .ttl(ttl)
                .on_fail(OnFail::Retry(policy))
                .acquire()
                .await
                .unwrap_or_else(|e| panic!("waiter {n}: {e}"))
        })
    };
    let first_waiter = wait(1);
    // Queued, watching and asleep: no call of it on its way when the runtime shuts down.
    wait_for(
        "the first waiter to sleep",
        Duration::from_secs(10),
        async || (backend.watching() == 1 && a.waiting() == 1).then_some(()),
    )
    .await;
    stop_tx.send(()).unwrap();
    tokio::task::spawn_blocking(move || first.join())
        .await
        .unwrap()
        .expect("the first runtime's thread");
    // Every waiter's timer is due 20 s or more after this.
    let shut = Instant::now();
    let second_waiter = wait(2);
    wait_for(
        "both waiters to watch on the session resumed",
        Duration::from_secs(10),
        async || (backend.watching() == 2 && a.waiting() == 2).then_some(()),
    )
    .await;
    assert_eq!(backend.session_id(), session, "the session was not resumed");
    holder.release().await.unwrap();
    let g1 = tokio::time::timeout(Duration::from_secs(15), first_waiter)
        .await
        .expect("the first waiter was not woken by the release")
        .unwrap();
    let first_token = g1.fencing_token();
    g1.release().await.unwrap();
    let g2 = tokio::time::timeout(Duration::from_secs(15), second_waiter)
        .await
        .expect("the second waiter was not woken by the release")
        .unwrap();
    let woken = shut.elapsed();
    assert!(
        woken < Duration::from_secs(15),
        "the waiters got the lock {woken:?} after the runtime shut down: by their timers"
    );
    assert!(g2.fencing_token() > first_token);
    g2.release().await.unwrap();
}

/// A session whose task went with the runtime it ran on is resumed on the next call, and used
/// once its server synced with the leader. When the client lost its server right after the
/// resume answered, for longer than the session timeout, the session expired unsynced — and
/// every later call tried to sync it again, which fails at once ("session expired"), so the
/// backend answered 503 for as long as the process ran. It now opens a new session, as when
/// the resume itself finds the session expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_session_that_expires_before_it_is_synced_is_replaced() {
    let server = zookeeper_server::shared().lock().unwrap().client_port(0);
    let url = zookeeper_server::shared().lock().unwrap().url();
    let proxy = Proxy::start(server).await.unwrap();
    let key = format!("unsynced-{}", std::process::id());
    let timeout = Duration::from_millis(500);
    // Long enough that the resume below comes well before the server expires the session of
    // the runtime that shut down.
    let session = Duration::from_secs(4);
    let proxied = format!(
        "zk://127.0.0.1:{}?session_timeout_ms={}",
        proxy.port(),
        session.as_millis()
    );
    // Made on a runtime of its own, which shuts down with the session's task; the lock it took
    // (not renewed, its lease longer than the test needs) goes only with the session.
    let (backend, held, dir) = tokio::task::spawn_blocking({
        let key = key.clone();
        move || {
            let first = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            let made = first.block_on(async move {
                let backend =
                    ZkBackend::connect(&proxied, ZkOptions::default().command_timeout(timeout))
                        .await
                        .expect("connect to ZooKeeper");
                let locker = Locker::builder()
                    .command_timeout(timeout)
                    .build(backend.clone());
                let held = locker
                    .lock(key.as_str())
                    .ttl(session * 2)
                    .auto_renew(false)
                    .acquire()
                    .await
                    .unwrap();
                let dir = format!(
                    "/dlock/{}",
                    locker.resource(LockKey::new(&key).unwrap()).as_str()
                );
                (backend, held, dir)
            });
            drop(first);
            made
        }
    })
    .await
    .unwrap();
    let expired = backend.session_id();
    let a = Locker::builder()
        .command_timeout(timeout)
        .build(backend.clone());
    // The resume's answers (the session's, then its first ping's) get through; then the client
    // has no server.
    proxy.cut_after_replies(2);
    let err = a
        .lock("unsynced-probe")
        .ttl(timeout)
        .try_acquire()
        .await
        .expect_err("a lock taken on a session its server never synced");
    assert!(err.is_unavailable(), "{err}");
    assert_eq!(backend.session_id(), expired, "the session was not resumed");
    // The server expires the session: its node goes.
    let raw = zookeeper_client::Client::connect(url.trim_start_matches("zk://"))
        .await
        .expect("a raw client");
    poll_until(session * 3, Duration::from_millis(50), async || {
        match raw.list_children(&dir).await {
            Ok(nodes) if nodes.is_empty() => Ok(()),
            Err(zookeeper_client::Error::NoNode) => Ok(()),
            Ok(nodes) => Err(format!("the lock's nodes are still there: {nodes:?}")),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    proxy.allow();
    let g = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        async || match a.lock("unsynced-probe").ttl(timeout).try_acquire().await {
            Ok(Some(g)) => Ok(g),
            Ok(None) => Err("held".to_owned()),
            Err(e) => Err(e.to_string()),
        },
    )
    .await;
    assert_ne!(backend.session_id(), expired);
    g.release().await.unwrap();
    // The lock taken on the expired session is gone with it.
    assert!(held.release().await.is_err());
}

/// A backend whose session goes through a `proxy` (session timeout 10 s, command timeout
/// `timeout`), and a lock `key` (in `dir`) that another locker holds (`blocker`), so that its
/// directory stays and the nodes of attempts land behind it.
struct CutOff {
    url: String,
    proxy: Proxy,
    backend: ZkBackend,
    timeout: Duration,
    key: String,
    dir: String,
    blocker: dlock_runtime::LockGuard,
    _holder: Locker,
}

/// A client straight to the ensemble at `url`, and a recursive watch on `dir` through it.
async fn watching(
    url: &str,
    dir: &str,
) -> (
    zookeeper_client::Client,
    zookeeper_client::PersistentWatcher,
) {
    let raw = zookeeper_client::Client::connect(url.trim_start_matches("zk://"))
        .await
        .expect("a raw client");
    let events = raw
        .watch(dir, zookeeper_client::AddWatchMode::PersistentRecursive)
        .await
        .expect("a recursive watch");
    (raw, events)
}

async fn behind_a_proxy(tag: &str) -> CutOff {
    let server = zookeeper_server::shared().lock().unwrap().client_port(0);
    let url = zookeeper_server::shared().lock().unwrap().url();
    let proxy = Proxy::start(server).await.unwrap();
    let timeout = Duration::from_millis(500);
    let backend = ZkBackend::connect(
        &format!("zk://127.0.0.1:{}?session_timeout_ms=10000", proxy.port()),
        ZkOptions::default().command_timeout(timeout),
    )
    .await
    .expect("connect to ZooKeeper");
    let key = format!("{tag}-{}", std::process::id());
    let holder = locker(&url).await;
    let blocker = holder
        .lock(key.as_str())
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let dir = format!(
        "/dlock/{}",
        holder.resource(LockKey::new(&key).unwrap()).as_str()
    );
    CutOff {
        url,
        proxy,
        backend,
        timeout,
        key,
        dir,
        blocker,
        _holder: holder,
    }
}

/// Cuts `backend`'s session off at `proxy`: from then on its client keeps requests until it
/// has a server again.
async fn cut(proxy: &Proxy, backend: &ZkBackend) {
    proxy.cut(true);
    wait_for(
        "the client to see the cut",
        Duration::from_secs(10),
        async || (!backend.connected()).then_some(()),
    )
    .await;
}

/// An undo that got no answer (the client had no server) is settled by the backend's one task
/// for such attempts, which deletes the attempt's node once the client, back, has sent the
/// `create` it kept. That task ran on the runtime of the undo; when that runtime shut down, the
/// task went with it, and its "running" flag stayed up: no undo was settled again, and the node
/// stayed for the life of the session. The task now moves to the fallback thread.
///
/// The session runs on this test's runtime, through a proxy that cuts it off; the try, its undo
/// (the locker's one background try: the TTL is shorter than the command timeout) and so the
/// task run on a runtime of their own, shut down before the proxy lets the client through
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_undo_is_settled_after_the_runtime_it_was_noted_on_shut_down() {
    let CutOff {
        url,
        proxy,
        backend,
        timeout,
        key,
        dir,
        blocker,
        _holder,
    } = behind_a_proxy("unsettled").await;
    let (_raw, mut events) = watching(&url, &dir).await;
    cut(&proxy, &backend).await;
    let first = std::thread::spawn({
        let (backend, key) = (backend.clone(), key.clone());
        move || {
            let first = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            first.block_on(async move {
                let a = Locker::builder()
                    .command_timeout(timeout)
                    .build(backend.clone());
                let err = a
                    .lock(key.as_str())
                    .ttl(Duration::from_millis(100))
                    .try_acquire()
                    .await
                    .expect_err("a lock taken without a server");
                assert!(err.is_unavailable(), "{err}");
                wait_for(
                    "the undo to go unanswered",
                    Duration::from_secs(10),
                    async || (backend.unsettled() == 1).then_some(()),
                )
                .await;
            });
            drop(first);
        }
    });
    tokio::task::spawn_blocking(move || first.join())
        .await
        .unwrap()
        .expect("the undo's runtime");
    proxy.allow();
    // The renewals of the blocker's node come as events too: one deadline for the lot.
    let settled = tokio::time::timeout(Duration::from_secs(15), async {
        let mut created = None;
        loop {
            let event = events.changed().await;
            match (event.event_type, &created) {
                (zookeeper_client::EventType::NodeCreated, None) => created = Some(event.path),
                (zookeeper_client::EventType::NodeDeleted, Some(path)) if *path == event.path => {
                    return;
                }
                _ => {}
            }
        }
    });
    settled
        .await
        .expect("the node of the try, created once the client was back, was not deleted");
    wait_for(
        "the attempt to be settled",
        Duration::from_secs(5),
        async || (backend.unsettled() == 0).then_some(()),
    )
    .await;
    blocker.release().await.unwrap();
}

/// Every attempt of a wait the client had no server for leaves a `create` it keeps until it has
/// one again; when the wait's undo gets no answer either, each of those nodes lands once the
/// client is back — and the task that settles unanswered undos deletes every one of them. It
/// deleted the first it found and took the attempt as settled: the others stayed, the first in
/// line holding the lock up for its TTL, on a lock nobody asked again for as long as the
/// session lived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_undo_settles_every_node_its_attempts_left() {
    use dlock_runtime::backend::{OwnerToken, WaitMode};
    use dlock_runtime::conformance::{abandon_as, attempt_as};

    let CutOff {
        url,
        proxy,
        backend,
        timeout,
        key,
        dir,
        blocker,
        _holder,
    } = behind_a_proxy("unsettled-all").await;
    let a = Locker::builder()
        .command_timeout(timeout)
        .build(backend.clone());
    let resource = a.resource(LockKey::new(&key).unwrap());
    let (raw, mut events) = watching(&url, &dir).await;
    cut(&proxy, &backend).await;
    let token = OwnerToken::generate();
    let ttl = Duration::from_secs(15);
    for _ in 0..2 {
        let err = attempt_as(&a, &resource, &token, WaitMode::Queue, ttl)
            .await
            .expect_err("an attempt answered without a server");
        assert!(err.is_unavailable(), "{err}");
    }
    abandon_as(&a, &resource, &token)
        .await
        .expect_err("an undo answered without a server");
    assert_eq!(backend.unsettled(), 1);
    proxy.allow();
    // Both attempts' nodes land once the client is back, and both are deleted (the renewals
    // of the blocker's node come as events too: one deadline for the lot).
    let own = format!("{dir}/{}", token.as_str());
    let landed = tokio::time::timeout(Duration::from_secs(15), async {
        let mut created = std::collections::HashSet::new();
        let mut deleted = std::collections::HashSet::new();
        while created.len() < 2 || deleted != created {
            let event = events.changed().await;
            if !event.path.starts_with(&own) {
                continue;
            }
            match event.event_type {
                zookeeper_client::EventType::NodeCreated => {
                    created.insert(event.path);
                }
                zookeeper_client::EventType::NodeDeleted => {
                    deleted.insert(event.path);
                }
                _ => {}
            }
        }
        created
    })
    .await;
    let created = landed
        .expect("the two attempts' nodes, created once the client was back, were not both deleted");
    assert_eq!(created.len(), 2, "{created:?}");
    wait_for(
        "the attempt to be settled",
        Duration::from_secs(15),
        async || (backend.unsettled() == 0).then_some(()),
    )
    .await;
    let left: Vec<String> = raw
        .list_children(&dir)
        .await
        .unwrap()
        .into_iter()
        .filter(|name| name.starts_with(token.as_str()))
        .collect();
    assert!(
        left.is_empty(),
        "nodes of the settled attempt left: {left:?}"
    );
    blocker.release().await.unwrap();
}

/// The local lease of a lock never counts on more than ¾ of the negotiated session timeout:
/// the leader expires a session one session timeout after it last heard of it, and for a
/// client served by a follower that can be up to half a tick (at most a quarter of the session
/// timeout, as `minSessionTimeout` is two ticks) before the client's last answered request —
/// the follower tells the leader in its answers to the leader's pings. Counting on the whole
/// session timeout, a holder cut off with its follower still believed it held the lock when the
/// leader let the next holder in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locks_local_lease_counts_on_three_quarters_of_the_session_timeout() {
    let url = zookeeper_server::shared().lock().unwrap().url();
    let session = Duration::from_millis(2000);
    let backend = with_session(&url, session).await;
    let a = Locker::builder().build(backend);
    let key = format!("three-quarters-{}", std::process::id());
    for ttl in [Duration::from_secs(4), Duration::from_millis(1600)] {
        let asked = Instant::now();
        let g = a
            .lock(key.as_str())
            .ttl(ttl)
            .auto_renew(false)
            .acquire()
            .await
            .unwrap();
        // Counted from when the request was sent: what is left, plus the time the acquire
        // took, is the local lease (within the clock's millisecond).
        let (left, took) = (g.remaining(), asked.elapsed());
        assert!(
            left <= session * 3 / 4 && left + took > session * 3 / 4 - Duration::from_millis(5),
            "a {ttl:?} lock on a {session:?} session counts on {left:?} ({took:?} after asking)"
        );
        g.release().await.unwrap();
    }
}

/// A `create` cut off by the command timeout that landed all the same: locker `a` (through
/// `proxy`, 1 s command timeout) sent token `mine`'s queued attempt on `key` through 800 ms of
/// latency each way — its node `taken` exists, the attempt answered `Unavailable` — and the
/// latency is gone again. `a`'s session keeps a lease (`_other`), so the unanswered call does
/// not have it replaced; `b` is a direct locker, holding the lock (`held`) if asked to.
struct LostCreate {
    a: Locker,
    b: Locker,
    raw: zookeeper_client::Client,
    resource: dlock_runtime::key::ResourceName,
    dir: String,
    mine: dlock_runtime::backend::OwnerToken,
    taken: String,
    held: Option<dlock_runtime::LockGuard>,
    ttl: Duration,
    _other: dlock_runtime::LockGuard,
    _proxy: Proxy,
}

async fn lost_create(tag: &str, hold: bool) -> LostCreate {
    use dlock_runtime::backend::{OwnerToken, WaitMode};
    use dlock_runtime::conformance::attempt_as;

    let server = zookeeper_server::shared().lock().unwrap().client_port(0);
    let url = zookeeper_server::shared().lock().unwrap().url();
    let proxy = Proxy::start(server).await.unwrap();
    let timeout = Duration::from_secs(1);
    // The connection stays (its silence is the proxy's latency, not a dead server).
    let opts = ZkOptions::default()
        .command_timeout(timeout)
        .connection_timeout(Duration::from_secs(5));
    let backend = ZkBackend::connect(
        &format!("zk://127.0.0.1:{}?session_timeout_ms=10000", proxy.port()),
        opts,
    )
    .await
    .unwrap();
    let a = Locker::builder().command_timeout(timeout).build(backend);
    let b = locker(&url).await;
    let other = a
        .lock(format!("{tag}-other-{}", std::process::id()))
        .ttl(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    let key = format!("{tag}-{}", std::process::id());
    let resource = a.resource(LockKey::new(&key).unwrap());
    let ttl = Duration::from_secs(20);
    // The lock's directory exists (a node was made in it; made again after the release that
    // took it away), so the `create` is the one call.
    let dir = format!("/dlock/{}", resource.as_str());
    let raw = raw_client(&url).await;
    let held = b.lock(key.as_str()).ttl(ttl).acquire().await.unwrap();
    let held = match hold {
        true => Some(held),
        false => {
            held.release().await.unwrap();
            remake_dir(&raw, &dir).await;
            None
        }
    };
    // The `create` reaches the server after 800 ms; the attempt gave up at 1 s, its answer
    // 1.6 s after it was sent.
    let mine = OwnerToken::generate();
    proxy.set_latency(Duration::from_millis(800));
    let lost = attempt_as(&a, &resource, &mine, WaitMode::Queue, ttl).await;
    assert!(lost.is_err(), "answered through 1.6 s of latency: {lost:?}");
    let taken = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        async || {
            let kids = raw.list_children(&dir).await.unwrap_or_default();
            match kids.iter().find(|k| k.starts_with(mine.as_str())) {
                Some(name) => Ok(name.clone()),
                None => Err(format!("no node of the token yet: {kids:?}")),
            }
        },
    )
    .await;
    proxy.set_latency(Duration::ZERO);
    LostCreate {
        a,
        b,
        raw,
        resource,
        dir,
        mine,
        taken,
        held,
        ttl,
        _other: other,
        _proxy: proxy,
    }
}

/// A token that asks again after the answer to its `create` was lost (the command timeout cut
/// the attempt off while the `create` was on its way) keeps the place that `create` took — here
/// the head of the line, i.e. the lock — rather than deleting that node as a stray and
/// queueing behind the waiter that came meanwhile: an attempt whose reply was lost is granted
/// the lock it took, with that node's fencing token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_asking_again_after_a_lost_create_keeps_the_place_it_took() {
    use dlock_runtime::backend::{Attempt, OwnerToken, WaitMode};
    use dlock_runtime::conformance::attempt_as;

    let lost = lost_create("lost-create", false).await;
    let (theirs, ttl) = (OwnerToken::generate(), lost.ttl);
    let queued = attempt_as(&lost.b, &lost.resource, &theirs, WaitMode::Queue, ttl).await;
    assert!(
        matches!(queued, Ok(Attempt::Held { .. })),
        "the lost create holds the lock: {queued:?}"
    );
    let again = attempt_as(&lost.a, &lost.resource, &lost.mine, WaitMode::Queue, ttl).await;
    let (_, stat) = lost
        .raw
        .get_data(&format!("{}/{}", lost.dir, lost.taken))
        .await
        .expect("the node the lost create made is kept");
    assert_eq!(
        again.unwrap_or_else(|e| panic!("{e}")),
        Attempt::Acquired {
            fencing_token: stat.czxid.unsigned_abs()
        },
        "asked again, the token must be granted the lock its lost create took"
    );
    let kids = lost.raw.list_children(&lost.dir).await.unwrap();
    assert_eq!(kids.len(), 2, "its node and the waiter's: {kids:?}");
}

/// A `create` whose answer is lost looks for the token's node by its name — and may find one
/// an earlier attempt of the token made (a `create` the command timeout cut off, landed all
/// the same), whose lease counts from that attempt's time. Granted as it was, the ensemble
/// ended that lease before this attempt's local lease (counted from this attempt's sending),
/// and let another client in beside the holder. The lease is written afresh first: the node's
/// version and modification time move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_found_after_a_lost_create_is_granted_with_a_fresh_lease() {
    use dlock_runtime::backend::{Attempt, WaitMode};
    use dlock_runtime::conformance::attempt_as;

    let lost = lost_create("lost-found", false).await;
    let path = format!("{}/{}", lost.dir, lost.taken);
    let (_, before) = lost
        .raw
        .get_data(&path)
        .await
        .expect("the lost create's node");
    assert_eq!(before.version, 0, "written since its create: {before:?}");
    // The next attempt's `create` is held on its way, then its connection cut: the client,
    // back on a new one, finds the earlier attempt's node by the token.
    let proxy = &lost._proxy;
    proxy.hold();
    let attempt = tokio::spawn({
        let (a, resource, mine, ttl) = (
            lost.a.clone(),
            lost.resource.clone(),
            lost.mine.clone(),
            lost.ttl,
        );
        async move { attempt_as(&a, &resource, &mine, WaitMode::Queue, ttl).await }
    });
    // A `create` (its path alone is longer than a ping).
    wait_for(
        "the create on its way",
        Duration::from_secs(5),
        async || (proxy.held_bytes() > 80).then_some(()),
    )
    .await;
    proxy.cut(false);
    let granted = tokio::time::timeout(Duration::from_secs(15), attempt)
        .await
        .expect("the attempt, once the client is back")
        .unwrap();
    assert_eq!(
        granted.unwrap_or_else(|e| panic!("{e}")),
        Attempt::Acquired {
            fencing_token: before.czxid.unsigned_abs()
        },
        "the earlier attempt's node holds the lock"
    );
    let (_, after) = lost.raw.get_data(&path).await.expect("the node is kept");
    assert!(
        after.version > before.version && after.mtime > before.mtime,
        "granted on the lease of the earlier attempt's create: {before:?} → {after:?}"
    );
    let kids = lost.raw.list_children(&lost.dir).await.unwrap();
    assert_eq!(
        kids,
        std::slice::from_ref(&lost.taken),
        "one node of the token"
    );
}

/// A barging waiter (`fair(false)`) is woken by the holder's release — its attempt, which
/// leaves no node in the line, watches the holder's node — not by its fallback timer (5 s
/// here). Before, a barging attempt set no watch at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_barging_waiter_is_woken_by_a_release() {
    let url = zookeeper_server::shared().lock().unwrap().url();
    let a = Locker::builder()
        .command_timeout(COMMAND_TIMEOUT)
        .waiter_ttl(Duration::from_secs(30))
        .default_ttl(Duration::from_secs(10))
        .connect(&url)
        .await
        .expect("connect to ZooKeeper");
    let key = dlock_runtime::conformance::unique_key("barging");
    dlock_tests::wait::a_barging_waiter_is_woken_by_a_release(&a, &key).await;
}

/// The undo of an acquire deletes every node of its token, not only the one its last attempt
/// knew: a token whose first `create` lost its answer (that node took the free lock) and whose
/// next attempt was cut off after creating a node of its own left the first node holding the
/// lock, with no guard, until its lease ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandon_deletes_every_node_of_its_token() {
    use dlock_runtime::backend::WaitMode;
    use dlock_runtime::conformance::{abandon_as, attempt_as};

    let lost = lost_create("abandon-all", false).await;
    // The next attempt's `create` is answered after 600 ms, its listing after 1.2 s: past the
    // 1 s command timeout, so it is cut off knowing its own node, not the first one.
    lost._proxy.set_latency(Duration::from_millis(300));
    let cut = attempt_as(
        &lost.a,
        &lost.resource,
        &lost.mine,
        WaitMode::Queue,
        lost.ttl,
    )
    .await;
    lost._proxy.set_latency(Duration::ZERO);
    assert!(cut.is_err(), "answered through the latency: {cut:?}");
    let mine = |kids: &[String]| {
        kids.iter()
            .filter(|k| k.starts_with(lost.mine.as_str()))
            .count()
    };
    let kids = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        async || {
            let kids = lost.raw.list_children(&lost.dir).await.unwrap_or_default();
            match mine(&kids) {
                2 => Ok(kids),
                _ => Err(format!("not two nodes of the token yet: {kids:?}")),
            }
        },
    )
    .await;
    assert!(kids.contains(&lost.taken), "{kids:?}");
    abandon_as(&lost.a, &lost.resource, &lost.mine)
        .await
        .expect("abandon");
    let kids = lost.raw.list_children(&lost.dir).await.unwrap();
    assert_eq!(
        mine(&kids),
        0,
        "a node of the abandoned token is left: {kids:?}"
    );
    let free = lost
        .b
        .lock(lost.resource.key().as_str())
        .try_acquire()
        .await
        .unwrap();
    assert!(free.is_some(), "the lock is still taken after the abandon");
}

/// A try by a token whose earlier `create` was cut off and landed behind a holder keeps that
/// earlier node in its place (as a queued attempt does), judges the holder by the ensemble's
/// time — it reports the holder's lease left, at most its TTL — and, as a try, leaves nothing
/// behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_after_a_lost_create_reports_the_holders_lease() {
    use dlock_runtime::backend::WaitMode;
    use dlock_runtime::conformance::attempt_as;

    let mut lost = lost_create("lost-try", true).await;
    let ttl = lost.ttl;
    let tried = attempt_as(&lost.a, &lost.resource, &lost.mine, WaitMode::Try, ttl).await;
    assert_reports_the_holders_lease(tried, ttl);
    let kids = lost.raw.list_children(&lost.dir).await.unwrap();
    assert_eq!(kids.len(), 1, "the try left a node behind: {kids:?}");
    lost.held.take().unwrap().release().await.unwrap();
}

/// A line of twenty waiters that died (their leases lapsed; a frozen process's, say) ahead of
/// a new waiter on a free lock: its attempt clears them and is granted the lock. Before, an
/// attempt gave up after eight rounds of clearing (two nodes each) and answered "held, time
/// unknown" with no watch set, so the waiter slept until its backoff on a free lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_clears_a_long_line_of_dead_waiters() {
    use dlock_runtime::backend::{Attempt, Backend, OwnerToken, WaitMode};
    use dlock_runtime::conformance::attempt_as;

    let url = zookeeper_server::shared().lock().unwrap().url();
    let (backend, a) = zk_locker(&url).await;
    let key = format!("dead-line-{}", std::process::id());
    // The lock's directory is made with a first node, goes with its release, and is made
    // again for the dead waiters.
    let made = a.lock(key.as_str()).try_acquire().await.unwrap();
    made.expect("free").release().await.unwrap();
    let resource = a.resource(LockKey::new(&key).unwrap());
    let dir = format!("/dlock/{}", resource.as_str());
    let raw = raw_client(&url).await;
    remake_dir(&raw, &dir).await;
    let opts = zookeeper_client::CreateMode::EphemeralSequential
        .with_acls(zookeeper_client::Acls::anyone_all());
    for _ in 0..20 {
        // A lease of 1 ms.
        let waiter = format!("{dir}/{}-", OwnerToken::generate().as_str());
        raw.create(&waiter, b"1", &opts)
            .await
            .expect("a dead waiter");
    }
    // Their 1 ms leases lapse by the ensemble's clock (no event tells when).
    tokio::time::sleep(Duration::from_millis(5)).await;
    let token = OwnerToken::generate();
    let ttl = Duration::from_secs(10);
    let attempt = attempt_as(&a, &resource, &token, WaitMode::Queue, ttl).await;
    assert!(
        matches!(attempt, Ok(Attempt::Acquired { .. })),
        "a free lock behind dead waiters: {attempt:?}"
    );
    assert_eq!(raw.list_children(&dir).await.unwrap().len(), 1);
    assert!(backend.release(&resource, &token).await.unwrap());
}

/// Timeouts given as `Duration::MAX` ("no deadline") are taken as a day.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_past_a_day_are_a_day_not_a_panic() {
    use dlock_runtime::backend::{ZkBackend, ZkOptions};
    let url = zookeeper_server::shared().lock().unwrap().url();
    let opts = ZkOptions::default()
        .command_timeout(Duration::MAX)
        .connection_timeout(Duration::MAX);
    let locker = Locker::builder().build(ZkBackend::connect(&url, opts).await.unwrap());
    dlock_tests::wait::locks_and_holds(&locker, "forever").await;
}
