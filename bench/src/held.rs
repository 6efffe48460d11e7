//! Scenario 4: 100,000 locks held at once with auto-renewal (TTL 30 s), in a child process of
//! its own so that its RSS and CPU are the locker's alone.
//!
//! The parent runs `dlock-bench --held-child <url> <locks> <hold secs>`; the child acquires
//! the locks (512 acquires in flight), then measures over the hold: VmRSS, utime + stime,
//! `Locker::renewals()`, and finally `is_held()` on every guard. It prints one JSON line and
//! exits without releasing (the parent flushes the server).

use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use dlock_runtime::{LockGuard, Locker};
use futures_util::stream::{self, StreamExt as _};
use serde_json::{json, Value};

use crate::stats::{round1, round3};
use crate::sys::{cpu_secs, peak_rss_kib, rss_kib};
use crate::BenchError;

pub(crate) const TTL: Duration = Duration::from_secs(30);
const IN_FLIGHT: usize = 512;

/// Runs the child and returns its figures.
pub(crate) async fn run(url: &str, locks: usize, hold: Duration) -> Result<Value, BenchError> {
    let exe = std::env::current_exe()?;
    let args = [
        "--held-child".to_owned(),
        url.to_owned(),
        locks.to_string(),
        hold.as_secs().to_string(),
    ];
    let out = tokio::task::spawn_blocking(move || {
        Command::new(exe)
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
    })
    .await??;
    if !out.status.success() {
        return Err(format!("held-at-scale child failed: {}", out.status).into());
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(line.trim())
        .map_err(|e| format!("held-at-scale child printed no JSON ({e}): {line}"))?;
    Ok(v)
}

/// `dlock-bench --held-child <url> <locks> <hold secs>`.
pub(crate) fn child_main(args: &[String]) -> ExitCode {
    let parsed = (|| {
        let url = args.first()?.clone();
        let locks = args.get(1)?.parse().ok()?;
        let secs = args.get(2)?.parse().ok()?;
        Some((url, locks, Duration::from_secs(secs)))
    })();
    let Some((url, locks, hold)) = parsed else {
        eprintln!("usage: dlock-bench --held-child <url> <locks> <hold secs>");
        return ExitCode::FAILURE;
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(crate::WORKERS)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("held child: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(child(&url, locks, hold)) {
        Ok(v) => {
            println!("{v}");
            // Skip dropping 100,000 guards (each would queue a background release); the
            // parent flushes the server.
            std::process::exit(0);
        }
        Err(e) => {
            eprintln!("held child: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn child(url: &str, locks: usize, hold: Duration) -> Result<Value, BenchError> {
    let locker = Locker::from_url(url).await?;
    let rss_start = rss_kib();
    let t = Instant::now();
    let results: Vec<Result<LockGuard, dlock_runtime::LockError>> = stream::iter(0..locks)
        .map(|i| {
            let locker = locker.clone();
            async move { locker.lock(format!("held:{i}")).ttl(TTL).acquire().await }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    let acquire_s = t.elapsed().as_secs_f64();
    let guards = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    let rss_held = rss_kib();

    let (cpu0, renew0, t0) = (cpu_secs(), locker.renewals(), Instant::now());
    let mut rss_max = rss_held;
    let end = t0 + hold;
    while Instant::now() < end {
        let step = (end - Instant::now()).min(Duration::from_millis(500));
        tokio::time::sleep(step).await;
        rss_max = rss_max.max(rss_kib());
    }
    let (cpu1, renew1, wall) = (cpu_secs(), locker.renewals(), t0.elapsed().as_secs_f64());
    let rss_end = rss_kib();
    let held = guards.iter().filter(|g| g.is_held()).count();
    let renewals = renew1 - renew0;
    let mib = |kib: u64| round1(kib as f64 / 1024.0);
    Ok(json!({
        "status": "ok",
        "locks": locks,
        "ttl_s": TTL.as_secs(),
        "hold_s": round3(wall),
        "acquire_s": round3(acquire_s),
        "acquire_per_s": round1(locks as f64 / acquire_s),
        "rss_mib": mib(rss_end),
        "rss_max_mib": mib(rss_max.max(rss_end)),
        "rss_before_locks_mib": mib(rss_start),
        "peak_rss_mib": mib(peak_rss_kib()),
        "cpu_s": round3(cpu1 - cpu0),
        "cpu_cores": round3((cpu1 - cpu0) / wall),
        "renewals": renewals,
        "renewals_per_s": round1(renewals as f64 / wall),
        "renewals_total": renew1,
        "renewing": locker.renewing(),
        "held": held,
        "lost": locks - held,
    }))
}
