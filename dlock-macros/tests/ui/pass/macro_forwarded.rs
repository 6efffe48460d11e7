// A function written through a `macro_rules!` that forwards its attributes: the key's
// placeholders still name the function's parameters and fields (they keep the parameters'
// hygiene, not the attribute's), `self` included.

use dlock_runtime::{distributed_lock, Locker};

macro_rules! forward {
    ($(#[$m:meta])* $v:vis async fn $($rest:tt)*) => {
        $(#[$m])* $v async fn $($rest)*
    };
}

struct Shop {
    id: u32,
}

forward! {
    #[distributed_lock(key = "fwd:<id>")]
    async fn forwarded(id: u64) -> u64 {
        assert_eq!(dlock_runtime::current_lock().unwrap().key(), "fwd:7");
        id
    }
}

impl Shop {
    forward! {
        #[distributed_lock(key = "shop:<self.id>:<order>")]
        async fn order(&self, order: u32) -> u32 {
            assert_eq!(dlock_runtime::current_lock().unwrap().key(), "shop:1:2");
            self.id + order
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let locker = Locker::memory();
    let _previous = dlock_runtime::set_default_locker(locker.clone());
    assert_eq!(forwarded(7).await.unwrap(), 7);
    assert_eq!(Shop { id: 1 }.order(2).await.unwrap(), 3);
}
