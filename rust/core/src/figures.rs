//! Stats as named figures: each stats struct lists its figures once, here in the core, with
//! the ones derived from others (hit rates, totals in bytes); the binding turns the list into
//! a dict without knowing a single name.

/// One figure's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Figure {
    Int(u128),
    Float(f64),
    Text(&'static str),
}

impl From<usize> for Figure {
    fn from(value: usize) -> Self {
        Figure::Int(value as u128)
    }
}

impl From<u64> for Figure {
    fn from(value: u64) -> Self {
        Figure::Int(value as u128)
    }
}

impl From<u128> for Figure {
    fn from(value: u128) -> Self {
        Figure::Int(value)
    }
}

impl From<f64> for Figure {
    fn from(value: f64) -> Self {
        Figure::Float(value)
    }
}

impl From<&'static str> for Figure {
    fn from(value: &'static str) -> Self {
        Figure::Text(value)
    }
}

/// Stats that can be read as a list of named figures.
pub trait Figures {
    /// Every figure, by name, in a stable order.
    fn figures(&self) -> Vec<(&'static str, Figure)>;
}

/// `figures![self; a, b, "name" => expression, ...]`: fields by their own name, or named
/// expressions.
macro_rules! figures {
    ($($name:literal => $value:expr),* $(,)?) => {
        vec![$(($name, $crate::figures::Figure::from($value))),*]
    };
}
