//! `paged_attention`: the core's CPU paged attention over numpy views of a model's tensors
//! (torch's `Tensor.numpy()`; 16-bit ones viewed as int16, their bits), with the GIL released
//! while the threads attend; `use_openmp`: its threads taken from torch's OpenMP runtime.

use std::ffi::CString;
use std::path::PathBuf;

use atb_mem_core::{
    bf16, f16, write_slots, AttentionShape, Element, Fp8E4m3Code, Int8Code, KvCacheDtype, NewKv,
    PagedAttention, StepRows, Visibility,
};
use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::convert::{cast, cast_mut, contiguous, contiguous_mut, readonly, writable, Count};
use crate::errors::{value_error, IntoPyResult};

/// The step's rows and how they attend, as Python gave them.
struct Rows<'py> {
    query_start_loc: PyReadonlyArray1<'py, i32>,
    seq_lens: PyReadonlyArray1<'py, i32>,
    block_tables: PyReadonlyArray2<'py, i32>,
    block_size: usize,
    scale: f32,
    visibility: Visibility,
    sinks: Option<PyReadonlyArray1<'py, f32>>,
    slot_mapping: Option<PyReadonlyArray1<'py, i32>>,
}

/// The tensors, as numpy arrays of their storage type.
struct Tensors<'a, 'py> {
    query: &'a Bound<'py, PyAny>,
    key_cache: &'a Bound<'py, PyAny>,
    value_cache: &'a Bound<'py, PyAny>,
    out: &'a Bound<'py, PyAny>,
    new_kv: Option<(&'a Bound<'py, PyAny>, &'a Bound<'py, PyAny>)>,
}

/// Runs `paged_attention`'s threads on the team of the OpenMP runtime that `library`, which
/// this process must have loaded already, is or links (see `_core.pyi`).
#[pyfunction]
pub fn use_openmp(library: PathBuf) -> PyResult<()> {
    let shown = library.display().to_string();
    // dlopen("") is the program itself, and a bare name is searched for: neither is a
    // library the caller named.
    if !library.is_absolute() {
        return Err(value_error(format!("{shown:?} is not an absolute path")));
    }
    let path = CString::new(library.into_os_string().into_encoded_bytes())
        .map_err(|_| value_error("the library's path has a NUL byte"))?;
    // RTLD_NOLOAD: a handle only to a library already loaded (torch's), never a new copy.
    // Safety: both take valid C strings; the handle is kept open for the process's life.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return Err(value_error(format!(
            "{shown} is not a library this process has loaded"
        )));
    }
    // A handle's lookup covers the library's own dependencies: torch's libtorch_cpu finds
    // the runtime torch binds to.
    let parallel = unsafe { libc::dlsym(handle, c"GOMP_parallel".as_ptr()) };
    if parallel.is_null() {
        return Err(value_error(format!(
            "{shown} has no GOMP_parallel: not an OpenMP runtime, nor linked to one"
        )));
    }
    // Safety: an OpenMP runtime's GOMP_parallel, of that signature, loaded for good.
    unsafe {
        let parallel: atb_mem_core::OpenMpParallel = std::mem::transmute(parallel);
        atb_mem_core::use_openmp(parallel).into_py_result()
    }
}

/// Attends a step's rows for one layer into `out` (see `_core.pyi`).
#[pyfunction]
#[pyo3(signature = (
    query, key_cache, value_cache, out, query_start_loc, seq_lens, block_tables, *,
    block_size, scale, dtype, window=None, chunk=None, sinks=None, new_keys=None,
    new_values=None, slot_mapping=None, threads=Count(1), kv_cache_dtype="auto"
))]
#[allow(clippy::too_many_arguments)] // Python's keyword arguments, one per input
pub fn paged_attention<'py>(
    py: Python<'py>,
    query: &Bound<'py, PyAny>,
    key_cache: &Bound<'py, PyAny>,
    value_cache: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    query_start_loc: PyReadonlyArray1<'py, i32>,
    seq_lens: PyReadonlyArray1<'py, i32>,
    block_tables: PyReadonlyArray2<'py, i32>,
    block_size: Count<1>,
    scale: f64,
    dtype: &str,
    window: Option<Count<1>>,
    chunk: Option<Count<1>>,
    sinks: Option<PyReadonlyArray1<'py, f32>>,
    new_keys: Option<&Bound<'py, PyAny>>,
    new_values: Option<&Bound<'py, PyAny>>,
    slot_mapping: Option<PyReadonlyArray1<'py, i32>>,
    threads: Count<1>,
    kv_cache_dtype: &str,
) -> PyResult<()> {
    let cache_dtype = KvCacheDtype::parse(kv_cache_dtype).into_py_result()?;
    let visibility = match (window, chunk) {
        (None, None) => Visibility::Causal,
        (Some(window), None) => Visibility::Sliding {
            window: window.get(),
        },
        (None, Some(chunk)) => Visibility::Chunked { chunk: chunk.get() },
        (Some(_), Some(_)) => return Err(value_error("give a window or a chunk, not both")),
    };
    let new_kv = match (new_keys, new_values, slot_mapping.is_some()) {
        (Some(keys), Some(values), true) => Some((keys, values)),
        (None, None, false) => None,
        _ => {
            return Err(value_error(
                "new_keys, new_values and slot_mapping come together",
            ))
        }
    };
    let rows = Rows {
        query_start_loc,
        seq_lens,
        block_tables,
        block_size: block_size.get(),
        scale: scale as f32,
        visibility,
        sinks,
        slot_mapping,
    };
    let tensors = Tensors {
        query,
        key_cache,
        value_cache,
        out,
        new_kv,
    };
    let threads = threads.get();
    match dtype {
        "float32" => attend_over::<f32, f32>(py, &tensors, &rows, threads, cache_dtype),
        "bfloat16" => attend_over::<bf16, i16>(py, &tensors, &rows, threads, cache_dtype),
        "float16" => attend_over::<f16, i16>(py, &tensors, &rows, threads, cache_dtype),
        other => Err(value_error(format!(
            "dtype must be 'float32', 'bfloat16' or 'float16', got {other:?}"
        ))),
    }
}

/// `attend` with the caches' element: the model's (`T` to numpy), or a quantized row's code
/// (uint8 to numpy).
fn attend_over<E: Element, T: numpy::Element>(
    py: Python<'_>,
    tensors: &Tensors<'_, '_>,
    rows: &Rows<'_>,
    threads: usize,
    cache_dtype: KvCacheDtype,
) -> PyResult<()> {
    match cache_dtype {
        KvCacheDtype::Auto => attend::<E, T, E, T>(py, tensors, rows, threads),
        KvCacheDtype::Int8 => attend::<E, T, Int8Code, u8>(py, tensors, rows, threads),
        KvCacheDtype::Fp8E4m3 => attend::<E, T, Fp8E4m3Code, u8>(py, tensors, rows, threads),
    }
}

/// Runs the call with elements `E`, held by numpy as `T` (the same bits), over caches of
/// `C`, held by numpy as `U`.
fn attend<E: Element, T: numpy::Element, C: Element, U: numpy::Element>(
    py: Python<'_>,
    tensors: &Tensors<'_, '_>,
    rows: &Rows<'_>,
    threads: usize,
) -> PyResult<()> {
    let query = readonly::<T>(tensors.query, "query")?;
    let mut key_cache = writable::<U>(tensors.key_cache, "key_cache")?;
    let mut value_cache = writable::<U>(tensors.value_cache, "value_cache")?;
    let mut out = writable::<T>(tensors.out, "out")?;
    let new_kv = match tensors.new_kv {
        Some((keys, values)) => Some((
            readonly::<T>(keys, "new_keys")?,
            readonly::<T>(values, "new_values")?,
        )),
        None => None,
    };
    let [_, num_heads, head_dim] = dims(query.shape(), "query")?;
    let [_, num_kv_heads, cache_dim] = dims(key_cache.shape(), "key_cache")?;
    if cache_dim != C::row_len(head_dim) || out.shape() != query.shape() {
        return Err(value_error(format!(
            "query {:?}, out {:?} and key_cache {:?} disagree on head_dim or shape (a \
             quantized cache's rows are head_dim + 4 bytes)",
            query.shape(),
            out.shape(),
            key_cache.shape()
        )));
    }
    let shape = AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim,
        block_size: rows.block_size,
    };
    if !rows.block_tables.is_c_contiguous() {
        return Err(value_error("block_tables must be C-contiguous"));
    }
    let width = rows.block_tables.shape()[1];
    let sinks = rows
        .sinks
        .as_ref()
        .map(|sinks| sinks.as_slice())
        .transpose();
    let sinks = sinks.map_err(|_| value_error("sinks must be a contiguous float32 array"))?;
    let slices = (
        contiguous(&rows.query_start_loc.as_slice(), "query_start_loc")?,
        contiguous(&rows.seq_lens.as_slice(), "seq_lens")?,
        contiguous(&rows.block_tables.as_slice(), "block_tables")?,
    );
    let query = cast::<T, E>(contiguous(&query.as_slice(), "query")?);
    let keys = cast_mut::<U, C>(contiguous_mut(key_cache.as_slice_mut(), "key_cache")?);
    let values = cast_mut::<U, C>(contiguous_mut(value_cache.as_slice_mut(), "value_cache")?);
    let out = cast_mut::<T, E>(contiguous_mut(out.as_slice_mut(), "out")?);
    let new = match (&new_kv, &rows.slot_mapping) {
        (Some((new_keys, new_values)), Some(slot_mapping)) => Some(NewKv {
            keys: cast::<T, E>(contiguous(&new_keys.as_slice(), "new_keys")?),
            values: cast::<T, E>(contiguous(&new_values.as_slice(), "new_values")?),
            slot_mapping: contiguous(&slot_mapping.as_slice(), "slot_mapping")?,
        }),
        _ => None,
    };
    let step = StepRows {
        query_start_loc: slices.0,
        seq_lens: slices.1,
        block_tables: slices.2,
        width,
    };
    let how = (rows.visibility, rows.scale, sinks);
    py.detach(|| {
        // Checked before the new K/V are written: a refused call changes nothing.
        paged_call(shape, step, query, (keys, values), how).validate(out.len(), threads)?;
        if let Some(new) = &new {
            write_slots(new, keys, values, (num_kv_heads, head_dim))?;
        }
        paged_call(shape, step, query, (keys, values), how).run(out, threads)
    })
    .into_py_result()
}

/// The core's call over these caches (built twice: once to validate, once to run after the
/// caches were written).
fn paged_call<'a, E, C>(
    shape: AttentionShape,
    rows: StepRows<'a>,
    query: &'a [E],
    (key_cache, value_cache): (&'a [C], &'a [C]),
    (visibility, scale, sinks): (Visibility, f32, Option<&'a [f32]>),
) -> PagedAttention<'a, E, C> {
    PagedAttention {
        shape,
        rows,
        query,
        key_cache,
        value_cache,
        visibility,
        scale,
        sinks,
    }
}

fn dims(shape: &[usize], name: &str) -> PyResult<[usize; 3]> {
    <[usize; 3]>::try_from(shape)
        .map_err(|_| value_error(format!("{name} must be 3-D, got shape {shape:?}")))
}
