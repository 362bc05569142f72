//! The loss head's ops over logits rows: fused log-prob + entropy (forward) and the
//! gradients of the per-token log-prob and entropy (backward), one block per row, no
//! `[rows, vocab]` temporary.

use super::{ArgOrNull, ModelOps, State, bad, check_len, i64_of, mul, status_result};
use crate::error::{DriverContext, Result};
use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

/// The race sampler's settings and keys for [`ModelOps::pick_rows`] (the parameters of
/// [`ModelOps::sample_race`]).
#[derive(Debug, Clone, Copy)]
pub struct RacePick<'k, 'v> {
    /// `1 / temperature` of the draw.
    pub inv_t: f32,
    /// Keep the `top_k` most likely tokens (0: off).
    pub top_k: u32,
    /// Keep the most likely tokens holding this much mass, in (0, 1] (1: off).
    pub top_p: f32,
    /// Keep the tokens at least this likely relative to the most likely, in [0, 1] (0: off).
    pub min_p: f32,
    /// Five key words a row (`ares_cpu::sampler::SampleKey::words`).
    pub keys: &'k CudaView<'v, u32>,
}

/// Checks a pick's `vocab` (ids must fit below `u32::MAX`, the "no token" id) and
/// `1 / temperature`.
fn check_pick(k: &'static str, vocab: usize, inv_t: f32) -> Result<()> {
    if vocab == 0 || vocab >= u32::MAX as usize {
        return Err(bad(k, format!("vocab = {vocab} must be in 1..2^32-1")));
    }
    if !(inv_t.is_finite() && inv_t > 0.0) {
        return Err(bad(
            k,
            format!("1/temperature = {inv_t} must be finite and > 0"),
        ));
    }
    Ok(())
}

/// Checks the race's `top_p` and `min_p`.
fn check_filters(k: &'static str, top_p: f32, min_p: f32) -> Result<()> {
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad(k, format!("top_p = {top_p} must be in (0, 1]")));
    }
    if !(0.0..=1.0).contains(&min_p) {
        return Err(bad(k, format!("min_p = {min_p} must be in [0, 1]")));
    }
    Ok(())
}

/// Threads per row.
const ROW_BLOCK: u32 = 512;

/// Checks `vocab` and the temperature; returns `1 / temperature`.
fn check_head(k: &'static str, vocab: usize, temperature: f32) -> Result<f32> {
    if vocab == 0 || vocab > u32::MAX as usize {
        return Err(bad(k, format!("vocab = {vocab} must be in 1..=2^32-1")));
    }
    let inv_t = 1.0 / temperature;
    if !(temperature.is_finite() && temperature > 0.0 && inv_t.is_finite()) {
        return Err(bad(
            k,
            format!("temperature = {temperature} must be finite and > 0"),
        ));
    }
    Ok(inv_t)
}

/// The launch of a loss-head backward over `rows` rows of `vocab` logits, its lengths
/// checked (`None`: no row, nothing to launch).
struct HeadRows {
    inv_t: f32,
    vocab: i64,
    rows: i64,
    cfg: LaunchConfig,
}

impl HeadRows {
    /// Checks `vocab` and the temperature ([`check_head`]) and that the logits and their
    /// gradient are `rows × vocab` long.
    fn check(
        k: &'static str,
        (vocab, temperature, rows): (usize, f32, usize),
        logits: usize,
        dlogits: usize,
    ) -> Result<Option<Self>> {
        let inv_t = check_head(k, vocab, temperature)?;
        let n = mul(k, "rows × vocab", rows, vocab)?;
        check_len(k, "logits", n, logits)?;
        check_len(k, "dlogits", n, dlogits)?;
        if rows == 0 {
            return Ok(None);
        }
        Ok(Some(Self {
            inv_t,
            vocab: i64_of(k, "vocab", vocab)?,
            rows: i64_of(k, "rows", rows)?,
            cfg: rows_cfg(k, rows)?,
        }))
    }
}

/// One block per row; rows beyond the grid limit are refused (the kernels index rows by
/// block).
fn rows_cfg(k: &'static str, rows: usize) -> Result<LaunchConfig> {
    let grid = u32::try_from(rows)
        .ok()
        .filter(|&r| r <= i32::MAX as u32)
        .ok_or_else(|| bad(k, format!("{rows} rows exceed the grid limit 2^31 - 1")))?;
    Ok(LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (ROW_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl ModelOps {
    /// Per row of `logits` `[rows, vocab]` (rows = `targets.len()`), with `z = logits /
    /// temperature`: `entropy[row]` = entropy of `softmax(z)`, `log_prob[row]` = `log
    /// softmax(z)[targets[row]]` (twin of `ares_cpu::log_prob_entropy`; the token kernel
    /// `log_prob_entropy_f32`). Rows holding NaN/+∞, only −∞, or a target out of range
    /// give NaN and are reported at the next [`ModelOps::check_status`].
    ///
    /// # Errors
    /// Lengths that do not match, `vocab` 0, a temperature not finite and > 0.
    pub fn log_prob_entropy(
        &self,
        logits: &CudaView<'_, f32>,
        vocab: usize,
        temperature: f32,
        targets: &CudaView<'_, u32>,
        log_prob: &mut CudaViewMut<'_, f32>,
        entropy: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "log_prob_entropy";
        let inv_t = check_head(K, vocab, temperature)?;
        let rows = targets.len();
        check_len(
            K,
            "logits",
            mul(K, "rows × vocab", rows, vocab)?,
            logits.len(),
        )?;
        check_len(K, "log_prob", rows, log_prob.len())?;
        check_len(K, "entropy", rows, entropy.len())?;
        if rows == 0 {
            return Ok(());
        }
        let cfg = rows_cfg(K, rows)?;
        let v64 = i64_of(K, "vocab", vocab)?;
        let mut state = self.lock();
        let mut l = self.stream.launch_builder(&self.token.log_prob_entropy_f32);
        l.arg(logits)
            .arg(&v64)
            .arg(&inv_t)
            .arg(targets)
            .arg(log_prob)
            .arg(entropy)
            .arg(&mut state.status);
        // SAFETY: argument order as `log_prob_entropy_f32` in token_kernels.cu; lengths
        // checked above.
        unsafe { l.launch(cfg) }.during(K)?;
        Ok(())
    }

    /// Backward of the per-token log-prob (twin of
    /// `ares_cpu::ops::log_prob_backward::log_prob_backward`): per row, with `z = logits /
    /// temperature` and `g = coeffs[row]`, `dlogits[row] = g/temperature·(onehot(target) −
    /// softmax(z))`, **overwriting**; rows with `g = 0` are zero and their logits unread.
    /// A non-finite coefficient, a bad row or target (for `g ≠ 0`) gives a NaN row,
    /// reported at the next [`ModelOps::check_status`].
    ///
    /// # Errors
    /// Lengths that do not match, `vocab` 0, a temperature not finite and > 0.
    pub fn log_prob_backward(
        &self,
        logits: &CudaView<'_, f32>,
        vocab: usize,
        temperature: f32,
        targets: &CudaView<'_, u32>,
        coeffs: &CudaView<'_, f32>,
        dlogits: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "log_prob_backward";
        let rows = targets.len();
        check_len(K, "coeffs", rows, coeffs.len())?;
        let shape = (vocab, temperature, rows);
        let Some(h) = HeadRows::check(K, shape, logits.len(), dlogits.len())? else {
            return Ok(());
        };
        let mut state = self.lock();
        let mut l = self.stream.launch_builder(&self.f.log_prob_bwd);
        l.arg(logits)
            .arg(&h.vocab)
            .arg(&h.inv_t)
            .arg(targets)
            .arg(coeffs)
            .arg(&h.rows)
            .arg(dlogits)
            .arg(&mut state.status);
        // SAFETY: argument order as `log_prob_bwd`; lengths checked above.
        unsafe { l.launch(h.cfg) }.during(K)?;
        Ok(())
    }

    /// Backward of the per-token entropy (twin of
    /// `ares_cpu::ops::entropy_backward::entropy_backward`): per row, with `z = logits /
    /// temperature`, `p = softmax(z)`, `H = −Σ p ln p` and `c = coeffs[row]` (∂L/∂H of that
    /// token), `dlogits[row] += c·∂H/∂logits = −c·p·(ln p + H)/temperature`, **accumulating**
    /// (it runs after [`ModelOps::log_prob_backward`] overwrote `dlogits`); a −∞ logit gets
    /// 0; rows with `c = 0` are untouched and their logits unread. A non-finite coefficient
    /// (or one so large against the temperature that the gradient overflows f32) or a bad
    /// row (for `c ≠ 0`: NaN/+∞, or only −∞) gives a NaN row, reported at the next
    /// [`ModelOps::check_status`].
    ///
    /// # Errors
    /// Lengths that do not match, `vocab` 0, a temperature not finite and > 0.
    pub fn entropy_backward(
        &self,
        logits: &CudaView<'_, f32>,
        vocab: usize,
        temperature: f32,
        coeffs: &CudaView<'_, f32>,
        dlogits: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "entropy_backward";
        let shape = (vocab, temperature, coeffs.len());
        let Some(h) = HeadRows::check(K, shape, logits.len(), dlogits.len())? else {
            return Ok(());
        };
        let mut state = self.lock();
        let mut l = self.stream.launch_builder(&self.f.entropy_bwd);
        l.arg(logits)
            .arg(&h.vocab)
            .arg(&h.inv_t)
            .arg(coeffs)
            .arg(&h.rows)
            .arg(dlogits)
            .arg(&mut state.status);
        // SAFETY: argument order as `entropy_bwd` in model_ops.cu; lengths checked above.
        unsafe { l.launch(h.cfg) }.during(K)?;
        Ok(())
    }

    /// [`ModelOps::log_prob_backward`] and then [`ModelOps::entropy_backward`] from 16-bit
    /// logits (`bf16`: bfloat16 bits, else IEEE half bits), fused, **overwriting** `dlogits`
    /// (as long, the logits' dtype): per row the f32 gradient of both parts is formed from
    /// the widened logits by the two kernels' operations in their order and rounded to
    /// nearest once — the f32 kernels' result on the widened logits, rounded. `lp` =
    /// `(targets, coeffs)` of the log-prob part, `entropy` the entropy part's coefficients;
    /// `None` (or a 0 coefficient) leaves a part out, and a row with neither is zero and
    /// unread. Bad rows, targets and coefficients give a NaN row and the status bits the
    /// f32 kernels set, reported at the next [`ModelOps::check_status`].
    ///
    /// # Errors
    /// Lengths that do not match, `vocab` 0, a temperature not finite and > 0, neither part
    /// given.
    #[allow(clippy::too_many_arguments)] // the logits, both parts' inputs, the output
    pub fn log_prob_entropy_backward_16(
        &self,
        logits: &CudaView<'_, u16>,
        bf16: bool,
        vocab: usize,
        temperature: f32,
        lp: Option<(&CudaView<'_, u32>, &CudaView<'_, f32>)>,
        entropy: Option<&CudaView<'_, f32>>,
        dlogits: &mut CudaViewMut<'_, u16>,
    ) -> Result<()> {
        const K: &str = "log_prob_entropy_backward_16";
        let rows = match (lp, entropy) {
            (Some((targets, coeffs)), _) => {
                check_len(K, "coeffs", targets.len(), coeffs.len())?;
                targets.len()
            }
            (None, Some(c)) => c.len(),
            (None, None) => {
                return Err(bad(K, "neither a log-prob nor an entropy gradient".into()));
            }
        };
        if let Some(c) = entropy {
            check_len(K, "entropy coeffs", rows, c.len())?;
        }
        let shape = (vocab, temperature, rows);
        let Some(h) = HeadRows::check(K, shape, logits.len(), dlogits.len())? else {
            return Ok(());
        };
        let kernel = if bf16 {
            &self.f.log_prob_entropy_bwd_bf16
        } else {
            &self.f.log_prob_entropy_bwd_f16
        };
        let mut state = self.lock();
        let mut l = self.stream.launch_builder(kernel);
        l.arg(logits)
            .arg(&h.vocab)
            .arg(&h.inv_t)
            .arg_or_null(lp.map(|p| p.0))
            .arg_or_null(lp.map(|p| p.1))
            .arg_or_null(entropy)
            .arg(&h.rows)
            .arg(dlogits)
            .arg(&mut state.status);
        // SAFETY: argument order as `log_prob_entropy_bwd_16` in model_ops.cu; lengths
        // checked above, the absent parts null.
        unsafe { l.launch(h.cfg) }.during(K)?;
        Ok(())
    }

    /// Greedy decoding: `out[row]` = the index of the largest logit of row `row` of
    /// `logits` `[rows, vocab]` (rows = `out.len()`), the lowest index among equal maxima,
    /// or `u32::MAX` for a row holding NaN/+∞ or only −∞ (twin of ares-runner's host
    /// greedy pick). Sets no status bit: the caller turns `u32::MAX` into its own error.
    ///
    /// # Errors
    /// Lengths that do not match, `vocab` 0 or ≥ 2³².
    pub fn argmax_rows(
        &self,
        logits: &CudaView<'_, f32>,
        vocab: usize,
        out: &mut CudaViewMut<'_, u32>,
    ) -> Result<()> {
        const K: &str = "argmax_rows";
        check_pick(K, vocab, 1.0)?;
        let rows = out.len();
        check_len(
            K,
            "logits",
            mul(K, "rows × vocab", rows, vocab)?,
            logits.len(),
        )?;
        if rows == 0 {
            return Ok(());
        }
        let cfg = rows_cfg(K, rows)?;
        let (v64, r64) = (i64_of(K, "vocab", vocab)?, i64_of(K, "rows", rows)?);
        let mut l = self.stream.launch_builder(&self.f.argmax_rows);
        l.arg(logits).arg(&v64).arg(&r64).arg(out);
        // SAFETY: argument order as `argmax_rows` in model_ops.cu; lengths checked above.
        unsafe { l.launch(cfg) }.during(K)?;
        Ok(())
    }

    /// Sampling, the race sampler (twin of `ares_cpu::sampler::sample_rows` bit for bit; see
    /// `sample_race` in model_ops.cu): `out[row]` = the token row `row` of `logits`
    /// `[rows, vocab]` (rows = `out.len()`) draws from `softmax(logits · inv_t)` with
    /// `top_k` (0: off), `top_p` and `min_p` (0: off), its random numbers keyed by
    /// `keys[5·row .. 5·row + 5]` (`ares_cpu::sampler::SampleKey::words`); `u32::MAX` for a
    /// row holding NaN/+∞ or only −∞. Sets no status bit.
    ///
    /// # Errors
    /// Lengths that do not match, `vocab` 0 or ≥ 2³², `inv_t` not finite and > 0, a `top_p`
    /// outside (0, 1] or a `min_p` outside [0, 1].
    #[allow(clippy::too_many_arguments)] // the kernel's parameters, each checked here
    pub fn sample_race(
        &self,
        logits: &CudaView<'_, f32>,
        vocab: usize,
        inv_t: f32,
        top_k: u32,
        top_p: f32,
        min_p: f32,
        keys: &CudaView<'_, u32>,
        out: &mut CudaViewMut<'_, u32>,
    ) -> Result<()> {
        const K: &str = "sample_race";
        check_pick(K, vocab, inv_t)?;
        check_filters(K, top_p, min_p)?;
        let rows = out.len();
        check_len(
            K,
            "logits",
            mul(K, "rows × vocab", rows, vocab)?,
            logits.len(),
        )?;
        check_len(K, "keys", mul(K, "rows × 5", rows, 5)?, keys.len())?;
        if rows == 0 {
            return Ok(());
        }
        let cfg = rows_cfg(K, rows)?;
        let (v64, r64) = (i64_of(K, "vocab", vocab)?, i64_of(K, "rows", rows)?);
        let mut l = self.stream.launch_builder(&self.f.sample_race);
        l.arg(logits)
            .arg(&v64)
            .arg(&r64)
            .arg(&inv_t)
            .arg(&top_k)
            .arg(&top_p)
            .arg(&min_p)
            .arg(keys)
            .arg(out);
        // SAFETY: argument order as `sample_race` in model_ops.cu; lengths checked above.
        unsafe { l.launch(cfg) }.during(K)?;
        Ok(())
    }

    /// A decode step's pick in **one** launch and **one** transfer (`pick_rows` in
    /// model_ops.cu): each row of `logits` `[rows, vocab]` (rows = `ids.len()`) gets its
    /// token — greedy ([`ModelOps::argmax_rows`]) when `race` is `None`, else the race
    /// sampler ([`ModelOps::sample_race`]) with its filters and keys, the same ids as those
    /// ops — with its log-prob and the entropy of `softmax(logits · inv_t)` (the formulas of
    /// `log_prob_entropy`, summed in the pick's order), gathered while the pick reads the
    /// row. The ids stay in `ids` (the next step's input); `dst` (`3·rows + 1` words)
    /// receives the ids (`u32::MAX` for a row with none), the bits of the log-probs and of
    /// the entropies, and the status word, which the device clears; `packed` is the device
    /// staging of the same length. Waits for the queued ops.
    ///
    /// # Errors
    /// Lengths that do not match, `vocab` 0 or ≥ 2³², `inv_t` not finite and > 0, a filter
    /// out of range (as [`ModelOps::sample_race`]); a driver failure;
    /// [`Error::DeviceStatus`](crate::Error::DeviceStatus) when a kernel met a bad value
    /// since the last check (a row with NaN / +∞ or only −∞ sets bit 1, its words NaN).
    #[allow(clippy::too_many_arguments)] // the kernel's parameters, each checked here
    pub fn pick_rows(
        &self,
        logits: &CudaView<'_, f32>,
        vocab: usize,
        inv_t: f32,
        race: Option<RacePick<'_, '_>>,
        ids: &mut CudaViewMut<'_, u32>,
        packed: &mut CudaViewMut<'_, u32>,
        dst: &mut [u32],
    ) -> Result<()> {
        const K: &str = "pick_rows";
        check_pick(K, vocab, inv_t)?;
        let rows = ids.len();
        check_len(
            K,
            "logits",
            mul(K, "rows × vocab", rows, vocab)?,
            logits.len(),
        )?;
        let words = mul(K, "3 × rows", rows, 3)?
            .checked_add(1)
            .ok_or_else(|| bad(K, format!("rows = {rows} overflows")))?;
        check_len(K, "packed", words, packed.len())?;
        check_len(K, "dst", words, dst.len())?;
        let (race_inv_t, top_k, top_p, min_p) = match &race {
            Some(r) => {
                check_pick(K, vocab, r.inv_t)?;
                check_filters(K, r.top_p, r.min_p)?;
                check_len(K, "keys", mul(K, "rows × 5", rows, 5)?, r.keys.len())?;
                (r.inv_t, r.top_k, r.top_p, r.min_p)
            }
            None => (1.0, 0, 1.0, 0.0),
        };
        if rows == 0 {
            dst[0] = 0;
            return self.synchronize();
        }
        let cfg = rows_cfg(K, rows)?;
        let (v64, r64) = (i64_of(K, "vocab", vocab)?, i64_of(K, "rows", rows)?);
        let sample = i32::from(race.is_some());
        {
            let mut state = self.lock();
            let State {
                status,
                blocks_done,
                ..
            } = &mut *state;
            let mut l = self.stream.launch_builder(&self.f.pick_rows);
            l.arg(logits)
                .arg(&v64)
                .arg(&r64)
                .arg(&sample)
                .arg(&race_inv_t)
                .arg(&top_k)
                .arg(&top_p)
                .arg(&min_p)
                .arg_or_null(race.as_ref().map(|r| r.keys))
                .arg(&inv_t)
                .arg(&mut *ids)
                .arg(status)
                .arg(blocks_done)
                .arg(&mut *packed);
            // SAFETY: argument order as `pick_rows` in model_ops.cu; lengths checked above
            // (keys only read when `sample`).
            unsafe { l.launch(cfg) }.during(K)?;
        }
        self.staging()
            .download(&self.stream, &packed.as_view(), dst)?;
        status_result(dst[words - 1])
    }

    /// The race sampler's Gumbel draws of tokens `0..out.len()` for one key (its 5 words):
    /// `out[i]` = `ares_cpu::sampler::gumbel(random_bits(key, i / 4)[i % 4])`, bit for bit
    /// (the check that the device's draws are the twin's).
    ///
    /// # Errors
    /// A key of other than 5 words.
    pub fn race_draws(
        &self,
        key: &CudaView<'_, u32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "race_draws";
        check_len(K, "key", 5, key.len())?;
        let n = out.len();
        if n == 0 {
            return Ok(());
        }
        let quads = n.div_ceil(4).div_ceil(256).min(1 << 16);
        let cfg = LaunchConfig {
            grid_dim: (quads as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let n64 = i64_of(K, "n", n)?;
        let mut l = self.stream.launch_builder(&self.f.race_draws);
        l.arg(key).arg(&n64).arg(out);
        // SAFETY: argument order as `race_draws` in model_ops.cu; lengths checked above.
        unsafe { l.launch(cfg) }.during(K)?;
        Ok(())
    }
}
