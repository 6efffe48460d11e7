//! The shared conformance suite, on every backend: each check runs once per backend, against a
//! fresh store (for Redis: a fresh `redis-server` on a free port) — and on the least a backend
//! author has to write (`minimal`).

use std::sync::Arc;

use dlock_runtime::backend::{
    AcquireArgs, Attempt, Backend, BoxFuture, IntoBackend, MemoryBackend, OwnerToken,
};
use dlock_runtime::conformance::Store;
use dlock_runtime::key::ResourceName;
use dlock_runtime::LockError;
use dlock_tests::RedisServer;

fn memory_store() -> ((), Store) {
    let shared = MemoryBackend::new();
    ((), memory_backed("memory", shared.clone(), shared))
}

/// A store whose lockers use `backend`, which keeps its locks in `memory` (where the suite
/// breaks them).
fn memory_backed<B>(name: &'static str, memory: MemoryBackend, backend: B) -> Store
where
    B: IntoBackend + Clone + Send + Sync + 'static,
{
    Store::new(
        name,
        move |b| {
            let backend = backend.clone();
            Box::pin(async move { b.try_build(backend).expect("locker") })
        },
        move |resource| {
            let freed = memory.force_release(&resource);
            assert!(freed, "no live lock named {resource}");
            Box::pin(async {})
        },
    )
}

fn redis_store() -> (Arc<RedisServer>, Store) {
    let server = Arc::new(RedisServer::start());
    let (for_lockers, for_breaking) = (server.clone(), server.clone());
    let store = Store::new(
        "redis",
        move |b| {
            let url = for_lockers.url();
            Box::pin(async move { b.connect(&url).await.expect("connect") })
        },
        move |resource| {
            let server = for_breaking.clone();
            Box::pin(async move {
                let n: i64 = server.query(::redis::cmd("DEL").arg(&resource)).await;
                assert_eq!(n, 1, "no lock key {resource}");
            })
        },
    );
    (server, store)
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
    // Shared as `Arc<B>`: the locker takes it without a forwarding wrapper.
    let backend = Arc::new(MinimalBackend(shared.clone()));
    let mut store = memory_backed("minimal", shared, backend);
    store.idempotency = false;
    store.notifications = false;
    // Without `acquire_kind`: semaphores and read-write locks are refused, typed.
    store.kinds = false;
    store.admin = false;
    ((), store)
}

mod minimal {
    dlock_runtime::conformance_tests!(super::minimal_store);
}
