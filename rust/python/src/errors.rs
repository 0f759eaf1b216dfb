//! The Python exception hierarchy and the one mapping from core errors onto it.
//!
//! Each class subclasses both `AtbMemError` and the builtin a caller would catch without
//! knowing this library (`MemoryError`, `KeyError`, ...). PyO3's `create_exception!` takes a
//! single base, so the classes are made with `type()` when the module loads.

use atb_mem_core::CoreError;
use pyo3::exceptions::{PyBaseException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

static ATB_MEM_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static OUT_OF_MEMORY_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static UNKNOWN_SEQUENCE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static DUPLICATE_SEQUENCE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INVALID_HANDLE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static QUEUE_FULL_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static REQUEST_TIMEOUT_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BLOCK_MOVE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static REQUEST_REFUSED_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn make_class<'py>(
    py: Python<'py>,
    name: &str,
    bases: Vec<Bound<'py, PyAny>>,
    doc: &str,
) -> PyResult<Bound<'py, PyType>> {
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "atb_mem")?;
    namespace.set_item("__doc__", doc)?;
    // KeyError's str() shows the repr of its argument; keep messages readable.
    let base_exception = py.get_type::<pyo3::exceptions::PyBaseException>();
    namespace.set_item("__str__", base_exception.getattr("__str__")?)?;
    let class = py
        .get_type::<PyType>()
        .call1((name, PyTuple::new(py, bases)?, namespace))?;
    Ok(class.cast_into::<PyType>()?)
}

pub fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = module.py();
    let root = make_class(
        py,
        "AtbMemError",
        vec![py.get_type::<pyo3::exceptions::PyException>().into_any()],
        "Base class of every error atb-mem raises.",
    )?;
    let builtin =
        |name: &str| -> PyResult<Bound<'_, PyAny>> { py.import("builtins")?.getattr(name) };
    let classes: [(&PyOnceLock<Py<PyType>>, &str, &str, &str); 8] = [
        (
            &OUT_OF_MEMORY_ERROR,
            "OutOfMemoryError",
            "MemoryError",
            "The pool or the KV-cache blocks are exhausted, or host memory ran out.",
        ),
        (
            &UNKNOWN_SEQUENCE_ERROR,
            "UnknownSequenceError",
            "KeyError",
            "No sequence has this id.",
        ),
        (
            &DUPLICATE_SEQUENCE_ERROR,
            "DuplicateSequenceError",
            "ValueError",
            "A sequence with this id exists already.",
        ),
        (
            &INVALID_HANDLE_ERROR,
            "InvalidHandleError",
            "ValueError",
            "A double free, or a stale or foreign handle.",
        ),
        (
            &QUEUE_FULL_ERROR,
            "QueueFullError",
            "RuntimeError",
            "The request queue is full.",
        ),
        (
            &REQUEST_TIMEOUT_ERROR,
            "RequestTimeoutError",
            "TimeoutError",
            "A request waited longer than its timeout.",
        ),
        (
            &BLOCK_MOVE_ERROR,
            "BlockMoveError",
            "RuntimeError",
            "Executing block moves failed. The pool was put back as it was before the \
             operation; `aborted_seq_ids` lists the sequences whose bytes the partial \
             execution destroyed, which were ended. The executor's error is the cause.",
        ),
        (
            &REQUEST_REFUSED_ERROR,
            "RequestRefusedError",
            "ValueError",
            "The scheduler refuses a request that could never run: `seq_id` names it, \
             `reason` says why (the message is both).",
        ),
    ];
    module.add("AtbMemError", &root)?;
    for (cell, name, builtin_base, doc) in classes {
        let class = make_class(
            py,
            name,
            vec![root.clone().into_any(), builtin(builtin_base)?],
            doc,
        )?;
        module.add(name, &class)?;
        let _ = cell.set(py, class.unbind());
    }
    let _ = ATB_MEM_ERROR.set(py, root.unbind());
    Ok(())
}

fn raise(cell: &PyOnceLock<Py<PyType>>, message: String) -> PyErr {
    Python::attach(|py| match cell.get(py) {
        Some(class) => PyErr::from_type(class.bind(py).clone(), message),
        None => pyo3::exceptions::PyRuntimeError::new_err(message),
    })
}

/// Maps a core error onto the Python hierarchy. (The orphan rule forbids `From<CoreError> for
/// PyErr` outside both crates; this trait is that one mapping.)
pub trait IntoPyResult<T> {
    fn into_py_result(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, CoreError> {
    #[inline]
    fn into_py_result(self) -> PyResult<T> {
        self.map_err(to_py_err)
    }
}

pub fn to_py_err(error: CoreError) -> PyErr {
    let message = error.to_string();
    match error {
        CoreError::OutOfBlocks { .. }
        | CoreError::OutOfHostBlocks { .. }
        | CoreError::PoolExhausted { .. }
        | CoreError::HostOutOfMemory { .. } => raise(&OUT_OF_MEMORY_ERROR, message),
        CoreError::InvalidHandle(_) => raise(&INVALID_HANDLE_ERROR, message),
        CoreError::QueueFull { .. } => raise(&QUEUE_FULL_ERROR, message),
        CoreError::UnknownSequence(_) => raise(&UNKNOWN_SEQUENCE_ERROR, message),
        CoreError::DuplicateSequence(_) => raise(&DUPLICATE_SEQUENCE_ERROR, message),
        CoreError::InvalidArgument(_) => PyValueError::new_err(message),
        CoreError::MovesFailed { aborted, .. } => block_move_error(message, &aborted),
        CoreError::RequestRefused { seq_id, reason } => {
            with_attributes(raise(&REQUEST_REFUSED_ERROR, message), |value| {
                value.setattr("seq_id", seq_id)?;
                value.setattr("reason", reason)
            })
        }
    }
}

/// `error` with attributes set on its value by `set`; the error of setting them instead if
/// that fails.
fn with_attributes(
    error: PyErr,
    set: impl FnOnce(&Bound<'_, PyBaseException>) -> PyResult<()>,
) -> PyErr {
    Python::attach(|py| match set(error.value(py)) {
        Ok(()) => error,
        Err(failed) => failed,
    })
}

/// `BlockMoveError` for a failed transaction (the core's message names what was ended), its
/// `aborted_seq_ids` set.
fn block_move_error(message: String, aborted: &[u64]) -> PyErr {
    with_attributes(raise(&BLOCK_MOVE_ERROR, message), |value| {
        value.setattr("aborted_seq_ids", aborted.to_vec())
    })
}

/// [`to_py_err`], with the executor's exception (when it raised one) as the cause.
pub fn to_py_err_caused_by(error: CoreError, cause: Option<PyErr>) -> PyErr {
    let error = to_py_err(error);
    if let Some(cause) = cause {
        Python::attach(|py| error.set_cause(py, Some(cause)));
    }
    error
}

pub fn invalid_handle(message: impl Into<String>) -> PyErr {
    raise(&INVALID_HANDLE_ERROR, message.into())
}

pub fn type_error(message: impl Into<String>) -> PyErr {
    PyTypeError::new_err(message.into())
}

pub fn value_error(message: impl Into<String>) -> PyErr {
    PyValueError::new_err(message.into())
}
