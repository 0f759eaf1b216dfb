//! `linear`: the core's product of a linear layer over a few rows (`atb_mem_core::Linear`),
//! over numpy views of torch's tensors (16-bit ones as their int16 bits), the GIL released.

use atb_mem_core::{bf16, f16, Element, Linear};
use numpy::{PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::convert::{cast, cast_mut, Count};
use crate::errors::{value_error, IntoPyResult};

/// `out [rows, N] = x [rows, K] · weight [N, K]ᵀ` (see `_core.pyi`).
#[pyfunction]
#[pyo3(signature = (x, weight, out, *, dtype, bias=None, threads=Count(1)))]
pub fn linear<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    dtype: &str,
    bias: Option<&Bound<'py, PyAny>>,
    threads: Count<1>,
) -> PyResult<()> {
    let arrays = (x, weight, out);
    match dtype {
        "float32" => product::<f32, f32>(py, arrays, bias, threads.get()),
        "bfloat16" => product::<bf16, i16>(py, arrays, bias, threads.get()),
        "float16" => product::<f16, i16>(py, arrays, bias, threads.get()),
        other => Err(value_error(format!(
            "dtype must be 'float32', 'bfloat16' or 'float16', got {other:?}"
        ))),
    }
}

type Arrays<'a, 'py> = (
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
);

/// The call with elements `E`, held by numpy as `T` (the same bits).
fn product<E: Element, T: numpy::Element>(
    py: Python<'_>,
    (x, weight, out): Arrays<'_, '_>,
    bias: Option<&Bound<'_, PyAny>>,
    threads: usize,
) -> PyResult<()> {
    let bias = bias.map(|bias| typed::<T>(bias, "bias")).transpose()?;
    let bias = bias
        .as_ref()
        .map(|bias| bias.try_readonly())
        .transpose()
        .map_err(|_| value_error("bias is borrowed for writing elsewhere"))?;
    let (x, weight, out) = (
        typed::<T>(x, "x")?,
        typed::<T>(weight, "weight")?,
        typed::<T>(out, "out")?,
    );
    let (x, weight) = (
        x.try_readonly()
            .map_err(|_| value_error("x is borrowed for writing elsewhere"))?,
        weight
            .try_readonly()
            .map_err(|_| value_error("weight is borrowed for writing elsewhere"))?,
    );
    let mut out = out
        .try_readwrite()
        .map_err(|_| value_error("out must be a writable array borrowed nowhere else"))?;
    let ([rows, inner], [features, weight_inner], [out_rows, out_features]) = (
        dims(x.shape(), "x")?,
        dims(weight.shape(), "weight")?,
        dims(out.shape(), "out")?,
    );
    if weight_inner != inner || out_rows != rows || out_features != features {
        return Err(value_error(format!(
            "x {:?}, weight {:?} and out {:?} do not make [rows, K] · [N, K]ᵀ = [rows, N]",
            x.shape(),
            weight.shape(),
            out.shape()
        )));
    }
    // numpy's slices take Fortran order too: a transposed array would be read in the wrong
    // order.
    let contiguous = |name: &str| value_error(format!("{name} must be C-contiguous"));
    for (array, name) in [(&x, "x"), (&weight, "weight")] {
        if !array.is_c_contiguous() {
            return Err(contiguous(name));
        }
    }
    if !out.is_c_contiguous() {
        return Err(contiguous("out"));
    }
    let x = cast::<T, E>(x.as_slice().map_err(|_| contiguous("x"))?);
    let weight = cast::<T, E>(weight.as_slice().map_err(|_| contiguous("weight"))?);
    let out = cast_mut::<T, E>(out.as_slice_mut().map_err(|_| contiguous("out"))?);
    let bias = match &bias {
        Some(bias) if bias.ndim() != 1 => {
            return Err(value_error(format!(
                "bias must be 1-D, got shape {:?}",
                bias.shape()
            )))
        }
        Some(bias) => Some(cast::<T, E>(
            bias.as_slice().map_err(|_| contiguous("bias"))?,
        )),
        None => None,
    };
    let call = Linear {
        x,
        weight,
        bias,
        rows,
        features_in: inner,
        features_out: features,
    };
    py.detach(|| call.run(out, threads)).into_py_result()
}

fn typed<'py, T: numpy::Element>(
    array: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<Bound<'py, PyArrayDyn<T>>> {
    let wanted = if std::mem::size_of::<T>() == 4 {
        "float32"
    } else {
        "int16 (a 16-bit tensor's bits)"
    };
    array
        .cast::<PyArrayDyn<T>>()
        .cloned()
        .map_err(|_| value_error(format!("{name} must be a numpy {wanted} array")))
}

fn dims(shape: &[usize], name: &str) -> PyResult<[usize; 2]> {
    <[usize; 2]>::try_from(shape)
        .map_err(|_| value_error(format!("{name} must be 2-D, got shape {shape:?}")))
}
