//! A job's result rows and the JSON lines sinks write them as: `{"key":"key-7","value":42}` or,
//! windowed, `{"key":7,"window":{"start":0,"end":10000},"value":42}` (string keys as JSON strings,
//! long and int keys as numbers). The keyed operator formats rows straight into lines
//! ([`format_json_row`]); the sinks carry the lines.

use super::record::{KeyRef, RecordKey};

/// A tumbling window `[start, end)` in event-time ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Window {
    /// Inclusive start.
    pub start: i64,
    /// Exclusive end.
    pub end: i64,
}

/// One result: a key's value, over all time or for one window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultRow {
    /// The key.
    pub key: RecordKey,
    /// The window, if the job is windowed.
    pub window: Option<Window>,
    /// The aggregate.
    pub value: i64,
}

/// Appends a result as one JSON line (with the trailing newline).
pub fn format_json_line(row: &ResultRow, out: &mut Vec<u8>) {
    format_json_row(&row.key, row.window, row.value, out);
}

/// Appends one result, given by its parts, as one JSON line (with the trailing newline): the
/// same bytes as [`format_json_line`], without building a [`ResultRow`]. Numbers are formatted
/// without `fmt`, and a string key that needs no escaping is copied as is.
#[inline]
pub fn format_json_row(key: &RecordKey, window: Option<Window>, value: i64, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{\"key\":");
    put_key(out, key);
    if let Some(w) = window {
        out.extend_from_slice(b",\"window\":{\"start\":");
        put_i64(out, w.start);
        out.extend_from_slice(b",\"end\":");
        put_i64(out, w.end);
        out.push(b'}');
    }
    out.extend_from_slice(b",\"value\":");
    put_i64(out, value);
    out.extend_from_slice(b"}\n");
}

/// Appends a source record as the JSON object a program reads from the generator (no line
/// end): `{"key":...,"value":...,"ts":...}`, the key a string or a number as its type is.
#[inline]
pub fn format_record_json(key: &RecordKey, value: i64, ts: i64, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{\"key\":");
    put_key(out, key);
    out.extend_from_slice(b",\"value\":");
    put_i64(out, value);
    out.extend_from_slice(b",\"ts\":");
    put_i64(out, ts);
    out.push(b'}');
}

/// A key as JSON: a string, or a number for long and int keys.
#[inline]
fn put_key(out: &mut Vec<u8>, key: &RecordKey) {
    match key.view() {
        KeyRef::Long(v) => put_i64(out, v),
        KeyRef::Int(v) => put_i64(out, i64::from(v)),
        KeyRef::Str(s) => put_json_str(out, s),
    }
}

/// A JSON string: copied between quotes when nothing in it needs escaping (no `"`, `\\` or
/// control character; what `serde_json` escapes), else written by `serde_json`.
#[inline]
fn put_json_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // Writing JSON into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, s);
    }
}

/// A decimal integer, as `{v}` formats it.
#[inline]
fn put_i64(out: &mut Vec<u8>, v: i64) {
    let mut buf = [0u8; 20];
    let mut n = v.unsigned_abs();
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    if v < 0 {
        out.push(b'-');
    }
    out.extend_from_slice(&buf[i..]);
}

/// The log sink: formats results for the worker's log.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogSink;

impl LogSink {
    /// A result as one JSON line without the newline.
    pub fn format(row: &ResultRow) -> String {
        let mut out = Vec::with_capacity(64);
        format_json_line(row, &mut out);
        out.pop();
        String::from_utf8_lossy(&out).into_owned()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A result over all time.
    pub(crate) fn row(key: RecordKey, value: i64) -> ResultRow {
        ResultRow {
            key,
            window: None,
            value,
        }
    }

    #[test]
    fn json_lines() {
        assert_eq!(
            LogSink::format(&row(RecordKey::string("a\"b"), 3)),
            r#"{"key":"a\"b","value":3}"#
        );
        let w = ResultRow {
            key: RecordKey::long(-7),
            window: Some(Window { start: 0, end: 10 }),
            value: 1,
        };
        let line = LogSink::format(&w);
        assert_eq!(
            line,
            r#"{"key":-7,"window":{"start":0,"end":10},"value":1}"#
        );
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["window"]["end"], 10);
    }

    /// The reference the fast formatter must match byte for byte: `serde_json` for the key,
    /// `fmt` for the numbers.
    fn reference_line(key: &RecordKey, window: Option<Window>, value: i64) -> Vec<u8> {
        use std::io::Write;
        let mut out = b"{\"key\":".to_vec();
        match key.view() {
            KeyRef::Long(v) => write!(out, "{v}").unwrap(),
            KeyRef::Int(v) => write!(out, "{v}").unwrap(),
            KeyRef::Str(s) => serde_json::to_writer(&mut out, s).unwrap(),
        }
        if let Some(w) = window {
            write!(
                out,
                ",\"window\":{{\"start\":{},\"end\":{}}}",
                w.start, w.end
            )
            .unwrap();
        }
        writeln!(out, ",\"value\":{value}}}").unwrap();
        out
    }

    proptest::proptest! {
        #[test]
        fn fast_lines_match_the_reference(
            text in "\\PC{0,12}|[\\x00-\\x7f]{0,12}|[a-z\"\\\\\\n\\t\\x01\\x1f\\x7fé€😀]{0,8}",
            long in proptest::prelude::any::<i64>(),
            int in proptest::prelude::any::<i32>(),
            value in proptest::prelude::any::<i64>(),
            start in proptest::prelude::any::<i64>(),
            end in proptest::prelude::any::<i64>(),
            windowed in proptest::prelude::any::<bool>(),
        ) {
            let window = windowed.then_some(Window { start, end });
            for key in [RecordKey::string(text.as_str()), RecordKey::long(long), RecordKey::int(int)] {
                let mut fast = Vec::new();
                format_json_row(&key, window, value, &mut fast);
                proptest::prop_assert_eq!(&fast, &reference_line(&key, window, value));
                let line: serde_json::Value = serde_json::from_slice(&fast).unwrap();
                proptest::prop_assert_eq!(&line["value"], &serde_json::json!(value));
            }
        }
    }

    #[test]
    fn number_edges() {
        for v in [
            0,
            1,
            -1,
            9,
            10,
            -10,
            i64::MAX,
            i64::MIN,
            i64::from(i32::MIN),
        ] {
            let mut out = Vec::new();
            put_i64(&mut out, v);
            assert_eq!(out, v.to_string().into_bytes());
        }
    }
}
