//! The shared conformance suite, on every backend: each check runs once per backend, against a
//! fresh store (for Redis: a fresh `redis-server` on a free port).

use dlock_runtime::backend::MemoryBackend;
use dlock_runtime::conformance::Store;
use dlock_tests::RedisServer;

fn memory_store() -> ((), Store) {
    ((), memory())
}

fn redis_store() -> (RedisServer, Store) {
    let server = RedisServer::start();
    let store = redis(&server);
    (server, store)
}

fn memory() -> Store {
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
        idempotency: true,
    }
}

fn redis(server: &RedisServer) -> Store {
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
        idempotency: true,
    }
}

mod memory {
    dlock_runtime::conformance_tests!(super::memory_store);
}

mod redis {
    dlock_runtime::conformance_tests!(super::redis_store);
}
