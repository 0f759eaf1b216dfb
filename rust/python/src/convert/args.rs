//! The argument kinds of the binding as `FromPyObject` newtypes, so a method's signature says
//! what it takes (`seq_id: SeqId`, `n: Count<1>`, `tokens: Prompt`) and the checks live here
//! once. Messages name the kind of value expected; PyO3 adds a note naming the argument
//! ("while processing 'seq_id'"), which tracebacks show.

use atb_mem_core::{KvDtype, Tokens};
use numpy::{PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::errors::IntoPyResult;

use super::{describe, is_int, is_sequence_like, Ints};
use crate::errors::{type_error, value_error};

/// A sequence (or request) id: an int in `[0, 2**63)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqId(pub u64);

impl<'a, 'py> FromPyObject<'a, 'py> for SeqId {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        super::seq_id(&obj, "a sequence id").map(SeqId)
    }
}

/// A count: an int in `[MIN, 2**63)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count<const MIN: i64>(pub usize);

impl<'a, 'py, const MIN: i64> FromPyObject<'a, 'py> for Count<MIN> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        super::count(&obj, "the value", MIN).map(Count)
    }
}

impl<const MIN: i64> Count<MIN> {
    pub fn get(self) -> usize {
        self.0
    }

    pub fn as_u64(self) -> u64 {
        self.0 as u64
    }
}

/// Nanoseconds (a time or a duration): an int in `[0, 2**63)`.
pub type Nanos = Count<0>;

/// Sequence ids: a list or tuple of ints, or a 1-D numpy integer array (borrowed, not
/// copied, when it is int64 or uint64 and contiguous).
pub struct SeqIds<'py>(Ints<'py, i64, u64>);

impl<'a, 'py> FromPyObject<'a, 'py> for SeqIds<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        super::seq_ids(&obj, "sequence ids").map(SeqIds)
    }
}

impl SeqIds<'_> {
    pub fn as_slice(&self) -> &[u64] {
        self.0.as_slice()
    }
}

/// Token ids, each in `[0, 2**32)`: a list or tuple of ints, or a numpy integer array
/// (borrowed when int32 or uint32 and contiguous). 2-D input is checked against a shape
/// where the call knows one ([`TokenIds::extract_shaped`]).
pub struct TokenIds<'py>(Ints<'py, i32, u32>);

impl<'a, 'py> FromPyObject<'a, 'py> for TokenIds<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        super::token_ids(&obj, "token ids", None).map(TokenIds)
    }
}

impl<'py> TokenIds<'py> {
    /// `[rows, columns]` ids (or the same number flat), row-major.
    pub fn extract_shaped(obj: &Bound<'py, PyAny>, shape: [usize; 2]) -> PyResult<Self> {
        super::token_ids(obj, "token ids", Some(shape)).map(TokenIds)
    }

    pub fn as_slice(&self) -> &[u32] {
        self.0.as_slice()
    }
}

/// What a sequence starts from: a token count (an int ≥ 1), or the token ids themselves.
pub enum Prompt<'py> {
    Count(usize),
    Ids(TokenIds<'py>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Prompt<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if is_sequence_like(&obj) {
            return super::token_ids(&obj, "token ids", None).map(|ids| Prompt::Ids(TokenIds(ids)));
        }
        if is_int(&obj) {
            return super::count(&obj, "a token count", 1).map(Prompt::Count);
        }
        Err(type_error(format!(
            "expected a token count (int) or token ids (a list or 1-D numpy integer array), \
             got {}",
            super::type_name(&obj)
        )))
    }
}

impl Prompt<'_> {
    pub fn tokens(&self) -> Tokens<'_> {
        match self {
            Prompt::Count(count) => Tokens::Count(*count),
            Prompt::Ids(ids) => Tokens::Ids(ids.as_slice()),
        }
    }
}

/// Token positions or slots: a list of ints or a 1-D numpy integer array.
pub struct Positions(pub Vec<i64>);

impl<'a, 'py> FromPyObject<'a, 'py> for Positions {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        super::positions(&obj, "positions").map(Positions)
    }
}

/// A cache salt: str or bytes (its UTF-8 or raw bytes seed the prefix hashes).
pub struct CacheSalt(pub Vec<u8>);

impl<'a, 'py> FromPyObject<'a, 'py> for CacheSalt {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(text) = obj.cast::<pyo3::types::PyString>() {
            return Ok(CacheSalt(text.to_str()?.as_bytes().to_vec()));
        }
        if let Ok(bytes) = obj.cast::<pyo3::types::PyBytes>() {
            return Ok(CacheSalt(bytes.as_bytes().to_vec()));
        }
        Err(type_error(format!(
            "cache_salt must be str or bytes, got {}",
            super::type_name(&obj)
        )))
    }
}

/// Block pairs: an int32 `[k, 2]` array of (source, destination) block ids, each ≥ 0.
pub struct BlockPairs(pub Vec<[usize; 2]>);

impl<'a, 'py> FromPyObject<'a, 'py> for BlockPairs {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let pairs: PyReadonlyArray2<'py, i32> = obj.extract().map_err(|_| {
            type_error(format!(
                "block pairs must be an int32 [k, 2] array, got {}",
                describe(&obj)
            ))
        })?;
        if pairs.shape()[1] != 2 {
            return Err(value_error("block pairs must have shape [k, 2]"));
        }
        pairs
            .as_array()
            .rows()
            .into_iter()
            .map(
                |pair| match (usize::try_from(pair[0]), usize::try_from(pair[1])) {
                    (Ok(src), Ok(dst)) => Ok([src, dst]),
                    _ => Err(value_error(format!(
                        "block pair ({}, {}) is out of range",
                        pair[0], pair[1]
                    ))),
                },
            )
            .collect::<PyResult<_>>()
            .map(BlockPairs)
    }
}

/// A K/V dtype: its name (`"float16"`, `"bf16"`, ...), a numpy dtype or scalar type, or a
/// torch dtype.
pub struct Dtype(pub KvDtype);

impl<'a, 'py> FromPyObject<'a, 'py> for Dtype {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let name = if let Ok(name) = obj.cast::<PyString>() {
            name.to_string()
        } else if let Ok(name) = obj.getattr("__name__") {
            name.str()?.to_string()
        } else {
            obj.str()?.to_string()
        };
        KvDtype::parse(name.trim_start_matches("torch."))
            .into_py_result()
            .map(Dtype)
    }
}

/// transformers' per-layer attention names (`config.layer_types`): a list or tuple of str.
pub struct LayerTypes(pub Vec<String>);

impl<'a, 'py> FromPyObject<'a, 'py> for LayerTypes {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let is_list = obj.is_instance_of::<pyo3::types::PyList>()
            || obj.is_instance_of::<pyo3::types::PyTuple>();
        let names = is_list
            .then(|| obj.extract::<Vec<String>>().ok())
            .flatten()
            .ok_or_else(|| {
                type_error(format!(
                    "layer_types must be a list of str (\"full_attention\", \
                     \"sliding_attention\", \"chunked_attention\"), got {}",
                    describe(&obj)
                ))
            })?;
        Ok(LayerTypes(names))
    }
}
