//! Drawing panels as one SVG document (the `svg` crate) and as an HTML page.
//!
//! Layout: a title line, then the panels side by side, each with its title, a byte axis
//! (shared scale: the tallest panel sets it, so heights compare directly), a time axis
//! in allocator events, the lower-bound line (green) and the panel's peak-reserved line
//! (red), and one legend below. Blocks carry `<title>` tooltips. O(rectangles).

use std::fmt::Write as _;

use stweaver_core::Bytes;
use svg::Document;
use svg::node::element::{Group, Line, Rectangle, Text, Title};

use super::{BlockClass, Panel, PixRect, pixel_rects};

/// Picture size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VizOptions {
    /// Width of the whole picture, pixels.
    pub width: u32,
    /// Height of each plot area, pixels.
    pub plot_height: u32,
}

impl Default for VizOptions {
    fn default() -> Self {
        VizOptions {
            width: 1600,
            plot_height: 560,
        }
    }
}

const FONT: &str = "DejaVu Sans, Verdana, sans-serif";
const LEFT: u32 = 84;
const GAP: u32 = 96;
const RIGHT: u32 = 24;
const TOP: u32 = 96;
const BOTTOM: u32 = 104;

pub(crate) fn colour(c: BlockClass) -> &'static str {
    match c {
        BlockClass::Persistent => "#3b6fb6",
        BlockClass::Prologue => "#49a89f",
        BlockClass::PerIteration => "#e8853d",
        BlockClass::Dynamic => "#b8479a",
    }
}
const BOX_FILL: &str = "#e4e4e4";
const BOX_STROKE: &str = "#9a9a9a";
const LB_COLOUR: &str = "#1a9850";
const PEAK_COLOUR: &str = "#d73027";

fn text(x: f64, y: f64, s: impl Into<String>, size: u32) -> Text {
    Text::new(s)
        .set("x", r(x))
        .set("y", r(y))
        .set("font-family", FONT)
        .set("font-size", size)
        .set("fill", "#222")
}

/// Rounds to 0.1 px (keeps the file small).
fn r(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

/// A "nice" step (1, 2 or 5 × 10^k) giving at most `max_ticks` ticks over `span`.
fn nice_step(span: f64, max_ticks: f64) -> f64 {
    let raw = (span / max_ticks).max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * mag >= raw {
            return m * mag;
        }
    }
    10.0 * mag
}

/// Byte-axis ticks: a nice step in GiB (or MiB for small pictures).
fn byte_ticks(y_max: u64) -> (Vec<u64>, &'static str, u64) {
    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    let (unit, name) = if y_max >= 2 * GIB {
        (GIB, "GiB")
    } else if y_max >= 2 * MIB {
        (MIB, "MiB")
    } else {
        (1024, "KiB")
    };
    let step_units = nice_step(y_max as f64 / unit as f64, 7.0);
    let step = ((step_units * unit as f64) as u64).max(1);
    let ticks = (0..)
        .map(|i| i * step)
        .take_while(|&v| v <= y_max)
        .collect();
    (ticks, name, unit)
}

fn fmt_units(v: u64, unit: u64) -> String {
    let x = v as f64 / unit as f64;
    if (x - x.round()).abs() < 1e-9 {
        format!("{}", x.round() as u64)
    } else {
        format!("{x:.1}")
    }
}

fn tooltip(p: &PixRect) -> String {
    let Some(b) = p.block else {
        return String::new();
    };
    let mut s = format!(
        "{}: {} block ({} requested), events {}..{} ({} events), {}",
        b.alloc,
        Bytes(b.size),
        b.requested,
        b.t0,
        b.t1,
        b.t1 - b.t0,
        b.class.name()
    );
    if p.count > 1 {
        let _ = write!(s, "; {} blocks drawn here", p.count);
    }
    s
}

fn hline(x0: f64, x1: f64, y: f64, colour: &str) -> Line {
    Line::new()
        .set("x1", r(x0))
        .set("x2", r(x1))
        .set("y1", r(y))
        .set("y2", r(y))
        .set("stroke", colour)
        .set("stroke-width", 1.5)
        .set("stroke-dasharray", "6 4")
}

/// Draws `panels` side by side. `title` heads the picture; `lower_bound` is drawn in
/// every panel.
pub fn render_svg(panels: &[Panel], title: &str, lower_bound: Bytes, opts: &VizOptions) -> String {
    let n = panels.len().max(1) as u32;
    let plot_w = (opts.width.saturating_sub(LEFT + RIGHT + GAP * (n - 1))) / n;
    let plot_w = plot_w.max(50);
    let plot_h = opts.plot_height.max(50);
    let width = LEFT + RIGHT + GAP * (n - 1) + plot_w * n;
    let height = TOP + plot_h + BOTTOM;
    let y_max = panels
        .iter()
        .map(Panel::extent)
        .max()
        .unwrap_or(1)
        .max(lower_bound.get())
        .max(1);
    // 4 % headroom so the top line is not on the border.
    let y_max = y_max + y_max / 25;

    let mut doc = Document::new()
        .set("xmlns", "http://www.w3.org/2000/svg")
        .set("width", width)
        .set("height", height)
        .set("viewBox", (0, 0, width, height))
        .add(
            Rectangle::new()
                .set("width", width)
                .set("height", height)
                .set("fill", "white"),
        )
        .add(text(f64::from(LEFT), 30.0, title, 20).set("font-weight", "bold"));

    let (ticks, unit_name, unit) = byte_ticks(y_max);
    for (k, panel) in panels.iter().enumerate() {
        let ox = f64::from(LEFT + k as u32 * (plot_w + GAP));
        let oy = f64::from(TOP);
        let (pw, ph) = (f64::from(plot_w), f64::from(plot_h));
        let ty = ph / y_max as f64;
        let tx = pw / panel.events.max(1) as f64;
        let mut g = Group::new();
        g = g.add(text(ox, oy - 38.0, panel.title.clone(), 16).set("font-weight", "bold"));
        g = g.add(text(ox, oy - 16.0, panel.subtitle.clone(), 13));
        // Plot frame.
        g = g.add(
            Rectangle::new()
                .set("x", r(ox))
                .set("y", r(oy))
                .set("width", plot_w)
                .set("height", plot_h)
                .set("fill", "#fafafa")
                .set("stroke", "#555")
                .set("stroke-width", 1),
        );
        // Held memory.
        let mut boxes = Group::new()
            .set("fill", BOX_FILL)
            .set("stroke", BOX_STROKE)
            .set("stroke-width", 0.6);
        for b in &panel.boxes {
            let x0 = b.t0 as f64 * tx;
            let x1 = (b.t1 as f64 * tx).max(x0 + 0.5);
            let top = ph - (b.y + b.size) as f64 * ty;
            boxes = boxes.add(
                Rectangle::new()
                    .set("x", r(ox + x0))
                    .set("y", r(oy + top))
                    .set("width", r(x1 - x0))
                    .set("height", r((b.size as f64 * ty).max(0.3))),
            );
        }
        g = g.add(boxes);
        // Blocks.
        let rects = pixel_rects(panel, plot_w, plot_h, y_max);
        for class in BlockClass::ALL {
            let mut cg = Group::new()
                .set("fill", colour(class))
                .set("class", "blocks");
            for p in rects.iter().filter(|p| p.class == class) {
                let mut rect = Rectangle::new()
                    .set("x", r(ox + p.x))
                    .set("y", r(oy + p.y))
                    .set("width", r(p.w))
                    .set("height", r(p.h));
                if p.block.is_some() {
                    rect = rect
                        .set("stroke", "#00000040")
                        .set("stroke-width", 0.4)
                        .add(Title::new(tooltip(p)));
                }
                cg = cg.add(rect);
            }
            g = g.add(cg);
        }
        // Lower bound and peak reserved.
        let lb_y = oy + ph - lower_bound.get() as f64 * ty;
        let pk_y = oy + ph - panel.reserved.get() as f64 * ty;
        g = g.add(hline(ox, ox + pw, lb_y, LB_COLOUR));
        g = g.add(hline(ox, ox + pw, pk_y, PEAK_COLOUR));
        // Peak label on the right, lower-bound label on the left: they never collide,
        // however close the two lines are.
        g = g.add(
            text(
                ox + pw - 6.0,
                pk_y - 4.0,
                format!("peak reserved {}", panel.reserved),
                12,
            )
            .set("text-anchor", "end")
            .set("fill", PEAK_COLOUR),
        );
        g = g.add(
            text(
                ox + 6.0,
                lb_y - 4.0,
                format!("lower bound {lower_bound}"),
                12,
            )
            .set("fill", LB_COLOUR),
        );
        // Byte axis.
        for &v in &ticks {
            let y = oy + ph - v as f64 * ty;
            g = g.add(
                Line::new()
                    .set("x1", r(ox - 5.0))
                    .set("x2", r(ox))
                    .set("y1", r(y))
                    .set("y2", r(y))
                    .set("stroke", "#555"),
            );
            g = g.add(
                text(
                    ox - 8.0,
                    y + 4.0,
                    format!("{} {unit_name}", fmt_units(v, unit)),
                    12,
                )
                .set("text-anchor", "end"),
            );
        }
        // Time axis.
        let step = nice_step(panel.events.max(1) as f64, 6.0).max(1.0);
        let mut t = 0.0;
        while t <= panel.events as f64 {
            let x = ox + t * tx;
            g = g.add(
                Line::new()
                    .set("x1", r(x))
                    .set("x2", r(x))
                    .set("y1", r(oy + ph))
                    .set("y2", r(oy + ph + 5.0))
                    .set("stroke", "#555"),
            );
            g = g.add(
                text(x, oy + ph + 19.0, format!("{}", t as u64), 12).set("text-anchor", "middle"),
            );
            t += step;
        }
        g = g.add(
            text(ox + pw / 2.0, oy + ph + 40.0, "time (allocator events)", 13)
                .set("text-anchor", "middle"),
        );
        doc = doc.add(g);
    }

    // Legend.
    let ly = f64::from(TOP + plot_h) + 72.0;
    let mut lx = f64::from(LEFT);
    let mut legend = Group::new();
    let mut item = |legend: Group, fill: &str, stroke: &str, label: String| {
        let g = legend
            .add(
                Rectangle::new()
                    .set("x", r(lx))
                    .set("y", r(ly - 11.0))
                    .set("width", 22)
                    .set("height", 13)
                    .set("fill", fill)
                    .set("stroke", stroke),
            )
            .add(text(lx + 28.0, ly, label.clone(), 13));
        lx += 50.0 + 7.2 * label.chars().count() as f64;
        g
    };
    for c in BlockClass::ALL {
        legend = item(legend, colour(c), "none", c.name().to_string());
    }
    let mut names: Vec<&str> = panels.iter().map(|p| p.box_name.as_str()).collect();
    names.dedup();
    for name in names {
        legend = item(legend, BOX_FILL, BOX_STROKE, name.to_string());
    }
    for (colour, label) in [
        (LB_COLOUR, "lower bound (peak live bytes)"),
        (PEAK_COLOUR, "peak reserved"),
    ] {
        legend =
            legend
                .add(hline(lx, lx + 26.0, ly - 4.0, colour))
                .add(text(lx + 32.0, ly, label, 13));
        lx += 54.0 + 7.2 * label.len() as f64;
    }
    doc = doc.add(legend);
    doc.to_string()
}

/// An HTML page around an SVG picture, with `lines` of text under the heading.
pub fn render_html(svg: &str, title: &str, lines: &[String]) -> String {
    let esc = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    };
    let mut out = String::with_capacity(svg.len() + 2048);
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{}</title>\n\
         <style>body{{font-family:'DejaVu Sans',Verdana,sans-serif;margin:24px;color:#222}}\
         pre{{font-size:13px;background:#f6f6f6;padding:12px;display:inline-block}}\
         .blocks rect:hover{{stroke:#000;stroke-width:1.5}}</style>\n</head>\n<body>\n<h2>{}</h2>\n<pre>",
        esc(title),
        esc(title)
    );
    for l in lines {
        out.push_str(&esc(l));
        out.push('\n');
    }
    out.push_str("</pre>\n<p>Hover a block for its size and lifetime.</p>\n");
    out.push_str(svg);
    out.push_str("\n</body>\n</html>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::viz::{VizBlock, VizBox};
    use stweaver_core::AllocId;

    fn panel(reserved: u64) -> Panel {
        Panel {
            title: "A <panel>".into(),
            subtitle: "sub".into(),
            box_name: "segment".into(),
            events: 100,
            blocks: vec![VizBlock {
                alloc: AllocId(7),
                t0: 10,
                t1: 60,
                y: 0,
                size: 3 << 30,
                requested: Bytes(3 << 30),
                class: BlockClass::PerIteration,
            }],
            boxes: vec![VizBox {
                t0: 0,
                t1: 100,
                y: 0,
                size: reserved,
            }],
            reserved: Bytes(reserved),
        }
    }

    #[test]
    fn svg_has_panels_axes_tooltips_and_lines() {
        let svg = render_svg(
            &[panel(4 << 30), panel(3 << 30)],
            "title & more",
            Bytes(3 << 30),
            &VizOptions::default(),
        );
        assert!(svg.starts_with("<svg"), "{}", &svg[..100]);
        assert_eq!(svg.matches("A &lt;panel&gt;").count(), 2);
        assert!(svg.contains("title &amp; more"));
        assert!(svg.contains(
            "a7: 3.00 GiB block (3.00 GiB requested), events 10..60 (50 events), per-iteration"
        ));
        assert!(svg.contains("peak reserved 4.00 GiB"));
        assert!(svg.contains("lower bound 3.00 GiB"));
        assert!(svg.contains("\n4 GiB\n"), "byte ticks");
        assert!(svg.contains("\n60\n"), "time ticks: 0, 20, .., 100");
        assert!(svg.contains("time (allocator events)"));
        let html = render_html(&svg, "t <x>", &["row 1".into()]);
        assert!(html.contains("<title>t &lt;x&gt;</title>"));
        assert!(html.contains(&svg));
    }

    #[test]
    fn nice_steps_and_ticks() {
        assert_eq!(nice_step(10.0, 5.0), 2.0);
        assert_eq!(nice_step(62000.0, 6.0), 20000.0);
        let (t, name, _) = byte_ticks(11 << 30);
        assert_eq!(name, "GiB");
        assert_eq!(t.len(), 6); // 0, 2, .., 10
        let (t, name, _) = byte_ticks(3 << 20);
        assert_eq!((name, t.len()), ("MiB", 7)); // 0, 0.5, .., 3
    }
}
