//! `dlock-tower`: per-request distributed locks for any `tower` + `http` stack.
//!
//! The layer itself is being built (issue 4); this crate currently contains no public API.
