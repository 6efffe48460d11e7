// The key template's own syntax: an empty key, an empty placeholder, an unclosed `<`, a stray
// `>`, an invalid placeholder, and characters the runtime reserves in literal text. Each is an
// error on the key literal that says what is wrong.

#![allow(unused_variables)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "")]
async fn empty(id: u32) {}

#[distributed_lock(key = "order:<>")]
async fn empty_placeholder(id: u32) {}

#[distributed_lock(key = "order:<id")]
async fn unclosed(id: u32) {}

#[distributed_lock(key = "order:id>")]
async fn stray(id: u32) {}

#[distributed_lock(key = "order:<id + 1>")]
async fn expression(id: u32) {}

#[distributed_lock(key = "order {<id>}")]
async fn reserved(id: u32) {}

#[distributed_lock(key = order_id)]
async fn not_a_string(order_id: u32) {}

fn main() {}
