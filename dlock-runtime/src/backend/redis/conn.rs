//! The connection under a [`RedisBackend`](super::RedisBackend): one server (redis-rs's
//! reconnecting `ConnectionManager`); under feature `cluster`, a Redis Cluster (redis-rs's
//! cluster client, which routes each command to its slot's master and follows `MOVED`/`ASK`
//! and topology changes); under feature `sentinel`, the master of a Sentinel-monitored group,
//! followed through failovers (`super::sentinel`). One server and Sentinel carry commands and
//! RESP3 pushes on the same connection; a cluster keeps its shard-channel subscriptions on
//! connections of their own (see [`Conn::Cluster`]).

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

/// One server or a cluster. Cheap to clone.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    /// Commands, and subscriptions (`SSUBSCRIBE`/`SUNSUBSCRIBE`) on connections of their own.
    /// When a slot moves to another master, Redis tells the clients subscribed to its shard
    /// channels with an unsolicited `sunsubscribe` push, which redis-rs (1.8) takes for the
    /// reply of the oldest request in flight on that connection: that request fails and every
    /// reply after it goes to the request behind it (an acquire could get another key's
    /// grant) until the connection is idle. No command ever waits on the subscriptions'
    /// connections, so a moved slot cannot shift a command's reply.
    #[cfg(feature = "cluster")]
    Cluster {
        /// Every command.
        cmds: redis::cluster_async::ClusterConnection,
        /// `SSUBSCRIBE`/`SUNSUBSCRIBE` only.
        subs: redis::cluster_async::ClusterConnection,
    },
    #[cfg(feature = "sentinel")]
    Sentinel(super::sentinel::SentinelConn),
}

impl Conn {
    /// Whether this is a cluster (scripts publish on sharded channels, fencing counters are
    /// per slot, pipelines hold one slot).
    pub(crate) fn is_cluster(&self) -> bool {
        #[cfg(feature = "cluster")]
        if let Conn::Cluster { .. } = self {
            return true;
        }
        false
    }

    /// The issuer number of the connection the last reply on this handle came over, where it
    /// is not the backend's own (see [`Issuer`](super::Issuer)).
    pub(super) fn replied_issuer(&self) -> super::Issuer {
        match self {
            #[cfg(feature = "sentinel")]
            Conn::Sentinel(c) => c.replied_issuer(),
            _ => None,
        }
    }

    /// Subscribes to a lock's release channel: `SUBSCRIBE` on one server, `SSUBSCRIBE` (routed
    /// to the channel's slot, re-established by the client after a topology change) on a
    /// cluster.
    pub(super) async fn subscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            Conn::Single(c) => c.subscribe(channel).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster { subs, .. } => subs.ssubscribe(channel).await,
            #[cfg(feature = "sentinel")]
            Conn::Sentinel(c) => c.subscribe(channel).await,
        }
    }

    /// The reverse of [`subscribe`](Conn::subscribe).
    pub(super) async fn unsubscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            Conn::Single(c) => c.unsubscribe(channel).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster { subs, .. } => subs.sunsubscribe(channel).await,
            #[cfg(feature = "sentinel")]
            Conn::Sentinel(c) => c.unsubscribe(channel).await,
        }
    }
}

/// Connects to the cluster behind `url` (`redis+cluster://[user:pass@]h1:p1,h2:p2`,
/// `rediss+cluster://…`) without release notifications (the durable queue's connection).
#[cfg(all(feature = "cluster", feature = "durable"))]
pub(crate) async fn connect_cluster(
    url: &str,
    connect_timeout: std::time::Duration,
    command_timeout: std::time::Duration,
) -> Result<Conn, crate::LockError> {
    let client = redis::cluster::ClusterClient::builder(cluster_urls(url)?)
        .connection_timeout(connect_timeout)
        .response_timeout(command_timeout)
        .retries(3)
        .build()
        // The URL may carry a password: never put it in an error message.
        .map_err(|e| {
            crate::LockError::unavailable(
                format!("invalid redis cluster url: {:?}", e.kind()),
                None,
            )
        })?;
    let limit = connect_timeout + command_timeout;
    match tokio::time::timeout(limit, client.get_async_connection()).await {
        Ok(Ok(c)) => Ok(Conn::Cluster {
            cmds: c.clone(),
            subs: c,
        }),
        Ok(Err(e)) => Err(crate::LockError::unavailable(
            format!("redis cluster connect: {:?}", e.kind()),
            Some(Box::new(e)),
        )),
        Err(_) => Err(crate::LockError::unavailable(
            format!("redis cluster: no node answered within {limit:?}"),
            None,
        )),
    }
}

/// Whether `url` names a cluster (`redis+cluster://`, `rediss+cluster://`).
#[cfg(feature = "durable")]
pub(crate) fn is_cluster_url(url: &str) -> bool {
    url.starts_with("redis+cluster://") || url.starts_with("rediss+cluster://")
}

/// `redis+cluster://[user:pass@]h1:p1,h2:p2/…` → one `redis://[user:pass@]h:p` URL per node
/// (`rediss://` for `rediss+cluster://`).
#[cfg(feature = "cluster")]
pub(crate) fn cluster_urls(url: &str) -> Result<Vec<String>, crate::LockError> {
    let bad = || {
        crate::LockError::unavailable(
            "invalid redis cluster url: expected redis+cluster://host:port,host:port",
            None,
        )
    };
    let (scheme, rest) = url.split_once("://").ok_or_else(bad)?;
    let scheme = if scheme == "rediss+cluster" {
        "rediss"
    } else {
        "redis"
    };
    let (auth, hosts, _) = split_hosts(rest);
    let urls = node_urls(scheme, &auth, hosts);
    if urls.is_empty() {
        return Err(bad());
    }
    Ok(urls)
}

/// `[user:pass@]h1:p1,h2:p2[/path]` (a multi-host URL after its `://`) → (`"user:pass@"` or
/// `""`, `"h1:p1,h2:p2"`, the path after the first `/`, if any).
#[cfg(any(feature = "cluster", feature = "sentinel"))]
pub(super) fn split_hosts(rest: &str) -> (String, &str, Option<&str>) {
    let (auth, hosts) = match rest.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), rest),
    };
    match hosts.split_once('/') {
        Some((hosts, path)) => (auth, hosts, Some(path)),
        None => (auth, hosts, None),
    }
}

/// One `<scheme>://<auth><host>` URL per non-empty comma-separated host.
#[cfg(any(feature = "cluster", feature = "sentinel"))]
pub(super) fn node_urls(scheme: &str, auth: &str, hosts: &str) -> Vec<String> {
    hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(|h| format!("{scheme}://{auth}{h}"))
        .collect()
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
            Conn::Cluster { cmds, .. } => cmds.req_packed_command(cmd),
            #[cfg(feature = "sentinel")]
            Conn::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "cluster")]
            Conn::Cluster { cmds, .. } => cmds.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "sentinel")]
            Conn::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            #[cfg(feature = "cluster")]
            Conn::Cluster { cmds, .. } => cmds.get_db(),
            #[cfg(feature = "sentinel")]
            Conn::Sentinel(c) => c.get_db(),
        }
    }
}

/// The cluster slot of a lock: CRC16 (XMODEM) of its hash tag — the encoded key, which holds no
/// braces — modulo 16384, as Redis Cluster computes it.
#[cfg(feature = "cluster")]
pub(super) fn slot(tag: &str) -> u16 {
    let mut crc: u16 = 0;
    for &b in tag.as_bytes() {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// For every slot, a short hash tag that falls into it (`f<n>`): a cluster keeps one fencing
/// counter per slot, `<prefix>:{<tag>}:fence`, which its scripts can reach beside any lock of
/// the slot. The counter moves with its slot when the slot is resharded.
#[cfg(feature = "cluster")]
pub(super) fn slot_tag(of: u16) -> &'static str {
    use std::sync::LazyLock;
    static TAGS: LazyLock<Vec<String>> = LazyLock::new(|| {
        let mut tags = vec![String::new(); 16384];
        let mut missing = 16384usize;
        let mut n = 0u32;
        while missing > 0 {
            let tag = format!("f{n}");
            let t = &mut tags[usize::from(slot(&tag))];
            if t.is_empty() {
                *t = tag;
                missing -= 1;
            }
            n += 1;
        }
        tags
    });
    &TAGS[usize::from(of)]
}

#[cfg(all(test, feature = "cluster"))]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_keep_credentials_and_scheme_per_node() {
        assert_eq!(
            cluster_urls("redis+cluster://u:p@a:1,b:2/").unwrap(),
            vec!["redis://u:p@a:1", "redis://u:p@b:2"]
        );
        assert_eq!(
            cluster_urls("rediss+cluster://a:1").unwrap(),
            vec!["rediss://a:1"]
        );
        assert!(cluster_urls("redis+cluster://").is_err());
    }

    #[test]
    fn slots_match_redis_and_every_slot_has_a_tag() {
        // Values from the Redis Cluster specification's reference implementation.
        assert_eq!(slot("123456789"), 0x31C3); // the CRC16 check value, below 16384
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("user:1000"), 1649);
        for s in [0u16, 1, 8000, 16383] {
            assert_eq!(slot(slot_tag(s)), s);
        }
    }
}
