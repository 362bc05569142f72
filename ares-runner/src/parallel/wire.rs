//! The bytes ranks exchange: little-endian integers and floats (bit patterns, so a value
//! arrives as the same bits, NaN payloads and −0 included) and length-prefixed byte strings.

/// A message that does not parse (a bug or a corrupted transport).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed collective message: {0}")]
pub struct WireError(pub String);

impl WireError {
    /// As a [`super::CollectiveError`] seen by `rank`.
    pub fn at(self, rank: usize) -> super::CollectiveError {
        super::CollectiveError::Transport {
            rank,
            what: self.to_string(),
        }
    }
}

/// Values a block of [`Writer::values`] holds (the last may hold fewer).
pub const BLOCK: usize = 2048;
/// A block of [`Writer::values`] in f32 bits.
const F32_BLOCK: u8 = 0;
/// A block of [`Writer::values`] in bf16 bits (each value's upper half).
const BF16_BLOCK: u8 = 1;

/// Builds a message.
#[derive(Debug, Default)]
pub struct Writer(Vec<u8>);

impl Writer {
    /// One byte.
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }

    /// A `u64`.
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// An `f64`'s bits.
    pub fn f64(&mut self, v: f64) {
        self.u64(v.to_bits());
    }

    /// A length-prefixed byte string.
    pub fn bytes(&mut self, v: &[u8]) {
        self.u64(v.len() as u64);
        self.0.extend_from_slice(v);
    }

    /// A length-prefixed run of `f32` bit patterns.
    pub fn f32s(&mut self, v: &[f32]) {
        self.u64(v.len() as u64);
        self.0.reserve(v.len() * 4);
        for x in v {
            self.0.extend_from_slice(&x.to_bits().to_le_bytes());
        }
    }

    /// A length-prefixed run of `f32` values, in blocks of [`BLOCK`]: a block whose every
    /// value is a bf16 value exactly (its low 16 bits zero — gradients stored in bf16,
    /// widened) travels as those values' upper halves, 2 bytes each, any other as 4; the
    /// reader gets the same bits either way ([`Reader::values`]).
    pub fn values(&mut self, v: &[f32]) {
        self.u64(v.len() as u64);
        self.0.reserve(v.len() * 4);
        for block in v.chunks(BLOCK) {
            if block.iter().all(|x| x.to_bits() & 0xffff == 0) {
                self.0.push(BF16_BLOCK);
                for x in block {
                    self.0
                        .extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes());
                }
            } else {
                self.0.push(F32_BLOCK);
                for x in block {
                    self.0.extend_from_slice(&x.to_bits().to_le_bytes());
                }
            }
        }
    }

    /// A length-prefixed run of `u32`s.
    pub fn u32s(&mut self, v: &[u32]) {
        self.u64(v.len() as u64);
        self.0.reserve(v.len() * 4);
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }

    /// The message.
    pub fn finish(self) -> Vec<u8> {
        self.0
    }
}

/// Reads a message in the order it was written.
#[derive(Debug)]
pub struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.rest.len() < n {
            return Err(WireError(format!(
                "{n} bytes wanted, {} left",
                self.rest.len()
            )));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    /// One byte.
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    /// A `u64`.
    pub fn u64(&mut self) -> Result<u64, WireError> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    /// An `f64`.
    pub fn f64(&mut self) -> Result<f64, WireError> {
        Ok(f64::from_bits(self.u64()?))
    }

    fn len(&mut self, item: usize) -> Result<usize, WireError> {
        let n = self.u64()?;
        usize::try_from(n)
            .ok()
            .filter(|n| n.checked_mul(item).is_some_and(|b| b <= self.rest.len()))
            .ok_or_else(|| {
                WireError(format!(
                    "a length of {n} with {} bytes left",
                    self.rest.len()
                ))
            })
    }

    /// A byte string.
    pub fn bytes(&mut self) -> Result<&'a [u8], WireError> {
        let n = self.len(1)?;
        self.take(n)
    }

    /// A run of `f32`s.
    pub fn f32s(&mut self) -> Result<Vec<f32>, WireError> {
        let n = self.len(4)?;
        Ok(self
            .take(n * 4)?
            .chunks_exact(4)
            .map(|c| f32::from_bits(u32::from_le_bytes(c.try_into().expect("4 bytes"))))
            .collect())
    }

    /// A run of exactly `len` values written by [`Writer::values`], not yet decoded (its
    /// blocks' tags and lengths checked).
    pub fn values(&mut self, len: usize) -> Result<Values<'a>, WireError> {
        let n = self.u64()?;
        if n != len as u64 {
            return Err(WireError(format!("{n} values, expected {len}")));
        }
        let mut blocks = Vec::with_capacity(len.div_ceil(BLOCK));
        let mut left = len;
        while left > 0 {
            let count = left.min(BLOCK);
            let block = match self.u8()? {
                F32_BLOCK => Block::F32(self.take(count * 4)?),
                BF16_BLOCK => Block::Bf16(self.take(count * 2)?),
                tag => return Err(WireError(format!("a block of values tagged {tag}"))),
            };
            blocks.push(block);
            left -= count;
        }
        Ok(Values(blocks))
    }

    /// A run of `u32`s.
    pub fn u32s(&mut self) -> Result<Vec<u32>, WireError> {
        let n = self.len(4)?;
        Ok(self
            .take(n * 4)?
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }

    /// Fails unless the whole message was read.
    pub fn end(&self) -> Result<(), WireError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(WireError(format!("{} bytes left over", self.rest.len())))
        }
    }
}

/// One block of [`Values`], as it travelled.
#[derive(Debug, Clone, Copy)]
enum Block<'a> {
    F32(&'a [u8]),
    Bf16(&'a [u8]),
}

/// Values written by [`Writer::values`], still in their blocks' bytes.
#[derive(Debug, Clone)]
pub struct Values<'a>(Vec<Block<'a>>);

impl Values<'_> {
    fn iter(&self) -> impl Iterator<Item = f32> + '_ {
        self.0.iter().flat_map(|b| {
            let (bytes, size) = match *b {
                Block::F32(bytes) => (bytes, 4),
                Block::Bf16(bytes) => (bytes, 2),
            };
            bytes.chunks_exact(size).map(move |c| match c {
                [a, b, c, d] => f32::from_bits(u32::from_le_bytes([*a, *b, *c, *d])),
                [a, b] => f32::from_bits(u32::from(u16::from_le_bytes([*a, *b])) << 16),
                _ => unreachable!("chunks of 4 or 2 bytes"),
            })
        })
    }

    /// The values, decoded.
    pub fn to_vec(&self) -> Vec<f32> {
        self.iter().collect()
    }

    /// `out[i] = v[i]`.
    pub fn write_to(&self, out: &mut [f32]) {
        for (o, v) in out.iter_mut().zip(self.iter()) {
            *o = v;
        }
    }

    /// `out[i] += v[i]`.
    pub fn add_to(&self, out: &mut [f32]) {
        for (o, v) in out.iter_mut().zip(self.iter()) {
            *o += v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_as_bits() {
        let mut w = Writer::default();
        w.u8(7);
        w.u64(u64::MAX);
        w.f64(-0.0);
        w.f32s(&[f32::NAN, -0.0, 1.5, f32::INFINITY]);
        w.u32s(&[0, u32::MAX]);
        w.bytes(b"ok");
        let m = w.finish();
        let mut r = Reader::new(&m);
        assert_eq!(r.u8().unwrap(), 7);
        assert_eq!(r.u64().unwrap(), u64::MAX);
        assert_eq!(r.f64().unwrap().to_bits(), (-0.0f64).to_bits());
        let f: Vec<u32> = r.f32s().unwrap().iter().map(|x| x.to_bits()).collect();
        let want: Vec<u32> = [f32::NAN, -0.0, 1.5, f32::INFINITY]
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(f, want);
        assert_eq!(r.u32s().unwrap(), vec![0, u32::MAX]);
        assert_eq!(r.bytes().unwrap(), b"ok");
        r.end().unwrap();
    }

    /// Blocks of bf16 values travel at 2 bytes a value, any other at 4, and every value
    /// comes back with its bits (NaN, −0, infinities, subnormals; a short last block).
    #[test]
    fn values_travel_as_bf16_where_they_are_and_keep_their_bits() {
        let n = 2 * BLOCK + 7;
        // block 0 bf16 values (widened), block 1 one f32 value among them, the tail bf16
        let mut v: Vec<f32> = (0..n)
            .map(|i| f32::from_bits(((i as u32).wrapping_mul(2_654_435_761) >> 16) << 16))
            .collect();
        v[1] = f32::NAN;
        v[2] = -0.0;
        v[3] = f32::NEG_INFINITY;
        v[4] = f32::from_bits(0x0001_0000); // a subnormal bf16
        v[BLOCK + 5] = 1.0 + f32::EPSILON;
        let mut w = Writer::default();
        w.values(&v);
        let m = w.finish();
        assert_eq!(m.len(), 8 + 3 + 2 * BLOCK + 4 * BLOCK + 2 * 7);
        let mut r = Reader::new(&m);
        let got = r.values(n).unwrap().to_vec();
        r.end().unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&v));
        let mut sum = vec![0.5f32; n];
        Reader::new(&m).values(n).unwrap().add_to(&mut sum);
        assert_eq!(sum[BLOCK + 5], 0.5 + (1.0 + f32::EPSILON));
        // a wrong length, a truncated block, a bad tag
        assert!(Reader::new(&m).values(n - 1).is_err());
        assert!(Reader::new(&m[..m.len() - 1]).values(n).is_err());
        let mut bad = m.clone();
        bad[8] = 9;
        let e = Reader::new(&bad).values(n).unwrap_err();
        assert!(e.to_string().contains("tagged 9"), "{e}");
        let mut empty = Writer::default();
        empty.values(&[]);
        assert!(
            Reader::new(&empty.finish())
                .values(0)
                .unwrap()
                .to_vec()
                .is_empty()
        );
    }

    #[test]
    fn truncated_and_oversized_messages_are_errors() {
        let mut w = Writer::default();
        w.f32s(&[1.0, 2.0]);
        let m = w.finish();
        assert!(Reader::new(&m[..m.len() - 1]).f32s().is_err());
        let mut huge = Writer::default();
        huge.u64(u64::MAX);
        assert!(Reader::new(&huge.finish()).bytes().is_err());
        let mut extra = m.clone();
        extra.push(0);
        let mut r = Reader::new(&extra);
        r.f32s().unwrap();
        assert!(r.end().is_err());
    }
}
