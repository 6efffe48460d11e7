//! The `dlock` binary end to end, as a process, against real servers started by the
//! `dlock-tests` harness on free loopback ports: Redis (locks, `watch`, durable jobs), Postgres
//! etcd and ZooKeeper (locks); and its errors for bad URLs and unreachable servers.

use std::process::Output;
use std::time::{Duration, Instant};

use dlock_runtime::durable::{DurableQueue, DurableWorker};
use dlock_runtime::{DeferPolicy, LockKey, Locker, OnFail, RetryPolicy};
use dlock_tests::jobs::RecordJob;
use dlock_tests::redis_server::free_port;
use dlock_tests::RedisServer;
use serde_json::Value;

/// Runs `dlock <args>` with stdin closed (no terminal) and `DLOCK_URL` unset unless given.
async fn dlock(url: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlock"));
    cmd.args(args)
        .env_remove("DLOCK_URL")
        .stdin(std::process::Stdio::null());
    if let Some(url) = url {
        cmd.env("DLOCK_URL", url);
    }
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("dlock finishes")
        .expect("run dlock");
    out
}

/// Starts `dlock <args>` against `url` with stdin closed and stdout and stderr piped.
fn spawn(url: &str, args: &[&str]) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_dlock"))
        .args(args)
        .env("DLOCK_URL", url)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "dlock failed: {:?}\n{}",
        out.status,
        stderr(out)
    );
    serde_json::from_slice(&out.stdout).expect("JSON output")
}

/// A held lock on `key` and one waiter queued behind it (on another locker).
async fn held_with_waiter(
    url: &str,
    key: &str,
) -> (
    dlock_runtime::LockGuard,
    Locker,
    tokio::task::JoinHandle<Result<dlock_runtime::LockGuard, dlock_runtime::LockError>>,
) {
    let a = Locker::from_url(url).await.expect("connect");
    let b = Locker::from_url(url).await.expect("connect");
    let guard = a
        .lock(key)
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let waiter = {
        let (b, key) = (b.clone(), key.to_owned());
        tokio::spawn(async move {
            b.lock(key.as_str())
                .ttl(Duration::from_secs(30))
                .on_fail(OnFail::Retry(RetryPolicy::new(Duration::from_secs(30))))
                .acquire()
                .await
        })
    };
    dlock_tests::wait::wait_for("the waiter queues", Duration::from_secs(10), async || {
        (b.waiting() == 1).then_some(())
    })
    .await;
    // Its queue entry is written by its first attempt: wait until the store shows it.
    let admin = a.admin().unwrap();
    dlock_tests::wait::wait_for(
        "the waiter is in the queue",
        Duration::from_secs(10),
        async || (admin.inspect(key).await.unwrap().waiters.len() == 1).then_some(()),
    )
    .await;
    (guard, b, waiter)
}

/// inspect, list, watch and release --force on one backend, through the binary.
async fn locks_through_the_cli(url: &str, key: &str) {
    let (guard, _b, waiter) = held_with_waiter(url, key).await;

    let state = json(&dlock(Some(url), &["--json", "inspect", key]).await);
    assert_eq!(state["key"], key);
    assert!(state["holder"].is_object(), "{state}");
    let prefix = state["holder"]["token_prefix"].as_str().unwrap();
    assert_eq!(prefix.len(), 8, "only a token prefix is shown");
    if let Some(t) = state["holder"]["fencing_token"].as_u64() {
        assert_eq!(t, guard.fencing_token());
    }
    let left = state["holder"]["ttl_left_ms"].as_u64().unwrap();
    assert!(left > 0 && left <= 30_000, "{left}");
    assert_eq!(state["waiters"].as_array().unwrap().len(), 1);

    let text = stdout(&dlock(Some(url), &["inspect", key]).await);
    assert!(
        text.contains(&format!("holder         {prefix}…")),
        "{text}"
    );
    assert!(text.contains("waiters        1"), "{text}");

    let family = &key[..key.rfind(':').unwrap() + 1];
    let listed = json(&dlock(Some(url), &["--json", "list", "--prefix", family]).await);
    let listed = listed.as_array().unwrap();
    assert!(listed.iter().any(|s| s["key"] == key), "{listed:?}");
    let none = json(&dlock(Some(url), &["--json", "list", "--prefix", "nothing-here:"]).await);
    assert_eq!(none, Value::Array(vec![]));

    let out = dlock(
        Some(url),
        &[
            "--json",
            "watch",
            "--count",
            "2",
            "--interval",
            "100ms",
            "--prefix",
            family,
        ],
    )
    .await;
    let refreshes: Vec<Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(refreshes.len(), 2, "{}", stdout(&out));
    for r in &refreshes {
        assert!(
            r["locks"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s["key"] == key),
            "contended key missing: {r}"
        );
    }

    // No --force; then no terminal and no --yes: refused, nothing released.
    let out = dlock(Some(url), &["release", key]).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--force"));
    let out = dlock(Some(url), &["release", key, "--force"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--yes"), "{}", stderr(&out));
    assert!(guard.is_held());
    let state = json(&dlock(Some(url), &["--json", "inspect", key]).await);
    assert_eq!(
        state["holder"]["token_prefix"], prefix,
        "still the same holder"
    );

    // `--if-holder` naming another owner: nothing released, the holder named (exit 1); not a
    // token prefix: bad usage.
    let other = if prefix.starts_with('0') { "1" } else { "0" };
    let release_if = |holder| ["release", key, "--force", "--yes", "--if-holder", holder];
    let out = dlock(Some(url), &release_if(other)).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("held by `{prefix}…`, not by `{other}…`")),
        "{}",
        stderr(&out)
    );
    let out = dlock(Some(url), &release_if("xyz")).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let state = json(&dlock(Some(url), &["--json", "inspect", key]).await);
    assert_eq!(state["holder"]["token_prefix"], prefix, "released: {state}");

    // Naming the holder `inspect` showed: released.
    let [release, rest @ ..] = release_if(prefix);
    let mut args = vec!["--json", release];
    args.extend(rest);
    let released = json(&dlock(Some(url), &args).await);
    assert_eq!(released["was_held"], true, "{released}");
    assert_eq!(released["other_holder"], Value::Null, "{released}");
    let next = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("the waiter gets the lock")
        .unwrap()
        .unwrap();
    assert!(next.fencing_token() > guard.fencing_token());
    if let Some(fence) = released["fence"].as_u64() {
        assert!(
            fence > guard.fencing_token(),
            "fence raised past the old holder"
        );
        assert!(next.fencing_token() > fence);
    }
    assert!(
        guard.extend(Duration::from_secs(30)).await.is_err(),
        "old holder is out"
    );
    next.release().await.unwrap();
    let state = json(&dlock(Some(url), &["--json", "inspect", key]).await);
    assert!(state["holder"].is_null(), "{state}");
    assert_eq!(state["waiters"].as_array().unwrap().len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_locks() {
    let server = RedisServer::start();
    locks_through_the_cli(&server.url(), "order:42").await;
}

/// The read-only commands take no issuer number (`RedisBackend::ISSUER_BITS`): a monitoring
/// job running `dlock list` every few seconds used one per run, and after 2,048 of them two
/// live applications' backends could share one — tokens two masters issued from one counter
/// value during a split no longer told apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_commands_take_no_issuer_number() {
    let server = RedisServer::start();
    let url = server.url();
    let locker = server.locker().await;
    let guard = locker.lock("watched").acquire().await.unwrap();
    let issuers = || async {
        let n: Option<u64> = server.query(redis::cmd("GET").arg("dlock:issuers")).await;
        n
    };
    let before = issuers().await;
    assert_eq!(before, Some(1), "the application's grant took one");
    for args in [
        &["--json", "list"][..],
        &["--json", "inspect", "watched"],
        &["--json", "watch", "--count", "1"],
    ] {
        let out = dlock(Some(&url), args).await;
        assert!(out.status.success(), "{args:?}: {out:?}");
    }
    assert_eq!(issuers().await, before);
    guard.release().await.unwrap();
}

/// A `watch` refresh that read only `--scan` locks of more says so (JSON: `"truncated": true`,
/// `"scanned"`; text: "there are more"); one that read them all does not. Before, the locks
/// past the first 10,000 were left out without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_refresh_cut_at_its_scan_limit_says_so() {
    let server = RedisServer::start();
    let url = server.url();
    let locker = server.locker().await;
    let mut held = Vec::new();
    for key in ["scan:a", "scan:b", "scan:c"] {
        held.push(locker.lock(key).acquire().await.unwrap());
    }
    let watch = |scan: &'static str, json: bool| {
        let url = url.clone();
        async move {
            let mut args = vec!["watch", "--all", "--count", "1", "--scan", scan];
            if json {
                args.insert(0, "--json");
            }
            let out = dlock(Some(&url), &args).await;
            assert!(out.status.success(), "{out:?}");
            String::from_utf8(out.stdout).unwrap()
        }
    };
    let cut: Value = serde_json::from_str(&watch("2", true).await).unwrap();
    assert_eq!(cut["truncated"], true, "{cut}");
    assert_eq!(cut["scanned"], 2, "{cut}");
    assert_eq!(cut["locks"].as_array().unwrap().len(), 2, "{cut}");
    let whole: Value = serde_json::from_str(&watch("3", true).await).unwrap();
    assert!(whole.get("truncated").is_none(), "{whole}");
    assert_eq!(whole["locks"].as_array().unwrap().len(), 3, "{whole}");
    assert!(watch("2", false).await.contains("there are more"));
    assert!(!watch("3", false).await.contains("there are more"));
    for guard in held {
        guard.release().await.unwrap();
    }
}

/// The keys of `locks` as `list --json` gives them, sorted.
fn keys(locks: &Value) -> Vec<String> {
    let mut keys: Vec<String> = locks
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["key"].as_str().unwrap().to_owned())
        .collect();
    keys.sort_unstable();
    keys
}

/// A key as `list` and `inspect` show it (encoded: `user:1%3A2`) works as `inspect`, `release`
/// and `--prefix` argument, and literal text (`a b`, `100%`) still does; `release --force` of a
/// lock nobody holds exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_as_shown_and_releasing_a_free_lock_exits_1() {
    let server = RedisServer::start();
    let url = server.url();
    let locker = server.locker().await;
    let ttl = Duration::from_secs(30);
    let valued = LockKey::builder()
        .lit("user:")
        .value("1:2")
        .finish()
        .unwrap();
    let guard = locker.lock(&valued).ttl(ttl).acquire().await.unwrap();
    let _spaced = locker.lock("a b").ttl(ttl).acquire().await.unwrap();
    let _percent = locker.lock("100%").ttl(ttl).acquire().await.unwrap();
    let shown = "user:1%3A2";
    assert_eq!(guard.key(), shown);

    let all = json(&dlock(Some(&url), &["--json", "list"]).await);
    assert_eq!(keys(&all), ["100%25", "a%20b", shown]);
    for (prefix, expected) in [
        ("user:1%3A", shown),
        ("a%20", "a%20b"),
        ("a b", "a%20b"),
        ("100%", "100%25"),
    ] {
        let listed = json(&dlock(Some(&url), &["--json", "list", "--prefix", prefix]).await);
        assert_eq!(keys(&listed), [expected], "--prefix {prefix}");
    }
    let listed = json(&dlock(Some(&url), &["--json", "list", "--prefix", "user:1:"]).await);
    assert_eq!(listed, Value::Array(vec![]), "`user:1:` is another prefix");

    for (arg, key) in [
        (shown, shown),
        ("a b", "a%20b"),
        ("a%20b", "a%20b"),
        ("100%", "100%25"),
        ("100%25", "100%25"),
    ] {
        let state = json(&dlock(Some(&url), &["--json", "inspect", arg]).await);
        assert_eq!(state["key"], key, "inspect {arg}");
        assert!(state["holder"].is_object(), "inspect {arg}: {state}");
    }
    let text = stdout(&dlock(Some(&url), &["inspect", shown]).await);
    assert!(
        text.contains(&format!("key            {shown}\n")),
        "{text}"
    );
    assert!(!text.contains("(free)"), "{text}");

    let released = json(
        &dlock(
            Some(&url),
            &["--json", "release", shown, "--force", "--yes"],
        )
        .await,
    );
    assert_eq!(released["was_held"], true, "{released}");
    assert!(guard.extend(ttl).await.is_err(), "the holder is out");
    let state = json(&dlock(Some(&url), &["--json", "inspect", shown]).await);
    assert!(state["holder"].is_null(), "{state}");

    // Nothing to free: the message, and exit 1 (text and JSON).
    let out = dlock(Some(&url), &["release", shown, "--force", "--yes"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("`{shown}` was not held")),
        "{}",
        stderr(&out)
    );
    let out = dlock(
        Some(&url),
        &["--json", "release", shown, "--force", "--yes"],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON output");
    assert_eq!(doc["was_held"], false, "{doc}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_jobs_list_dead_requeue_purge() {
    let server = RedisServer::start();
    let url = server.url();
    let queue = DurableQueue::connect(&url, "mail").await.unwrap();
    let locker = server.locker().await;
    let job = |id, fail| RecordJob {
        id,
        lock: format!("j{id}"),
        record_url: url.clone(),
        always_fail: fail,
        ..Default::default()
    };
    let policy = DeferPolicy::new(Duration::ZERO, 1);
    let ttl = Duration::from_secs(5);
    let failing = queue
        .enqueue(&job(1, true), &policy, ttl, Duration::ZERO)
        .await
        .unwrap();
    let worker = DurableWorker::new(queue.clone(), locker).register::<RecordJob>();
    dlock_tests::wait::wait_for("a dead letter", Duration::from_secs(10), async || {
        worker.run_once().await.unwrap();
        (!queue.dead_letters().await.unwrap().is_empty()).then_some(())
    })
    .await;
    let later = queue
        .enqueue(&job(2, false), &policy, ttl, Duration::from_secs(3600))
        .await
        .unwrap();

    let jobs = ["--json", "jobs", "--queue", "mail"];
    let with = |extra: &[&'static str]| [&jobs[..], extra].concat();
    let listed = json(&dlock(Some(&url), &with(&["list"])).await);
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["id"], later.as_str());
    assert_eq!(listed[0]["state"], "queued");
    assert_eq!(listed[0]["key"], "record:j2");

    // `--limit` cuts the listing (due order first) and says how many there are in all.
    let latest = queue
        .enqueue(&job(3, false), &policy, ttl, Duration::from_secs(7200))
        .await
        .unwrap();
    let out = dlock(Some(&url), &with(&["list", "--limit", "1"])).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let cut: Value = serde_json::from_slice(&out.stdout).expect("JSON output");
    assert_eq!(cut.as_array().map(Vec::len), Some(1), "{cut}");
    assert_eq!(cut[0]["id"], later.as_str());
    assert!(
        stderr(&out).contains("first 1 of 2 job(s)"),
        "{}",
        stderr(&out)
    );
    let out = dlock(
        Some(&url),
        &["jobs", "--queue", "mail", "list", "--limit", "1"],
    )
    .await;
    let printed = stdout(&out);
    assert!(printed.contains(later.as_str()), "{printed}");
    assert!(!printed.contains(latest.as_str()), "{printed}");
    assert!(
        printed.contains("first 1 of 2 job(s) (--limit to see more)"),
        "{printed}"
    );
    let out = dlock(Some(&url), &["jobs", "--queue", "mail", "list"]).await;
    assert!(stdout(&out).contains("\n2 job(s)"), "{}", stdout(&out));
    let out = dlock(Some(&url), &with(&["dead", "--limit", "0"])).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));

    let dead = json(&dlock(Some(&url), &with(&["dead"])).await);
    assert_eq!(dead[0]["id"], failing.as_str());
    assert!(
        dead[0]["reason"].as_str().unwrap().contains("always fails"),
        "{dead}"
    );

    let out = dlock(Some(&url), &with(&["requeue", "no-such-job"])).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let requeued = json(
        &dlock(
            Some(&url),
            &[&jobs[..], &["requeue", failing.as_str()]].concat(),
        )
        .await,
    );
    assert_eq!(requeued["requeued"], failing.as_str());
    assert!(queue.dead_letters().await.unwrap().is_empty());
    assert_eq!(queue.len().await.unwrap(), 3);

    // Dead again, then purged (refused without --yes and without a terminal).
    dlock_tests::wait::wait_for("a dead letter again", Duration::from_secs(10), async || {
        worker.run_once().await.unwrap();
        (!queue.dead_letters().await.unwrap().is_empty()).then_some(())
    })
    .await;
    let out = dlock(Some(&url), &with(&["purge", "--all"])).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(queue.dead_letters().await.unwrap().len(), 1);
    let purged = json(&dlock(Some(&url), &with(&["purge", "--all", "--yes"])).await);
    assert_eq!(purged["purged"], 1);
    assert!(queue.dead_letters().await.unwrap().is_empty());

    let out = dlock(Some("postgres://127.0.0.1:1/db"), &with(&["dead"])).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("live in Redis"), "{}", stderr(&out));
    // A Redis socket URL is a Redis URL: the queue is looked for there (none listens at this
    // path: exit 2 for that, not for the scheme).
    for scheme in ["redis+unix", "unix"] {
        let url = format!("{scheme}:///nonexistent/dlock-test.sock");
        let out = dlock(Some(&url), &with(&["--timeout", "1s", "dead"])).await;
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(
            !stderr(&out).contains("live in Redis"),
            "{scheme}: {}",
            stderr(&out)
        );
    }
}

/// A dead letter's reason quotes the job's error, which may hold request data: `jobs dead`
/// prints its control characters escaped, so none reaches the operator's terminal (an `OSC`
/// sequence sets the window title or the clipboard). JSON escapes them anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letters_reason_cannot_drive_the_terminal() {
    let server = RedisServer::start();
    let url = server.url();
    let queue = DurableQueue::connect(&url, "esc").await.unwrap();
    let job = RecordJob {
        id: 7,
        lock: "esc".into(),
        record_url: url.clone(),
        fail_with: Some("\u{1b}]0;pwned\u{7} boom".into()),
        ..Default::default()
    };
    let policy = DeferPolicy::new(Duration::ZERO, 1);
    queue
        .enqueue(&job, &policy, Duration::from_secs(5), Duration::ZERO)
        .await
        .unwrap();
    let worker = DurableWorker::new(queue.clone(), server.locker().await).register::<RecordJob>();
    dlock_tests::wait::wait_for("a dead letter", Duration::from_secs(10), async || {
        worker.run_once().await.unwrap();
        (!queue.dead_letters().await.unwrap().is_empty()).then_some(())
    })
    .await;
    let out = dlock(Some(&url), &["jobs", "--queue", "esc", "dead"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let printed = stdout(&out);
    assert!(
        !out.stdout.iter().any(|b| *b < 0x20 && *b != b'\n'),
        "a control character reached the terminal: {printed:?}"
    );
    assert!(printed.contains("\\u{1b}]0;pwned\\u{7} boom"), "{printed}");
}

/// `--timeout` past what a wait can mean (it panicked multiplying it: exit 101) or zero is a
/// usage error, exit 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_out_of_range_is_a_usage_error() {
    for timeout in ["18446744073709551615s", "2days", "0s"] {
        let out = dlock(Some("memory://"), &["--timeout", timeout, "inspect", "a"]).await;
        assert_eq!(out.status.code(), Some(2), "{timeout}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("from 1ms to 1day"),
            "{}",
            stderr(&out)
        );
        assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
    }
    let out = dlock(Some("memory://"), &["--timeout", "1day", "inspect", "a"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

/// Zero for `--limit` or `--count`, and a `--interval` under 100 ms, are usage errors (exit 2):
/// `list --limit 0` said "no locks held" while locks were, `watch --count 0` refreshed once all
/// the same, and `watch --interval 0s` scanned the backend in a busy loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_limits_and_counts_and_short_intervals_are_usage_errors() {
    for (args, says) in [
        (&["list", "--limit", "0"][..], "at least 1"),
        (&["watch", "--count", "0"][..], "at least 1"),
        (
            &["watch", "--interval", "0s", "--count", "1"][..],
            "from 100ms",
        ),
        (
            &["watch", "--interval", "50ms", "--count", "1"][..],
            "from 100ms",
        ),
    ] {
        let out = dlock(Some("memory://"), args).await;
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
    for args in [
        &["list", "--limit", "1"][..],
        &["watch", "--interval", "100ms", "--count", "1"][..],
    ] {
        let out = dlock(Some("memory://"), args).await;
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    }
}

/// Ctrl-C (SIGINT) while `watch` refreshes — here a refresh stuck on a frozen server — ends it
/// at once, with success. The first Ctrl-C listener installs tokio's handler for good (SIGINT
/// no longer ends the process), and `watch` listened only between refreshes: a Ctrl-C during
/// one was lost, and it ran on until the refresh timed out (exit 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_during_a_refresh_ends_watch_at_once() {
    use tokio::io::AsyncBufReadExt as _;

    let mut server = RedisServer::start();
    let mut child = spawn(
        &server.url(),
        &["--timeout", "20s", "watch", "--interval", "100ms"],
    );
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.next_line().await.unwrap().is_some(),
        "a first refresh"
    );
    server.pause();
    // The next refresh starts 100 ms after the first and waits on the frozen server; nothing
    // outside the process tells when it began, so give it three intervals.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = child.id().unwrap().to_string();
    let sent = Instant::now();
    let kill = std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = tokio::time::timeout(Duration::from_secs(5), child.wait_with_output())
        .await
        .expect("watch ends at Ctrl-C during a refresh")
        .unwrap();
    server.resume();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(sent.elapsed() < Duration::from_secs(5));
}

/// Output piped into a reader that stops early (`dlock watch | head -n1`): `dlock` ends quietly
/// with success. It panicked ("failed printing to stdout: Broken pipe", exit 101).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_ends_the_command_quietly() {
    use tokio::io::AsyncBufReadExt as _;

    let mut child = spawn(
        "memory://",
        &["watch", "--interval", "100ms", "--count", "1000"],
    );
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next_line().await.unwrap();
    assert!(first.is_some(), "a first line");
    drop(lines);
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("dlock ends once its stdout is closed")
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_urls_and_unreachable_servers_exit_2_within_the_timeout() {
    let out = dlock(None, &["inspect", "k"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("DLOCK_URL"), "{}", stderr(&out));

    let out = dlock(Some("nosuch://x"), &["list"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("unsupported locker url scheme"),
        "{}",
        stderr(&out)
    );

    let out = dlock(Some("redis://user:secret@127.0.0.1:notaport"), &["list"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(!stderr(&out).contains("secret"), "{}", stderr(&out));

    // Nothing listens there: a typed error within the timeout, never a hang.
    for scheme in ["redis", "postgres", "etcd", "zk"] {
        let url = match scheme {
            "postgres" => format!("postgres://u:secret@127.0.0.1:{}/db", free_port()),
            _ => format!("{scheme}://127.0.0.1:{}", free_port()),
        };
        let start = Instant::now();
        let out = dlock(Some(&url), &["--timeout", "1s", "inspect", "k"]).await;
        assert_eq!(out.status.code(), Some(2), "{scheme}: {}", stderr(&out));
        assert!(!stderr(&out).is_empty());
        assert!(!stderr(&out).contains("secret"), "{}", stderr(&out));
        assert!(
            start.elapsed() < Duration::from_secs(8),
            "{scheme}: took {:?}",
            start.elapsed()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_locks() {
    let url = dlock_tests::postgres_server::shared()
        .lock()
        .unwrap()
        .url("postgres");
    locks_through_the_cli(&url, "invoice:7").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_locks() {
    let url = dlock_tests::etcd_server::shared().lock().unwrap().url();
    locks_through_the_cli(&url, "payout:3").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_locks() {
    let url = dlock_tests::zookeeper_server::shared()
        .lock()
        .unwrap()
        .url();
    locks_through_the_cli(&url, "refund:5").await;
}
