use numpy::{PyArray1, IntoPyArray};
use pyo3::prelude::*;

#[pyfunction]
fn f<'py>(py: Python<'py>) -> Bound<'py, PyArray1<i32>> { vec![1i32, 2].into_pyarray(py) }

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(f, m)?)?;
    Ok(())
}
