// Field-path placeholders: named fields, tuple indices and nesting, on plain parameters and on
// pattern-bound names; the value is whatever the path reaches, formatted with `Display`.

use dlock_runtime::distributed_lock;

struct Request {
    order_no: String,
    customer: Customer,
}

struct Customer {
    id: u64,
    region: (&'static str, u8),
}

struct Wrapper(Request);

#[distributed_lock(key = "order:<req.order_no>:customer:<req.customer.id>:<req.customer.region.0>")]
async fn handle(req: Request) -> u64 {
    req.customer.id
}

#[distributed_lock(key = "pair:<pair.0>:<pair.1.1>")]
async fn pair(pair: (u8, (u8, u8))) -> u8 {
    pair.1 .1
}

#[distributed_lock(key = "wrapped:<inner.order_no>")]
async fn wrapped(Wrapper(inner): Wrapper) -> String {
    inner.order_no
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _previous = dlock_runtime::set_default_locker(dlock_runtime::Locker::memory());
    let request = || Request {
        order_no: "A-1".to_owned(),
        customer: Customer {
            id: 3,
            region: ("eu", 1),
        },
    };
    let _ = request().customer.region.1;
    assert_eq!(handle(request()).await.unwrap(), 3);
    assert_eq!(pair((1, (2, 3))).await.unwrap(), 3);
    assert_eq!(wrapped(Wrapper(request())).await.unwrap(), "A-1");
}
