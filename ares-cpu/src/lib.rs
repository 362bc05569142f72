//! # ares-cpu
//!
//! The CPU backend of ares: fused log-prob + entropy over logits, entropy windows and HWE
//! masks, masked dynamic KL, and the transformer ops of the runner's model.
//!
//! **Not built yet.** This crate holds no API so far; the token kernels are the next
//! milestone after `ares-core` (see the README's status table).
