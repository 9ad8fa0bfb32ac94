//! PNG output: the SVG picture rasterised by `resvg`, with DejaVu Sans (bundled in
//! `assets/fonts`, Bitstream Vera licence) as the only font, so the result does not
//! depend on the machine's fonts. O(pixels + rectangles).

use resvg::{tiny_skia, usvg};

/// DejaVu Sans 2.37 (see `assets/fonts/LICENSE-DejaVu.txt`).
const DEJAVU_SANS: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

/// Why a picture could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum VizError {
    #[error("the picture is not valid SVG: {0}")]
    Svg(String),
    #[error("the picture has an empty or oversized canvas ({width} x {height})")]
    Canvas { width: u32, height: u32 },
    #[error("PNG encoding failed: {0}")]
    Png(String),
}

/// Rasterises an SVG document (as [`super::render_svg`] makes) to PNG bytes, at `scale`
/// device pixels per SVG pixel.
pub fn render_png(svg: &str, scale: f32) -> Result<Vec<u8>, VizError> {
    let mut opt = usvg::Options {
        font_family: "DejaVu Sans".to_string(),
        ..usvg::Options::default()
    };
    opt.fontdb_mut().load_font_data(DEJAVU_SANS.to_vec());
    let tree = usvg::Tree::from_str(svg, &opt).map_err(|e| VizError::Svg(e.to_string()))?;
    let size = tree.size();
    let (width, height) = (
        (size.width() * scale).ceil() as u32,
        (size.height() * scale).ceil() as u32,
    );
    let mut pixmap =
        tiny_skia::Pixmap::new(width, height).ok_or(VizError::Canvas { width, height })?;
    pixmap.fill(tiny_skia::Color::WHITE);
    resvg::render(
        &tree,
        tiny_skia::Transform::from_scale(scale, scale),
        &mut pixmap.as_mut(),
    );
    pixmap
        .encode_png()
        .map_err(|e| VizError::Png(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rasterises_with_the_bundled_font() {
        let svg = r##"<svg xmlns="http://www.w3.org/2000/svg" width="120" height="40" viewBox="0 0 120 40"><rect x="0" y="0" width="60" height="40" fill="#ff0000"/><text x="64" y="25" font-family="DejaVu Sans" font-size="14">GiB</text></svg>"##;
        let png = render_png(svg, 1.0).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let pm = tiny_skia::Pixmap::decode_png(&png).unwrap();
        assert_eq!((pm.width(), pm.height()), (120, 40));
        // The rectangle is red, and the text drew dark pixels right of it.
        let px = pm.pixel(10, 10).unwrap();
        assert_eq!((px.red(), px.green(), px.blue()), (255, 0, 0));
        let dark = (64..120)
            .flat_map(|x| (0..40).map(move |y| (x, y)))
            .filter(|&(x, y)| pm.pixel(x, y).unwrap().red() < 100)
            .count();
        assert!(dark > 20, "text was drawn ({dark} dark pixels)");
        assert!(matches!(render_png("<svg", 1.0), Err(VizError::Svg(_))));
    }
}
