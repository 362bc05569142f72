//! The 8-bit moments' quantiser against bitsandbytes' own (fixture made by
//! `scripts/make_int8_state_fixtures.py`): the block-wise codes and scales bit for bit on
//! bitsandbytes' maps, and our maps equal to its maps up to a few f32 ulps (bitsandbytes builds
//! them with `torch.linspace`, whose vectorised CPU loop rounds some points one ulp apart
//! from the scalar formula, by the machine's vector width; ours is the scalar formula, the
//! same on every machine).

use ares_cpu::ops::optim_int8::{BLOCK, Codebook, blocks, dynamic_map};
use safetensors::SafeTensors;

fn fixture() -> Vec<u8> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/int8_blockwise_bnb.safetensors"
    );
    std::fs::read(path).expect("fixture")
}

fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).expect(name);
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn dynamic_maps_are_bitsandbytes_maps() {
    let bytes = fixture();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for (signed, name) in [(true, "map_signed"), (false, "map_unsigned")] {
        let want = f32s(&st, name);
        let got = dynamic_map(signed);
        assert_eq!(want.len(), got.len());
        let mut exact = 0;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let ulps = (g.to_bits() as i64 - w.to_bits() as i64).abs();
            assert!(
                ulps <= 4 && g.signum() == w.signum(),
                "{name}[{i}]: {g} vs {w}"
            );
            exact += usize::from(ulps == 0);
        }
        eprintln!("{name}: {exact} of 256 bit-equal");
        assert!(exact >= 200, "{name}: only {exact} of 256 bit-equal");
    }
}

#[test]
fn blockwise_codes_and_scales_are_bitsandbytes() {
    let bytes = fixture();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for kind in ["signed", "unsigned"] {
        let x = f32s(&st, &format!("x_{kind}"));
        let want_codes = st.tensor(&format!("codes_{kind}")).unwrap().data().to_vec();
        let want_absmax = f32s(&st, &format!("absmax_{kind}"));
        assert!(
            x.len() > 2 * BLOCK && !x.len().is_multiple_of(BLOCK),
            "full blocks and a partial one"
        );
        let map: [f32; 256] = f32s(&st, &format!("map_{kind}")).try_into().unwrap();
        let book = Codebook::new(&map);
        let mut codes = vec![0u8; x.len()];
        let mut absmax = vec![0.0f32; blocks(x.len())];
        book.quantize(&x, &mut codes, &mut absmax).unwrap();
        assert_eq!(absmax, want_absmax, "{kind}");
        let diff: Vec<usize> = (0..x.len())
            .filter(|&i| codes[i] != want_codes[i])
            .collect();
        assert!(
            diff.is_empty(),
            "{kind}: {} codes differ, first at {:?}",
            diff.len(),
            diff.first()
        );
    }
}
