//! The ops page (feature `admin`): an axum [`Router`] with JSON endpoints and one small HTML
//! page showing the locks held, who waits, what was contended over the last minutes, and the
//! deferred and dead-lettered jobs, with a requeue button.
//!
//! # ⚠ Mount it behind your own authentication
//!
//! The router has **no authentication of its own**. It shows lock keys (which may carry
//! identifiers from requests) and lets whoever reaches it requeue jobs. Mount it under a path
//! that only operators reach — behind the same auth layer as your other admin routes — never on
//! the public router as is. An internal listener alone is not enough: it refuses cross-site
//! posts, but a page an operator's browser opens can rebind its own host name to the internal
//! address (DNS rebinding) and then reads and posts as same-origin; put authentication, or at
//! least a check of the `Host` header against the names you serve it under
//! ([`OpsPage::allowed_hosts`]), in front there too.
//!
//! ```
//! # async fn f() {
//! use axum::Router;
//! use dlock_runtime::Locker;
//!
//! let locker = Locker::memory();
//! let app: Router = Router::new()
//!     // .route(...) your service
//!     .nest("/ops/dlock", dlock_tower::admin::router(locker.clone()));
//!     // .layer(your_admin_auth_layer)   <- required in production
//! # let _ = app; }
//! ```
//!
//! | route | answers |
//! |---|---|
//! | `GET /` | (the path the router is nested at, e.g. `/ops/dlock`) the HTML page: server-rendered, no JavaScript, no external resources; refreshes itself every 5 s, or as often as it lists the locks when that is rarer ([`OpsPage::listing_spacing`]: page loads share one listing) |
//! | `GET /api/locks?prefix=<key prefix>` | the held or waited-for locks (`dlock_runtime::admin::LockState`, JSON): the first 500; when there are more, the answer says so in the header `x-dlock-truncated: 500` (narrow it with `prefix`, or page through them all with `dlock list`) |
//! | `GET /api/locks/<key>` | one lock (`<key>` percent-encoded like any path segment) |
//! | `GET /api/contention?minutes=<n>` | this process's contended acquire attempts of the last `n` minutes (default 10), per key and per minute |
//! | `GET /api/jobs` | the locker's in-process deferred jobs and dead letters, and those of the durable queues given to [`OpsPage::durable_queue`]: the first 500 of each list, with `deferred_total` and `dead_total` counting them all |
//! | `POST /api/jobs/<id>/requeue` | puts a dead letter back (`404` when there is none with that id) |
//! | `POST /requeue/<id>` | the same for the page's button, answered with a redirect to the page |
//!
//! # Keys as shown
//!
//! The page and `/api/locks` show each lock's *encoded* key
//! ([`LockKey::as_str`](dlock_runtime::LockKey::as_str)): `user:1%3A2` for a key built from the
//! value `1:2`, `a%23b` for the literal key `a#b`, a long key as a prefix, `#` and a digest.
//! `GET /api/locks/<key>` and `?prefix=` take a key or prefix **as shown**, or a literal one:
//! text that is an encoded key (every `%` starts a `%XX` escape, no character the encoder
//! escapes, `#` only as the digest marker) is taken as is; any other text (`a b`, `100%`) is a
//! literal key, encoded as the locker encodes it
//! ([`dlock_runtime::admin::key_as_shown`], [`Admin::list`](dlock_runtime::admin::Admin::list)).
//! The URL decodes first, as always: `user:1%3A2` is requested as `/api/locks/user:1%253A2`.
//!
//! # Cross-origin requests are refused
//!
//! Every request that changes something (any method but `GET`, `HEAD` and `OPTIONS`) is
//! answered `403` when a browser sent it from another site, so that a page elsewhere cannot
//! make an operator's browser requeue jobs (cross-site request forgery): with a
//! `Sec-Fetch-Site` header, unless it is `same-origin` or `none` (typed by the user); without
//! one, when its `Origin` names another host and port than the request's `Host`. Requests with
//! neither header (curl, scripts, other services) pass — this is no authentication, it only
//! stops browsers from being used against yours. Behind a proxy that rewrites `Host`, have it
//! pass the browser's (nginx: `proxy_set_header Host $host;`), or browsers that send `Origin`
//! without `Sec-Fetch-Site` are refused on the page's own forms. The page itself is sent with
//! `X-Frame-Options: DENY` and a `Content-Security-Policy` (`frame-ancestors 'none'`, inline
//! styles only, forms to its own origin), so it cannot be framed and clicked through by another
//! site (clickjacking).
//!
//! # Host names
//!
//! [`OpsPage::allowed_hosts`] answers only requests whose `Host` and URI authority (an
//! absolute-form request, HTTP/2), each one given, name the page as you serve it — `421
//! Misdirected Request` to every other, reads included. A rebound name (`evil.example` resolving to your internal address) then
//! reaches nothing. Without it, any `Host` is answered.
//!
//! ```
//! # fn f() -> Result<(), dlock_runtime::LockError> {
//! use dlock_tower::admin::OpsPage;
//!
//! let ops = OpsPage::new(dlock_runtime::Locker::memory())
//!     .allowed_hosts(["ops.internal.example", "localhost:8081"])?
//!     .router();
//! # let _ = ops; Ok(()) }
//! ```
//!
//! Lock data comes from the backend's inspection capability
//! ([`Locker::admin`](dlock_runtime::Locker::admin)); a backend without it (Redlock) answers
//! `501` on the lock endpoints. Contention is this process's own (the locker's ring of recent
//! contended attempts, [`Locker::recent_contention`](dlock_runtime::Locker::recent_contention)):
//! every instance shows its own.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{OriginalUri, Path, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use dlock_runtime::admin::{key_as_shown, LockState};
use dlock_runtime::defer::JobInfo;
use dlock_runtime::Locker;
use serde_json::{json, Value};

mod page;

/// How many locks the page and `/api/locks` show at most.
const MAX_LOCKS: usize = 500;

/// The header of a `/api/locks` answer cut at [`MAX_LOCKS`]: how many it holds.
const TRUNCATED: http::HeaderName = http::HeaderName::from_static("x-dlock-truncated");

/// How many jobs of each list (deferred, dead) of each queue the page and `/api/jobs` show at
/// most; `deferred_total` and `dead_total` count them all.
const MAX_JOBS: usize = 500;

/// The page's `Content-Security-Policy`: it loads nothing, styles itself inline, posts its
/// forms to its own origin, and no other page may frame it.
const PAGE_CSP: &str =
    "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'";

/// The ops router over `locker` (see the [module docs](self)); mount it behind your own auth.
pub fn router(locker: Locker) -> Router {
    OpsPage::new(locker).router()
}

/// The ops page's settings: the locker, the durable queues whose jobs it shows, and the host
/// names it answers under.
#[derive(Clone, Debug)]
pub struct OpsPage {
    locker: Locker,
    #[cfg(feature = "defer")]
    queues: Vec<dlock_runtime::durable::DurableQueue>,
    window: Duration,
    /// `None`: any `Host`.
    hosts: Option<Arc<[AllowedHost]>>,
    /// The least time between two lock listings of the page ([`OpsPage::listing_spacing`]).
    spacing: Duration,
    /// The page's last lock listing, shared by the page loads that follow within its spacing.
    listed: Arc<tokio::sync::Mutex<Option<Listed>>>,
}

/// A lock listing of the page: the locks (one more than shown when there are more), when it
/// was read and how long that took.
#[derive(Debug)]
struct Listed {
    locks: Arc<Vec<LockState>>,
    at: std::time::Instant,
    took: Duration,
}

/// How many times as long as a listing took the page waits before the next one (at least its
/// [spacing](OpsPage::listing_spacing)): the open pages keep the store busy for a tenth of the
/// time at most, however many there are.
const LISTING_DUTY: u32 = 10;

/// The longest time between two lock listings of the page, and between two of its refreshes.
const MAX_SPACING: Duration = Duration::from_secs(300);

/// How often the page refreshes itself at most.
const PAGE_REFRESH: Duration = Duration::from_secs(5);

/// One entry of [`OpsPage::allowed_hosts`]: a host name (lowercase, no final dot) and the port,
/// when one was given.
#[derive(Clone, Debug, PartialEq, Eq)]
struct AllowedHost {
    name: String,
    port: Option<u16>,
}

impl AllowedHost {
    /// `host` or `host:port` (`[v6]:port` too); `None` for anything else.
    fn parse(s: &str) -> Option<Self> {
        if s.contains('@') {
            return None;
        }
        let authority: axum::http::uri::Authority = s.parse().ok()?;
        let name = authority.host();
        let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
        (!name.is_empty()).then_some(AllowedHost {
            name,
            port: authority.port_u16(),
        })
    }

    /// Whether `requested` (a request's `Host`) is this entry: the same name, and the same
    /// port when the entry names one.
    fn admits(&self, requested: &AllowedHost) -> bool {
        self.name == requested.name && self.port.is_none_or(|p| requested.port == Some(p))
    }
}

impl OpsPage {
    /// The page over `locker`, showing contention over the last 10 minutes.
    pub fn new(locker: Locker) -> Self {
        OpsPage {
            locker,
            #[cfg(feature = "defer")]
            queues: Vec::new(),
            window: Duration::from_secs(600),
            hosts: None,
            spacing: Duration::from_secs(2),
            listed: Arc::default(),
        }
    }

    /// The least time between two listings of the locks by the page (default 2 s; at most
    /// 5 min). Listing reads the store's whole keyspace on Redis (`SCAN`), and every open page
    /// reloads itself: the page lists at most once per `max(spacing, 10 × the last listing's
    /// duration)`, and page loads within that — every tab's, and the refreshes — show the last
    /// listing and say how old it is; concurrent loads wait for the one listing. The page
    /// refreshes itself every `max(5 s, that time)`. `/api/locks` lists anew on every call.
    /// `Duration::ZERO`: every page load lists anew, as `/api/locks` does.
    pub fn listing_spacing(mut self, spacing: Duration) -> Self {
        self.spacing = spacing.min(MAX_SPACING);
        self
    }

    /// Answers only requests whose `Host` and URI authority (each one the request gives; it
    /// must give one) are among `hosts`, and `421 Misdirected Request` to every other (see [Host names](self#host-names)): the defence against DNS rebinding where
    /// the page has no authentication in front. Each entry is a host name or address, which
    /// admits it on any port (`ops.example`, `10.0.0.5`, `[::1]`), or `host:port`, which
    /// admits that port only (a browser leaves `:80` and `:443` out of `Host`: name those ports
    /// by leaving the port off). Names compare without case and without a final dot. Calling it
    /// again replaces the list; an empty list admits nothing.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`](dlock_runtime::LockError::Misconfigured) naming the first
    /// entry that is not a host or `host:port` (a URL, a path, user info, spaces).
    pub fn allowed_hosts<I, S>(mut self, hosts: I) -> Result<Self, dlock_runtime::LockError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let hosts = hosts
            .into_iter()
            .map(|h| {
                let h = h.as_ref();
                AllowedHost::parse(h).ok_or_else(|| {
                    dlock_runtime::LockError::misconfigured(
                        format!("ops page: allowed host `{h}` is not a host name or host:port"),
                        None,
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.hosts = Some(hosts.into());
        Ok(self)
    }

    /// Also shows (and requeues) the jobs of a durable queue (feature `defer`).
    #[cfg(feature = "defer")]
    pub fn durable_queue(mut self, queue: dlock_runtime::durable::DurableQueue) -> Self {
        self.queues.push(queue);
        self
    }

    /// How far back the page's contention view looks (default 10 minutes; at most the ring's
    /// 4096 newest events).
    pub fn contention_window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// The router.
    pub fn router(self) -> Router {
        let hosts = self.hosts.clone();
        Router::new()
            .route("/", get(html))
            .route("/api/locks", get(locks))
            .route("/api/locks/{*key}", get(lock))
            .route("/api/contention", get(contention))
            .route("/api/jobs", get(jobs))
            .route("/api/jobs/{id}/requeue", post(requeue_json))
            .route("/requeue/{id}", post(requeue_form))
            .with_state(Arc::new(self))
            .layer(middleware::from_fn(same_origin_only))
            .layer(middleware::from_fn_with_state(hosts, host_allowed))
    }
}

type Ops = State<Arc<OpsPage>>;

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn error_response(e: &dlock_runtime::LockError) -> Response {
    let status = if e.is_unsupported() {
        StatusCode::NOT_IMPLEMENTED
    } else if e.is_invalid() {
        StatusCode::BAD_REQUEST
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(status, &json!({ "error": e.to_string() }))
}

/// The value of `name` in the query string (no percent-decoding beyond `%XX` and `+`).
fn query_param(uri: &Uri, name: &str) -> Option<String> {
    uri.query()?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    String::from_utf8_lossy(&crate::uri::form_decoded(s)).into_owned()
}

/// Answers `421` to a request whose `Host` is not among the allowed ones, when there is a list
/// ([`OpsPage::allowed_hosts`]); passes every other request on.
async fn host_allowed(
    State(hosts): State<Option<Arc<[AllowedHost]>>>,
    req: Request,
    next: Next,
) -> Response {
    if let Some(hosts) = hosts {
        // Every name the request gives must be allowed, and it must give one: the `Host`
        // header and the URI's authority (an absolute-form request, HTTP/2), which a server
        // may prefer to `Host`.
        let allowed = |name: &str| {
            AllowedHost::parse(name).is_some_and(|r| hosts.iter().any(|h| h.admits(&r)))
        };
        let host = req
            .headers()
            .get(header::HOST)
            .map(|h| h.to_str().unwrap_or(""));
        let authority = req.uri().authority().map(|a| a.as_str());
        let named = host.is_some() || authority.is_some();
        if !named || !host.is_none_or(allowed) || !authority.is_none_or(allowed) {
            return json_response(
                StatusCode::MISDIRECTED_REQUEST,
                &json!({ "error": "this host name does not serve the ops page" }),
            );
        }
    }
    next.run(req).await
}

/// Answers `403` to a request that changes something and that a browser sent from another
/// origin (see the [module docs](self)); passes every other request on.
async fn same_origin_only(req: Request, next: Next) -> Response {
    if is_cross_origin(req.method(), req.headers(), req.uri()) {
        return json_response(
            StatusCode::FORBIDDEN,
            &json!({ "error": "cross-origin request refused: the ops page takes changes only from its own origin" }),
        );
    }
    next.run(req).await
}

/// Whether a request is an unsafe one from another origin. `Sec-Fetch-Site`, set by the
/// browser and never by a page, decides when present; older browsers send only `Origin`,
/// compared with `Host` (or, over HTTP/2, the URI's authority). Neither header: not a browser's
/// cross-site request.
fn is_cross_origin(method: &Method, headers: &HeaderMap, uri: &Uri) -> bool {
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return false;
    }
    if let Some(site) = headers.get("sec-fetch-site") {
        return !matches!(site.as_bytes(), b"same-origin" | b"none");
    }
    let Some(origin) = headers.get(header::ORIGIN) else {
        return false;
    };
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| uri.authority().map(|a| a.as_str()));
    // `Origin: null` (a sandboxed frame, a redirect across sites) has no `://`: refused.
    let Some((scheme, authority)) = origin.to_str().ok().and_then(|o| o.split_once("://")) else {
        return true;
    };
    host.is_none_or(|host| {
        !without_default_port(authority, scheme)
            .eq_ignore_ascii_case(without_default_port(host, scheme))
    })
}

/// `authority` without the default port of `scheme` (`example.com:443` → `example.com` for
/// `https`): browsers leave it out of `Origin`, a client may write it in `Host`.
fn without_default_port<'a>(authority: &'a str, scheme: &str) -> &'a str {
    let default = match scheme {
        "http" => ":80",
        "https" => ":443",
        _ => return authority,
    };
    authority.strip_suffix(default).unwrap_or(authority)
}

impl OpsPage {
    /// The first [`MAX_LOCKS`] locks under `prefix` — and one more when there are more, so
    /// that the answer can say it was cut.
    async fn held(&self, prefix: &str) -> Result<Vec<LockState>, dlock_runtime::LockError> {
        self.locker.admin()?.list_all(prefix, MAX_LOCKS + 1).await
    }

    /// The page's lock listing: the last one while it is within its spacing (see
    /// [`OpsPage::listing_spacing`]), else a new one (a failed one is not kept), and how old
    /// it is.
    async fn held_for_page(
        &self,
    ) -> (
        Result<Arc<Vec<LockState>>, dlock_runtime::LockError>,
        Duration,
    ) {
        if self.spacing.is_zero() {
            return (self.held("").await.map(Arc::new), Duration::ZERO);
        }
        // Held through the listing: concurrent loads wait for it and share it.
        let mut last = self.listed.lock().await;
        if let Some(l) = last.as_ref() {
            let age = l.at.elapsed();
            if age < self.next_listing_after(l.took) {
                return (Ok(l.locks.clone()), age);
            }
        }
        let started = std::time::Instant::now();
        let listed = self.held("").await.map(Arc::new);
        if let Ok(locks) = &listed {
            *last = Some(Listed {
                locks: locks.clone(),
                at: started,
                took: started.elapsed(),
            });
        }
        (listed, Duration::ZERO)
    }

    /// How long after a listing that took `took` the page lists again.
    fn next_listing_after(&self, took: Duration) -> Duration {
        took.saturating_mul(LISTING_DUTY)
            .clamp(self.spacing, MAX_SPACING.max(self.spacing))
    }

    /// How often the page refreshes itself: every 5 s, or as often as it lists, when that is
    /// rarer (whole seconds).
    async fn page_refresh(&self) -> u64 {
        if self.spacing.is_zero() {
            return PAGE_REFRESH.as_secs();
        }
        let took = self.listed.lock().await.as_ref().map(|l| l.took);
        let every = took.map_or(self.spacing, |t| self.next_listing_after(t));
        every.max(PAGE_REFRESH).as_secs_f64().ceil() as u64
    }

    /// Contention of the window: per key (count, last seen), most contended first, and per
    /// minute (oldest first).
    fn contention(&self, window: Duration) -> Value {
        let events = self.locker.recent_contention(window);
        let mut per_key: Vec<(String, u64, u64)> = Vec::new();
        let minutes = window.as_secs().div_ceil(60).max(1) as usize;
        let mut per_minute = vec![0u64; minutes];
        let now = std::time::SystemTime::now();
        for e in &events {
            let at_ms =
                e.at.duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
            match per_key.iter_mut().find(|(k, ..)| k == e.key.as_str()) {
                Some(entry) => {
                    entry.1 += 1;
                    entry.2 = entry.2.max(at_ms);
                }
                None => per_key.push((e.key.as_str().to_owned(), 1, at_ms)),
            }
            let ago = now.duration_since(e.at).unwrap_or_default().as_secs() / 60;
            if let Some(slot) = minutes.checked_sub(1 + ago as usize) {
                per_minute[slot] += 1;
            }
        }
        per_key.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        json!({
            "window_secs": window.as_secs(),
            "total": events.len(),
            "keys": per_key.iter().map(|(k, n, last)| json!({
                "key": k, "count": n, "last_at_ms": last,
            })).collect::<Vec<_>>(),
            "per_minute": per_minute,
        })
    }

    async fn jobs(&self) -> Value {
        let queue = self.locker.defer_queue();
        #[cfg_attr(not(feature = "defer"), allow(unused_mut))]
        let (pending, dead) = (queue.pending(), queue.dead_letters());
        let mut queues = vec![json!({
            "queue": "in-process",
            "deferred": pending.iter().take(MAX_JOBS).map(job_json).collect::<Vec<_>>(),
            "deferred_total": pending.len(),
            "dead": dead.iter().take(MAX_JOBS).map(job_json).collect::<Vec<_>>(),
            "dead_total": dead.len(),
        })];
        #[cfg(feature = "defer")]
        for q in &self.queues {
            let (pending, dead) = (
                q.pending_first(MAX_JOBS).await,
                q.dead_letters_first(MAX_JOBS).await,
            );
            queues.push(match (pending, dead) {
                (Ok(p), Ok(d)) => json!({
                    "queue": q.name(),
                    "deferred": p.jobs.iter().map(|(j, _)| job_json(j)).collect::<Vec<_>>(),
                    "deferred_total": p.total,
                    "dead": d.jobs.iter().map(job_json).collect::<Vec<_>>(),
                    "dead_total": d.total,
                }),
                (Err(e), _) | (_, Err(e)) => json!({ "queue": q.name(), "error": e.to_string() }),
            });
        }
        Value::Array(queues)
    }

    /// Requeues dead letter `id` from whichever queue has it.
    async fn requeue(&self, id: &str) -> Result<bool, dlock_runtime::LockError> {
        if self.locker.defer_queue().requeue(id) {
            return Ok(true);
        }
        #[cfg(feature = "defer")]
        for q in &self.queues {
            if q.requeue(id).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

fn job_json(j: &JobInfo) -> Value {
    json!({ "id": j.id, "key": j.key, "attempts": j.attempts, "reason": j.reason })
}

async fn locks(State(ops): Ops, uri: Uri) -> Response {
    let prefix = query_param(&uri, "prefix").unwrap_or_default();
    match ops.held(&prefix).await {
        Ok(mut locks) => {
            // Cut where the page cuts, and said: before, a client could not tell the first 500
            // from all of them.
            let cut = locks.len() > MAX_LOCKS;
            locks.truncate(MAX_LOCKS);
            let mut res = json_response(StatusCode::OK, &json!(locks));
            if cut {
                res.headers_mut()
                    .insert(TRUNCATED, http::HeaderValue::from(MAX_LOCKS));
            }
            res
        }
        Err(e) => error_response(&e),
    }
}

async fn lock(State(ops): Ops, Path(key): Path<String>) -> Response {
    let inspected = match (ops.locker.admin(), key_as_shown(&key)) {
        (Ok(admin), Ok(key)) => admin.inspect(key).await,
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
    match inspected {
        Ok(state) => json_response(StatusCode::OK, &json!(state)),
        Err(e) => error_response(&e),
    }
}

async fn contention(State(ops): Ops, uri: Uri) -> Response {
    let minutes = query_param(&uri, "minutes")
        .and_then(|m| m.parse::<u64>().ok())
        .unwrap_or(10)
        .clamp(1, 24 * 60);
    json_response(
        StatusCode::OK,
        &ops.contention(Duration::from_secs(minutes * 60)),
    )
}

async fn jobs(State(ops): Ops) -> Response {
    json_response(StatusCode::OK, &ops.jobs().await)
}

async fn requeue_json(State(ops): Ops, Path(id): Path<String>) -> Response {
    match ops.requeue(&id).await {
        Ok(true) => json_response(StatusCode::OK, &json!({ "requeued": id })),
        Ok(false) => json_response(
            StatusCode::NOT_FOUND,
            &json!({ "error": format!("no dead letter `{id}`") }),
        ),
        Err(e) => error_response(&e),
    }
}

async fn requeue_form(
    State(ops): Ops,
    Path(id): Path<String>,
    OriginalUri(uri): OriginalUri,
) -> Response {
    match ops.requeue(&id).await {
        // Back to the page (`<page>/requeue/<id>` → `<page>`), which shows the job again.
        Ok(_) => {
            let path = uri.path();
            let page = path
                .rfind("/requeue/")
                .map_or("/", |at| &path[..at])
                .to_owned();
            let page = if page.is_empty() {
                "/".to_owned()
            } else {
                page
            };
            (StatusCode::SEE_OTHER, [(header::LOCATION, page)]).into_response()
        }
        Err(e) => error_response(&e),
    }
}

async fn html(State(ops): Ops, OriginalUri(uri): OriginalUri) -> Response {
    let (held, age) = ops.held_for_page().await;
    let refresh = ops.page_refresh().await;
    let contention = ops.contention(ops.window);
    let jobs = ops.jobs().await;
    // The page's own path, wherever the router is nested, for its forms.
    let base = format!("{}/", uri.path().trim_end_matches('/'));
    let listing = page::Listing {
        held: &held,
        age,
        refresh,
    };
    let body = page::render(&ops.locker, &base, &listing, &contention, &jobs);
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::CONTENT_SECURITY_POLICY, PAGE_CSP),
        ],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page lists again after ten times as long as its last listing took, at least its
    /// spacing and at most 5 min; it refreshes itself as often, and every 5 s at most.
    #[tokio::test]
    async fn the_page_lists_and_refreshes_less_often_the_longer_a_listing_takes() {
        let ops = OpsPage::new(Locker::memory());
        let ms = Duration::from_millis;
        assert_eq!(ops.next_listing_after(ms(10)), ms(2000));
        assert_eq!(ops.next_listing_after(ms(700)), ms(7000));
        assert_eq!(ops.next_listing_after(ms(60_000)), MAX_SPACING);
        assert_eq!(ops.page_refresh().await, 5, "before any listing");
        let listed = |took| Listed {
            locks: Arc::default(),
            at: std::time::Instant::now(),
            took,
        };
        *ops.listed.lock().await = Some(listed(ms(300)));
        assert_eq!(ops.page_refresh().await, 5);
        *ops.listed.lock().await = Some(listed(ms(1250)));
        assert_eq!(ops.page_refresh().await, 13);
        let spaced = OpsPage::new(Locker::memory()).listing_spacing(Duration::from_secs(30));
        assert_eq!(spaced.next_listing_after(ms(10)), ms(30_000));
        assert_eq!(spaced.page_refresh().await, 30);
        let capped = OpsPage::new(Locker::memory()).listing_spacing(Duration::from_secs(3600));
        assert_eq!(capped.next_listing_after(ms(10)), MAX_SPACING);
    }

    /// Entries: a name admits it on any port, `name:port` that port only; case and a final
    /// dot do not matter; anything that is not a host or `host:port` is refused.
    #[test]
    fn allowed_hosts_admit_their_names_and_ports() {
        let admits = |entry: &str, host: &str| {
            AllowedHost::parse(entry)
                .unwrap()
                .admits(&AllowedHost::parse(host).unwrap())
        };
        assert!(admits("ops.example", "ops.example"));
        assert!(admits("ops.example", "OPS.Example.:8080"));
        assert!(admits("ops.example:8080", "ops.example:8080"));
        assert!(!admits("ops.example:8080", "ops.example"));
        assert!(!admits("ops.example:8080", "ops.example:8081"));
        assert!(!admits("ops.example", "evil.example"));
        assert!(!admits("ops.example", "ops.example.evil.example"));
        assert!(admits("[::1]", "[::1]:9000"));
        assert!(admits("10.0.0.5:81", "10.0.0.5:81"));
        for bad in [
            "",
            "http://ops.example",
            "ops.example/x",
            "a b",
            "user@ops.example",
            ":80",
        ] {
            assert_eq!(AllowedHost::parse(bad), None, "{bad:?}");
            let err = OpsPage::new(Locker::memory())
                .allowed_hosts(["ok.example", bad])
                .unwrap_err();
            assert!(err.is_misconfigured(), "{err}");
        }
    }

    #[test]
    fn query_params_are_decoded() {
        let uri: Uri = "/api/locks?x=1&prefix=order%3A4+2".parse().unwrap();
        assert_eq!(query_param(&uri, "prefix").as_deref(), Some("order:4 2"));
        assert_eq!(query_param(&uri, "nope"), None);
        assert_eq!(percent_decode("100%"), "100%");
    }
}
