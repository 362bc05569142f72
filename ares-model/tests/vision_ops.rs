//! The vision tower's backend ops on the CPU backend: hand-checked values through the
//! trait (views at nonzero offsets included), the accumulate/overwrite conventions of the
//! backward ops, and argument errors naming the op. The kernels' own tests (finite
//! differences, f64 references) live in `ares-cpu`; `cuda_backend.rs` holds the CUDA twins.

use ares_model::backend::cpu::CpuBackend;
use ares_model::backend::{Activation, Backend, SegmentAttentionDims, View, ViewMut};

fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

#[test]
fn layer_norm_through_views_and_its_backward_accumulates() {
    let be = CpuBackend;
    // x = [pad, 1, 2, 3, 6]: μ = 3, σ² = 3.5, eps = 0.5 → rstd = 0.5, x̂ = [−1, −0.5, 0, 1.5].
    let x = vec![99.0f32, 1.0, 2.0, 3.0, 6.0];
    let (w, b) = (vec![1.0f32, 2.0, 3.0, 4.0], vec![0.0f32, 1.0, 0.0, -1.0]);
    let mut out = vec![7.0f32; 6];
    let (mut mean, mut rstd) = (vec![0.0f32; 1], vec![0.0f32; 1]);
    be.layer_norm(
        View::new(&x, 1, 4).unwrap(),
        View::whole(&w),
        View::whole(&b),
        0.5,
        4,
        ViewMut::new(&mut out, 2, 4).unwrap(),
        ViewMut::whole(&mut mean),
        ViewMut::whole(&mut rstd),
    )
    .unwrap();
    assert_eq!(out, [7.0, 7.0, -1.0, 0.0, 0.0, 5.0]);
    assert_eq!((mean[0], rstd[0]), (3.0, 0.5));

    // dout = 1: dbias += 1, dweight += x̂; g = dout·w = w, mean(g) = 2.5,
    // mean(g·x̂) = (−1 − 1 + 0 + 6)/4 = 1, dx = rstd·(g − mean(g) − x̂·mean(g·x̂))
    // = 0.5·[1 − 2.5 + 1, 2 − 2.5 + 0.5, 3 − 2.5 − 0, 4 − 2.5 − 1.5] = [−0.25, 0, 0.25, 0];
    // all three start at 1 and accumulate.
    let dout = vec![1.0f32; 4];
    let (mut dx, mut dw, mut db) = (vec![1.0f32; 4], vec![1.0f32; 4], vec![1.0f32; 4]);
    be.layer_norm_backward(
        View::whole(&dout),
        View::new(&x, 1, 4).unwrap(),
        View::whole(&w),
        View::whole(&mean),
        View::whole(&rstd),
        4,
        ViewMut::whole(&mut dx),
        ViewMut::whole(&mut dw),
        ViewMut::whole(&mut db),
    )
    .unwrap();
    close("dx", &dx, &[0.75, 1.0, 1.25, 1.0], 1e-6);
    close("dweight", &dw, &[0.0, 0.5, 1.0, 2.5], 1e-6);
    assert_eq!(db, [2.0; 4]);

    let e = be
        .layer_norm(
            View::whole(&x),
            View::whole(&w),
            View::whole(&b),
            0.5,
            4,
            ViewMut::whole(&mut out),
            ViewMut::whole(&mut mean),
            ViewMut::whole(&mut rstd),
        )
        .unwrap_err();
    assert!(e.to_string().starts_with("layer_norm"), "{e}");
}

#[test]
fn activations_and_their_backward_overwrite() {
    let be = CpuBackend;
    let x = vec![0.0f32, 1.0, -1.0];
    // act(1) for the three kinds (exact values rounded): x·Φ(x), x·σ(1.702x), tanh form.
    for (kind, at_one) in [
        (Activation::GeluErf, 0.841_344_746_068_543),
        (Activation::QuickGelu, 0.845_795_765_932_821),
        (Activation::GeluTanh, 0.841_191_990_608_277),
    ] {
        let at_one = at_one as f32;
        let mut out = vec![9.0f32; 3];
        be.activation(kind, View::whole(&x), ViewMut::whole(&mut out))
            .unwrap();
        close(&format!("{kind:?}"), &out[..2], &[0.0, at_one], 1e-6);
        // act(−x) = act(x) − x for all three (Φ(−x) = 1 − Φ(x), σ(−z) = 1 − σ(z)).
        close(&format!("{kind:?}(−1)"), &out[2..], &[at_one - 1.0], 1e-6);
        // act'(0) = ½; dx is overwritten.
        let (three, mut dx) = (vec![3.0f32], vec![9.0f32]);
        be.activation_backward(
            kind,
            View::whole(&three),
            View::new(&x, 0, 1).unwrap(),
            ViewMut::whole(&mut dx),
        )
        .unwrap();
        assert_eq!(dx, [1.5], "{kind:?}");
    }
    let mut short = vec![0.0f32; 2];
    let e = be
        .activation(
            Activation::GeluErf,
            View::whole(&x),
            ViewMut::whole(&mut short),
        )
        .unwrap_err();
    assert!(e.to_string().starts_with("activation"), "{e}");
}

#[test]
fn segment_attention_hand_values_and_backward() {
    let be = CpuBackend;
    // One head of dim 2, scale 1; segments {0, 1}, {} and {2} (see ares-cpu's hand check).
    let mut dims = SegmentAttentionDims::new(3, 3, 1, 2);
    assert_eq!(dims.scale, std::f32::consts::FRAC_1_SQRT_2);
    dims.scale = 1.0;
    let cu = vec![0u32, 2, 2, 3];
    let q = vec![1.0f32, 0.0, 0.0, 0.0, 3.0, 1.0];
    let k = vec![1.0f32, 0.0, 0.0, 1.0, 1.0, -1.0];
    let v = vec![2.0f32, 4.0, 6.0, 8.0, -1.0, 5.0];
    let (mut out, mut lse) = (vec![0.0f32; 6], vec![0.0f32; 3]);
    be.segment_attention(
        dims,
        &cu,
        View::whole(&q),
        View::whole(&k),
        View::whole(&v),
        ViewMut::whole(&mut out),
        ViewMut::whole(&mut lse),
    )
    .unwrap();
    close(
        "out",
        &out,
        &[3.075_765_6, 5.075_765_6, 4.0, 6.0, -1.0, 5.0],
        1e-6,
    );
    close(
        "lse",
        &lse,
        &[1.313_261_7, std::f32::consts::LN_2, 2.0],
        1e-6,
    );

    // Token 2 is alone in its segment: p = 1, so dv_2 = dout_2, dq_2 = dk_2 = 0.
    let dout = vec![0.5f32, -1.0, 0.25, 2.0, 3.0, -4.0];
    let (mut dq, mut dk, mut dv) = (vec![9.0f32; 6], vec![9.0f32; 6], vec![9.0f32; 6]);
    be.segment_attention_backward(
        dims,
        &cu,
        View::whole(&q),
        View::whole(&k),
        View::whole(&v),
        View::whole(&out),
        View::whole(&lse),
        View::whole(&dout),
        ViewMut::whole(&mut dq),
        ViewMut::whole(&mut dk),
        ViewMut::whole(&mut dv),
    )
    .unwrap();
    close("dv_2", &dv[4..], &[3.0, -4.0], 1e-6);
    close("dq_2", &dq[4..], &[0.0, 0.0], 1e-6);
    close("dk_2", &dk[4..], &[0.0, 0.0], 1e-6);
    // dv over segment {0, 1}: Σ_t p_ts·dout_t, and Σ_s dv_s = Σ_t dout_t (rows of p sum to 1).
    close("Σ dv", &[dv[0] + dv[2], dv[1] + dv[3]], &[0.75, 1.0], 1e-6);

    // cu_seqlens must hold segments + 1 offsets; the CPU checks their values too.
    for (bad_dims, bad_cu) in [
        (
            SegmentAttentionDims {
                segments: 2,
                ..dims
            },
            cu.clone(),
        ),
        (dims, vec![0u32, 2, 1, 3]),
        (dims, vec![0u32, 2, 2, 4]),
        (dims, vec![1u32, 2, 2, 3]),
    ] {
        let e = be
            .segment_attention(
                bad_dims,
                &bad_cu,
                View::whole(&q),
                View::whole(&k),
                View::whole(&v),
                ViewMut::whole(&mut out),
                ViewMut::whole(&mut lse),
            )
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.starts_with("segment_attention") && msg.contains("cu_seqlens"),
            "{msg}"
        );
    }
}

#[test]
fn scatter_rows_overwrites_named_rows_only() {
    let be = CpuBackend;
    let src = vec![1.0f32, 2.0, 3.0, 4.0];
    let mut dst = vec![9.0f32, 9.0, 8.0, 8.0, 7.0, 7.0, 6.0, 6.0, 5.0];
    be.scatter_rows(
        View::whole(&src),
        &vec![3u32, 1],
        4,
        2,
        ViewMut::new(&mut dst, 0, 8).unwrap(),
    )
    .unwrap();
    assert_eq!(dst, [9.0, 9.0, 3.0, 4.0, 7.0, 7.0, 1.0, 2.0, 5.0]);
    // The backward is the embedding gather with the same index.
    let mut back = vec![0.0f32; 4];
    be.embedding(
        &vec![3u32, 1],
        View::new(&dst, 0, 8).unwrap(),
        4,
        2,
        ViewMut::whole(&mut back),
    )
    .unwrap();
    assert_eq!(back, src);
    for index in [vec![4u32, 1], vec![2u32, 2]] {
        let e = be
            .scatter_rows(
                View::whole(&src),
                &index,
                4,
                2,
                ViewMut::new(&mut dst, 0, 8).unwrap(),
            )
            .unwrap_err();
        assert!(e.to_string().starts_with("scatter_rows"), "{e}");
    }
}
