//! Test support for dlock: real `redis-server` processes ([`redis_server`]), the shared
//! backend conformance suite ([`conformance`]) and a durable job type for the defer tests
//! ([`jobs`]).

pub mod conformance;
pub mod jobs;
pub mod redis_server;

pub use redis_server::RedisServer;
