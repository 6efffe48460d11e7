//! Test support for dlock: real `redis-server` processes ([`redis_server`]), a fault-injecting
//! TCP proxy ([`proxy`]) and durable job types for the defer tests ([`jobs`]). The backend conformance suite is public in
//! `dlock_runtime::conformance` (feature `conformance`).

pub mod jobs;
pub mod proxy;
pub mod redis_server;

pub use redis_server::RedisServer;
