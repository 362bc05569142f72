//! Cross-crate integration tests of ares live in `tests/`. This library holds what the
//! workspace's test suites share: [`bounded`], which checks in a child process that a test
//! stays under a memory bound.

pub mod bounded;
