//! `linear`: the core's product of a linear layer over a few rows (`atb_mem_core::Linear`),
//! over numpy views of torch's tensors (16-bit ones as their int16 bits), the GIL released.

use atb_mem_core::{bf16, f16, Element, Linear};
use numpy::PyUntypedArrayMethods;
use pyo3::prelude::*;

use crate::convert::{cast, cast_mut, contiguous, contiguous_mut, readonly, writable, Count};
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
    let (x, weight) = (readonly::<T>(x, "x")?, readonly::<T>(weight, "weight")?);
    let bias = bias.map(|bias| readonly::<T>(bias, "bias")).transpose()?;
    let mut out = writable::<T>(out, "out")?;
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
    let bias = match &bias {
        Some(bias) if bias.ndim() != 1 => {
            return Err(value_error(format!(
                "bias must be 1-D, got shape {:?}",
                bias.shape()
            )))
        }
        Some(bias) => Some(cast::<T, E>(contiguous(&bias.as_slice(), "bias")?)),
        None => None,
    };
    let call = Linear {
        x: cast::<T, E>(contiguous(&x.as_slice(), "x")?),
        weight: cast::<T, E>(contiguous(&weight.as_slice(), "weight")?),
        bias,
        rows,
        features_in: inner,
        features_out: features,
    };
    let out = cast_mut::<T, E>(contiguous_mut(out.as_slice_mut(), "out")?);
    py.detach(|| call.run(out, threads)).into_py_result()
}

fn dims(shape: &[usize], name: &str) -> PyResult<[usize; 2]> {
    <[usize; 2]>::try_from(shape)
        .map_err(|_| value_error(format!("{name} must be 2-D, got shape {shape:?}")))
}
