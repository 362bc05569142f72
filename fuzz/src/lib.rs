//! Turns the fuzzer's bytes into the arguments of `ares-core` functions: sizes, flags,
//! parameters and slices, biased toward the values that break numeric code (0, ±1, huge,
//! tiny, NaN, ±∞) while still reaching ordinary values.

/// A cursor over fuzzer bytes. Once the bytes run out every read returns zeros, so a
/// target never has to handle "not enough input".
pub struct Bytes<'a> {
    data: &'a [u8],
}

impl<'a> Bytes<'a> {
    /// Reads from `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Bytes { data }
    }

    /// One byte (0 when exhausted).
    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    /// A little-endian `u32`.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// A size in `0..=max`.
    pub fn size(&mut self, max: usize) -> usize {
        if max == 0 { 0 } else { self.u8() as usize % (max + 1) }
    }

    /// A flag.
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// An `f64` drawn mostly from small "interesting" values, sometimes from raw bits.
    pub fn f64(&mut self) -> f64 {
        const SPECIAL: [f64; 16] = [
            0.0, 1.0, -1.0, 0.5, 2.0, -0.5, 1e-9, -1e-9, 1e9, -1e9, 1e300, f64::NAN,
            f64::INFINITY, f64::NEG_INFINITY, f64::MIN_POSITIVE, 3.0,
        ];
        let tag = self.u8();
        match tag % 4 {
            0 => SPECIAL[(tag >> 4) as usize],
            1 => f64::from(f32::from_bits(self.u32())),
            // small integers and simple fractions: the values rewards and counts take
            2 => f64::from(self.u8() as i8) / 4.0,
            _ => f64::from(self.u8()) / 255.0,
        }
    }

    /// An `f32` from [`Bytes::f64`].
    pub fn f32(&mut self) -> f32 {
        self.f64() as f32
    }

    /// A 0/1 mask value, occasionally something else to exercise validation.
    pub fn mask_value(&mut self) -> f64 {
        match self.u8() % 16 {
            0 => 0.5,
            1..=4 => 0.0,
            _ => 1.0,
        }
    }

    /// Fills `out` with [`Bytes::f64`] values.
    pub fn fill_f64(&mut self, out: &mut [f64]) {
        for x in out {
            *x = self.f64();
        }
    }

    /// Fills `out` with mask values.
    pub fn fill_mask(&mut self, out: &mut [f64]) {
        for x in out {
            *x = self.mask_value();
        }
    }
}

/// The inputs of a ragged [`ares_core::Groups`] layout drawn from fuzzer bytes: a uid per
/// row from a few values (so groups of one and of many occur), offsets that are sometimes
/// invalid (repeats, a wrong total), and scratch that is sometimes too short.
pub struct Ragged {
    uids: Vec<u64>,
    offsets: Vec<usize>,
    scratch: Vec<usize>,
}

impl Ragged {
    /// Draws the inputs for a batch of `batch` rows.
    pub fn new(b: &mut Bytes, batch: usize) -> Self {
        let uids = (0..batch).map(|_| u64::from(b.u8() % 5)).collect();
        let mut offsets = vec![0];
        let mut at = 0;
        while at < batch {
            at = (at + b.size(4)).min(batch + usize::from(b.u8() % 32 == 0));
            offsets.push(at);
            if b.u8() % 64 == 0 {
                break;
            }
        }
        let needed = 2 * batch + 1;
        let scratch = vec![0; if b.u8() % 16 == 0 { b.size(needed) } else { needed }];
        Ragged {
            uids,
            offsets,
            scratch,
        }
    }

    /// The layout by uid (`by_uid`) or by offsets.
    pub fn groups(&mut self, by_uid: bool) -> ares_core::Result<ares_core::Groups<'_>> {
        if by_uid {
            ares_core::Groups::by_uid(&self.uids, &mut self.scratch)
        } else {
            ares_core::Groups::from_offsets(&self.offsets)
        }
    }
}
