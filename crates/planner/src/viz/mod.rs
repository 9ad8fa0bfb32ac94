//! Address × time pictures of where memory goes: PyTorch's replayed allocator (its
//! segments and the blocks inside them) next to stweaver's plan, on one byte scale.
//!
//! A picture is a list of [`Panel`]s, each a set of blocks (an allocation's bytes over
//! its lifetime) and background boxes (memory held from the device: PyTorch's segments,
//! stweaver's pool). [`render_svg`] draws them side by side with axes, the lower-bound
//! and peak-reserved lines, a legend and a `<title>` tooltip per visible block (size,
//! lifetime, class); [`render_html`] wraps that SVG in a page; [`render_png`]
//! rasterises it (resvg, with the bundled DejaVu Sans font, so no system fonts).
//!
//! **Many blocks.** Real traces have 10^5 blocks, most far smaller than a pixel. Blocks
//! at least one pixel wide and tall are drawn one by one (identical pixel rectangles
//! merged); the rest are accumulated into a per-class pixel grid whose runs are emitted
//! as merged rectangles (horizontal runs, then equal runs of consecutive rows). The
//! output size is therefore bounded by the picture's pixels, not the block count.
//!
//! Cost: O(blocks + pixels) per panel.

mod raster;
mod svg;

pub use raster::{VizError, render_png};
pub use svg::{VizOptions, render_html, render_svg};

use stweaver_core::{AllocId, Bytes, Offset, Trace};

use crate::classify::{AllocClass, Classification};
use crate::replay::{ReplayLayout, ReplayStats};

/// How a block is coloured: its class in [`crate::classify`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BlockClass {
    /// Live when the steady state begins, or never freed (parameters, optimizer state).
    Persistent,
    /// Made and freed before the steady state (setup, first iteration), or recurring
    /// in a trace without one.
    Prologue,
    /// Repeats identically every steady iteration.
    PerIteration,
    /// Not planned: served online (token-dependent shapes, irregular requests).
    Dynamic,
}

impl BlockClass {
    pub const ALL: [BlockClass; 4] = [
        BlockClass::Persistent,
        BlockClass::Prologue,
        BlockClass::PerIteration,
        BlockClass::Dynamic,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BlockClass::Persistent => "persistent",
            BlockClass::Prologue => "prologue / recurring",
            BlockClass::PerIteration => "per-iteration",
            BlockClass::Dynamic => "dynamic",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// The class of every allocation (indexed by `AllocId`).
    pub fn of_all(c: &Classification) -> Vec<BlockClass> {
        c.classes
            .iter()
            .map(|k| match k {
                AllocClass::Persistent => BlockClass::Persistent,
                AllocClass::Prologue => BlockClass::Prologue,
                AllocClass::PerIteration { .. } => BlockClass::PerIteration,
                AllocClass::Dynamic(_) => BlockClass::Dynamic,
            })
            .collect()
    }
}

/// One allocation's bytes over its lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VizBlock {
    pub alloc: AllocId,
    /// Lifetime `[t0, t1)` in event indices.
    pub t0: u64,
    pub t1: u64,
    /// Lowest byte (panel coordinates) and size drawn.
    pub y: u64,
    pub size: u64,
    pub requested: Bytes,
    pub class: BlockClass,
}

/// Memory held from the device over `[t0, t1)`: `[y, y + size)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VizBox {
    pub t0: u64,
    pub t1: u64,
    pub y: u64,
    pub size: u64,
}

/// One allocator's picture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Panel {
    pub title: String,
    /// Second title line (e.g. the peak reserved).
    pub subtitle: String,
    /// Name of the background boxes in the legend ("PyTorch segment", "stweaver pool").
    pub box_name: String,
    /// Length of the time axis (events).
    pub events: u64,
    pub blocks: Vec<VizBlock>,
    pub boxes: Vec<VizBox>,
    /// Peak reserved bytes (drawn as a line).
    pub reserved: Bytes,
}

impl Panel {
    /// The highest byte drawn.
    pub fn extent(&self) -> u64 {
        let b = self.blocks.iter().map(|b| b.y + b.size).max().unwrap_or(0);
        let s = self.boxes.iter().map(|b| b.y + b.size).max().unwrap_or(0);
        b.max(s).max(self.reserved.get())
    }
}

/// The class of allocation `a` (`Dynamic` if `classes` does not cover it).
fn class_of(classes: &[BlockClass], a: AllocId) -> BlockClass {
    classes
        .get(a.index())
        .copied()
        .unwrap_or(BlockClass::Dynamic)
}

/// The PyTorch panel from a replay's layout. Segments are stacked on the byte axis in
/// the order they were created, a released segment's range being reused first-fit by
/// later ones, so the stack's height is the peak reserved when nothing is released.
/// `classes` colours the blocks (indexed by `AllocId`, [`BlockClass::of_all`]).
pub fn native_panel(
    title: &str,
    layout: &ReplayLayout,
    stats: &ReplayStats,
    classes: &[BlockClass],
) -> Panel {
    let events = u64::from(layout.events);
    // First-fit stacking of segment lifetimes: O(segments^2), segments are few.
    let mut placed: Vec<(u64, u64, u64, u64)> = Vec::with_capacity(layout.segments.len()); // (t0, t1, y, size)
    let mut seg_y = Vec::with_capacity(layout.segments.len());
    for s in &layout.segments {
        let t0 = u64::from(s.created.0);
        let t1 = s.released.map_or(events, |e| u64::from(e.0)).max(t0 + 1);
        let size = s.size.get();
        let mut busy: Vec<(u64, u64)> = placed
            .iter()
            .filter(|p| p.0 < t1 && t0 < p.1)
            .map(|p| (p.2, p.2 + p.3))
            .collect();
        busy.sort_unstable();
        let mut y = 0u64;
        for (lo, hi) in busy {
            if lo >= y + size {
                break;
            }
            y = y.max(hi);
        }
        placed.push((t0, t1, y, size));
        seg_y.push(y);
    }
    let boxes = placed
        .iter()
        .map(|&(t0, t1, y, size)| VizBox { t0, t1, y, size })
        .collect();
    let blocks = layout
        .blocks
        .iter()
        .map(|b| {
            let end = b.end.map(|e| u64::from(e.0));
            VizBlock {
                alloc: b.alloc,
                t0: u64::from(b.start.0),
                t1: end.unwrap_or(events).max(u64::from(b.start.0) + 1),
                y: seg_y[b.segment as usize] + b.offset.get(),
                size: b.size.get(),
                requested: b.requested,
                class: class_of(classes, b.alloc),
            }
        })
        .collect();
    Panel {
        title: title.to_string(),
        subtitle: format!(
            "peak reserved {}, peak allocated {}, {} segments",
            stats.peak_reserved, stats.peak_allocated, stats.segments_allocated
        ),
        box_name: "PyTorch segment (reserved, free when grey)".into(),
        events,
        blocks,
        boxes,
        reserved: stats.peak_reserved,
    }
}

/// A panel of a plan: allocation `i` at `offsets[i]` with its requested size, live over
/// its trace lifetime, inside one pool of `reserved` bytes held for the whole run.
pub fn plan_panel(
    title: &str,
    trace: &Trace,
    offsets: &[Offset],
    reserved: Bytes,
    classes: &[BlockClass],
) -> Panel {
    let events = trace.events.len() as u64;
    let blocks = trace
        .lifetimes()
        .iter()
        .zip(&trace.allocations)
        .zip(offsets)
        .enumerate()
        .map(|(i, ((l, a), off))| {
            let t0 = l.start.map_or(0, |e| u64::from(e.0));
            let end = l.end.map(|e| u64::from(e.0));
            VizBlock {
                alloc: AllocId(i as u32),
                t0,
                t1: end.unwrap_or(events).max(t0 + 1),
                y: off.get(),
                size: a.size.get(),
                requested: a.size,
                class: class_of(classes, AllocId(i as u32)),
            }
        })
        .collect();
    Panel {
        title: title.to_string(),
        subtitle: format!("pool {reserved}, mapped once"),
        box_name: "stweaver pool".into(),
        events,
        blocks,
        boxes: vec![VizBox {
            t0: 0,
            t1: events.max(1),
            y: 0,
            size: reserved.get(),
        }],
        reserved,
    }
}

/// An axis-aligned rectangle in pixels (y down), possibly standing for many blocks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PixRect {
    pub x: f64,
    pub y: f64,
    pub w: f64,
    pub h: f64,
    pub class: BlockClass,
    /// The block shown in the tooltip (`None` for merged sub-pixel blocks).
    pub block: Option<VizBlock>,
    /// How many blocks the rectangle stands for.
    pub count: u32,
}

/// Maps a panel's blocks to pixel rectangles inside a `w` × `h` plot (origin top left,
/// bytes growing upwards, `y_max` bytes at the top), merging as the module doc says.
pub(crate) fn pixel_rects(panel: &Panel, w: u32, h: u32, y_max: u64) -> Vec<PixRect> {
    let (wf, hf) = (f64::from(w), f64::from(h));
    let tx = wf / panel.events.max(1) as f64;
    let ty = hf / y_max.max(1) as f64;
    let mut out: Vec<PixRect> = Vec::new();
    let mut seen: rustc_hash::FxHashMap<(i64, i64, i64, i64, BlockClass), usize> =
        rustc_hash::FxHashMap::default();
    // Per class, one bit per pixel cell.
    let (gw, gh) = (w as usize, h as usize);
    let mut grid = vec![0u8; gw * gh];
    let mut any_small = false;
    for b in &panel.blocks {
        let x0 = b.t0 as f64 * tx;
        let x1 = b.t1 as f64 * tx;
        let top = hf - (b.y + b.size) as f64 * ty;
        let bh = b.size as f64 * ty;
        if x1 - x0 >= 1.0 && bh >= 1.0 {
            let q = |v: f64| (v * 10.0).round() as i64;
            let key = (q(x0), q(x1), q(top), q(bh), b.class);
            match seen.get(&key) {
                Some(&i) => out[i].count += 1,
                None => {
                    seen.insert(key, out.len());
                    out.push(PixRect {
                        x: x0,
                        y: top,
                        w: x1 - x0,
                        h: bh,
                        class: b.class,
                        block: Some(*b),
                        count: 1,
                    });
                }
            }
        } else {
            any_small = true;
            let cx0 = (x0.floor().max(0.0) as usize).min(gw.saturating_sub(1));
            let cx1 = (x1.ceil() as usize).clamp(cx0 + 1, gw.max(1));
            let cy0 = (top.floor().max(0.0) as usize).min(gh.saturating_sub(1));
            let cy1 = ((top + bh).ceil() as usize).clamp(cy0 + 1, gh.max(1));
            let bit = 1u8 << b.class.index();
            for row in cy0..cy1 {
                for cell in &mut grid[row * gw + cx0..row * gw + cx1] {
                    *cell |= bit;
                }
            }
        }
    }
    if any_small {
        for class in BlockClass::ALL {
            let bit = 1u8 << class.index();
            // Open rectangles: (x0, x1) -> index into out, extended row by row.
            let mut open: rustc_hash::FxHashMap<(usize, usize), usize> =
                rustc_hash::FxHashMap::default();
            for row in 0..gh {
                let mut next_open = rustc_hash::FxHashMap::default();
                let cells = &grid[row * gw..(row + 1) * gw];
                let mut x = 0;
                while x < gw {
                    if cells[x] & bit == 0 {
                        x += 1;
                        continue;
                    }
                    let start = x;
                    while x < gw && cells[x] & bit != 0 {
                        x += 1;
                    }
                    let idx = match open.get(&(start, x)) {
                        Some(&i) => {
                            out[i].h += 1.0;
                            i
                        }
                        None => {
                            out.push(PixRect {
                                x: start as f64,
                                y: row as f64,
                                w: (x - start) as f64,
                                h: 1.0,
                                class,
                                block: None,
                                count: 0,
                            });
                            out.len() - 1
                        }
                    };
                    next_open.insert((start, x), idx);
                }
                open = next_open;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::{AllocatorConfig, ReplayOptions, replay};
    use stweaver_core::testkit::TraceBuilder;

    const M: u64 = 1 << 20;

    fn trace() -> Trace {
        let mut b = TraceBuilder::new();
        b.alloc(30 * M);
        let mid = b.alloc(5 * M);
        b.alloc(512);
        b.free_completed(mid);
        b.build()
    }

    #[test]
    fn native_panel_stacks_segments_and_places_blocks() {
        let t = trace();
        let opts = ReplayOptions {
            record_layout: true,
            ..ReplayOptions::default()
        };
        let r = replay(&t, &AllocatorConfig::default(), &opts).unwrap();
        let classes = [BlockClass::Persistent, BlockClass::PerIteration];
        let p = native_panel("PyTorch", r.layout.as_ref().unwrap(), &r.stats, &classes);
        // Segments: 30 MiB, 20 MiB (5 MiB block), 2 MiB small.
        let boxes: Vec<(u64, u64)> = p.boxes.iter().map(|b| (b.y, b.size)).collect();
        assert_eq!(boxes, [(0, 30 * M), (30 * M, 20 * M), (50 * M, 2 * M)]);
        assert_eq!(p.extent(), 52 * M);
        assert_eq!(p.blocks[1].y, 30 * M);
        assert_eq!((p.blocks[1].t0, p.blocks[1].t1), (1, 3));
        assert_eq!(p.blocks[0].class, BlockClass::Persistent);
        assert_eq!(p.blocks[1].class, BlockClass::PerIteration);
        assert_eq!(
            p.blocks[2].class,
            BlockClass::Dynamic,
            "not covered by `classes`"
        );
        assert_eq!(p.blocks[0].t1, 4);
    }

    #[test]
    fn sub_pixel_blocks_are_merged_into_runs() {
        let t = trace();
        let offsets = [Offset(0), Offset(30 * M), Offset(35 * M)];
        let p = plan_panel(
            "plan",
            &t,
            &offsets,
            Bytes(36 * M),
            &[BlockClass::Prologue; 3],
        );
        // 36 pixels tall: 1 px per MiB; 4 px wide: 1 px per event.
        let rects = pixel_rects(&p, 4, 36, 36 * M);
        let big: Vec<&PixRect> = rects.iter().filter(|r| r.block.is_some()).collect();
        assert_eq!(big.len(), 2, "{rects:?}");
        assert_eq!(
            (big[0].x, big[0].y, big[0].w, big[0].h),
            (0.0, 6.0, 4.0, 30.0)
        );
        let small: Vec<&PixRect> = rects.iter().filter(|r| r.block.is_none()).collect();
        assert_eq!(small.len(), 1);
        assert_eq!((small[0].x, small[0].w, small[0].h), (2.0, 2.0, 1.0));

        // 1000 identical tiny blocks in one cell collapse into one rectangle.
        let mut p2 = p.clone();
        p2.blocks = (0..1000)
            .map(|i| VizBlock {
                alloc: AllocId(i),
                t0: 0,
                t1: 1,
                y: 0,
                size: 512,
                requested: Bytes(512),
                class: BlockClass::Dynamic,
            })
            .collect();
        assert_eq!(pixel_rects(&p2, 4, 36, 36 * M).len(), 1);
    }
}
