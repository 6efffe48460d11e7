// Placeholders resolve against names bound inside parameter patterns, as web extractors use
// them: a tuple-struct pattern (`Path(id)`), a struct pattern with `..`, a renamed field, nested
// tuples, `ref`, `mut` and `@` bindings. The extractor types are defined here, not taken from
// a web framework.

use dlock_runtime::distributed_lock;

struct Path<T>(T);
struct Json<T>(T);

struct NewOrder {
    order_no: String,
    customer: u64,
    note: String,
}

#[distributed_lock(key = "order:<id>:<order_no>:<who>")]
async fn create(
    Path(id): Path<u64>,
    Json(NewOrder {
        order_no,
        customer: who,
        ..
    }): Json<NewOrder>,
) -> String {
    format!("{id}/{order_no}/{who}")
}

#[distributed_lock(key = "pair:<a>:<b>:<whole.0>")]
async fn pair(Path((a, b)): Path<(u32, u32)>, ref whole @ (_, _): (u8, u8), mut n: u8) -> u32 {
    n += whole.0;
    a + b + u32::from(n)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _previous = dlock_runtime::set_default_locker(dlock_runtime::Locker::memory());
    let order = NewOrder {
        order_no: "A-1".to_owned(),
        customer: 9,
        note: String::new(),
    };
    let _ = &order.note;
    assert_eq!(create(Path(5), Json(order)).await.unwrap(), "5/A-1/9");
    assert_eq!(pair(Path((1, 2)), (3, 4), 1).await.unwrap(), 7);
}
