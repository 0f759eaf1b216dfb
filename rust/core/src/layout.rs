//! The shape of what one block holds, so the core can size blocks in bytes.

use crate::error::CoreResult;
use crate::quant::KvCacheDtype;

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
    /// The model's K/V dtype (what queries and new K/V come in).
    pub dtype: KvDtype,
    /// How the cache stores them: in `dtype` (`Auto`) or quantized per row (`quant`).
    pub cache_dtype: KvCacheDtype,
}

impl Default for KvLayout {
    fn default() -> Self {
        KvLayout {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 1,
            dtype: KvDtype::Float16,
            cache_dtype: KvCacheDtype::Auto,
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
        ensure!(
            self.cache_dtype == KvCacheDtype::Auto || self.dtype != KvDtype::Int8,
            "kv_cache_dtype {:?} quantizes a model's float K/V; the cache's dtype is int8",
            self.cache_dtype.name()
        );
        Ok(())
    }

    /// Bytes of one token's K (or V) for one KV head: `head_dim` elements of `dtype`, or a
    /// quantized row with its scale; `None` on overflow.
    pub fn row_bytes(&self) -> Option<usize> {
        match self.cache_dtype {
            KvCacheDtype::Auto => self.head_dim.checked_mul(self.dtype.itemsize()),
            quantized => quantized.row_bytes(self.head_dim),
        }
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
            self.row_bytes()?,
        ]
        .into_iter()
        .try_fold(2usize, |acc, factor| acc.checked_mul(factor))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dtype: KvDtype, cache_dtype: KvCacheDtype) -> KvLayout {
        KvLayout {
            num_layers: 28,
            num_kv_heads: 8,
            head_dim: 128,
            dtype,
            cache_dtype,
        }
    }

    #[test]
    fn quantized_blocks_count_each_rows_codes_and_scale() {
        let bf16 = layout(KvDtype::BFloat16, KvCacheDtype::Auto);
        assert_eq!(bf16.bytes_per_block(16), Some(2 * 28 * 16 * 8 * 256));
        for cache_dtype in [KvCacheDtype::Int8, KvCacheDtype::Fp8E4m3] {
            let quantized = layout(KvDtype::BFloat16, cache_dtype);
            assert_eq!(quantized.row_bytes(), Some(132));
            assert_eq!(quantized.bytes_per_block(16), Some(2 * 28 * 16 * 8 * 132));
            // The model's dtype does not change a quantized row.
            assert_eq!(
                layout(KvDtype::Float32, cache_dtype).bytes_per_block(16),
                quantized.bytes_per_block(16)
            );
        }
    }

    #[test]
    fn a_quantized_cache_needs_a_float_model_dtype() {
        assert!(layout(KvDtype::Int8, KvCacheDtype::Int8)
            .validate()
            .is_err());
        assert!(layout(KvDtype::Int8, KvCacheDtype::Auto).validate().is_ok());
        assert!(layout(KvDtype::Float16, KvCacheDtype::Fp8E4m3)
            .validate()
            .is_ok());
    }
}
