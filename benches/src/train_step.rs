//! One training step's model work at a model's real shape, in a chosen storage setup: the
//! forward and backward's tokens/s, the AdamW update's time, the bytes the step holds
//! (weights, gradients, activation arena, moments) and the device memory in use at its
//! phases' ends. `bench-model_cuda scale` runs Qwen2.5-1.5B and 3B shapes in "today's f32"
//! ([`StepSetup::F32`]) beside the bf16 storage the CUDA trainer defaults to
//! ([`StepSetup::BF16`]): the MFU and peak-memory goals are read off those lines.

use std::time::Duration;

use crate::SplitMix;
use crate::model::try_best_and_median;
use ares_model::backend::{Backend, MatmulPrecision};
use ares_model::hf::config::ModelConfig;
use ares_model::hf::weights::ModelWeights;
use ares_model::model::{
    ActivationDtype, AdamW, AdamWConfig, GradDtype, Inputs, Model, ModelError, StateDtype,
    WeightStorage,
};

/// How a training step stores its tensors and multiplies.
#[derive(Debug, Clone, Copy)]
pub struct StepSetup {
    /// The line's label.
    pub name: &'static str,
    /// The products' operands.
    pub precision: MatmulPrecision,
    /// The linear layers' (and embedding's, head's) weights.
    pub storage: WeightStorage,
    /// The activation arena's stored activations.
    pub activations: ActivationDtype,
    /// The gradients.
    pub grads: GradDtype,
    /// AdamW's two moments.
    pub moments: StateDtype,
}

impl StepSetup {
    /// Every tensor in f32 with TF32 products: the CUDA trainer before bf16 storage (the
    /// issue's "today's f32").
    pub const F32: Self = Self {
        name: "f32 storage, TF32 products",
        precision: MatmulPrecision::Tf32,
        storage: WeightStorage::F32,
        activations: ActivationDtype::F32,
        grads: GradDtype::F32,
        moments: StateDtype::F32,
    };

    /// `trainer.precision: bf16`, the CUDA default: weights, gradients and activations in
    /// bf16, bf16 products, f32 moments (`worker.actor.optim.state_dtype`'s default).
    pub const BF16: Self = Self {
        name: "bf16 storage (weights, gradients, activations), bf16 products",
        precision: MatmulPrecision::Bf16,
        storage: WeightStorage::Bf16,
        activations: ActivationDtype::Bf16,
        grads: GradDtype::Bf16,
        moments: StateDtype::F32,
    };

    /// [`StepSetup::BF16`] with AdamW's moments in 8 bits
    /// (`worker.actor.optim.state_dtype: int8`, bitsandbytes' block-wise scheme): the f32
    /// moments are most of what the bf16 step holds (8 of its 12 bytes a parameter).
    pub const BF16_INT8_MOMENTS: Self = Self {
        name: "bf16 storage and int8 moments",
        moments: StateDtype::Int8,
        ..Self::BF16
    };
}

/// A training batch of random tokens with the loss's per-token coefficients: every
/// sequence full, each token's target the next one, ∂L/∂logπ = −1/N (0 at a sequence's end).
#[derive(Debug, Clone)]
pub struct TrainBatch {
    /// Sequences.
    pub batch: usize,
    /// Tokens a sequence.
    pub seq: usize,
    ids: Vec<u32>,
    mask: Vec<u32>,
    positions: Vec<u32>,
    /// The next token of every position (0 at a sequence's end).
    pub targets: Vec<u32>,
    /// ∂L/∂logπ of every position.
    pub coeffs: Vec<f32>,
}

impl TrainBatch {
    /// `batch × seq` tokens drawn from `rng` below `vocab`.
    pub fn random(rng: &mut SplitMix, batch: usize, seq: usize, vocab: u64) -> Self {
        let n = batch * seq;
        let ids: Vec<u32> = (0..n).map(|_| (rng.next_u64() % vocab) as u32).collect();
        let mut targets = vec![0u32; n];
        let mut coeffs = vec![0.0f32; n];
        for i in 0..n {
            if i % seq + 1 < seq {
                targets[i] = ids[i + 1];
                coeffs[i] = -1.0 / n as f32;
            }
        }
        Self {
            batch,
            seq,
            mask: vec![1; n],
            positions: (0..n).map(|i| (i % seq) as u32).collect(),
            ids,
            targets,
            coeffs,
        }
    }

    /// Tokens in the batch.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// The model's inputs.
    pub fn inputs(&self) -> Inputs<'_> {
        Inputs {
            batch: self.batch,
            seq: self.seq,
            input_ids: &self.ids,
            attention_mask: &self.mask,
            position_ids: &self.positions,
        }
    }
}

/// FLOPs of one forward and backward over `tokens` tokens in sequences of `seq`: 6 per
/// parameter and token, and the causal attention's 6·layers·hidden·seq per token (half of
/// the 12 a full square takes).
pub fn train_flops(config: &ModelConfig, params: usize, tokens: usize, seq: usize) -> f64 {
    let attention = 6.0 * (config.num_hidden_layers * config.hidden_size * seq) as f64;
    (6.0 * params as f64 + attention) * tokens as f64
}

/// The dense bf16 tensor-core peak of the GPU named `device`, TFLOP/s, for MFU:
/// `ARES_BENCH_PEAK_TFLOPS` when set, else 989 for an H100 or H200 in the SXM form (the
/// FlashAttention-3 paper's 740 TFLOP/s is 75 % of it, `gpu-anchors.md`); `None` for
/// another GPU (the PCIe and NVL forms clock lower).
pub fn dense_bf16_peak(device: &str) -> Option<f64> {
    if let Ok(v) = std::env::var("ARES_BENCH_PEAK_TFLOPS") {
        return v.parse().ok().filter(|p: &f64| p.is_finite() && *p > 0.0);
    }
    let hopper = device.contains("H100") || device.contains("H200");
    let other_form = device.contains("PCIe") || device.contains("NVL");
    (hopper && !other_form).then_some(989.0)
}

/// What [`train_step`] measured.
#[derive(Debug, Clone, Copy)]
pub struct StepFigures {
    /// Forward and backward (gradients zeroed first): best and median.
    pub fwd_bwd: (Duration, Duration),
    /// The AdamW update (norm, clip, update): best and median.
    pub update: (Duration, Duration),
    /// Bytes of the weights on the backend.
    pub weights: u64,
    /// Bytes of the gradients.
    pub grads: u64,
    /// Bytes of the activation arena.
    pub arena: u64,
    /// Bytes of AdamW's moments.
    pub moments: u64,
    /// The most device memory in use at the ends of the step's phases (model built, arena,
    /// gradients and moments allocated, forward + backward, update), less what was in use
    /// before the model: `None` where the backend has no device memory (the CPU).
    pub device_peak: Option<u64>,
}

impl StepFigures {
    /// Bytes the step holds: weights, gradients, arena and moments.
    pub fn held(&self) -> u64 {
        self.weights + self.grads + self.arena + self.moments
    }
}

/// Builds a model of `config` from `weights` on `backend` in `setup`, then times `runs`
/// forward + backward passes over `batch` and `runs` AdamW updates (lr 1e-7, clip 1), each
/// ended by a synchronisation. The model and its buffers are dropped on return, so setups
/// run one after another see the same free memory.
///
/// # Errors
/// The model's: a setup the model refuses, or the device out of memory.
pub fn train_step<B: Backend + Clone>(
    backend: &B,
    (config, weights): (&ModelConfig, &ModelWeights),
    setup: &StepSetup,
    batch: &TrainBatch,
    runs: usize,
) -> Result<StepFigures, ModelError> {
    let used = || backend.memory_info().map(|(free, total)| total - free);
    let before = used();
    let mut peak = before;
    let mut sample = || {
        if let (Some(now), Some(p)) = (used(), peak.as_mut()) {
            *p = (*p).max(now);
        }
    };
    let mut model = Model::new(backend.clone(), config, weights)?;
    model.set_matmul_precision(setup.precision);
    model.set_bf16_weights(setup.storage == WeightStorage::Bf16)?;
    model.set_weight_storage(setup.storage)?;
    model.set_activation_dtype(setup.activations);
    backend.synchronize()?;
    sample();
    let mut acts = model.activations(batch.batch, batch.seq)?;
    let mut grads = model.grads_in(setup.grads)?;
    let mut opt = AdamW::with_state_dtype(&model, AdamWConfig::default(), setup.moments)?;
    backend.synchronize()?;
    sample();
    let inputs = batch.inputs();
    let fwd_bwd = try_best_and_median(runs, || -> Result<(), ModelError> {
        grads.zero(backend)?;
        model.forward(&inputs, &mut acts)?;
        let (targets, coeffs) = (&batch.targets, &batch.coeffs);
        model.backward_from_log_prob_grads(&inputs, &mut acts, targets, coeffs, 1.0, &mut grads)?;
        Ok(backend.synchronize()?)
    })?;
    sample();
    let update = try_best_and_median(runs, || -> Result<(), ModelError> {
        opt.step(&mut model, &grads, 1e-7, Some(1.0))?;
        Ok(backend.synchronize()?)
    })?;
    sample();
    Ok(StepFigures {
        fwd_bwd,
        update,
        weights: model.weight_bytes(),
        grads: grads.bytes(),
        arena: acts.elements().bytes(),
        moments: opt.moment_bytes(),
        device_peak: peak.zip(before).map(|(p, b)| p.saturating_sub(b)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{BENCH_MODEL, random_weights_parallel};
    use ares_model::backend::cpu::CpuBackend;
    use ares_model::hf::weights::expected_tensors;
    use std::path::Path;

    #[test]
    fn both_setups_step_and_bf16_holds_less() {
        let config = ModelConfig::from_json_str(Path::new("bench/config.json"), BENCH_MODEL)
            .expect("the bench config parses");
        let weights = random_weights_parallel(&config, 3);
        let batch = TrainBatch::random(&mut SplitMix::new(1), 2, 16, 8192);
        assert_eq!(batch.tokens(), 32);
        assert_eq!(batch.coeffs.iter().filter(|c| **c == 0.0).count(), 2);
        let run = |setup| train_step(&CpuBackend, (&config, &weights), setup, &batch, 1).unwrap();
        let (f32s, bf16s) = (run(&StepSetup::F32), run(&StepSetup::BF16));
        let lean = run(&StepSetup::BF16_INT8_MOMENTS);
        assert!(lean.moments * 3 < bf16s.moments);
        assert_eq!((lean.weights, lean.grads), (bf16s.weights, bf16s.grads));
        // the CPU has no device memory to sample
        assert!(f32s.device_peak.is_none());
        // weights and gradients at half the bytes, the arena smaller, moments the same
        let norms = 4 * non_matrix(&config) as u64;
        assert_eq!(f32s.weights - norms, 2 * (bf16s.weights - norms));
        assert!(bf16s.grads < f32s.grads && bf16s.arena < f32s.arena);
        assert_eq!(bf16s.moments, f32s.moments);
        assert!(bf16s.held() < f32s.held());
    }

    /// Parameters outside the weight matrices (norms, biases): f32 in either setup.
    fn non_matrix(config: &ModelConfig) -> usize {
        expected_tensors(config)
            .into_iter()
            .filter(|(name, _)| name.ends_with("norm.weight") || name.ends_with(".bias"))
            .map(|(_, shape)| shape.iter().product::<usize>())
            .sum()
    }

    #[test]
    fn the_peak_is_known_for_the_sxm_hoppers_only() {
        if std::env::var_os("ARES_BENCH_PEAK_TFLOPS").is_some() {
            return; // the override answers for every name
        }
        assert_eq!(dense_bf16_peak("NVIDIA H200"), Some(989.0));
        assert_eq!(dense_bf16_peak("NVIDIA H100 80GB HBM3"), Some(989.0));
        assert_eq!(dense_bf16_peak("NVIDIA H100 PCIe"), None);
        assert_eq!(dense_bf16_peak("NVIDIA A10G"), None);
    }

    #[test]
    fn parallel_weights_do_not_depend_on_the_threads() {
        let config = ModelConfig::from_json_str(Path::new("bench/config.json"), BENCH_MODEL)
            .expect("the bench config parses");
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(|| random_weights_parallel(&config, 9));
        let many = random_weights_parallel(&config, 9);
        for ((a, x), (b, y)) in one.tensors().into_iter().zip(many.tensors()) {
            assert_eq!(a, b);
            assert_eq!(x.data, y.data, "{a}");
        }
    }
}
