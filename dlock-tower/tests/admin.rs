//! The ops page (`dlock_tower::admin`, features `admin` + `defer`) over a real HTTP server and a
//! live Redis from the `dlock-tests` harness, with held locks, a queued waiter, contended
//! attempts, a deferred job and a dead letter: the JSON endpoints through an HTTP client, and
//! the HTML page in a real headless Chromium (Debian's `chromium`, installed by
//! `./scripts/test`), which also saves a screenshot to `<target dir>/ops-page.png`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use axum::Router;
use dlock_runtime::durable::{DurableQueue, DurableWorker};
use dlock_runtime::{DeferPolicy, LockError, LockGuard, LockKey, OnFail, RetryPolicy};
use dlock_tests::http::{client, serve, text};
use dlock_tests::jobs::RecordJob;
use dlock_tests::wait::wait_for;
use dlock_tests::RedisServer;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::Full;
use serde_json::Value;
use tokio::task::JoinHandle;

/// What the page is looked at with. Fields are kept alive for the test.
#[allow(dead_code)]
struct Fixture {
    server: RedisServer,
    addr: SocketAddr,
    held: Vec<LockGuard>,
    waiter: JoinHandle<Result<LockGuard, LockError>>,
    dead_id: String,
    deferred_id: String,
    queue: DurableQueue,
}

async fn fixture() -> Fixture {
    let server = RedisServer::start();
    let url = server.url();
    let locker = server.locker().await;
    let other = server.locker().await;
    let ttl = Duration::from_secs(60);
    let held = vec![
        locker.lock("order:1").ttl(ttl).acquire().await.unwrap(),
        locker
            .lock("report:2026-11")
            .ttl(ttl)
            .acquire()
            .await
            .unwrap(),
    ];
    let waiter = {
        let other = other.clone();
        tokio::spawn(async move {
            other
                .lock("order:1")
                .ttl(ttl)
                .on_fail(OnFail::Retry(RetryPolicy::new(Duration::from_secs(60))))
                .acquire()
                .await
        })
    };
    let admin = locker.admin().unwrap();
    wait_for(
        "the waiter is queued",
        Duration::from_secs(10),
        async || (admin.inspect("order:1").await.unwrap().waiters.len() == 1).then_some(()),
    )
    .await;
    // Contended attempts of this locker: what the page's contention view counts.
    for _ in 0..3 {
        assert!(locker
            .lock("order:1")
            .try_acquire()
            .await
            .unwrap()
            .is_none());
    }

    let queue = DurableQueue::connect(&url, "mail").await.unwrap();
    let job = |id, fail| RecordJob {
        id,
        lock: format!("j{id}"),
        record_url: url.clone(),
        always_fail: fail,
        ..Default::default()
    };
    let policy = DeferPolicy::new(Duration::ZERO, 1);
    let dead_id = queue
        .enqueue(&job(1, true), &policy, ttl, Duration::ZERO)
        .await
        .unwrap();
    let worker = DurableWorker::new(queue.clone(), other).register::<RecordJob>();
    wait_for("a dead letter", Duration::from_secs(10), async || {
        worker.run_once().await.unwrap();
        (!queue.dead_letters().await.unwrap().is_empty()).then_some(())
    })
    .await;
    let deferred_id = queue
        .enqueue(&job(2, false), &policy, ttl, Duration::from_secs(3600))
        .await
        .unwrap();

    let ops = dlock_tower::admin::OpsPage::new(locker)
        .durable_queue(queue.clone())
        .router();
    let (addr, _) = serve(Router::new().nest("/ops", ops)).await;
    Fixture {
        server,
        addr,
        held,
        waiter,
        dead_id,
        deferred_id,
        queue,
    }
}

async fn request(method: Method, url: String) -> (StatusCode, String) {
    let (status, _, body) = request_with(method, url, &[]).await;
    (status, body)
}

/// A request with `headers`; its status, headers and body.
async fn request_with(
    method: Method,
    url: String,
    headers: &[(&str, &str)],
) -> (StatusCode, HeaderMap, String) {
    let mut req = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let res = client()
        .request(req.body(Full::default()).unwrap())
        .await
        .unwrap();
    let (status, headers) = (res.status(), res.headers().clone());
    (status, headers, text(res).await)
}

async fn get_json(url: String) -> Value {
    let (status, body) = request(Method::GET, url).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Past 500 locks, `/api/locks` answers the first 500 and says it cut them
/// (`x-dlock-truncated: 500`), and the page says there are more; at 500, neither. Before, both
/// cut at 500 without a word, and a client could not tell the first 500 from all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_lock_list_says_it_was_cut() {
    let locker = dlock_runtime::Locker::memory();
    let ttl = Duration::from_secs(60);
    let mut held = Vec::new();
    for n in 0..501 {
        let key = format!("many:{n:03}");
        held.push(locker.lock(key.as_str()).ttl(ttl).acquire().await.unwrap());
    }
    // Every page load lists the locks anew.
    let ops = dlock_tower::admin::OpsPage::new(locker).listing_spacing(Duration::ZERO);
    let (addr, _) = serve(Router::new().nest("/ops", ops.router())).await;
    let base = format!("http://{addr}/ops");
    let look = async || {
        let (status, headers, body) =
            request_with(Method::GET, format!("{base}/api/locks"), &[]).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let listed = serde_json::from_str::<Value>(&body).unwrap();
        let cut = headers
            .get("x-dlock-truncated")
            .map(|v| v.to_str().unwrap().to_owned());
        let (_, page) = request(Method::GET, base.clone()).await;
        (listed.as_array().unwrap().len(), cut, page)
    };
    let (listed, cut, page) = look().await;
    assert_eq!(listed, 500);
    assert_eq!(cut.as_deref(), Some("500"));
    assert!(
        page.contains(r#"<span id="lock-count">500</span>"#),
        "{page}"
    );
    assert!(page.contains("there are more"), "the page does not say so");
    held.pop().unwrap().release().await.unwrap();
    let (listed, cut, page) = look().await;
    assert_eq!(listed, 500);
    assert_eq!(cut, None);
    assert!(
        page.contains(r#"<span id="lock-count">500</span>"#),
        "{page}"
    );
    assert!(!page.contains("there are more"));
}

/// The `SCAN` calls the Redis at `url` has answered.
async fn scans(url: &str) -> u64 {
    let mut conn = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_scan:calls="))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

/// A lock listing reads the whole keyspace on Redis (`SCAN`), and every open page reloads
/// itself: page loads within the listing spacing — in a row and at once — share one listing
/// (the server's `SCAN` count moves for the first only), say how old it is, and the page
/// refreshes itself as often as it lists; `/api/locks` lists anew on every call. (Every page
/// load listed the keyspace.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_loads_within_the_listing_spacing_share_one_listing() {
    let server = RedisServer::start();
    let url = server.url();
    let locker = server.locker().await;
    let ttl = Duration::from_secs(60);
    let _a = locker.lock("spaced:a").ttl(ttl).acquire().await.unwrap();
    let ops = dlock_tower::admin::OpsPage::new(locker.clone())
        .listing_spacing(Duration::from_secs(60))
        .router();
    let (addr, _) = serve(Router::new().nest("/ops", ops)).await;
    let page = format!("http://{addr}/ops");

    let before = scans(&url).await;
    let (status, first) = request(Method::GET, page.clone()).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert!(first.contains(r#"data-key="spaced:a""#), "{first}");
    assert!(!first.contains("listed-ago"), "{first}");
    assert!(
        first.contains(r#"<meta http-equiv="refresh" content="60">"#),
        "the page refreshes as often as it lists: {first}"
    );
    let one_listing = scans(&url).await - before;
    assert!(one_listing > 0, "the first load listed nothing");

    // Taken after the listing: not on the pages that show it again.
    let _b = locker.lock("spaced:b").ttl(ttl).acquire().await.unwrap();
    // Time passes, for the page to tell the listing's age.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let at_once: Vec<_> = (0..4)
        .map(|_| tokio::spawn(request(Method::GET, page.clone())))
        .collect();
    for load in at_once {
        let (status, body) = load.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.contains(r#"data-key="spaced:a""#), "{body}");
        assert!(!body.contains(r#"data-key="spaced:b""#), "{body}");
        assert!(
            body.contains(r#"id="listed-ago">as listed 1 s ago"#),
            "{body}"
        );
    }
    assert_eq!(
        scans(&url).await - before,
        one_listing,
        "page loads within the spacing listed the keyspace again"
    );

    let listed = get_json(format!("{page}/api/locks")).await;
    let keys: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys.len(), 2, "{listed}");
    assert!(keys.contains(&"spaced:b"), "{listed}");
    assert!(
        scans(&url).await - before > one_listing,
        "/api/locks did not list"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_endpoints_over_http() {
    let f = fixture().await;
    let base = format!("http://{}/ops", f.addr);

    let locks = get_json(format!("{base}/api/locks")).await;
    let locks = locks.as_array().unwrap();
    assert_eq!(locks.len(), 2, "{locks:?}");
    let order = locks.iter().find(|l| l["key"] == "order:1").unwrap();
    assert_eq!(order["holder"]["token_prefix"].as_str().unwrap().len(), 8);
    assert_eq!(order["waiters"].as_array().unwrap().len(), 1);
    let only = get_json(format!("{base}/api/locks?prefix=report%3A")).await;
    assert_eq!(only.as_array().unwrap().len(), 1);
    assert_eq!(only[0]["key"], "report:2026-11");

    let one = get_json(format!("{base}/api/locks/order:1")).await;
    assert!(one["holder"]["ttl_left_ms"].as_u64().unwrap() > 0);
    let free = get_json(format!("{base}/api/locks/nobody:here")).await;
    assert!(free["holder"].is_null() && free["waiters"] == Value::Array(vec![]));

    let c = get_json(format!("{base}/api/contention?minutes=5")).await;
    assert_eq!(c["window_secs"], 300);
    assert_eq!(c["keys"][0]["key"], "order:1");
    assert_eq!(c["keys"][0]["count"], 3);
    assert_eq!(c["per_minute"].as_array().unwrap().len(), 5);
    assert_eq!(c["per_minute"][4], 3, "this minute's attempts: {c}");

    let jobs = get_json(format!("{base}/api/jobs")).await;
    let mail = jobs
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["queue"] == "mail")
        .unwrap();
    assert_eq!(mail["dead"][0]["id"], f.dead_id.as_str());
    assert!(mail["dead"][0]["reason"]
        .as_str()
        .unwrap()
        .contains("always fails"));
    assert_eq!(mail["deferred"][0]["id"], f.deferred_id.as_str());
    assert_eq!(
        (mail["deferred_total"].as_u64(), mail["dead_total"].as_u64()),
        (Some(1), Some(1))
    );

    let (status, body) = request(
        Method::POST,
        format!("{base}/api/jobs/{}/requeue", f.dead_id),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(f.queue.dead_letters().await.unwrap().is_empty());
    assert_eq!(f.queue.len().await.unwrap(), 2, "requeued job is due again");
    let (status, _) = request(
        Method::POST,
        format!("{base}/api/jobs/{}/requeue", f.dead_id),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // The page's button: a form POST answered with a redirect back to the page.
    let req = Request::post(format!("{base}/requeue/nope"))
        .body(Full::default())
        .unwrap();
    let res = client().request(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER);
    assert_eq!(res.headers()["location"], "/ops");
}

/// Debian's `chromium`: `./scripts/test` installs it; missing, the test fails loudly.
fn chromium() -> PathBuf {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("chromium is not installed: run ./scripts/test (it installs Debian's `chromium`)")
}

async fn headless(args: &[String]) -> String {
    let profile = std::env::temp_dir().join(format!("dlock-chromium-{}", std::process::id()));
    let out = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::process::Command::new(chromium())
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-proxy-server",
                "--hide-scrollbars",
                &format!("--user-data-dir={}", profile.display()),
            ])
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("chromium finishes")
    .expect("run chromium");
    let _ = std::fs::remove_dir_all(&profile);
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        !args.iter().any(|a| a == "--dump-dom") || !stdout.is_empty(),
        "chromium printed no DOM: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The build's target directory (where CI collects artifacts).
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chromium_renders_the_page() {
    let f = fixture().await;
    let page = format!("http://{}/ops", f.addr);

    let dom = headless(&["--dump-dom".to_owned(), page.clone()]).await;
    assert!(dom.contains("<h1>dlock ops</h1>"), "{dom}");
    assert!(dom.contains(r#"<b id="backend">redis</b>"#), "{dom}");
    assert!(dom.contains(r#"<span id="lock-count">2</span>"#), "{dom}");
    assert!(
        dom.contains(r#"<tr class="lock" data-key="order:1" data-waiters="1">"#),
        "{dom}"
    );
    assert!(
        dom.contains(r#"<tr class="lock" data-key="report:2026-11" data-waiters="0">"#),
        "{dom}"
    );
    assert!(
        dom.contains(r#"<span id="contention-total">3</span>"#),
        "{dom}"
    );
    assert!(
        dom.contains(r#"<tr class="contended" data-key="order:1">"#),
        "{dom}"
    );
    assert!(
        dom.contains(&format!(r#"<tr class="dead" data-id="{}">"#, f.dead_id)),
        "{dom}"
    );
    assert!(
        dom.contains(&format!(r#"action="/ops/requeue/{}""#, f.dead_id)),
        "{dom}"
    );
    assert!(
        dom.contains(&format!(
            r#"<tr class="deferred" data-id="{}">"#,
            f.deferred_id
        )),
        "{dom}"
    );
    assert!(!dom.contains("<script"), "no JavaScript on the page");
    assert!(
        !dom.contains("src=\"http") && !dom.contains("href=\"http"),
        "nothing loaded from elsewhere"
    );

    let shot = target_dir().join("ops-page.png");
    let _ = std::fs::remove_file(&shot);
    headless(&[
        format!("--screenshot={}", shot.display()),
        "--window-size=1100,1000".to_owned(),
        page,
    ])
    .await;
    let png = std::fs::read(&shot).expect("the screenshot");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
    assert!(
        png.len() > 10_000,
        "a page, not a blank: {} bytes",
        png.len()
    );
}

/// `s` percent-encoded for a URL path segment or query value (all but `A-Z a-z 0-9 - . _ ~ :`).
fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b':' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A key shown encoded (`user:1%3A2`, `a%23b%20c`, `100%25`, a digested key whose cut splits an
/// escape) is found by `GET /api/locks/<key>` and `?prefix=` as shown; literal text still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_looked_up_as_shown() {
    let server = RedisServer::start();
    let locker = server.locker().await;
    let ttl = Duration::from_secs(60);
    let valued = LockKey::builder()
        .lit("user:")
        .value("1:2")
        .finish()
        .unwrap();
    // 95 bytes, then `%25`: the digest's cut after 96 bytes leaves `…%` before the `#`.
    let long = format!("{}%{}", "k".repeat(95), "x".repeat(200));
    let mut held = vec![locker.lock(&valued).ttl(ttl).acquire().await.unwrap()];
    for literal in ["a#b c", "100%", long.as_str()] {
        held.push(locker.lock(literal).ttl(ttl).acquire().await.unwrap());
    }
    let shown: Vec<String> = held.iter().map(|g| g.key().to_owned()).collect();
    assert_eq!(shown[..3], ["user:1%3A2", "a%23b%20c", "100%25"]);
    assert!(
        shown[3].starts_with(&format!("{}%#", "k".repeat(95))),
        "{}",
        shown[3]
    );

    let (addr, _) = serve(Router::new().nest("/ops", dlock_tower::admin::router(locker))).await;
    let base = format!("http://{addr}/ops");
    let all = get_json(format!("{base}/api/locks")).await;
    let mut listed: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["key"].as_str().unwrap())
        .collect();
    listed.sort_unstable();
    let mut expected: Vec<&str> = shown.iter().map(String::as_str).collect();
    expected.sort_unstable();
    assert_eq!(listed, expected, "the page shows encoded keys");

    for key in &shown {
        let one = get_json(format!("{base}/api/locks/{}", url_encode(key))).await;
        assert_eq!(one["key"], key.as_str(), "{one}");
        assert!(one["holder"].is_object(), "`{key}` as shown is held: {one}");
    }
    for literal in ["a#b c", "100%"] {
        let one = get_json(format!("{base}/api/locks/{}", url_encode(literal))).await;
        assert!(one["holder"].is_object(), "literal `{literal}`: {one}");
    }
    let other = get_json(format!("{base}/api/locks/{}", url_encode("user:1:2"))).await;
    assert!(
        other["holder"].is_null(),
        "`user:1:2` is another key: {other}"
    );

    let prefixed = |prefix: &str| {
        let url = format!("{base}/api/locks?prefix={}", url_encode(prefix));
        async move {
            let locks = get_json(url).await;
            locks
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l["key"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(prefixed("user:1%3A").await, ["user:1%3A2"]);
    assert_eq!(prefixed("a%23").await, ["a%23b%20c"]);
    assert_eq!(prefixed("a#b").await, ["a%23b%20c"], "literal prefix");
    assert_eq!(prefixed("100%").await, ["100%25"], "literal prefix");
    assert_eq!(prefixed(&shown[3][..110]).await, [shown[3].clone()]);
    assert!(prefixed("user:1:").await.is_empty());
}

/// The page's requeue form works from the page's own origin (the headers a browser sends with
/// it); the same POST from another site, to the form's route or the JSON one, is refused with
/// `403` and requeues nothing. The page may not be framed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_origin_posts_are_refused_and_the_page_cannot_be_framed() {
    let f = fixture().await;
    let base = format!("http://{}/ops", f.addr);
    let form = format!("{base}/requeue/{}", f.dead_id);
    let json = format!("{base}/api/jobs/{}/requeue", f.dead_id);
    let own_origin = format!("http://{}", f.addr);
    let other_port = format!("http://127.0.0.1:{}", f.addr.port() ^ 1);
    let form_post = [("content-type", "application/x-www-form-urlencoded")];

    let refused: [(&str, Vec<(&str, &str)>); 6] = [
        (
            &form,
            vec![
                ("sec-fetch-site", "cross-site"),
                ("origin", "https://evil.example"),
            ],
        ),
        (&form, vec![("origin", "https://evil.example")]),
        (&form, vec![("origin", other_port.as_str())]),
        (&form, vec![("origin", "null")]),
        (&json, vec![("sec-fetch-site", "same-site")]),
        (&json, vec![("origin", "https://evil.example")]),
    ];
    for (url, headers) in refused {
        let headers = [&form_post[..], &headers].concat();
        let (status, _, body) = request_with(Method::POST, url.to_owned(), &headers).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{url} {headers:?}: {body}");
        assert!(body.contains("cross-origin"), "{body}");
        let dead = f.queue.dead_letters().await.unwrap();
        assert_eq!(dead.len(), 1, "{headers:?}: requeued anyway");
        assert_eq!(dead[0].id, f.dead_id);
    }

    let (status, headers, body) = request_with(
        Method::POST,
        form,
        &[
            ("content-type", "application/x-www-form-urlencoded"),
            ("origin", own_origin.as_str()),
            ("sec-fetch-site", "same-origin"),
            ("sec-fetch-mode", "navigate"),
            ("sec-fetch-dest", "document"),
        ],
    )
    .await;
    assert_eq!(status, StatusCode::SEE_OTHER, "{body}");
    assert_eq!(headers["location"], "/ops");
    assert!(f.queue.dead_letters().await.unwrap().is_empty(), "requeued");

    let (status, headers, _) = request_with(Method::GET, base, &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["x-frame-options"], "DENY");
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert!(csp.contains("form-action 'self'"), "{csp}");
}

/// With an allow-list of host names, a request naming another host — what a browser sends
/// after DNS rebinding pointed the attacker's name at the page's address — is answered `421`,
/// reads and changes alike, over a real server; the listed names (any port for a bare name,
/// only its own for `name:port`) are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_allowed_host_names_are_served() {
    let ops = dlock_tower::admin::OpsPage::new(dlock_runtime::Locker::memory())
        .allowed_hosts(["ops.internal.example", "localhost:8081"])
        .unwrap()
        .router();
    let (addr, _) = serve(Router::new().nest("/ops", ops)).await;
    let base = format!("http://{addr}/ops");
    let ask = |method: Method, path: &str, host: &str| {
        let url = format!("{base}{path}");
        let host = host.to_owned();
        async move { request_with(method, url, &[("host", host.as_str())]).await }
    };
    for host in [
        "evil.example",
        "evil.example:8081",
        "localhost",
        "localhost:8082",
        "127.0.0.1",
    ] {
        for (method, path) in [
            (Method::GET, ""),
            (Method::GET, "/api/locks"),
            (Method::POST, "/api/jobs/1/requeue"),
        ] {
            let (status, _, body) = ask(method.clone(), path, host).await;
            assert_eq!(
                status,
                StatusCode::MISDIRECTED_REQUEST,
                "{method} {path} as {host}: {body}"
            );
        }
    }
    // An absolute-form request names its host twice; each name must be allowed (a server may
    // go by either).
    let raw = async |target: &str, host: &str| {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!("GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        conn.write_all(head.as_bytes()).await.unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).await.unwrap();
        answer.lines().next().unwrap_or_default().to_owned()
    };
    let status = raw("http://evil.example/ops/api/locks", "localhost:8081").await;
    assert!(status.contains(" 421 "), "{status}");
    let status = raw("http://localhost:8081/ops/api/locks", "evil.example").await;
    assert!(status.contains(" 421 "), "{status}");
    let status = raw("http://localhost:8081/ops/api/locks", "localhost:8081").await;
    assert!(status.contains(" 200 "), "{status}");

    for host in [
        "ops.internal.example",
        "OPS.internal.example.:9000",
        "localhost:8081",
    ] {
        let (status, _, body) = ask(Method::GET, "/api/locks", host).await;
        assert_eq!(status, StatusCode::OK, "as {host}: {body}");
        let (status, _, body) = ask(Method::GET, "", host).await;
        assert_eq!(status, StatusCode::OK, "as {host}: {body}");
        assert!(body.contains("<html"), "{body}");
    }
}

/// A queue with more jobs than the page shows (it refreshes itself every 5 s, and a dead-letter
/// set can hold millions): the page and `/api/jobs` show the first 500 and say how many there
/// are in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_job_list_is_cut_and_counted() {
    let server = RedisServer::start();
    let queue = DurableQueue::connect(&server.url(), "many").await.unwrap();
    let policy = DeferPolicy::new(Duration::ZERO, 1);
    let mut first = None;
    for id in 0..501 {
        let job = RecordJob {
            id,
            lock: format!("m{id}"),
            record_url: server.url(),
            ..Default::default()
        };
        let delay = Duration::from_secs(3600 + u64::from(id));
        let enqueued = queue
            .enqueue(&job, &policy, Duration::from_secs(5), delay)
            .await
            .unwrap();
        first.get_or_insert(enqueued);
    }
    let ops = dlock_tower::admin::OpsPage::new(server.locker().await)
        .durable_queue(queue.clone())
        .router();
    let (addr, _) = serve(Router::new().nest("/ops", ops)).await;
    let jobs = get_json(format!("http://{addr}/ops/api/jobs")).await;
    let many = jobs
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["queue"] == "many")
        .unwrap();
    assert_eq!(many["deferred"].as_array().map(Vec::len), Some(500));
    assert_eq!(many["deferred_total"], 501);
    assert_eq!(many["deferred"][0]["id"], first.unwrap().as_str());
    assert_eq!(
        (
            many["dead"].as_array().map(Vec::len),
            many["dead_total"].as_u64()
        ),
        (Some(0), Some(0))
    );
    let (status, page) = request(Method::GET, format!("http://{addr}/ops")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        page.contains("first 500 of 501 deferred · 0 dead"),
        "{page}"
    );
}
