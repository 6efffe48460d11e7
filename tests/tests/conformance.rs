//! The shared conformance suite, on every backend: each check runs once per backend, against a
//! fresh store (for Redis: a fresh `redis-server` on a free port).

use dlock_runtime::backend::MemoryBackend;
use dlock_tests::conformance::Store;
use dlock_tests::RedisServer;

fn memory_store() -> Store {
    let shared = MemoryBackend::new();
    let for_break = shared.clone();
    Store {
        name: "memory",
        locker: Box::new(move |b| {
            let s = shared.clone();
            Box::pin(async move { b.try_build(s).expect("locker") })
        }),
        break_lock: Box::new(move |resource| {
            let freed = for_break.force_release(&resource);
            assert!(freed, "no live lock named {resource}");
            Box::pin(async {})
        }),
        fifo: true,
    }
}

fn redis_store(server: &RedisServer) -> Store {
    let url = server.url();
    let url2 = url.clone();
    Store {
        name: "redis",
        locker: Box::new(move |b| {
            let url = url.clone();
            Box::pin(async move { b.connect(&url).await.expect("connect") })
        }),
        break_lock: Box::new(move |resource| {
            let url = url2.clone();
            Box::pin(async move {
                let client = ::redis::Client::open(url).unwrap();
                let mut c = client.get_multiplexed_async_connection().await.unwrap();
                let n: i64 = ::redis::cmd("DEL")
                    .arg(&resource)
                    .query_async(&mut c)
                    .await
                    .unwrap();
                assert_eq!(n, 1, "no lock key {resource}");
            })
        }),
        fifo: true,
    }
}

macro_rules! conformance {
    ($($check:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    dlock_tests::conformance::$check(&super::memory_store()).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    let server = super::RedisServer::start();
                    dlock_tests::conformance::$check(&super::redis_store(&server)).await;
                }
            )*
        }
    };
}

conformance!(
    mutual_exclusion,
    owner_checked_release_and_extend,
    fencing_tokens_increase,
    watchdog_holds_past_ttl,
    loss_is_reported,
    release_wakes_waiter,
    waiters_are_served_in_order,
    dead_waiters_leave_the_queue,
    vanished_holder_expires,
    drop_releases,
    reject_and_timeout_errors,
    cancelled_acquires_leave_no_lock,
);
