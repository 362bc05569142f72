//! Argument checks and launch helpers every op of this crate shares: errors naming the
//! kernel and the argument, index conversions, optional pointer arguments.

use crate::error::{Error, Result};
use cudarc::driver::{LaunchArgs, PushKernelArg};

/// Grid cap of the grid-stride kernels (they loop over the rest).
pub(crate) const MAX_GRID: usize = 1 << 20;

/// An argument error of `kernel`.
pub(crate) fn bad(kernel: &'static str, message: String) -> Error {
    Error::BadArgument { kernel, message }
}

/// Errors unless `actual == expected`, naming the argument.
pub(crate) fn check_len(
    kernel: &'static str,
    what: &str,
    expected: usize,
    actual: usize,
) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(bad(
            kernel,
            format!("`{what}` has {actual} elements, expected {expected}"),
        ))
    }
}

/// `a · b`, or an error naming the shape when it overflows.
pub(crate) fn mul(kernel: &'static str, what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| bad(kernel, format!("{what} = {a} × {b} overflows")))
}

/// `n` as the kernels' 64-bit index type.
pub(crate) fn i64_of(kernel: &'static str, what: &str, n: usize) -> Result<i64> {
    i64::try_from(n).map_err(|_| bad(kernel, format!("{what} = {n} exceeds 2^63 - 1")))
}

/// `n` as a kernel's `int` argument.
pub(crate) fn i32_of(kernel: &'static str, what: &str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| bad(kernel, format!("{what} = {n} exceeds 2^31 - 1")))
}

/// Blocks for `units` units of work, at least 1, at most [`MAX_GRID`] (kernels loop).
pub(crate) fn grid(units: usize) -> u32 {
    units.clamp(1, MAX_GRID) as u32
}

/// A device null pointer: the value of an absent optional pointer argument.
pub(crate) const NULL: u64 = 0;

/// Pushing an optional pointer argument onto a kernel launch.
pub(crate) trait ArgOrNull {
    /// Pushes `arg`, or a null pointer for `None` (the kernels test the pointer).
    fn arg_or_null<A>(&mut self, arg: Option<A>) -> &mut Self
    where
        Self: PushKernelArg<A>;
}

impl ArgOrNull for LaunchArgs<'_> {
    fn arg_or_null<A>(&mut self, arg: Option<A>) -> &mut Self
    where
        Self: PushKernelArg<A>,
    {
        match arg {
            Some(a) => self.arg(a),
            None => PushKernelArg::<&u64>::arg(self, &NULL),
        }
    }
}
