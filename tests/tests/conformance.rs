//! The shared conformance suite, on every backend: each check runs once per backend, against a
//! fresh store (for Redis: a fresh `redis-server` on a free port) — and on the least a backend
//! author has to write (`minimal`).

use dlock_runtime::backend::{AcquireArgs, Attempt, Backend, BoxFuture, MemoryBackend, OwnerToken};
use dlock_runtime::conformance::Store;
use dlock_runtime::key::ResourceName;
use dlock_runtime::LockError;
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
        notifications: true,
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
        notifications: true,
    }
}

mod memory {
    dlock_runtime::conformance_tests!(super::memory_store);
}

mod redis {
    dlock_runtime::conformance_tests!(super::redis_store);
}

/// The least a backend author must write: the five required methods, nothing else — no
/// release notifications (waiters fall back to their timers), no idempotency storage, default
/// batching. It keeps every promise of the suite. (It stores locks in a `MemoryBackend`, used
/// here only through those five methods.)
#[derive(Clone)]
struct MinimalBackend(MemoryBackend);

impl Backend for MinimalBackend {
    fn name(&self) -> &'static str {
        "minimal"
    }

    fn acquire<'a>(&'a self, args: AcquireArgs<'a>) -> BoxFuture<'a, Result<Attempt, LockError>> {
        self.0.acquire(args)
    }

    fn release<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        self.0.release(resource, token)
    }

    fn extend<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        ttl: std::time::Duration,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        self.0.extend(resource, token, ttl)
    }

    fn abandon<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<(), LockError>> {
        self.0.abandon(resource, token)
    }
}

fn minimal_store() -> ((), Store) {
    let shared = MemoryBackend::new();
    let for_break = shared.clone();
    // Shared as `Arc<B>`: the locker takes it without a forwarding wrapper.
    let backend = std::sync::Arc::new(MinimalBackend(shared));
    let mut store = Store::new(
        "minimal",
        move |b| {
            let backend = backend.clone();
            Box::pin(async move { b.try_build(backend).expect("locker") })
        },
        move |resource| {
            assert!(
                for_break.force_release(&resource),
                "no live lock named {resource}"
            );
            Box::pin(async {})
        },
    );
    store.idempotency = false;
    store.notifications = false;
    ((), store)
}

mod minimal {
    dlock_runtime::conformance_tests!(super::minimal_store);
}
