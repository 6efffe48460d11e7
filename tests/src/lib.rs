//! Test support for dlock: real `redis-server` processes ([`redis_server`]) and the shared
//! backend conformance suite ([`conformance`]).

pub mod conformance;
pub mod redis_server;

pub use redis_server::RedisServer;
