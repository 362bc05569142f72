//! AdamW with 8-bit moments: block-wise dynamic quantisation, the scheme of bitsandbytes'
//! 8-bit Adam (`worker.actor.optim.state_dtype: int8`, a quarter of the f32 moments'
//! memory).
//!
//! A moment tensor is cut into blocks of [`BLOCK`] elements from its start (the last one
//! may be shorter). A block stores its largest magnitude `absmax` as f32 and each element
//! as one byte: the index of the nearest value of a 256-entry *dynamic map* to
//! `x · (1 / absmax)` — ties to the lower index, `1 / absmax` rounded to f32 with `absmax`
//! raised to at least 1e-38 first (an all-zero block stores `absmax = 0` and the code of
//! 0). Reading it back gives `map[code] · absmax`. The first moment uses the signed map,
//! the second (never negative) the unsigned one: [`dynamic_map`], bitsandbytes'
//! `create_dynamic_map(signed)`. Its values step through seven decades from ±1 down to
//! ~1e-7 with finer steps near 1, so a block keeps its small values' magnitudes to a few
//! per cent rather than rounding them to zero as a linear code would.
//!
//! One step ([`adamw_step_int8`]) reads a block's moments back, runs the f32 AdamW update
//! of [`adamw_step_scaled`](super::optim::adamw_step_scaled) on them (the same arithmetic,
//! element for element), and stores them again with the block's new `absmax`. Tensors
//! shorter than [`MIN_QUANTIZED_LEN`] are worth no bytes saved (norms, biases): callers
//! keep their moments in f32, as bitsandbytes does below 4 096 elements.
//!
//! The quantiser equals bitsandbytes' reference kernel bit for bit on its maps
//! (`tests/int8_blockwise.rs`, on a fixture `scripts/make_int8_state_fixtures.py` made).

use rayon::prelude::*;

use super::optim::{AdamConsts, AdamWConfig, StoredF32};
use crate::Result;
use crate::error::check_len;

/// Elements per quantisation block (one f32 `absmax` each).
pub const BLOCK: usize = 2048;

/// Tensors shorter than this keep f32 moments (see the module docs).
pub const MIN_QUANTIZED_LEN: usize = 4096;

/// Entries of a dynamic map (one byte's worth).
pub const MAP_LEN: usize = 256;

/// Smallest `absmax` the scale `1 / absmax` is taken of, so that it stays finite.
const MIN_ABSMAX: f32 = 1e-38;

/// Blocks of a tensor of `len` elements: `⌈len / BLOCK⌉`.
pub const fn blocks(len: usize) -> usize {
    len.div_ceil(BLOCK)
}

/// The dynamic map (bitsandbytes' `create_dynamic_map(signed, 7, 8)`), sorted ascending:
/// for `i` in `0..7`, the midpoints of `linspace(0.1, 1, n_i)` (f32, torch's scalar formula)
/// times `10^(i − 6)`, with `n_i = 2^i + 1` and their negatives (signed) or
/// `n_i = 2^(i+1) + 1` (unsigned), then 0 and 1. Signed: 127 positive values, 127 negative, 0 and 1 (so
/// `−1` is not in it: a block's most negative element reads back as −0.993·absmax).
/// bitsandbytes' own maps differ from these by at most a few ulps in some entries (torch's
/// vectorised `linspace` rounds by the machine's vector width); these are the same on every
/// machine.
pub fn dynamic_map(signed: bool) -> [f32; MAP_LEN] {
    // 10^(i − 6) as Python evaluates `10 ** (i - 6)`, then rounded to f32 by torch
    const DECADES: [f64; 7] = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0];
    let mut data: Vec<f32> = Vec::with_capacity(MAP_LEN);
    for (i, &decade) in DECADES.iter().enumerate() {
        let n = if signed {
            (1 << i) + 1
        } else {
            (1 << (i + 1)) + 1
        };
        let bounds = linspace_f32(0.1, 1.0, n);
        let scale = decade as f32;
        for pair in bounds.windows(2) {
            let mean = (pair[0] + pair[1]) / 2.0;
            data.push(scale * mean);
            if signed {
                data.push(-(scale * mean));
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    // unsigned: 2 + 4 + … + 128 = 254 values, 0 and 1; signed: 2·127, 0 and 1
    debug_assert_eq!(data.len(), MAP_LEN);
    data.sort_by(f32::total_cmp);
    let mut map = [0.0f32; MAP_LEN];
    map.copy_from_slice(&data);
    map
}

/// `torch.linspace(start, end, n, dtype=float32)`: f32 step `(end − start) / (n − 1)`, the
/// first half counted up from `start`, the second down from `end`.
fn linspace_f32(start: f32, end: f32, n: usize) -> Vec<f32> {
    let step = (end - start) / (n - 1) as f32;
    let half = n / 2;
    (0..n)
        .map(|i| {
            if i < half {
                start + step * i as f32
            } else {
                end - step * (n - 1 - i) as f32
            }
        })
        .collect()
}

/// A dynamic map with its 255 midpoints `(map[i] + map[i + 1]) / 2` (f32), the bounds of
/// the nearest-code search.
#[derive(Debug, Clone)]
pub struct Codebook {
    values: [f32; MAP_LEN],
    midpoints: [f32; MAP_LEN - 1],
}

impl Codebook {
    /// The codebook of `map` (sorted ascending, as [`dynamic_map`] is).
    pub fn new(map: &[f32; MAP_LEN]) -> Self {
        let mut midpoints = [0.0f32; MAP_LEN - 1];
        for (m, pair) in midpoints.iter_mut().zip(map.windows(2)) {
            *m = (pair[0] + pair[1]) / 2.0;
        }
        Self {
            values: *map,
            midpoints,
        }
    }

    /// The signed and the unsigned map's codebooks (first and second moment).
    pub fn moments() -> (Self, Self) {
        (
            Self::new(&dynamic_map(true)),
            Self::new(&dynamic_map(false)),
        )
    }

    /// The map's values.
    pub fn values(&self) -> &[f32; MAP_LEN] {
        &self.values
    }

    /// The code of `s` (a value in [−1, 1]): the number of midpoints below it, i.e. the
    /// nearest map value, the lower one on a tie.
    #[inline]
    pub fn code(&self, s: f32) -> u8 {
        self.midpoints.partition_point(|&m| m < s) as u8
    }

    /// Quantises one block: writes the codes of `x` and returns its `absmax`.
    ///
    /// `x` and `codes` have the same length (at most [`BLOCK`]).
    pub fn quantize_block(&self, x: &[f32], codes: &mut [u8]) -> f32 {
        let absmax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let inv = 1.0 / absmax.max(MIN_ABSMAX);
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = self.code((v * inv).clamp(-1.0, 1.0));
        }
        absmax
    }

    /// Reads one block back: `out[i] = map[codes[i]] · absmax`.
    pub fn dequantize_block(&self, codes: &[u8], absmax: f32, out: &mut [f32]) {
        for (o, &c) in out.iter_mut().zip(codes) {
            *o = self.values[usize::from(c)] * absmax;
        }
    }

    /// Quantises `x` block by block into `codes` (as long as `x`) and `absmax`
    /// ([`blocks`]`(x.len())` long).
    ///
    /// # Errors
    /// Lengths that do not match.
    pub fn quantize(&self, x: &[f32], codes: &mut [u8], absmax: &mut [f32]) -> Result<()> {
        check_len("codes", x.len(), codes.len())?;
        check_len("absmax", blocks(x.len()), absmax.len())?;
        for ((x, c), a) in x.chunks(BLOCK).zip(codes.chunks_mut(BLOCK)).zip(absmax) {
            *a = self.quantize_block(x, c);
        }
        Ok(())
    }

    /// Reads `codes` and `absmax` back into `out` (as long as `codes`).
    ///
    /// # Errors
    /// Lengths that do not match.
    pub fn dequantize(&self, codes: &[u8], absmax: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("out", codes.len(), out.len())?;
        check_len("absmax", blocks(codes.len()), absmax.len())?;
        for ((c, &a), o) in codes.chunks(BLOCK).zip(absmax).zip(out.chunks_mut(BLOCK)) {
            self.dequantize_block(c, a, o);
        }
        Ok(())
    }
}

/// One block's moments as stored: codes and scale of each.
struct BlockState<'a> {
    m: &'a mut [u8],
    v: &'a mut [u8],
    m_absmax: &'a mut f32,
    v_absmax: &'a mut f32,
}

/// [`adamw_step_scaled`](super::optim::adamw_step_scaled) with both moments stored in 8
/// bits: `m` and `v` hold the codes (as long as `params`), `m_absmax` and `v_absmax` the
/// scale of each block (`blocks(params.len())` long), `maps` the signed map then the
/// unsigned one (512 values, [`dynamic_map`]). Per block: read back, the f32 update,
/// quantise with the new `absmax` (see the module docs). Blocks run in parallel; each is
/// computed alone, so the result does not depend on the thread count. The gradient is
/// f32 or bf16 bits, as there.
///
/// # Errors
/// As `adamw_step_scaled`; lengths that do not match; `maps` not 512 long or a map not
/// sorted. Everything is checked before anything is written.
#[allow(clippy::too_many_arguments)]
pub fn adamw_step_int8<G: StoredF32>(
    params: &mut [f32],
    grads: &[G],
    m: &mut [u8],
    v: &mut [u8],
    m_absmax: &mut [f32],
    v_absmax: &mut [f32],
    maps: &[f32],
    step: u64,
    cfg: &AdamWConfig,
    lr: f64,
    grad_scale: f32,
) -> Result<()> {
    let len = params.len();
    check_len("m", len, m.len())?;
    check_len("v", len, v.len())?;
    check_len("m_absmax", blocks(len), m_absmax.len())?;
    check_len("v_absmax", blocks(len), v_absmax.len())?;
    check_len("maps", 2 * MAP_LEN, maps.len())?;
    let (signed, unsigned) = maps.split_at(MAP_LEN);
    let unsorted = |map: &[f32]| {
        map.windows(2)
            .find(|w| w[0].partial_cmp(&w[1]) != Some(std::cmp::Ordering::Less))
            .map(|w| w[1])
    };
    if let Some(value) = unsorted(signed).or(unsorted(unsigned)) {
        return Err(ares_core::Error::OutOfRange {
            what: "maps",
            value: f64::from(value),
            expected: "two strictly ascending 256-value maps",
        }
        .into());
    }
    let k = AdamConsts::checked(grads, len, step, cfg, lr, grad_scale)?;
    let as_map = |m: &[f32]| -> [f32; MAP_LEN] { m.try_into().unwrap_or([0.0; MAP_LEN]) };
    let books = (
        Codebook::new(&as_map(signed)),
        Codebook::new(&as_map(unsigned)),
    );
    let run = |((p, g), s): ((&mut [f32], &[G]), BlockState<'_>)| {
        let n = p.len();
        let (mut mf, mut vf) = ([0.0f32; BLOCK], [0.0f32; BLOCK]);
        let (mf, vf) = (&mut mf[..n], &mut vf[..n]);
        books.0.dequantize_block(s.m, *s.m_absmax, mf);
        books.1.dequantize_block(s.v, *s.v_absmax, vf);
        k.update(p, g, mf, vf, ((0, 0), 0)); // f32 moments here: nothing rounds
        *s.m_absmax = books.0.quantize_block(mf, s.m);
        *s.v_absmax = books.1.quantize_block(vf, s.v);
    };
    let states = m
        .par_chunks_mut(BLOCK)
        .zip(v.par_chunks_mut(BLOCK))
        .zip(m_absmax.par_iter_mut().zip(v_absmax.par_iter_mut()))
        .map(|((m, v), (m_absmax, v_absmax))| BlockState {
            m,
            v,
            m_absmax,
            v_absmax,
        });
    params
        .par_chunks_mut(BLOCK)
        .zip(grads.par_chunks(BLOCK))
        .zip(states)
        .for_each(run);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::optim::adamw_step_scaled;
    use super::*;

    fn maps() -> Vec<f32> {
        let mut m = dynamic_map(true).to_vec();
        m.extend(dynamic_map(false));
        m
    }

    #[test]
    fn maps_hold_zero_one_and_seven_decades() {
        for signed in [true, false] {
            let map = dynamic_map(signed);
            assert!(map.windows(2).all(|w| w[0] < w[1]), "sorted, distinct");
            assert_eq!(map[MAP_LEN - 1], 1.0);
            assert!(map.contains(&0.0));
            let smallest = map.iter().copied().filter(|&x| x > 0.0).fold(1.0, f32::min);
            assert!((1e-7..1e-6).contains(&smallest), "{smallest}");
        }
        let s = dynamic_map(true);
        assert_eq!(s.iter().filter(|&&x| x < 0.0).count(), 127);
        assert!((s[0] + 0.993).abs() < 1e-3, "no −1: {}", s[0]);
        assert_eq!(dynamic_map(false).iter().filter(|&&x| x < 0.0).count(), 0);
    }

    #[test]
    fn codes_are_the_nearest_value_ties_low() {
        let book = Codebook::new(&dynamic_map(true));
        let values = book.values();
        for (i, &value) in values.iter().enumerate() {
            assert_eq!(usize::from(book.code(value)), i, "its own code");
        }
        for i in 0..MAP_LEN - 1 {
            let mid = (values[i] + values[i + 1]) / 2.0;
            assert_eq!(usize::from(book.code(mid)), i, "tie goes low");
            let above =
                f32::from_bits(
                    mid.to_bits()
                        .wrapping_add(if mid > 0.0 { 1 } else { u32::MAX }),
                );
            assert_eq!(usize::from(book.code(above)), i + 1);
        }
        // nearest by brute force on a grid, up to the f32 rounding of a midpoint
        for k in 0..=20_000 {
            let s = -1.0 + k as f32 * 1e-4;
            let c = usize::from(book.code(s));
            let best = (0..MAP_LEN)
                .min_by(|&a, &b| (values[a] - s).abs().total_cmp(&(values[b] - s).abs()))
                .unwrap();
            let slack = f32::EPSILON;
            assert!(
                (values[c] - s).abs() <= (values[best] - s).abs() + slack,
                "{s}"
            );
        }
    }

    #[test]
    fn blocks_round_trip_within_the_map_step() {
        let book = Codebook::new(&dynamic_map(true));
        let x: Vec<f32> = (0..5000)
            .map(|i| ((i as f32) * 0.37).sin() * 1e-3)
            .collect();
        let mut codes = vec![0u8; x.len()];
        let mut absmax = vec![0.0f32; blocks(x.len())];
        book.quantize(&x, &mut codes, &mut absmax).unwrap();
        let mut back = vec![0.0f32; x.len()];
        book.dequantize(&codes, &absmax, &mut back).unwrap();
        for (i, (&a, &b)) in x.iter().zip(&back).enumerate() {
            let am = absmax[i / BLOCK];
            // the widest step near 1 is ~1/64 of absmax; small values keep ~5 % or 1e-7·absmax
            assert!(
                (a - b).abs() <= (0.008 * am).max(0.05 * a.abs()).max(1e-6 * am),
                "{i}: {a} {b}"
            );
        }
        // a block of zeros
        let mut c = [7u8; 3];
        assert_eq!(book.quantize_block(&[0.0; 3], &mut c), 0.0);
        assert!(c.iter().all(|&c| book.values()[usize::from(c)] == 0.0));
        assert!(book.quantize(&x, &mut codes[1..], &mut absmax).is_err());
    }

    #[test]
    fn int8_step_is_the_f32_step_on_the_read_back_moments() {
        let n = BLOCK * 2 + 300;
        let cfg = AdamWConfig::default();
        let (book_m, book_v) = Codebook::moments();
        let mut p: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.11).cos()).collect();
        let mut p_ref = p.clone();
        let (mut m, mut v) = (vec![0u8; n], vec![0u8; n]);
        let (mut ma, mut va) = (vec![0.0f32; blocks(n)], vec![0.0f32; blocks(n)]);
        let maps = maps();
        for step in 1..=4u64 {
            let g: Vec<f32> = (0..n)
                .map(|i| ((i as f32 + step as f32) * 0.7).sin() * 1e-2)
                .collect();
            // reference: dequantise, f32 step, quantise
            let (mut mf, mut vf) = (vec![0.0f32; n], vec![0.0f32; n]);
            book_m.dequantize(&m, &ma, &mut mf).unwrap();
            book_v.dequantize(&v, &va, &mut vf).unwrap();
            adamw_step_scaled(&mut p_ref, &g, &mut mf, &mut vf, step, &cfg, 1e-3, 0.5, 0).unwrap();
            let (mut mc, mut vc) = (vec![0u8; n], vec![0u8; n]);
            let (mut mac, mut vac) = (vec![0.0f32; blocks(n)], vec![0.0f32; blocks(n)]);
            book_m.quantize(&mf, &mut mc, &mut mac).unwrap();
            book_v.quantize(&vf, &mut vc, &mut vac).unwrap();

            adamw_step_int8(
                &mut p, &g, &mut m, &mut v, &mut ma, &mut va, &maps, step, &cfg, 1e-3, 0.5,
            )
            .unwrap();
            assert_eq!(p, p_ref, "step {step}");
            assert_eq!((&m, &v, &ma, &va), (&mc, &vc, &mac, &vac), "step {step}");
        }
        assert!(ma.iter().all(|&a| a > 0.0) && va.iter().all(|&a| a > 0.0));
    }

    #[test]
    fn int8_step_checks_before_writing() {
        let n = 10;
        let mut p = vec![1.0f32; n];
        let (mut m, mut v) = (vec![0u8; n], vec![0u8; n]);
        let (mut ma, mut va) = (vec![0.0f32; 1], vec![0.0f32; 1]);
        let cfg = AdamWConfig::default();
        let mut bad_grad = vec![0.1f32; n];
        bad_grad[3] = f32::NAN;
        let mut bad_maps = maps();
        bad_maps.swap(0, 1);
        let g = vec![0.1f32; n];
        let cases: [(&[f32], Vec<f32>, usize); 4] = [
            (&bad_grad, maps(), 1),
            (&g, bad_maps, 1),
            (&g, maps()[..300].to_vec(), 1),
            (&g, maps(), 2),
        ];
        for (grads, maps, absmax_len) in cases {
            let mut ma2 = vec![0.0f32; absmax_len];
            let r = adamw_step_int8(
                &mut p, grads, &mut m, &mut v, &mut ma2, &mut va, &maps, 1, &cfg, 1e-3, 1.0,
            );
            assert!(r.is_err());
            assert!(p.iter().all(|&x| x == 1.0) && m.iter().all(|&c| c == 0));
        }
        ma[0] = 0.0;
        adamw_step_int8(
            &mut p,
            &g,
            &mut m,
            &mut v,
            &mut ma,
            &mut va,
            &maps(),
            1,
            &cfg,
            1e-3,
            1.0,
        )
        .unwrap();
        assert!(p.iter().all(|&x| x < 1.0));
    }
}
