//! Writing a step's new K/V into their slots (ATB's ReshapeAndCache, vLLM's
//! `reshape_and_cache`): token `t`'s keys and values go to slot `slot_mapping[t]` of the
//! caches; a negative slot (`PAD_SLOT`) is a token whose K/V has no block yet. A quantized
//! cache (`Int8Code`, `Fp8E4m3Code`) gets each token's rows quantized from its own values.

use std::any::TypeId;
use std::cell::RefCell;

use super::element::Element;
use crate::error::CoreResult;

/// The new K/V of a step, `[tokens, kv_heads, head_dim]` each, and where each token's go.
pub struct NewKv<'a, E> {
    pub keys: &'a [E],
    pub values: &'a [E],
    pub slot_mapping: &'a [i32],
}

/// Writes `new` into the caches (`[slots, kv_heads, row]`, a row `C::row_len(head_dim)`
/// elements). Checks every slot before it writes any.
pub fn write_slots<E: Element, C: Element>(
    new: &NewKv<'_, E>,
    key_cache: &mut [C],
    value_cache: &mut [C],
    (kv_heads, head_dim): (usize, usize),
) -> CoreResult<()> {
    let tokens = new.slot_mapping.len();
    let per_token = kv_heads * head_dim;
    ensure!(
        per_token > 0
            && new.keys.len() == tokens * per_token
            && new.values.len() == tokens * per_token,
        "the new keys and values hold {} and {} elements; {tokens} tokens of {per_token} need {}",
        new.keys.len(),
        new.values.len(),
        tokens * per_token
    );
    let row = C::row_len(head_dim);
    let slot_len = kv_heads * row;
    ensure!(
        key_cache.len() == value_cache.len() && key_cache.len().is_multiple_of(slot_len),
        "the key and value caches hold {} and {} elements, not whole slots of {slot_len}",
        key_cache.len(),
        value_cache.len()
    );
    let slots = key_cache.len() / slot_len;
    if let Some((token, &slot)) = new
        .slot_mapping
        .iter()
        .enumerate()
        .find(|(_, &slot)| slot >= 0 && slot as usize >= slots)
    {
        return Err(invalid!(
            "slot_mapping[{token}] = {slot} is beyond the cache's {slots} slots"
        ));
    }
    if TypeId::of::<E>() == TypeId::of::<C>() {
        // Safety: `E` and `C` are the same type.
        let (keys, values) =
            unsafe { (same_type::<E, C>(new.keys), same_type::<E, C>(new.values)) };
        for (token, &slot) in new.slot_mapping.iter().enumerate() {
            if slot >= 0 {
                let (from, to) = (token * per_token, slot as usize * slot_len);
                key_cache[to..to + slot_len].copy_from_slice(&keys[from..from + per_token]);
                value_cache[to..to + slot_len].copy_from_slice(&values[from..from + per_token]);
            }
        }
        return Ok(());
    }
    ROW.with(|buffer| {
        let mut buffer = buffer.borrow_mut();
        buffer.resize(head_dim, 0.0);
        for (token, &slot) in new.slot_mapping.iter().enumerate() {
            if slot < 0 {
                continue;
            }
            for head in 0..kv_heads {
                let from = token * per_token + head * head_dim;
                let to = slot as usize * slot_len + head * row;
                for (source, cache) in
                    [(new.keys, &mut *key_cache), (new.values, &mut *value_cache)]
                {
                    E::load(&source[from..from + head_dim], &mut buffer);
                    C::store(&buffer, &mut cache[to..to + row]);
                }
            }
        }
    });
    Ok(())
}

thread_local! {
    /// One row in f32, between the model's dtype and a quantized cache's.
    static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `slice` as the same type under its other name.
///
/// # Safety
/// `E` and `C` are one type.
unsafe fn same_type<E, C>(slice: &[E]) -> &[C] {
    std::slice::from_raw_parts(slice.as_ptr().cast::<C>(), slice.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::element::{Fp8E4m3Code, Int8Code};
    use crate::quant::KvCacheDtype;
    use half::bf16;

    #[test]
    fn a_quantized_cache_gets_each_tokens_rows_from_its_own_values() {
        let (kv_heads, head_dim) = (2, 5);
        let keys: Vec<f32> = (0..3 * kv_heads * head_dim)
            .map(|i| i as f32 * 0.37 - 4.0)
            .collect();
        let values: Vec<f32> = keys.iter().map(|k| k * -2.5 + 1.0).collect();
        let halves = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        let (keys16, values16) = (halves(&keys), halves(&values));
        let new = NewKv {
            keys: &keys16,
            values: &values16,
            slot_mapping: &[3, -1, 0],
        };
        let row = head_dim + 4;
        let mut key_cache = vec![Int8Code(0xAA); 4 * kv_heads * row];
        let mut value_cache = key_cache.clone();
        write_slots(&new, &mut key_cache, &mut value_cache, (kv_heads, head_dim)).unwrap();
        for (token, slot) in [(0usize, 3usize), (2, 0)] {
            for head in 0..kv_heads {
                let from = (token * kv_heads + head) * head_dim;
                let at = (slot * kv_heads + head) * row;
                let exact: Vec<f32> = keys16[from..from + head_dim]
                    .iter()
                    .map(|x| x.to_f32())
                    .collect();
                let mut expected = vec![0u8; row];
                KvCacheDtype::Int8.quantize_row(&exact, &mut expected);
                assert_eq!(Int8Code::bytes(&key_cache[at..at + row]), &expected[..]);
            }
        }
        // The padding token wrote nothing: slots 1 and 2 keep their bytes.
        let untouched = &key_cache[kv_heads * row..3 * kv_heads * row];
        assert!(untouched.iter().all(|&code| code == Int8Code(0xAA)));
    }

    #[test]
    fn a_slot_past_the_quantized_cache_is_refused_before_anything_is_written() {
        let keys = vec![1.0f32; 2 * 4];
        let new = NewKv {
            keys: &keys,
            values: &keys,
            slot_mapping: &[0, 2],
        };
        let mut key_cache = vec![Fp8E4m3Code(7); 2 * 8];
        let mut value_cache = key_cache.clone();
        let error = write_slots(&new, &mut key_cache, &mut value_cache, (1, 4)).unwrap_err();
        assert!(error.to_string().contains("beyond"), "{error}");
        assert!(key_cache.iter().all(|&code| code == Fp8E4m3Code(7)));
    }
}
