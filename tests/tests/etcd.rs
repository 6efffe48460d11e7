//! etcd (`etcd://`): the conformance suite on one real member started once for this binary
//! (`dlock_tests::etcd_server::shared`), then fault tests on 3-member clusters of their own.

use dlock_runtime::backend::{EtcdBackend, EtcdOptions};
use dlock_runtime::conformance::Store;
use dlock_tests::etcd_server;

fn etcd_store() -> ((), Store) {
    let url = etcd_server::shared().lock().unwrap().url();
    let for_break = url.clone();
    let store = Store::new(
        "etcd",
        move |b| {
            let url = url.clone();
            Box::pin(async move { b.connect(&url).await.expect("connect") })
        },
        move |resource| {
            let url = for_break.clone();
            Box::pin(async move {
                let backend = EtcdBackend::connect(&url, EtcdOptions::default())
                    .await
                    .expect("connect");
                let n = backend.delete_lock(&resource).await.expect("delete");
                assert!(n >= 1, "no lock keys for {resource}");
            })
        },
    );
    let store = Store {
        idempotency: false,
        ..store
    };
    ((), store)
}

mod conformance {
    dlock_runtime::conformance_tests!(super::etcd_store);
}
