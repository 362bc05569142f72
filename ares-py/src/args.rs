//! Argument handling: numpy arrays in without copies, outputs allocated once, group layouts,
//! and ares-core errors as `ValueError`.

use ares_core::{Error, Float, Groups, Shape};
use numpy::{
    Element, PyArray, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
    PyReadwriteArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Runs `$body` with the type alias `$F` bound to the float type of `$dt` (a [`Dtype`]).
macro_rules! by_dtype {
    ($dt:expr, $F:ident => $body:expr) => {
        match $dt {
            $crate::args::Dtype::F32 => {
                type $F = f32;
                $body
            }
            $crate::args::Dtype::F64 => {
                type $F = f64;
                $body
            }
        }
    };
}
pub(crate) use by_dtype;

/// A float type ares-core computes in and numpy stores.
pub trait Real: Float + Element + Send + Sync {}
impl Real for f32 {}
impl Real for f64 {}

/// The two float dtypes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F64,
}

impl Dtype {
    fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "float32",
            Dtype::F64 => "float64",
        }
    }
}

/// A `ValueError` with `msg`.
pub fn value_error(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

/// An ares-core error as a `ValueError` prefixed by the Python function's name.
pub fn core_err(func: &str, e: Error) -> PyErr {
    value_error(format!("{func}: {e}"))
}

fn untyped<'a, 'py>(
    func: &str,
    name: &str,
    obj: &'a Bound<'py, PyAny>,
) -> PyResult<&'a Bound<'py, PyUntypedArray>> {
    obj.cast::<PyUntypedArray>().map_err(|_| {
        let ty = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into());
        value_error(format!(
            "{func}: `{name}` must be a numpy array (float32 or float64), got {ty}"
        ))
    })
}

/// The float dtype of `obj`, which must be a float32 or float64 numpy array.
pub fn float_dtype(func: &str, name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Dtype> {
    let py = obj.py();
    let arr = untyped(func, name, obj)?;
    let dt = arr.dtype();
    if dt.is_equiv_to(&numpy::dtype::<f64>(py)) {
        Ok(Dtype::F64)
    } else if dt.is_equiv_to(&numpy::dtype::<f32>(py)) {
        Ok(Dtype::F32)
    } else {
        Err(value_error(format!(
            "{func}: `{name}` must have dtype float32 or float64, got {dt}"
        )))
    }
}

/// Borrows `obj` (already known to be an array `arr` of element type `T`) in place after
/// checking it has `ndim` dimensions and is C-contiguous: the checks every input shares.
fn borrow_in_place<'py, T: Element>(
    func: &str,
    name: &str,
    obj: &Bound<'py, PyAny>,
    arr: &Bound<'py, PyUntypedArray>,
    ndim: usize,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    if arr.ndim() != ndim {
        return Err(value_error(format!(
            "{func}: `{name}` must have {ndim} dimension{}, got shape {:?}",
            if ndim == 1 { "" } else { "s" },
            arr.shape()
        )));
    }
    if !arr.is_c_contiguous() {
        return Err(value_error(format!(
            "{func}: `{name}` is not C-contiguous (inputs are read in place, not copied); \
             pass np.ascontiguousarray({name})"
        )));
    }
    obj.cast::<PyArrayDyn<T>>()
        .map_err(|e| value_error(format!("{func}: `{name}`: {e}")))?
        .try_readonly()
        .map_err(|e| value_error(format!("{func}: `{name}`: {e}")))
}

/// A float input read in place: `ndim` dimensions, the dtype `F` of the call, C-contiguous.
pub struct Input<'py, F: Real> {
    array: PyReadonlyArrayDyn<'py, F>,
}

impl<'py, F: Real> Input<'py, F> {
    /// Checks and borrows `obj` (an error names `name` and says what is wrong).
    pub fn new(func: &str, name: &str, obj: &Bound<'py, PyAny>, ndim: usize) -> PyResult<Self> {
        let arr = untyped(func, name, obj)?;
        let dtype = float_dtype(func, name, obj)?;
        let want = if numpy::dtype::<F>(obj.py()).is_equiv_to(&numpy::dtype::<f64>(obj.py())) {
            Dtype::F64
        } else {
            Dtype::F32
        };
        if dtype != want {
            return Err(value_error(format!(
                "{func}: `{name}` has dtype {}, expected {} (the dtype of the first float argument; \
                 arrays are not converted)",
                dtype.name(),
                want.name()
            )));
        }
        let array = borrow_in_place(func, name, obj, arr, ndim)?;
        Ok(Input { array })
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.array.shape()
    }

    /// The elements, row-major, without a copy.
    pub fn slice(&self) -> &[F] {
        // C-contiguity was checked in `new`
        self.array.as_slice().unwrap_or(&[])
    }
}

/// An optional input (`None` stays `None`).
#[allow(dead_code)]
pub fn opt_input<'py, F: Real>(
    func: &str,
    name: &str,
    obj: Option<&Bound<'py, PyAny>>,
    ndim: usize,
) -> PyResult<Option<Input<'py, F>>> {
    obj.map(|o| Input::new(func, name, o, ndim)).transpose()
}

/// A `[rows, cols]` token input whose rows must equal `rows`.
pub fn token_input<'py, F: Real>(
    func: &str,
    name: &str,
    obj: &Bound<'py, PyAny>,
    shape: Option<Shape>,
) -> PyResult<(Input<'py, F>, Shape)> {
    let input = Input::new(func, name, obj, 2)?;
    let s = input.shape();
    let got = Shape::new(s[0], s[1]);
    if let Some(want) = shape
        && want != got
    {
        return Err(value_error(format!(
            "{func}: `{name}` has shape ({}, {}), expected ({}, {})",
            got.rows, got.cols, want.rows, want.cols
        )));
    }
    Ok((input, got))
}

/// A zero-filled output allocated by numpy (it owns its data: `base is None`).
pub struct Output<'py, F: Real> {
    pub array: Bound<'py, PyArrayDyn<F>>,
}

impl<'py, F: Real> Output<'py, F> {
    /// A new output of `dims`.
    pub fn new(py: Python<'py>, dims: &[usize]) -> Self {
        Output {
            array: PyArray::zeros(py, dims, false),
        }
    }

    /// Exclusive write access to its elements (the array was just created, so no other
    /// borrow exists).
    pub fn write(&self) -> PyResult<PyReadwriteArrayDyn<'py, F>> {
        self.array
            .try_readwrite()
            .map_err(|e| value_error(format!("output: {e}")))
    }
}

/// `x` as `F` (f64 → f32 rounds).
pub fn cast<F: Real>(x: f64) -> F {
    F::from(x).unwrap_or_else(F::nan)
}

/// `x` as `f64`.
pub fn f64_of<F: Real>(x: F) -> f64 {
    x.to_f64().unwrap_or(f64::NAN)
}

/// How the rows form groups, as the caller gave it.
pub enum GroupSpec<'py> {
    /// Consecutive groups of `n`.
    N(usize),
    /// One key per row; `obj` is the caller's uid sequence (for error messages).
    Uid {
        keys: Vec<u64>,
        obj: Bound<'py, PyAny>,
    },
}

impl<'py> GroupSpec<'py> {
    /// Reads `n=` / `uid=` (exactly one) for a batch of `batch` rows.
    pub fn new(
        func: &str,
        n: Option<i64>,
        uid: Option<&Bound<'py, PyAny>>,
        batch: usize,
    ) -> PyResult<Self> {
        match (n, uid) {
            (Some(_), Some(_)) => Err(value_error(format!(
                "{func}: give the groups by `n` or by `uid`, not both"
            ))),
            (None, None) => Err(value_error(format!(
                "{func}: the groups are missing: give `n` (consecutive groups of n rows) or \
                 `uid` (one key per row)"
            ))),
            (Some(n), None) => {
                let n = usize::try_from(n).map_err(|_| {
                    value_error(format!("{func}: `n` = {n} is out of range: expected >= 1"))
                })?;
                Ok(GroupSpec::N(n))
            }
            (None, Some(obj)) => {
                let keys = uid_keys(func, obj)?;
                if keys.len() != batch {
                    return Err(value_error(format!(
                        "{func}: `uid` has {} elements, expected {batch} (one per row)",
                        keys.len()
                    )));
                }
                Ok(GroupSpec::Uid {
                    keys,
                    obj: obj.clone(),
                })
            }
        }
    }

    /// Runs `f` on the layout with the GIL released. Layout errors name `n` / `uid`; a
    /// group of one in a uid layout is reported with the caller's uid value.
    pub fn run<T: Send>(
        &self,
        py: Python<'_>,
        func: &str,
        batch: usize,
        f: impl FnOnce(&Groups<'_>) -> Result<T, Error> + Send,
    ) -> PyResult<T> {
        let keys = match self {
            GroupSpec::N(_) => None,
            GroupSpec::Uid { keys, .. } => Some(keys.as_slice()),
        };
        let n = match self {
            GroupSpec::N(n) => *n,
            GroupSpec::Uid { .. } => 0,
        };
        let result: Result<T, Fail> = py.detach(move || match keys {
            None => {
                let groups = Groups::contiguous(batch, n).map_err(Fail::Layout)?;
                f(&groups).map_err(|e| Fail::Core(e, None))
            }
            Some(keys) => {
                let mut scratch = vec![0usize; 2 * keys.len() + 1];
                let groups = Groups::by_uid(keys, &mut scratch).map_err(Fail::Layout)?;
                f(&groups).map_err(|e| {
                    let row = match e {
                        Error::RaggedGroupTooSmall { group, .. } => Some(groups.row(group, 0)),
                        _ => None,
                    };
                    Fail::Core(e, row)
                })
            }
        });
        result.map_err(|fail| match (fail, self) {
            (Fail::Layout(e), GroupSpec::N(n)) => {
                value_error(format!("{func}: `n` = {n} does not fit the batch: {e}"))
            }
            (Fail::Layout(e), GroupSpec::Uid { .. }) => value_error(format!("{func}: `uid`: {e}")),
            (
                Fail::Core(
                    Error::RaggedGroupTooSmall {
                        estimator,
                        group,
                        n,
                        ..
                    },
                    Some(row),
                ),
                GroupSpec::Uid { obj, .. },
            ) => {
                let shown = obj
                    .get_item(row)
                    .and_then(|v| v.repr())
                    .map(|r| r.to_string())
                    .unwrap_or_else(|_| "?".into());
                value_error(format!(
                    "{func}: advantage estimator `{estimator}` needs at least 2 samples per \
                     group; group {group} (uid {shown}, first at row {row}) has {n}"
                ))
            }
            (Fail::Core(e, _), _) => core_err(func, e),
        })
    }
}

enum Fail {
    Layout(Error),
    Core(Error, Option<usize>),
}

/// One `u64` key per row: integer arrays by value, anything else (strings, objects) by
/// equality, numbered in order of first appearance.
fn uid_keys(func: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let py = obj.py();
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Err(value_error(format!(
                "{func}: `uid` must have 1 dimension, got shape {:?}",
                arr.shape()
            )));
        }
        let kind = arr.dtype().kind();
        if matches!(kind, b'i' | b'u' | b'b') {
            // astype(int64) is injective on every integer dtype (uint64 wraps)
            let as_i64 = obj.call_method1("astype", ("int64",))?;
            let typed = as_i64
                .cast::<PyArrayDyn<i64>>()
                .map_err(|e| value_error(format!("{func}: `uid`: {e}")))?;
            let ro = typed.readonly();
            return Ok(ro.as_array().iter().map(|&v| v as u64).collect());
        }
    }
    let ids = PyDict::new(py);
    let mut keys = Vec::new();
    let iter = obj.try_iter().map_err(|_| {
        value_error(format!(
            "{func}: `uid` must be a 1-D array or sequence of hashable keys"
        ))
    })?;
    for item in iter {
        let item = item?;
        let id = match ids.get_item(&item) {
            Ok(Some(id)) => id.extract::<u64>()?,
            Ok(None) => {
                let id = ids.len() as u64;
                ids.set_item(&item, id).map_err(|e| {
                    value_error(format!("{func}: `uid` holds an unhashable key: {e}"))
                })?;
                id
            }
            Err(e) => {
                return Err(value_error(format!(
                    "{func}: `uid` holds an unhashable key: {e}"
                )));
            }
        };
        keys.push(id);
    }
    Ok(keys)
}

/// A 1-D numpy bool input read in place (C-contiguous, no copy).
pub struct BoolInput<'py> {
    array: PyReadonlyArrayDyn<'py, bool>,
}

impl<'py> BoolInput<'py> {
    /// Checks and borrows `obj`, a 1-D C-contiguous numpy array of dtype bool.
    pub fn new(func: &str, name: &str, obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        let arr = obj.cast::<PyUntypedArray>().map_err(|_| {
            let ty = obj
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into());
            value_error(format!(
                "{func}: `{name}` must be a numpy bool array, got {ty}"
            ))
        })?;
        let dt = arr.dtype();
        if !dt.is_equiv_to(&numpy::dtype::<bool>(obj.py())) {
            return Err(value_error(format!(
                "{func}: `{name}` must have dtype bool, got {dt} (pass {name} != 0 or \
                 {name}.astype(bool))"
            )));
        }
        let array = borrow_in_place(func, name, obj, arr, 1)?;
        Ok(BoolInput { array })
    }

    /// The elements, without a copy.
    pub fn slice(&self) -> &[bool] {
        self.array.as_slice().unwrap_or(&[])
    }
}
