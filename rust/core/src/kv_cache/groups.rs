//! KV-cache groups: layers of one attention kind share a block list per sequence.
//!
//! A hybrid model (Gemma 3, gpt-oss, Mistral with a window, Llama 4) mixes full-attention
//! layers with sliding-window or chunked-local ones. A sliding-window layer reads only the last
//! `window` tokens, so keeping every block for it wastes most of its memory at long context.
//! Layers are therefore split into groups of one kind and equal size (vLLM's uniform page size):
//! every group's blocks have the same bytes, so all groups draw from one block pool (ATB's
//! one-pool strategy) and memory flows to whichever group needs it. A block of group `g` holds
//! the K/V of `layers_per_block` layers; layer `l` lives in "slot" `slot_of(l)` of its group's
//! blocks, so the backing keeps `layers_per_block` tensors and layers in the same slot of
//! different groups share one (a block belongs to one group at a time).
//!
//! A sequence has one block list per group, all of the same length. A group that no longer
//! needs a block (every position in it is outside the window of every token still to be
//! computed) releases it and the null block stands in its slot, as vLLM does.

use crate::error::CoreResult;

/// What the layers of a group attend to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Every earlier position.
    Full,
    /// The last `window` positions, itself included (transformers' `sliding_window`).
    SlidingWindow { window: usize },
    /// The positions of its own chunk of `chunk` tokens (Llama 4's `attention_chunk_size`).
    ChunkedLocal { chunk: usize },
}

impl AttentionKind {
    pub fn check(self) -> CoreResult<Self> {
        match self {
            AttentionKind::SlidingWindow { window: 0 } => {
                Err(invalid!("sliding_window must be at least 1, got 0"))
            }
            AttentionKind::ChunkedLocal { chunk: 0 } => {
                Err(invalid!("attention_chunk_size must be at least 1, got 0"))
            }
            kind => Ok(kind),
        }
    }

    /// transformers' name for the kind.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Full => "full_attention",
            AttentionKind::SlidingWindow { .. } => "sliding_attention",
            AttentionKind::ChunkedLocal { .. } => "chunked_attention",
        }
    }

    /// The window (sliding) or chunk (chunked) in tokens; `None` for full attention.
    pub fn span(self) -> Option<usize> {
        match self {
            AttentionKind::Full => None,
            AttentionKind::SlidingWindow { window } => Some(window),
            AttentionKind::ChunkedLocal { chunk } => Some(chunk),
        }
    }

    /// The earliest position a query at `position` attends to.
    #[inline]
    pub fn first_attended(self, position: usize) -> usize {
        match self {
            AttentionKind::Full => 0,
            AttentionKind::SlidingWindow { window } => (position + 1).saturating_sub(window),
            AttentionKind::ChunkedLocal { chunk } => position / chunk * chunk,
        }
    }

    /// Blocks before this index are read by no query at `position` or later.
    #[inline]
    pub fn first_needed_block(self, position: usize, block_size: usize) -> usize {
        self.first_attended(position) / block_size
    }
}

/// What a layer keeps per sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// K/V per token, attended as the kind says.
    Attention(AttentionKind),
    /// One state of `state_bytes` bytes, whatever the length (a Mamba or gated delta-net
    /// layer: transformers' `"linear_attention"`).
    Recurrent { state_bytes: usize },
}

impl From<AttentionKind> for LayerKind {
    fn from(kind: AttentionKind) -> Self {
        LayerKind::Attention(kind)
    }
}

impl LayerKind {
    fn check(self) -> CoreResult<Self> {
        match self {
            LayerKind::Attention(kind) => Ok(LayerKind::Attention(kind.check()?)),
            LayerKind::Recurrent { state_bytes: 0 } => {
                Err(invalid!("state_bytes must be at least 1, got 0"))
            }
            recurrent => Ok(recurrent),
        }
    }
}

/// transformers' name for a recurrent layer (Qwen3-Next's gated delta-net, Granite 4.0-H's
/// Mamba 2, ...).
pub const RECURRENT_LAYER_TYPE: &str = "linear_attention";

/// The kind of each of `num_layers` layers from a transformers config: `layer_types` names
/// each layer (`"full_attention"`, `"sliding_attention"`, `"chunked_attention"`,
/// `"linear_attention"`); without it, every layer slides when `sliding_window` is set
/// (Mistral) and attends fully otherwise. Recurrent layers keep `state_bytes` each.
pub fn layer_kinds(
    num_layers: usize,
    layer_types: Option<&[String]>,
    sliding_window: Option<usize>,
    attention_chunk_size: Option<usize>,
    state_bytes: Option<usize>,
) -> CoreResult<Vec<LayerKind>> {
    let Some(layer_types) = layer_types else {
        ensure!(
            state_bytes.is_none(),
            "state_bytes is for recurrent layers: name them in layer_types"
        );
        let kind = match sliding_window {
            Some(window) => AttentionKind::SlidingWindow { window },
            None => AttentionKind::Full,
        };
        return Ok(vec![LayerKind::Attention(kind.check()?); num_layers]);
    };
    ensure!(
        layer_types.len() == num_layers,
        "layer_types names {} layers; num_layers = {num_layers}",
        layer_types.len()
    );
    let kinds = layer_types
        .iter()
        .map(|name| {
            let kind = match (name.as_str(), sliding_window, attention_chunk_size) {
                ("full_attention", _, _) => AttentionKind::Full,
                ("sliding_attention", Some(window), _) => AttentionKind::SlidingWindow { window },
                ("chunked_attention", _, Some(chunk)) => AttentionKind::ChunkedLocal { chunk },
                (RECURRENT_LAYER_TYPE, _, _) => {
                    let Some(state_bytes) = state_bytes else {
                        return Err(invalid!(
                            "layer_types has linear_attention (recurrent) layers: state_bytes \
                             (the bytes of one layer's state) is required"
                        ));
                    };
                    return LayerKind::Recurrent { state_bytes }.check();
                }
                ("sliding_attention", None, _) => {
                    return Err(invalid!(
                        "layer_types has sliding_attention layers: sliding_window is required"
                    ))
                }
                ("chunked_attention", _, None) => {
                    return Err(invalid!(
                        "layer_types has chunked_attention layers: attention_chunk_size is \
                         required"
                    ))
                }
                (other, _, _) => {
                    return Err(invalid!(
                        "unknown layer type {other:?}: expected full_attention, \
                         sliding_attention, chunked_attention or linear_attention"
                    ))
                }
            };
            LayerKind::Attention(kind).check()
        })
        .collect::<CoreResult<Vec<_>>>()?;
    ensure!(
        state_bytes.is_none()
            || kinds
                .iter()
                .any(|k| matches!(k, LayerKind::Recurrent { .. })),
        "state_bytes is for recurrent layers, and layer_types names none (linear_attention)"
    );
    Ok(kinds)
}

/// One group: its kind, the model layers in it, and the slot each uses in a block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheGroup {
    pub kind: AttentionKind,
    /// Model layer indices, ascending; layer `layers[i]` uses slot `i` of the group's blocks.
    pub layers: Vec<usize>,
}

/// Layers split into groups of one kind: attention groups, whose blocks hold K/V per
/// token, and recurrent groups, whose blocks hold one state per sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerGroups {
    pub attention: Vec<KvCacheGroup>,
    /// (bytes of one layer's state, the group's layers).
    pub recurrent: Vec<(usize, Vec<usize>)>,
    pub layers_per_block: usize,
}

/// Splits attention layers (given by kind, in model order) into groups; see
/// [`group_hybrid_layers`].
pub fn group_layers(kinds: &[AttentionKind]) -> CoreResult<(Vec<KvCacheGroup>, usize)> {
    let kinds: Vec<LayerKind> = kinds.iter().map(|&kind| kind.into()).collect();
    let groups = group_hybrid_layers(&kinds)?;
    Ok((groups.attention, groups.layers_per_block))
}

/// Splits layers (given by kind, in model order) into groups of one kind and at most
/// `layers_per_block` layers, ordered by their first layer: the largest size, up to the
/// smallest kind's layer count, whose padding (slots of a kind's last, partly filled group)
/// wastes at most a tenth of the slots. Fewer, larger groups keep per-step work down; the
/// bound keeps the memory they waste small.
pub fn group_hybrid_layers(kinds: &[LayerKind]) -> CoreResult<LayerGroups> {
    ensure!(
        !kinds.is_empty(),
        "layer_types must name at least one layer"
    );
    let mut by_kind: Vec<(LayerKind, Vec<usize>)> = Vec::new();
    for (layer, &kind) in kinds.iter().enumerate() {
        let kind = kind.check()?;
        match by_kind.iter_mut().find(|(known, _)| *known == kind) {
            Some((_, layers)) => layers.push(layer),
            None => by_kind.push((kind, vec![layer])),
        }
    }
    ensure!(
        by_kind
            .iter()
            .any(|(kind, _)| matches!(kind, LayerKind::Attention(_))),
        "every layer is recurrent: there is no K/V to page (at least one attention layer is \
         needed)"
    );
    let smallest = by_kind.iter().map(|(_, layers)| layers.len()).min();
    let padded = |size: usize| -> usize {
        by_kind
            .iter()
            .map(|(_, layers)| layers.len().div_ceil(size) * size)
            .sum()
    };
    let layers_per_block = (1..=smallest.unwrap_or(1))
        .rev()
        .find(|&size| (padded(size) - kinds.len()) * 10 <= padded(size))
        .unwrap_or(1);
    let mut groups: Vec<(LayerKind, Vec<usize>)> = by_kind
        .iter()
        .flat_map(|(kind, layers)| {
            layers
                .chunks(layers_per_block)
                .map(|chunk| (*kind, chunk.to_vec()))
        })
        .collect();
    groups.sort_by_key(|(_, layers)| layers[0]);
    let mut split = LayerGroups {
        attention: Vec::new(),
        recurrent: Vec::new(),
        layers_per_block,
    };
    for (kind, layers) in groups {
        match kind {
            LayerKind::Attention(kind) => split.attention.push(KvCacheGroup { kind, layers }),
            LayerKind::Recurrent { state_bytes } => split.recurrent.push((state_bytes, layers)),
        }
    }
    Ok(split)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: AttentionKind = AttentionKind::Full;
    const SLIDE: AttentionKind = AttentionKind::SlidingWindow { window: 8 };

    #[test]
    fn gemma_pattern_groups_by_the_smallest_kind() {
        // 5 sliding : 1 full, 12 layers -> 10 sliding, 2 full: groups of 2 layers.
        let kinds: Vec<_> = (0..12)
            .map(|l| if l % 6 == 5 { FULL } else { SLIDE })
            .collect();
        let (groups, per_block) = group_layers(&kinds).unwrap();
        assert_eq!(per_block, 2);
        assert_eq!(groups.len(), 6);
        assert_eq!(groups[0].layers, [0, 1]);
        let full: Vec<_> = groups.iter().filter(|g| g.kind == FULL).collect();
        assert_eq!(full.len(), 1);
        assert_eq!(full[0].layers, [5, 11]);
        let mut all: Vec<usize> = groups.iter().flat_map(|g| g.layers.clone()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..12).collect::<Vec<_>>());
    }

    #[test]
    fn uneven_counts_pad_at_most_a_tenth() {
        // 22 sliding, 4 full: size 4 pads 2 of 28 slots (7%).
        let kinds: Vec<_> = (0..26)
            .map(|l| if l % 6 == 5 { FULL } else { SLIDE })
            .collect();
        let (groups, per_block) = group_layers(&kinds).unwrap();
        assert_eq!((per_block, groups.len()), (4, 7));
        assert_eq!(groups.iter().filter(|g| g.layers.len() == 2).count(), 1);
        // 3 sliding, 2 full: size 2 would pad 1 of 6 (17%): size 1.
        let kinds = [SLIDE, FULL, SLIDE, FULL, SLIDE];
        assert_eq!(group_layers(&kinds).unwrap().1, 1);
    }

    #[test]
    fn one_kind_is_one_group() {
        let (groups, per_block) = group_layers(&[FULL; 4]).unwrap();
        assert_eq!((groups.len(), per_block), (1, 4));
    }

    #[test]
    fn windows_and_chunks() {
        assert_eq!(SLIDE.first_attended(3), 0);
        assert_eq!(SLIDE.first_attended(8), 1);
        assert_eq!(SLIDE.first_needed_block(20, 4), 3);
        let chunked = AttentionKind::ChunkedLocal { chunk: 6 };
        assert_eq!(chunked.first_attended(13), 12);
        assert!(AttentionKind::SlidingWindow { window: 0 }.check().is_err());
        assert!(group_layers(&[]).is_err());
    }

    #[test]
    fn transformers_layer_types() {
        let names: Vec<String> = ["sliding_attention", "full_attention"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let kinds = layer_kinds(2, Some(&names), Some(8), None, None).unwrap();
        assert_eq!(kinds, [SLIDE.into(), FULL.into()]);
        assert!(layer_kinds(2, Some(&names), None, None, None).is_err());
        assert!(layer_kinds(3, Some(&names), Some(8), None, None).is_err());
        assert_eq!(
            layer_kinds(2, None, Some(8), None, None).unwrap(),
            [SLIDE.into(); 2]
        );
        assert_eq!(
            layer_kinds(2, None, None, Some(4), None).unwrap(),
            [FULL.into(); 2]
        );
        let odd = vec!["mamba".to_string()];
        assert!(layer_kinds(1, Some(&odd), None, None, None).is_err());
        // State sizes go with recurrent layers, and only with them.
        assert!(layer_kinds(2, Some(&names), Some(8), None, Some(64)).is_err());
        assert!(layer_kinds(2, None, None, None, Some(64)).is_err());
    }

    #[test]
    fn recurrent_layers_group_apart_from_attention() {
        let names: Vec<String> = ["linear_attention", "linear_attention", "full_attention"]
            .repeat(2)
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert!(layer_kinds(6, Some(&names), None, None, None).is_err());
        assert!(layer_kinds(6, Some(&names), None, None, Some(0)).is_err());
        let kinds = layer_kinds(6, Some(&names), None, None, Some(640)).unwrap();
        let groups = group_hybrid_layers(&kinds).unwrap();
        assert_eq!(groups.layers_per_block, 2);
        assert_eq!(groups.attention.len(), 1);
        assert_eq!(groups.attention[0].layers, [2, 5]);
        assert_eq!(groups.recurrent, [(640, vec![0, 1]), (640, vec![3, 4])]);
        let recurrent = [LayerKind::Recurrent { state_bytes: 8 }; 3];
        assert!(group_hybrid_layers(&recurrent).is_err());
    }
}
