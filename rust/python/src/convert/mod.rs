//! Python arguments into core types (and core results back, in `arrays`): every check of type and range a caller can get wrong,
//! with a message that names the argument. Numpy arrays of the natural dtype are borrowed,
//! not copied.

use numpy::{
    PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList, PyTuple};

use crate::errors::{type_error, value_error};

mod args;
mod arrays;
mod tensor_views;

pub use args::{
    BlockPairs, CacheSalt, Count, Dtype, LayerTypes, Nanos, Positions, Prompt, SeqId, SeqIds,
    TokenIds,
};
pub use arrays::{figures_to_dict, narrow_slots, pairs_to_array, to_2d};
pub use tensor_views::{cast, cast_mut, contiguous, contiguous_mut, readonly, writable};

const SEQ_ID_RANGE: &str = "an int in [0, 2**63)";

pub fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|name| name.to_string())
        .unwrap_or_else(|_| "?".into())
}

pub fn describe(obj: &Bound<'_, PyAny>) -> String {
    match obj.repr() {
        Ok(repr) => {
            let repr = repr.to_string();
            match repr.char_indices().nth(60) {
                Some((cut, _)) => format!("{}...", &repr[..cut]),
                None => repr,
            }
        }
        Err(_) => type_name(obj),
    }
}

/// A Python int (or numpy integer scalar) as i64; bools are not integers here.
fn exact_int(obj: &Bound<'_, PyAny>) -> Option<Result<i64, ()>> {
    if obj.is_instance_of::<PyBool>() {
        return None;
    }
    match obj.extract::<i64>() {
        Ok(value) => Some(Ok(value)),
        // An int too large for i64 is still an int: out of range, not the wrong type.
        Err(error) if error.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) => {
            Some(Err(()))
        }
        Err(_) => None,
    }
}

/// An int or numpy integer scalar (not a bool), whatever its value.
pub fn is_int(obj: &Bound<'_, PyAny>) -> bool {
    exact_int(obj).is_some()
}

/// A list, a tuple or a numpy array.
pub fn is_sequence_like(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() || as_array(obj).is_some()
}

pub fn seq_id(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    match exact_int(obj) {
        Some(Ok(value)) if value >= 0 => Ok(value as u64),
        _ => Err(type_error(format!(
            "{what} must be {SEQ_ID_RANGE}, got {}",
            describe(obj)
        ))),
    }
}

/// A real number: an int or a float (numpy's too), not a bool or a string.
pub fn number(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<f64> {
    let numeric = obj.is_instance_of::<pyo3::types::PyFloat>() || exact_int(obj).is_some();
    match obj.extract::<f64>() {
        Ok(value) if numeric || obj.hasattr("dtype").unwrap_or(false) => Ok(value),
        _ => Err(type_error(format!(
            "{what} must be a number, got {}",
            describe(obj)
        ))),
    }
}

/// A count argument: an int in `[minimum, i64::MAX]`.
pub fn count(obj: &Bound<'_, PyAny>, what: &str, minimum: i64) -> PyResult<usize> {
    match exact_int(obj) {
        Some(Ok(value)) if value >= minimum => Ok(value as usize),
        Some(Ok(_)) => Err(value_error(format!(
            "{what} must be at least {minimum}, got {}",
            describe(obj)
        ))),
        Some(Err(())) => Err(value_error(format!(
            "{what} is too large: {} is above 2**63 - 1",
            describe(obj)
        ))),
        None => Err(type_error(format!(
            "{what} must be an int, got {}",
            describe(obj)
        ))),
    }
}

fn as_array<'py>(obj: &Bound<'py, PyAny>) -> Option<Bound<'py, PyUntypedArray>> {
    obj.cast::<PyUntypedArray>().ok().cloned()
}

fn integer_kind(array: &Bound<'_, PyUntypedArray>, what: &str) -> PyResult<()> {
    let dtype = array.dtype();
    match dtype.kind() {
        b'i' | b'u' => Ok(()),
        _ => Err(type_error(format!(
            "{what} must be integers, got a {} array",
            describe(dtype.as_any())
        ))),
    }
}

/// Converts a numpy integer array of any dtype and layout to a 1-D contiguous array of `T`.
fn converted<'py>(array: &Bound<'py, PyUntypedArray>, dtype: &str) -> PyResult<Bound<'py, PyAny>> {
    let numpy = array.py().import("numpy")?;
    numpy.call_method1(
        "ascontiguousarray",
        (array.reshape_flat()?, numpy.getattr(dtype)?),
    )
}

trait ReshapeFlat<'py> {
    fn reshape_flat(&self) -> PyResult<Bound<'py, PyAny>>;
}

impl<'py> ReshapeFlat<'py> for Bound<'py, PyUntypedArray> {
    fn reshape_flat(&self) -> PyResult<Bound<'py, PyAny>> {
        self.call_method1("reshape", (-1,))
    }
}

/// Non-negative integers: a list's, copied, or a numpy array's of the signed or unsigned
/// dtype of the same width, borrowed without a copy.
pub enum Ints<'py, Signed: numpy::Element, Unsigned: numpy::Element> {
    Owned(Vec<Unsigned>),
    Signed(PyReadonlyArray1<'py, Signed>),
    Unsigned(PyReadonlyArray1<'py, Unsigned>),
}

impl<Signed: numpy::Element, Unsigned: numpy::Element> Ints<'_, Signed, Unsigned> {
    pub fn as_slice(&self) -> &[Unsigned] {
        const { assert!(std::mem::size_of::<Signed>() == std::mem::size_of::<Unsigned>()) };
        match self {
            Ints::Owned(values) => values,
            Ints::Signed(array) => {
                let values = array.as_slice().unwrap_or_default();
                // SAFETY: same size and alignment (checked above for size; both are primitive
                // integers); every value was checked non-negative and the array contiguous when
                // this was built, so the reinterpretation is exact.
                unsafe {
                    std::slice::from_raw_parts(values.as_ptr().cast::<Unsigned>(), values.len())
                }
            }
            Ints::Unsigned(array) => array.as_slice().unwrap_or_default(),
        }
    }
}

impl<'py, Signed, Unsigned> Ints<'py, Signed, Unsigned>
where
    Signed: numpy::Element + Copy,
    Unsigned: numpy::Element + Copy,
{
    /// A contiguous 1-D array of either dtype, borrowed without a copy: `Some(None)` when a
    /// value fails its range check, `None` when the array is of another dtype or layout.
    fn borrow(
        array: &Bound<'py, PyUntypedArray>,
        signed_ok: impl Fn(Signed) -> bool,
        unsigned_ok: impl Fn(Unsigned) -> bool,
    ) -> Option<Option<Self>> {
        if let Ok(signed) = array.cast::<numpy::PyArray1<Signed>>() {
            let readonly = signed.try_readonly().ok()?;
            if let Ok(values) = readonly.as_slice() {
                let valid = values.iter().all(|&value| signed_ok(value));
                return Some(valid.then_some(Ints::Signed(readonly)));
            }
        }
        if let Ok(unsigned) = array.cast::<numpy::PyArray1<Unsigned>>() {
            let readonly = unsigned.try_readonly().ok()?;
            if let Ok(values) = readonly.as_slice() {
                let valid = values.iter().all(|&value| unsigned_ok(value));
                return Some(valid.then_some(Ints::Unsigned(readonly)));
            }
        }
        None
    }
}

pub fn seq_ids<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Ints<'py, i64, u64>> {
    if let Some(array) = as_array(obj) {
        if array.ndim() != 1 {
            return Err(value_error(format!(
                "{what} must be 1-D, got shape {:?}",
                array.shape()
            )));
        }
        integer_kind(&array, what)?;
        let out_of_range = || type_error(format!("{what} must hold ints in [0, 2**63)"));
        if let Some(ids) = Ints::borrow(&array, |id: i64| id >= 0, |id: u64| id <= i64::MAX as u64)
        {
            return ids.ok_or_else(out_of_range);
        }
        let wide = converted(&array, "int64")?;
        let wide = wide.cast::<numpy::PyArray1<i64>>()?.try_readonly()?;
        let ids = wide.as_slice()?;
        if ids.iter().any(|&id| id < 0) {
            return Err(out_of_range());
        }
        return Ok(Ints::Owned(ids.iter().map(|&id| id as u64).collect()));
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return list
            .iter()
            .map(|item| seq_id(&item, what))
            .collect::<PyResult<_>>()
            .map(Ints::Owned);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return tuple
            .iter()
            .map(|item| seq_id(&item, what))
            .collect::<PyResult<_>>()
            .map(Ints::Owned);
    }
    Err(type_error(format!(
        "{what} must be a list of ints or a 1-D numpy integer array, got {}",
        type_name(obj)
    )))
}

fn token_id(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u32> {
    match exact_int(obj) {
        Some(Ok(value)) if (0..=u32::MAX as i64).contains(&value) => Ok(value as u32),
        Some(_) => Err(value_error(format!(
            "{what} must be in [0, 2**32), got {}",
            describe(obj)
        ))),
        None => Err(type_error(format!(
            "{what} must be ints, got {}",
            describe(obj)
        ))),
    }
}

/// `shape`, when given, is the array shape a 2-D input must have (it is then flattened).
pub fn token_ids<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    shape: Option<[usize; 2]>,
) -> PyResult<Ints<'py, i32, u32>> {
    let array = match as_array(obj) {
        Some(array) => array,
        None if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() => {
            let mut ids = Vec::with_capacity(obj.len()?);
            let mut nested = false;
            for item in obj.try_iter()? {
                let item = item?;
                if item.is_instance_of::<PyList>() || item.is_instance_of::<PyTuple>() {
                    nested = true;
                    break;
                }
                ids.push(token_id(&item, what)?);
            }
            if !nested {
                return Ok(Ints::Owned(ids));
            }
            // Nested lists: let numpy build the array, then check it like any other.
            let array = obj.py().import("numpy")?.call_method1("asarray", (obj,))?;
            array.cast_into::<PyUntypedArray>()?
        }
        None => {
            return Err(type_error(format!(
                "{what} must be a list of ints or a numpy integer array, got {}",
                type_name(obj)
            )))
        }
    };
    let dims = array.shape().to_vec();
    match (dims.len(), shape) {
        (1, _) => {}
        (2, Some([rows, columns])) if dims == [rows, columns] => {}
        (_, Some([rows, columns])) => {
            return Err(value_error(format!(
                "{what} must have shape ({rows}, {columns}) or ({},), got {dims:?}",
                rows.saturating_mul(columns)
            )))
        }
        (_, None) => {
            return Err(value_error(format!(
                "{what} must be 1-D, got shape {dims:?}"
            )))
        }
    }
    integer_kind(&array, what)?;
    let out_of_range = || value_error(format!("{what} must be in [0, 2**32)"));
    if dims.len() == 1 {
        if let Some(ids) = Ints::borrow(&array, |id: i32| id >= 0, |_: u32| true) {
            return ids.ok_or_else(out_of_range);
        }
    }
    // Other integer dtypes, non-contiguous or 2-D arrays: widen, check, narrow.
    if array.dtype().kind() == b'u' && array.dtype().itemsize() == 8 {
        let wide = converted(&array, "uint64")?;
        let wide = wide.cast::<numpy::PyArray1<u64>>()?.try_readonly()?;
        let ids = wide.as_slice()?;
        if ids.iter().any(|&id| id > u32::MAX as u64) {
            return Err(out_of_range());
        }
        return Ok(Ints::Owned(ids.iter().map(|&id| id as u32).collect()));
    }
    let wide = converted(&array, "int64")?;
    let wide = wide.cast::<numpy::PyArray1<i64>>()?.try_readonly()?;
    let ids = wide.as_slice()?;
    if ids.iter().any(|&id| !(0..=u32::MAX as i64).contains(&id)) {
        return Err(out_of_range());
    }
    Ok(Ints::Owned(ids.iter().map(|&id| id as u32).collect()))
}

/// Token positions (`starts`/`ends`): a list of ints or a 1-D numpy integer array.
pub fn positions(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i64>> {
    if let Some(array) = as_array(obj) {
        if array.dtype().kind() == b'u' && array.dtype().itemsize() == 8 {
            let wide = converted(&array, "uint64")?;
            let wide = wide.cast::<numpy::PyArray1<u64>>()?.try_readonly()?;
            return wide
                .as_slice()?
                .iter()
                .map(|&value| {
                    i64::try_from(value)
                        .map_err(|_| value_error(format!("{what} out of range: {value}")))
                })
                .collect();
        }
        if array.ndim() != 1 {
            return Err(value_error(format!(
                "{what} must be 1-D, got shape {:?}",
                array.shape()
            )));
        }
        integer_kind(&array, what)?;
        let wide = converted(&array, "int64")?;
        let wide = wide.cast::<numpy::PyArray1<i64>>()?.try_readonly()?;
        return Ok(wide.as_slice()?.to_vec());
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        return obj
            .try_iter()?
            .map(|item| {
                let item = item?;
                match exact_int(&item) {
                    Some(Ok(value)) => Ok(value),
                    Some(Err(())) => Err(value_error(format!(
                        "{what} out of range: {}",
                        describe(&item)
                    ))),
                    None => Err(type_error(format!(
                        "{what} must be ints, got {}",
                        describe(&item)
                    ))),
                }
            })
            .collect();
    }
    Err(type_error(format!(
        "{what} must be a list of ints or a 1-D numpy integer array, got {}",
        type_name(obj)
    )))
}

/// A configuration mapping's entries: every key in `keys` must be there, and nothing else.
pub fn config_items<'py, const N: usize>(
    config: &Bound<'py, PyAny>,
    keys: [&str; N],
) -> PyResult<[Bound<'py, PyAny>; N]> {
    let Ok(config) = config.cast::<pyo3::types::PyDict>() else {
        return Err(type_error(format!(
            "a configuration must be a dict, got {}",
            type_name(config)
        )));
    };
    if let Some(unknown) = config.keys().iter().find(|key| {
        !key.extract::<String>()
            .is_ok_and(|key| keys.contains(&key.as_str()))
    }) {
        return Err(value_error(format!(
            "unknown configuration key {}",
            describe(&unknown)
        )));
    }
    let mut items = Vec::with_capacity(N);
    for key in keys {
        items.push(
            config
                .get_item(key)?
                .ok_or_else(|| value_error(format!("the configuration needs {key:?}")))?,
        );
    }
    items.try_into().map_err(|_| value_error("configuration"))
}
