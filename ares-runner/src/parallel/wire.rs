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

    /// A run of exactly `len` `f32`s, not yet decoded.
    pub fn f32_slice(&mut self, len: usize) -> Result<F32Bytes<'a>, WireError> {
        let n = self.len(4)?;
        if n != len {
            return Err(WireError(format!("{n} values, expected {len}")));
        }
        Ok(F32Bytes(self.take(n * 4)?))
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

/// `f32` values still in their little-endian bytes.
#[derive(Debug, Clone, Copy)]
pub struct F32Bytes<'a>(&'a [u8]);

impl F32Bytes<'_> {
    fn values(self) -> impl Iterator<Item = f32> {
        self.0
            .chunks_exact(4)
            .map(|c| f32::from_bits(u32::from_le_bytes(c.try_into().expect("4 bytes"))))
    }

    /// `out[i] = v[i]`.
    pub fn write_to(self, out: &mut [f32]) {
        for (o, v) in out.iter_mut().zip(self.values()) {
            *o = v;
        }
    }

    /// `out[i] += v[i]`.
    pub fn add_to(self, out: &mut [f32]) {
        for (o, v) in out.iter_mut().zip(self.values()) {
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

    #[test]
    fn truncated_and_oversized_messages_are_errors() {
        let mut w = Writer::default();
        w.f32s(&[1.0, 2.0]);
        let m = w.finish();
        assert!(Reader::new(&m[..m.len() - 1]).f32s().is_err());
        let mut huge = Writer::default();
        huge.u64(u64::MAX);
        assert!(Reader::new(&huge.finish()).bytes().is_err());
        let mut r = Reader::new(&m);
        assert!(r.f32_slice(3).is_err());
        let mut extra = m.clone();
        extra.push(0);
        let mut r = Reader::new(&extra);
        r.f32s().unwrap();
        assert!(r.end().is_err());
    }
}
