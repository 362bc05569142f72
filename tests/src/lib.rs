//! Cross-crate integration tests of ares live in `tests/`; this library is empty.
