//! AdamW's two moments of one parameter buffer, stored in the state dtype the run asks for
//! (`worker.actor.optim.state_dtype`): f32 (8 bytes a parameter), bf16 (4) or 8-bit codes
//! with a scale per block of 2 048 (≈ 2), and their host form for the state files.
//!
//! A buffer holds `len / item` tensors of `item` elements (a stack of every layer's tensor,
//! or one tensor). 8-bit blocks restart at each tensor, so a tensor's state is the same
//! whatever buffer it sits in and a state file can name it by its Hugging Face name.
//! Tensors shorter than `ares_cpu::ops::optim_int8::MIN_QUANTIZED_LEN` (norms, biases)
//! keep f32 moments under `int8`: a few bytes saved are not worth the error.

use ares_cpu::ops::optim_int8::{BLOCK, Codebook, MIN_QUANTIZED_LEN, blocks, dynamic_map};

use super::ModelError;
use crate::backend::{AdamWUpdate, Backend, DType, DeviceBuffer, Stored, View, ViewMut};

/// How AdamW stores its moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum StateDtype {
    /// Both moments in f32 (PyTorch's `torch.optim.AdamW`).
    #[default]
    F32,
    /// Both moments rounded to bf16 stochastically after each update, each tensor under
    /// its step's key (`ares_cpu::ops::precision::moment_keys`): unbiased, so a second
    /// moment whose change a step (0.001 of it at β₂ = 0.999) is under half an ulp still
    /// decays and grows as the f32 one does on average.
    Bf16,
    /// Both moments quantised block-wise to 8 bits (bitsandbytes' 8-bit Adam scheme).
    Int8,
}

impl StateDtype {
    /// Every state dtype with its configuration name.
    pub const ALL: [(Self, &'static str); 3] = [
        (Self::F32, "f32"),
        (Self::Bf16, "bf16"),
        (Self::Int8, "int8"),
    ];

    /// The configuration name: `f32`, `bf16` or `int8`.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(d, _)| *d == self)
            .map_or("f32", |(_, n)| n)
    }

    /// The dtype of a configuration name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().find(|(_, n)| *n == name).map(|(d, _)| *d)
    }

    /// Bytes both moments of a tensor of `len` elements take.
    pub fn moment_bytes(self, len: usize) -> u64 {
        let len = len as u64;
        match self {
            Self::F32 => 8 * len,
            Self::Bf16 => 4 * len,
            Self::Int8 if (len as usize) < MIN_QUANTIZED_LEN => 8 * len,
            Self::Int8 => 2 * len + 8 * blocks(len as usize) as u64,
        }
    }
}

impl std::fmt::Display for StateDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The signed then the unsigned dynamic map, as [`Backend::adamw_step_int8`] takes them.
pub(crate) fn int8_maps() -> Vec<f32> {
    let mut maps = dynamic_map(true).to_vec();
    maps.extend(dynamic_map(false));
    maps
}

/// The two moments of one parameter buffer on the backend.
pub struct Moments<B: Backend> {
    len: usize,
    item: usize,
    store: Store<B>,
}

enum Store<B: Backend> {
    F32 {
        m: B::Buffer,
        v: B::Buffer,
    },
    Bf16 {
        m: B::Half,
        v: B::Half,
    },
    Int8 {
        m: B::Bytes,
        v: B::Bytes,
        m_absmax: B::Buffer,
        v_absmax: B::Buffer,
    },
}

/// One moment of one tensor on the host, as stored.
#[derive(Debug, Clone, PartialEq)]
pub enum HostMoment {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 bits.
    Bf16(Vec<u16>),
    /// 8-bit codes and a scale per block of 2 048 (signed map for the first moment,
    /// unsigned for the second).
    Int8 {
        /// One code per element.
        codes: Vec<u8>,
        /// One scale per block, `⌈len / 2048⌉`.
        absmax: Vec<f32>,
    },
}

impl HostMoment {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(x) => x.len(),
            Self::Bf16(x) => x.len(),
            Self::Int8 { codes, .. } => codes.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values it stands for, in f32 (`second`: the second moment, whose 8-bit codes
    /// use the unsigned map).
    ///
    /// # Errors
    /// 8-bit codes whose scales are not one per block of 2 048.
    pub fn to_f32(&self, second: bool) -> Result<Vec<f32>, ModelError> {
        Ok(match self {
            Self::F32(x) => x.clone(),
            Self::Bf16(x) => x
                .iter()
                .map(|&b| f32::from_bits(u32::from(b) << 16))
                .collect(),
            Self::Int8 { codes, absmax } => {
                let mut out = vec![0.0f32; codes.len()];
                Codebook::new(&dynamic_map(!second))
                    .dequantize(codes, absmax, &mut out)
                    .map_err(|_| layout("8-bit moment scales (one per block of 2048)"))?;
                out
            }
        })
    }

    /// `values` stored as `dtype` would store them for a tensor of their length (f32 below
    /// the 8-bit minimum; `second` as for [`HostMoment::to_f32`]).
    pub fn encode(values: &[f32], dtype: StateDtype, second: bool) -> Self {
        match effective(dtype, values.len()) {
            StateDtype::F32 => Self::F32(values.to_vec()),
            StateDtype::Bf16 => Self::Bf16(
                values
                    .iter()
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect(),
            ),
            StateDtype::Int8 => {
                let book = Codebook::new(&dynamic_map(!second));
                let mut codes = vec![0u8; values.len()];
                let mut absmax = vec![0.0f32; blocks(values.len())];
                for ((x, c), a) in values
                    .chunks(BLOCK)
                    .zip(codes.chunks_mut(BLOCK))
                    .zip(&mut absmax)
                {
                    *a = book.quantize_block(x, c);
                }
                Self::Int8 { codes, absmax }
            }
        }
    }

    /// The state dtype it is stored in.
    pub fn dtype(&self) -> StateDtype {
        match self {
            Self::F32(_) => StateDtype::F32,
            Self::Bf16(_) => StateDtype::Bf16,
            Self::Int8 { .. } => StateDtype::Int8,
        }
    }
}

/// The dtype a tensor of `item` elements is stored in under `dtype` (8 bits only from
/// [`MIN_QUANTIZED_LEN`] elements).
pub fn effective(dtype: StateDtype, item: usize) -> StateDtype {
    match dtype {
        StateDtype::Int8 if item < MIN_QUANTIZED_LEN => StateDtype::F32,
        other => other,
    }
}

fn layout(what: &'static str) -> ModelError {
    ModelError::LayoutMismatch { what }
}

impl<B: Backend> Moments<B> {
    /// Zero moments for a buffer of `len` elements made of tensors of `item` elements,
    /// stored as `dtype` says (see the module docs).
    ///
    /// # Errors
    /// `item` 0 or not dividing `len`; a backend allocation failure.
    pub fn zeros(be: &B, len: usize, item: usize, dtype: StateDtype) -> Result<Self, ModelError> {
        if item == 0 || !len.is_multiple_of(item) {
            return Err(layout("optimizer moments (tensor length)"));
        }
        let store = match effective(dtype, item) {
            StateDtype::F32 => Store::F32 {
                m: be.alloc(len)?,
                v: be.alloc(len)?,
            },
            StateDtype::Bf16 => Store::Bf16 {
                m: be.alloc_half(len, DType::Bf16)?,
                v: be.alloc_half(len, DType::Bf16)?,
            },
            StateDtype::Int8 => {
                let scales = len / item * blocks(item);
                Store::Int8 {
                    m: be.alloc_bytes(len)?,
                    v: be.alloc_bytes(len)?,
                    m_absmax: be.alloc(scales)?,
                    v_absmax: be.alloc(scales)?,
                }
            }
        };
        Ok(Self { len, item, store })
    }

    /// Elements of one tensor of the buffer.
    pub fn item(&self) -> usize {
        self.item
    }

    /// Elements of the parameter buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Moments of no element with this one's tensor length and dtype: what a rank keeps
    /// of a buffer another rank updates (ZeRO-1).
    ///
    /// # Errors
    /// A backend allocation failure.
    pub(crate) fn emptied(&self, be: &B) -> Result<Self, ModelError> {
        Self::zeros(be, 0, self.item, self.dtype())
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The dtype the moments are stored in (f32 for short tensors under `int8`).
    pub fn dtype(&self) -> StateDtype {
        match self.store {
            Store::F32 { .. } => StateDtype::F32,
            Store::Bf16 { .. } => StateDtype::Bf16,
            Store::Int8 { .. } => StateDtype::Int8,
        }
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> u64 {
        (self.len / self.item.max(1)) as u64 * self.dtype().moment_bytes(self.item)
    }

    /// One AdamW update of `param` from `grad` (both `len` long) with these moments;
    /// `maps` is [`int8_maps`] on the backend (read only by 8-bit moments). `grad` is read
    /// as stored: a gradient kept in bf16 is widened by the update as it reads it. bf16
    /// moments round stochastically under `key(tensor)` ([`Backend::adamw_step_bf16`]).
    ///
    /// # Errors
    /// Lengths that differ; a backend failure.
    #[allow(clippy::too_many_arguments)] // the update's parts, as the backend op's
    pub(crate) fn step(
        &mut self,
        be: &B,
        param: &mut B::Buffer,
        grad: Stored<'_, B>,
        maps: &B::Buffer,
        update: &AdamWUpdate,
        copy: Option<&mut B::Half>,
        key: impl Fn(usize) -> u64,
    ) -> Result<(), ModelError> {
        if param.len() != self.len
            || grad.len() != self.len
            || copy.as_ref().is_some_and(|c| c.len() != self.len)
        {
            return Err(layout("optimizer moments"));
        }
        let p = ViewMut::whole(param);
        let c = copy.map(ViewMut::whole);
        self.step_tensors(
            be,
            0..self.len / self.item.max(1),
            (p, grad),
            (maps, update),
            c,
            &key,
        )
    }

    /// One AdamW update of a weight **stored in bf16** (`weight`, `len` long) from `grad`
    /// (as stored), a tensor at a time ([`Backend::adamw_step_bf16_weight`] and its
    /// moment-dtype variants): the tensor widened, the f32 update of [`Moments::step`], the
    /// result rounded back to bf16 stochastically under `key(tensor)` (an update below half
    /// an ulp moves the weight with the probability that keeps it unbiased, where rounding
    /// to nearest would drop it) — one pass over the weight on CUDA.
    ///
    /// # Errors
    /// Lengths that differ; a backend failure.
    pub(crate) fn step_bf16_weight(
        &mut self,
        be: &B,
        weight: &mut B::Half,
        grad: Stored<'_, B>,
        maps: &B::Buffer,
        update: &AdamWUpdate,
        key: impl Fn(usize) -> u64,
    ) -> Result<(), ModelError> {
        let item = self.item;
        if weight.len() != self.len || grad.len() != self.len {
            return Err(layout("optimizer moments (bf16 weight)"));
        }
        for t in 0..self.len / item.max(1) {
            let (w, g) = (ViewMut::item(weight, t, item)?, grad.slice(t * item, item)?);
            self.step_bf16_weight_tensor(be, t, w, key(t), g, maps, update)?;
        }
        Ok(())
    }

    /// [`Moments::step_bf16_weight`] of tensor `t` alone: `weight` and `grad` are that
    /// tensor's.
    ///
    /// # Errors
    /// A backend failure.
    #[allow(clippy::too_many_arguments)] // the update's parts, as the backend op's
    fn step_bf16_weight_tensor(
        &mut self,
        be: &B,
        t: usize,
        w: ViewMut<'_, B::Half>,
        key: u64,
        g: Stored<'_, B>,
        maps: &B::Buffer,
        update: &AdamWUpdate,
    ) -> Result<(), ModelError> {
        let item = self.item;
        match &mut self.store {
            Store::F32 { m, v } => {
                let (m, v) = (ViewMut::item(m, t, item)?, ViewMut::item(v, t, item)?);
                be.adamw_step_bf16_weight(w, key, g, m, v, update)?;
            }
            Store::Bf16 { m, v } => {
                let (m, v) = (ViewMut::item(m, t, item)?, ViewMut::item(v, t, item)?);
                be.adamw_step_bf16_weight_bf16(w, key, g, m, v, update)?;
            }
            Store::Int8 {
                m,
                v,
                m_absmax,
                v_absmax,
            } => {
                let scales = blocks(item);
                be.adamw_step_bf16_weight_int8(
                    w,
                    key,
                    g,
                    ViewMut::item(m, t, item)?,
                    ViewMut::item(v, t, item)?,
                    ViewMut::item(m_absmax, t, scales)?,
                    ViewMut::item(v_absmax, t, scales)?,
                    View::whole(maps),
                    update,
                )?;
            }
        }
        Ok(())
    }

    /// The update of tensors `tensors` (a range of this buffer's) from `param` and `grad`,
    /// which hold exactly those tensors; bf16 moments round under `key(tensor)`.
    fn step_tensors(
        &mut self,
        be: &B,
        tensors: std::ops::Range<usize>,
        (param, grad): (ViewMut<'_, B::Buffer>, Stored<'_, B>),
        (maps, update): (&B::Buffer, &AdamWUpdate),
        mut copy: Option<ViewMut<'_, B::Half>>,
        key: &dyn Fn(usize) -> u64,
    ) -> Result<(), ModelError> {
        let item = self.item;
        let (first, n) = (tensors.start * item, tensors.len() * item);
        match &mut self.store {
            Store::F32 { m, v } => {
                let (m, v) = (ViewMut::new(m, first, n)?, ViewMut::new(v, first, n)?);
                be.adamw_step(param, grad, m, v, update, copy)?;
            }
            Store::Bf16 { m, v } => {
                // one call per tensor: element i of a tensor draws its rounding bits from
                // (key(tensor), i), whatever range of the buffer an update covers
                let mut param = param;
                for (j, t) in tensors.enumerate() {
                    let within = j * item;
                    be.adamw_step_bf16(
                        param.slice_mut(within, item)?,
                        key(t),
                        grad.slice(within, item)?,
                        ViewMut::item(m, t, item)?,
                        ViewMut::item(v, t, item)?,
                        update,
                        copy.as_mut()
                            .map(|c| c.slice_mut(within, item))
                            .transpose()?,
                    )?;
                }
            }
            Store::Int8 {
                m,
                v,
                m_absmax,
                v_absmax,
            } => {
                // one call per tensor: its blocks start at its first element
                let scales = blocks(item);
                let mut param = param;
                for (j, t) in tensors.enumerate() {
                    let within = j * item;
                    be.adamw_step_int8(
                        param.slice_mut(within, item)?,
                        grad.slice(within, item)?,
                        ViewMut::item(m, t, item)?,
                        ViewMut::item(v, t, item)?,
                        ViewMut::item(m_absmax, t, scales)?,
                        ViewMut::item(v_absmax, t, scales)?,
                        View::whole(maps),
                        update,
                        copy.as_mut()
                            .map(|c| c.slice_mut(within, item))
                            .transpose()?,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Tensor `index`'s moments (first, second) on the host, as stored.
    ///
    /// # Errors
    /// `index` past the buffer; a backend failure.
    pub fn read(&self, be: &B, index: usize) -> Result<[HostMoment; 2], ModelError> {
        let item = self.item;
        match &self.store {
            Store::F32 { m, v } => [m, v].map(|x| {
                let mut host = vec![0.0f32; item];
                be.download(View::item(x, index, item)?, &mut host)?;
                Ok::<_, ModelError>(HostMoment::F32(host))
            }),
            Store::Bf16 { m, v } => [m, v].map(|x| {
                let mut host = vec![0u16; item];
                be.download_half(View::item(x, index, item)?, &mut host)?;
                Ok(HostMoment::Bf16(host))
            }),
            Store::Int8 {
                m,
                v,
                m_absmax,
                v_absmax,
            } => [(m, m_absmax), (v, v_absmax)].map(|(x, a)| {
                let mut codes = vec![0u8; item];
                be.download_bytes(View::item(x, index, item)?, &mut codes)?;
                let mut absmax = vec![0.0f32; blocks(item)];
                be.download(View::item(a, index, blocks(item))?, &mut absmax)?;
                Ok(HostMoment::Int8 { codes, absmax })
            }),
        }
        .try_into_array()
    }

    /// Sets tensor `index`'s moments (first, second) from the host: stored as they are
    /// when they are in this buffer's dtype (exact), otherwise read as f32 and stored
    /// again (`f32 → bf16` rounds, `→ int8` quantises).
    ///
    /// # Errors
    /// `index` past the buffer, a moment of another length; a backend failure.
    pub fn write(
        &mut self,
        be: &B,
        index: usize,
        moments: [&HostMoment; 2],
    ) -> Result<(), ModelError> {
        let item = self.item;
        if moments.iter().any(|m| m.len() != item) {
            return Err(layout("optimizer moments (tensor length)"));
        }
        let dtype = self.dtype();
        let [first, second] = moments;
        let recoded = [recode(first, dtype, false)?, recode(second, dtype, true)?];
        let scales = blocks(item);
        match &mut self.store {
            Store::F32 { m, v } => {
                for (dst, src) in [m, v].into_iter().zip(&recoded) {
                    if let HostMoment::F32(x) = src.as_ref() {
                        be.upload(x, ViewMut::item(dst, index, item)?)?;
                    }
                }
            }
            Store::Bf16 { m, v } => {
                for (dst, src) in [m, v].into_iter().zip(&recoded) {
                    if let HostMoment::Bf16(x) = src.as_ref() {
                        be.upload_half(x, ViewMut::item(dst, index, item)?)?;
                    }
                }
            }
            Store::Int8 {
                m,
                v,
                m_absmax,
                v_absmax,
            } => {
                for ((dst, scale), src) in [(m, m_absmax), (v, v_absmax)].into_iter().zip(&recoded)
                {
                    if let HostMoment::Int8 { codes, absmax } = src.as_ref() {
                        be.upload_bytes(codes, ViewMut::item(dst, index, item)?)?;
                        be.upload(absmax, ViewMut::item(scale, index, scales)?)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// `m` as stored in `dtype`: itself, or read as f32 and stored again.
fn recode(
    m: &HostMoment,
    dtype: StateDtype,
    second: bool,
) -> Result<std::borrow::Cow<'_, HostMoment>, ModelError> {
    Ok(if m.dtype() == dtype {
        std::borrow::Cow::Borrowed(m)
    } else {
        let values = m.to_f32(second)?;
        std::borrow::Cow::Owned(HostMoment::encode(&values, dtype, second))
    })
}

/// `[Result<T>; 2]` → `Result<[T; 2]>`.
trait TryIntoArray<T> {
    fn try_into_array(self) -> Result<[T; 2], ModelError>;
}

impl<T> TryIntoArray<T> for [Result<T, ModelError>; 2] {
    fn try_into_array(self) -> Result<[T; 2], ModelError> {
        let [a, b] = self;
        Ok([a?, b?])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    #[test]
    fn host_moments_encode_and_read_back() {
        let values: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.01).sin() * 1e-3).collect();
        let q = HostMoment::encode(&values, StateDtype::Int8, false);
        assert_eq!(q.dtype(), StateDtype::Int8);
        let back = q.to_f32(false).unwrap();
        let worst = values
            .iter()
            .zip(&back)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst < 2e-5, "{worst}");
        // stored again in its own dtype: the same codes
        assert_eq!(HostMoment::encode(&back, StateDtype::Int8, false), q);
        // short tensors keep f32 under int8; bf16 rounds to nearest
        assert_eq!(
            HostMoment::encode(&[0.1; 10], StateDtype::Int8, true).dtype(),
            StateDtype::F32
        );
        let b = HostMoment::encode(&[1.0 + 2f32.powi(-9)], StateDtype::Bf16, false);
        assert_eq!(b.to_f32(false).unwrap(), vec![1.0]);
        let bad = HostMoment::Int8 {
            codes: vec![0; 5000],
            absmax: vec![1.0; 2],
        };
        assert!(bad.to_f32(false).is_err());
    }

    /// A weight stored in bf16, updated by `step_bf16_weight` (the fused op per tensor), has
    /// the bits of the three ops it stands for — widen, [`Moments::step`] on the f32 copy,
    /// round stochastically under the tensor's key — with the moments alike, for each
    /// moment dtype, over tensors that end inside an 8-bit block.
    #[test]
    fn a_bf16_weights_update_is_widen_step_round() {
        let be = CpuBackend;
        let (item, tensors) = (2 * 2048 + 77, 3);
        let len = item * tensors;
        let init: Vec<f32> = (0..len).map(|i| ((i as f32) * 0.37).sin() * 0.05).collect();
        let mut bits = vec![0u16; len];
        ares_cpu::ops::precision::round_to_bf16(&init, &mut bits).unwrap();
        let key = |t: usize| 0x5EED ^ (t as u64) << 7;
        let maps = {
            let mut m = ares_cpu::ops::optim_int8::dynamic_map(true).to_vec();
            m.extend(ares_cpu::ops::optim_int8::dynamic_map(false));
            let mut b = be.alloc(m.len()).unwrap();
            be.upload(&m, ViewMut::whole(&mut b)).unwrap();
            b
        };
        let half = |v: &[u16]| {
            let mut h = be.alloc_half(v.len(), crate::backend::DType::Bf16).unwrap();
            be.upload_half(v, ViewMut::whole(&mut h)).unwrap();
            h
        };
        let upload = |v: &[f32]| {
            let mut b = be.alloc(v.len()).unwrap();
            be.upload(v, ViewMut::whole(&mut b)).unwrap();
            b
        };
        for dtype in [StateDtype::F32, StateDtype::Bf16, StateDtype::Int8] {
            let mut fused = Moments::zeros(&be, len, item, dtype).unwrap();
            let mut three = Moments::zeros(&be, len, item, dtype).unwrap();
            let (mut w_fused, mut w_three) = (half(&bits), half(&bits));
            for step in 1..=3u64 {
                let g: Vec<f32> = (0..len)
                    .map(|i| ((i as f32 + step as f32) * 0.11).cos())
                    .collect();
                let grad = upload(&g);
                let update = AdamWUpdate {
                    config: ares_cpu::ops::optim::AdamWConfig::default(),
                    lr: 3e-4,
                    step,
                    grad_scale: 0.75,
                };
                fused
                    .step_bf16_weight(
                        &be,
                        &mut w_fused,
                        Stored::F32(View::whole(&grad)),
                        &maps,
                        &update,
                        key,
                    )
                    .unwrap();
                // the three ops, a tensor at a time
                let mut wide = be.alloc(len).unwrap();
                be.widen_bf16(View::whole(&w_three), ViewMut::whole(&mut wide))
                    .unwrap();
                three
                    .step(
                        &be,
                        &mut wide,
                        Stored::F32(View::whole(&grad)),
                        &maps,
                        &update,
                        None,
                        key,
                    )
                    .unwrap();
                for t in 0..tensors {
                    be.round_bf16_stochastic(
                        View::item(&wide, t, item).unwrap(),
                        key(t),
                        ViewMut::item(&mut w_three, t, item).unwrap(),
                    )
                    .unwrap();
                }
                let read = |w: &<CpuBackend as Backend>::Half| {
                    let mut h = vec![0u16; len];
                    be.download_half(View::whole(w), &mut h).unwrap();
                    h
                };
                assert_eq!(read(&w_fused), read(&w_three), "{dtype:?} step {step}");
                for t in 0..tensors {
                    assert_eq!(
                        fused.read(&be, t).unwrap(),
                        three.read(&be, t).unwrap(),
                        "{dtype:?} step {step} tensor {t}"
                    );
                }
            }
            let mut moved = vec![0u16; len];
            be.download_half(View::whole(&w_fused), &mut moved).unwrap();
            assert_ne!(moved, bits, "{dtype:?}: the weight moved");
        }
    }

    #[test]
    fn moments_write_converts_and_read_returns_as_stored() {
        let be = CpuBackend;
        let (len, item) = (2 * 4096, 4096);
        let mut m = Moments::zeros(&be, len, item, StateDtype::Int8).unwrap();
        assert_eq!(m.dtype(), StateDtype::Int8);
        assert_eq!(m.bytes(), 2 * StateDtype::Int8.moment_bytes(item));
        let first: Vec<f32> = (0..item).map(|i| i as f32 * 1e-4 - 0.2).collect();
        let second: Vec<f32> = (0..item).map(|i| i as f32 * 1e-6).collect();
        let host = [
            HostMoment::F32(first.clone()),
            HostMoment::F32(second.clone()),
        ];
        m.write(&be, 1, [&host[0], &host[1]]).unwrap();
        let [a, b] = m.read(&be, 1).unwrap();
        assert_eq!(a, HostMoment::encode(&first, StateDtype::Int8, false));
        assert_eq!(b, HostMoment::encode(&second, StateDtype::Int8, true));
        let [z, _] = m.read(&be, 0).unwrap();
        assert!(z.to_f32(false).unwrap().iter().all(|&x| x == 0.0));
        assert!(m.read(&be, 2).is_err());
        let short = HostMoment::F32(vec![0.0; 10]);
        assert!(m.write(&be, 0, [&short, &short]).is_err());
        assert!(Moments::<CpuBackend>::zeros(&be, 10, 3, StateDtype::F32).is_err());
        assert_eq!(
            Moments::zeros(&be, 10, 10, StateDtype::Int8)
                .unwrap()
                .dtype(),
            StateDtype::F32
        );
    }
}
