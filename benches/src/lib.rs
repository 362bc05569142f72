//! Criterion benchmarks of ares live in `benches/`; this library is empty.
