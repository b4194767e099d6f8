// SPDX-License-Identifier: MIT OR Apache-2.0
//! Element types of the Python tensors: the crate's tensors are bytes, so
//! the binding keeps a dtype and a shape next to each view and hands them
//! to the buffer protocol (struct format) and DLPack (type code and bits).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyString;

/// One element type.
#[derive(Debug, PartialEq, Eq)]
pub struct DType {
    /// numpy's name.
    pub name: &'static str,
    /// Size in bytes.
    pub size: usize,
    /// The buffer protocol's struct format (native order), if it has one.
    pub format: Option<&'static str>,
    /// DLPack `DLDataTypeCode`: 0 int, 1 uint, 2 float, 4 bfloat,
    /// 5 complex, 6 bool.
    pub dl_code: u8,
}

const fn dt(name: &'static str, size: usize, format: Option<&'static str>, dl_code: u8) -> DType {
    DType {
        name,
        size,
        format,
        dl_code,
    }
}

/// Every supported type.
pub static DTYPES: &[DType] = &[
    dt("uint8", 1, Some("B"), 1),
    dt("int8", 1, Some("b"), 0),
    dt("uint16", 2, Some("H"), 1),
    dt("int16", 2, Some("h"), 0),
    dt("uint32", 4, Some("I"), 1),
    dt("int32", 4, Some("i"), 0),
    dt("uint64", 8, Some("Q"), 1),
    dt("int64", 8, Some("q"), 0),
    dt("float16", 2, Some("e"), 2),
    dt("float32", 4, Some("f"), 2),
    dt("float64", 8, Some("d"), 2),
    dt("complex64", 8, Some("Zf"), 5),
    dt("complex128", 16, Some("Zd"), 5),
    dt("bool", 1, Some("?"), 6),
    // No struct format: numpy has no bfloat16; DLPack does.
    dt("bfloat16", 2, None, 4),
];

/// The byte type: untyped tensors.
pub fn uint8() -> &'static DType {
    &DTYPES[0]
}

/// Looks a type up by name.
pub fn by_name(name: &str) -> Option<&'static DType> {
    DTYPES.iter().find(|d| d.name == name)
}

/// A dtype argument: a name (`"float32"`), a numpy dtype (its `.name`) or
/// a numpy scalar type (`numpy.float32`, its `__name__`).
pub fn parse(obj: &Bound<'_, PyAny>) -> PyResult<&'static DType> {
    let name: String = if let Ok(s) = obj.cast::<PyString>() {
        s.to_str()?.to_owned()
    } else if let Ok(n) = obj.getattr("name").and_then(|n| n.extract::<String>()) {
        n
    } else if let Ok(n) = obj.getattr("__name__").and_then(|n| n.extract::<String>()) {
        n
    } else {
        return Err(PyTypeError::new_err(format!(
            "dtype must be a name such as \"float32\" or a numpy dtype, not {}",
            obj.get_type().name()?
        )));
    };
    by_name(&name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unsupported dtype {name:?}; supported: {}",
            DTYPES.iter().map(|d| d.name).collect::<Vec<_>>().join(", ")
        ))
    })
}

/// The type of a buffer's struct format with its item size, as exporters
/// write it (numpy: `"f"`, `"<f"`, `"l"` for int64 on LP64, ...). Integer
/// and float kinds are resolved by item size, so native and standard
/// sizes agree. Big-endian formats are refused.
pub fn from_format(format: &str, itemsize: usize) -> Option<&'static DType> {
    let f = format.trim_start_matches(['@', '=', '<']);
    if f.starts_with(['>', '!']) {
        return None;
    }
    let name = match (f, itemsize) {
        ("?", 1) => "bool",
        ("b" | "h" | "i" | "l" | "q" | "n", 1) => "int8",
        ("b" | "h" | "i" | "l" | "q" | "n", 2) => "int16",
        ("b" | "h" | "i" | "l" | "q" | "n", 4) => "int32",
        ("b" | "h" | "i" | "l" | "q" | "n", 8) => "int64",
        ("B" | "H" | "I" | "L" | "Q" | "N" | "c", 1) => "uint8",
        ("B" | "H" | "I" | "L" | "Q" | "N", 2) => "uint16",
        ("B" | "H" | "I" | "L" | "Q" | "N", 4) => "uint32",
        ("B" | "H" | "I" | "L" | "Q" | "N", 8) => "uint64",
        ("e", 2) => "float16",
        ("f", 4) => "float32",
        ("d", 8) => "float64",
        ("Zf", 8) => "complex64",
        ("Zd", 16) => "complex128",
        _ => return None,
    };
    by_name(name)
}

/// The type of a DLPack `(code, bits, lanes)`.
pub fn from_dlpack(code: u8, bits: u8, lanes: u16) -> Option<&'static DType> {
    if lanes != 1 || bits % 8 != 0 {
        return None;
    }
    let size = usize::from(bits / 8);
    DTYPES.iter().find(|d| d.dl_code == code && d.size == size)
}
