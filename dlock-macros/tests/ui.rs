//! Compile-time behaviour of `#[distributed_lock]`, checked with trybuild.
//!
//! `ui/pass/*.rs` must compile (and their `main` must run); `ui/fail/*.rs` must fail with exactly
//! the diagnostics in the `.stderr` file beside them. Regenerate the snapshots with
//! `TRYBUILD=overwrite cargo test -p dlock-macros --test ui` and review the diff: every error
//! must be clear and point at the offending token.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/ui/pass/*.rs");
    cases.compile_fail("tests/ui/fail/*.rs");
}
