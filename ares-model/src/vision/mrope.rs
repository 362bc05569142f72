//! Multimodal rotary positions (M-RoPE) of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL): the
//! text-side placeholder expansion, the 3-D position ids of a prompt, the positions of
//! generated tokens, and the per-token cos / sin tables. Pure functions on host data; the
//! model feeds the tables to [`Backend::rope`](crate::backend::Backend::rope) unchanged.
//!
//! # 1. Placeholder expansion ([`expand_placeholders`])
//!
//! A prompt holds one `<|image_pad|>` per image and one `<|video_pad|>` per video (inside
//! `<|vision_start|> … <|vision_end|>`, which are ordinary tokens here). The `i`-th image pad
//! becomes `t·h·w / merge²` image pads for the `i`-th image grid `[t, h, w]` (patches of the
//! vision tower; `merge` = `spatial_merge_size`, 2 on the hub), likewise for videos — what the
//! processor's text side does. The number of pads of each kind must equal the number of grids
//! of that kind ([`MropeError::PlaceholderCount`]).
//!
//! # 2. Position ids of a prompt ([`rope_index`])
//!
//! Every token gets three positions (temporal, height, width). Per sequence, over its valid
//! tokens (attention mask 1; padding gets position 0 on all axes, as transformers 5.24 writes
//! it), with `next` starting at 0:
//!
//! * a **text** token gets `next` on all three axes, then `next += 1`;
//! * a **vision block** (the `T·H·W` pad tokens of one grid, `H = h / merge`, `W = w / merge`,
//!   in the row-major order (t, row, column) of the merged patches) with `start = next` gives
//!   its token `(τ, r, c)` the positions `(start + θ(τ), start + r, start + c)`. Then
//!   `next = max(start + θ(T−1), start + H − 1, start + W − 1) + 1` — one more than the
//!   largest position so far.
//!
//! The temporal index `θ` is:
//! * images, and every video of **Qwen2-VL**: `θ(τ) = τ`;
//! * videos of **Qwen2.5-VL**: `θ(τ) = trunc(f32(τ) · f32(f32(tokens_per_second) ·
//!   f32(second_per_grid_ts)))`, in `f32` as transformers computes it (`second_per_grid_ts` =
//!   `temporal_patch_size / fps`, 1 when not given; `tokens_per_second` from
//!   `vision_config`, 2 on the hub). At 3 fps the step is `f32(4/3)` and `θ` = 0, 1, 2, 4.
//!
//! The sequence's **`rope_delta`** = (largest position + 1) − (number of valid tokens), ≤ 0
//! when vision blocks are present (a block of `T·H·W` tokens advances the positions by only
//! `max(θ(T−1), H − 1, W − 1) + 1`); 0 for text only and for a sequence without valid tokens.
//! Grids are consumed in order across the whole batch, images and videos separately, as
//! transformers does; blocks of the same kind that touch are split by their grids' sizes.
//!
//! **Difference from transformers 5.24.** Its `get_rope_index` continues the text after a
//! block at `start + max(H, W)`, while the original Qwen code and vLLM (and this module)
//! continue at the largest position + 1 as above. The two agree unless the block's temporal
//! span exceeds its spatial one, `θ(T−1) > max(H, W) − 1` — a video with more (scaled) time
//! steps than merged rows or columns: a 12-frame 56×56 Qwen2.5-VL video at 2 fps (grid
//! `[6, 4, 4]`, `θ` = 0, 2, …, 10) continues at `start + 2` in transformers 5.24 and at
//! `start + 11` here; transformers then also reports a different `rope_delta`. Images
//! (`T = 1`) never differ.
//!
//! Other details that follow transformers 5.24: Qwen2.5-VL images use `θ(τ) = τ` (no time
//! scaling); the time step is `tokens_per_second · second_per_grid_ts` rounded to `f32` before
//! it multiplies `τ` (the original code multiplies `τ · second_per_grid_ts` first, which can
//! round differently on the other side of an integer).
//!
//! # 3. Generated tokens ([`decode_position`])
//!
//! The `k`-th generated token (`k = 0` first) of a sequence with `n` valid prompt tokens gets
//! `n + k + rope_delta` on all three axes: generation continues one past the largest prompt
//! position, and text keeps the three axes equal.
//!
//! # 4. Cos / sin tables ([`MropeRope`])
//!
//! `head_dim/2` frequencies `inv_freq[j]` as for text RoPE
//! ([`RopeTable`], `rope_type` default) are split by `mrope_section = [s_t, s_h, s_w]`
//! (summing to `head_dim/2`; `[16, 24, 24]` for a head of 128): frequency `j < s_t` takes the
//! token's temporal position, `s_t ≤ j < s_t + s_h` the height one, the rest the width one.
//! transformers 5.24 splits the `head_dim/2` frequencies this way and then repeats the whole
//! `head_dim/2` vector for the second half of the head (it does not split `head_dim` into
//! sections repeated per half), so the `[tokens, head_dim/2]` tables here are exactly what the
//! rotate-half [`Backend::rope`](crate::backend::Backend::rope) op and
//! [`RopeTable::cos_sin`] use. Each value is `RopeTable`'s own
//! `cos(f32(position) · inv_freq[j])` (same `f32` numerics), so text-only positions give the
//! text tables bit for bit.

use ares_cpu::ops::rope::{RopeConfig, RopeScaling, RopeTable};

/// Errors of the M-RoPE functions; each names the counts, indices or values involved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MropeError {
    /// The prompt holds a different number of placeholders of one kind than grids were given.
    #[error(
        "{found} {token} placeholder(s) in the prompt but {grids} {kind} grid(s) given; \
         each {kind} needs exactly one {token}"
    )]
    PlaceholderCount {
        /// `image` or `video`.
        kind: &'static str,
        /// The placeholder token's name.
        token: &'static str,
        /// Placeholders found.
        found: usize,
        /// Grids given.
        grids: usize,
    },
    /// A vision block without a grid left to describe it.
    #[error(
        "{kind} block {block} (sequence {row}, token {index}) has no grid: only {grids} {kind} \
         grid(s) given"
    )]
    MissingGrid {
        /// `image` or `video`.
        kind: &'static str,
        /// 0-based number of the block over the batch.
        block: usize,
        /// Sequence of the batch.
        row: usize,
        /// Token index in the sequence (padded).
        index: usize,
        /// Grids given.
        grids: usize,
    },
    /// Grids left over after every block of the batch took one.
    #[error("{grids} {kind} grid(s) given but the sequences hold {blocks} {kind} block(s)")]
    UnusedGrids {
        /// `image` or `video`.
        kind: &'static str,
        /// Grids given.
        grids: usize,
        /// Blocks found.
        blocks: usize,
    },
    /// A vision block shorter than its grid needs.
    #[error(
        "{kind} block {block} (sequence {row}, from token {index}) has {found} {token} \
         token(s) but its grid {grid:?} needs {needed}"
    )]
    ShortBlock {
        /// `image` or `video`.
        kind: &'static str,
        /// The pad token's name.
        token: &'static str,
        /// 0-based number of the block over the batch.
        block: usize,
        /// Sequence of the batch.
        row: usize,
        /// Index of its first token (padded).
        index: usize,
        /// The grid `[t, h, w]`.
        grid: [usize; 3],
        /// Tokens the grid needs.
        needed: usize,
        /// Consecutive valid pad tokens found.
        found: usize,
    },
    /// A grid with a zero side or a side not divisible by `spatial_merge_size`.
    #[error(
        "{kind} grid {index} = {grid:?} is invalid: t, h, w must be >= 1 and h, w multiples of \
         spatial_merge_size = {merge}"
    )]
    Grid {
        /// `image` or `video`.
        kind: &'static str,
        /// Index among the grids of that kind.
        index: usize,
        /// The grid `[t, h, w]`.
        grid: [usize; 3],
        /// `spatial_merge_size`.
        merge: usize,
    },
    /// An argument out of its range (the message says which and why).
    #[error("{what}: {message}")]
    Argument {
        /// The argument.
        what: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A slice of the wrong length.
    #[error("{what} has {actual} elements, expected {expected}")]
    Length {
        /// The argument.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        actual: usize,
    },
    /// An attention-mask value other than 0 or 1.
    #[error("attention_mask[{index}] = {value}, expected 0 or 1")]
    Mask {
        /// Flat index.
        index: usize,
        /// The value.
        value: u32,
    },
    /// A position beyond `u32`.
    #[error("position overflow: {what} passes u32::MAX")]
    Overflow {
        /// What overflowed.
        what: String,
    },
}

fn argument(what: &'static str, message: impl Into<String>) -> MropeError {
    MropeError::Argument {
        what,
        message: message.into(),
    }
}

/// The ids of the placeholder tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VisionTokens {
    /// `<|image_pad|>` (`image_token_id` in `config.json`).
    pub image_pad: u32,
    /// `<|video_pad|>` (`video_token_id` in `config.json`).
    pub video_pad: u32,
}

impl VisionTokens {
    /// The ids of the Qwen2-VL / Qwen2.5-VL tokenizers on the hub (151655, 151656).
    pub const QWEN2_VL: Self = Self {
        image_pad: 151_655,
        video_pad: 151_656,
    };
}

/// How video blocks index time (images always use the frame index).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TemporalScale {
    /// Qwen2-VL: `θ(τ) = τ`.
    Index,
    /// Qwen2.5-VL: `θ(τ) = trunc(f32(τ) · f32(tokens_per_second · second_per_grid_ts))` per
    /// video (see the module docs).
    PerSecond {
        /// `vision_config.tokens_per_second` (2 on the hub).
        tokens_per_second: f64,
    },
}

/// What [`rope_index`] needs from the model config.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MropeConfig {
    /// The placeholder token ids.
    pub tokens: VisionTokens,
    /// `vision_config.spatial_merge_size` (2 on the hub).
    pub spatial_merge_size: usize,
    /// Qwen2-VL ([`TemporalScale::Index`]) or Qwen2.5-VL ([`TemporalScale::PerSecond`]).
    pub temporal: TemporalScale,
}

/// The images and videos of a batch, in prompt order (rows in order).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct VisionGrids<'a> {
    /// `image_grid_thw`, one `[t, h, w]` per image (patches before the merge).
    pub images: &'a [[usize; 3]],
    /// `video_grid_thw`, one per video.
    pub videos: &'a [[usize; 3]],
    /// `second_per_grid_ts`, one per video (`temporal_patch_size / fps`); `None`: 1 for every
    /// video. Used by [`TemporalScale::PerSecond`] only.
    pub second_per_grid_ts: Option<&'a [f64]>,
}

/// Checks `grid` and returns `(T, H, W)` after the spatial merge.
fn merged(
    kind: &'static str,
    index: usize,
    grid: [usize; 3],
    merge: usize,
) -> Result<[usize; 3], MropeError> {
    let [t, h, w] = grid;
    let bad = MropeError::Grid {
        kind,
        index,
        grid,
        merge,
    };
    if merge == 0 || t == 0 || h == 0 || w == 0 || h % merge != 0 || w % merge != 0 {
        return Err(bad);
    }
    Ok([t, h / merge, w / merge])
}

/// Number of language-model tokens of a vision input of grid `[t, h, w]`:
/// `t·h·w / spatial_merge_size²`.
///
/// # Errors
/// [`MropeError::Grid`] for a zero side, `h` or `w` not a multiple of `spatial_merge_size`,
/// or `spatial_merge_size == 0`; [`MropeError::Overflow`] if the count passes `usize`.
pub fn tokens_per_grid(grid: [usize; 3], spatial_merge_size: usize) -> Result<usize, MropeError> {
    let [t, h, w] = merged("vision", 0, grid, spatial_merge_size)?;
    block_len(grid, [t, h, w])
}

fn block_len(grid: [usize; 3], [t, h, w]: [usize; 3]) -> Result<usize, MropeError> {
    t.checked_mul(h)
        .and_then(|n| n.checked_mul(w))
        .ok_or_else(|| MropeError::Overflow {
            what: format!("token count of grid {grid:?}"),
        })
}

/// Expands each `<|image_pad|>` / `<|video_pad|>` of one prompt into as many pads as its
/// grid has merged patches (`t·h·w / spatial_merge_size²`), the `i`-th pad of a kind taking
/// the `i`-th grid of that kind. Other tokens are copied.
///
/// # Errors
/// [`MropeError::PlaceholderCount`] when the prompt holds more or fewer pads of a kind than
/// grids were given; [`MropeError::Grid`] for an invalid grid.
pub fn expand_placeholders(
    ids: &[u32],
    tokens: VisionTokens,
    image_grids: &[[usize; 3]],
    video_grids: &[[usize; 3]],
    spatial_merge_size: usize,
) -> Result<Vec<u32>, MropeError> {
    if tokens.image_pad == tokens.video_pad {
        return Err(argument(
            "tokens",
            format!(
                "image_pad and video_pad are the same id {}",
                tokens.image_pad
            ),
        ));
    }
    let lens = |kind, grids: &[[usize; 3]]| -> Result<Vec<usize>, MropeError> {
        grids
            .iter()
            .enumerate()
            .map(|(i, &g)| block_len(g, merged(kind, i, g, spatial_merge_size)?))
            .collect()
    };
    let image_lens = lens("image", image_grids)?;
    let video_lens = lens("video", video_grids)?;
    let count = |id| ids.iter().filter(|&&t| t == id).count();
    for (kind, token, id, grids) in [
        (
            "image",
            "<|image_pad|>",
            tokens.image_pad,
            image_grids.len(),
        ),
        (
            "video",
            "<|video_pad|>",
            tokens.video_pad,
            video_grids.len(),
        ),
    ] {
        let found = count(id);
        if found != grids {
            return Err(MropeError::PlaceholderCount {
                kind,
                token,
                found,
                grids,
            });
        }
    }
    let extra: usize = image_lens.iter().chain(&video_lens).sum::<usize>();
    let mut out = Vec::with_capacity(ids.len() + extra);
    let (mut images, mut videos) = (image_lens.iter(), video_lens.iter());
    for &id in ids {
        // Counts were checked above, so the iterators cannot run out.
        let n = if id == tokens.image_pad {
            images.next().copied().unwrap_or(0)
        } else if id == tokens.video_pad {
            videos.next().copied().unwrap_or(0)
        } else {
            1
        };
        out.extend(std::iter::repeat_n(id, n));
    }
    Ok(out)
}

/// 3-D positions of a batch: [`rope_index`]'s result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MropePositions {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence (padded).
    pub seq: usize,
    /// `[3, batch, seq]` (temporal, height, width), transformers' `position_ids` layout;
    /// padding is 0.
    pub position_ids: Vec<u32>,
    /// `[batch]`: largest position + 1 − valid tokens, per sequence.
    pub rope_deltas: Vec<i64>,
}

impl MropePositions {
    /// The `[batch, seq]` positions of one axis (0 temporal, 1 height, 2 width).
    ///
    /// # Panics
    /// If `axis > 2`.
    pub fn axis(&self, axis: usize) -> &[u32] {
        let n = self.batch * self.seq;
        &self.position_ids[axis * n..(axis + 1) * n]
    }
}

/// Temporal indices `θ(τ)` of a video block (see the module docs).
fn temporal_index(
    scale: TemporalScale,
    t: usize,
    second_per_grid: f64,
) -> Result<Vec<u64>, MropeError> {
    match scale {
        TemporalScale::Index => Ok((0..t as u64).collect()),
        TemporalScale::PerSecond { tokens_per_second } => {
            // As torch evaluates it: the step rounded to f32, each f32 product truncated.
            let step = (tokens_per_second as f32) * (second_per_grid as f32);
            (0..t)
                .map(|tau| {
                    let v = (tau as f32) * step;
                    if v.is_finite() && v >= 0.0 && v < u32::MAX as f32 {
                        Ok(v.trunc() as u64)
                    } else {
                        Err(MropeError::Overflow {
                            what: format!("temporal index {tau} · {step}"),
                        })
                    }
                })
                .collect()
        }
    }
}

/// Checks the config's and the grids' scalars.
fn check_config(config: &MropeConfig, grids: &VisionGrids<'_>) -> Result<(), MropeError> {
    if config.tokens.image_pad == config.tokens.video_pad {
        return Err(argument(
            "tokens",
            format!(
                "image_pad and video_pad are the same id {}",
                config.tokens.image_pad
            ),
        ));
    }
    if config.spatial_merge_size == 0 {
        return Err(argument("spatial_merge_size", "must be >= 1, found 0"));
    }
    if let TemporalScale::PerSecond { tokens_per_second } = config.temporal
        && !(tokens_per_second.is_finite() && tokens_per_second >= 0.0)
    {
        return Err(argument(
            "tokens_per_second",
            format!("must be finite and >= 0, found {tokens_per_second}"),
        ));
    }
    if let Some(s) = grids.second_per_grid_ts {
        if s.len() != grids.videos.len() {
            return Err(MropeError::Length {
                what: "second_per_grid_ts",
                expected: grids.videos.len(),
                actual: s.len(),
            });
        }
        if let Some((i, v)) = s
            .iter()
            .enumerate()
            .find(|(_, v)| !(v.is_finite() && **v >= 0.0))
        {
            return Err(argument(
                "second_per_grid_ts",
                format!("element {i} = {v}, expected finite and >= 0"),
            ));
        }
    }
    Ok(())
}

/// The 3-D position ids and `rope_delta`s of a batch of expanded prompts `input_ids`
/// `[batch, seq]` (row-major; `seq = input_ids.len() / batch`), with an optional
/// `attention_mask` `[batch, seq]` of 0/1 (left or right padding; `None`: all valid). The
/// rules are in the module docs: transformers' `get_rope_index` for Qwen2-VL and Qwen2.5-VL,
/// except that text after a vision block continues at the largest position + 1 (the original
/// Qwen rule), which differs from transformers 5.24 only after a video whose temporal span
/// exceeds its spatial size.
///
/// # Errors
/// Lengths that do not fit `batch`; a mask value other than 0/1; an invalid grid or config
/// value; a vision block without a grid ([`MropeError::MissingGrid`]), shorter than its grid
/// ([`MropeError::ShortBlock`]), or grids left unused ([`MropeError::UnusedGrids`]); a
/// position past `u32`.
pub fn rope_index(
    config: &MropeConfig,
    input_ids: &[u32],
    batch: usize,
    attention_mask: Option<&[u32]>,
    grids: &VisionGrids<'_>,
) -> Result<MropePositions, MropeError> {
    check_config(config, grids)?;
    if batch == 0 {
        return Err(argument("batch", "must be >= 1, found 0"));
    }
    if !input_ids.len().is_multiple_of(batch) {
        return Err(argument(
            "input_ids",
            format!(
                "{} ids do not split into {batch} sequences",
                input_ids.len()
            ),
        ));
    }
    let seq = input_ids.len() / batch;
    if let Some(mask) = attention_mask {
        if mask.len() != input_ids.len() {
            return Err(MropeError::Length {
                what: "attention_mask",
                expected: input_ids.len(),
                actual: mask.len(),
            });
        }
        if let Some((index, &value)) = mask.iter().enumerate().find(|&(_, &m)| m > 1) {
            return Err(MropeError::Mask { index, value });
        }
    }
    let merge = config.spatial_merge_size;
    let image_dims: Vec<[usize; 3]> = (grids.images.iter().enumerate())
        .map(|(i, &g)| merged("image", i, g, merge))
        .collect::<Result<_, _>>()?;
    let video_dims: Vec<[usize; 3]> = (grids.videos.iter().enumerate())
        .map(|(i, &g)| merged("video", i, g, merge))
        .collect::<Result<_, _>>()?;

    let n = input_ids.len();
    let mut position_ids = vec![0u32; 3 * n];
    let mut rope_deltas = Vec::with_capacity(batch);
    let (mut next_image, mut next_video) = (0usize, 0usize);
    let to_u32 = |p: u64, what: &dyn Fn() -> String| {
        u32::try_from(p).map_err(|_| MropeError::Overflow { what: what() })
    };
    for row in 0..batch {
        let ids = &input_ids[row * seq..(row + 1) * seq];
        let valid = |i: usize| attention_mask.is_none_or(|m| m[row * seq + i] == 1);
        // Next position (largest so far + 1) and number of valid tokens.
        let (mut next, mut n_valid) = (0u64, 0u64);
        let mut i = 0;
        while i < seq {
            if !valid(i) {
                i += 1;
                continue;
            }
            let id = ids[i];
            let (kind, token, dims, grid_list, counter) = if id == config.tokens.image_pad {
                (
                    "image",
                    "<|image_pad|>",
                    &image_dims,
                    grids.images,
                    &mut next_image,
                )
            } else if id == config.tokens.video_pad {
                (
                    "video",
                    "<|video_pad|>",
                    &video_dims,
                    grids.videos,
                    &mut next_video,
                )
            } else {
                let flat = row * seq + i;
                let p = to_u32(next, &|| format!("text position in sequence {row}"))?;
                for axis in 0..3 {
                    position_ids[axis * n + flat] = p;
                }
                next += 1;
                n_valid += 1;
                i += 1;
                continue;
            };
            let block = *counter;
            let Some(&[t, h, w]) = dims.get(block) else {
                return Err(MropeError::MissingGrid {
                    kind,
                    block,
                    row,
                    index: i,
                    grids: grid_list.len(),
                });
            };
            *counter += 1;
            let grid = grid_list[block];
            let needed = block_len(grid, [t, h, w])?;
            // The block's tokens: the next `needed` valid tokens, all this pad.
            let mut slots = Vec::with_capacity(needed);
            let mut j = i;
            while j < seq && slots.len() < needed {
                if valid(j) {
                    if ids[j] != id {
                        break;
                    }
                    slots.push(j);
                }
                j += 1;
            }
            if slots.len() < needed {
                return Err(MropeError::ShortBlock {
                    kind,
                    token,
                    block,
                    row,
                    index: i,
                    grid,
                    needed,
                    found: slots.len(),
                });
            }
            let theta = if kind == "video" {
                let spg = grids.second_per_grid_ts.map_or(1.0, |s| s[block]);
                temporal_index(config.temporal, t, spg)?
            } else {
                (0..t as u64).collect()
            };
            let start = next;
            let what = || format!("{kind} block {block} in sequence {row}");
            let mut slot = slots.iter();
            for &th in &theta {
                let pt = to_u32(start + th, &what)?;
                for r in 0..h as u64 {
                    let ph = to_u32(start + r, &what)?;
                    for c in 0..w as u64 {
                        let pw = to_u32(start + c, &what)?;
                        // `slots` holds exactly t·h·w entries.
                        if let Some(&s) = slot.next() {
                            let flat = row * seq + s;
                            position_ids[flat] = pt;
                            position_ids[n + flat] = ph;
                            position_ids[2 * n + flat] = pw;
                        }
                    }
                }
            }
            let last_t = theta.last().copied().unwrap_or(0);
            next = start + last_t.max(h as u64 - 1).max(w as u64 - 1) + 1;
            n_valid += needed as u64;
            i = j;
        }
        let delta = if n_valid == 0 {
            0
        } else {
            next as i64 - n_valid as i64
        };
        rope_deltas.push(delta);
    }
    for (kind, used, given) in [
        ("image", next_image, grids.images.len()),
        ("video", next_video, grids.videos.len()),
    ] {
        if used != given {
            return Err(MropeError::UnusedGrids {
                kind,
                grids: given,
                blocks: used,
            });
        }
    }
    Ok(MropePositions {
        batch,
        seq,
        position_ids,
        rope_deltas,
    })
}

/// Position (the same on all three axes) of the `k`-th generated token (`k = 0` first) of a
/// sequence whose prompt has `prompt_len` valid tokens and [`rope_index`]'s `rope_delta`:
/// `prompt_len + k + rope_delta`.
///
/// # Errors
/// [`MropeError::Overflow`] if the result is negative (an inconsistent `rope_delta`) or passes
/// `u32`.
pub fn decode_position(prompt_len: usize, k: usize, rope_delta: i64) -> Result<u32, MropeError> {
    let p = (prompt_len as i128) + (k as i128) + i128::from(rope_delta);
    u32::try_from(p).map_err(|_| MropeError::Overflow {
        what: format!("decode position {prompt_len} + {k} + ({rope_delta}) = {p}"),
    })
}

/// The M-RoPE cos / sin of a model: its text [`RopeTable`] and `mrope_section`.
#[derive(Debug, Clone, PartialEq)]
pub struct MropeRope {
    table: RopeTable,
    section: [usize; 3],
}

impl MropeRope {
    /// The default (unscaled) RoPE of `head_dim` and `rope_theta`, split by `mrope_section`.
    ///
    /// # Errors
    /// As [`MropeRope::from_table`], and `head_dim` odd or 0 or `rope_theta` not finite and > 0.
    pub fn new(
        head_dim: usize,
        rope_theta: f64,
        mrope_section: [usize; 3],
    ) -> Result<Self, MropeError> {
        let table = RopeTable::new(&RopeConfig {
            head_dim,
            theta: rope_theta,
            scaling: RopeScaling::None,
        })
        .map_err(|e| argument("rope", e.to_string()))?;
        Self::from_table(table, mrope_section)
    }

    /// `table`'s frequencies split by `mrope_section`.
    ///
    /// # Errors
    /// `mrope_section` not summing to `head_dim / 2`.
    pub fn from_table(table: RopeTable, mrope_section: [usize; 3]) -> Result<Self, MropeError> {
        let half = table.head_dim() / 2;
        let sum = mrope_section
            .iter()
            .try_fold(0usize, |a, &s| a.checked_add(s));
        if sum != Some(half) {
            return Err(argument(
                "mrope_section",
                format!("{mrope_section:?} must sum to head_dim / 2 = {half}"),
            ));
        }
        Ok(Self {
            table,
            section: mrope_section,
        })
    }

    /// `head_dim`.
    pub fn head_dim(&self) -> usize {
        self.table.head_dim()
    }

    /// `mrope_section`.
    pub fn section(&self) -> [usize; 3] {
        self.section
    }

    /// Fills `cos`, `sin` `[tokens, head_dim/2]` from `position_ids` `[3, tokens]` (axis-major,
    /// e.g. [`MropePositions::position_ids`] with `tokens = batch·seq`): frequency `j` of token
    /// `n` uses the position of the axis whose section holds `j`. The layout of
    /// [`RopeTable::cos_sin`] and [`Backend::rope`](crate::backend::Backend::rope) (transformers
    /// repeats these over both halves of the head).
    ///
    /// # Errors
    /// `position_ids` not a multiple of 3 long, or `cos` / `sin` not `tokens · head_dim/2`.
    pub fn cos_sin(
        &self,
        position_ids: &[u32],
        cos: &mut [f32],
        sin: &mut [f32],
    ) -> Result<(), MropeError> {
        if !position_ids.len().is_multiple_of(3) {
            return Err(argument(
                "position_ids",
                format!("{} values is not [3, tokens]", position_ids.len()),
            ));
        }
        let tokens = position_ids.len() / 3;
        let half = self.table.head_dim() / 2;
        let len = tokens * half;
        for (what, actual) in [("cos", cos.len()), ("sin", sin.len())] {
            if actual != len {
                return Err(MropeError::Length {
                    what,
                    expected: len,
                    actual,
                });
            }
        }
        // Each axis through RopeTable's own formula, keeping that axis's columns.
        let (mut c, mut s) = (vec![0.0f32; len], vec![0.0f32; len]);
        let mut lo = 0;
        for (axis, &width) in self.section.iter().enumerate() {
            let hi = lo + width;
            if width > 0 {
                let pos = &position_ids[axis * tokens..(axis + 1) * tokens];
                self.table
                    .cos_sin(pos, &mut c, &mut s)
                    .map_err(|e| argument("rope", e.to_string()))?;
                for ((dst, src), (dst_s, src_s)) in cos
                    .chunks_exact_mut(half)
                    .zip(c.chunks_exact(half))
                    .zip(sin.chunks_exact_mut(half).zip(s.chunks_exact(half)))
                {
                    dst[lo..hi].copy_from_slice(&src[lo..hi]);
                    dst_s[lo..hi].copy_from_slice(&src_s[lo..hi]);
                }
            }
            lo = hi;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOK: VisionTokens = VisionTokens {
        image_pad: 9,
        video_pad: 8,
    };

    fn cfg(temporal: TemporalScale) -> MropeConfig {
        MropeConfig {
            tokens: TOK,
            spatial_merge_size: 2,
            temporal,
        }
    }

    #[test]
    fn expansion_counts() {
        let ids = [1, 9, 2, 8, 3];
        let out = expand_placeholders(&ids, TOK, &[[1, 4, 6]], &[[2, 2, 2]], 2).unwrap();
        assert_eq!(out, [1, 9, 9, 9, 9, 9, 9, 2, 8, 8, 3]);
        let e = expand_placeholders(&ids, TOK, &[], &[[2, 2, 2]], 2).unwrap_err();
        assert!(matches!(
            e,
            MropeError::PlaceholderCount {
                kind: "image",
                found: 1,
                grids: 0,
                ..
            }
        ));
        assert!(e.to_string().contains("1 <|image_pad|>"), "{e}");
        let e =
            expand_placeholders(&ids, TOK, &[[1, 2, 2]], &[[1, 2, 2], [1, 2, 2]], 2).unwrap_err();
        assert!(e.to_string().contains("but 2 video grid(s)"), "{e}");
        let e = expand_placeholders(&ids, TOK, &[[1, 3, 2]], &[[1, 2, 2]], 2).unwrap_err();
        assert!(matches!(e, MropeError::Grid { kind: "image", .. }), "{e}");
    }

    #[test]
    fn text_only_and_padding() {
        let ids = [5, 5, 1, 2, 3];
        let mask = [0, 0, 1, 1, 1];
        let p = rope_index(
            &cfg(TemporalScale::Index),
            &ids,
            1,
            Some(&mask),
            &VisionGrids::default(),
        )
        .unwrap();
        for a in 0..3 {
            assert_eq!(p.axis(a), [0, 0, 0, 1, 2]);
        }
        assert_eq!(p.rope_deltas, [0]);
        assert_eq!(decode_position(3, 0, 0).unwrap(), 3);
    }

    /// Where transformers 5.24 and the original rule part: a 12-frame 56×56 video at 2 fps in
    /// Qwen2.5-VL (grid [6, 4, 4], merged 2×2, temporal step 2·1.0 = 2).
    #[test]
    fn long_video_continues_after_its_last_time_step() {
        let mut ids = vec![1, 8];
        ids.extend([8; 23]);
        ids.extend([2, 3]);
        let p = rope_index(
            &cfg(TemporalScale::PerSecond {
                tokens_per_second: 2.0,
            }),
            &ids,
            1,
            None,
            &VisionGrids {
                videos: &[[6, 4, 4]],
                second_per_grid_ts: Some(&[1.0]),
                ..Default::default()
            },
        )
        .unwrap();
        // start = 1; θ = 0, 2, …, 10; text after at 1 + 10 + 1 = 12 (transformers: 1 + 2 = 3).
        assert_eq!(&p.axis(0)[1..5], [1, 1, 1, 1]);
        assert_eq!(&p.axis(0)[21..25], [11, 11, 11, 11]);
        assert_eq!(&p.axis(1)[1..5], [1, 1, 2, 2]);
        assert_eq!(&p.axis(2)[1..5], [1, 2, 1, 2]);
        for a in 0..3 {
            assert_eq!(&p.axis(a)[25..], [12, 13]);
        }
        // max 13 + 1 − 27 tokens.
        assert_eq!(p.rope_deltas, [-13]);
        assert_eq!(decode_position(27, 0, -13).unwrap(), 14);
    }

    #[test]
    fn block_errors_name_counts() {
        let c = cfg(TemporalScale::Index);
        let ids = [1, 9, 9, 9, 2];
        let e = rope_index(&c, &ids, 1, None, &VisionGrids::default()).unwrap_err();
        assert!(e.to_string().contains("only 0 image grid"), "{e}");
        let e = rope_index(
            &c,
            &ids,
            1,
            None,
            &VisionGrids {
                images: &[[1, 4, 4]],
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                MropeError::ShortBlock {
                    needed: 4,
                    found: 3,
                    ..
                }
            ),
            "{e}"
        );
        let e = rope_index(
            &c,
            &ids,
            1,
            None,
            &VisionGrids {
                images: &[[1, 2, 6]],
                videos: &[[1, 2, 2]],
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("1 video grid(s) given but the sequences hold 0"),
            "{e}"
        );
        let e = rope_index(&c, &ids, 2, None, &VisionGrids::default()).unwrap_err();
        assert!(e.to_string().contains("5 ids"), "{e}");
        let e =
            rope_index(&c, &ids, 1, Some(&[1, 1, 2, 1, 1]), &VisionGrids::default()).unwrap_err();
        assert_eq!(e, MropeError::Mask { index: 2, value: 2 });
        assert!(decode_position(0, 0, -1).is_err());
    }

    #[test]
    fn adjacent_blocks_split_by_grid() {
        // Two images with no text between them: 2 + 2 pads.
        let ids = [1, 9, 9, 9, 9, 2];
        let p = rope_index(
            &cfg(TemporalScale::Index),
            &ids,
            1,
            None,
            &VisionGrids {
                images: &[[1, 2, 4], [1, 4, 2]],
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(p.axis(0), [0, 1, 1, 3, 3, 5]);
        assert_eq!(p.axis(1), [0, 1, 1, 3, 4, 5]);
        assert_eq!(p.axis(2), [0, 1, 2, 3, 3, 5]);
        assert_eq!(p.rope_deltas, [0]);
    }

    #[test]
    fn sections_pick_axes_and_text_matches_plain_rope() {
        let m = MropeRope::new(16, 10_000.0, [2, 3, 3]).unwrap();
        assert!(MropeRope::new(16, 10_000.0, [2, 3, 4]).is_err());
        let table = RopeTable::new(&RopeConfig {
            head_dim: 16,
            theta: 10_000.0,
            scaling: RopeScaling::None,
        })
        .unwrap();
        // Text: equal axes give the plain table.
        let pos = [0u32, 5, 70_000];
        let three: Vec<u32> = pos.iter().cycle().take(9).copied().collect();
        let (mut c, mut s) = (vec![0.0; 24], vec![0.0; 24]);
        m.cos_sin(&three, &mut c, &mut s).unwrap();
        let (mut c1, mut s1) = (vec![0.0; 24], vec![0.0; 24]);
        table.cos_sin(&pos, &mut c1, &mut s1).unwrap();
        assert_eq!((c, s), (c1, s1));
        // One token at (t, h, w) = (1, 2, 3): columns 0..2 ← 1, 2..5 ← 2, 5..8 ← 3.
        let (mut c, mut s) = (vec![0.0; 8], vec![0.0; 8]);
        m.cos_sin(&[1, 2, 3], &mut c, &mut s).unwrap();
        for (j, &f) in table.inv_freq().iter().enumerate() {
            let p = [1.0f32, 2.0, 3.0][usize::from(j >= 2) + usize::from(j >= 5)];
            assert_eq!(c[j], f64::from(p * f).cos() as f32);
            assert_eq!(s[j], f64::from(p * f).sin() as f32);
        }
        assert!(m.cos_sin(&[1, 2], &mut c, &mut s).is_err());
    }
}
