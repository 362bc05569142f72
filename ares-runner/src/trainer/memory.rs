//! The host memory a run needs at the least, from the model's `config.json` and the run's
//! config alone, checked before the model is loaded: a run that cannot fit stops with the
//! parts it needs and what the machine has, not with the kernel's out-of-memory kill
//! halfway through loading.
//!
//! A lower bound, by design: it counts what a run certainly holds at once — on the CPU the
//! f32 weights, their gradients, both AdamW moments and the reference policy (when the KL
//! needs one); on a GPU the f32 checkpoint that is read on the host before it is uploaded.
//! The decode weights and the KV cache come on top; the KV cache at its largest (every
//! sequence of a rollout at its longest) is reported with the check, as a warning when it
//! would not fit. A bound that may refuse a run that would fit is not wanted here: the
//! fuller per-phase plan (activations, logits chunks, the vision tower, device memory) is
//! the memory plan's job.

use crate::config::Config;
use crate::hf::config::ModelConfig;

use super::TrainError;

/// One part of a run's memory, in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// What it is, as the message names it.
    pub what: &'static str,
    /// Its bytes.
    pub bytes: u64,
}

/// What a run needs at the least, and the KV cache on top at its largest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostNeed {
    /// Held at once for certain.
    pub parts: Vec<Part>,
    /// The KV cache when every sequence of a rollout is at its longest.
    pub kv_cache_at_most: u64,
}

impl HostNeed {
    /// The parts' sum.
    pub fn total(&self) -> u64 {
        self.parts.iter().map(|p| p.bytes).sum()
    }
}

/// The language model's parameters as `config.json` declares them (the vision tower of a
/// vision-language model is left out: this is a lower bound).
pub fn text_parameters(config: &ModelConfig) -> u64 {
    crate::hf::weights::expected_tensors(config)
        .iter()
        .map(|(_, shape)| shape.iter().map(|&d| d as u64).fold(1, u64::saturating_mul))
        .fold(0, u64::saturating_add)
}

/// The need of a run of `cfg` on the model of `config`: `on_cpu` when the model is trained
/// in host memory, `reference` when the KL needs a reference policy.
pub fn host_need(cfg: &Config, config: &ModelConfig, on_cpu: bool, reference: bool) -> HostNeed {
    let f32s = |n: u64| n.saturating_mul(4);
    let params = text_parameters(config);
    let mut parts = vec![Part {
        what: if on_cpu {
            "weights (f32)"
        } else {
            "checkpoint read on the host (f32)"
        },
        bytes: f32s(params),
    }];
    if on_cpu && !cfg.trainer.val_only {
        parts.push(Part {
            what: "gradients (f32)",
            bytes: f32s(params),
        });
        parts.push(Part {
            what: "AdamW moments (2 × f32)",
            bytes: f32s(params).saturating_mul(2),
        });
        if reference {
            parts.push(Part {
                what: "reference policy (f32)",
                bytes: f32s(params),
            });
        }
    }
    let sequences =
        (cfg.data.rollout_batch_size as u64).saturating_mul(cfg.worker.rollout.n as u64);
    let tokens =
        (cfg.data.max_prompt_length as u64).saturating_add(cfg.data.max_response_length as u64);
    let per_token = (config.num_hidden_layers as u64)
        .saturating_mul(2 * config.num_key_value_heads as u64)
        .saturating_mul(config.head_dim as u64);
    let kv_cache_at_most = if on_cpu {
        f32s(sequences.saturating_mul(tokens).saturating_mul(per_token))
    } else {
        0
    };
    HostNeed {
        parts,
        kv_cache_at_most,
    }
}

fn gib(bytes: u64) -> String {
    crate::host_memory::human_bytes(bytes)
}

/// Refuses a run whose certain need passes `available` (from `source`), naming each part;
/// returns a warning when the KV cache at its largest would not fit beside it.
///
/// # Errors
/// [`TrainError::Invalid`] when the need passes what is available.
pub fn check(need: &HostNeed, available: u64, source: &str) -> Result<Option<String>, TrainError> {
    let total = need.total();
    let parts = need
        .parts
        .iter()
        .map(|p| format!("{} {}", p.what, gib(p.bytes)))
        .collect::<Vec<_>>()
        .join(" + ");
    if total > available {
        return Err(TrainError::Invalid(format!(
            "this run needs at least {} of memory ({parts}), more than the {} available \
             ({source}); pick a smaller model, or turn the KL's reference policy off \
             (algorithm.disable_kl) if it is counted (set ARES_MEMORY_LIMIT to state the \
             memory yourself)",
            gib(total),
            gib(available)
        )));
    }
    let kv = need.kv_cache_at_most;
    Ok((total.saturating_add(kv) > available).then(|| {
        format!(
            "memory: the KV cache may reach {} when every rollout sequence is at \
             data.max_prompt_length + data.max_response_length, beside {} held ({parts}); \
             {} is available ({source}): lower data.rollout_batch_size, worker.rollout.n or \
             the lengths if the run runs out of memory",
            gib(kv),
            gib(total),
            gib(available)
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_need_past_what_is_available_is_refused_by_part() {
        let need = HostNeed {
            parts: vec![
                Part {
                    what: "weights (f32)",
                    bytes: 4 << 30,
                },
                Part {
                    what: "gradients (f32)",
                    bytes: 4 << 30,
                },
            ],
            kv_cache_at_most: 2 << 30,
        };
        let e = check(&need, 7 << 30, "test").unwrap_err().to_string();
        assert!(
            e.contains("at least 8.0 GiB")
                && e.contains("weights (f32) 4.0 GiB + gradients (f32) 4.0 GiB")
                && e.contains("7.0 GiB available (test)"),
            "{e}"
        );
        let w = check(&need, 9 << 30, "test").unwrap().unwrap();
        assert!(w.contains("may reach 2.0 GiB"), "{w}");
        assert_eq!(check(&need, 10 << 30, "test").unwrap(), None);
    }
}
