//! Packed sequences on a backend whose attention does not take segments
//! ([`Backend::packs_sequences`] false; both of ours take them, and
//! [`Model::set_native_packed_attention`](super::Model::set_native_packed_attention)`(false)`
//! runs this path on them). Everything token-wise — the GEMMs, the
//! norms, the MLP, the head — runs on the packed row; only the attention runs padded: its
//! q, k, v are gathered into `[segments, longest]` rows, each segment **right-aligned**
//! (left padding), attended with the padded layout's key mask, and the output and
//! log-sum-exp gathered back. The backward gathers the same way and brings dq, dk, dv back.
//!
//! Why right-aligned: a padding slot then has no valid key at or before it, so the
//! attention gives it no visible key — output 0 and, in the backward, no probability — and
//! whatever the gathers put in its q, out, lse or dout rows (copies of a real token's, so
//! finite) contributes nothing to any real token's gradient. With left alignment the
//! padding slots after a segment would see its keys, and the copies in their `dout` rows
//! would add to its dk and dv.
//!
//! Both directions are the row gather ([`Backend::embedding`]): padded slot `j` takes packed
//! token `gather[j]` (0 on padding), packed token `i` takes padded slot `scatter[i]`.

use super::ModelError;
use crate::backend::{
    AttentionDims, AttentionGrads, AttentionInputs, Backend, Tensor, TensorMut, View, ViewMut,
};

/// The padded layout of one pass's packed segments, and the scratch its attention runs in.
pub(crate) struct Unpack<B: Backend> {
    map: Map<B>,
    /// Slots the scratch below holds (at least the layout's `segments · longest`: a later
    /// pass whose layout fits reuses it).
    capacity: usize,
    /// Padded q, k, v, out, lse, the key mask.
    q: B::Buffer,
    k: B::Buffer,
    v: B::Buffer,
    out: B::Buffer,
    lse: B::Buffer,
    mask: B::Buffer,
    /// The backward's padded dout, dq, dk, dv.
    dout: B::Buffer,
    dq: B::Buffer,
    dk: B::Buffer,
    dv: B::Buffer,
}

impl<B: Backend> std::fmt::Debug for Unpack<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unpack")
            .field("segments", &self.map.segments)
            .field("longest", &self.map.longest)
            .field("tokens", &self.map.tokens)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

/// Where each token goes.
struct Map<B: Backend> {
    /// Segments (the packed row's offsets, a tail of padding included).
    segments: usize,
    /// Slots per padded row: the longest segment.
    longest: usize,
    /// Tokens of the packed row.
    tokens: usize,
    /// `[segments · longest]`: the packed token each padded slot holds (0 on padding).
    gather: B::Ids,
    /// `[tokens]`: each packed token's padded slot.
    scatter: B::Ids,
}

/// The packed row's per-token widths: query and output `hq · d`, keys and values
/// `hkv · d`, log-sum-exp `hq`.
#[derive(Clone, Copy)]
pub(crate) struct Widths {
    pub(crate) hq: usize,
    pub(crate) hkv: usize,
    pub(crate) d: usize,
}

/// The two gather maps and the padded mask of offsets `cu` over a packed row with key mask
/// `mask`: `(longest, gather, scatter, padded mask)`, segments right-aligned.
pub(crate) fn maps(cu: &[u32], mask: &[u32]) -> (usize, Vec<u32>, Vec<u32>, Vec<f32>) {
    let lens: Vec<usize> = cu.windows(2).map(|w| (w[1] - w[0]) as usize).collect();
    let longest = lens.iter().copied().max().unwrap_or(0).max(1);
    let mut gather = vec![0u32; lens.len() * longest];
    let mut scatter = vec![0u32; mask.len()];
    let mut padded = vec![0.0f32; lens.len() * longest];
    for (r, (&start, &len)) in cu.iter().zip(&lens).enumerate() {
        let first = r * longest + longest - len;
        for k in 0..len {
            let (i, j) = (start as usize + k, first + k);
            gather[j] = i as u32;
            scatter[i] = j as u32;
            padded[j] = mask.get(i).map_or(0.0, |&m| m as f32);
        }
    }
    (longest, gather, scatter, padded)
}

impl<B: Backend> Map<B> {
    /// Padded slots.
    fn slots(&self) -> usize {
        self.segments * self.longest
    }

    /// The padded attention's sizes.
    fn dims(&self, packed: AttentionDims) -> AttentionDims {
        AttentionDims {
            batch: self.segments,
            seq: self.longest,
            ..packed
        }
    }

    /// The layout's first `width` floats a slot of scratch buffer `buf`.
    fn r<'a>(&self, buf: &'a B::Buffer, width: usize) -> Result<Tensor<'a, B>, ModelError> {
        Ok(View::new(buf, 0, self.slots() * width)?)
    }

    /// [`Map::r`], writable.
    fn w<'a>(&self, buf: &'a mut B::Buffer, width: usize) -> Result<TensorMut<'a, B>, ModelError> {
        Ok(ViewMut::new(buf, 0, self.slots() * width)?)
    }

    /// Scratch `dst` (padded) = the packed rows of `src`, `width` floats a token.
    fn to_padded(
        &self,
        be: &B,
        src: Tensor<'_, B>,
        width: usize,
        dst: &mut B::Buffer,
    ) -> Result<(), ModelError> {
        let dst = self.w(dst, width)?;
        Ok(be.embedding(&self.gather, src, self.tokens, width, dst)?)
    }

    /// `dst` (packed) = the padded rows of scratch `src` at the packed tokens' slots.
    fn to_packed(
        &self,
        be: &B,
        src: &B::Buffer,
        width: usize,
        dst: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let src = self.r(src, width)?;
        Ok(be.embedding(&self.scatter, src, self.slots(), width, dst)?)
    }
}

impl<B: Backend> Unpack<B> {
    /// The layout of offsets `cu` (checked by the caller) over a packed row whose key mask
    /// is `mask`, with its scratch on `be`: `prev`'s when its layout's slots fit, new ones
    /// otherwise.
    pub(crate) fn stage(
        prev: Option<Self>,
        be: &B,
        cu: &[u32],
        mask: &[u32],
        w: Widths,
    ) -> Result<Self, ModelError> {
        let (longest, gather, scatter, padded) = maps(cu, mask);
        let segments = cu.len().saturating_sub(1);
        let slots = segments * longest;
        let ids = |host: &[u32]| -> Result<B::Ids, ModelError> {
            let mut d = be.alloc_ids(host.len())?;
            be.upload_ids(host, &mut d)?;
            Ok(d)
        };
        let map = Map {
            segments,
            longest,
            tokens: mask.len(),
            gather: ids(&gather)?,
            scatter: ids(&scatter)?,
        };
        let mut u = match prev {
            Some(p) if p.capacity >= slots => Self { map, ..p },
            _ => {
                let buf = |n: usize| be.alloc(slots * n);
                let (qd, kvd) = (w.hq * w.d, w.hkv * w.d);
                Self {
                    map,
                    capacity: slots,
                    q: buf(qd)?,
                    k: buf(kvd)?,
                    v: buf(kvd)?,
                    out: buf(qd)?,
                    lse: buf(w.hq)?,
                    mask: buf(1)?,
                    dout: buf(qd)?,
                    dq: buf(qd)?,
                    dk: buf(kvd)?,
                    dv: buf(kvd)?,
                }
            }
        };
        let m = u.map.w(&mut u.mask, 1)?;
        be.upload(&padded, m)?;
        Ok(u)
    }

    /// Gathers packed `q`, `k`, `v` into the padded scratch.
    fn gather_qkv(
        &mut self,
        be: &B,
        (q, k, v): (Tensor<'_, B>, Tensor<'_, B>, Tensor<'_, B>),
        w: Widths,
    ) -> Result<(), ModelError> {
        let (qd, kvd) = (w.hq * w.d, w.hkv * w.d);
        self.map.to_padded(be, q, qd, &mut self.q)?;
        self.map.to_padded(be, k, kvd, &mut self.k)?;
        self.map.to_padded(be, v, kvd, &mut self.v)
    }

    /// The forward of packed `q`, `k`, `v` (dims `packed`: one row of the packed tokens)
    /// into packed `out` and `lse`, with bf16 operands (tensor cores) or f32.
    pub(crate) fn forward(
        &mut self,
        be: &B,
        (packed, bf16, w): (AttentionDims, bool, Widths),
        qkv: (Tensor<'_, B>, Tensor<'_, B>, Tensor<'_, B>),
        out: TensorMut<'_, B>,
        lse: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let qd = w.hq * w.d;
        self.gather_qkv(be, qkv, w)?;
        let Self {
            map,
            q,
            k,
            v,
            mask,
            out: po,
            lse: pl,
            ..
        } = self;
        let dims = map.dims(packed);
        let inputs = padded_inputs(map, (q, k, v), mask, w)?;
        let (o, l) = (map.w(po, qd)?, map.w(pl, w.hq)?);
        if bf16 {
            be.attention_bf16(dims, inputs, None, o, l)?;
        } else {
            be.attention(dims, inputs, None, o, l)?;
        }
        map.to_packed(be, po, qd, out)?;
        map.to_packed(be, pl, w.hq, lse)
    }

    /// The backward of [`Unpack::forward`]: from the packed `q`, `k`, `v`, the forward's
    /// packed `out` and `lse` and `dout`, **overwrites** the packed `grads`.
    pub(crate) fn backward(
        &mut self,
        be: &B,
        (packed, bf16, w): (AttentionDims, bool, Widths),
        qkv: (Tensor<'_, B>, Tensor<'_, B>, Tensor<'_, B>),
        (out, lse, dout): (Tensor<'_, B>, Tensor<'_, B>, Tensor<'_, B>),
        grads: AttentionGrads<'_, B::Buffer>,
    ) -> Result<(), ModelError> {
        let (qd, kvd) = (w.hq * w.d, w.hkv * w.d);
        self.gather_qkv(be, qkv, w)?;
        self.map.to_padded(be, out, qd, &mut self.out)?;
        self.map.to_padded(be, lse, w.hq, &mut self.lse)?;
        self.map.to_padded(be, dout, qd, &mut self.dout)?;
        let Self {
            map: m,
            q,
            k,
            v,
            mask,
            out: o,
            lse: l,
            dout,
            dq,
            dk,
            dv,
            ..
        } = self;
        let dims = m.dims(packed);
        let inputs = padded_inputs(m, (q, k, v), mask, w)?;
        let (o, l, g) = (m.r(o, qd)?, m.r(l, w.hq)?, m.r(dout, qd)?);
        let padded = AttentionGrads {
            dq: m.w(dq, qd)?,
            dk: m.w(dk, kvd)?,
            dv: m.w(dv, kvd)?,
        };
        if bf16 {
            be.attention_backward_bf16(dims, inputs, None, o, l, g, padded)?;
        } else {
            be.attention_backward(dims, inputs, None, o, l, g, padded)?;
        }
        m.to_packed(be, dq, qd, grads.dq)?;
        m.to_packed(be, dk, kvd, grads.dk)?;
        m.to_packed(be, dv, kvd, grads.dv)
    }
}

/// The padded attention's inputs: the gathered q, k, v under the padded key mask.
fn padded_inputs<'a, B: Backend>(
    map: &Map<B>,
    (q, k, v): (&'a B::Buffer, &'a B::Buffer, &'a B::Buffer),
    mask: &'a B::Buffer,
    w: Widths,
) -> Result<AttentionInputs<'a, B::Buffer>, ModelError> {
    let (qd, kvd) = (w.hq * w.d, w.hkv * w.d);
    Ok(AttentionInputs {
        q: map.r(q, qd)?,
        k: map.r(k, kvd)?,
        v: map.r(v, kvd)?,
        key_mask: Some(map.r(mask, 1)?),
    })
}

#[cfg(test)]
mod tests {
    use super::maps;

    #[test]
    fn segments_are_right_aligned_and_the_maps_invert() {
        // segments of 2, 3 and 1 tokens; the last token is padding (mask 0)
        let cu = [0u32, 2, 5, 6];
        let mask = [1u32, 1, 1, 1, 1, 0];
        let (longest, gather, scatter, padded) = maps(&cu, &mask);
        assert_eq!(longest, 3);
        assert_eq!(gather, [0, 0, 1, 2, 3, 4, 0, 0, 5]);
        assert_eq!(scatter, [1, 2, 3, 4, 5, 8]);
        assert_eq!(padded, [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]);
        for (i, &j) in scatter.iter().enumerate() {
            assert_eq!(gather[j as usize] as usize, i);
        }
    }
}
