// Durations are humantime strings checked at compile time: a value humantime cannot read, a
// bare number, and a ttl outside 10ms..=24h are errors on the value.

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "a", ttl = "30 parsecs")]
async fn unknown_unit() {}

#[distributed_lock(key = "b", ttl = 30)]
async fn not_a_string() {}

#[distributed_lock(key = "c", ttl = "5ms")]
async fn too_short() {}

#[distributed_lock(key = "d", ttl = "2days")]
async fn too_long() {}

#[distributed_lock(key = "e", on_fail = "retry", wait = "soon")]
async fn bad_wait() {}

fn main() {}
