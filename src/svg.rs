//! A small SVG writer shared by every picture the project draws (the rescale plan of
//! `keyshift plan -o svg` and the documentation pictures).
//!
//! Pure and deterministic: fixed decimals, no clock, so a committed picture can be compared
//! byte for byte with what the code draws now. Text is escaped here, attributes are written by
//! the caller as given (they are the caller's own constants and numbers).

use std::fmt::Write as _;

/// Left margin most pictures use.
pub const MARGIN: f64 = 30.0;

/// The whole document: XML declaration, `<svg>` with a white background, `<title>` (and
/// `<desc>` when not empty), `defs` (markers, patterns; may be empty) and `body`.
pub fn document(
    width: f64,
    height: f64,
    title: &str,
    desc: &str,
    defs: &str,
    body: &str,
) -> String {
    let height = height.ceil();
    let mut s = String::new();
    let _ = writeln!(s, r##"<?xml version="1.0" encoding="UTF-8"?>"##);
    let _ = writeln!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="12" fill="#222">"##
    );
    let _ = writeln!(s, "  <title>{}</title>", escape(title));
    if !desc.is_empty() {
        let _ = writeln!(s, "  <desc>{}</desc>", escape(desc));
    }
    if !defs.is_empty() {
        let _ = writeln!(s, "  <defs>{defs}</defs>");
    }
    let _ = writeln!(
        s,
        r##"  <rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>"##
    );
    s.push_str(body);
    s.push_str("</svg>\n");
    s
}

/// A picture being drawn: shapes are appended in drawing order (later ones on top).
#[derive(Debug, Clone)]
pub struct Svg {
    width: f64,
    body: String,
}

impl Svg {
    pub fn new(width: f64) -> Self {
        Svg {
            width,
            body: String::new(),
        }
    }

    /// A text element at (x, y) (the baseline), escaped.
    pub fn text(&mut self, x: f64, y: f64, text: &str, attrs: &str) {
        let _ = writeln!(
            self.body,
            r##"  <text x="{x:.2}" y="{y:.2}"{}>{}</text>"##,
            space(attrs),
            escape(text)
        );
    }

    /// A rectangle.
    pub fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, attrs: &str) {
        let _ = writeln!(
            self.body,
            r##"  <rect x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{h:.2}"{}/>"##,
            space(attrs)
        );
    }

    /// A rectangle with a tooltip (`<title>`).
    pub fn rect_titled(&mut self, x: f64, y: f64, w: f64, h: f64, attrs: &str, title: &str) {
        let _ = writeln!(
            self.body,
            r##"  <rect x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{h:.2}"{}><title>{}</title></rect>"##,
            space(attrs),
            escape(title)
        );
    }

    /// A straight line.
    pub fn line(&mut self, x1: f64, y1: f64, x2: f64, y2: f64, attrs: &str) {
        let _ = writeln!(
            self.body,
            r##"  <line x1="{x1:.2}" y1="{y1:.2}" x2="{x2:.2}" y2="{y2:.2}"{}/>"##,
            space(attrs)
        );
    }

    /// A path (`d` as given).
    pub fn path(&mut self, d: &str, attrs: &str) {
        let _ = writeln!(self.body, r##"  <path d="{d}"{}/>"##, space(attrs));
    }

    /// The document, `height` high.
    pub fn finish(self, height: f64, title: &str, defs: &str) -> String {
        document(self.width, height, title, "", defs, &self.body)
    }

    /// The document with a `<desc>`.
    pub fn finish_with_desc(self, height: f64, title: &str, desc: &str, defs: &str) -> String {
        document(self.width, height, title, desc, defs, &self.body)
    }
}

fn space(attrs: &str) -> String {
    if attrs.is_empty() {
        String::new()
    } else {
        format!(" {attrs}")
    }
}

/// An arrow head marker `id` in `colour`, for `marker-end="url(#id)"` (and `marker-start`).
pub fn arrow_marker(id: &str, colour: &str) -> String {
    format!(
        r##"<marker id="{id}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{colour}"/></marker>"##
    )
}

/// "s" unless `n` is 1.
pub fn plural(n: u32) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// Escapes text for XML character data and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_covers_markup() {
        assert_eq!(escape(r##"a<b>&"c'"##), "a&lt;b&gt;&amp;&quot;c&apos;");
    }

    #[test]
    fn a_document_has_its_title_desc_and_shapes_in_order() {
        let mut s = Svg::new(100.0);
        s.rect(1.0, 2.0, 3.0, 4.0, r##"fill="#fff""##);
        s.text(5.0, 6.0, "a < b", "");
        let doc = s.finish_with_desc(49.2, "T & t", "d", "");
        assert!(doc.contains(r#"height="50" viewBox="0 0 100 50""#), "{doc}");
        assert!(doc.contains("<title>T &amp; t</title>"), "{doc}");
        assert!(doc.contains("<desc>d</desc>"), "{doc}");
        assert!(!doc.contains("<defs>"), "{doc}");
        let rect = doc.find(r#"<rect x="1.00""#).unwrap();
        let text = doc.find(">a &lt; b</text>").unwrap();
        assert!(rect < text);
        assert!(doc.ends_with("</svg>\n"));
    }
}
