use super::*;
use crate::Error;
use crate::ops::stored::Bf16Bits;

/// xorshift64*: reproducible inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        x as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

struct Case {
    sh: AttentionShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    mask: Option<Vec<f32>>,
    /// Tokens per task of the blocked kernels: the public functions' block, or a smaller
    /// one that makes short sequences span several blocks.
    block: usize,
}

impl Case {
    fn new(sh: AttentionShape, mask: Option<Vec<f32>>, seed: u64) -> Self {
        let mut rng = Rng(seed);
        // Spread of 2 keeps the softmax away from uniform.
        let q = rng
            .vec(sh.q_len().unwrap())
            .iter()
            .map(|x| 2.0 * x)
            .collect();
        let k = rng
            .vec(sh.kv_len().unwrap())
            .iter()
            .map(|x| 2.0 * x)
            .collect();
        let v = rng.vec(sh.kv_len().unwrap());
        Case {
            sh,
            q,
            k,
            v,
            mask,
            block: blocked::BLOCK,
        }
    }

    /// The same case run with `block` tokens per task.
    fn with_block(mut self, block: usize) -> Self {
        self.block = block;
        self
    }

    /// The key mask, all ones when there is none.
    fn mask_or_ones(&self) -> Vec<f32> {
        self.mask
            .clone()
            .unwrap_or_else(|| vec![1.0; self.sh.batch * self.sh.seq])
    }

    fn inputs(&self) -> AttentionInputs<'_> {
        AttentionInputs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            key_mask: self.mask.as_deref(),
            segments: None,
        }
    }

    fn spans(&self) -> Vec<blocked::Span> {
        let dims = self.sh.dims().unwrap();
        self.inputs().spans(&dims)
    }

    fn forward(&self) -> (Vec<f32>, Vec<f32>) {
        let mut out = vec![f32::NAN; self.sh.q_len().unwrap()];
        let mut lse = vec![f32::NAN; self.sh.lse_len().unwrap()];
        if self.block == blocked::BLOCK {
            attention_forward(&self.sh, self.inputs(), &mut out, &mut lse).unwrap();
        } else {
            let dims = self.sh.dims().unwrap();
            let mask = self.mask_or_ones();
            let spans = self.spans();
            blocked::forward(
                &dims,
                &spans,
                self.inputs(),
                &mask,
                &mut out,
                &mut lse,
                self.block,
            )
            .unwrap();
        }
        (out, lse)
    }

    fn backward(&self, dout: &[f32]) -> [Vec<f32>; 3] {
        let (out, lse) = self.forward();
        let mut dq = vec![f32::NAN; self.q.len()];
        let mut dk = vec![f32::NAN; self.k.len()];
        let mut dv = vec![f32::NAN; self.v.len()];
        if self.block == blocked::BLOCK {
            let grads = AttentionGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
            };
            attention_backward(&self.sh, self.inputs(), &out, &lse, dout, grads).unwrap();
        } else {
            let dims = self.sh.dims().unwrap();
            let mask = self.mask_or_ones();
            let saved = blocked::Saved {
                out: &out,
                lse: &lse,
                dout,
            };
            blocked::backward(
                &dims,
                &self.spans(),
                self.inputs(),
                &mask,
                saved,
                &mut dq,
                &mut dk,
                &mut dv,
                self.block,
                blocked::Operands::F32,
            )
            .unwrap();
        }
        [dq, dk, dv]
    }

    /// Naive f64 attention: explicit scores, mask, softmax and weighted sum; rows without
    /// a valid key are 0.
    fn reference(&self) -> Vec<f64> {
        let AttentionShape {
            batch,
            seq,
            q_heads,
            kv_heads,
            head_dim: d,
            scale,
        } = self.sh;
        let group = q_heads / kv_heads;
        let qi = |b: usize, t: usize, h: usize| ((b * seq + t) * q_heads + h) * d;
        let ki = |b: usize, s: usize, g: usize| ((b * seq + s) * kv_heads + g) * d;
        let mut out = vec![0.0f64; self.q.len()];
        for b in 0..batch {
            for h in 0..q_heads {
                let g = h / group;
                for t in 0..seq {
                    let valid = |s: usize| self.mask.as_ref().is_none_or(|m| m[b * seq + s] == 1.0);
                    let scores: Vec<f64> = (0..seq)
                        .map(|s| {
                            if s > t || !valid(s) {
                                return f64::NEG_INFINITY;
                            }
                            let dot: f64 = (0..d)
                                .map(|e| {
                                    f64::from(self.q[qi(b, t, h) + e])
                                        * f64::from(self.k[ki(b, s, g) + e])
                                })
                                .sum();
                            f64::from(scale) * dot
                        })
                        .collect();
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    if m == f64::NEG_INFINITY {
                        continue;
                    }
                    let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (s, p) in e.iter().enumerate() {
                        for j in 0..d {
                            out[qi(b, t, h) + j] += p / z * f64::from(self.v[ki(b, s, g) + j]);
                        }
                    }
                }
            }
        }
        out
    }
}

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

/// Sequence 0 left-padded by `pad` (generation prompts), sequence 1 right-padded by `pad`
/// (training), further sequences unpadded.
fn mixed_mask(batch: usize, seq: usize, pad: usize) -> Vec<f32> {
    let mut m = vec![1.0f32; batch * seq];
    for s in 0..pad {
        m[s] = 0.0;
        if batch > 1 {
            m[2 * seq - 1 - s] = 0.0;
        }
    }
    m
}

fn gqa() -> AttentionShape {
    AttentionShape::new(2, 5, 6, 2, 8)
}

#[test]
fn forward_matches_f64_reference_on_odd_shapes() {
    let shapes = [
        gqa(),
        AttentionShape::new(2, 5, 3, 3, 8),  // Hq = Hkv
        AttentionShape::new(3, 1, 4, 2, 5),  // T = 1, D not a multiple of 8
        AttentionShape::new(1, 7, 4, 1, 12), // MQA
        AttentionShape::new(2, 4, 2, 2, 3).with_scale(0.7),
    ];
    for (i, sh) in shapes.into_iter().enumerate() {
        let c = Case::new(sh, None, 11 + i as u64);
        let (out, lse) = c.forward();
        assert_close(&out, &c.reference(), 1e-5, "out");
        assert!(lse.iter().all(|l| l.is_finite()));
    }
}

#[test]
fn forward_matches_reference_with_left_and_right_padding() {
    for (mask, seed) in [
        (mixed_mask(2, 5, 2), 3),
        (vec![0., 0., 0., 1., 1., 0., 1., 1., 1., 1.], 4), // left only
        (vec![1., 1., 1., 0., 0., 1., 1., 1., 1., 0.], 5), // right only
        (vec![1., 0., 1., 0., 1., 0., 1., 1., 0., 1.], 6), // holes
    ] {
        let c = Case::new(gqa(), Some(mask), seed);
        assert_close(&c.forward().0, &c.reference(), 1e-5, "out");
    }
}

#[test]
fn future_keys_and_values_change_nothing() {
    let mut c = Case::new(gqa(), Some(mixed_mask(2, 5, 1)), 7);
    let (before, _) = c.forward();
    // Token 3 of sequence 1, every kv head.
    let (sh, t0) = (c.sh, 3);
    let tok = sh.kv_heads * sh.head_dim;
    for x in &mut c.k[(sh.seq + t0) * tok..(sh.seq + t0 + 1) * tok] {
        *x += 1.5;
    }
    for x in &mut c.v[(sh.seq + t0) * tok..(sh.seq + t0 + 1) * tok] {
        *x -= 0.5;
    }
    let (after, _) = c.forward();
    let row = sh.q_heads * sh.head_dim;
    let b1_t0 = (sh.seq + t0) * row;
    assert_eq!(before[..b1_t0], after[..b1_t0], "past rows must not move");
    for (bt, (x, y)) in before[b1_t0..]
        .chunks(row)
        .zip(after[b1_t0..].chunks(row))
        .enumerate()
    {
        assert_ne!(x, y, "row {} sees the changed token", t0 + bt);
    }
}

#[test]
fn padding_queries_give_zero_output_and_gradient_never_nan() {
    // Sequence 0: left padding of 3, so queries 0..3 see no valid key.
    let mask = mixed_mask(2, 5, 3);
    let c = Case::new(gqa(), Some(mask.clone()), 8);
    let (out, lse) = c.forward();
    let row = c.sh.q_heads * c.sh.head_dim;
    assert!(out[..3 * row].iter().all(|&x| x == 0.0));
    assert!(
        lse[..3 * c.sh.q_heads]
            .iter()
            .all(|&l| l == f32::NEG_INFINITY)
    );
    assert!(out.iter().all(|x| x.is_finite()));
    let dout = Rng(9).vec(out.len());
    let [dq, dk, dv] = c.backward(&dout);
    assert!(dq[..3 * row].iter().all(|&x| x == 0.0));
    let tok = c.sh.kv_heads * c.sh.head_dim;
    for (s, &m) in mask.iter().enumerate() {
        if m == 0.0 {
            let span = s * tok..(s + 1) * tok;
            assert!(dk[span.clone()].iter().chain(&dv[span]).all(|&x| x == 0.0));
        }
    }
    assert!(dq.iter().chain(&dk).chain(&dv).all(|x| x.is_finite()));
}

fn param(c: &mut Case, which: usize) -> &mut Vec<f32> {
    match which {
        0 => &mut c.q,
        1 => &mut c.k,
        _ => &mut c.v,
    }
}

/// Central differences of `L = Σ dout ∘ out` against the analytic gradients.
fn check_gradients(c: &mut Case, seed: u64) {
    let dout = Rng(seed).vec(c.sh.q_len().unwrap());
    let grads = c.backward(&dout);
    let loss = |c: &Case| -> f64 {
        let (out, _) = c.forward();
        out.iter()
            .zip(&dout)
            .map(|(&o, &g)| f64::from(o) * f64::from(g))
            .sum()
    };
    let h = 1e-2f32;
    for (which, grad) in grads.iter().enumerate() {
        for (i, &g) in grad.iter().enumerate() {
            let x0 = param(c, which)[i];
            param(c, which)[i] = x0 + h;
            let up = loss(c);
            param(c, which)[i] = x0 - h;
            let down = loss(c);
            param(c, which)[i] = x0;
            let fd = (up - down) / (2.0 * f64::from(h));
            let an = f64::from(g);
            assert!(
                (fd - an).abs() <= 1e-4 + 1e-3 * an.abs(),
                "{}[{i}]: finite difference {fd}, backward {an}",
                ["dq", "dk", "dv"][which]
            );
        }
    }
}

#[test]
fn gradients_match_central_differences_gqa_padded() {
    let mut c = Case::new(gqa(), Some(mixed_mask(2, 5, 2)), 21);
    check_gradients(&mut c, 22);
}

#[test]
fn gradients_match_central_differences_across_block_boundaries() {
    for block in [1, 2, 3] {
        let mut c = Case::new(gqa(), Some(mixed_mask(2, 5, 2)), 27).with_block(block);
        check_gradients(&mut c, 28);
        let mask = vec![1., 0., 1., 1., 0., 1., 1.];
        let mut c = Case::new(AttentionShape::new(1, 7, 4, 1, 6), Some(mask), 29).with_block(block);
        check_gradients(&mut c, 30);
    }
}

#[test]
fn block_size_changes_nothing_but_rounding() {
    // Long sequences span several default blocks; small blocks split short ones.
    let cases = [
        (
            AttentionShape::new(2, 150, 4, 2, 8),
            mixed_mask(2, 150, 20),
            [64, 7],
        ),
        (gqa(), mixed_mask(2, 5, 3), [64, 2]),
        (AttentionShape::new(1, 9, 2, 2, 16), vec![1.0; 9], [4, 1]),
    ];
    for (i, (sh, mask, [a, b])) in cases.into_iter().enumerate() {
        let c = Case::new(sh, Some(mask.clone()), 31 + i as u64).with_block(a);
        let d = Case::new(sh, Some(mask), 31 + i as u64).with_block(b);
        let (out_a, lse_a) = c.forward();
        let (out_b, lse_b) = d.forward();
        let want = c.reference();
        assert_close(&out_a, &want, 1e-5, "out");
        assert_close(&out_b, &want, 1e-5, "out (small blocks)");
        for (x, y) in lse_a.iter().zip(&lse_b) {
            assert!(
                x == y || (x - y).abs() <= 1e-5 * (1.0 + x.abs()),
                "lse {x} vs {y}"
            );
        }
        let dout = Rng(40 + i as u64).vec(out_a.len());
        for (ga, gb) in c.backward(&dout).iter().zip(&d.backward(&dout)) {
            let want: Vec<f64> = ga.iter().map(|&x| f64::from(x)).collect();
            assert_close(gb, &want, 2e-5, "gradient");
        }
    }
}

#[test]
fn gradients_match_central_differences_mha_and_single_token() {
    let mut c = Case::new(AttentionShape::new(1, 4, 2, 2, 5), None, 23);
    check_gradients(&mut c, 24);
    let mut c = Case::new(AttentionShape::new(2, 1, 4, 2, 3), None, 25);
    check_gradients(&mut c, 26);
}

/// Generation: keys appended token by token (or in a prefill chunk), decode over the cache.
fn decode_rows(c: &Case, chunks: &[usize]) -> Vec<f32> {
    let sh = c.sh;
    let (tq, tk) = (sh.q_heads * sh.head_dim, sh.kv_heads * sh.head_dim);
    let max_len = sh.seq + 2; // spare slots must be ignored
    let mut k_cache = vec![f32::NAN; sh.batch * max_len * tk];
    let mut v_cache = vec![f32::NAN; sh.batch * max_len * tk];
    let mut len = vec![0usize; sh.batch];
    let mut key_mask = vec![1.0f32; sh.batch * max_len];
    if let Some(m) = &c.mask {
        for b in 0..sh.batch {
            key_mask[b * max_len..b * max_len + sh.seq].copy_from_slice(&m[b * sh.seq..][..sh.seq]);
        }
    }
    let mut got = vec![0.0f32; c.q.len()];
    let mut t0 = 0;
    for &n in chunks {
        let step = AttentionShape { seq: n, ..sh };
        // Tokens t0..t0+n of every sequence, as [B, n, H, D].
        let take = |x: &[f32], w: usize| -> Vec<f32> {
            (0..sh.batch)
                .flat_map(|b| x[(b * sh.seq + t0) * w..(b * sh.seq + t0 + n) * w].to_vec())
                .collect()
        };
        let cache = KvCacheMut {
            k: &mut k_cache,
            v: &mut v_cache,
            max_len,
            len: &mut len,
        };
        kv_cache_append(&step, &take(&c.k, tk), &take(&c.v, tk), cache).unwrap();
        let mut out = vec![f32::NAN; sh.batch * n * tq];
        let cache = KvCache {
            k: &k_cache,
            v: &v_cache,
            max_len,
            len: &len,
            key_mask: Some(&key_mask),
        };
        attention_decode(&step, &take(&c.q, tq), cache, &mut out).unwrap();
        for b in 0..sh.batch {
            got[(b * sh.seq + t0) * tq..(b * sh.seq + t0 + n) * tq]
                .copy_from_slice(&out[b * n * tq..(b + 1) * n * tq]);
        }
        t0 += n;
    }
    assert_eq!(len, vec![sh.seq; sh.batch]);
    got
}

#[test]
fn decode_over_cache_equals_forward_token_by_token_with_left_padding() {
    let mut mask = vec![1.0f32; 3 * 5];
    mask[..2].fill(0.0); // sequence 0 left-padded by 2
    mask[5] = 0.0; // sequence 1 by 1
    let c = Case::new(AttentionShape::new(3, 5, 6, 2, 8), Some(mask), 31);
    let (full, _) = c.forward();
    // The forward runs as GEMMs, decode as dot products: equal up to summation order.
    let got = decode_rows(&c, &[1, 1, 1, 1, 1]);
    assert_close(
        &got,
        &full.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
        1e-6,
        "decode token by token",
    );
    // Prefill chunk of 3, then two single-token steps.
    let got = decode_rows(&c, &[3, 1, 1]);
    assert_close(
        &got,
        &full.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
        1e-6,
        "chunked",
    );
}

#[test]
fn decode_over_ragged_unpadded_caches() {
    // Prompts of 2 and 4 tokens written through batch-1 views, then one decode step each.
    let sh = AttentionShape::new(2, 1, 4, 2, 8);
    let (lens, max_len) = ([3usize, 5], 6);
    let tk = sh.kv_heads * sh.head_dim;
    let seqs: Vec<Case> = lens
        .iter()
        .enumerate()
        .map(|(b, &t)| {
            Case::new(
                AttentionShape {
                    batch: 1,
                    seq: t,
                    ..sh
                },
                None,
                40 + b as u64,
            )
        })
        .collect();
    let mut k_cache = vec![0.0f32; 2 * max_len * tk];
    let mut v_cache = vec![0.0f32; 2 * max_len * tk];
    let mut len = [0usize; 2];
    for (b, c) in seqs.iter().enumerate() {
        let prompt = lens[b] - 1;
        let view = AttentionShape {
            batch: 1,
            seq: prompt,
            ..sh
        };
        let slab = b * max_len * tk..(b + 1) * max_len * tk;
        let cache = KvCacheMut {
            k: &mut k_cache[slab.clone()],
            v: &mut v_cache[slab],
            max_len,
            len: &mut len[b..b + 1],
        };
        kv_cache_append(&view, &c.k[..prompt * tk], &c.v[..prompt * tk], cache).unwrap();
    }
    assert_eq!(len, [2, 4]);
    // The last token of each sequence, batched.
    let last = |x: &Case, w: usize, f: fn(&Case) -> &Vec<f32>| f(x)[(x.sh.seq - 1) * w..].to_vec();
    let k_new: Vec<f32> = seqs.iter().flat_map(|c| last(c, tk, |c| &c.k)).collect();
    let v_new: Vec<f32> = seqs.iter().flat_map(|c| last(c, tk, |c| &c.v)).collect();
    let tq = sh.q_heads * sh.head_dim;
    let q_new: Vec<f32> = seqs.iter().flat_map(|c| last(c, tq, |c| &c.q)).collect();
    let cache = KvCacheMut {
        k: &mut k_cache,
        v: &mut v_cache,
        max_len,
        len: &mut len,
    };
    kv_cache_append(&sh, &k_new, &v_new, cache).unwrap();
    let mut out = vec![f32::NAN; 2 * tq];
    let cache = KvCache {
        k: &k_cache,
        v: &v_cache,
        max_len,
        len: &len,
        key_mask: None,
    };
    attention_decode(&sh, &q_new, cache, &mut out).unwrap();
    for (b, c) in seqs.iter().enumerate() {
        let want = c.reference();
        assert_close(
            &out[b * tq..(b + 1) * tq],
            &want[want.len() - tq..],
            1e-5,
            "decode",
        );
    }
}

#[test]
fn decode_query_without_valid_key_is_zero() {
    let sh = AttentionShape::new(1, 1, 2, 1, 4);
    let (k, v) = (vec![1.0f32; 8], vec![f32::NAN; 8]); // masked values are never read
    let mut out = vec![f32::NAN; 8];
    let cache = KvCache {
        k: &k,
        v: &v,
        max_len: 2,
        len: &[2],
        key_mask: Some(&[0.0, 0.0]),
    };
    attention_decode(&sh, &[0.5; 8], cache, &mut out).unwrap();
    assert_eq!(out, vec![0.0; 8]);
}

fn core_err(e: Error) -> CoreError {
    match e {
        Error::Core(c) => c,
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn bad_inputs_are_errors_naming_the_argument() {
    let c = Case::new(gqa(), None, 50);
    let (mut out, mut lse) = (
        vec![0.0f32; c.q.len()],
        vec![0.0f32; c.sh.lse_len().unwrap()],
    );
    let mismatch = |r: Result<()>| match core_err(r.unwrap_err()) {
        CoreError::LengthMismatch { what, .. } => what,
        other => panic!("unexpected {other:?}"),
    };
    let short = &c.k[1..];
    let bad = AttentionInputs {
        k: short,
        ..c.inputs()
    };
    assert_eq!(
        mismatch(attention_forward(&c.sh, bad, &mut out, &mut lse)),
        "k"
    );
    assert_eq!(
        mismatch(attention_forward(
            &c.sh,
            c.inputs(),
            &mut out,
            &mut lse[1..]
        )),
        "lse"
    );
    let grads = AttentionGrads {
        dq: &mut vec![0.0; c.q.len()],
        dk: &mut vec![0.0; c.k.len()],
        dv: &mut [0.0; 3],
    };
    let r = attention_backward(&c.sh, c.inputs(), &out, &lse, &out, grads);
    assert_eq!(mismatch(r), "dv");

    let mask = vec![0.5f32; 10];
    let bad = AttentionInputs {
        key_mask: Some(&mask),
        ..c.inputs()
    };
    let e = core_err(attention_forward(&c.sh, bad, &mut out, &mut lse).unwrap_err());
    assert_eq!(
        e,
        CoreError::InvalidMask {
            what: "key_mask",
            index: 0
        }
    );

    let sh = AttentionShape::new(2, 5, 6, 4, 8);
    let e = core_err(attention_forward(&sh, c.inputs(), &mut out, &mut lse).unwrap_err());
    assert!(matches!(
        e,
        CoreError::NotDivisible {
            what: "q_heads",
            ..
        }
    ));
    let sh = gqa().with_scale(f32::NAN);
    let e = core_err(attention_forward(&sh, c.inputs(), &mut out, &mut lse).unwrap_err());
    assert!(matches!(e, CoreError::OutOfRange { what: "scale", .. }));
    let sh = AttentionShape::new(2, 5, 6, 2, 0);
    let e = core_err(attention_forward(&sh, c.inputs(), &mut out, &mut lse).unwrap_err());
    assert!(matches!(
        e,
        CoreError::OutOfRange {
            what: "head_dim",
            ..
        }
    ));
    let sh = AttentionShape::new(usize::MAX, 5, 6, 2, 8);
    let e = core_err(attention_forward(&sh, c.inputs(), &mut out, &mut lse).unwrap_err());
    assert!(matches!(e, CoreError::OutOfRange { .. }));
}

#[test]
fn cache_overflow_and_short_cache_are_errors_and_write_nothing() {
    let sh = AttentionShape::new(2, 2, 2, 1, 4);
    let (mut k, mut v) = (vec![0.0f32; 2 * 3 * 4], vec![0.0f32; 2 * 3 * 4]);
    let mut len = [1usize, 2];
    let new = vec![1.0f32; 2 * 2 * 4];
    let cache = KvCacheMut {
        k: &mut k,
        v: &mut v,
        max_len: 3,
        len: &mut len,
    };
    let e = core_err(kv_cache_append(&sh, &new, &new, cache).unwrap_err());
    assert!(matches!(e, CoreError::OutOfRange { what: "cache_len", value, .. } if value == 2.0));
    assert_eq!(len, [1, 2]);
    assert!(k.iter().chain(&v).all(|&x| x == 0.0));
    let cache = KvCacheMut {
        k: &mut k,
        v: &mut v,
        max_len: 3,
        len: &mut len[..1],
    };
    let e = core_err(kv_cache_append(&sh, &new, &new, cache).unwrap_err());
    assert!(matches!(
        e,
        CoreError::LengthMismatch {
            what: "cache_len",
            ..
        }
    ));

    // Two queries per sequence but sequence 0 holds one key: its keys were not appended.
    let mut out = vec![0.0f32; 2 * 2 * 2 * 4];
    let cache = KvCache {
        k: &k,
        v: &v,
        max_len: 3,
        len: &len,
        key_mask: None,
    };
    let e = core_err(attention_decode(&sh, &out.clone(), cache, &mut out).unwrap_err());
    assert!(matches!(e, CoreError::OutOfRange { what: "cache_len", value, .. } if value == 1.0));
    let cache = KvCache {
        k: &k[1..],
        v: &v,
        max_len: 3,
        len: &[2, 2],
        key_mask: None,
    };
    let e = core_err(attention_decode(&sh, &out.clone(), cache, &mut out).unwrap_err());
    assert!(matches!(
        e,
        CoreError::LengthMismatch {
            what: "k_cache",
            ..
        }
    ));
}

#[test]
fn empty_batch_is_a_no_op() {
    let sh = AttentionShape::new(0, 5, 4, 2, 8);
    let inputs = AttentionInputs {
        q: &[],
        k: &[],
        v: &[],
        key_mask: Some(&[]),
        segments: None,
    };
    attention_forward(&sh, inputs, &mut [], &mut []).unwrap();
    let grads = AttentionGrads {
        dq: &mut [],
        dk: &mut [],
        dv: &mut [],
    };
    attention_backward(&sh, inputs, &[], &[], &[], grads).unwrap();
}

#[test]
fn non_finite_scores_give_nan_rows() {
    let mut c = Case::new(AttentionShape::new(1, 3, 2, 1, 4), None, 60);
    c.k[4] = f32::INFINITY; // key 1
    let (out, lse) = c.forward();
    let row = 2 * 4;
    assert!(
        out[..row].iter().all(|x| x.is_finite()),
        "row 0 does not see key 1"
    );
    assert!(out[row..].iter().all(|x| x.is_nan()) && lse[2..].iter().all(|l| l.is_nan()));
}

/// Decode takes a kv head's query heads through one pass over its keys (in parts of
/// `HEADS_AT_ONCE`); each head must get exactly the bits it gets alone. A group of 10 (a
/// part of 8 and one of 2) against the same heads two at a time over MHA's one-head loop,
/// with masked slots and a non-finite score in one sequence.
#[test]
fn grouped_heads_equal_one_head_at_a_time_bit_for_bit() {
    let (b, hkv, group, d, max_len) = (2usize, 2usize, 10usize, 12usize, 9usize);
    let hq = hkv * group;
    let len = [7usize, 9];
    let k = crate::test_rng::rand_vec(b * max_len * hkv * d, 71);
    let v = crate::test_rng::rand_vec(b * max_len * hkv * d, 72);
    let mut q = crate::test_rng::rand_vec(b * hq * d, 73);
    q[hq * d + 3 * d] = f32::INFINITY; // sequence 1, head 3: NaN scores
    let mut key_mask = vec![1.0f32; b * max_len];
    key_mask[1] = 0.0;
    key_mask[max_len + 4] = 0.0;
    let cache = KvCache {
        k: &k,
        v: &v,
        max_len,
        len: &len,
        key_mask: Some(&key_mask),
    };
    let mut grouped = vec![0.0f32; q.len()];
    attention_decode(
        &AttentionShape::new(b, 1, hq, hkv, d),
        &q,
        cache,
        &mut grouped,
    )
    .unwrap();
    assert!(grouped[hq * d + 3 * d].is_nan() && grouped[0].is_finite());
    for i in 0..group {
        // query heads i and group + i (kv heads 0 and 1) as an MHA of 2 heads
        let pick = |x: &[f32]| -> Vec<f32> {
            (0..b)
                .flat_map(|s| [i, group + i].map(|h| &x[(s * hq + h) * d..][..d]))
                .flatten()
                .copied()
                .collect()
        };
        let mut alone = vec![0.0f32; b * hkv * d];
        let mha = AttentionShape::new(b, 1, hkv, hkv, d);
        attention_decode(&mha, &pick(&q), cache, &mut alone).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&pick(&grouped)),
            bits(&alone),
            "heads {i} and {}",
            group + i
        );
    }
}

/// The AVX2 decode path scores 8 keys at a time; each score must be `dot`'s bits, for head
/// sizes with and without a tail past the 16-lane chunks, zeros of both signs included.
#[cfg(target_arch = "x86_64")]
#[test]
fn eight_key_dots_equal_dot_bit_for_bit() {
    if !crate::Isa::Avx2.supported() {
        eprintln!("skipped: no AVX2 on this CPU");
        return;
    }
    for (i, d) in [1usize, 8, 15, 16, 17, 32, 48, 64, 100, 128]
        .into_iter()
        .enumerate()
    {
        let a = crate::test_rng::rand_vec(d, 80 + i as u64);
        let mut rows: Vec<Vec<f32>> = (0..8)
            .map(|j| crate::test_rng::rand_vec(d, 90 + (8 * i + j) as u64))
            .collect();
        rows[3].iter_mut().for_each(|x| *x = -0.0);
        rows[5].iter_mut().for_each(|x| *x *= 1e30);
        let b: [&[f32]; 8] = std::array::from_fn(|j| &rows[j][..]);
        // SAFETY: AVX2 is supported (checked above); every row holds `d` values.
        let got = unsafe { super::dot8_avx2::<F32Exact>(&a, &b) };
        for (j, (g, row)) in got.iter().zip(&rows).enumerate() {
            assert_eq!(
                g.to_bits(),
                super::dot::<F32Exact>(&a, row).to_bits(),
                "d = {d}, key {j}"
            );
        }
        // the same keys stored in bf16 (a bf16 KV page), widened as they are loaded
        let halves: Vec<Vec<u16>> = rows
            .iter()
            .map(|r| r.iter().map(|&x| Bf16Bits::narrow(x)).collect())
            .collect();
        let b16: [&[u16]; 8] = std::array::from_fn(|j| &halves[j][..]);
        // SAFETY: as above.
        let got = unsafe { super::dot8_avx2::<Bf16Bits>(&a, &b16) };
        for (j, (g, row)) in got.iter().zip(&halves).enumerate() {
            let widened: Vec<f32> = row.iter().map(|&x| Bf16Bits::widen(x)).collect();
            assert_eq!(
                g.to_bits(),
                super::dot::<Bf16Bits>(&a, row).to_bits(),
                "bf16: d = {d}, key {j}"
            );
            assert_eq!(
                g.to_bits(),
                super::dot::<F32Exact>(&a, &widened).to_bits(),
                "bf16 widened: d = {d}, key {j}"
            );
        }
    }
}

/// The tensor-core forward's arithmetic one row at a time, in plain loops: the bf16
/// operands, key tiles from 0, the running max and sum, `α`, the probabilities rounded for
/// the value product (`tensor_core`'s module docs). Returns `(out, lse)`.
fn bf16_kernel_reference(c: &Case) -> (Vec<f32>, Vec<f32>) {
    let AttentionShape {
        batch,
        seq,
        q_heads,
        kv_heads,
        head_dim: d,
        scale,
    } = c.sh;
    let r = |x: f32| crate::ops::precision::MatmulPrecision::Bf16.round(x);
    let exp = |x: f32| exp_nonpositive::<false>(x);
    let group = q_heads / kv_heads;
    let mask = c.mask_or_ones();
    let mut out = vec![0.0f32; c.q.len()];
    let mut lse = vec![0.0f32; c.sh.lse_len().unwrap()];
    for b in 0..batch {
        for t in 0..seq {
            for h in 0..q_heads {
                let (qi, g) = (((b * seq + t) * q_heads + h) * d, h / group);
                let ki = |s: usize| ((b * seq + s) * kv_heads + g) * d;
                let (mut m, mut l, mut bad) = (f32::NEG_INFINITY, 0.0f32, false);
                let mut o = vec![0.0f32; d];
                for k0 in (0..=t).step_by(tensor_core::KEY_TILE) {
                    let tile: Vec<f32> = (k0..(k0 + tensor_core::KEY_TILE).min(t + 1))
                        .map(|s| {
                            let dot = (0..d)
                                .fold(0.0f32, |acc, e| acc + r(c.q[qi + e]) * r(c.k[ki(s) + e]));
                            let x = scale * dot;
                            let visible = mask[b * seq + s] == 1.0;
                            bad |= visible && !x.is_finite();
                            if visible && x.is_finite() {
                                x
                            } else {
                                f32::NEG_INFINITY
                            }
                        })
                        .collect();
                    let tile_max = tile.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    if tile_max == f32::NEG_INFINITY {
                        continue;
                    }
                    let m_new = m.max(tile_max);
                    let alpha = exp(m - m_new);
                    let p: Vec<f32> = tile
                        .iter()
                        .map(|&x| {
                            if x == f32::NEG_INFINITY {
                                0.0
                            } else {
                                exp(x - m_new)
                            }
                        })
                        .collect();
                    l = l * alpha + p.iter().sum::<f32>();
                    for (e, o) in o.iter_mut().enumerate() {
                        let pv = p
                            .iter()
                            .enumerate()
                            .fold(0.0f32, |acc, (j, &p)| acc + r(p) * r(c.v[ki(k0 + j) + e]));
                        *o = *o * alpha + pv;
                    }
                    m = m_new;
                }
                let empty = m == f32::NEG_INFINITY;
                for (e, o) in o.iter().enumerate() {
                    out[qi + e] = if bad {
                        f32::NAN
                    } else if empty {
                        0.0
                    } else {
                        o * (1.0 / l)
                    };
                }
                lse[(b * seq + t) * q_heads + h] = if bad {
                    f32::NAN
                } else if empty {
                    f32::NEG_INFINITY
                } else {
                    m + l.ln()
                };
            }
        }
    }
    (out, lse)
}

fn bf16_forward(c: &Case) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![f32::NAN; c.sh.q_len().unwrap()];
    let mut lse = vec![f32::NAN; c.sh.lse_len().unwrap()];
    attention_forward_bf16(&c.sh, c.inputs(), &mut out, &mut lse).unwrap();
    (out, lse)
}

/// With operands on a coarse dyadic grid every score is exact whatever the summation
/// order, so the twin's GEMM tiles and the plain loops must round every probability alike:
/// the log-sum-exp to the bit, the output to the f32 sums of the value product. A twin that
/// took the row's final max instead of the running one, another tile size, or unrounded
/// probabilities fails it (the lse by last bits, the output by bf16 steps of p).
#[test]
fn bf16_forward_is_the_kernels_tile_arithmetic() {
    for (sh, mask) in [
        (
            AttentionShape::new(2, 150, 4, 2, 16),
            Some(mixed_mask(2, 150, 5)),
        ),
        (AttentionShape::new(1, 70, 2, 1, 64), None),
    ] {
        let mut c = Case::new(sh.with_scale(0.125), mask, 81);
        for x in c.q.iter_mut().chain(c.k.iter_mut()) {
            *x = (*x * 4.0).round() / 8.0;
        }
        for x in c.v.iter_mut() {
            *x = (*x * 8.0).round() / 16.0;
        }
        let (out, lse) = bf16_forward(&c);
        let (want_out, want_lse) = bf16_kernel_reference(&c);
        for (i, (g, w)) in lse.iter().zip(&want_lse).enumerate() {
            assert!(g.to_bits() == w.to_bits(), "lse[{i}]: {g} vs {w}");
        }
        for (i, (g, w)) in out.iter().zip(&want_out).enumerate() {
            assert!((g - w).abs() <= 1e-5, "out[{i}]: {g} vs {w}");
        }
    }
}

/// Against exact f32 attention the differences are bf16's: scores from operands rounded
/// to 8 significant bits, probabilities and values rounded once more.
#[test]
fn bf16_forward_is_f32_attention_to_bf16_rounding() {
    let c = Case::new(
        AttentionShape::new(2, 100, 6, 2, 16),
        Some(mixed_mask(2, 100, 7)),
        82,
    );
    let (out, lse) = bf16_forward(&c);
    let (want_out, want_lse) = c.forward();
    let mut worst = 0.0f32;
    for (g, w) in out.iter().zip(&want_out) {
        worst = worst.max((g - w).abs());
    }
    assert!(
        worst <= 2e-2 && worst > 0.0,
        "out: worst |bf16 − f32| = {worst}"
    );
    for (i, (g, w)) in lse.iter().zip(&want_lse).enumerate() {
        let same_inf = *g == f32::NEG_INFINITY && *w == f32::NEG_INFINITY;
        assert!(
            same_inf || (g - w).abs() <= 2e-2 * (1.0 + w.abs()),
            "lse[{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn bf16_forward_keeps_empty_and_non_finite_rows() {
    // Left padding: sequence 0's first 3 queries see no key.
    let c = Case::new(
        AttentionShape::new(2, 9, 2, 1, 16),
        Some(mixed_mask(2, 9, 3)),
        83,
    );
    let (out, lse) = bf16_forward(&c);
    assert!(out[..3 * 2 * 16].iter().all(|&x| x == 0.0));
    assert!(lse[..3 * 2].iter().all(|&l| l == f32::NEG_INFINITY));
    assert!(out[3 * 2 * 16..].iter().all(|x| x.is_finite()));
    let mut c = Case::new(AttentionShape::new(1, 3, 2, 1, 4), None, 60);
    c.k[4] = f32::INFINITY; // key 1
    let (out, lse) = bf16_forward(&c);
    let row = 2 * 4;
    assert!(
        out[..row].iter().all(|x| x.is_finite()),
        "row 0 does not see key 1"
    );
    assert!(out[row..].iter().all(|x| x.is_nan()) && lse[2..].iter().all(|l| l.is_nan()));
    let mut short = vec![0.0f32; 3];
    let err = attention_forward_bf16(&c.sh, c.inputs(), &mut short, &mut [0.0; 6]);
    assert!(err.is_err_and(|e| e.to_string().contains("out")));
}

/// The tensor-core backward's arithmetic in plain loops: scores from the rounded q and k,
/// `p = e^(min(s − lse, 0))` by the kernels' exp, `δ = dÕ·out`, `dS = p·(dÕ·ṽ − δ)`, and
/// the products over bf16 `p` and `dS`. Returns `[dq, dk, dv]`.
fn bf16_backward_reference(c: &Case, out: &[f32], lse: &[f32], dout: &[f32]) -> [Vec<f32>; 3] {
    let AttentionShape {
        batch,
        seq,
        q_heads,
        kv_heads,
        head_dim: d,
        scale,
    } = c.sh;
    let r = |x: f32| crate::ops::precision::MatmulPrecision::Bf16.round(x);
    let group = q_heads / kv_heads;
    let mask = c.mask_or_ones();
    let (mut dq, mut dk, mut dv) = (
        vec![0.0f32; c.q.len()],
        vec![0.0f32; c.k.len()],
        vec![0.0f32; c.v.len()],
    );
    for b in 0..batch {
        for h in 0..q_heads {
            let g = h / group;
            for t in 0..seq {
                let qi = ((b * seq + t) * q_heads + h) * d;
                let l = lse[(b * seq + t) * q_heads + h];
                let delta: f32 = (0..d).map(|e| r(dout[qi + e]) * out[qi + e]).sum();
                for s in 0..=t {
                    let ki = ((b * seq + s) * kv_heads + g) * d;
                    if mask[b * seq + s] != 1.0 || l == f32::NEG_INFINITY {
                        continue;
                    }
                    let dot = (0..d).fold(0.0f32, |a, e| a + r(c.q[qi + e]) * r(c.k[ki + e]));
                    let p = exp_nonpositive::<false>((scale * dot - l).min(0.0));
                    let dp = (0..d).fold(0.0f32, |a, e| a + r(dout[qi + e]) * r(c.v[ki + e]));
                    let ds = r(p * (dp - delta));
                    for e in 0..d {
                        dq[qi + e] += scale * ds * r(c.k[ki + e]);
                        dk[ki + e] += scale * ds * r(c.q[qi + e]);
                        dv[ki + e] += r(p) * r(dout[qi + e]);
                    }
                }
            }
        }
    }
    [dq, dk, dv]
}

fn bf16_backward(c: &Case, out: &[f32], lse: &[f32], dout: &[f32]) -> [Vec<f32>; 3] {
    let (mut dq, mut dk, mut dv) = (
        vec![f32::NAN; c.q.len()],
        vec![f32::NAN; c.k.len()],
        vec![f32::NAN; c.v.len()],
    );
    let grads = AttentionGrads {
        dq: &mut dq,
        dk: &mut dk,
        dv: &mut dv,
    };
    attention_backward_bf16(&c.sh, c.inputs(), out, lse, dout, grads).unwrap();
    [dq, dk, dv]
}

/// On dyadic operands (exact scores and `dÕ·ṽ`), the twin's blocked GEMMs against the plain
/// loops: every probability and `dS` rounds alike, so the gradients differ by the order
/// of f32 sums only. Unrounded `p` or `dS`, or an FMA `exp`, fails it.
#[test]
fn bf16_backward_is_the_kernels_arithmetic() {
    for (sh, mask) in [
        (
            AttentionShape::new(2, 90, 4, 2, 16),
            Some(mixed_mask(2, 90, 4)),
        ),
        (AttentionShape::new(1, 70, 2, 1, 64), None),
    ] {
        let mut c = Case::new(sh.with_scale(0.125), mask, 91);
        for x in c.q.iter_mut().chain(c.k.iter_mut()) {
            *x = (*x * 4.0).round() / 8.0;
        }
        for x in c.v.iter_mut() {
            *x = (*x * 8.0).round() / 16.0;
        }
        let dout: Vec<f32> = Rng(92)
            .vec(c.q.len())
            .iter()
            .map(|x| (x * 8.0).round() / 16.0)
            .collect();
        let (out, lse) = bf16_forward(&c);
        let got = bf16_backward(&c, &out, &lse, &dout);
        let want = bf16_backward_reference(&c, &out, &lse, &dout);
        for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            let scale = w.iter().fold(0.0f32, |a, x| a.max(x.abs()));
            for (i, (g, w)) in g.iter().zip(w).enumerate() {
                assert!(
                    (g - w).abs() <= 2e-6 * scale.max(1.0),
                    "{name}[{i}]: {g} vs {w}"
                );
            }
        }
    }
}

/// Against the exact f32 backward of exact f32 attention: bf16's differences.
#[test]
fn bf16_backward_is_f32_gradients_to_bf16_rounding() {
    let c = Case::new(
        AttentionShape::new(2, 100, 6, 2, 16),
        Some(mixed_mask(2, 100, 7)),
        93,
    );
    let dout = Rng(94).vec(c.q.len());
    let (out, lse) = bf16_forward(&c);
    let got = bf16_backward(&c, &out, &lse, &dout);
    let want = c.backward(&dout);
    for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
        let scale = w.iter().fold(0.0f32, |a, x| a.max(x.abs()));
        let worst = g
            .iter()
            .zip(w)
            .fold(0.0f32, |a, (g, w)| a.max((g - w).abs()));
        assert!(
            worst > 0.0 && worst <= 3e-2 * scale,
            "{name}: worst {worst} of {scale}"
        );
    }
}

/// Forward and backward of `inputs` at `sh`, f32 or bf16 operands: `[out, lse, dq, dk, dv]`.
fn run_both(
    sh: &AttentionShape,
    inputs: AttentionInputs<'_>,
    dout: &[f32],
    bf16: bool,
) -> [Vec<f32>; 5] {
    let mut out = vec![f32::NAN; sh.q_len().unwrap()];
    let mut lse = vec![f32::NAN; sh.lse_len().unwrap()];
    let (mut dq, mut dk, mut dv) = (
        vec![f32::NAN; inputs.q.len()],
        vec![f32::NAN; inputs.k.len()],
        vec![f32::NAN; inputs.v.len()],
    );
    let grads = AttentionGrads {
        dq: &mut dq,
        dk: &mut dk,
        dv: &mut dv,
    };
    if bf16 {
        attention_forward_bf16(sh, inputs, &mut out, &mut lse).unwrap();
        attention_backward_bf16(sh, inputs, &out, &lse, dout, grads).unwrap();
    } else {
        attention_forward(sh, inputs, &mut out, &mut lse).unwrap();
        attention_backward(sh, inputs, &out, &lse, dout, grads).unwrap();
    }
    [out, lse, dq, dk, dv]
}

/// Packed segments are attended each as a sequence of its own: the packed call equals one
/// call per segment to the bit (same tasks, same products), forward and backward, f32 and
/// the bf16 twin, with a key mask, an empty segment and segments across block boundaries.
#[test]
fn packed_segments_equal_each_sequence_alone_bit_for_bit() {
    let lens = [70usize, 0, 5, 130, 1, 64];
    let tokens: usize = lens.iter().sum();
    let mut cu = vec![0u32];
    for l in lens {
        cu.push(cu.last().unwrap() + l as u32);
    }
    let (hq, hkv, d) = (4, 2, 16);
    let mut mask = vec![1.0f32; tokens];
    for i in [3, 80, 150] {
        mask[i] = 0.0;
    }
    let c = Case::new(AttentionShape::new(1, tokens, hq, hkv, d), Some(mask), 91);
    let dout = Rng(92).vec(c.q.len());
    let packed = AttentionInputs {
        segments: Some(&cu),
        ..c.inputs()
    };
    for bf16 in [false, true] {
        let got = run_both(&c.sh, packed, &dout, bf16);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for w in cu.windows(2) {
            let (a, b) = (w[0] as usize, w[1] as usize);
            if a == b {
                continue;
            }
            let sh = AttentionShape::new(1, b - a, hq, hkv, d);
            let one = AttentionInputs {
                q: &c.q[a * hq * d..b * hq * d],
                k: &c.k[a * hkv * d..b * hkv * d],
                v: &c.v[a * hkv * d..b * hkv * d],
                key_mask: c.mask.as_ref().map(|m| &m[a..b]),
                segments: None,
            };
            let want = run_both(&sh, one, &dout[a * hq * d..b * hq * d], bf16);
            let per_token = [hq * d, hq, hq * d, hkv * d, hkv * d];
            for (i, name) in ["out", "lse", "dq", "dk", "dv"].iter().enumerate() {
                let n = per_token[i];
                assert_eq!(
                    bits(&got[i][a * n..b * n]),
                    bits(&want[i]),
                    "{name} of segment {a}..{b}, bf16 {bf16}"
                );
            }
        }
    }
}

/// Packed segments against the same sequences right-padded into a batch: equal up to the
/// summation order of the padded keys' zero probabilities.
#[test]
fn packed_segments_match_the_padded_batch() {
    let lens = [37usize, 64, 9];
    let (hq, hkv, d, t) = (4, 2, 8, 64);
    let tokens: usize = lens.iter().sum();
    let c = Case::new(AttentionShape::new(1, tokens, hq, hkv, d), None, 93);
    let mut cu = vec![0u32];
    for l in lens {
        cu.push(cu.last().unwrap() + l as u32);
    }
    let packed = AttentionInputs {
        segments: Some(&cu),
        ..c.inputs()
    };
    let dout = Rng(94).vec(c.q.len());
    let got = run_both(&c.sh, packed, &dout, false);
    // the padded batch: row b holds segment b, then zeros (masked keys)
    let sh = AttentionShape::new(lens.len(), t, hq, hkv, d);
    let pad = |x: &[f32], per: usize| {
        let mut out = vec![0.0f32; lens.len() * t * per];
        for (b, w) in cu.windows(2).enumerate() {
            let (a, e) = (w[0] as usize, w[1] as usize);
            out[b * t * per..(b * t + e - a) * per].copy_from_slice(&x[a * per..e * per]);
        }
        out
    };
    let mask = pad(&vec![1.0; tokens], 1);
    let (q, k, v) = (pad(&c.q, hq * d), pad(&c.k, hkv * d), pad(&c.v, hkv * d));
    let padded = AttentionInputs {
        q: &q,
        k: &k,
        v: &v,
        key_mask: Some(&mask),
        segments: None,
    };
    let want = run_both(&sh, padded, &pad(&dout, hq * d), false);
    let per_token = [hq * d, hq, hq * d, hkv * d, hkv * d];
    for (i, name) in ["out", "lse", "dq", "dk", "dv"].iter().enumerate() {
        let want = pad_inverse(&want[i], &cu, t, per_token[i]);
        for (j, (g, w)) in got[i].iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{name}[{j}]: {g} vs {w}"
            );
        }
    }
}

/// The valid rows of a right-padded `[segments, t, per]` tensor, packed.
fn pad_inverse(x: &[f32], cu: &[u32], t: usize, per: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for (b, w) in cu.windows(2).enumerate() {
        let n = (w[1] - w[0]) as usize;
        out.extend_from_slice(&x[b * t * per..(b * t + n) * per]);
    }
    out
}

#[test]
fn packed_segments_need_one_row_and_valid_offsets() {
    let c = Case::new(AttentionShape::new(2, 5, 2, 1, 4), None, 95);
    let (mut out, mut lse) = (vec![0.0; c.q.len()], vec![0.0; 2 * 5 * 2]);
    let cu = [0u32, 3, 10];
    let two_rows = AttentionInputs {
        segments: Some(&cu),
        ..c.inputs()
    };
    let e = core_err(attention_forward(&c.sh, two_rows, &mut out, &mut lse).unwrap_err());
    assert!(
        matches!(
            e,
            CoreError::OutOfRange {
                what: "batch (packed segments)",
                ..
            }
        ),
        "{e:?}"
    );
    let sh = AttentionShape::new(1, 10, 2, 1, 4);
    for bad in [&[0u32, 3, 9][..], &[1, 10], &[0, 6, 4, 10], &[]] {
        let inputs = AttentionInputs {
            segments: Some(bad),
            ..c.inputs()
        };
        let e = attention_forward(&sh, inputs, &mut out, &mut lse).unwrap_err();
        assert!(e.to_string().contains("cu_seqlens"), "{bad:?}: {e}");
    }
}
