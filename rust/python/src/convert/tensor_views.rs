//! numpy views of torch's tensors as the kernels read them (`Tensor.numpy()`, 16-bit ones
//! viewed as int16): typed, C-contiguous, borrowed, then cast to the element type of the same
//! bits.

use numpy::{
    PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::errors::value_error;

pub fn readonly<'py, T: numpy::Element>(
    array: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    let typed = array
        .cast::<PyArrayDyn<T>>()
        .map_err(|_| wrong_type::<T>(name))?;
    c_contiguous(typed, name)?;
    typed
        .try_readonly()
        .map_err(|_| value_error(format!("{name} is borrowed for writing elsewhere")))
}

pub fn writable<'py, T: numpy::Element>(
    array: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<PyReadwriteArrayDyn<'py, T>> {
    let typed = array
        .cast::<PyArrayDyn<T>>()
        .map_err(|_| wrong_type::<T>(name))?;
    c_contiguous(typed, name)?;
    typed.try_readwrite().map_err(|_| {
        value_error(format!(
            "{name} must be a writable array borrowed nowhere else"
        ))
    })
}

/// numpy's slices take Fortran order too: a transposed array would be read in the wrong order.
fn c_contiguous<T: numpy::Element>(array: &Bound<'_, PyArrayDyn<T>>, name: &str) -> PyResult<()> {
    if array.is_c_contiguous() {
        Ok(())
    } else {
        Err(value_error(format!("{name} must be C-contiguous")))
    }
}

fn wrong_type<T: numpy::Element>(name: &str) -> PyErr {
    let wanted = match std::mem::size_of::<T>() {
        4 => "float32",
        1 => "uint8 (a quantized cache's rows)",
        _ => "int16 (a 16-bit tensor's bits)",
    };
    value_error(format!("{name} must be a numpy {wanted} array"))
}

pub fn contiguous<'a, T, E>(slice: &Result<&'a [T], E>, name: &str) -> PyResult<&'a [T]> {
    slice
        .as_ref()
        .map(|slice| *slice)
        .map_err(|_| value_error(format!("{name} must be C-contiguous")))
}

pub fn contiguous_mut<'a, T, E>(
    slice: Result<&'a mut [T], E>,
    name: &str,
) -> PyResult<&'a mut [T]> {
    slice.map_err(|_| value_error(format!("{name} must be C-contiguous")))
}

/// numpy's storage type as the element type of the same bits (f32 as f32; int16 as bf16 or
/// f16).
pub fn cast<T, E>(slice: &[T]) -> &[E] {
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<E>());
    assert_eq!(std::mem::align_of::<T>(), std::mem::align_of::<E>());
    // Safety: same size and alignment, and every bit pattern is a valid f32, bf16 or f16.
    unsafe { std::slice::from_raw_parts(slice.as_ptr().cast::<E>(), slice.len()) }
}

pub fn cast_mut<T, E>(slice: &mut [T]) -> &mut [E] {
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<E>());
    assert_eq!(std::mem::align_of::<T>(), std::mem::align_of::<E>());
    // Safety: as `cast`; the slice is borrowed mutably for the result's life.
    unsafe { std::slice::from_raw_parts_mut(slice.as_mut_ptr().cast::<E>(), slice.len()) }
}
