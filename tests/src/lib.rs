//! Test support for dlock: real `redis-server` processes ([`redis_server`]), clusters of them
//! ([`redis_cluster`]) and Sentinel deployments ([`redis_sentinel`]), real PostgreSQL servers and
//! PgBouncers ([`postgres_server`]), etcd members and clusters ([`etcd_server`]), ZooKeeper servers and ensembles
//! ([`zookeeper_server`]), a
//! fault-injecting TCP proxy ([`proxy`]), durable job types for the defer tests ([`jobs`]), bounded polling for
//! state nothing signals ([`wait`]) and, with the feature `http`, HTTP helpers for the tower
//! layer tests (`http`). The backend conformance suite is public in
//! `dlock_runtime::conformance` (feature `conformance`).

pub mod etcd_server;
#[cfg(feature = "http")]
pub mod http;
pub mod jobs;
pub mod postgres_server;
pub mod proxy;
pub mod redis_cluster;
pub mod redis_sentinel;
pub mod redis_server;
pub mod wait;
pub mod zookeeper_server;

pub use etcd_server::Quorum;
pub use postgres_server::{PgBouncer, PostgresServer};
pub use redis_server::RedisServer;
