//! Views: a window `[offset, offset + len)` of elements of one backend buffer, so a single
//! allocation (an arena) can hold many tensors. Views are checked against their buffer's
//! length when made, so a backend can index with them without checking again.

use super::BackendError;

/// The element type of a device tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32: activations, gradients, optimizer states, weights by default.
    F32,
    /// bfloat16 (the top 16 bits of an f32): decode weights in `bf16`, checkpoints.
    Bf16,
    /// IEEE binary16, as some checkpoints store weights.
    F16,
    /// Unsigned 32-bit integers: token ids, positions, row indices, block tables.
    U32,
    /// Bytes: 8-bit codes (AdamW moments in `int8`, `ares_cpu::ops::optim_int8`).
    U8,
}

impl DType {
    /// Whether the dtype is a 16-bit float (the storage of [`Backend::Half`]).
    ///
    /// [`Backend::Half`]: super::Backend::Half
    pub const fn is_half(self) -> bool {
        matches!(self, Self::Bf16 | Self::F16)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::U32 => "u32",
            Self::U8 => "u8",
        })
    }
}

/// A backend allocation of `len()` elements of [`DeviceBuffer::dtype`]. Its storage is
/// opaque: the host reaches it only through [`Backend::upload`](super::Backend::upload)
/// and [`Backend::download`](super::Backend::download).
pub trait DeviceBuffer {
    /// Number of elements.
    fn len(&self) -> usize;

    /// The element type.
    fn dtype(&self) -> DType;

    /// Whether the buffer holds no element.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer as its concrete type, for code that works on one backend's buffers
    /// directly (a device-side collective); `None` for a backend that offers none.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }

    /// [`DeviceBuffer::as_any_mut`], read-only.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}

/// Checks that `[offset, offset + len)` lies in a buffer of `buffer_len` elements.
fn check_bounds(offset: usize, len: usize, buffer_len: usize) -> Result<(), BackendError> {
    match offset.checked_add(len) {
        Some(end) if end <= buffer_len => Ok(()),
        _ => Err(BackendError::ViewOutOfBounds {
            offset,
            len,
            buffer_len,
        }),
    }
}

/// The first element of item `index` of `len` elements (`index · len`), or the error of a
/// view past any buffer (of `buffer_len` elements) when that overflows.
fn item_offset(index: usize, len: usize, buffer_len: usize) -> Result<usize, BackendError> {
    index.checked_mul(len).ok_or(BackendError::ViewOutOfBounds {
        offset: usize::MAX,
        len,
        buffer_len,
    })
}

/// A read-only view of `len` elements of `buffer` starting at `offset`.
#[derive(Debug)]
pub struct View<'a, T: ?Sized> {
    buffer: &'a T,
    offset: usize,
    len: usize,
}

impl<T: ?Sized> Clone for View<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: ?Sized> Copy for View<'_, T> {}

impl<'a, T: DeviceBuffer + ?Sized> View<'a, T> {
    /// The elements `[offset, offset + len)` of `buffer`.
    ///
    /// # Errors
    /// [`BackendError::ViewOutOfBounds`] if they do not all lie in `buffer`.
    pub fn new(buffer: &'a T, offset: usize, len: usize) -> Result<Self, BackendError> {
        check_bounds(offset, len, buffer.len())?;
        Ok(Self {
            buffer,
            offset,
            len,
        })
    }

    /// The whole of `buffer`.
    pub fn whole(buffer: &'a T) -> Self {
        Self {
            buffer,
            offset: 0,
            len: buffer.len(),
        }
    }

    /// Item `index` of `buffer` seen as consecutive items of `len` elements (layer `index`
    /// of a `[layers, len]` stack).
    ///
    /// # Errors
    /// [`BackendError::ViewOutOfBounds`] if the item does not lie in `buffer`.
    pub fn item(buffer: &'a T, index: usize, len: usize) -> Result<Self, BackendError> {
        Self::new(buffer, item_offset(index, len, buffer.len())?, len)
    }
}

impl<'a, T: ?Sized> View<'a, T> {
    /// The buffer viewed.
    pub fn buffer(&self) -> &'a T {
        self.buffer
    }

    /// First element of the view in the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of elements in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements `[start, start + len)` of this view.
    ///
    /// # Errors
    /// [`BackendError::ViewOutOfBounds`] if they do not all lie in the view.
    pub fn slice(&self, start: usize, len: usize) -> Result<Self, BackendError> {
        check_bounds(start, len, self.len)?;
        Ok(Self {
            buffer: self.buffer,
            offset: self.offset + start,
            len,
        })
    }
}

/// A writable view of `len` elements of `buffer` starting at `offset`.
#[derive(Debug)]
pub struct ViewMut<'a, T: ?Sized> {
    buffer: &'a mut T,
    offset: usize,
    len: usize,
}

impl<'a, T: DeviceBuffer + ?Sized> ViewMut<'a, T> {
    /// The elements `[offset, offset + len)` of `buffer`.
    ///
    /// # Errors
    /// [`BackendError::ViewOutOfBounds`] if they do not all lie in `buffer`.
    pub fn new(buffer: &'a mut T, offset: usize, len: usize) -> Result<Self, BackendError> {
        check_bounds(offset, len, buffer.len())?;
        Ok(Self {
            buffer,
            offset,
            len,
        })
    }

    /// The whole of `buffer`.
    pub fn whole(buffer: &'a mut T) -> Self {
        let len = buffer.len();
        Self {
            buffer,
            offset: 0,
            len,
        }
    }

    /// Item `index` of `buffer` seen as consecutive items of `len` elements (layer `index`
    /// of a `[layers, len]` stack).
    ///
    /// # Errors
    /// [`BackendError::ViewOutOfBounds`] if the item does not lie in `buffer`.
    pub fn item(buffer: &'a mut T, index: usize, len: usize) -> Result<Self, BackendError> {
        let offset = item_offset(index, len, buffer.len())?;
        Self::new(buffer, offset, len)
    }
}

impl<'a, T: ?Sized> ViewMut<'a, T> {
    /// The buffer viewed, for writing (a backend then writes `[offset, offset + len)` only).
    pub fn into_buffer(self) -> &'a mut T {
        self.buffer
    }

    /// First element of the view in the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of elements in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements `[start, start + len)` of this view, writable while this borrow lasts.
    ///
    /// # Errors
    /// [`BackendError::ViewOutOfBounds`] if they do not all lie in the view.
    pub fn slice_mut(&mut self, start: usize, len: usize) -> Result<ViewMut<'_, T>, BackendError> {
        check_bounds(start, len, self.len)?;
        Ok(ViewMut {
            buffer: &mut *self.buffer,
            offset: self.offset + start,
            len,
        })
    }

    /// The same window, read-only (while this borrow lasts).
    pub fn as_view(&self) -> View<'_, T> {
        View {
            buffer: self.buffer,
            offset: self.offset,
            len: self.len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_are_checked_against_their_buffer() {
        let mut buf = vec![0.0f32; 10];
        assert_eq!(
            View::new(&buf, 4, 6).map(|v| (v.offset(), v.len())).ok(),
            Some((4, 6))
        );
        assert!(matches!(
            View::new(&buf, 5, 6),
            Err(BackendError::ViewOutOfBounds {
                offset: 5,
                len: 6,
                buffer_len: 10
            })
        ));
        assert!(View::new(&buf, usize::MAX, 2).is_err());
        assert_eq!(View::item(&buf, 4, 2).map(|v| v.offset()).ok(), Some(8));
        assert!(View::item(&buf, 5, 2).is_err());
        assert!(View::item(&buf, usize::MAX, 2).is_err());
        assert!(ViewMut::item(&mut buf, 2, 5).is_err());
        let v = ViewMut::item(&mut buf, 1, 5).map(|v| (v.offset(), v.as_view().len()));
        assert_eq!(v.ok(), Some((5, 5)));
        // slices are offsets within the view, checked against it
        let w = View::new(&buf, 2, 6).unwrap();
        assert_eq!(
            w.slice(1, 5).map(|v| (v.offset(), v.len())).ok(),
            Some((3, 5))
        );
        assert!(w.slice(2, 5).is_err());
        let mut m = ViewMut::new(&mut buf, 4, 4).unwrap();
        assert_eq!(m.slice_mut(3, 1).map(|v| v.offset()).ok(), Some(7));
        assert!(m.slice_mut(0, 5).is_err());
    }
}
