//! Small pieces every layer uses: the TTL bounds, one hex codec, the two kinds of randomness (secure tokens from
//! the OS, fast jitter), one exponential backoff, and the fallback runtime background tasks
//! move to.

use std::cell::Cell;
use std::time::Duration;

use crate::LockError;

// Shared with `#[distributed_lock]` (crate `dlock-limits`), which checks `ttl` against them
// at compile time.
pub use dlock_limits::{MAX_TTL, MIN_TTL};

/// What a wait past what the clock can count (`Duration::MAX`: "as long as it takes") waits
/// instead of overflowing an `Instant`.
pub(crate) const CENTURY: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 86_400);

pub(crate) fn validate_ttl(ttl: Duration) -> Result<Duration, LockError> {
    let reason = if ttl.is_zero() {
        "ttl must not be zero".to_owned()
    } else if ttl < MIN_TTL {
        format!("ttl must be at least {MIN_TTL:?}")
    } else if ttl > MAX_TTL {
        format!("ttl must be at most {MAX_TTL:?}; long work keeps a short lease renewed")
    } else {
        return Ok(ttl);
    };
    Err(LockError::InvalidTtl { ttl, reason })
}

/// Decodes `%XX` escapes (a URL's user, password or parameter); `None` when an escape is not
/// two hex digits or the result is not UTF-8. `+` stays `+`.
#[cfg(any(
    feature = "etcd",
    feature = "postgres",
    feature = "sentinel",
    feature = "zookeeper"
))]
pub(crate) fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                return None;
            }
            out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Appends `bytes` as lowercase hex.
pub(crate) fn hex_into(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.reserve(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
}

/// `n` in decimal, written into `buf` (no allocation, no formatting machinery: for names
/// and values built on every lock).
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
pub(crate) fn decimal(n: u128, buf: &mut [u8; 39]) -> &str {
    let mut i = buf.len();
    let mut n = n;
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // ASCII digits only.
    std::str::from_utf8(&buf[i..]).unwrap_or("0")
}

/// `bytes` as lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut s = String::new();
    hex_into(&mut s, bytes);
    s
}

/// `N` random bytes from the OS CSPRNG, as hex: owner tokens, job ids, claim tokens.
///
/// # Panics
/// If the operating system cannot provide randomness (never on supported platforms); a lock
/// library must not fall back to a weaker source.
pub(crate) fn secure_token<const N: usize>() -> String {
    let mut bytes = [0u8; N];
    SECURE.with(|pool| pool.borrow_mut().fill(&mut bytes));
    hex(&bytes)
}

/// Bytes from the OS CSPRNG, drawn 1 KiB at a time: one `getrandom` per 64 owner tokens instead
/// of one per token (it was a measurable share of an uncontended lock's client CPU). Every byte
/// is used once and zeroed as it is handed out. A forked child starts a fresh pool (the pid is
/// checked on every draw), so parent and child never share bytes.
struct SecurePool {
    buf: [u8; 1024],
    /// Bytes of `buf` already handed out.
    used: usize,
    pid: u32,
}

impl SecurePool {
    fn fill(&mut self, out: &mut [u8]) {
        let pid = std::process::id();
        if pid != self.pid {
            self.pid = pid;
            self.used = self.buf.len();
        }
        for chunk in out.chunks_mut(self.buf.len()) {
            if self.buf.len() - self.used < chunk.len() {
                getrandom::fill(&mut self.buf).expect("the OS CSPRNG is unavailable");
                self.used = 0;
            }
            let take = &mut self.buf[self.used..self.used + chunk.len()];
            chunk.copy_from_slice(take);
            take.fill(0);
            self.used += chunk.len();
        }
    }
}

thread_local! {
    static SECURE: std::cell::RefCell<SecurePool> = const {
        std::cell::RefCell::new(SecurePool { buf: [0; 1024], used: 1024, pid: 0 })
    };
}

thread_local! {
    static RNG: Cell<u64> = Cell::new({
        let mut seed = [0u8; 8];
        // Jitter needs no secrecy; a fixed odd seed is a fine fallback.
        if getrandom::fill(&mut seed).is_err() {
            seed = 0x9E37_79B9_7F4A_7C15u64.to_le_bytes();
        }
        u64::from_le_bytes(seed) | 1
    });
}

/// xorshift64*: jitter only, never for tokens.
pub(crate) fn next_random() -> u64 {
    RNG.with(|c| {
        let mut x = c.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        c.set(x);
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    })
}

/// A uniformly random duration in `0..=max` (`max` counted up to `u64::MAX` nanoseconds).
pub(crate) fn random_up_to(max: Duration) -> Duration {
    let nanos = max.as_nanos().min(u128::from(u64::MAX)) as u64;
    match nanos.checked_add(1) {
        Some(span) => Duration::from_nanos(next_random() % span),
        // `0..=u64::MAX`: every value is in range.
        None => Duration::from_nanos(next_random()),
    }
}

/// The longest backoff step: a year. Longer steps mean nothing to a retry, and the timer
/// wheels that schedule deferred work refuse deadlines past about two years (a panic in the
/// queue's task, and the job in hand lost).
pub(crate) const MAX_BACKOFF_STEP: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// The longest timeout a backend keeps (`RedisOptions`, `EtcdOptions`, `ZkOptions`): a day. A
/// longer one — `Duration::MAX` for "no deadline" — is taken as a day: the backends add and
/// multiply their timeouts, and past this they overflowed (a panic).
#[cfg_attr(
    not(any(feature = "redis", feature = "etcd", feature = "zookeeper")),
    allow(dead_code)
)]
pub(crate) const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

/// The least pause before asking a backend that is down (a 503-class answer) again — a
/// waiter waiting through an outage, a deferred job whose attempt found the backend down: one
/// that refuses at once (nothing listening) is not asked in a busy loop, whatever the policy's
/// backoff (a defer delay of zero included).
pub(crate) const OUTAGE_PAUSE: Duration = Duration::from_millis(10);

/// Where in a backoff step the wait falls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Jitter {
    /// Exactly the step.
    None,
    /// Anywhere in `0..=step` ("full jitter"): spreads waiters out the most.
    Full,
    /// Anywhere in `step/2..=step` ("equal jitter"): never much earlier than the step.
    Equal,
}

/// Step `n` (0-based) of the exponential backoff `base · 2ⁿ`, capped at `max` (and at
/// [`MAX_BACKOFF_STEP`]), with `jitter`.
pub(crate) fn backoff(base: Duration, n: u32, max: Duration, jitter: Jitter) -> Duration {
    let max = max.min(MAX_BACKOFF_STEP);
    let step = base.checked_mul(1u32 << n.min(20)).unwrap_or(max).min(max);
    match jitter {
        Jitter::None => step,
        Jitter::Full => random_up_to(step),
        Jitter::Equal => step / 2 + random_up_to(step - step / 2),
    }
}

/// A run of failures of one repeated operation (a poll, a campaign attempt), reported without
/// flooding the log: the first failure, then at most one report per `every` while it lasts.
#[derive(Debug, Default)]
pub(crate) struct FailureStreak {
    /// Failures in this run.
    failures: u64,
    /// When the run was last reported.
    reported: Option<tokio::time::Instant>,
}

impl FailureStreak {
    /// Counts a failure; `Some(failures in the run so far)` when it is to be reported now.
    pub(crate) fn failed(&mut self, every: Duration) -> Option<u64> {
        self.failures += 1;
        let now = tokio::time::Instant::now();
        if self
            .reported
            .is_some_and(|at| now.duration_since(at) < every)
        {
            return None;
        }
        self.reported = Some(now);
        Some(self.failures)
    }

    /// Ends the run on a success; `Some(its failures)` when there was one.
    pub(crate) fn succeeded(&mut self) -> Option<u64> {
        let failures = std::mem::take(&mut self.failures);
        self.reported = None;
        (failures > 0).then_some(failures)
    }
}

/// The message of a caught panic's payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-string payload".to_owned())
}

/// The lease margin of a server that takes a lease in whole milliseconds (dropping the rest of
/// `ttl`), counted from `clock_ms` milliseconds before the request could have reached it: a
/// clock read in whole milliseconds is up to 1 ms behind. The local lease clock starts when the
/// request is sent, so with this margin it ends before the server lets anyone else in.
#[cfg(any(feature = "redis", feature = "postgres", feature = "zookeeper"))]
pub(crate) fn whole_ms_margin(ttl: Duration, clock_ms: u64) -> Duration {
    let below_ms = ttl.saturating_sub(Duration::from_millis(
        u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
    ));
    below_ms + Duration::from_millis(clock_ms)
}

/// The lease that keeps a lock until a minimum hold with `left_ns` to go ends
/// (`Lease::hold_left`): `None` once it has ended, and at least [`MIN_TTL`] (the shortest
/// lease a backend takes) — a few milliseconds too long rather than too short.
pub(crate) fn hold_rest(left_ns: u64) -> Option<Duration> {
    let ms = left_ns.div_ceil(1_000_000).saturating_add(1);
    (left_ns > 0).then(|| Duration::from_millis(ms).max(MIN_TTL))
}

#[cfg(any(feature = "redis", feature = "etcd", feature = "zookeeper"))]
pub(crate) use shutdown_watch::{on_runtime_shutdown, RuntimeWatch};

#[cfg(any(feature = "redis", feature = "etcd", feature = "zookeeper"))]
mod shutdown_watch {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// Calls `on_shutdown` if the current runtime shuts down while the returned watch lives: a task
    /// on that runtime that never ends holds it, and the runtime's shutdown drops the task and so
    /// calls it — from inside the shutdown, so it must only mark and notify. For what a client
    /// library ran on this runtime (its driver, its session task) and lost with it: the etcd and
    /// ZooKeeper clients, the Redis connections (redis-rs's managers and cluster clients). Dropping the watch disarms it. `None`
    /// off any runtime.
    pub(crate) fn on_runtime_shutdown(
        on_shutdown: impl FnOnce() + Send + 'static,
    ) -> Option<RuntimeWatch> {
        let rt = tokio::runtime::Handle::try_current().ok()?;
        let state = Arc::new(WatchState::default());
        // Made outside the task: a runtime that shuts down before polling it still drops it.
        let fire = Fire {
            state: state.clone(),
            on_shutdown: Some(on_shutdown),
        };
        let task = rt.spawn(async move {
            let _fire = fire;
            std::future::pending::<()>().await
        });
        Some(RuntimeWatch {
            state,
            task: task.abort_handle(),
        })
    }

    /// See [`on_runtime_shutdown`]. Dropped, it disarms the call and ends its task.
    pub(crate) struct RuntimeWatch {
        state: Arc<WatchState>,
        task: tokio::task::AbortHandle,
    }

    #[derive(Default)]
    struct WatchState {
        disarmed: AtomicBool,
        fired: AtomicBool,
    }

    impl RuntimeWatch {
        /// Whether the runtime shut down (set before the call is made).
        #[cfg_attr(not(feature = "redis"), allow(dead_code))]
        pub(crate) fn is_gone(&self) -> bool {
            self.state.fired.load(Ordering::Acquire)
        }
    }

    impl Drop for RuntimeWatch {
        fn drop(&mut self) {
            self.state.disarmed.store(true, Ordering::Release);
            self.task.abort();
        }
    }

    struct Fire<F: FnOnce()> {
        state: Arc<WatchState>,
        on_shutdown: Option<F>,
    }

    impl<F: FnOnce()> Drop for Fire<F> {
        fn drop(&mut self) {
            if self.state.disarmed.load(Ordering::Acquire) {
                return;
            }
            self.state.fired.store(true, Ordering::Release);
            if let Some(f) = self.on_shutdown.take() {
                f();
            }
        }
    }
}

/// The runtime a background task moves to when the one running it shuts down (the watchdog, the
/// Postgres `LISTEN` task), and the watchdog starts on when a guard is dropped off any runtime:
/// one thread for the whole process, `dlock-watchdog`, started on first need.
pub(crate) fn fallback_runtime() -> Option<&'static tokio::runtime::Handle> {
    static FALLBACK: std::sync::OnceLock<Option<tokio::runtime::Handle>> =
        std::sync::OnceLock::new();
    FALLBACK
        .get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name("dlock-watchdog".into())
                .spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build();
                    match rt {
                        Ok(rt) => {
                            let _ = tx.send(Some(rt.handle().clone()));
                            rt.block_on(std::future::pending::<()>());
                        }
                        Err(_) => {
                            let _ = tx.send(None);
                        }
                    }
                })
                .ok()?;
            rx.recv().ok().flatten()
        })
        .as_ref()
}

#[cfg_attr(not(any(feature = "redis", feature = "etcd")), allow(unused_imports))]
pub(crate) use to_the_end::spawn_to_the_end;

// Used by the Redis and etcd backends (and this module's tests).
#[cfg_attr(not(any(feature = "redis", feature = "etcd")), allow(dead_code))]
mod to_the_end {
    /// Background work that is safe to do twice (a revocation, a reconnect check, a keep-alive
    /// loop), started anew by each call.
    pub(crate) type Work = std::sync::Arc<
        dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync,
    >;

    /// Runs `work` on the current runtime to its end. If that runtime shuts down first (an
    /// actix-web worker restarting, a runtime built for set-up and dropped) and drops the task
    /// half-way, the work starts again, from the beginning, on the fallback thread (as the
    /// watchdog does). Without a runtime, nothing runs.
    pub(crate) fn spawn_to_the_end(work: Work) {
        tokio::spawn(to_the_end(Unfinished(Some(work))));
    }

    /// Work not done yet: dropped so, it starts again on the fallback thread.
    struct Unfinished(Option<Work>);

    impl Drop for Unfinished {
        fn drop(&mut self) {
            // Not after a panic in the work: it would only panic again.
            let Some(work) = self.0.take().filter(|_| !std::thread::panicking()) else {
                return;
            };
            let Some(rt) = crate::util::fallback_runtime() else {
                tracing::warn!("dlock could not start its fallback thread; background work cut off with its runtime");
                return;
            };
            rt.spawn(to_the_end(Unfinished(Some(work))));
        }
    }

    async fn to_the_end(mut task: Unfinished) {
        if let Some(work) = task.0.clone() {
            work().await;
        }
        task.0 = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(any(
        feature = "etcd",
        feature = "postgres",
        feature = "sentinel",
        feature = "zookeeper"
    ))]
    fn percent_escapes_decode_and_bad_ones_are_refused() {
        assert_eq!(percent_decode("a%40b%3Ac%2F+").as_deref(), Some("a@b:c/+"));
        assert_eq!(percent_decode("%C3%A9").as_deref(), Some("é"));
        for bad in ["%", "%4", "%+1", "%zz", "%C3"] {
            assert_eq!(percent_decode(bad), None, "{bad}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_streak_is_reported_first_then_once_per_interval() {
        let every = Duration::from_secs(60);
        let mut streak = FailureStreak::default();
        assert_eq!(streak.succeeded(), None);
        assert_eq!(streak.failed(every), Some(1));
        assert_eq!(streak.failed(every), None);
        tokio::time::advance(Duration::from_secs(59)).await;
        assert_eq!(streak.failed(every), None);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(streak.failed(every), Some(4));
        assert_eq!(streak.succeeded(), Some(4));
        assert_eq!(
            streak.failed(every),
            Some(1),
            "a new run is reported at once"
        );
    }

    #[test]
    fn ttl_bounds_are_enforced() {
        assert!(validate_ttl(Duration::ZERO).unwrap_err().is_invalid());
        assert!(validate_ttl(Duration::from_millis(9)).is_err());
        assert!(validate_ttl(MIN_TTL).is_ok());
        assert!(validate_ttl(MAX_TTL).is_ok());
        assert!(validate_ttl(MAX_TTL + Duration::from_millis(1)).is_err());
    }

    #[test]
    fn secure_pool_never_hands_out_a_byte_twice_and_starts_afresh_after_a_fork() {
        // Many tokens across several refills of the pool: all distinct, all 32 hex digits.
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            let t = secure_token::<16>();
            assert_eq!(t.len(), 32);
            assert!(seen.insert(t), "a token repeated");
        }
        // A pool inherited from another process (what a fork leaves) is not drawn from.
        let mut pool = SecurePool {
            buf: [7; 1024],
            used: 0,
            pid: std::process::id().wrapping_add(1),
        };
        let mut out = [0u8; 16];
        pool.fill(&mut out);
        assert_ne!(out, [7; 16], "bytes of the parent's pool were reused");
        assert_eq!(pool.pid, std::process::id());
        assert!(
            pool.buf[..16].iter().all(|&b| b == 0),
            "handed-out bytes are zeroed"
        );
        // A draw larger than the pool works too.
        let mut big = [0u8; 3000];
        pool.fill(&mut big);
        assert!(big.windows(16).any(|w| w != [0; 16]));
    }

    #[test]
    fn hex_is_lowercase_and_two_digits_per_byte() {
        assert_eq!(hex(&[0x00, 0x0f, 0xa0, 0xff]), "000fa0ff");
        assert_eq!(secure_token::<16>().len(), 32);
        assert_ne!(secure_token::<16>(), secure_token::<16>());
    }

    #[test]
    fn decimal_writes_every_digit() {
        let mut buf = [0; 39];
        for n in [0, 7, 10, 1500, u128::from(u32::MAX), u128::MAX] {
            assert_eq!(decimal(n, &mut buf), n.to_string());
        }
    }

    #[test]
    fn backoff_doubles_to_the_cap_and_jitter_stays_in_its_range() {
        let (base, max) = (Duration::from_millis(10), Duration::from_millis(70));
        let steps: Vec<_> = (0..5)
            .map(|n| backoff(base, n, max, Jitter::None).as_millis())
            .collect();
        assert_eq!(steps, vec![10, 20, 40, 70, 70]);
        assert_eq!(backoff(base, 1000, max, Jitter::None), max);
        for n in 0..200 {
            let step = backoff(base, n % 4, max, Jitter::None);
            assert!(backoff(base, n % 4, max, Jitter::Full) <= step);
            let equal = backoff(base, n % 4, max, Jitter::Equal);
            assert!(equal >= step / 2 && equal <= step, "{equal:?} vs {step:?}");
        }
    }

    /// Background work cut off by its runtime's shutdown starts again on the fallback thread
    /// and runs to its end; work that ended is not started again.
    #[test]
    fn background_work_cut_off_by_its_runtime_runs_to_the_end_elsewhere() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (starts, ends) = (
            std::sync::Arc::new(AtomicUsize::new(0)),
            std::sync::Arc::new(AtomicUsize::new(0)),
        );
        let work = |starts: &std::sync::Arc<AtomicUsize>,
                    ends: &std::sync::Arc<AtomicUsize>,
                    pause: Duration|
         -> to_the_end::Work {
            let (starts, ends) = (starts.clone(), ends.clone());
            std::sync::Arc::new(move || {
                let (starts, ends) = (starts.clone(), ends.clone());
                Box::pin(async move {
                    starts.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(pause).await;
                    ends.fetch_add(1, Ordering::SeqCst);
                })
            })
        };
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        first.block_on(async {
            spawn_to_the_end(work(&starts, &ends, Duration::from_millis(50)));
            while starts.load(Ordering::SeqCst) == 0 {
                tokio::task::yield_now().await;
            }
        });
        drop(first);
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while ends.load(Ordering::SeqCst) == 0 {
            assert!(
                std::time::Instant::now() < until,
                "the work was not finished"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(starts.load(Ordering::SeqCst), 2, "started again once");

        let (starts, ends) = (
            std::sync::Arc::new(AtomicUsize::new(0)),
            std::sync::Arc::new(AtomicUsize::new(0)),
        );
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        second.block_on(async {
            spawn_to_the_end(work(&starts, &ends, Duration::ZERO));
            while ends.load(Ordering::SeqCst) == 0 {
                tokio::task::yield_now().await;
            }
        });
        drop(second);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            starts.load(Ordering::SeqCst),
            1,
            "work that ended started again"
        );
    }
}
