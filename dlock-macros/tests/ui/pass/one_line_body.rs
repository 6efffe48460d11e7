// A body of one expression compiles without a warning (`unused_braces` took the body's braces
// for braces written around a block's return value), also under `deny(warnings)`.
#![deny(warnings)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "b:<id>")]
#[rustfmt::skip]
async fn one_line(id: u64) -> u64 { id * 2 }

#[distributed_lock(key = "c:<id>", on_fail = "retry", wait = "1s")]
#[rustfmt::skip]
async fn one_line_unit(id: u64) { assert!(id > 0) }

// A body that never returns compiles without a warning too (no "unreachable expression").
#[distributed_lock(key = "d:<id>")]
async fn never_returns(id: u64) -> u64 {
    loop {
        std::future::pending::<()>().await;
        let _ = id;
    }
}

fn main() {
    let _ = (one_line(1), one_line_unit(2), never_returns(3));
}
