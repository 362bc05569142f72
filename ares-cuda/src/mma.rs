//! The register layout of `mma.sync.aligned.m16n8k16` with bf16 operands and f32
//! accumulators (PTX ISA, "matrix fragments for mma.m16n8k16"), which the tensor-core
//! kernels of `model_ops.cu` index by hand. A warp's 32 lanes each hold a slice of the
//! operands: lane `4·gid + tig` holds rows (or columns) `gid` and `gid + 8` and the column
//! pairs `2·tig`, `2·tig + 1`; a 32-bit register holds two bf16 values, the lower index in
//! the low half.
//!
//! The tests emulate one warp of `attention_fwd_mma_impl` through these maps — q loaded as
//! the A operand, keys and transposed values read from its shared-memory layouts as B, the
//! score registers reused as the A operand of `P·V` — and one of the backward's dk/dv
//! kernel (keys as the A operand from shared memory, transposed scores, `pᵀ·dout`), and
//! check each product against a plain matrix product; another test checks that the kernel
//! source indexes exactly as the emulations do.

/// Lane `lane`'s group `gid` (`lane / 4`) and thread in the group `tig` (`lane % 4`).
pub const fn lane_parts(lane: usize) -> (usize, usize) {
    (lane / 4, lane % 4)
}

/// (row, column) of the 16 × 16 A operand held in half `half` (0: low 16 bits) of
/// register `reg` (0..4) of `lane`.
pub const fn a_element(lane: usize, reg: usize, half: usize) -> (usize, usize) {
    let (gid, tig) = lane_parts(lane);
    (gid + 8 * (reg % 2), 8 * (reg / 2) + 2 * tig + half)
}

/// (k, n) of the 16 × 8 B operand held in half `half` of register `reg` (0..2) of `lane`.
pub const fn b_element(lane: usize, reg: usize, half: usize) -> (usize, usize) {
    let (gid, tig) = lane_parts(lane);
    (8 * reg + 2 * tig + half, gid)
}

/// (row, column) of the 16 × 8 f32 accumulator's element `e` (0..4) of `lane`.
pub const fn c_element(lane: usize, e: usize) -> (usize, usize) {
    let (gid, tig) = lane_parts(lane);
    (gid + 8 * (e / 2), 2 * tig + e % 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::MODEL_OPS;

    /// bf16 bits of `x` (exact for the test values), widened back.
    fn bits(x: f32) -> u16 {
        let b = x.to_bits();
        assert_eq!(b & 0xffff, 0, "{x} is not a bf16 value");
        (b >> 16) as u16
    }
    fn widen(b: u16) -> f32 {
        f32::from_bits(u32::from(b) << 16)
    }
    fn pack(lo: f32, hi: f32) -> u32 {
        u32::from(bits(lo)) | (u32::from(bits(hi)) << 16)
    }
    fn half_of(reg: u32, half: usize) -> f32 {
        widen((reg >> (16 * half)) as u16)
    }
    /// The 32-bit word at bf16 index `i` of a shared-memory array (little-endian pairs).
    fn word(smem: &[u16], i: usize) -> u32 {
        assert_eq!(i % 2, 0, "unaligned 32-bit load at {i}");
        u32::from(smem[i]) | (u32::from(smem[i + 1]) << 16)
    }

    /// `c += a·b` for a warp, per the PTX definition through the maps: gather the whole A
    /// and B from the lanes' registers, multiply, scatter into the lanes' accumulators.
    fn mma(c: &mut [[f32; 4]; 32], a: &[[u32; 4]; 32], b: &[[u32; 2]; 32]) {
        let mut am = [[f32::NAN; 16]; 16];
        let mut bm = [[f32::NAN; 8]; 16];
        for (lane, (a, b)) in a.iter().zip(b).enumerate() {
            for (reg, &word) in a.iter().enumerate() {
                for half in 0..2 {
                    let (r, col) = a_element(lane, reg, half);
                    am[r][col] = half_of(word, half);
                }
            }
            for (reg, &word) in b.iter().enumerate() {
                for half in 0..2 {
                    let (k, n) = b_element(lane, reg, half);
                    bm[k][n] = half_of(word, half);
                }
            }
        }
        for (lane, acc) in c.iter_mut().enumerate() {
            for (e, x) in acc.iter_mut().enumerate() {
                let (r, n) = c_element(lane, e);
                *x += (0..16).map(|k| am[r][k] * bm[k][n]).sum::<f32>();
            }
        }
    }

    #[test]
    fn each_map_covers_its_tile_once() {
        let mut a = [[0u8; 16]; 16];
        let mut b = [[0u8; 8]; 16];
        let mut c = [[0u8; 8]; 16];
        for lane in 0..32 {
            for reg in 0..4 {
                for half in 0..2 {
                    let (r, col) = a_element(lane, reg, half);
                    a[r][col] += 1;
                }
            }
            for reg in 0..2 {
                for half in 0..2 {
                    let (k, n) = b_element(lane, reg, half);
                    b[k][n] += 1;
                }
            }
            for e in 0..4 {
                let (r, n) = c_element(lane, e);
                c[r][n] += 1;
            }
        }
        assert!(a.iter().flatten().all(|&n| n == 1));
        assert!(b.iter().flatten().all(|&n| n == 1));
        assert!(c.iter().flatten().all(|&n| n == 1));
    }

    /// Small dyadic values: every product and sum below is exact in f32.
    fn value(seed: usize) -> f32 {
        ((seed * 7919 + 13) % 17) as f32 / 8.0 - 1.0
    }

    /// One warp of `attention_fwd_mma_impl` at head size `d`: 16 query rows against a
    /// tile of 64 keys, indexed as the kernel indexes (the strings of
    /// `the_kernel_indexes_as_the_emulation`).
    fn emulate_warp(d: usize) {
        const KEYS: usize = 64;
        let (ks_n, nd_n, nb_n) = (d / 16, d / 8, KEYS / 8);
        let (kp, vp) = (d + 8, KEYS + 8);
        let q: Vec<Vec<f32>> = (0..16)
            .map(|r| (0..d).map(|c| value(r * d + c)).collect())
            .collect();
        let k: Vec<Vec<f32>> = (0..KEYS)
            .map(|j| (0..d).map(|c| value(5000 + j * d + c)).collect())
            .collect();
        let v: Vec<Vec<f32>> = (0..KEYS)
            .map(|j| (0..d).map(|c| value(9000 + j * d + c)).collect())
            .collect();
        // Staging: `Ks[j * KP + c] = kv; Vt[c * VP + j] = vv;` (each rounded to bf16, or a
        // bf16 pool's bits as they are)
        let mut ks_mem = vec![0u16; KEYS * kp];
        let mut vt_mem = vec![0u16; d * vp];
        for j in 0..KEYS {
            for c in 0..d {
                ks_mem[j * kp + c] = bits(k[j][c]);
                vt_mem[c * vp + j] = bits(v[j][c]);
            }
        }
        // q fragments: `row = i % 2, col = 16 * ks + 8 * (i / 2) + 2 * tig` (row i % 2 of
        // the lane's two: gid + 8·(i % 2)).
        let qa: Vec<[[u32; 4]; 32]> = (0..ks_n)
            .map(|ks| {
                let mut regs = [[0u32; 4]; 32];
                for (lane, r) in regs.iter_mut().enumerate() {
                    let (gid, tig) = lane_parts(lane);
                    for (i, reg) in r.iter_mut().enumerate() {
                        let (row, col) = (gid + 8 * (i % 2), 16 * ks + 8 * (i / 2) + 2 * tig);
                        *reg = pack(q[row][col], q[row][col + 1]);
                    }
                }
                regs
            })
            .collect();
        // Scores: `Ks + (8 * nb + gid) * KP + 16 * ks + 2 * tig`, second register 8 on.
        let mut s = vec![[[0.0f32; 4]; 32]; nb_n];
        for (ks, qa) in qa.iter().enumerate() {
            for (nb, acc) in s.iter_mut().enumerate() {
                let mut b = [[0u32; 2]; 32];
                for (lane, regs) in b.iter_mut().enumerate() {
                    let (gid, tig) = lane_parts(lane);
                    let at = (8 * nb + gid) * kp + 16 * ks + 2 * tig;
                    *regs = [word(&ks_mem, at), word(&ks_mem, at + 8)];
                }
                mma(acc, qa, &b);
            }
        }
        // Element e of 8-key block nb is row gid + 8·(e / 2), key `8 * nb + 2 * tig + e % 2`.
        for (nb, acc) in s.iter().enumerate() {
            for (lane, regs) in acc.iter().enumerate() {
                let (gid, tig) = lane_parts(lane);
                for (e, &x) in regs.iter().enumerate() {
                    let (row, j) = (gid + 8 * (e / 2), 8 * nb + 2 * tig + e % 2);
                    let want: f32 = (0..d).map(|c| q[row][c] * k[j][c]).sum();
                    assert_eq!(x, want, "d {d}: score row {row} key {j}");
                }
            }
        }
        // Probabilities in the score registers, then P·V as `mma_from_scores(o, s, Vt, VP)`:
        // `pa[0] = pack(c[2kk][0], c[2kk][1])`, `pa[1] = pack(c[2kk][2], c[2kk][3])`,
        // `pa[2] = pack(c[2kk+1][0], c[2kk+1][1])`, `pa[3] = pack(c[2kk+1][2], c[2kk+1][3])`
        // and B at `bt + (8 * nd + gid) * pitch + 16 * kk + 2 * tig`.
        let p = |row: usize, j: usize| value(20_000 + row * KEYS + j).abs() / 4.0;
        for (nb, acc) in s.iter_mut().enumerate() {
            for (lane, regs) in acc.iter_mut().enumerate() {
                let (gid, tig) = lane_parts(lane);
                for (e, x) in regs.iter_mut().enumerate() {
                    *x = p(gid + 8 * (e / 2), 8 * nb + 2 * tig + e % 2);
                }
            }
        }
        let mut o = vec![[[0.0f32; 4]; 32]; nd_n];
        for kk in 0..KEYS / 16 {
            let mut pa = [[0u32; 4]; 32];
            for (lane, regs) in pa.iter_mut().enumerate() {
                let (lo, hi) = (&s[2 * kk][lane], &s[2 * kk + 1][lane]);
                *regs = [
                    pack(lo[0], lo[1]),
                    pack(lo[2], lo[3]),
                    pack(hi[0], hi[1]),
                    pack(hi[2], hi[3]),
                ];
            }
            for (nd, acc) in o.iter_mut().enumerate() {
                let mut b = [[0u32; 2]; 32];
                for (lane, regs) in b.iter_mut().enumerate() {
                    let (gid, tig) = lane_parts(lane);
                    let at = (8 * nd + gid) * vp + 16 * kk + 2 * tig;
                    *regs = [word(&vt_mem, at), word(&vt_mem, at + 8)];
                }
                mma(acc, &pa, &b);
            }
        }
        // Output: `dst[8 * nd + 2 * tig + e] = o[nd][2 * i + e]` for the lane's row i.
        for (nd, acc) in o.iter().enumerate() {
            for (lane, regs) in acc.iter().enumerate() {
                let (gid, tig) = lane_parts(lane);
                for i in 0..2 {
                    for e in 0..2 {
                        let (row, col) = (gid + 8 * i, 8 * nd + 2 * tig + e);
                        let want: f32 = (0..KEYS).map(|j| p(row, j) * v[j][col]).sum();
                        assert_eq!(regs[2 * i + e], want, "d {d}: out row {row} col {col}");
                    }
                }
            }
        }
    }

    /// One warp of `attention_bwd_dkv_mma_impl` at head size `d`: its 16 keys (warp 1 of
    /// the block's 64) against a tile of 32 query rows — keys as the A operand read from
    /// shared memory, the transposed scores `k·qᵀ`, and `pᵀ·dout` with the probabilities
    /// from the score registers and dout transposed in shared memory.
    fn emulate_dkv_warp(d: usize) {
        const KEYS: usize = 64;
        const ROWS: usize = 32;
        let warp = 1;
        let (ks_n, nd_n, nb_n) = (d / 16, d / 8, ROWS / 8);
        let (kp, rp) = (d + 8, ROWS + 8);
        let k: Vec<Vec<f32>> = (0..KEYS)
            .map(|j| (0..d).map(|c| value(j * d + c)).collect())
            .collect();
        let q: Vec<Vec<f32>> = (0..ROWS)
            .map(|r| (0..d).map(|c| value(7000 + r * d + c)).collect())
            .collect();
        let o: Vec<Vec<f32>> = (0..ROWS)
            .map(|r| (0..d).map(|c| value(3000 + r * d + c)).collect())
            .collect();
        // `Kb[j * KP + c]`, `Qs[rr * KP + c]`, `Ot[c * RP + rr]`
        let mut kb = vec![0u16; KEYS * kp];
        let mut qs = vec![0u16; ROWS * kp];
        let mut ot = vec![0u16; d * rp];
        for (j, row) in k.iter().enumerate() {
            for (c, &x) in row.iter().enumerate() {
                kb[j * kp + c] = bits(x);
            }
        }
        for rr in 0..ROWS {
            for c in 0..d {
                qs[rr * kp + c] = bits(q[rr][c]);
                ot[c * rp + rr] = bits(o[rr][c]);
            }
        }
        let mut st = vec![[[0.0f32; 4]; 32]; nb_n];
        for ks in 0..ks_n {
            // `(16 * warp + gid + 8 * (i % 2)) * KP + 16 * ks + 8 * (i / 2) + 2 * tig`
            let mut ka = [[0u32; 4]; 32];
            for (lane, regs) in ka.iter_mut().enumerate() {
                let (gid, tig) = lane_parts(lane);
                for (i, reg) in regs.iter_mut().enumerate() {
                    *reg = word(
                        &kb,
                        (16 * warp + gid + 8 * (i % 2)) * kp + 16 * ks + 8 * (i / 2) + 2 * tig,
                    );
                }
            }
            for (nb, acc) in st.iter_mut().enumerate() {
                let mut b = [[0u32; 2]; 32];
                for (lane, regs) in b.iter_mut().enumerate() {
                    let (gid, tig) = lane_parts(lane);
                    let at = (8 * nb + gid) * kp + 16 * ks + 2 * tig;
                    *regs = [word(&qs, at), word(&qs, at + 8)];
                }
                mma(acc, &ka, &b);
            }
        }
        // `kl = 16 * warp + gid + 8 * (e / 2), rr = 8 * nb + 2 * tig + e % 2`
        let p = |kl: usize, rr: usize| value(40_000 + kl * ROWS + rr).abs() / 4.0;
        for (nb, acc) in st.iter_mut().enumerate() {
            for (lane, regs) in acc.iter_mut().enumerate() {
                let (gid, tig) = lane_parts(lane);
                for (e, x) in regs.iter_mut().enumerate() {
                    let (kl, rr) = (16 * warp + gid + 8 * (e / 2), 8 * nb + 2 * tig + e % 2);
                    let want: f32 = (0..d).map(|c| k[kl][c] * q[rr][c]).sum();
                    assert_eq!(*x, want, "d {d}: score key {kl} row {rr}");
                    *x = p(kl, rr);
                }
            }
        }
        let mut dv = vec![[[0.0f32; 4]; 32]; nd_n];
        for kk in 0..ROWS / 16 {
            let mut pa = [[0u32; 4]; 32];
            for (lane, regs) in pa.iter_mut().enumerate() {
                let (lo, hi) = (&st[2 * kk][lane], &st[2 * kk + 1][lane]);
                *regs = [
                    pack(lo[0], lo[1]),
                    pack(lo[2], lo[3]),
                    pack(hi[0], hi[1]),
                    pack(hi[2], hi[3]),
                ];
            }
            for (nd, acc) in dv.iter_mut().enumerate() {
                let mut b = [[0u32; 2]; 32];
                for (lane, regs) in b.iter_mut().enumerate() {
                    let (gid, tig) = lane_parts(lane);
                    let at = (8 * nd + gid) * rp + 16 * kk + 2 * tig;
                    *regs = [word(&ot, at), word(&ot, at + 8)];
                }
                mma(acc, &pa, &b);
            }
        }
        // `dv[at + 8 * nd + 2 * tig + e] = adv[nd][2 * i + e]` for key 16·warp + gid + 8·i
        for (nd, acc) in dv.iter().enumerate() {
            for (lane, regs) in acc.iter().enumerate() {
                let (gid, tig) = lane_parts(lane);
                for i in 0..2 {
                    for e in 0..2 {
                        let (kl, col) = (16 * warp + gid + 8 * i, 8 * nd + 2 * tig + e);
                        let want: f32 = (0..ROWS).map(|rr| p(kl, rr) * o[rr][col]).sum();
                        assert_eq!(regs[2 * i + e], want, "d {d}: dv key {kl} col {col}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_dkv_warp_computes_its_transposed_products() {
        for d in crate::model_ops::BF16_HEAD_DIMS {
            emulate_dkv_warp(d);
        }
    }

    #[test]
    fn the_attention_warp_computes_its_products() {
        for d in crate::model_ops::BF16_HEAD_DIMS {
            emulate_warp(d);
        }
    }

    /// The emulation above is the kernel only if the kernel indexes as it does.
    #[test]
    fn the_kernel_indexes_as_the_emulation() {
        let src = MODEL_OPS.code;
        for line in [
            "kv = bf16_at(a.k, a.k16, idx);",
            "vv = bf16_at(a.v, a.v16, idx);",
            "return h ? h[idx] : bf16_rne(f[idx]);",
            "Ks[j * KP + c] = kv;",
            "Vt[c * VP + j] = vv;",
            "const int row = i % 2, col = 16 * ks + 8 * (i / 2) + 2 * tig;",
            "const i64 r = row0 + 16 * warp + gid + 8 * i;",
            "Ks + (8 * nb + gid) * KP + 16 * ks + 2 * tig;",
            "mma_bf16_16816(s[nb], qa[ks], *(const unsigned*)kp, *(const unsigned*)(kp + 8));",
            "const int i = e / 2, j = 8 * nb + 2 * tig + e % 2;",
            // the product from the score registers (`mma_from_scores`)
            "pa[0] = pack_bf16x2(c[2 * kk][0], c[2 * kk][1]);",
            "pa[1] = pack_bf16x2(c[2 * kk][2], c[2 * kk][3]);",
            "pa[2] = pack_bf16x2(c[2 * kk + 1][0], c[2 * kk + 1][1]);",
            "pa[3] = pack_bf16x2(c[2 * kk + 1][2], c[2 * kk + 1][3]);",
            "const unsigned short* bp = bt + (8 * nd + gid) * pitch + 16 * kk + 2 * tig;",
            "mma_bf16_16816(acc[nd], pa, *(const unsigned*)bp, *(const unsigned*)(bp + 8));",
            "mma_from_scores<NB, ND>(o, s, Vt, VP, gid, tig);",
            "const float val = bad[i] ? NAN_F : __fmul_rn(o[nd][2 * i + e], inv);",
            "else out[row + 8 * nd + 2 * tig + e] = val;",
            "if (out16) out16[row + 8 * nd + 2 * tig + e] = bf16_rne(val);",
            "return (unsigned)bf16_rne(lo) | ((unsigned)bf16_rne(hi) << 16);",
            "constexpr int KP = D + 8;",
            "constexpr int VP = MMA_KEYS + 8;",
            // the backward kernels
            "const int at = (16 * warp + gid + 8 * (i % 2)) * KP + 16 * ks + 8 * (i / 2) + 2 * tig;",
            "const unsigned short* qp = Qs + (8 * nb + gid) * KP + 16 * ks + 2 * tig;",
            "mma_bf16_16816(st[nb], ka, *(const unsigned*)qp, *(const unsigned*)(qp + 8));",
            "const int kl = 16 * warp + gid + 8 * (e / 2), rr = 8 * nb + 2 * tig + e % 2;",
            "mma_from_scores<NB, ND>(adv, st, Ot, RP, gid, tig);",
            "mma_from_scores<NB, ND>(adk, dpt, Qt, RP, gid, tig);",
            "mma_from_scores<NB, ND>(acc, s, Kt, TP, gid, tig);",
            "Qs[rr * KP + c] = q16;",
            "Qt[c * RP + rr] = q16;",
            "Ot[c * RP + rr] = o16;",
            "dv[at + 8 * nd + 2 * tig + e] = adv[nd][2 * i + e];",
            "Kt[c * TP + j] = kv;",
            "dst[8 * nd + 2 * tig + e] = __fmul_rn(a.scale, acc[nd][2 * i + e]);",
        ] {
            assert!(src.contains(line), "model_ops.cu no longer has `{line}`");
        }
    }
}
