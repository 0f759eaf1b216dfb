//! Writing a step's new K/V into their slots (ATB's ReshapeAndCache, vLLM's
//! `reshape_and_cache`): token `t`'s keys and values go to slot `slot_mapping[t]` of the
//! caches; a negative slot (`PAD_SLOT`) is a token whose K/V has no block yet.

use super::element::Element;
use crate::error::CoreResult;

/// The new K/V of a step, `[tokens, kv_heads, head_dim]` each, and where each token's go.
pub struct NewKv<'a, E> {
    pub keys: &'a [E],
    pub values: &'a [E],
    pub slot_mapping: &'a [i32],
}

/// Writes `new` into the caches (`[slots, kv_heads, head_dim]`): `row` elements per token.
/// Checks every slot before it writes any.
pub fn write_slots<E: Element>(
    new: &NewKv<'_, E>,
    key_cache: &mut [E],
    value_cache: &mut [E],
    row: usize,
) -> CoreResult<()> {
    let tokens = new.slot_mapping.len();
    ensure!(
        row > 0 && new.keys.len() == tokens * row && new.values.len() == tokens * row,
        "the new keys and values hold {} and {} elements; {tokens} tokens of {row} need {}",
        new.keys.len(),
        new.values.len(),
        tokens * row
    );
    ensure!(
        key_cache.len() == value_cache.len() && key_cache.len().is_multiple_of(row),
        "the key and value caches hold {} and {} elements, not whole slots of {row}",
        key_cache.len(),
        value_cache.len()
    );
    let slots = key_cache.len() / row;
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
    for (token, &slot) in new.slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let (from, to) = (token * row, slot as usize * row);
        key_cache[to..to + row].copy_from_slice(&new.keys[from..from + row]);
        value_cache[to..to + row].copy_from_slice(&new.values[from..from + row]);
    }
    Ok(())
}
