//! The shape of what one block holds, so the core can size blocks in bytes.

use crate::error::CoreResult;

/// Element type of the K/V cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    Float16,
    BFloat16,
    Float32,
    /// Quantized caches.
    Int8,
}

impl KvDtype {
    pub fn parse(name: &str) -> CoreResult<KvDtype> {
        match name {
            "float16" | "fp16" | "half" => Ok(KvDtype::Float16),
            "bfloat16" | "bf16" => Ok(KvDtype::BFloat16),
            "float32" | "fp32" | "float" => Ok(KvDtype::Float32),
            "int8" => Ok(KvDtype::Int8),
            other => Err(invalid!(
                "unknown KV-cache dtype {other:?}: expected one of float16, bfloat16, float32, int8"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Float16 => "float16",
            KvDtype::BFloat16 => "bfloat16",
            KvDtype::Float32 => "float32",
            KvDtype::Int8 => "int8",
        }
    }

    /// Every dtype, by name.
    pub const ALL: [KvDtype; 4] = [
        KvDtype::Float16,
        KvDtype::BFloat16,
        KvDtype::Float32,
        KvDtype::Int8,
    ];

    pub fn itemsize(self) -> usize {
        match self {
            KvDtype::Float16 | KvDtype::BFloat16 => 2,
            KvDtype::Float32 => 4,
            KvDtype::Int8 => 1,
        }
    }
}

/// Model dimensions that fix the byte size of a block: K and V for every layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
}

impl Default for KvLayout {
    fn default() -> Self {
        KvLayout {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 1,
            dtype: KvDtype::Float16,
        }
    }
}

impl KvLayout {
    pub fn validate(&self) -> CoreResult<()> {
        for (name, value) in [
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
        ] {
            ensure!(value != 0, "{name} must be at least 1, got 0");
        }
        Ok(())
    }

    /// Bytes of K plus V for one token across all layers, `None` on overflow.
    pub fn bytes_per_token(&self) -> Option<usize> {
        self.bytes_per_block(1)
    }

    /// Bytes of K plus V for one block across all layers, `None` on overflow.
    pub fn bytes_per_block(&self, block_size: usize) -> Option<usize> {
        [
            self.num_layers,
            block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype.itemsize(),
        ]
        .into_iter()
        .try_fold(2usize, |acc, factor| acc.checked_mul(factor))
    }
}
